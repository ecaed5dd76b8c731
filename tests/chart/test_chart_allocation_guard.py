"""The allocation guard as the chart installs it: its webhook configuration (which writes it sees,
its match conditions evaluated with CEL as kube-apiserver would), its certificate, its Service with
no selector, the leader's EndpointSlice grant, and the controller's environment."""

from __future__ import annotations

import base64
import subprocess
import uuid
from pathlib import Path
from typing import Any

import cel
import pytest
from admission_support import admission_request, service_account_user
from chart_support import NAMESPACE, RELEASE, render_chart
from test_chart_render import container, env_of, one

from driver.controller.guard import GUARD_PATH, build_endpoint_slice

GUARD = f"{RELEASE}-controller-allocation-guard"
CONTROLLER_USER = service_account_user(NAMESPACE, f"{RELEASE}-controller")
SCHEDULER_USER = {"username": "system:kube-scheduler", "groups": ["system:authenticated"]}


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return render_chart({"fakeDevices": {"enabled": True}})


def claim(*, allocated: bool, driver: str = "fractional.dev", reserved: bool = False) -> dict[str, Any]:
    status: dict[str, Any] = {}
    if allocated:
        result = {
            "request": "gpu",
            "driver": driver,
            "pool": "node-a",
            "device": "gpu-0",
            "shareID": str(uuid.uuid4()),
            "consumedCapacity": {"memory": "12Gi", "compute": "15"},
        }
        status["allocation"] = {"devices": {"results": [result]}}  # fmt: skip
    if reserved:
        status["reservedFor"] = [{"resource": "pods", "name": "p", "uid": str(uuid.uuid4())}]
    body: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "team", "uid": "u-1"}, "spec": {},
    }  # fmt: skip
    if status:
        body["status"] = status
    return body


def called(webhook: dict[str, Any], user: dict[str, Any], old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Do the match conditions send this status update to the guard? (none may error)"""
    request = admission_request(
        user=user, operation="UPDATE", group="resource.k8s.io", resource="resourceclaims",
        subresource="status", meta=new["metadata"],
    )  # fmt: skip
    activation = {"object": new, "oldObject": old, "request": request}
    results = [
        cel.compile(c["expression"]).execute(cel.Context(variables=activation))
        for c in webhook["matchConditions"]
    ]
    assert all(isinstance(r, bool) for r in results), results
    return all(results)


def test_kube_apiserver_asks_the_leader_about_status_writes_of_claims(objects: list[dict[str, Any]]) -> None:
    configuration = one(objects, "ValidatingWebhookConfiguration", "-allocation-guard")
    (webhook,) = configuration["webhooks"]
    assert webhook["clientConfig"]["service"] == {
        "namespace": NAMESPACE, "name": GUARD, "path": GUARD_PATH, "port": 443,
    }  # fmt: skip
    assert webhook["rules"] == [{
        "apiGroups": ["resource.k8s.io"], "apiVersions": ["v1"], "operations": ["UPDATE"],
        "resources": ["resourceclaims/status"], "scope": "Namespaced",
    }]  # fmt: skip
    assert webhook["matchPolicy"] == "Equivalent"  # v1beta1/v1beta2 writes reach it converted to v1
    assert webhook["sideEffects"] == "None" and webhook["admissionReviewVersions"] == ["v1"]
    assert webhook["failurePolicy"] == "Ignore" and webhook["timeoutSeconds"] == 10
    service = one(objects, "Service", "-allocation-guard")
    assert "selector" not in service["spec"], "the leader writes the endpoint, not a selector"
    assert service["spec"]["ports"] == [{"name": "https", "port": 443, "targetPort": 9443, "protocol": "TCP"}]
    endpoint = build_endpoint_slice(namespace=NAMESPACE, service=GUARD, address="10.0.0.7", port=9443,
                                    pod_name="c-0")  # fmt: skip
    assert endpoint["metadata"]["labels"]["kubernetes.io/service-name"] == GUARD
    assert endpoint["ports"][0]["name"] == service["spec"]["ports"][0]["name"]
    role = one(objects, "Role", "-allocation-guard")
    assert role["rules"][1]["resourceNames"] == [endpoint["metadata"]["name"]]


@pytest.mark.parametrize(
    ("user", "old", "new", "expected"),
    [
        (SCHEDULER_USER, claim(allocated=False), claim(allocated=True, reserved=True), True),
        (SCHEDULER_USER, claim(allocated=False), claim(allocated=True, driver="gpu.nvidia.com"), False),
        (CONTROLLER_USER, claim(allocated=False), claim(allocated=True), False),  # ours: ordered in-process
        (
            SCHEDULER_USER,
            claim(allocated=True),
            claim(allocated=True, reserved=True),
            False,
        ),  # reservation only
        (SCHEDULER_USER, claim(allocated=True, reserved=True), claim(allocated=False), False),  # deallocation
        (SCHEDULER_USER, claim(allocated=False), claim(allocated=False, reserved=True), False),
    ],
    ids=[
        "kube-scheduler allocates",
        "another driver",
        "our controller",
        "reserves",
        "deallocates",
        "no allocation",
    ],
)
def test_only_new_allocations_of_our_devices_by_someone_else_are_sent(
    objects: list[dict[str, Any]],
    user: dict[str, Any],
    old: dict[str, Any],
    new: dict[str, Any],
    expected: bool,
) -> None:
    (webhook,) = one(objects, "ValidatingWebhookConfiguration", "-allocation-guard")["webhooks"]
    assert called(webhook, user, old, new) is expected


def test_the_certificate_is_for_the_service_and_the_ca_is_the_webhooks(
    objects: list[dict[str, Any]], tmp_path: Path
) -> None:
    secret = one(objects, "Secret", "-allocation-guard-tls")
    (webhook,) = one(objects, "ValidatingWebhookConfiguration", "-allocation-guard")["webhooks"]
    assert secret["data"]["ca.crt"] == webhook["clientConfig"]["caBundle"]
    for name in ("ca.crt", "tls.crt", "tls.key"):
        (tmp_path / name).write_bytes(base64.b64decode(secret["data"][name]))
    verified = subprocess.run(
        ["openssl", "verify", "-CAfile", "ca.crt", "-verify_hostname", f"{GUARD}.{NAMESPACE}.svc", "tls.crt"],
        cwd=tmp_path, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stderr + verified.stdout


def test_the_controller_serves_it_with_that_certificate(objects: list[dict[str, Any]]) -> None:
    pod = one(objects, "Deployment", "-controller")["spec"]["template"]["spec"]
    controller = container(pod, "controller")
    env = env_of(controller)
    assert env["FRACTIONAL_ALLOCATION_GUARD_PORT"] == "9443"
    assert env["FRACTIONAL_ALLOCATION_GUARD_SERVICE"] == GUARD
    assert env["FRACTIONAL_ALLOCATION_GUARD_ADDRESS"] == ("fieldRef", "status.podIP")
    mount = next(m for m in controller["volumeMounts"] if m["name"] == "allocation-guard-tls")
    assert mount["mountPath"] == env["FRACTIONAL_ALLOCATION_GUARD_CERT_DIR"] and mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == "allocation-guard-tls")
    assert volume["secret"]["secretName"] == f"{GUARD}-tls"
    assert {p["name"]: p["containerPort"] for p in controller["ports"]}["guard"] == 9443


def test_fail_closed_can_be_chosen_and_the_guard_turned_off() -> None:
    strict = render_chart({"controller": {"allocationGuard": {"failurePolicy": "Fail", "timeoutSeconds": 5}}})
    (webhook,) = one(strict, "ValidatingWebhookConfiguration", "-allocation-guard")["webhooks"]
    assert (webhook["failurePolicy"], webhook["timeoutSeconds"]) == ("Fail", 5)
    off = render_chart({"controller": {"allocationGuard": {"enabled": False}}})
    assert not [o for o in off if "allocation-guard" in o["metadata"]["name"]]
    env = env_of(container(one(off, "Deployment", "-controller")["spec"]["template"]["spec"], "controller"))
    assert not [name for name in env if "ALLOCATION_GUARD" in name]

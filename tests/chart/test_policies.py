"""The chart's ValidatingAdmissionPolicies allow what our components write and deny the rest.

The chart is rendered with real Helm, the policies are taken from it and evaluated with
``admission_support.evaluate`` (kube-apiserver's steps, Python CEL) against requests built as
kube-apiserver builds them. Objects are shaped as the API server stores them and, for the
writes our code makes, produced by the code itself (the controller's ``ApiWriter``, the agent's
status merge functions) and then by a model of the API server's update rules for the resource
(``_server_update``), so the test notices when the code starts writing something a policy forbids.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from admission_support import Decision, admission_request, apply_merge_patch, evaluate, service_account_user
from chart_support import KUBE_VERSIONS, NAMESPACE, RELEASE, render_chart, validate_strict
from kubernetes import client

from driver.controller.model.objects import (
    FINALIZER,
    GATE,
    HINT_ANNOTATION,
    PLACED_ANNOTATION,
    PROVISIONING_ANNOTATION,
    PROVISIONING_CLASS_ANNOTATION,
    PROVISIONING_OURS_ANNOTATION,
    pod_consumer,
)
from driver.controller.writes import writer as writer_module
from driver.controller.writes.writer import ApiWriter
from driver.plugin.status import merge_device_statuses, without_driver_statuses

Obj = dict[str, Any]

NODE = "gpu-node-1"
POD_UID = "0b6f4a52-7c1e-4d55-9b8a-3f0f4f5b8e11"  # gated_pod()'s, its claim's owner
OTHER_NODE = "gpu-node-2"
DRIVER = "fractional.dev"
OTHER_DRIVER = "nic.example.com"


# -- the rendered policies ------------------------------------------------------------------------


def _policies(values: Obj | None) -> dict[str, Obj]:
    objects = render_chart(values)
    policies = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"}
    bindings = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert sorted(b["spec"]["policyName"] for b in bindings) == sorted(policies)
    for binding in bindings:
        assert binding["spec"] == {"policyName": binding["spec"]["policyName"], "validationActions": ["Deny"]}
    for policy in policies.values():
        assert policy["spec"]["failurePolicy"] == "Fail"
    return policies


@pytest.fixture(scope="module")
def rendered() -> dict[str, Obj]:
    """All policies: the agent's claim-status policy is rendered on request (agentClaimStatus=policy)."""
    return _policies({"admissionPolicy": {"agentClaimStatus": "policy"}})


@pytest.fixture(scope="module")
def accounts() -> dict[str, str]:
    return {
        o["metadata"]["labels"]["app.kubernetes.io/component"]: o["metadata"]["name"]
        for o in render_chart(None)
        if o["kind"] == "ServiceAccount"
    }


def _policy(rendered: dict[str, Obj], suffix: str) -> Obj:
    (name,) = [name for name in rendered if name.endswith(suffix)]
    return rendered[name]


def test_which_policies_render_for_which_version() -> None:
    """auto: the agent's claim-status policy only before 1.36 (Helm's offline default is 1.36)."""
    default = _policies(None)
    assert sorted(name.removeprefix(f"{RELEASE}-") for name in default) == [
        "agent-resourceslices",
        "controller-claims",
        "controller-claims-in-use",
        "controller-evictions",
        "controller-pod-status",
        "controller-pods",
    ]
    assert any(
        name.endswith("-agent-claim-status")
        for name in _policies({"admissionPolicy": {"agentClaimStatus": "policy"}})
    )
    assert not any(
        name.endswith("-claim-status")
        for name in _policies({"admissionPolicy": {"agentClaimStatus": "authorizer"}})
    )
    assert any(name.endswith("-controller-deployments") for name in _policies(CONSOLIDATING))
    assert _policies({"admissionPolicy": {"enabled": False}}) == {}
    controllerless = _policies({"controller": {"enabled": False}})
    assert not any("-controller-" in name for name in controllerless)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_policy_validates_strictly(rendered: dict[str, Obj], version: str) -> None:
    """Also the claim-status policy, which the default rendering (for 1.36) leaves out."""
    objects = render_chart({"admissionPolicy": {"agentClaimStatus": "policy"}})
    admission = [o for o in objects if o["kind"].startswith("ValidatingAdmissionPolicy")]
    assert len(admission) == 2 * len(rendered) == 14
    for obj in admission:
        validate_strict(obj, version)


def test_the_policies_name_what_the_code_writes(rendered: dict[str, Obj]) -> None:
    pods = json.dumps(_policy(rendered, "-controller-pods"))
    names = (PROVISIONING_ANNOTATION, PROVISIONING_CLASS_ANNOTATION, PROVISIONING_OURS_ANNOTATION)
    for name in (GATE, HINT_ANNOTATION, *names):
        assert name in pods
    assert FINALIZER in json.dumps(_policy(rendered, "-controller-claims"))


def test_no_optional_syntax_or_kubernetes_only_functions(rendered: dict[str, Obj]) -> None:
    """The Python evaluator would reject these; the chart keeps to the shared CEL subset."""
    text = json.dumps(rendered)
    for construct in (".?", "[?", "orValue", "cel.bind", ".join("):
        assert construct not in text


# -- objects as the API server stores them ---------------------------------------------------------


def gated_pod() -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "train-0",
            "namespace": "team-a",
            "uid": "0b6f4a52-7c1e-4d55-9b8a-3f0f4f5b8e11",
            "resourceVersion": "4711",
            "generation": 1,
            "creationTimestamp": "2026-11-30T10:00:00Z",
            "labels": {"fractional.dev/gang": "train", "app": "train"},
            "annotations": {"fractional.dev/gang-size": "2", "team.example.com/owner": "alice"},
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": "train",
                    "uid": "6d1c9a3e-51a2-4a57-8d3c-2b1f8f2d0a77",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
            "managedFields": [
                {
                    "manager": "kube-controller-manager",
                    "operation": "Update",
                    "apiVersion": "v1",
                    "time": "2026-11-30T10:00:00Z",
                    "fieldsType": "FieldsV1",
                    "fieldsV1": {"f:metadata": {"f:labels": {}}},
                }
            ],
        },
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "ghcr.io/team-a/train:1.0",
                    "resources": {"claims": [{"name": "gpu"}]},
                    "terminationMessagePath": "/dev/termination-log",
                    "terminationMessagePolicy": "File",
                    "imagePullPolicy": "IfNotPresent",
                }
            ],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu-share"}],
            "schedulingGates": [{"name": GATE}, {"name": "example.com/quota-check"}],
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 30,
            "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default",
            "securityContext": {},
            "schedulerName": "default-scheduler",
            "tolerations": [
                {
                    "key": "node.kubernetes.io/not-ready",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 300,
                }
            ],
            "priority": 0,
            "enableServiceLinks": True,
            "preemptionPolicy": "PreemptLowerPriority",
        },
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "lastProbeTime": None,
                    "lastTransitionTime": "2026-11-30T10:00:00Z",
                    "reason": "SchedulingGated",
                    "message": "Scheduling is blocked due to non-empty scheduling gates",
                }
            ],
            "qosClass": "BestEffort",
        },
    }


def allocation(node: str = NODE) -> Obj:
    return {
        "devices": {
            "results": [
                {
                    "request": "gpu",
                    "driver": DRIVER,
                    "pool": node,
                    "device": "gpu-0",
                    "shareID": "4f6e8e5a-1c1d-4e8b-9f0e-7a1b2c3d4e5f",
                    "consumedCapacity": {"memory": "8Gi", "compute": "25"},
                },
                {"request": "nic", "driver": OTHER_DRIVER, "pool": node, "device": "eth1"},
            ]
        },
        "nodeSelector": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
            ]
        },
    }


def claim(
    *, allocated: bool = False, devices: list[Obj] | None = None, finalizers: list[str] | None = None
) -> Obj:
    obj: Obj = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": "train-0-gpu-x2k9q",
            "namespace": "team-a",
            "uid": "9a7f3c1e-2b4d-4e6f-8a0b-1c2d3e4f5a6b",
            "resourceVersion": "5120",
            "generation": 1,
            "creationTimestamp": "2026-11-30T10:00:01Z",
            "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"},
            "finalizers": finalizers
            if finalizers is not None
            else ["resource.kubernetes.io/delete-protection"],
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": "train-0",
                    "uid": "0b6f4a52-7c1e-4d55-9b8a-3f0f4f5b8e11",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": "gpu.fractional.dev",
                            "allocationMode": "ExactCount",
                            "count": 1,
                            "capacity": {"requests": {"memory": "8Gi", "compute": "25"}},
                        },
                    },
                    {
                        "name": "nic",
                        "exactly": {
                            "deviceClassName": "nic.example.com",
                            "allocationMode": "ExactCount",
                            "count": 1,
                        },
                    },
                ]
            }
        },
    }
    status: Obj = {}
    if allocated:
        status["allocation"] = allocation()
    if devices:
        status["devices"] = devices
    if status:
        obj["status"] = status
    return obj


def device_status(driver: str = DRIVER, pool: str = NODE, device: str = "gpu-0", **extra: Any) -> Obj:
    entry: Obj = {"driver": driver, "pool": pool, "device": device}
    if driver == DRIVER and device.startswith("gpu"):
        entry["shareID"] = "4f6e8e5a-1c1d-4e8b-9f0e-7a1b2c3d4e5f"
    entry["conditions"] = [
        {
            "type": "Ready",
            "status": "True",
            "observedGeneration": 1,
            "lastTransitionTime": "2026-11-30T10:00:05Z",
            "reason": "Prepared",
            "message": "",
        }
    ]
    entry.update(extra)
    return entry


# -- kube-apiserver's update rules (the parts admission sees) --------------------------------------


def _server_update(old: Obj, written: Obj, *, resource: str, subresource: str = "") -> Obj:
    """The object admission sees for an update: the written body after the resource's strategy
    (pkg/registry/core/pod/strategy.go, pkg/registry/resource/resourceclaim/strategy.go
    PrepareForUpdate), with the API server's own metadata moves."""
    new = copy.deepcopy(written)
    if resource == "pods":
        new["status"] = copy.deepcopy(old.get("status"))  # a main-resource update keeps the status
    elif resource == "resourceclaims" and subresource == "status":
        new["spec"] = copy.deepcopy(old["spec"])
        for key in (
            "labels",
            "annotations",
            "finalizers",
            "ownerReferences",
            "deletionTimestamp",
            "generation",
        ):
            if key in old["metadata"]:
                new["metadata"][key] = copy.deepcopy(old["metadata"][key])
            else:
                new["metadata"].pop(key, None)
        # dropDeallocatedStatusDevices: entries of devices no longer allocated go.
        allocated = {
            (r["driver"], r["pool"], r["device"])
            for r in ((new.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results", [])
        }
        status = new.get("status") or {}
        kept = [d for d in status.get("devices", []) if (d["driver"], d["pool"], d["device"]) in allocated]
        if kept:
            status["devices"] = kept
        else:
            status.pop("devices", None)
    elif resource == "resourceclaims":
        if "status" in old:
            new["status"] = copy.deepcopy(old["status"])
        else:
            new.pop("status", None)
    if resource == "pods" and new.get("spec") != old.get("spec"):
        new["metadata"]["generation"] = (
            old["metadata"].get("generation", 1) + 1
        )  # PodObservedGenerationTracking
    new["metadata"]["managedFields"] = [
        *old["metadata"].get("managedFields", []),
        {
            "manager": "fractional",
            "operation": "Update",
            "apiVersion": new["apiVersion"],
            "time": "2026-11-30T10:01:00Z",
            "fieldsType": "FieldsV1",
            "fieldsV1": {},
            **({"subresource": subresource} if subresource else {}),
        },
    ]
    return new


def _decide(
    policy: Obj,
    user: Obj,
    *,
    old: Obj | None,
    obj: Obj | None,
    operation: str = "UPDATE",
    subresource: str = "",
) -> Decision:
    source = obj if obj is not None else old
    assert source is not None
    group = source["apiVersion"].split("/")[0] if "/" in source["apiVersion"] else ""
    resource = {
        "Pod": "pods",
        "Deployment": "deployments",
        "ResourceClaim": "resourceclaims",
        "ResourceSlice": "resourceslices",
    }[source["kind"]]
    request = admission_request(
        user=user,
        operation=operation,
        group=group,
        resource=resource,
        subresource=subresource,
        meta=source["metadata"],
    )
    return evaluate(policy, request, obj=obj, old=old)


# -- the controller's writes, made by its own code ---------------------------------------------------


class _Recorder:
    """Stands in for the API under ApiWriter (its ``JsonSender``): records each write as the typed
    client method it stands for, and answers with the body (the writer only decodes the answer)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Obj]] = []

    def send_json(self, method: str, path: str, _params: Any, body: Obj, **_: Any) -> bytes:
        kind = "pod" if "/pods/" in path else "resource_claim"
        status = "_status" if path.endswith("/status") else ""
        self.calls.append(
            (f"{'patch' if method == 'PATCH' else 'replace'}_namespaced_{kind}{status}", copy.deepcopy(body))
        )
        return json.dumps(body).encode()


@pytest.fixture
def writer(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ApiWriter, list[_Recorder]]]:
    recorder = _Recorder()
    monkeypatch.setattr(writer_module, "JsonSender", lambda _api_client: recorder)
    with client.ApiClient(client.Configuration()) as api_client:
        yield ApiWriter(api_client), [recorder]


def _the_write(recorders: list[_Recorder]) -> tuple[str, Obj]:
    calls = [call for recorder in recorders for call in recorder.calls]
    assert len(calls) == 1, calls
    for recorder in recorders:
        recorder.calls.clear()
    return calls[0]


def _admitted(method: str, body: Obj, old: Obj) -> tuple[Obj, str]:
    """(the object admission sees, subresource) for one recorded client call."""
    resource = "pods" if "pod" in method else "resourceclaims"
    subresource = "status" if method.endswith("_status") else ""
    written = apply_merge_patch(old, body) if method.startswith("patch_") else body
    return _server_update(old, written, resource=resource, subresource=subresource), subresource


def test_the_controllers_own_writes_pass(
    rendered: dict[str, Obj], accounts: dict[str, str], writer: tuple[ApiWriter, list[_Recorder]]
) -> None:
    api, recorders = writer
    user = service_account_user(NAMESPACE, accounts["controller"])
    pods = _policy(rendered, "-controller-pods")
    claims = _policy(rendered, "-controller-claims")
    decisions = {}

    def record(name: str, policy: Obj, old: Obj) -> Obj:
        method, body = _the_write(recorders)
        obj, subresource = _admitted(method, body, old)
        decisions[name] = _decide(policy, user, old=old, obj=obj, subresource=subresource)
        return obj

    pod = gated_pod()
    api.annotate_pod(
        pod,
        {
            HINT_ANNOTATION: '{"nodes":1}',
            PROVISIONING_ANNOTATION: "pr-1",
            PROVISIONING_CLASS_ANNOTATION: "best-effort",
            PROVISIONING_OURS_ANNOTATION: "pr-1",
        },
    )
    hinted = record("annotate", pods, pod)
    api.annotate_pod(hinted, {HINT_ANNOTATION: None})
    record("remove hint", pods, hinted)
    api.ungate_pod(pod, annotations={PLACED_ANNOTATION: NODE, HINT_ANNOTATION: None})
    ungated = record("ungate", pods, pod)
    assert ungated["spec"]["schedulingGates"] == [{"name": "example.com/quota-check"}]
    assert ungated["metadata"]["annotations"][PLACED_ANNOTATION] == NODE
    api.ungate_pod(pod, pin=("kubernetes.io/hostname", NODE))
    pinned = record("ungate and pin a pod without devices", pods, pod)
    assert pinned["spec"]["nodeSelector"]["kubernetes.io/hostname"] == NODE

    guarded = claim()
    api.write_allocation(guarded, allocation(), reserved_for=pod_consumer(pod))
    reserved = record("allocate and reserve for the one pod", claims, guarded)
    assert reserved["status"]["reservedFor"] == [{"resource": "pods", "name": "train-0", "uid": POD_UID}]
    api.clear_allocation(reserved)
    unreserved = record("deallocate and unreserve", claims, reserved)
    assert "reservedFor" not in unreserved["status"]
    api.write_allocation(guarded, allocation())
    allocated = record("allocate", claims, guarded)
    prepared = copy.deepcopy(allocated)
    prepared["status"]["devices"] = [device_status(), device_status(OTHER_DRIVER, device="eth1")]
    api.clear_allocation(prepared)
    cleared = record("deallocate", claims, prepared)
    assert "allocation" not in cleared.get("status", {})
    legacy = claim(finalizers=[FINALIZER])  # an earlier version's
    api.remove_finalizer(legacy)
    record("remove finalizer", claims, legacy)

    assert {name: d for name, d in decisions.items() if not (d.applies and d.allowed)} == {}


# -- controller: pods ------------------------------------------------------------------------------


def only_our_gate() -> Obj:
    pod = gated_pod()
    pod["spec"]["schedulingGates"] = [{"name": GATE}]
    return pod


def annotate(key: str, value: str | None) -> Callable[[Obj], None]:
    def change(pod: Obj) -> None:
        if value is None:
            pod["metadata"]["annotations"].pop(key)
        else:
            pod["metadata"]["annotations"][key] = value

    return change


def in_spec(key: str, value: Any) -> Callable[[Obj], None]:
    def change(pod: Obj) -> None:
        if value is None:
            pod["spec"].pop(key)
        else:
            pod["spec"][key] = value

    return change


def in_metadata(key: str, value: Any) -> Callable[[Obj], None]:
    def change(pod: Obj) -> None:
        if value is None:
            pod["metadata"].pop(key)
        else:
            pod["metadata"][key] = value

    return change


def _ungate_and_pin(pod: Obj, value: str = NODE, key: str = "kubernetes.io/hostname") -> None:
    pod["spec"]["schedulingGates"] = [g for g in pod["spec"]["schedulingGates"] if g["name"] != GATE] or None
    if pod["spec"]["schedulingGates"] is None:
        del pod["spec"]["schedulingGates"]
    pod["spec"].setdefault("nodeSelector", {})[key] = value


def _with_selector(hostname: str | None = None) -> Obj:
    pod = only_our_gate()
    pod["spec"]["nodeSelector"] = {"pool": "inference"}
    if hostname:
        pod["spec"]["nodeSelector"]["kubernetes.io/hostname"] = hostname
    return pod


def with_hint() -> Obj:
    pod = gated_pod()
    pod["metadata"]["annotations"][HINT_ANNOTATION] = '{"nodes":1}'
    return pod


# name -> (stored pod, change)
POD_ALLOWED: dict[str, tuple[Callable[[], Obj], Callable[[Obj], None]]] = {
    "remove our gate, another stays": (
        gated_pod,
        in_spec("schedulingGates", [{"name": "example.com/quota-check"}]),
    ),
    "remove our gate, the only one": (only_our_gate, in_spec("schedulingGates", None)),
    "remove our gate and pin the node (a pod without devices)": (only_our_gate, _ungate_and_pin),
    "remove our gate and pin the node beside the pod's own nodeSelector": (
        _with_selector,
        _ungate_and_pin,
    ),
    "add the scale-up hint": (gated_pod, annotate(HINT_ANNOTATION, '{"nodes":2}')),
    "change the scale-up hint": (with_hint, annotate(HINT_ANNOTATION, '{"nodes":3}')),
    "remove the scale-up hint": (with_hint, annotate(HINT_ANNOTATION, None)),
    "add the provisioning annotations": (
        gated_pod,
        lambda pod: pod["metadata"]["annotations"].update(
            {
                PROVISIONING_ANNOTATION: "pr-1",
                PROVISIONING_CLASS_ANNOTATION: "best-effort",
                PROVISIONING_OURS_ANNOTATION: "pr-1",
            }
        ),
    ),
    "nothing (a repeated write)": (gated_pod, lambda pod: None),
}


def _image(pod: Obj) -> None:
    pod["spec"]["containers"][0]["image"] = "evil.example.com/miner:latest"


def _ungate_and_change_the_image(pod: Obj) -> None:
    pod["spec"]["schedulingGates"] = [{"name": "example.com/quota-check"}]
    _image(pod)


def _resources(pod: Obj) -> None:
    pod["spec"]["containers"][0]["resources"] = {}


# name -> (stored pod, change, a fragment of the denial)
POD_FORBIDDEN: dict[str, tuple[Callable[[], Obj], Callable[[Obj], None], str]] = {
    "change an image": (gated_pod, _image, "spec"),
    "drop a container's claims": (gated_pod, _resources, "spec"),
    "set nodeName": (gated_pod, in_spec("nodeName", "gpu-node-9"), "spec"),
    "add a toleration": (
        gated_pod,
        in_spec("tolerations", [{"key": "nvidia.com/gpu", "operator": "Exists"}]),
        "spec",
    ),
    "set activeDeadlineSeconds": (gated_pod, in_spec("activeDeadlineSeconds", 1), "spec"),
    "add a nodeSelector": (
        gated_pod,
        in_spec("nodeSelector", {"kubernetes.io/hostname": "gpu-node-9"}),
        "spec",
    ),
    "pin by another label while ungating": (
        only_our_gate,
        lambda pod: _ungate_and_pin(pod, key="topology.kubernetes.io/zone", value="a"),
        "spec.nodeSelector",
    ),
    "re-pin a pod pinned already": (lambda: _with_selector(OTHER_NODE), _ungate_and_pin, "spec.nodeSelector"),
    "change the pod's nodeSelector while pinning": (
        _with_selector,
        lambda pod: (_ungate_and_pin(pod), pod["spec"]["nodeSelector"].update(pool="training")),
        "spec.nodeSelector",
    ),
    "remove our gate and change the image": (
        gated_pod,
        _ungate_and_change_the_image,
        "spec",
    ),
    "add a label": (gated_pod, lambda pod: pod["metadata"]["labels"].__setitem__("team", "b"), "metadata"),
    "remove a label": (
        gated_pod,
        lambda pod: pod["metadata"]["labels"].pop("fractional.dev/gang"),
        "metadata",
    ),
    "add a finalizer": (gated_pod, in_metadata("finalizers", ["example.com/hold"]), "metadata"),
    "drop the owner reference": (gated_pod, in_metadata("ownerReferences", None), "metadata"),
    "change another annotation": (gated_pod, annotate("team.example.com/owner", "mallory"), "annotations"),
    "remove another annotation": (gated_pod, annotate("fractional.dev/gang-size", None), "annotations"),
    "add a foreign annotation": (gated_pod, annotate("example.com/debug", "1"), "annotations"),
    "add our hint and a foreign annotation": (
        gated_pod,
        lambda pod: pod["metadata"]["annotations"].update({HINT_ANNOTATION: "{}", "example.com/debug": "1"}),
        "annotations",
    ),
    "remove another gate": (gated_pod, in_spec("schedulingGates", [{"name": GATE}]), "gate"),
    "remove every gate": (gated_pod, in_spec("schedulingGates", None), "gate"),
    "add a gate": (
        gated_pod,
        in_spec(
            "schedulingGates", [{"name": GATE}, {"name": "example.com/quota-check"}, {"name": "x.io/hold"}]
        ),
        "gate",
    ),
    "re-add our gate": (
        lambda: {
            **gated_pod(),
            "spec": {**gated_pod()["spec"], "schedulingGates": [{"name": "example.com/quota-check"}]},
        },
        in_spec("schedulingGates", [{"name": "example.com/quota-check"}, {"name": GATE}]),
        "gate",
    ),
}


def _pod_decision(
    policy: Obj, user: Obj, stored: Callable[[], Obj], change: Callable[[Obj], None]
) -> Decision:
    old = stored()
    new = copy.deepcopy(old)
    change(new)
    return _decide(policy, user, old=old, obj=_server_update(old, new, resource="pods"))


@pytest.mark.parametrize("case", sorted(POD_ALLOWED))
def test_controller_pod_write_allowed(rendered: dict[str, Obj], accounts: dict[str, str], case: str) -> None:
    user = service_account_user(NAMESPACE, accounts["controller"])
    decision = _pod_decision(_policy(rendered, "-controller-pods"), user, *POD_ALLOWED[case])
    assert decision.applies and decision.allowed, decision


@pytest.mark.parametrize("case", sorted(POD_FORBIDDEN))
def test_controller_pod_write_forbidden(
    rendered: dict[str, Obj], accounts: dict[str, str], case: str
) -> None:
    stored, change, fragment = POD_FORBIDDEN[case]
    user = service_account_user(NAMESPACE, accounts["controller"])
    decision = _pod_decision(_policy(rendered, "-controller-pods"), user, stored, change)
    assert decision.applies and decision.errors == () and decision.denials, decision
    assert any(fragment in message for message in decision.denials), decision


def test_controller_pod_status_is_forbidden_even_if_the_server_kept_it(
    rendered: dict[str, Obj], accounts: dict[str, str]
) -> None:
    """kube-apiserver drops status changes on a pod update; the policy denies them regardless."""
    old = gated_pod()
    new = copy.deepcopy(old)
    new["status"]["phase"] = "Failed"
    user = service_account_user(NAMESPACE, accounts["controller"])
    decision = _decide(_policy(rendered, "-controller-pods"), user, old=old, obj=new)
    assert decision.denials == ("the controller may not change a Pod's status",), decision


def test_pod_policy_leaves_everyone_else_alone(rendered: dict[str, Obj], accounts: dict[str, str]) -> None:
    old = gated_pod()
    new = copy.deepcopy(old)
    _image(new)
    policy = _policy(rendered, "-controller-pods")
    for user in (
        service_account_user("kube-system", "job-controller"),
        service_account_user(NAMESPACE, accounts["agent"], node=NODE),
        {"username": "alice", "groups": ["system:authenticated"]},
    ):
        assert not _decide(policy, user, old=old, obj=new).applies
    # Only updates of the pod itself: its status has its own policy (below), deletes none.
    controller = service_account_user(NAMESPACE, accounts["controller"])
    assert not _decide(policy, controller, old=old, obj=new, subresource="status").applies
    assert not _decide(policy, controller, old=old, obj=None, operation="DELETE").applies


# -- controller: pods' status (priority preemption) ---------------------------------------------------


def running_pod() -> Obj:
    pod = gated_pod()
    pod["spec"]["schedulingGates"] = []
    pod["spec"]["nodeName"] = NODE
    pod["status"] = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-30T10:00:05Z"}],
    }
    return pod


def _status_patch(status: Obj) -> Callable[[Obj], None]:
    """A strategic-merge patch of status as preemption/preemptor.py sends it (conditions merge by type)."""

    def change(pod: Obj) -> None:
        for key, value in status.items():
            if key == "conditions":
                kept = [
                    c
                    for c in pod["status"].get("conditions", [])
                    if c["type"] not in {v["type"] for v in value}
                ]
                pod["status"]["conditions"] = kept + value
            else:
                pod["status"][key] = value

    return change


def _status_decision(policy: Obj, user: Obj, stored: Obj, change: Callable[[Obj], None]) -> Decision:
    new = copy.deepcopy(stored)
    change(new)
    new["metadata"]["resourceVersion"] = "4712"
    return _decide(policy, user, old=stored, obj=new, subresource="status")


def _other_condition(pod: Obj) -> None:
    pod["status"]["conditions"][0]["status"] = "False"


def _phase(pod: Obj) -> None:
    pod["status"]["phase"] = "Failed"


def _label(pod: Obj) -> None:
    pod["metadata"].setdefault("labels", {})["x"] = "y"


def _spec(pod: Obj) -> None:
    pod["spec"]["nodeName"] = OTHER_NODE


STATUS_FORBIDDEN: dict[str, tuple[Callable[[Obj], None], str]] = {
    "another condition": (_other_condition, "no Pod condition but DisruptionTarget"),
    "phase": (_phase, "only the DisruptionTarget condition and nominatedNodeName"),
    "label": (_label, "metadata"),
    "spec": (_spec, "spec"),
    "DisruptionTarget for another reason": (
        _status_patch(
            {
                "conditions": [
                    {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}
                ]
            }
        ),
        "PreemptionByScheduler",
    ),
}


def test_controller_pod_status_writes_of_preemption_allowed(
    rendered: dict[str, Obj], accounts: dict[str, str]
) -> None:
    from driver.controller.preemption.preemptor import build_disruption_condition

    policy = _policy(rendered, "-controller-pod-status")
    user = service_account_user(NAMESPACE, accounts["controller"])
    condition = build_disruption_condition(gated_pod())
    for stored, status in (
        (running_pod(), {"conditions": [condition]}),
        (gated_pod(), {"nominatedNodeName": NODE}),
    ):
        decision = _status_decision(policy, user, stored, _status_patch(status))
        assert decision.applies and decision.allowed, decision


@pytest.mark.parametrize("case", sorted(STATUS_FORBIDDEN))
def test_controller_pod_status_write_forbidden(
    rendered: dict[str, Obj], accounts: dict[str, str], case: str
) -> None:
    change, fragment = STATUS_FORBIDDEN[case]
    user = service_account_user(NAMESPACE, accounts["controller"])
    decision = _status_decision(_policy(rendered, "-controller-pod-status"), user, running_pod(), change)
    assert decision.applies and decision.errors == () and decision.denials, decision
    assert any(fragment in message for message in decision.denials), decision


def test_pod_status_policy_leaves_everyone_else_alone(
    rendered: dict[str, Obj], accounts: dict[str, str]
) -> None:
    policy = _policy(rendered, "-controller-pod-status")
    kubelet = {"username": f"system:node:{NODE}", "groups": ["system:nodes", "system:authenticated"]}
    assert not _status_decision(policy, kubelet, running_pod(), _phase).applies


def disruption_target(reason: str, *, status: str = "True") -> Obj:
    return {
        "type": "DisruptionTarget",
        "status": status,
        "reason": reason,
        "message": "Eviction API: evicting",
        "lastTransitionTime": "2026-11-30T10:10:00Z",
    }


def disrupted_pod(reason: str) -> Obj:
    """A running pod that already carries a DisruptionTarget condition (set for ``reason``)."""
    pod = running_pod()
    pod["status"]["conditions"].append(disruption_target(reason))
    return pod


def _drop_disruption_target(pod: Obj) -> None:
    pod["status"]["conditions"] = [c for c in pod["status"]["conditions"] if c["type"] != "DisruptionTarget"]


def _ours_again(pod: Obj) -> None:
    from driver.controller.preemption.preemptor import build_disruption_condition

    _status_patch({"conditions": [build_disruption_condition(gated_pod())]})(pod)


def _reason_changed(pod: Obj) -> None:
    for condition in pod["status"]["conditions"]:
        if condition["type"] == "DisruptionTarget":
            condition["reason"] = "DeletionByTaintManager"


# name -> (the pod as stored, the change, allowed, a fragment of the denial)
DISRUPTION_CASES: dict[str, tuple[Callable[[], Obj], Callable[[Obj], None], bool, str]] = {
    "rewrite our own DisruptionTarget": (
        lambda: disrupted_pod("PreemptionByScheduler"),
        _ours_again,
        True,
        "",
    ),
    "rewrite the eviction API's DisruptionTarget as ours": (
        lambda: disrupted_pod("EvictionByEvictionAPI"),
        _ours_again,
        False,
        "rewrite a DisruptionTarget condition that it did not set",
    ),
    "remove the eviction API's DisruptionTarget": (
        lambda: disrupted_pod("EvictionByEvictionAPI"),
        _drop_disruption_target,
        False,
        "rewrite a DisruptionTarget condition that it did not set",  # also "may not remove"
    ),
    "remove our own DisruptionTarget": (
        lambda: disrupted_pod("PreemptionByScheduler"),
        _drop_disruption_target,
        False,
        "may not remove a DisruptionTarget",
    ),
}


@pytest.mark.parametrize("case", sorted(DISRUPTION_CASES))
def test_controller_disruption_target_of_others_stays(
    rendered: dict[str, Obj], accounts: dict[str, str], case: str
) -> None:
    stored, change, allowed, fragment = DISRUPTION_CASES[case]
    user = service_account_user(NAMESPACE, accounts["controller"])
    decision = _status_decision(_policy(rendered, "-controller-pod-status"), user, stored(), change)
    assert decision.applies and decision.errors == () and decision.allowed == allowed, decision
    assert allowed or any(fragment in message for message in decision.denials), decision


# -- controller: evictions (priority preemption) ------------------------------------------------------


class _EvictionRecorder:
    """Stands in for CoreV1Api under the preemptor's ``evict``: records each Eviction body."""

    def __init__(self) -> None:
        self.bodies: list[Obj] = []

    def create_namespaced_pod_eviction(self, name: str, namespace: str, body: Obj, **_: Any) -> None:
        assert body["metadata"] == {"name": name, "namespace": namespace}
        self.bodies.append(copy.deepcopy(body))


def preemptor_evictions(pod: Obj) -> list[Obj]:
    """The Eviction bodies the preemptor's own code sends for ``pod``: its dry run, then the eviction."""
    from driver.controller.preemption.preemptor import Preemptor

    core = _EvictionRecorder()
    for dry_run in (True, False):
        Preemptor.evict(SimpleNamespace(check_fence=lambda: None), core, pod, dry_run=dry_run)  # type: ignore[arg-type]
    return core.bodies


def eviction(namespace: str, delete_options: Obj | None) -> Obj:
    body: Obj = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": "train-0", "namespace": namespace},
    }
    if delete_options is not None:
        body["deleteOptions"] = delete_options
    return body


UID = {"uid": "0b6f4a52-7c1e-4d55-9b8a-3f0f4f5b8e11"}

# name -> (namespace, deleteOptions (None: none), allowed, a fragment of the denial)
EVICTION_CASES: dict[str, tuple[str, Obj | None, bool, str]] = {
    "the victim, by UID": ("team-a", {"preconditions": UID}, True, ""),
    "the victim, by UID, dry run": ("team-a", {"preconditions": UID, "dryRun": ["All"]}, True, ""),
    "a pod in kube-system": ("kube-system", {"preconditions": UID}, False, "namespace kube-system"),
    "a pod in kube-node-lease": (
        "kube-node-lease",
        {"preconditions": UID},
        False,
        "namespace kube-node-lease",
    ),
    "without deleteOptions": ("team-a", None, False, "preconditions.uid"),
    "without a UID precondition": ("team-a", {"dryRun": ["All"]}, False, "preconditions.uid"),
    "with grace period 0": ("team-a", {"preconditions": UID, "gracePeriodSeconds": 0}, False, "grace period"),
    "with a propagation policy": (
        "team-a",
        {"preconditions": UID, "propagationPolicy": "Orphan"},
        False,
        "grace period",
    ),
    "with a resourceVersion precondition": (
        "team-a",
        {"preconditions": {**UID, "resourceVersion": "4711"}},
        False,
        "grace period",
    ),
}


def _eviction_decision(policy: Obj, user: Obj, body: Obj) -> Decision:
    request = admission_request(
        user=user,
        operation="CREATE",
        group="",
        resource="pods",
        subresource="eviction",
        meta=body["metadata"],
    )
    return evaluate(policy, request, obj=body, old=None)


def test_the_preemptors_evictions_pass(rendered: dict[str, Obj], accounts: dict[str, str]) -> None:
    user = service_account_user(NAMESPACE, accounts["controller"])
    bodies = preemptor_evictions(running_pod())
    assert len(bodies) == 2 and bodies[0]["deleteOptions"]["dryRun"] == ["All"]
    for body in bodies:
        decision = _eviction_decision(_policy(rendered, "-controller-evictions"), user, body)
        assert decision.applies and decision.allowed, decision


@pytest.mark.parametrize("case", sorted(EVICTION_CASES))
def test_controller_evictions(rendered: dict[str, Obj], accounts: dict[str, str], case: str) -> None:
    namespace, options, allowed, fragment = EVICTION_CASES[case]
    user = service_account_user(NAMESPACE, accounts["controller"])
    decision = _eviction_decision(
        _policy(rendered, "-controller-evictions"), user, eviction(namespace, options)
    )
    assert decision.applies and decision.errors == () and decision.allowed == allowed, decision
    assert allowed or any(fragment in message for message in decision.denials), decision


def test_eviction_policy_leaves_everyone_else_alone(
    rendered: dict[str, Obj], accounts: dict[str, str]
) -> None:
    policy = _policy(rendered, "-controller-evictions")
    body = eviction("kube-system", None)
    for user in (
        service_account_user("kube-system", "node-lifecycle-controller"),
        service_account_user(NAMESPACE, accounts["agent"], node=NODE),
        {"username": "alice", "groups": ["system:authenticated"]},
    ):
        assert not _eviction_decision(policy, user, body).applies


# -- controller: claims ----------------------------------------------------------------------------


def _claim_decision(
    rendered: dict[str, Obj], accounts: dict[str, str], old: Obj, new: Obj, subresource: str
) -> Decision:
    user = service_account_user(NAMESPACE, accounts["controller"])
    return _decide(_policy(rendered, "-controller-claims"), user, old=old, obj=new, subresource=subresource)


def _claim_pair(
    old: Obj, change: Callable[[Obj], None], subresource: str, *, server: bool = True
) -> tuple[Obj, Obj]:
    new = copy.deepcopy(old)
    change(new)
    if server:
        new = _server_update(old, new, resource="resourceclaims", subresource=subresource)
    return old, new


def _reserve(claim_obj: Obj) -> None:
    claim_obj["status"]["reservedFor"] = [
        {"resource": "pods", "name": "intruder", "uid": "1f2e3d4c-0000-4000-8000-000000000001"}
    ]


def _clear_allocation_and_devices(claim_obj: Obj) -> None:
    del claim_obj["status"]["allocation"], claim_obj["status"]["devices"]


def _pod_entry(name: str = "train-0", uid: str = POD_UID, **extra: str) -> Obj:
    return {"resource": "pods", "name": name, "uid": uid, **extra}


def _allocate_reserved_for(*entries: Obj) -> Callable[[Obj], None]:
    def change(claim_obj: Obj) -> None:
        claim_obj.setdefault("status", {})["allocation"] = allocation()
        claim_obj["status"]["reservedFor"] = list(entries)

    return change


def reserved_claim(*entries: Obj) -> Obj:
    obj = claim(allocated=True)
    obj["status"]["reservedFor"] = list(entries) or [_pod_entry()]
    return obj


def _clear_allocation_and_reservation(claim_obj: Obj) -> None:
    del claim_obj["status"]["allocation"], claim_obj["status"]["reservedFor"]


CLAIM_ALLOWED: dict[str, tuple[Callable[[], Obj], Callable[[Obj], None], str]] = {
    "remove our finalizer": (
        lambda: claim(finalizers=["resource.kubernetes.io/delete-protection", FINALIZER]),
        lambda c: c["metadata"]["finalizers"].remove(FINALIZER),
        "",
    ),
    "set the allocation": (
        claim,
        lambda c: c.setdefault("status", {}).__setitem__("allocation", allocation()),
        "status",
    ),
    "clear the allocation and its device status": (
        lambda: claim(allocated=True, devices=[device_status(), device_status(OTHER_DRIVER, device="eth1")]),
        _clear_allocation_and_devices,
        "status",
    ),
    "clear the allocation (the server drops the device status)": (
        lambda: claim(allocated=True, devices=[device_status()]),
        lambda c: c["status"].pop("allocation"),
        "status",
    ),
    "set the allocation reserved for its one pod": (claim, _allocate_reserved_for(_pod_entry()), "status"),
    "clear the allocation and the reservation of its one pod": (
        reserved_claim,
        _clear_allocation_and_reservation,
        "status",
    ),
    "clear the allocation and a reservation naming the core group": (
        lambda: reserved_claim(_pod_entry(apiGroup="")),
        _clear_allocation_and_reservation,
        "status",
    ),
}

CLAIM_FORBIDDEN: dict[str, tuple[Callable[[], Obj], Callable[[Obj], None], str, str]] = {
    "add our finalizer (only earlier versions did)": (
        claim,
        lambda c: c["metadata"]["finalizers"].append(FINALIZER),
        "",
        "finalizer",
    ),
    "remove another finalizer": (
        claim,
        lambda c: c["metadata"]["finalizers"].remove("resource.kubernetes.io/delete-protection"),
        "",
        "finalizer",
    ),
    "add another finalizer": (
        claim,
        lambda c: c["metadata"]["finalizers"].append("example.com/hold"),
        "",
        "finalizer",
    ),
    "add a label": (claim, lambda c: c["metadata"].__setitem__("labels", {"x": "y"}), "", "metadata"),
    "drop the owner reference": (claim, lambda c: c["metadata"].pop("ownerReferences"), "", "metadata"),
    "replace the allocation": (
        lambda: claim(allocated=True),
        lambda c: c["status"].__setitem__("allocation", allocation(OTHER_NODE)),
        "status",
        "allocation",
    ),
    "reserve the claim for a pod": (lambda: claim(allocated=True), _reserve, "status", "reservedFor"),
    "reserve for two pods with the allocation": (
        claim,
        _allocate_reserved_for(_pod_entry(), _pod_entry("train-1", "1f2e3d4c-0000-4000-8000-000000000002")),
        "status",
        "reservedFor",
    ),
    "reserve for a PodGroup with the allocation": (
        claim,
        _allocate_reserved_for(
            {"apiGroup": "scheduling.k8s.io", "resource": "podgroups", "name": "train", "uid": POD_UID}
        ),
        "status",
        "reservedFor",
    ),
    "reserve for a pod of another group with the allocation": (
        claim,
        _allocate_reserved_for(_pod_entry(apiGroup="example.com")),
        "status",
        "reservedFor",
    ),
    "unreserve and keep the allocation": (
        reserved_claim,
        lambda c: c["status"].pop("reservedFor"),
        "status",
        "reservedFor",
    ),
    "replace the reservation": (
        reserved_claim,
        lambda c: c["status"].__setitem__("reservedFor", [_pod_entry("intruder", "1f2e3d4c")]),
        "status",
        "reservedFor",
    ),
    "clear the allocation of a claim two pods use": (
        lambda: reserved_claim(_pod_entry(), _pod_entry("train-1", "1f2e3d4c-0000-4000-8000-000000000002")),
        _clear_allocation_and_reservation,
        "status",
        "reservedFor",
    ),
    "clear the allocation of a claim a PodGroup uses": (
        lambda: reserved_claim(
            {"apiGroup": "scheduling.k8s.io", "resource": "podgroups", "name": "train", "uid": POD_UID}
        ),
        _clear_allocation_and_reservation,
        "status",
        "reservedFor",
    ),
    "write status.devices": (
        lambda: claim(allocated=True),
        lambda c: c["status"].__setitem__("devices", [device_status()]),
        "status",
        "status.devices",
    ),
    "change another driver's device status": (
        lambda: claim(allocated=True, devices=[device_status(OTHER_DRIVER, device="eth1")]),
        lambda c: c["status"]["devices"][0].__setitem__("data", {"ip": "10.0.0.9"}),
        "status",
        "status.devices",
    ),
}


@pytest.mark.parametrize("case", sorted(CLAIM_ALLOWED))
def test_controller_claim_write_allowed(
    rendered: dict[str, Obj], accounts: dict[str, str], case: str
) -> None:
    stored, change, subresource = CLAIM_ALLOWED[case]
    old, new = _claim_pair(stored(), change, subresource)
    decision = _claim_decision(rendered, accounts, old, new, subresource)
    assert decision.applies and decision.allowed, decision


@pytest.mark.parametrize("case", sorted(CLAIM_FORBIDDEN))
def test_controller_claim_write_forbidden(
    rendered: dict[str, Obj], accounts: dict[str, str], case: str
) -> None:
    stored, change, subresource, fragment = CLAIM_FORBIDDEN[case]
    old, new = _claim_pair(stored(), change, subresource)
    decision = _claim_decision(rendered, accounts, old, new, subresource)
    assert decision.applies and decision.errors == () and decision.denials, decision
    assert any(fragment in message for message in decision.denials), decision


@pytest.mark.parametrize(
    ("case", "change", "subresource", "fragment"),
    [
        ("spec through the main resource", lambda c: c["spec"]["devices"]["requests"].pop(), "", "spec"),
        (
            "status through the main resource",
            lambda c: c.__setitem__("status", {"allocation": allocation()}),
            "",
            "status subresource",
        ),
        ("spec through status", lambda c: c["spec"]["devices"]["requests"].pop(), "status", "spec"),
        ("finalizer through status", lambda c: c["metadata"]["finalizers"].clear(), "status", "finalizer"),
    ],
)
def test_controller_claim_fields_the_server_resets_are_denied_anyway(
    rendered: dict[str, Obj],
    accounts: dict[str, str],
    case: str,
    change: Callable[[Obj], None],
    subresource: str,
    fragment: str,
) -> None:
    """kube-apiserver's strategy resets these before admission; the policy holds without it."""
    old, new = _claim_pair(claim(), change, subresource, server=False)
    decision = _claim_decision(rendered, accounts, old, new, subresource)
    assert decision.applies and decision.errors == () and any(fragment in m for m in decision.denials), (
        decision
    )


# -- claims the controller allocated: delete protection --------------------------------------------

GARBAGE_COLLECTOR = service_account_user("kube-system", "generic-garbage-collector")
ALICE = {"username": "alice", "groups": ["system:authenticated"]}


def _ours(*, reserved: bool, finalizers: list[str] | None = None) -> Obj:
    """A claim the controller allocated: no kube-scheduler finalizer (and none of ours)."""
    obj = reserved_claim() if reserved else claim(allocated=True)
    obj["metadata"]["finalizers"] = finalizers or []
    return obj


def _delete(rendered: dict[str, Obj], stored: Obj, user: Obj) -> Decision:
    policy = _policy(rendered, "-controller-claims-in-use")
    return _decide(policy, user, old=stored, obj=None, operation="DELETE")


@pytest.mark.parametrize("user", [ALICE, GARBAGE_COLLECTOR], ids=["a user", "the garbage collector"])
def test_a_claim_we_allocated_is_not_deleted_while_reserved(rendered: dict[str, Obj], user: Obj) -> None:
    """What kube-scheduler's delete-protection finalizer does for its claims, without a write per
    pod: refused while a pod may use the devices, whoever asks."""
    decision = _delete(rendered, _ours(reserved=True), user)
    assert decision.applies and decision.errors == (), decision
    assert decision.denials == (
        "ResourceClaim train-0-gpu-x2k9q is in use (reserved for pods/train-0): delete the pods that use"
        " it first; the claim can be deleted once they are gone",
    )
    two = _ours(reserved=True)
    two["status"]["reservedFor"].append(_pod_entry("train-1", "uid-1"))
    assert "pods/train-0 and others" in _delete(rendered, two, user).denials[0]


def test_a_claim_unreserved_or_with_a_finalizer_is_left_to_the_server(rendered: dict[str, Obj]) -> None:
    """Unreserved (its pods are gone), unallocated, or guarded by a finalizer (kube-scheduler's, or the
    one earlier versions of the controller wrote): the policy does not stand in the way."""
    assert _delete(rendered, _ours(reserved=False), GARBAGE_COLLECTOR).allowed
    assert not _delete(rendered, claim(), ALICE).applies
    for finalizer in ("resource.kubernetes.io/delete-protection", FINALIZER):
        assert not _delete(rendered, _ours(reserved=True, finalizers=[finalizer]), ALICE).applies
    updated = _ours(reserved=True)
    assert not _decide(
        _policy(rendered, "-controller-claims-in-use"), ALICE, old=updated, obj=updated, operation="UPDATE"
    ).applies


# -- agent: ResourceClaim status ------------------------------------------------------------------


def _agent_status(
    rendered: dict[str, Obj],
    accounts: dict[str, str],
    old: Obj,
    devices: list[Obj] | None,
    *,
    node: str | None = NODE,
) -> Decision:
    new = copy.deepcopy(old)
    status = new.setdefault("status", {})
    if devices:
        status["devices"] = devices
    else:
        status.pop("devices", None)
    new = _server_update(old, new, resource="resourceclaims", subresource="status")
    user = service_account_user(NAMESPACE, accounts["agent"], node=node)
    return _decide(_policy(rendered, "-agent-claim-status"), user, old=old, obj=new, subresource="status")


def _theirs() -> Obj:
    return device_status(
        OTHER_DRIVER, device="eth1", networkData={"interfaceName": "net1", "ips": ["10.0.0.5/24"]}
    )


def test_agent_writes_its_devices_status(rendered: dict[str, Obj], accounts: dict[str, str]) -> None:
    """What driver/plugin/status.py writes after prepare and after unprepare passes."""
    ours = [device_status(data={"memoryBytes": 8589934592, "backend": "mps"})]
    first = claim(allocated=True)
    assert _agent_status(rendered, accounts, first, merge_device_statuses([], ours)).allowed
    # Another driver wrote first; ours go after its entries, theirs stay as they were.
    shared = claim(allocated=True, devices=[_theirs()])
    decision = _agent_status(rendered, accounts, shared, merge_device_statuses([_theirs()], ours))
    assert decision.applies and decision.allowed, decision
    # Rewritten (a new condition time), then removed after unprepare.
    written = claim(allocated=True, devices=[device_status(), _theirs()])
    changed = [
        device_status(
            conditions=[
                {
                    "type": "Ready",
                    "status": "False",
                    "lastTransitionTime": "2026-11-30T11:00:00Z",
                    "reason": "Unhealthy",
                    "message": "",
                }
            ]
        )
    ]
    assert _agent_status(
        rendered, accounts, written, merge_device_statuses([device_status(), _theirs()], changed)
    ).allowed
    removal = _agent_status(
        rendered, accounts, written, without_driver_statuses([device_status(), _theirs()])
    )
    assert removal.applies and removal.allowed, removal
    only_ours = claim(allocated=True, devices=[device_status()])
    assert _agent_status(rendered, accounts, only_ours, without_driver_statuses([device_status()])).allowed


AGENT_FORBIDDEN: dict[str, tuple[Callable[[], Obj], list[Obj] | None, str]] = {
    "change another driver's entry": (
        lambda: claim(allocated=True, devices=[device_status(), _theirs()]),
        [device_status(), {**_theirs(), "data": {"forged": True}}],
        "entries of driver",
    ),
    "remove another driver's entry": (
        lambda: claim(allocated=True, devices=[device_status(), _theirs()]),
        [device_status()],
        "entries of driver",
    ),
    "write another node's pool": (
        lambda: claim(allocated=True),
        [device_status(pool=OTHER_NODE)],
        "entries of driver",
    ),
    "remove another node's entry of our driver": (
        lambda: claim(allocated=True, devices=[device_status(pool=OTHER_NODE)]),
        None,
        "entries of driver",
    ),
}


@pytest.mark.parametrize("case", sorted(AGENT_FORBIDDEN))
def test_agent_status_write_forbidden(rendered: dict[str, Obj], accounts: dict[str, str], case: str) -> None:
    stored, devices, fragment = AGENT_FORBIDDEN[case]
    old = stored()
    if case == "write another node's pool" or case == "remove another node's entry of our driver":
        # The device status must match an allocated result: allocate the other node's device.
        old["status"]["allocation"] = allocation(OTHER_NODE)
    decision = _agent_status(rendered, accounts, old, devices)
    assert decision.applies and decision.errors == () and any(fragment in m for m in decision.denials), (
        decision
    )


@pytest.mark.parametrize(
    ("case", "change", "fragment"),
    [
        ("clear the allocation", lambda s: s.pop("allocation"), "only status.devices"),
        (
            "reserve the claim",
            lambda s: s.__setitem__("reservedFor", [{"resource": "pods", "name": "p", "uid": "u"}]),
            "only status.devices",
        ),
    ],
)
def test_agent_may_not_touch_allocation_or_reservations(
    rendered: dict[str, Obj],
    accounts: dict[str, str],
    case: str,
    change: Callable[[Obj], None],
    fragment: str,
) -> None:
    old = claim(allocated=True, devices=[device_status()])
    new = copy.deepcopy(old)
    change(new["status"])
    new = _server_update(old, new, resource="resourceclaims", subresource="status")
    user = service_account_user(NAMESPACE, accounts["agent"], node=NODE)
    decision = _decide(_policy(rendered, "-agent-claim-status"), user, old=old, obj=new, subresource="status")
    assert decision.applies and decision.errors == () and any(fragment in m for m in decision.denials), (
        decision
    )


def test_agent_without_a_node_in_its_token_is_denied(
    rendered: dict[str, Obj], accounts: dict[str, str]
) -> None:
    decision = _agent_status(rendered, accounts, claim(allocated=True), [device_status()], node=None)
    assert decision.applies and decision.errors == ()
    assert any("no node association" in m for m in decision.denials), decision


def test_agent_on_another_node_may_not_write_this_nodes_entries(
    rendered: dict[str, Obj], accounts: dict[str, str]
) -> None:
    decision = _agent_status(rendered, accounts, claim(allocated=True), [device_status()], node=OTHER_NODE)
    assert decision.applies and any("entries of driver" in m for m in decision.denials), decision


# -- agent: ResourceSlices ------------------------------------------------------------------------


def resource_slice(node: str = NODE) -> Obj:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-fractional.dev-8x2kq", "resourceVersion": "77", "generation": 1},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}],
        },
    }


def _other_driver(slice_obj: Obj) -> None:
    slice_obj["spec"]["driver"] = OTHER_DRIVER
    slice_obj["spec"]["pool"]["name"] = "nics"  # another driver names its pools as it likes


def _other_pool(slice_obj: Obj) -> None:
    slice_obj["spec"]["pool"]["name"] = f"{OTHER_NODE}-gpus"


# name -> (operation, the slice's node, the agent's node, a change of the slice, allowed, denial fragment)
SLICE_CASES: dict[str, tuple[str, str, str | None, Callable[[Obj], None] | None, bool, str]] = {
    "create its own": ("CREATE", NODE, NODE, None, True, ""),
    "update its own": ("UPDATE", NODE, NODE, None, True, ""),
    "delete its own": ("DELETE", NODE, NODE, None, True, ""),
    "create another node's": ("CREATE", OTHER_NODE, NODE, None, False, "ResourceSlices of node"),
    "update another node's": ("UPDATE", OTHER_NODE, NODE, None, False, "ResourceSlices of node"),
    "delete another node's": ("DELETE", OTHER_NODE, NODE, None, False, "ResourceSlices of node"),
    "create without a node in its token": ("CREATE", NODE, None, None, False, "no node association"),
    "create one for all nodes": ("CREATE", "", NODE, None, False, "without spec.nodeName"),
    "create another driver's on its node": ("CREATE", NODE, NODE, _other_driver, False, "of driver"),
    "update another driver's on its node": ("UPDATE", NODE, NODE, _other_driver, False, "of driver"),
    "delete another driver's on its node": ("DELETE", NODE, NODE, _other_driver, False, "of driver"),
    "create a pool not named after its node": ("CREATE", NODE, NODE, _other_pool, False, "pool named"),
    "update a pool not named after its node": ("UPDATE", NODE, NODE, _other_pool, False, "pool named"),
    "delete a pool not named after its node": ("DELETE", NODE, NODE, _other_pool, False, "pool named"),
}


def slice_case(case: str) -> tuple[str, Obj, str | None]:
    """(operation, the slice as stored or written, the agent's node) of a SLICE_CASES case."""
    operation, slice_node, user_node, change, _, _ = SLICE_CASES[case]
    stored = resource_slice(slice_node or NODE)
    if not slice_node:
        stored["spec"].pop("nodeName")
        stored["spec"]["allNodes"] = True
    if change is not None:
        change(stored)
    return operation, stored, user_node


@pytest.mark.parametrize("case", sorted(SLICE_CASES))
def test_agent_resource_slices(rendered: dict[str, Obj], accounts: dict[str, str], case: str) -> None:
    operation, stored, user_node = slice_case(case)
    *_, allowed, fragment = SLICE_CASES[case]
    old = None if operation == "CREATE" else stored
    obj = None if operation == "DELETE" else stored
    user = service_account_user(NAMESPACE, accounts["agent"], node=user_node)
    decision = _decide(
        _policy(rendered, "-agent-resourceslices"), user, old=old, obj=obj, operation=operation
    )
    assert decision.applies and decision.errors == () and decision.allowed == allowed, decision
    assert allowed or any(fragment in message for message in decision.denials), decision


@pytest.mark.parametrize("change", [_other_driver, _other_pool])
def test_agent_may_not_turn_its_slice_into_a_foreign_one(
    rendered: dict[str, Obj], accounts: dict[str, str], change: Callable[[Obj], None]
) -> None:
    """Both sides of an update are checked (the server refuses the change too: both fields are
    immutable; the policy does not rely on it)."""
    old = resource_slice()
    new = copy.deepcopy(old)
    change(new)
    user = service_account_user(NAMESPACE, accounts["agent"], node=NODE)
    policy = _policy(rendered, "-agent-resourceslices")
    assert not _decide(policy, user, old=old, obj=new).allowed
    assert not _decide(policy, user, old=new, obj=old).allowed


@pytest.mark.parametrize(
    ("case", "change", "fragment"),
    [
        ("spec", lambda c: c["spec"]["devices"]["requests"].pop(), "spec"),
        ("a label", lambda c: c["metadata"].__setitem__("labels", {"x": "y"}), "metadata"),
        ("a finalizer", lambda c: c["metadata"]["finalizers"].clear(), "metadata"),
    ],
)
def test_agent_claim_fields_the_server_resets_are_denied_anyway(
    rendered: dict[str, Obj],
    accounts: dict[str, str],
    case: str,
    change: Callable[[Obj], None],
    fragment: str,
) -> None:
    """kube-apiserver resets spec and metadata on a status update; the policy holds without it."""
    old = claim(allocated=True, devices=[device_status()])
    new = copy.deepcopy(old)
    change(new)
    user = service_account_user(NAMESPACE, accounts["agent"], node=NODE)
    decision = _decide(_policy(rendered, "-agent-claim-status"), user, old=old, obj=new, subresource="status")
    assert decision.applies and decision.errors == () and any(fragment in m for m in decision.denials), (
        decision
    )


# -- consolidation's make before break: a Deployment's pod template annotation -------------------------

CONSOLIDATING = {"controller": {"consolidation": {"enabled": True}}}


def stored_deployment(annotations: Obj | None = None) -> Obj:
    template: Obj = {"metadata": {"labels": {"app": "web"}},
                     "spec": {"containers": [{"name": "main", "image": "example.com/web:1"}]}}  # fmt: skip
    if annotations is not None:
        template["metadata"]["annotations"] = annotations
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "team", "uid": "d-1", "generation": 3,
                     "resourceVersion": "41", "labels": {"app": "web"}},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}}, "template": template,
                 "strategy": {"type": "RollingUpdate",
                              "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}},
        "status": {"replicas": 1},
    }  # fmt: skip


def _rolled(old: Obj, patch: Obj) -> Obj:
    """The server's view after our patch: the patch merged, generation bumped (a spec change)."""
    new = apply_merge_patch(old, patch)
    new["metadata"]["generation"] = old["metadata"]["generation"] + 1
    return new


@pytest.fixture(scope="module")
def deployment_policy() -> Obj:
    return _policy(_policies(CONSOLIDATING), "-controller-deployments")


@pytest.mark.parametrize("annotations", [None, {"team": "x"}, {"fractional.dev/replaces": "an-older-uid"}])
def test_the_controllers_make_before_break_patch_is_allowed(
    deployment_policy: Obj, accounts: dict[str, str], annotations: Obj | None
) -> None:
    from driver.controller.consolidation.consolidator import rollout_patch

    old = stored_deployment(annotations)
    user = service_account_user(NAMESPACE, accounts["controller"])
    decision = _decide(deployment_policy, user, old=old, obj=_rolled(old, rollout_patch("pod-uid-1")))
    assert decision.applies and decision.allowed, decision


DEPLOYMENT_FORBIDDEN: dict[str, tuple[Obj, str]] = {
    "replicas": ({"spec": {"replicas": 0}}, "only the pod template"),
    "strategy": ({"spec": {"strategy": {"type": "Recreate", "rollingUpdate": None}}},
                 "only the pod template"),
    "image": ({"spec": {"template": {"spec": {"containers": [{"name": "main", "image": "evil:1"}]}}}},
              "pod spec"),
    "template labels": ({"spec": {"template": {"metadata": {"labels": {"app": "other"}}}}}, "labels"),
    "another annotation": ({"spec": {"template": {"metadata": {"annotations": {"x": "y"}}}}},
                           "only the annotation fractional.dev/replaces"),
    "metadata": ({"metadata": {"labels": {"app": "other"}}}, "metadata"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(DEPLOYMENT_FORBIDDEN))
def test_any_other_deployment_change_by_the_controller_is_denied(
    deployment_policy: Obj, accounts: dict[str, str], case: str
) -> None:
    patch, fragment = DEPLOYMENT_FORBIDDEN[case]
    old = stored_deployment({"fractional.dev/replaces": "a"})
    user = service_account_user(NAMESPACE, accounts["controller"])
    decision = _decide(deployment_policy, user, old=old, obj=_rolled(old, patch))
    assert decision.applies and decision.errors == () and decision.denials, decision
    assert any(fragment in message for message in decision.denials), decision


def test_removing_the_mark_is_denied_and_others_are_left_alone(
    deployment_policy: Obj, accounts: dict[str, str]
) -> None:
    old = stored_deployment({"fractional.dev/replaces": "a"})
    removed = _rolled(
        old, {"spec": {"template": {"metadata": {"annotations": {"fractional.dev/replaces": None}}}}}
    )
    user = service_account_user(NAMESPACE, accounts["controller"])
    decision = _decide(deployment_policy, user, old=old, obj=removed)
    assert "the controller may not remove the annotation fractional.dev/replaces" in decision.denials
    someone = {"username": "alice", "groups": ["system:authenticated"]}
    assert not _decide(deployment_policy, someone, old=old, obj=removed).applies

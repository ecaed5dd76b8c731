"""Metrics over HTTP, and the ProvisioningRequest published for a gang that does not fit."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from driver.cluster.apiserver import APIServer
from driver.cluster.controllers import ControllerManager
from driver.controller import Controller, ReconcilerSettings
from driver.probes import ProbeServer
from tests.controller.conftest import Cluster, RunningController, gated_pod, gpu_claim, wait_for

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read().decode()


def test_metrics_and_healthz(cluster: Cluster) -> None:
    cluster.add_node("node-a", "l4-2x")
    cluster.create_claim(gpu_claim("m", memory="6Gi", compute=20))
    cluster.create_pod(gated_pod("m", ["m"]))
    instance = Controller(
        configuration=cluster.server.configuration(),
        settings=ReconcilerSettings(),
        metrics_refresh_seconds=0.05,
    )
    server = ProbeServer(
        host="127.0.0.1",
        port=0,
        checks={"/healthz": lambda: (instance.healthy(), "")},
        registry=instance.metrics.registry,
    )
    server.start()
    instance.start()
    try:
        wait_for(lambda: cluster.ungated("m"), what="allocated")
        base = f"http://127.0.0.1:{server.port}"
        assert _get(base + "/healthz") == (200, "ok\n")

        def scraped() -> str | None:
            text = _get(base + "/metrics")[1]
            return (
                text
                if 'node_gpu_memory_bytes{kind="allocated",node="node-a"} 6.442450944e+09' in text
                else None
            )

        text = wait_for(scraped, what="allocated memory gauge")
        assert 'fractional_controller_decisions_total{outcome="allocated"} 1.0' in text
        assert 'node_gpu_compute_percent{kind="allocated",node="node-a"} 20.0' in text
        assert 'node_gpu_compute_percent{kind="published",node="node-a"} 200.0' in text
        assert "fractional_controller_gate_to_ungate_seconds_count 1.0" in text
    finally:
        instance.stop()
        server.close()


def _podtemplates_served(cluster: Cluster) -> bool:
    try:
        cluster.core.list_namespaced_pod_template("default")
    except client.ApiException:
        return False
    return True


PROVISIONING = ("autoscaling.x-k8s.io", "v1", "default", "provisioningrequests")
CONSUME = "autoscaling.x-k8s.io/consume-provisioning-request"


def _requests(custom: client.CustomObjectsApi) -> list[dict[str, Any]]:
    return list(custom.list_namespaced_custom_object(*PROVISIONING)["items"])


def _answer(custom: client.CustomObjectsApi, name: str, *conditions: tuple[str, str, str]) -> None:
    """Write conditions as cluster-autoscaler 1.36 does (its status, metav1.Condition)."""
    stamp = "2026-12-06T08:00:00Z"
    body = {"status": {"conditions": [
        {"type": t, "status": v, "reason": r, "message": f"{t} {r}", "lastTransitionTime": stamp}
        for t, v, r in conditions
    ]}}  # fmt: skip
    custom.patch_namespaced_custom_object_status(*PROVISIONING[:3], PROVISIONING[3], name, body)


def test_provisioning_requests_for_an_unfit_gang_through_their_life(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    if not _podtemplates_served(cluster):
        pytest.skip("the API emulator does not serve core v1 podtemplates yet")
    cluster.add_node("node-a", "l4-2x")
    for i in range(3):
        cluster.create_claim(gpu_claim(f"pr-{i}", memory="16Gi", compute=None))
        cluster.create_pod(gated_pod(f"pr-{i}", [f"pr-{i}"], gang="pr", size=3))
    controller(provisioning_requests=True, hint_profiles=("l4-2x",), provisioning_retry_seconds=0.5)
    custom = client.CustomObjectsApi(cluster.api_client)

    (request,) = wait_for(lambda: _requests(custom), what="ProvisioningRequest")
    name = request["metadata"]["name"]
    assert name.endswith("-a0-p0")
    spec = request["spec"]
    assert spec["provisioningClassName"] == "best-effort-atomic-scale-up.autoscaling.x-k8s.io"
    # One podSet per pod, each naming that pod's own claim: cluster-autoscaler simulates three
    # claims, not one shared three times.
    assert [s["count"] for s in spec["podSets"]] == [1, 1, 1]
    named = set()
    for pod_set in spec["podSets"]:
        template = cluster.core.read_namespaced_pod_template(pod_set["podTemplateRef"]["name"], "default")
        (entry,) = template.template.spec.resource_claims
        named.add(entry.resource_claim_name)
    assert named == {"pr-0", "pr-1", "pr-2"}

    def annotated(request_name: str) -> bool:
        return all(
            (cluster.pod(f"pr-{i}")["metadata"].get("annotations") or {}).get(CONSUME) == request_name
            for i in range(3)
        )

    def _said(text: str) -> bool:
        return any(text in (e.get("message") or "") for e in cluster.events())

    wait_for(lambda: annotated(name), what="the consume-provisioning-request annotations")
    annotations = cluster.pod("pr-1")["metadata"]["annotations"]
    assert annotations["fractional.dev/provisioning-request"] == name
    assert json.loads(annotations["fractional.dev/scale-up-hint"]) == {"profile": "l4-2x", "nodes": 1}
    wait_for(
        lambda: any(
            "asked cluster-autoscaler for nodes" in (e.get("message") or "") for e in cluster.events()
        ),
        what="the Event naming the request",
    )

    # Accepted, not provisioned yet (it retries that itself): no second request.
    _answer(custom, name, ("Accepted", "True", "Accepted"), ("Provisioned", "False", "CapacityIsNotFound"))
    _answer(custom, name, ("Accepted", "True", "Accepted"), ("Provisioned", "True", "CapacityIsProvisioned"))
    wait_for(lambda: _said("CapacityIsProvisioned"), what="the Event saying the nodes are coming")
    assert [r["metadata"]["name"] for r in _requests(custom)] == [name]

    # The booking expired before the gang was placed: retired with its templates, asked again.
    _answer(
        custom, name, ("Accepted", "True", "Accepted"), ("Provisioned", "True", "CapacityIsProvisioned"),
        ("BookingExpired", "True", "CapacityReservationTimeExpired"),
    )  # fmt: skip
    (again,) = wait_for(
        lambda: [r for r in _requests(custom) if r["metadata"]["name"] != name], what="the second attempt"
    )
    second = again["metadata"]["name"]
    assert second.endswith("-a1-p0")
    assert [r["metadata"]["name"] for r in _requests(custom)] == [second]
    templates = {t.metadata.name for t in cluster.core.list_namespaced_pod_template("default").items}
    assert not any(t.startswith(name) for t in templates)
    wait_for(lambda: annotated(second), what="the pods naming the second attempt")

    # Failed is final for cluster-autoscaler: retired, asked again after a longer wait.
    _answer(custom, second, ("Accepted", "True", "Accepted"), ("Failed", "True", "FailedToCreatePods"))
    (third,) = wait_for(
        lambda: [r for r in _requests(custom) if r["metadata"]["name"].endswith("-a2-p0")], what="the third"
    )

    # The nodes came: the gang is placed and its request deleted.
    cluster.add_node("node-b", "l4-2x")
    wait_for(lambda: all(cluster.ungated(f"pr-{i}") for i in range(3)), what="the gang placed")
    wait_for(lambda: not _requests(custom), what="the request deleted once the gang was placed")
    wait_for(
        lambda: not cluster.core.list_namespaced_pod_template("default").items, what="its templates deleted"
    )
    assert third["metadata"]["name"].endswith("-a2-p0")


def test_the_requests_of_a_gang_go_with_its_pods(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    """They are owned by the gang's pods: the garbage collector (kube-controller-manager's, or the
    emulator's stand-in for it) removes them, and their templates, once the last pod is gone."""
    if not _podtemplates_served(cluster):
        pytest.skip("the API emulator does not serve core v1 podtemplates yet")
    cluster.add_node("node-a", "l4-2x")
    for i in range(3):
        cluster.create_claim(gpu_claim(f"gc-{i}", memory="16Gi", compute=None))
        cluster.create_pod(gated_pod(f"gc-{i}", [f"gc-{i}"], gang="gc", size=3))
    controller(provisioning_requests=True, hint_profiles=("l4-2x",))
    custom = client.CustomObjectsApi(cluster.api_client)
    (request,) = wait_for(lambda: _requests(custom), what="ProvisioningRequest")
    owners = {o["name"] for o in request["metadata"]["ownerReferences"]}
    assert owners == {"gc-0", "gc-1", "gc-2"}
    stand_in = (
        ControllerManager(cluster.server.configuration(), interval_seconds=0.05)
        if isinstance(cluster.server, APIServer)
        else contextlib.nullcontext()
    )
    with stand_in:
        for i in range(2):
            cluster.core.delete_namespaced_pod(f"gc-{i}", "default", grace_period_seconds=0)
        time.sleep(1.0)
        assert [r["metadata"]["name"] for r in _requests(custom)] == [request["metadata"]["name"]]
        cluster.core.delete_namespaced_pod("gc-2", "default", grace_period_seconds=0)
        wait_for(lambda: not _requests(custom), what="the request gone with the last pod", timeout=60)
        wait_for(
            lambda: not cluster.core.list_namespaced_pod_template("default").items,
            what="its templates gone too",
            timeout=60,
        )

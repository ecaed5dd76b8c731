"""Metrics over HTTP, and the ProvisioningRequest published for a gang that does not fit."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable

import pytest
from kubernetes import client

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


def test_provisioning_request_for_an_unfit_gang(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    if not _podtemplates_served(cluster):
        pytest.skip("the API emulator does not serve core v1 podtemplates yet")
    cluster.add_node("node-a", "l4-2x")
    for i in range(3):
        cluster.create_claim(gpu_claim(f"pr-{i}", memory="16Gi", compute=None))
        cluster.create_pod(gated_pod(f"pr-{i}", [f"pr-{i}"], gang="pr", size=3))
    controller(provisioning_requests=True, hint_profiles=("l4-2x",))
    custom = client.CustomObjectsApi(cluster.api_client)

    def requests() -> list[dict[str, object]]:
        body = custom.list_namespaced_custom_object(
            "autoscaling.x-k8s.io", "v1", "default", "provisioningrequests"
        )
        return list(body["items"])

    (request,) = wait_for(requests, what="ProvisioningRequest")
    spec = request["spec"]
    assert spec["provisioningClassName"] == "best-effort-atomic-scale-up.autoscaling.x-k8s.io"
    (pod_set,) = spec["podSets"]  # three pods of one shape
    assert pod_set["count"] == 3
    template = cluster.core.read_namespaced_pod_template(pod_set["podTemplateRef"]["name"], "default")
    assert template.template.spec.resource_claims[0].resource_claim_name == "pr-0"
    # The request is created first, then the pods are annotated: wait for the annotation.
    annotations = wait_for(
        lambda: (
            (a := cluster.pod("pr-1")["metadata"].get("annotations") or {}).get(
                "cluster-autoscaler.kubernetes.io/consume-provisioning-request"
            )
            and a
        ),
        what="the consume-provisioning-request annotation",
    )
    assert (
        annotations["cluster-autoscaler.kubernetes.io/consume-provisioning-request"]
        == request["metadata"]["name"]
    )
    assert json.loads(annotations["fractional.dev/scale-up-hint"]) == {"profile": "l4-2x", "nodes": 1}

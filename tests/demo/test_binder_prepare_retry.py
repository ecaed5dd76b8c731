"""The demo's kubelet stand-in retries NodePrepareResources as the kubelet does: a claim the node
agent refuses (seen in the demo's consolidation scene: a whole GPU allocated a moment after the
moved share's claim was released, while the share was still prepared for the evicted pod) leaves
the pod Pending with its containers in ContainerCreating, never Failed; a later pass prepares it
and the pod runs (tests/e2e/test_driver.py holds the real kubelet to the same: no pod ends Failed)."""

from __future__ import annotations

import threading
from typing import Any

from kubernetes import client

from driver.cluster.apiserver import APIServer
from driver.demo.binder import PodBinder
from driver.kube import as_dict
from tests.demo.test_binder_reserve import CLASS, NAMESPACE


class RefusingKubelet:
    """A node agent that refuses the first ``refusals`` prepares (over capacity), then prepares."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.prepares = 0

    def prepare(self, claims: list[dict[str, str]]) -> dict[str, Any]:
        self.prepares += 1
        if self.prepares <= self.refusals:
            return {c["uid"]: {"error": "device node-a/gpu-0: memory: over the capacity"} for c in claims}
        return {c["uid"]: {"devices": [{"cdi_device_ids": ["k8s.fractional.dev/gpu=x"]}]} for c in claims}

    def unprepare(self, claims: list[dict[str, str]]) -> dict[str, Any]:
        return {}


def _allocated_on_node_a(resource: client.ResourceV1Api, name: str) -> None:
    body = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": CLASS}}]}},
    }  # fmt: skip
    created = as_dict(resource.create_namespaced_resource_claim(NAMESPACE, body))
    result = {"request": "gpu", "driver": "fractional.dev", "pool": "node-a", "device": "gpu-0"}
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}
    allocation = {"devices": {"results": [result]}, "nodeSelector": {"nodeSelectorTerms": [term]},
                  "allocationTimestamp": "2026-11-30T10:00:00Z"}  # fmt: skip
    created["status"] = {"allocation": allocation}
    resource.replace_namespaced_resource_claim_status(name, NAMESPACE, created)


def _pod(claim: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": NAMESPACE},
        "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                 "containers": [{"name": "main", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}]},
    }  # fmt: skip


def _phase(core: client.CoreV1Api) -> tuple[str, str]:
    pod = as_dict(core.read_namespaced_pod("p", NAMESPACE))
    status = pod.get("status") or {}
    waiting = ((status.get("containerStatuses") or [{}])[0].get("state") or {}).get("waiting") or {}
    return str(status.get("phase")), str(waiting.get("reason", ""))


def test_a_refused_prepare_leaves_the_pod_pending_and_is_tried_again(api_server: APIServer) -> None:
    with client.ApiClient(api_server.configuration()) as api_client:
        core, resource = client.CoreV1Api(api_client), client.ResourceV1Api(api_client)
        _allocated_on_node_a(resource, "c")
        kubelet = RefusingKubelet(refusals=2)
        binder = PodBinder(api_server.configuration(), NAMESPACE, {"node-a": kubelet})
        core.create_namespaced_pod(NAMESPACE, _pod("c"))
        binder.sync_once(core, resource)  # bound, prepare refused
        assert _phase(core) == ("Pending", "ContainerCreating")
        assert binder.bound()["p"].error and kubelet.prepares == 1
        stop = threading.Event()
        for _ in range(200):  # the retry backs off: 0.5 s, then 1 s
            binder.sync_once(core, resource)
            if _phase(core)[0] == "Running" or stop.wait(0.05):
                break
        assert _phase(core) == ("Running", "")
        assert kubelet.prepares == 3 and binder.bound()["p"].error is None
        assert binder.bound()["p"].cdi_devices == ["k8s.fractional.dev/gpu=x"]
        for _ in range(3):
            binder.sync_once(core, resource)
        assert kubelet.prepares == 3  # prepared once it ran: never again

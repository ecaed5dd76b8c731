"""The demo's stand-in for kube-scheduler reserves a claim for the pod it binds as upstream's PreBind
does: only a claim not reserved for that pod yet (``resourceclaim.IsReservedForPod``) costs a status
update; one our controller reserved with its allocation costs none."""

from __future__ import annotations

from typing import Any

from kubernetes import client

from driver.cluster.apiserver import APIServer
from driver.demo.binder import PodBinder
from driver.kube import as_dict

NAMESPACE = "default"
POD_UID = "0b6f4a52-7c1e-4d55-9b8a-3f0f4f5b8e11"
CLASS = "gpu.fractional.dev"


def _claim(resource: client.ResourceV1Api, name: str, reserved_for: list[dict[str, str]]) -> dict[str, Any]:
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": CLASS}}]}},
    }
    created = as_dict(resource.create_namespaced_resource_claim(NAMESPACE, body))
    result = {"request": "gpu", "driver": "fractional.dev", "pool": "node-a", "device": "gpu-0"}
    created["status"] = {
        "allocation": {"devices": {"results": [result]}, "allocationTimestamp": "2026-11-30T10:00:00Z"}
    }
    if reserved_for:
        created["status"]["reservedFor"] = reserved_for
    return as_dict(resource.replace_namespaced_resource_claim_status(name, NAMESPACE, created))


def test_a_claim_already_reserved_for_the_pod_is_not_written_again(api_server: APIServer) -> None:
    with client.ApiClient(api_server.configuration()) as api_client:
        resource = client.ResourceV1Api(api_client)
        entry = {"resource": "pods", "name": "p", "uid": POD_UID}
        ours = _claim(resource, "ours", [entry])
        theirs = _claim(resource, "theirs", [])
        binder = PodBinder(api_server.configuration(), NAMESPACE, {})
        api_server.reset_counts()
        binder._reserve(resource, ours, "p", POD_UID)
        assert api_server.request_count("update", "resourceclaims/status") == 0
        binder._reserve(resource, theirs, "p", POD_UID)
        assert api_server.request_count("update", "resourceclaims/status") == 1
        stored = as_dict(resource.read_namespaced_resource_claim("theirs", NAMESPACE))
        assert stored["status"]["reservedFor"] == [entry]

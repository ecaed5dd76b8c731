"""The cache holds no managedFields (as kube-scheduler's informers): they are a third of a pod and
nothing here reads them. A write built from a cached object leaves them out, and the server keeps
the live ones: the claim's creator still owns its spec after our finalizer and allocation."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from driver.controller.model.objects import FIELD_MANAGER, allocated_by_us, kept_managed_fields
from driver.controller.view.cache import POD_STATUS_READ, ClusterCache, Kind
from tests.controller.conftest import NAMESPACE, Cluster, RunningController, gated_pod, gpu_claim, wait_for

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)


def test_an_object_is_held_without_its_managed_fields() -> None:
    cache = ClusterCache(topology_label="zone")
    entry = {
        "manager": "kubectl",
        "operation": "Update",
        "fieldsType": "FieldsV1",
        "fieldsV1": {"f:spec": {}},
    }
    pod: dict[str, Any] = {
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "uid": "u",
            "resourceVersion": "1",
            "managedFields": [entry],
        },
        "spec": {"containers": [{"name": "c"}]},
    }
    cache.apply(Kind.POD, "ADDED", pod)
    held = cache.get(Kind.POD, "ns/p")
    assert held is not None and "managedFields" not in held["metadata"]
    assert held["metadata"]["uid"] == "u" and held["spec"] == {"containers": [{"name": "c"}]}


def test_a_pods_status_is_held_as_far_as_the_controller_reads_it() -> None:
    """A running pod's conditions, container statuses and IPs were a quarter of it as held (4 of
    17 KiB, a pod of the 5,000-node fill) and nothing here reads them. What is read stays: the
    phase (terminated pods), the start time (consolidation's minimum runtime), the claims made
    from templates, and the nomination."""
    cache = ClusterCache(topology_label="zone")
    read = {
        "phase": "Running",
        "startTime": "2026-12-07T15:14:14Z",
        "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "p-gpu-x1"}],
        "nominatedNodeName": "node-a",
    }
    unread = {
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-12-07T15:14:14Z"}],
        "containerStatuses": [{"name": "c", "ready": True, "restartCount": 0, "image": "pause"}],
        "hostIP": "10.0.0.1", "podIP": "10.0.0.2", "podIPs": [{"ip": "10.0.0.2"}], "qosClass": "Burstable",
    }  # fmt: skip
    pod: dict[str, Any] = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u", "resourceVersion": "1"},
        "spec": {"containers": [{"name": "c"}], "nodeName": "node-a"},
        "status": {**read, **unread},
    }
    assert set(read) == set(POD_STATUS_READ)
    cache.apply(Kind.POD, "ADDED", pod)
    held = cache.get(Kind.POD, "ns/p")
    assert held is not None and held["status"] == read
    assert held["spec"] == {"containers": [{"name": "c"}], "nodeName": "node-a"}  # the spec whole

    pending: dict[str, Any] = {**pod, "metadata": {**pod["metadata"], "name": "q"}}
    pending["status"] = {"phase": "Pending"}
    cache.apply(Kind.POD, "ADDED", pending)
    held = cache.get(Kind.POD, "ns/q")
    assert held is not None and held["status"] == {"phase": "Pending"}


def _h100_slice(node: str, version: str = "1") -> dict[str, Any]:
    from driver.inventory import load_profile, resolve_profile
    from driver.slices import build_resource_slices

    (built,) = build_resource_slices(load_profile(resolve_profile("h100-8x"), node_name=node))
    body: dict[str, Any] = copy.deepcopy(built)  # as decoded from the wire: nothing shared yet
    body["metadata"] = {"name": f"{node}-slice", "uid": f"uid-{node}", "resourceVersion": version}
    return body


def test_slices_share_the_attribute_and_capacity_values_their_devices_publish_alike() -> None:
    """5,000 nodes of 8 GPUs held 118 KiB a node (decoded slices and the allocator's model);
    sharing the values every GPU of a model publishes alike brought it to 52 KiB. What differs
    per device (its UUID) stays its own, and an updated slice changes nothing another holds."""
    cache = ClusterCache(topology_label="zone")
    for node in ("a", "b"):
        cache.apply(Kind.SLICE, "ADDED", _h100_slice(node))
    devices = [d for key in ("a-slice", "b-slice")
               for d in (cache.get(Kind.SLICE, key) or {})["spec"]["devices"]
               if d["name"].startswith("gpu-")]  # fmt: skip
    assert len(devices) == 16
    first = devices[0]
    for device in devices[1:]:
        assert device["attributes"]["productName"] is first["attributes"]["productName"]
        assert device["capacity"]["memory"] is first["capacity"]["memory"]
    assert len({d["attributes"]["uuid"]["string"] for d in devices[:8]}) == 8  # one node's own
    model = {device.name: device for device in cache.state._slices["a-slice"].devices}
    assert model["gpu-0"].attributes["productName"] is model["gpu-1"].attributes["productName"]

    updated = _h100_slice("b", version="2")
    updated["spec"]["devices"][0]["attributes"]["productName"] = {"string": "NVIDIA H200"}
    cache.apply(Kind.SLICE, "MODIFIED", updated)
    held_b = (cache.get(Kind.SLICE, "b-slice") or {})["spec"]["devices"][0]
    held_a = (cache.get(Kind.SLICE, "a-slice") or {})["spec"]["devices"][0]
    assert held_b["attributes"]["productName"] == {"string": "NVIDIA H200"}
    assert held_a["attributes"]["productName"] == {"string": "NVIDIA H100 80GB HBM3"}


def test_writes_from_the_trimmed_cache_keep_the_servers_managed_fields(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    cluster.add_node("node-a", "h100-8x")
    cluster.resource.create_namespaced_resource_claim(
        NAMESPACE, gpu_claim("kept", memory="12Gi", compute=15), field_manager="tenant"
    )
    cluster.create_pod(gated_pod("kept-pod", ["kept"]))
    controller()
    wait_for(lambda: cluster.ungated("kept-pod"), what="gate removed")
    claim = cluster.claim("kept")
    assert claim is not None and claim["status"]["allocation"]
    entries = claim["metadata"]["managedFields"]
    spec_owners = {e["manager"] for e in entries if "f:spec" in (e.get("fieldsV1") or {})}
    assert "tenant" in spec_owners, entries  # the creator's entry outlived our PUT without it
    assert any(e.get("subresource") == "status" and e["manager"] != "tenant" for e in entries), entries
    ours = [e for e in entries if e["manager"] == FIELD_MANAGER]  # every write of ours names it
    assert [e.get("subresource") for e in ours] == ["status"], entries
    assert "f:allocation" in ours[0]["fieldsV1"]["f:status"], entries
    cache = ClusterCache(topology_label="zone")
    cache.apply(Kind.CLAIM, "ADDED", copy.deepcopy(claim))
    held = cache.get(Kind.CLAIM, f"{NAMESPACE}/kept")  # kept of them: the one fact read
    assert held is not None and held["metadata"]["managedFields"] == kept_managed_fields(claim) != []
    assert allocated_by_us(held) and allocated_by_us(claim)

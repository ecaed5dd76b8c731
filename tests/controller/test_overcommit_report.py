"""An overcommitted device is reported: two allocators (ours and kube-scheduler) can
each fit a share on a device the other just filled; the controller sums what the allocated claims
consume per device against what it publishes, puts a Warning Event on each claim involved, and
exports a gauge; once per change, not on every refresh."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest

from driver.controller import Controller, ReconcilerSettings
from driver.controller.sizing.overcommit import compute_overcommits
from tests.controller.conftest import NAMESPACE, Cluster, gpu_claim, wait_for

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)

GI = 1 << 30


def allocation(device: str, memory: str, *, node: str = "node-a", share: bool = True) -> dict[str, Any]:
    result: dict[str, Any] = {"request": "gpu", "driver": "fractional.dev", "pool": node, "device": device}
    if share:
        result |= {"shareID": str(uuid.uuid4()), "consumedCapacity": {"memory": memory, "compute": "0"}}
    return {
        "devices": {"results": [result]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
    }  # fmt: skip


def allocate_directly(cluster: Cluster, name: str, device: str, memory: str) -> None:
    """As another allocator would: the claim's status written without our controller."""
    claim = cluster.create_claim(gpu_claim(name, memory=memory, compute=None))
    claim["status"] = {"allocation": allocation(device, memory)}
    cluster.resource.replace_namespaced_resource_claim_status(name, NAMESPACE, claim)


def overcommitted_events(cluster: Cluster) -> list[dict[str, Any]]:
    return [e for e in cluster.events() if e["reason"] == "DeviceOvercommitted"]


def a_slice(memory: str) -> dict[str, Any]:
    return {"spec": {"driver": "fractional.dev", "pool": {"name": "node-a"}, "nodeName": "node-a",
                     "devices": [{"name": "gpu-0", "capacity": {"memory": {"value": memory},
                                                                "compute": {"value": "100"}}}]}}  # fmt: skip


def a_claim(name: str, alloc: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"namespace": NAMESPACE, "name": name}, "status": {"allocation": alloc}}


@pytest.mark.parametrize(
    ("claims", "expected"),
    [
        ([("a", allocation("gpu-0", "12Gi")), ("b", allocation("gpu-0", "12Gi"))], []),  # exactly full
        ([("a", allocation("gpu-0", "16Gi")), ("b", allocation("gpu-0", "16Gi"))], [("memory", 32 * GI)]),
        (
            [("a", allocation("gpu-0", "4Gi", share=False)), ("b", allocation("gpu-0", "4Gi"))],
            [("exclusive", 2)],
        ),
        ([("a", allocation("gpu-9", "99Gi"))], []),  # a device no slice publishes: nothing to compare
    ],
)
def test_compute_overcommits(
    claims: list[tuple[str, dict[str, Any]]], expected: list[tuple[str, int]]
) -> None:
    found = compute_overcommits([a_slice("24Gi")], [a_claim(n, a) for n, a in claims])
    assert [(o.dimension, int(o.consumed)) for o in found] == expected
    for overcommit in found:
        assert overcommit.claims == tuple(f"{NAMESPACE}/{n}" for n, _ in claims)
        assert "fractional.dev/node-a/gpu-0" in overcommit.describe()


def test_only_the_devices_asked_about_are_compared() -> None:
    """A commit checks its own devices (``only``): the answer is the full one, cut to them."""
    two = a_slice("24Gi")
    two["spec"]["devices"].append({"name": "gpu-1", "capacity": {"memory": {"value": "24Gi"}}})
    claims = [a_claim(f"c{i}", allocation(f"gpu-{i % 2}", "16Gi")) for i in range(4)]
    everything = compute_overcommits([two], claims)
    assert {o.device[2] for o in everything} == {"gpu-0", "gpu-1"}
    ours = ("fractional.dev", "node-a", "gpu-1")
    assert compute_overcommits([two], claims, only=[ours]) == tuple(o for o in everything if o.device == ours)
    assert compute_overcommits([two], claims, only=[]) == ()


@pytest.mark.timeout(60)
def test_overcommit_reported_once_on_each_claim(cluster: Cluster) -> None:
    cluster.add_node("node-a", "l4-2x")  # L4s: 22Gi usable each, published as one shared device
    instance = Controller(
        configuration=cluster.server.configuration(),
        settings=ReconcilerSettings(),
        metrics_refresh_seconds=0.01,
    )
    refreshes = [0]
    refreshed = threading.Condition()
    original = instance.refresh_metrics

    def counting() -> None:
        original()
        with refreshed:
            refreshes[0] += 1

    instance.refresh_metrics = counting  # type: ignore[method-assign]
    instance.start()
    try:
        allocate_directly(cluster, "one", "gpu-0", "16Gi")
        allocate_directly(cluster, "two", "gpu-0", "16Gi")
        events = wait_for(lambda: len(overcommitted_events(cluster)) >= 2 and overcommitted_events(cluster),
                          what="DeviceOvercommitted on both claims")  # fmt: skip
        assert sorted(e["involvedObject"]["name"] for e in events) == ["one", "two"]
        assert all(e["involvedObject"]["kind"] == "ResourceClaim" and e["type"] == "Warning" for e in events)
        assert "gpu-0" in events[0]["message"] and "memory" in events[0]["message"]
        gauge = instance.metrics.overcommitted_devices
        assert wait_for(lambda: gauge._value.get() == 1, what="the gauge at 1")
        seen = refreshes[0]
        wait_for(lambda: refreshes[0] >= seen + 5, what="five more refreshes")
        again = overcommitted_events(cluster)
        assert len(again) == 2 and all(e.get("count", 1) == 1 for e in again)  # not said again
        cluster.resource.delete_namespaced_resource_claim("two", NAMESPACE)
        wait_for(lambda: gauge._value.get() == 0, what="the gauge back to 0")
    finally:
        instance.stop()

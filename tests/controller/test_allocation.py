"""The controller against the API emulator: allocate, ungate, gangs, release, conflicts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from driver.controller import FINALIZER
from driver.controller.objects import allocation_node
from tests.controller.conftest import Cluster, RunningController, gated_pod, gpu_claim, wait_for


def test_gated_pod_with_a_share_is_allocated_and_ungated(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    cluster.add_node("node-a", "h100-8x")
    cluster.create_claim(gpu_claim("share", memory="12Gi", compute=15))
    cluster.create_pod(gated_pod("app", ["share"]))
    controller()
    wait_for(lambda: cluster.ungated("app"), what="gate removed")
    claim = cluster.claim("share")
    assert claim is not None
    allocation = claim["status"]["allocation"]
    assert allocation_node(allocation) == "node-a"
    (result,) = allocation["devices"]["results"]
    assert result["consumedCapacity"]["memory"] == "12Gi"
    assert result["consumedCapacity"]["compute"] == "15"
    assert FINALIZER in claim["metadata"]["finalizers"]


def _gang(
    cluster: Cluster, name: str, pods: int, *, memory: str = "16Gi", size: int | None = None
) -> list[str]:
    names = []
    for i in range(pods):
        cluster.create_claim(gpu_claim(f"{name}-{i}", memory=memory, compute=None))
        cluster.create_pod(gated_pod(f"{name}-{i}", [f"{name}-{i}"], gang=name, size=size or pods))
        names.append(f"{name}-{i}")
    return names


def test_gang_waits_for_its_size_then_spans_two_nodes(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    cluster.add_node("node-a", "l4-2x")
    cluster.add_node("node-b", "l4-2x")
    # 16Gi of a 22Gi L4: one share per GPU, so four pods need all four GPUs of both nodes.
    names = _gang(cluster, "train", 3, size=4)
    controller()
    probe = "probe"
    cluster.create_claim(gpu_claim(probe, memory="1Gi", compute=None))
    cluster.create_pod(gated_pod(probe, [probe]))
    wait_for(
        lambda: cluster.ungated(probe), what="probe pod allocated"
    )  # the controller has looked at the gang
    assert not any(cluster.allocated(n) for n in names), "a gang of 4 with 3 pods must wait"
    cluster.core.delete_namespaced_pod(probe, "default")
    wait_for(lambda: not cluster.allocated(probe), what="probe released")
    names += _gang_member(cluster, "train", 3, size=4)
    wait_for(lambda: all(cluster.ungated(n) for n in names), what="gang ungated")
    placements = [_placement(cluster, n) for n in names]
    assert {node for node, _ in placements} == {"node-a", "node-b"}
    assert len(set(placements)) == 4  # four distinct GPUs


def _gang_member(cluster: Cluster, name: str, index: int, *, size: int) -> list[str]:
    cluster.create_claim(gpu_claim(f"{name}-{index}", memory="16Gi", compute=None))
    cluster.create_pod(gated_pod(f"{name}-{index}", [f"{name}-{index}"], gang=name, size=size))
    return [f"{name}-{index}"]


def _placement(cluster: Cluster, claim_name: str) -> tuple[str | None, str]:
    claim = cluster.claim(claim_name)
    assert claim is not None
    allocation = claim["status"]["allocation"]
    (result,) = allocation["devices"]["results"]
    return allocation_node(allocation), result["device"]


def test_gang_that_does_not_fit_is_all_or_nothing(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    cluster.add_node("node-a", "l4-2x")
    cluster.add_node("node-b", "l4-2x")
    names = _gang(cluster, "big", 5)  # five 16Gi shares, four GPUs
    controller(hint_profiles=("l4-2x",))
    event = wait_for(lambda: _unschedulable_events(cluster), what="GangUnschedulable event")
    assert not any(cluster.allocated(n) for n in names)
    assert not any(cluster.has_finalizer(n) for n in names)
    assert not any(cluster.ungated(n) for n in names)
    assert len(event) == 1
    assert event[0]["involvedObject"]["name"] == "big-0"


def _unschedulable_events(cluster: Cluster) -> list[dict[str, Any]]:
    return [e for e in cluster.events() if e["reason"] == "GangUnschedulable"]

"""The controller against the API emulator: allocate, ungate, gangs, release, conflicts."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from driver.controller import FINALIZER, HINT_ANNOTATION
from driver.controller.model.objects import allocated_by_us, allocation_node
from tests.controller.conftest import Cluster, RunningController, gated_pod, gpu_claim, wait_for

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)


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
    assert FINALIZER not in (claim["metadata"].get("finalizers") or ())  # ours by its field manager:
    assert allocated_by_us(claim)  # the server lists status.allocation under fractional-dra-controller


def test_the_written_allocation_carries_its_allocation_timestamp(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    """Learned on the real kube-scheduler 1.37.2: its PreBind stamps an allocation that has no
    ``allocationTimestamp`` (DRADeviceBindingConditions is on by default) in the same status update
    that reserves the claim for the pod; the apiserver refuses it ("status.allocation: field cannot
    be modified once set"), and every pod we ungated stayed Pending. So we stamp it ourselves."""
    cluster.add_node("node-a", "h100-8x")
    cluster.create_claim(gpu_claim("stamped", memory="4Gi", compute=5))
    cluster.create_pod(gated_pod("app", ["stamped"]))
    before = datetime.now(UTC).replace(microsecond=0)
    controller()
    wait_for(lambda: cluster.ungated("app"), what="gate removed")
    claim = cluster.claim("stamped")
    assert claim is not None
    stamp = datetime.fromisoformat(claim["status"]["allocation"]["allocationTimestamp"])
    assert before <= stamp <= datetime.now(UTC)


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


def test_unfit_gang_gets_one_event_and_a_hint_that_really_fits(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    cluster.add_node("node-a", "l4-2x")
    names = _gang(cluster, "train", 4)  # needs four L4-sized GPUs, the cluster has two
    controller(hint_profiles=("l4-2x", "a100-pcie-4x", "h100-8x"))
    hint = wait_for(
        lambda: (
            all(HINT_ANNOTATION in (cluster.pod(n)["metadata"].get("annotations") or {}) for n in names)
            and json.loads(cluster.pod(names[0])["metadata"]["annotations"][HINT_ANNOTATION])
        ),
        what="scale-up hint on every pod",
    )
    assert hint == {"profile": "l4-2x", "nodes": 1}  # two more L4s: the smallest node that fits
    (event,) = _unschedulable_events(cluster)
    assert event["type"] == "Warning"
    assert "4 shares of >=16Gi" in event["message"]
    assert "best node node-a offers room for 2 of 4 pods (2 devices)" in event["message"]
    assert not any(cluster.allocated(n) for n in names)
    # Follow the hint: add that many nodes of that profile, and the gang goes through.
    for i in range(hint["nodes"]):
        cluster.add_node(f"added-{i}", hint["profile"])
    wait_for(lambda: all(cluster.ungated(n) for n in names), what="gang allocated on the added node")
    assert {_placement(cluster, n)[0] for n in names} == {"node-a", "added-0"}
    assert len(_unschedulable_events(cluster)) == 1  # never re-emitted while nothing changed
    assert not any(HINT_ANNOTATION in (cluster.pod(n)["metadata"].get("annotations") or {}) for n in names)


def test_a_joining_node_tainted_not_ready_is_not_named_as_the_best_offer(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    """A Node is created tainted node.kubernetes.io/not-ready (kube-apiserver's admission) until its
    kubelet reports: seen on the real apiserver, where a gang's Event named such a node as its best
    offer although the planner rightly kept the gang off it. Here a taint of our own stands for it:
    a real kube-controller-manager lifts not-ready from a Node that has no kubelet condition."""
    cluster.add_node("node-a", "l4-2x")
    cluster.add_node("joining", "h100-8x")  # room for the whole gang, but not schedulable yet
    cluster.core.patch_node(
        "joining", {"spec": {"taints": [{"key": "example.com/joining", "effect": "NoSchedule"}]}}
    )
    names = _gang(cluster, "train", 4)
    controller()
    (event,) = wait_for(lambda: _unschedulable_events(cluster), what="the gang's Event")
    assert "best node node-a offers room for 2 of 4 pods" in event["message"], event["message"]
    assert "joining" not in event["message"]
    assert not any(cluster.allocated(n) for n in names)


def test_the_hint_counts_only_the_nodes_the_gang_may_use(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    """A gang kept off a node (here by its taint; a nodeSelector to one node group does the same)
    must not count that node's room: seen with the real cluster-autoscaler, where a gang of 5 kept
    to its group was hinted 1 node although 2 were needed."""
    cluster.add_node("node-a", "l4-2x")
    cluster.add_node("elsewhere", "l4-2x")  # two free L4s the gang may not use
    cluster.core.patch_node(
        "elsewhere", {"spec": {"taints": [{"key": "example.com/other-team", "effect": "NoSchedule"}]}}
    )
    names = _gang(cluster, "train", 6)  # six L4-sized shares: node-a's two, then four more
    controller(hint_profiles=("l4-2x",))
    hint = wait_for(
        lambda: (
            HINT_ANNOTATION in (cluster.pod(names[0])["metadata"].get("annotations") or {})
            and json.loads(cluster.pod(names[0])["metadata"]["annotations"][HINT_ANNOTATION])
        ),
        what="the gang's scale-up hint",
    )
    assert hint == {"profile": "l4-2x", "nodes": 2}, hint


def test_deleted_claim_releases_its_share_and_goes_away(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    cluster.add_node("node-a", "l4-2x")
    cluster.create_claim(gpu_claim("gone", memory="20Gi", compute=None))
    cluster.create_pod(gated_pod("gone", ["gone"]))
    controller()
    wait_for(lambda: cluster.ungated("gone"), what="allocated")
    cluster.server.reset_counts()
    cluster.resource.delete_namespaced_resource_claim("gone", "default")
    wait_for(lambda: cluster.claim("gone") is None, what="claim deleted")
    # No write: the claim carries no finalizer of ours, and its allocation goes with the object
    # (on a cluster the chart's claims-in-use policy refuses the delete while a pod holds it).
    assert cluster.server.request_count("update", "resourceclaims/status") == 0
    assert cluster.server.request_count("update", "resourceclaims") == 0
    # Its share is free again: two more 20Gi shares fit on the node's two L4s.
    for name in ("next-0", "next-1"):
        cluster.create_claim(gpu_claim(name, memory="20Gi", compute=None))
        cluster.create_pod(gated_pod(name, [name]))
    wait_for(lambda: cluster.ungated("next-0") and cluster.ungated("next-1"), what="freed share reused")


def test_conflict_on_status_write_is_decided_again(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    cluster.add_node("node-a", "l4-2x")
    cluster.create_claim(gpu_claim("c", memory="4Gi"))
    cluster.create_pod(gated_pod("p", ["c"]))
    cluster.server.inject_fault(verb="update", resource="resourceclaims/status", status=409)
    cluster.server.reset_counts()
    controller()
    wait_for(lambda: cluster.ungated("p"), what="allocated after the conflict")
    assert cluster.server.request_count("update", "resourceclaims/status") == 2
    claim = cluster.claim("c")
    assert claim is not None and claim["status"]["allocation"]
    assert not claim["metadata"].get("finalizers") and allocated_by_us(claim)


def test_claim_from_a_template_is_found_through_the_pod_status(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    cluster.add_node("node-a", "l4-2x")
    cluster.create_pod(gated_pod("tpl", [], templates=["gpu-template"]))
    controller()
    # What kube-controller-manager would do: create the claim, then record it in the pod status.
    cluster.create_claim(gpu_claim("tpl-t0-abcde", memory="2Gi"))
    pod = cluster.pod("tpl")
    pod["status"] = {"resourceClaimStatuses": [{"name": "t0", "resourceClaimName": "tpl-t0-abcde"}]}
    cluster.core.replace_namespaced_pod_status("tpl", "default", pod)
    wait_for(lambda: cluster.ungated("tpl"), what="pod with a template claim ungated")
    assert cluster.allocated("tpl-t0-abcde")


def test_pod_that_fits_no_node_cpu_is_not_allocated(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    cluster.add_node("a-small", "l4-2x", cpu="2")
    cluster.add_node("b-large", "l4-2x", cpu="64")
    cluster.create_claim(gpu_claim("cpu-heavy", memory="2Gi"))
    cluster.create_pod(gated_pod("cpu-heavy", ["cpu-heavy"], cpu="8"))
    controller()
    wait_for(lambda: cluster.ungated("cpu-heavy"), what="allocated")
    assert _placement(cluster, "cpu-heavy")[0] == "b-large"


def test_a_gated_pod_without_claims_is_pinned_to_the_node_we_chose_as_its_gate_comes_off(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    """A namespace opted in (fractional.dev/placement=all-pods) has its pods without claims gated:
    we choose the node (best-fit: where GPUs are taken already) and pin the pod there with a
    nodeSelector on the node's hostname label, in the same write that removes the gate (a gated
    pod may narrow where it runs; the emulator, like kube-apiserver, allows only additions)."""
    cluster.add_node("node-a", "l4-2x")
    cluster.add_node("node-b", "l4-2x")
    cluster.create_claim(gpu_claim("whole", memory=None, compute=None, count=2))
    whole = gated_pod("whole", ["whole"])
    whole["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "node-b"}
    cluster.create_pod(whole)
    controller()
    wait_for(lambda: cluster.ungated("whole"), what="the GPU pod placed")
    cluster.create_pod(gated_pod("cpu-only", [], cpu="2"))
    wait_for(lambda: cluster.ungated("cpu-only"), what="the pod without claims ungated")
    assert cluster.pod("cpu-only")["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "node-b"}


def test_a_gated_pod_without_claims_that_fits_nowhere_waits_with_an_event_naming_cpu(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    cluster.add_node("node-a", "l4-2x", cpu="2")
    cluster.create_pod(gated_pod("too-big", [], cpu="8"))
    controller()
    (event,) = wait_for(
        lambda: [e for e in cluster.events() if e["reason"] == "GangUnschedulable"][-1:],
        what="an Event for the pod without claims",
    )
    assert "CPU" in event["message"] or "cpu" in event["message"], event["message"]
    assert not cluster.ungated("too-big")

"""The decider under ``--policy fragmentation``, where the model's answer stands in for a search.

An empty ranking means "fits nowhere", and the decider then searches no further. That is exact only
for devices the model sees: it scores GPU memory, so it leaves out devices without memory capacity
(the NICs of every GPU node here). A pod asking for one NIC was once answered "devices do not fit"
on a cluster full of free NICs. When no node with room takes a pod, the model also says on which
nodes without room its devices would fit, so the decider searches only those to name what is short.

The model scores shares that ask for memory only. A burst of the usual share, memory and compute
(the demo's 12Gi / 15 %), once skipped the burst's packing under this policy and was decided pod by
pod: six shares took four GPUs where best-fit packs them on two.
"""

from __future__ import annotations

import copy
from typing import Any

from driver.controller.gangs.burst import decide_all
from driver.controller.gangs.decide import Decision
from driver.controller.gangs.plan import plan_gang
from driver.controller.view.cache import ClusterCache, Kind
from tests.controller.conftest import NAMESPACE, gated_pod, gpu_claim
from tests.controller.test_node_room import _bind, _cluster, _stamp
from tests.controller.test_node_room import _decide as _decide_with


def _decide(cache: ClusterCache, claim: dict[str, Any], pod: dict[str, Any]) -> Decision:
    return _decide_with(cache, claim, pod, policy="fragmentation")


def _learned(nodes: list[tuple[str, str, str]]) -> ClusterCache:
    """A cluster whose controller has seen 32 pods of one 4Gi share arrive (none placed)."""
    cache = _cluster(nodes)
    cache.learn_workload = True
    for _ in range(32):
        cache.state.learn([gpu_claim("seen", memory="4Gi", compute=None)], cpu_millis=1000)
    assert cache.state.workload.typical(), "the workload is learned"
    return cache


def _nic_claim(name: str) -> dict[str, Any]:
    exactly = {"deviceClassName": "nic.fractional.dev"}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"devices": {"requests": [{"name": "nic", "exactly": exactly}]}}}  # fmt: skip


def test_a_pod_of_one_nic_is_placed_though_the_model_sees_no_nics() -> None:
    cache = _learned([("a", "h100-8x", "64"), ("b", "h100-8x", "64")])
    decision = _decide(cache, _nic_claim("nic"), gated_pod("nic-pod", ["nic"]))
    assert decision.outcome == "allocated", decision.reason
    [(_, allocation)] = decision.allocations
    [result] = allocation["devices"]["results"]
    assert result["device"].startswith("nic-")


def test_the_short_resource_is_named_where_the_devices_fit() -> None:
    cache = _learned([("a", "l4-2x", "4"), ("b", "l4-2x", "4")])
    decision = _decide(
        cache, gpu_claim("big-cpu", memory="4Gi", compute=None), gated_pod("p", ["big-cpu"], cpu="8")
    )
    assert decision.outcome == "unschedulable"
    assert decision.short_of == "CPU"
    assert "node CPU is short where the devices fit" in decision.reason
    assert "cpu 8000m > 4000m free" in decision.reason


def test_devices_that_fit_no_node_are_said_so_even_where_cpu_is_short() -> None:
    cache = _learned([("a", "l4-2x", "4"), ("b", "l4-2x", "4")])
    too_big = gpu_claim("too-big", memory="40Gi", compute=None)  # an L4 has 24Gi
    decision = _decide(cache, too_big, gated_pod("p", ["too-big"], cpu="8"))
    assert decision.outcome == "unschedulable"
    assert decision.reason == "devices do not fit"


def test_the_node_named_short_is_one_the_devices_fit() -> None:
    # Node a's two GPUs are taken whole; b's take the share but b lacks the CPU: b is the node named.
    cache = _learned([("a", "l4-2x", "16"), ("b", "l4-2x", "4")])
    for index in range(2):
        pod = gated_pod(f"whole-{index}", [f"whole-{index}"], cpu="0")
        pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "a"}
        decision = _decide(cache, gpu_claim(f"whole-{index}", memory=None, compute=None), pod)
        assert decision.pod_nodes and decision.pod_nodes[0][1] == "a", decision.reason
        _bind(cache, pod, "a")
    decision = _decide(
        cache, gpu_claim("wide", memory="20Gi", compute=None), gated_pod("w", ["wide"], cpu="8")
    )
    assert decision.outcome == "unschedulable"
    assert "node CPU is short where the devices fit (b:" in decision.reason, decision.reason


def _burst(cache: ClusterCache, count: int, policy: str) -> list[tuple[str, str]]:
    """``count`` pods of one 12Gi / 15 % share decided in one pass: the (node, GPU) of each."""
    plans = []
    for index in range(count):
        pod = gated_pod(f"infer-{index}", [f"infer-{index}"])
        cache.apply(Kind.CLAIM, "ADDED", _stamp(gpu_claim(f"infer-{index}", memory="12Gi", compute=15)))
        cache.apply(Kind.POD, "ADDED", _stamp(copy.deepcopy(pod)))
        plans.append(plan_gang(cache, cache.gang_key(pod)))
    placed = []
    for decision in decide_all(cache, plans, policy=policy):
        assert isinstance(decision, Decision) and decision.outcome == "allocated"
        [(_, allocation)] = decision.allocations
        [result] = allocation["devices"]["results"]
        placed.append((result["pool"], result["device"]))
    return placed


def test_a_burst_of_shares_the_model_does_not_score_packs_as_under_best_fit() -> None:
    nodes = [("b", "a100-pcie-4x", "64"), ("c", "l4-2x", "64")]
    best_fit = _burst(_cluster(nodes), 6, "best-fit")
    assert len(set(best_fit)) == 2  # 3 shares of 12Gi on each 40Gi A100
    assert _burst(_cluster(nodes), 6, "fragmentation") == best_fit
    assert _burst(_learned(nodes), 6, "fragmentation") == best_fit


def test_the_cache_reports_each_change_of_a_nodes_free_cpu_to_the_ranking() -> None:
    # The ranking keeps nodes grouped by devices and free CPU; a node whose CPU a bound pod takes
    # must move, or the ranking would offer a node without the CPU (rank_index).
    nodes = [(name, "l4-2x", "16") for name in ("a", "b", "c")]
    cache = _learned(nodes)
    claims = [gpu_claim("probe", memory="4Gi", compute=None)]

    def ranked(cpu_free: Any) -> list[str] | None:
        return cache.state.rank_nodes(claims, cpu_millis=4000, cpu_free=cpu_free)

    before = ranked(cache.cpu_free)
    assert before == ranked(lambda node: cache.cpu_free(node)) and before is not None and len(before) == 3
    busy = gated_pod("busy", [], cpu="14")
    cache.apply(Kind.POD, "ADDED", _stamp(copy.deepcopy(busy)))
    _bind(cache, busy, before[0])
    after = ranked(cache.cpu_free)
    assert after == ranked(lambda node: cache.cpu_free(node))
    assert after is not None and before[0] not in after  # 2 CPUs left there, the pod asks 4

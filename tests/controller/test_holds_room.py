"""A hold keeps a node's CPU, memory and pod slot, not only its devices.

A consolidation reserves a place for each moved pod's replacement, and a preemption or a
consolidation nominates nodes for the waiting gang. Both used to hold only the devices: another pod
whose devices fitted beside them could take the node's CPU, and the replacement (or the gang) then
found its devices kept for it on a node that could no longer run it. kube-scheduler counts a
nominated pod's requests on its node for the same reason.
"""

from __future__ import annotations

import copy
from typing import Any

from kubernetes import client

from driver.controller.gangs.burst import decide_all
from driver.controller.gangs.decide import Decision
from driver.controller.gangs.plan import plan_gang
from driver.controller.model.objects import GangKey, Resources
from driver.controller.preemption.preemptor import Nomination, Preemptor, Reservation, gang_room
from driver.controller.view.cache import ClusterCache, Kind
from tests.controller.conftest import gated_pod, gpu_claim
from tests.controller.test_node_room import _cluster, _stamp

OWNER = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web", "uid": "rs-web", "controller": True}


def _decide(preemptor: Preemptor, claim: dict[str, Any], pod: dict[str, Any]) -> Decision:
    cache = preemptor.cache
    cache.apply(Kind.CLAIM, "ADDED", _stamp(copy.deepcopy(claim)))
    cache.apply(Kind.POD, "ADDED", _stamp(copy.deepcopy(pod)))
    with cache.lock:
        [decision] = preemptor.decide_all(
            [plan_gang(cache, cache.gang_key(pod))], policy="best-fit", decide_all=decide_all
        )
    assert isinstance(decision, Decision)
    return decision


def _nodes(decision: Decision) -> list[str | None]:
    return [node for _, node in decision.pod_nodes]


def _preemptor(cache: ClusterCache) -> Preemptor:
    return Preemptor(cache=cache, configuration=client.Configuration(), clock=lambda: 100.0)


def test_a_reservation_keeps_the_replacements_cpu_and_the_replacement_takes_it() -> None:
    preemptor = _preemptor(_cluster([("a", "l4-2x", "8"), ("b", "l4-2x", "8")]))
    preemptor.reservations["gang:web-0"] = Reservation(
        owner_uid="rs-web", node="a", allocations=(), deadline=400.0, gang=GangKey("default/big"),
        room=Resources(6000, 1 << 30, 1),
    )  # fmt: skip
    # Alone, best-fit takes the first of two equal nodes, a; with 6 of a's 8 CPUs kept, only b has 4.
    other = _decide(preemptor, gpu_claim("other", memory="4Gi"), gated_pod("other", ["other"], cpu="4"))
    assert other.outcome == "allocated", other.reason
    assert _nodes(other) == ["b"]
    # b has 4 CPUs left, a has 2 beside the kept 6: a 5-CPU pod fits nowhere, and says so.
    third = _decide(preemptor, gpu_claim("third", memory="4Gi"), gated_pod("third", ["third"], cpu="5"))
    assert third.outcome == "unschedulable"
    assert third.short_of == "CPU"
    # The replacement (a new pod of the same ReplicaSet) takes the place kept for it.
    replacement = gated_pod("web-1", ["web-1"], cpu="6")
    replacement["metadata"]["ownerReferences"] = [OWNER]
    placed = _decide(preemptor, gpu_claim("web-1", memory="4Gi"), replacement)
    assert placed.outcome == "allocated", placed.reason
    assert _nodes(placed) == ["a"]
    assert list(preemptor.taken.values()) == ["gang:web-0"]
    # Placed, its requests count on a once (the reservation it took is not held beside them): the
    # 2 CPUs left there are free for another pod.
    cache = preemptor.cache
    with cache.lock, preemptor.holding_all():
        assert cache.nodes_without_room(Resources(2000, 0, 1)) == frozenset()
        assert cache.nodes_without_room(Resources(3000, 0, 1)) == {"a"}


def test_a_replacement_whose_kept_node_lost_its_cpu_waits_instead_of_overflowing_it() -> None:
    """What kube-scheduler places itself (a pod without our claims) does not see our holds: when it
    takes the CPU, the replacement is not allocated devices on a node it cannot run on."""
    cache = _cluster([("a", "l4-2x", "8")])
    preemptor = _preemptor(cache)
    preemptor.reservations["gang:web-0"] = Reservation(
        owner_uid="rs-web", node="a", allocations=(), deadline=400.0, gang=GangKey("default/big"),
        room=Resources(6000, 1 << 30, 1),
    )  # fmt: skip
    squatter = gated_pod("squatter", [], cpu="4")
    squatter["spec"].pop("schedulingGates")
    squatter["spec"]["nodeName"] = "a"
    cache.apply(Kind.POD, "ADDED", _stamp(squatter))
    replacement = gated_pod("web-1", ["web-1"], cpu="6")
    replacement["metadata"]["ownerReferences"] = [OWNER]
    decision = _decide(preemptor, gpu_claim("web-1", memory="4Gi"), replacement)
    assert decision.outcome == "unschedulable"
    assert not preemptor.taken


def test_a_nomination_keeps_its_pods_cpu_against_gangs_of_lower_priority() -> None:
    cache = _cluster([("a", "l4-2x", "8"), ("b", "l4-2x", "8")])
    preemptor = _preemptor(cache)
    urgent = gated_pod("urgent", ["urgent"], cpu="6")
    cache.apply(Kind.CLAIM, "ADDED", _stamp(gpu_claim("urgent", memory="4Gi")))
    cache.apply(Kind.POD, "ADDED", _stamp(copy.deepcopy(urgent)))
    plan = plan_gang(cache, cache.gang_key(urgent))
    room = gang_room(plan, [("default/urgent", "a")])
    assert room == (("default/urgent", "a", Resources(6000, 1 << 30, 1)),)
    preemptor.nominations[plan.key] = Nomination(
        priority=100, pod_nodes={"default/urgent": "a"}, allocations=(), victim_pods=frozenset(),
        victim_claims=(), deadline=400.0, room=room,
    )  # fmt: skip
    with cache.lock:
        assert cache.nodes_without_room(Resources(4000, 0, 1)) == frozenset()
        with preemptor.holding_all():
            assert cache.nodes_without_room(Resources(4000, 0, 1)) == {"a"}
        assert cache.nodes_without_room(Resources(4000, 0, 1)) == frozenset()  # given back after
    low = _decide(preemptor, gpu_claim("low", memory="4Gi"), gated_pod("low", ["low"], cpu="4"))
    assert _nodes(low) == ["b"]

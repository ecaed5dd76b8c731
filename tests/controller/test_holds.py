"""The holds a leader hands to its successor: as text and back, deadlines moved between clocks, what
is out of date dropped, bad text refused naming the field, and what a successor takes over."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client

from driver.controller.model.objects import GATE, GangKey, Resources
from driver.controller.preemption.holds import (
    Holds,
    HoldsError,
    decode_holds,
    encode_holds,
    restore_holds,
    take_holds,
)
from driver.controller.preemption.preemptor import Nomination, Preemptor, Reservation
from driver.controller.view.cache import ClusterCache, Kind

RESULT = {"request": "gpu", "driver": "fractional.dev", "pool": "node-a", "device": "gpu-1",
          "shareID": "0a1b", "consumedCapacity": {"memory": "10Gi"}}  # fmt: skip
ALLOCATION = {
    "devices": {"results": [RESULT]},
    "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}]},
}  # fmt: skip


def _claim(name: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": "team", "name": name, "uid": f"uid-{name}", "resourceVersion": "7",
                         "managedFields": [{"manager": "x"}]},
            "spec": {"devices": {"requests": [{"name": "gpu"}]}}}  # fmt: skip


def _holds(mono: float) -> Holds:
    nomination = Nomination(
        priority=10, pod_nodes={"team/big-0": "node-a", "team/big-1": None},
        allocations=((_claim("big-0"), ALLOCATION),), victim_pods=frozenset({"team/s1"}),
        victim_claims=(_claim("s1"),), deadline=mono + 120, source="consolidation",
        created="2026-12-07T05:00:00Z", room=(("team/big-0", "node-a", Resources(2000, 1 << 30, 1)),),
    )  # fmt: skip
    reservation = Reservation(
        owner_uid="rs-1", node="node-a", allocations=((_claim("s1.replacement"), ALLOCATION),),
        deadline=mono + 300, gang=GangKey("team/big"), token="uid-s1", room=Resources(500, 1 << 29, 1),
    )  # fmt: skip
    return Holds(
        nominations={GangKey("team/big"): nomination},
        reservations={"team/big:team/s1": reservation},
        moved_at={"rs-1": 1_000.5},
    )


def test_holds_come_back_as_they_were_with_deadlines_on_the_successors_clock() -> None:
    held = _holds(mono=50.0)
    text = encode_holds(held, wall=1_000.0, monotonic=50.0)
    assert "managedFields" not in text and "resourceVersion" not in text  # claims by name and UID only
    # The successor's monotonic clock reads 9,000 when its wall clock reads 1,010: 10 s have passed.
    back = decode_holds(text, wall=1_010.0, monotonic=9_000.0)
    ((gang, nomination),) = back.nominations.items()
    assert gang == "team/big" and nomination.deadline == pytest.approx(9_000.0 + 110)
    original = held.nominations[GangKey("team/big")]
    assert nomination.pod_nodes == original.pod_nodes and nomination.room == original.room
    assert nomination.victim_pods == original.victim_pods and nomination.priority == 10
    assert nomination.source == "consolidation" and nomination.created == original.created
    assert [c["metadata"] for c in nomination.victim_claims] == [
        {"namespace": "team", "name": "s1", "uid": "uid-s1"}
    ]
    [(claim, allocation)] = nomination.allocations
    assert claim == {"metadata": {"namespace": "team", "name": "big-0", "uid": "uid-big-0"}}
    assert allocation == ALLOCATION
    ((rid, reservation),) = back.reservations.items()
    assert rid == "team/big:team/s1" and reservation.deadline == pytest.approx(9_000.0 + 290)
    kept = held.reservations[rid]
    for name in ("owner_uid", "node", "gang", "token", "room"):
        assert getattr(reservation, name) == getattr(kept, name), name
    assert back.moved_at == {"rs-1": 1_000.5}
    assert encode_holds(back, wall=1_010.0, monotonic=9_000.0) == text  # the same text again


def test_what_ran_out_while_nobody_led_is_dropped_and_nothing_is_written_for_no_holds() -> None:
    text = encode_holds(_holds(mono=0.0), wall=1_000.0, monotonic=0.0)
    later = decode_holds(text, wall=1_200.0, monotonic=0.0)  # 200 s on: the nomination (120 s) is over
    assert not later.nominations and list(later.reservations) == ["team/big:team/s1"]
    assert not decode_holds(text, wall=1_400.0, monotonic=0.0).reservations
    assert encode_holds(Holds(), wall=1.0, monotonic=1.0) == ""
    assert not decode_holds("", wall=1.0, monotonic=1.0)


def _broken(change: Any) -> str:
    doc = json.loads(encode_holds(_holds(mono=0.0), wall=1_000.0, monotonic=0.0))
    change(doc)
    return json.dumps(doc)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("{not json", "not JSON"),
        (_broken(lambda d: d.update(format=2)), "holds.format"),
        (_broken(lambda d: d.pop("reservations")), "holds.reservations: missing"),
        (_broken(lambda d: d["nominations"][0].update(deadline="soon")), "holds.nominations[0].deadline"),
        (_broken(lambda d: d["nominations"][0].update(priority=True)), "holds.nominations[0].priority"),
        (_broken(lambda d: d["nominations"][0]["room"][0].pop()), "holds.nominations[0].room[0]"),
        (_broken(lambda d: d["reservations"][0].update(room=[1, 2])), "holds.reservations[0].room"),
        (_broken(lambda d: d["reservations"][0]["allocations"][0][0].pop("metadata")),
         "holds.reservations[0].allocations[0][0].metadata"),
        (_broken(lambda d: d["movedAt"].update({"rs-2": "yesterday"})), "holds.movedAt.rs-2"),
    ],
)  # fmt: skip
def test_text_that_is_not_holds_is_refused_naming_the_field(text: str, field: str) -> None:
    with pytest.raises(HoldsError, match=field.replace("[", r"\[").replace("]", r"\]")):
        decode_holds(text, wall=1_000.0, monotonic=0.0)


def _pod(name: str, *, gated: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "pause"}]}
    if gated:
        spec["schedulingGates"] = [{"name": GATE}]
    meta = {"namespace": "team", "name": name, "uid": f"uid-{name}", "resourceVersion": "1"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def test_a_successor_takes_over_the_holds_of_gangs_still_waiting_and_keeps_its_own() -> None:
    cache = ClusterCache(topology_label="zone")
    cache.apply(Kind.POD, "ADDED", _pod("big-0", gated=True))
    preemptor = Preemptor(cache=cache, configuration=client.Configuration(), clock=lambda: 0.0)
    held = _holds(mono=0.0)
    gone = Nomination(priority=0, pod_nodes={"team/left-0": "node-b"}, allocations=(),
                      victim_pods=frozenset(), victim_claims=(), deadline=60.0)  # fmt: skip
    held.nominations[GangKey("team/left")] = gone  # its pod is gone: nothing to hold for
    own = Reservation(owner_uid="rs-9", node="node-b", allocations=(), deadline=60.0, gang=GangKey("team/x"))
    preemptor.reservations["team/big:team/s1"] = own
    moved_at = {"rs-1": 2_000.0}
    with cache.lock:
        assert restore_holds(preemptor, moved_at, held) == (1, 0)
    assert list(preemptor.nominations) == ["team/big"]
    assert preemptor.reservations == {"team/big:team/s1": own}  # what this process holds wins
    assert moved_at == {"rs-1": 2_000.0}  # the later move
    placed = _pod("big-0", gated=False)
    placed["metadata"]["resourceVersion"] = "2"
    placed["spec"]["nodeName"] = "node-a"
    cache.apply(Kind.POD, "MODIFIED", placed)
    preemptor.nominations.clear()
    with cache.lock:
        assert restore_holds(preemptor, moved_at, held) == (0, 0)  # placed meanwhile: not waiting


def test_what_a_leader_hands_over_leaves_out_what_holds_nothing_back() -> None:
    preemptor = Preemptor(cache=ClusterCache(topology_label="zone"), configuration=client.Configuration(),
                          clock=lambda: 500.0)  # fmt: skip
    preemptor.reservations["old"] = Reservation(owner_uid="rs-1", node="n", allocations=(), deadline=400.0,
                                                gang=GangKey("team/x"))  # fmt: skip
    preemptor.reservations["new"] = Reservation(owner_uid="rs-2", node="n", allocations=(), deadline=600.0,
                                                gang=GangKey("team/x"))  # fmt: skip
    holds = take_holds(preemptor, {"rs-1": 100.0, "rs-2": 1_000.0}, cooldown_seconds=1_800, wall=2_000.0)
    assert list(holds.reservations) == ["new"]  # the other's deadline passed
    assert holds.moved_at == {"rs-2": 1_000.0}  # rs-1 moved 1,900 s ago, past the cooldown

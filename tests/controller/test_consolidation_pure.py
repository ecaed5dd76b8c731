"""Consolidation's pure parts: who may move (every guard), the plan search (fewest moves, least
disruption, the budget), the room check and the count of GPUs freed."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from driver.config import ControllerConfig, parse_window
from driver.controller.consolidation.consolidator import (
    adds_up,
    asks_whole_devices,
    devices_freed,
    drain_order,
    in_window,
    stranded_ratio,
    surge_rollout,
    useful_movers,
)
from driver.controller.consolidation.movers import (
    Mover,
    MoverRules,
    build_movers,
    controller_owner,
    pod_started,
)
from driver.controller.consolidation.search import Budget, Move, MovePlan, PlanCost, find_plan
from driver.controller.preemption.victims import Placement
from driver.errors import ConfigError

NOW = 1_800_000_000.0
HOUR_AGO = "2027-01-15T07:00:00Z"  # NOW is 2027-01-15T08:00:00Z
RULES = MoverRules(min_runtime_seconds=600, cooldown_seconds=1800)
RS = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web", "uid": "rs-1", "controller": True}


def pod(name: str, *, claims: tuple[str, ...] = (), owner: dict[str, Any] | None = RS, movable: bool = True,
        priority: int = 0, started: str | None = HOUR_AGO, node: str | None = "n1",
        namespace: str = "default") -> dict[str, Any]:  # fmt: skip
    labels = {"fractional.dev/movable": "true"} if movable else {}
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels, "uid": f"uid-{name}"}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    entries = [{"name": f"c{i}", "resourceClaimName": c} for i, c in enumerate(claims or (f"{name}-c",))]
    spec: dict[str, Any] = {"priority": priority, "resourceClaims": entries}
    if node:
        spec["nodeName"] = node
    status = {"phase": "Running", **({"startTime": started} if started else {})}
    return {"metadata": meta, "spec": spec, "status": status}


def claim(name: str, device: str, *, shared: bool = True, node: str = "n1", namespace: str = "default",
          device_class: str = "gpu.fractional.dev") -> dict[str, Any]:  # fmt: skip
    result: dict[str, Any] = {"driver": "fractional.dev", "pool": node, "device": device, "request": "gpu"}
    if shared:
        result["shareID"] = f"share-{name}"
    selector = {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In",
                                                         "values": [node]}]}]}  # fmt: skip
    return {
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class}}]}},
        "status": {"allocation": {"devices": {"results": [result]}, "nodeSelector": selector}},
    }


def movers_of(
    pods: list[dict[str, Any]], claims: list[dict[str, Any]], **kwargs: Any
) -> tuple[list[Any], Any]:
    options: dict[str, Any] = {"waiting_priority": 0, "now": NOW, "rules": RULES, **kwargs}
    return build_movers(pods, {f"default/{c['metadata']['name']}": c for c in claims}, **options)


def test_the_fixture_clock_is_an_hour_after_the_start() -> None:
    assert NOW - (pod_started(pod("a")) or 0) == 3600


def test_a_movable_pod_of_a_replicaset_is_a_mover_with_its_device() -> None:
    movers, refusals = movers_of([pod("a")], [claim("a-c", "gpu-0")])
    (mover,) = movers
    assert mover.key == "default/a" and mover.owner == "ReplicaSet/web" and mover.owner_uid == "rs-1"
    assert mover.devices == {("fractional.dev", "n1", "gpu-0")} and not mover.whole and not mover.spare
    assert refusals.counts == {}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"owner": None}, "owner"),
        ({"owner": {**RS, "kind": "Node"}}, "owner"),
        ({"owner": {**RS, "controller": False}}, "owner"),
        ({"movable": False}, "not_opted_in"),
        ({"priority": 10}, "priority"),
        ({"started": "2027-01-15T07:55:00Z"}, "min_runtime"),
        ({"started": None}, "min_runtime"),
        ({"node": None}, "state"),
    ],
)
def test_each_guard_refuses_with_its_reason(change: dict[str, Any], reason: str) -> None:
    movers, refusals = movers_of([pod("a", **change)], [claim("a-c", "gpu-0")])
    assert movers == [] and refusals.counts == {reason: 1}


def test_a_pod_of_equal_priority_moves_for_the_waiting_one_and_a_higher_one_does_not() -> None:
    assert movers_of([pod("a", priority=5)], [claim("a-c", "gpu-0")], waiting_priority=5)[0]
    assert not movers_of([pod("a", priority=6)], [claim("a-c", "gpu-0")], waiting_priority=5)[0]


def test_the_owner_cooldown_holds_its_pods() -> None:
    moved_at = {"rs-1": NOW - 60}.get
    movers, refusals = movers_of([pod("a")], [claim("a-c", "gpu-0")], moved_at=moved_at)
    assert movers == [] and refusals.counts == {"cooldown": 1}
    long_ago = {"rs-1": NOW - 3600}.get
    assert movers_of([pod("a")], [claim("a-c", "gpu-0")], moved_at=long_ago)[0]


def test_a_gang_member_moves_only_when_its_gang_keeps_its_minimum() -> None:
    for room, moves in ((0, False), (1, True)):
        movers, refusals = movers_of([pod("a")], [claim("a-c", "gpu-0")], gang_room=lambda p, r=room: r)
        assert bool(movers) is moves
        assert refusals.counts == ({} if moves else {"gang": 1})


def test_a_namespace_or_every_device_class_of_its_claims_opts_a_pod_in() -> None:
    pods, claims = [pod("a", movable=False)], [claim("a-c", "gpu-0")]
    assert movers_of(pods, claims, movable_namespaces=frozenset({"default"}))[0]
    assert movers_of(pods, claims, movable_classes=frozenset({"gpu.fractional.dev"}))[0]
    assert not movers_of(pods, claims, movable_classes=frozenset({"other"}))[0]


def test_pods_sharing_a_claim_move_together_and_a_spare_replica_is_seen() -> None:
    pods = [pod("a", claims=("shared",)), pod("b", claims=("shared",)), pod("c")]
    movers, _ = movers_of(pods, [claim("shared", "gpu-0"), claim("c-c", "gpu-1", shared=False)])
    by_key = {m.key: m for m in movers}
    assert set(by_key) == {"default/a", "default/c"}
    assert [p["metadata"]["name"] for p in by_key["default/a"].pods] == ["a", "b"]
    assert by_key["default/c"].whole and by_key["default/c"].spare  # two other pods of the owner run


def test_a_pod_without_an_allocated_claim_is_not_a_mover_nor_refused() -> None:
    unallocated = claim("a-c", "gpu-0")
    del unallocated["status"]
    assert movers_of([pod("a", movable=False)], [unallocated]) == ([], movers_of([], [])[1])


def test_controller_owner_reads_only_the_controller_reference() -> None:
    assert controller_owner(pod("a")) == RS
    assert controller_owner(pod("a", owner={**RS, "controller": False})) is None


# -- the search --------------------------------------------------------------------------------------


def movers_on(layout: dict[str, list[tuple[str, bool]]]) -> list[Any]:
    """layout: device -> [(pod name, shared)]; each pod its own claim, all on node n1."""
    pods, claims = [], []
    for device, holders in layout.items():
        for name, shared in holders:
            pods.append(pod(name))
            claims.append(claim(f"{name}-c", device, shared=shared))
    for p in pods:  # one owner per pod: no spare replica
        p["metadata"]["ownerReferences"] = [{**RS, "uid": f"rs-{p['metadata']['name']}"}]
    movers, _ = movers_of(pods, claims)
    return movers


def fits_when(*needed: set[str]) -> Any:
    """A fit check that fits when the moved set holds one of ``needed`` (pod names)."""
    calls: list[frozenset[str]] = []

    def fits(moved: frozenset[str]) -> tuple[Placement, tuple[Move, ...]] | None:
        calls.append(moved)
        names = {k.split("/", 1)[1] for k in moved}
        if any(n <= names for n in needed):
            moves = tuple(Move(mover=k, node="n1", allocations=()) for k in sorted(moved))
            return Placement(allocations=(), pod_nodes=()), moves
        return None

    fits.calls = calls  # type: ignore[attr-defined]
    return fits


def test_the_fewest_moves_win() -> None:
    movers = movers_on({"gpu-0": [("a", True), ("b", True)], "gpu-1": [("c", True)]})
    found = find_plan(movers, fits=fits_when({"a", "b"}, {"c"}))
    assert found is not None and [m.key for m in found.movers] == ["default/c"]
    assert found.cost.pods_moved == 1


def test_a_share_moves_before_a_whole_gpu_pod() -> None:
    movers = movers_on({"gpu-0": [("whole", False)], "gpu-1": [("share", True)]})
    found = find_plan(movers, fits=fits_when({"whole"}, {"share"}))
    assert found is not None and [m.key for m in found.movers] == ["default/share"]


def test_a_pod_with_a_spare_replica_moves_first() -> None:
    movers = movers_on({"gpu-0": [("a", True)], "gpu-1": [("b", True)]})
    by_key = {m.key: m for m in movers}
    with_spare = [by_key["default/a"], replace(by_key["default/b"], spare=True)]
    found = find_plan(with_spare, fits=fits_when({"a"}, {"b"}))
    assert found is not None and [m.key for m in found.movers] == ["default/b"]


def test_steps_grow_until_it_fits_then_movers_not_needed_are_handed_back() -> None:
    layout = {f"gpu-{i}": [(f"p{i}", True)] for i in range(6)}
    found = find_plan(movers_on(layout), fits=fits_when({"p1", "p4"}))
    assert found is not None and sorted(m.key for m in found.movers) == ["default/p1", "default/p4"]


def test_nothing_fits_no_plan() -> None:
    assert find_plan(movers_on({"gpu-0": [("a", True)]}), fits=fits_when({"zzz"})) is None
    assert find_plan([], fits=fits_when(set())) is None


def test_max_moves_bounds_the_plan() -> None:
    layout = {f"gpu-{i}": [(f"p{i}", True)] for i in range(6)}
    needed = {f"p{i}" for i in range(6)}
    assert find_plan(movers_on(layout), fits=fits_when(needed), budget=Budget(max_moves=5)) is None
    found = find_plan(movers_on(layout), fits=fits_when(needed), budget=Budget(max_moves=6))
    assert found is not None and found.cost.pods_moved == 6


def test_the_budget_of_fit_checks_ends_the_search() -> None:
    layout = {f"gpu-{i}": [(f"p{i}", True)] for i in range(20)}
    fits = fits_when({"p19", "p0", "p7"})
    find_plan(movers_on(layout), fits=fits, budget=Budget(fit_checks=5, max_moves=20))
    assert len(fits.calls) <= 5


def test_the_time_budget_ends_the_search() -> None:
    ticks = iter(range(0, 10_000, 100))  # 100 ms per reading of the clock
    layout = {f"gpu-{i}": [(f"p{i}", True)] for i in range(20)}
    fits = fits_when({"p19", "p0", "p7"})
    find_plan(movers_on(layout), fits=fits, budget=Budget(milliseconds=250, max_moves=20),
              clock=lambda: next(ticks) / 1000)  # fmt: skip
    assert len(fits.calls) <= 3


# -- room and GPUs freed -----------------------------------------------------------------------------

GIB = 1 << 30


def device(free: int, total: int = 40 * GIB, exclusive: bool = False) -> dict[str, Any]:
    return {"memory_bytes_free": free, "memory_bytes_total": total, "exclusive": exclusive}


def gpu_claim_asking(memory: str | None, count: int = 1) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": "gpu.fractional.dev", "count": count}
    if memory:
        exactly["capacity"] = {"requests": {"memory": memory}}
    return {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}


def test_room_adds_up_only_on_the_nodes_the_gang_may_use() -> None:
    summary = {"n1": {"gpu-0": device(30 * GIB), "gpu-1": device(30 * GIB)},
               "n2": {"gpu-0": device(40 * GIB)}}  # fmt: skip
    assert adds_up(summary, ["n1"], [gpu_claim_asking(None)])  # 60 GiB free for one whole 40 GiB GPU
    assert not adds_up(summary, ["n1"], [gpu_claim_asking(None, count=2)])
    assert adds_up(summary, ["n1", "n2"], [gpu_claim_asking(None, count=2)])
    assert not adds_up({"n1": {"gpu-0": device(0, exclusive=True)}}, ["n1"], [gpu_claim_asking("1Gi")])
    assert adds_up(summary, ["n1"], [gpu_claim_asking("50Gi")])  # in total; the search decides the rest


def test_gpus_freed_counts_devices_left_empty_and_not_landed_on() -> None:
    movers = movers_on({"gpu-0": [("a", True)], "gpu-1": [("b", True)]})
    placement = Placement(allocations=(), pod_nodes=())
    landing = {"devices": {"results": [{"driver": "fractional.dev", "pool": "n1", "device": "gpu-1"}]}}
    plan = MovePlan(movers=(movers[0],), moves=(Move("default/a", "n1", (({}, landing),)),),
                    placement=placement, cost=PlanCost(1, 1, 0, 1))  # fmt: skip
    gpu0, gpu1 = ("fractional.dev", "n1", "gpu-0"), ("fractional.dev", "n1", "gpu-1")
    assert devices_freed(plan, {gpu0: 1, gpu1: 1}) == 1
    assert devices_freed(plan, {gpu0: 2, gpu1: 1}) == 0  # another claim stays on gpu-0


def deployment(replicas: int = 1, **rolling: Any) -> dict[str, Any]:
    strategy: dict[str, Any] = {"type": "RollingUpdate"}
    if rolling:
        strategy["rollingUpdate"] = rolling
    return {
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"replicas": replicas, "strategy": strategy},
    }


@pytest.mark.parametrize(
    ("body", "surge"),
    [
        (deployment(), 1),  # the defaults, 25 % each: surge rounds up to 1, unavailable down to 0
        (deployment(maxSurge=2, maxUnavailable=0), 2),
        (deployment(maxSurge="50%", maxUnavailable="0%"), 1),
        (deployment(maxSurge=0, maxUnavailable=1), None),  # break before make
        (deployment(maxSurge=1, maxUnavailable="100%"), None),
        (deployment(replicas=2), None),  # a spare replica: evicted, the other serves meanwhile
        ({**deployment(), "spec": {**deployment()["spec"], "paused": True}}, None),
        ({**deployment(), "spec": {"replicas": 1, "strategy": {"type": "Recreate"}}}, None),
        (deployment(maxSurge="lots"), None),
    ],
)
def test_make_before_break_only_where_the_deployment_surges_without_unavailability(
    body: dict[str, Any], surge: int | None
) -> None:
    rollout = surge_rollout(body)
    assert (rollout.surge if rollout is not None else None) == surge
    if rollout is not None:
        assert (rollout.namespace, rollout.deployment) == ("default", "web")


def test_the_preemptor_knows_the_make_before_break_mark_by_the_same_name() -> None:
    from driver.controller.consolidation.consolidator import REPLACES_ANNOTATION
    from driver.controller.preemption import preemptor

    assert preemptor.REPLACES_ANNOTATION == REPLACES_ANNOTATION


@pytest.mark.parametrize(
    ("text", "window"),
    [("", None), ("01:00-05:00", (60, 300)), ("22:30-02:15", (1350, 135)), (" 00:00 - 23:59 ", (0, 1439))],
)
def test_the_schedule_window_is_read_in_utc_minutes(text: str, window: tuple[int, int] | None) -> None:
    assert parse_window(text) == window


@pytest.mark.parametrize("text", ["1-5", "25:00-26:00", "01:00-01:00", "01:00", "01:60-02:00", "a:b-c:d"])
def test_a_bad_window_is_refused_naming_the_flag(text: str) -> None:
    with pytest.raises(ConfigError) as raised:
        ControllerConfig(consolidation_schedule_window=text)
    assert "--consolidation-schedule-window" in str(raised.value)


def test_a_window_past_midnight_wraps() -> None:
    window = (22 * 60, 2 * 60)
    assert in_window(window, 23 * 60) and in_window(window, 60) and not in_window(window, 12 * 60)
    assert in_window(None, 0) and in_window((60, 120), 60) and not in_window((60, 120), 120)


def test_stranded_memory_counts_free_memory_on_partly_used_gpus_only() -> None:
    summary = {"n1": {
        "gpu-0": {**device(30 * GIB), "shares": 1},  # 30 stranded
        "gpu-1": {**device(40 * GIB), "shares": 0},  # free: not stranded
        "gpu-2": {**device(0, exclusive=True), "shares": 0},
        "gpu-3": {**device(10 * GIB), "shares": 3},  # 10 stranded
    }}  # fmt: skip
    assert stranded_ratio(summary) == pytest.approx(40 / 160)
    assert stranded_ratio({}) == 0.0


def test_only_movers_worth_a_fit_check_are_searched() -> None:
    """A whole-GPU gang gains nothing from a move that leaves another pod on the GPU; a share
    bigger than every hole elsewhere has nowhere to go. Either would spend the search's budget."""
    movers = movers_on({"gpu-0": [("a", True)], "gpu-1": [("b", True)]})
    gpu0, gpu1 = ("fractional.dev", "n1", "gpu-0"), ("fractional.dev", "n1", "gpu-1")
    hole = {**device(20 * GIB), "pool": "n1"}
    summary = {"n1": {"gpu-0": hole, "gpu-1": hole, "gpu-2": {**device(0, exclusive=True), "pool": "n1"}}}
    refusals: dict[str, int] = {}
    kept = useful_movers(movers, summary, {gpu0: 2, gpu1: 1}, whole_only=True, refusals=refusals)
    assert [m.key for m in kept] == ["default/b"] and refusals == {"pinned": 1}
    assert len(useful_movers(movers, summary, {gpu0: 2, gpu1: 1}, whole_only=False)) == 2

    big = [
        replace(m, claims=tuple({**c, "spec": gpu_claim_asking("30Gi")["spec"]} for c in m.claims))
        for m in movers
    ]
    refusals = {}
    assert useful_movers(big, summary, {gpu0: 1, gpu1: 1}, whole_only=True, refusals=refusals) == []
    assert refusals == {"no_room": 2}  # 20 GiB holes, 30 GiB shares
    summary["n1"]["gpu-3"] = {**device(40 * GIB), "pool": "n1"}  # a free GPU takes either
    assert len(useful_movers(big, summary, {gpu0: 1, gpu1: 1}, whole_only=True)) == 2


def test_a_gang_asks_whole_devices_when_no_request_names_a_capacity() -> None:
    assert asks_whole_devices([gpu_claim_asking(None), gpu_claim_asking(None, count=2)])
    assert not asks_whole_devices([gpu_claim_asking(None), gpu_claim_asking("10Gi")])


def _mover(key: str, node: str, device: str) -> Mover:
    return Mover(
        key=key, pods=({"metadata": {"name": key}},), claims=(), owner_uid=key, owner=f"ReplicaSet/{key}",
        priority=0, devices=frozenset({("fractional.dev", node, device)}), nodes=(node,), whole=False,
        spare=False,
    )  # fmt: skip


def test_a_gang_pod_that_needs_two_gpus_of_a_node_gets_them_freed_together() -> None:
    """Single steps free one GPU each and never fit; with them capped at half the budget, the step
    that frees a pod's two GPUs of one node is tried (the bench's gangs waited for want of it)."""
    movers = [_mover(f"q{i}", "n2", f"gpu-{i}") for i in range(4)]

    def fits(moved: frozenset[str]) -> tuple[Placement, tuple[Move, ...]] | None:
        return (Placement((), ()), ()) if len(moved) >= 2 else None

    found = find_plan(movers, fits=fits, budget=Budget(fit_checks=4), group_size=2, groups_wanted=1)
    assert found is not None and len(found.movers) == 2 and found.fit_checks <= 4
    assert find_plan(movers, fits=fits, budget=Budget(fit_checks=4)) is None  # one GPU a pod: all singles


def test_the_scheduled_pass_empties_only_gpus_one_move_frees_nearest_a_free_node_first() -> None:
    """``drain_order``: a GPU another claim pins, a whole-GPU mover's and (by default) one that needs
    two moves are never tried; among the rest, the GPU beside the most free GPUs comes first."""
    movers = [
        *movers_of([pod("a", node="n1")], [claim("a-c", "gpu-0", node="n1")])[0],
        *movers_of([pod("b", node="n2")], [claim("b-c", "gpu-0", node="n2")])[0],
        *movers_of(
            [pod("c", node="n2"), pod("d", node="n2")],
            [claim("c-c", "gpu-1", node="n2"), claim("d-c", "gpu-1", node="n2")],
        )[0],
        *movers_of([pod("e", node="n1")], [claim("e-c", "gpu-1", node="n1")])[0],
        *movers_of([pod("w", node="n1")], [claim("w-c", "gpu-2", node="n1", shared=False)])[0],
    ]
    key = {name: ("fractional.dev", node, gpu) for name, node, gpu in
           [("a", "n1", "gpu-0"), ("b", "n2", "gpu-0"), ("cd", "n2", "gpu-1"), ("e", "n1", "gpu-1"),
            ("w", "n1", "gpu-2")]}  # fmt: skip
    holders = {key["a"]: 1, key["b"]: 1, key["cd"]: 2, key["e"]: 2, key["w"]: 1}  # e's GPU holds another
    free = {"shares": 0, "exclusive": False}
    summary = {"n1": {"gpu-3": {**free, "pool": "n1"}},
               "n2": {"gpu-2": {**free, "pool": "n2"}, "gpu-3": {**free, "pool": "n2"}}}  # fmt: skip
    order = drain_order(movers, holders, summary)
    assert [(device, [m.key for m in held]) for device, held in order] == [
        (key["b"], ["default/b"]),  # n2 has two GPUs free, n1 one
        (key["a"], ["default/a"]),
    ]
    wider = drain_order(movers, holders, summary, max_pods=2)
    assert [device for device, _ in wider] == [key["b"], key["a"], key["cd"]]  # two moves cost more


def test_a_gpu_held_for_a_replacement_is_not_emptied_by_moving_its_claims() -> None:
    """The preemptor's holds count per device beside the claims (``Consolidator._holders``): a GPU
    where a reservation keeps room for another move's replacement is pinned, so a whole-GPU gang
    spends no fit check on it (the bench's whole-GPU pods waited on such checks, none of which fit)."""
    from kubernetes import client

    from driver.controller.model.objects import GangKey
    from driver.controller.preemption.preemptor import Preemptor, Reservation
    from driver.controller.view.cache import ClusterCache

    preemptor = Preemptor(cache=ClusterCache(topology_label="zone"), configuration=client.Configuration(),
                          clock=lambda: 100.0)  # fmt: skip
    kept = claim("kept", "gpu-0")
    preemptor.reservations["r"] = Reservation(
        owner_uid="rs-2", node="n1", allocations=((kept, kept["status"]["allocation"]),), deadline=400.0,
        gang=GangKey("default/other"),
    )  # fmt: skip
    gpu0, gpu1 = ("fractional.dev", "n1", "gpu-0"), ("fractional.dev", "n1", "gpu-1")
    assert preemptor.held_per_device() == {gpu0: 1}
    movers = movers_on({"gpu-0": [("a", True)], "gpu-1": [("b", True)]})
    hole = {**device(20 * GIB), "pool": "n1"}
    summary = {"n1": {"gpu-0": hole, "gpu-1": hole, "gpu-2": hole}}
    claims_only = {gpu0: 1, gpu1: 1}
    assert len(useful_movers(movers, summary, claims_only, whole_only=True)) == 2
    with_holds = {d: claims_only.get(d, 0) + preemptor.held_per_device().get(d, 0) for d in (gpu0, gpu1)}
    refusals: dict[str, int] = {}
    kept_movers = useful_movers(movers, summary, with_holds, whole_only=True, refusals=refusals)
    assert [m.key for m in kept_movers] == ["default/b"] and refusals == {"pinned": 1}
    preemptor.clock = lambda: 500.0  # past its deadline: the hold is given up
    assert preemptor.held_per_device() == {}

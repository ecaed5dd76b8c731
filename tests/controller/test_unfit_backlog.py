"""A backlog of gated pods that do not fit, decided again as capacity changes: what each pass costs
and who gets freed room. The Reconciler driven directly on a cache (no API: its write jobs are
refused, as when it stops, and what it decided stays assumed in the cache), its clock stepped by
hand.

What was seen (API emulator, 200 nodes x 8 GPUs each holding a 70Gi share): 500 whole-GPU pods that
did not fit took 190 CPU-seconds to arrive, 93 % of it sizing each pod's scale-up hint anew; under
5 departures a second the controller was saturated and placed 31 of 151 freed GPUs, since every
freed device queued the whole backlog again and each pass decided every pod of it."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from driver.allocator import ClusterState, batch
from driver.controller.gangs import burst
from driver.controller.gangs.burst import decide_all
from driver.controller.gangs.plan import plan_gang
from driver.controller.loop import reconcile
from driver.controller.loop.reconcile import GANG_PREFIX, Reconciler, ReconcilerSettings
from driver.controller.metrics import ControllerMetrics
from driver.controller.model.objects import GangKey, gang_key_of
from driver.controller.view.cache import ClusterCache, Kind
from driver.controller.writes.pipeline import Writers
from driver.inventory.fake import load_profile, resolve_profile
from driver.slices import build_device_classes, build_resource_slices
from tests.controller.conftest import gated_pod, gpu_claim


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class _Backlog:
    """A cache with ``l4-2x`` nodes, and the Reconciler's queue as lists."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.clock = _Clock()
        monkeypatch.setattr(reconcile, "time", self.clock)
        self.cache = ClusterCache(topology_label="topology.kubernetes.io/zone")
        self.version = 0
        for device_class in build_device_classes():
            self._apply(Kind.CLASS, device_class)
        self.generation = 0
        self.requeued: list[str] = []
        self.timers: list[tuple[str, float]] = []
        self.reconciler = Reconciler(
            cache=self.cache, metrics=ControllerMetrics(), settings=ReconcilerSettings(preemption=False),
            capacity_generation=lambda: self.generation, submit=lambda job: False,
            requeue=self.requeued.append, requeue_later=lambda key: 0.0,
            requeue_after=lambda key, seconds: self.timers.append((key, seconds)),
        )  # fmt: skip

    def _apply(self, kind: Kind, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj = copy.deepcopy(obj)
        meta = obj["metadata"]
        meta.setdefault("uid", f"uid-{self.version}")
        meta["resourceVersion"] = str(self.version)
        self.cache.apply(Kind(kind), "ADDED", obj)
        return obj

    def add_node(self, name: str) -> None:
        inventory = load_profile(resolve_profile("l4-2x"), node_name=name)
        allocatable = {"cpu": "64", "memory": "512Gi", "pods": "110"}
        self._apply(Kind.NODE, {"apiVersion": "v1", "kind": "Node",
                                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
                                "status": {"allocatable": allocatable, "capacity": allocatable}})  # fmt: skip
        for s in build_resource_slices(inventory):
            self._apply(Kind.SLICE, s)
        self.generation += 1

    def add_pod(self, name: str, *, gpus: int) -> GangKey:
        claim = gpu_claim(name, memory=None, compute=None, count=gpus)
        claim["metadata"]["namespace"] = "default"
        self._apply(Kind.CLAIM, claim)
        pod = gated_pod(name, [name])
        pod["metadata"]["namespace"] = "default"
        return gang_key_of(self._apply(Kind.POD, pod))

    def unschedulable(self) -> float:
        return float(self.reconciler.metrics.decisions.labels(outcome="unschedulable")._value.get())

    def allocated(self) -> float:
        return float(self.reconciler.metrics.decisions.labels(outcome="allocated")._value.get())


def test_one_gang_of_each_demand_is_decided_while_the_rest_back_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each gang that does not fit backs off (1 s, then 2 s, ... to 10 s, a timer set to look at it
    again); capacity that changes meanwhile gets one gang of each demand decided, not all of them."""
    backlog = _Backlog(monkeypatch)
    backlog.add_node("node-a")
    gangs = [backlog.add_pod(f"w{i}", gpus=4) for i in range(6)]  # 4 GPUs: more than any node has
    backlog.reconciler.reconcile_gangs(gangs)
    assert backlog.unschedulable() == 6
    assert sorted(backlog.timers) == sorted((GANG_PREFIX + g, 1.0) for g in gangs)

    backlog.generation += 1  # a device freed somewhere: every unschedulable gang is queued again
    backlog.clock.now += 0.5
    backlog.reconciler.reconcile_gangs(gangs)
    assert backlog.unschedulable() == 7  # one of the six, for the six
    assert backlog.timers[-1] == (GANG_PREFIX + gangs[0], 2.0)  # its second failure: 2 s

    backlog.generation += 1
    backlog.clock.now += 1.0  # the other five's backoff is over
    backlog.reconciler.reconcile_gangs(gangs)
    assert backlog.unschedulable() == 12  # the five; the first waits its backoff out (its demand is decided)
    backlog.clock.now += 2.0
    for _ in range(5):
        backlog.generation += 1
        backlog.clock.now += 100.0
        backlog.reconciler.reconcile_gangs([gangs[0]])
    assert backlog.timers[-1] == (GANG_PREFIX + gangs[0], 10.0)  # doubled up to the most


def test_gangs_that_ask_differently_each_have_theirs_decided(monkeypatch: pytest.MonkeyPatch) -> None:
    backlog = _Backlog(monkeypatch)
    backlog.add_node("node-a")
    fours = [backlog.add_pod(f"four{i}", gpus=4) for i in range(3)]
    threes = [backlog.add_pod(f"three{i}", gpus=3) for i in range(3)]
    backlog.reconciler.reconcile_gangs(fours + threes)
    assert backlog.unschedulable() == 6
    backlog.generation += 1
    backlog.clock.now += 0.1
    backlog.reconciler.reconcile_gangs(fours + threes)
    assert backlog.unschedulable() == 8  # one of each demand


def test_freed_room_goes_to_the_backlog_and_the_next_of_its_kind_is_queued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gang decided for its demand that fits brings the next gang of that demand in (queued at
    once, not at the end of its backoff): a node that joins with room for two takes two."""
    backlog = _Backlog(monkeypatch)
    backlog.add_node("node-a")
    backlog.add_pod("filler", gpus=2)
    backlog.reconciler.reconcile_gangs([gang_key_of(backlog.cache.get(Kind.POD, "default/filler") or {})])
    assert backlog.allocated() == 1
    waiting = [backlog.add_pod(f"w{i}", gpus=1) for i in range(4)]
    backlog.reconciler.reconcile_gangs(waiting)
    assert backlog.unschedulable() == 4

    backlog.add_node("node-b")  # room for two of the four
    backlog.clock.now += 0.2
    backlog.requeued.clear()
    backlog.reconciler.reconcile_gangs(waiting)
    assert backlog.allocated() == 2
    assert backlog.requeued == [GANG_PREFIX + waiting[1]]  # the next of its kind
    backlog.reconciler.reconcile_gangs([waiting[1]])
    assert backlog.allocated() == 3
    assert backlog.requeued[-1] == GANG_PREFIX + waiting[2]
    backlog.reconciler.reconcile_gangs([waiting[2]])
    assert (backlog.allocated(), backlog.unschedulable()) == (3, 5)  # node-b is full


def test_a_pass_searches_once_for_gangs_that_ask_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """``decide_all``: a gang that asks what one before it in the pass could not have gets that
    answer without a search of its own; a gang that asks something else is searched for."""
    backlog = _Backlog(monkeypatch)
    backlog.add_node("node-a")
    gangs = [backlog.add_pod(f"w{i}", gpus=4) for i in range(5)]
    gangs += [backlog.add_pod("three", gpus=3), backlog.add_pod("two", gpus=2)]
    calls: list[str] = []
    real = burst.decide

    def counted(cache: ClusterCache, plan: Any, **kwargs: Any) -> Any:
        calls.append(plan.key)
        return real(cache, plan, **kwargs)

    monkeypatch.setattr(burst, "decide", counted)
    plans = [plan_gang(backlog.cache, g) for g in gangs]
    decisions = decide_all(backlog.cache, plans, policy="best-fit")
    assert [getattr(d, "outcome", None) for d in decisions] == ["unschedulable"] * 6 + ["allocated"]
    assert calls == [gangs[0], gangs[5]]  # "two" placed by the burst, before any is decided alone


def test_a_burst_pass_searches_once_for_like_groups_that_do_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ClusterState.allocate_many``: forty whole-GPU pods on two free GPUs: the first two placed,
    and of the other 38 only the first searched for, in each pass over them."""
    searched: list[int] = []
    real = batch.solve

    def counted(state: Any, claims: Any, **kwargs: Any) -> Any:
        searched.append(len(claims))
        return real(state, claims, **kwargs)

    monkeypatch.setattr(batch, "solve", counted)
    state = ClusterState(topology_label="topology.kubernetes.io/zone")
    for device_class in build_device_classes():
        state.upsert_class(device_class)
    inventory = load_profile(resolve_profile("l4-2x"), node_name="node-a")
    state.upsert_node("node-a", {"kubernetes.io/hostname": "node-a"})
    for s in build_resource_slices(inventory):
        state.upsert_slice(s)
    groups = []
    for i in range(40):
        claim = gpu_claim(f"w{i}", memory=None, compute=None)
        claim["metadata"].update({"namespace": "default", "uid": f"u{i}"})
        groups.append([claim])
    placed = state.allocate_many(groups, node=None, policy="best-fit")
    assert [i for i, p in enumerate(placed) if p is not None] == [0, 1]
    assert len(searched) <= 4  # two placed, one that does not fit; again after the compaction


class _Recorder:
    def __init__(self) -> None:
        self.said: list[tuple[GangKey, str]] = []
        self.kept: list[GangKey] = []

    def gang_unschedulable(self, gang: GangKey, pod: dict[str, Any], message: str, **_: Any) -> bool:
        self.said.append((gang, message))
        return True

    def keep_alive(self, gang: GangKey) -> int:
        self.kept.append(gang)
        return 0


class _Writer:
    def annotate_pod(self, pod: dict[str, Any], annotations: dict[str, str]) -> dict[str, Any]:
        pod = copy.deepcopy(pod)
        pod["metadata"].setdefault("annotations", {}).update(annotations)
        pod["metadata"]["resourceVersion"] = str(int(pod["metadata"]["resourceVersion"]) + 1000)
        return pod


def test_like_gangs_are_sized_once_and_told_again_only_when_it_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The best node's offer and the scale-up hint are sized once for gangs that ask the same, and
    kept for ``SIZING_REUSE_SECONDS`` while capacity changes; a gang told the same words again within
    ``SAME_EXPLANATION_SECONDS`` gets its Event kept alive, not bumped."""
    jobs: list[Any] = []
    backlog = _Backlog(monkeypatch)
    backlog.reconciler.submit = lambda job: jobs.append(job) is None
    recorder = _Recorder()

    def run_jobs() -> None:
        while jobs:
            jobs.pop(0)(Writers(writer=_Writer(), recorder=recorder))  # type: ignore[arg-type]

    sized: list[int] = []
    real = reconcile.compute_hint

    def counted(claims: Any, **kwargs: Any) -> Any:
        sized.append(len(claims))
        return real(claims, **kwargs)

    monkeypatch.setattr(reconcile, "compute_hint", counted)
    backlog.add_node("node-a")
    gangs = [backlog.add_pod(f"w{i}", gpus=3) for i in range(5)]
    backlog.reconciler.reconcile_gangs(gangs)
    run_jobs()
    assert len(sized) == 1
    assert sorted(g for g, _ in recorder.said) == sorted(gangs)
    assert "scale-up hint: 1 x" in recorder.said[0][1]  # a node of 3 or more GPUs would do

    backlog.generation += 1  # capacity changed elsewhere, their backoff is over: decided again
    backlog.clock.now += 1.5
    backlog.reconciler.reconcile_gangs(gangs)
    run_jobs()
    assert len(sized) == 1  # sized 1.5 s ago
    assert len(recorder.said) == 5 and len(recorder.kept) == 5  # the same words: kept alive

    backlog.generation += 1
    backlog.clock.now += reconcile.SIZING_REUSE_SECONDS
    backlog.reconciler.reconcile_gangs(gangs)
    run_jobs()
    assert len(sized) == 2
    assert len(recorder.said) == 5  # the same words, 11.5 s after they were said

    backlog.generation += 1
    backlog.clock.now += reconcile.SAME_EXPLANATION_SECONDS
    backlog.reconciler.reconcile_gangs(gangs)
    run_jobs()
    assert len(recorder.said) == 10  # said again: the Event's count goes on

"""Consolidation: waits of whole-GPU pods and gangs under churn, with consolidation off, on (ours:
room reserved for every moved pod), a KAI-like variant (the same plans, no reservation) and on with
the scheduled pass (``on+scheduled``).

A discrete-event simulation in simulated seconds, in process (no API server): N nodes x 8 GPUs of
80 GiB in the allocator's ``ClusterState`` (slices as bench/bench_preemption.py builds them: memory
and compute capacity, ``allowMultipleAllocations``). Every placement is
``state.allocate(claims, node=None, policy="best-fit", pod_groups=<one group per pod>)``, as the
controller's ``allocate_groups`` (driver/controller/gangs/decide.py) asks it; nodes' CPU and memory
are not modelled (every node has room for any pod).

Arrivals (Poisson; one stream per seed, node count and load, the same for the four variants):

- ReplicaSets of 1-4 replicas, each replica a pod with one share of 8, 16, ... or 56 GiB (uniform;
  those over half a GPU leave holes only smaller shares fill), labelled
  ``fractional.dev/movable: "true"`` (consolidation's movers); 60 % of the offered GPU load;
  lifetime exponential, mean 60 min (a moved pod's replacement keeps its predecessor's end);
- whole-GPU pods (one claim of one GPU, no capacity request), not movable: 20 % of the load,
  lifetime exponential, mean 20 min;
- gangs of 2-4 pods x 1-4 whole GPUs (one claim per pod), all or nothing: 20 % of the load,
  lifetime exponential, mean 30 min.

Rates are set so that the offered load (GPU-seconds asked per second over the GPUs) is the target.
Lifetimes run from placement. Pending pods are tried FIFO at every event, each one placed if it
fits (a gang whole or not at all); an allocator call is skipped when the bench's own ledger shows
it cannot succeed (exact here: one device type, memory the only capacity asked) or when nothing
was released since the pod last failed.

Consolidation (variants ``on`` and ``kai-like``), for a pending whole-GPU pod or gang not backing
off, at each event after the FIFO pass, oldest first: when the free GPU memory adds up
(``adds_up`` of driver/controller/consolidation/consolidator.py), the movers are built with
``build_movers`` (movers.py; chart defaults: minimum runtime 600 s, cooldown 1800 s), kept when worth a
fit check (``useful_movers``: on a GPU their moves can empty, with a hole elsewhere), and the plan
searched with ``find_plan`` (search.py; budget 64 fit checks, 16 moves; its millisecond budget is
not used, the clock passed to it stands still, so that a run is deterministic for a seed: the wall
time of each search is recorded instead). The fit check mirrors ``Consolidator._fit_check``,
``_place_all`` and ``_place_mover`` without the node CPU/memory check: the movers' claims released,
the gang placed, then each mover, the largest first, placed again as a stand-in copy of its claim
(``stand_in``) with the gang's devices and the earlier movers' held. A failed search backs off
30 s, doubling to 600 s (``ConsolidationSettings``).

- ``on``: the movers' claims are released, the gang placed at once on the plan's placement, and
  each mover's planned allocation held in the state until its replacement comes back after a
  restart delay (uniform 20-60 s) and takes exactly that place;
- ``kai-like``: the same search and commit, no reservation: a moved pod comes back after the same
  delay as a new pending pod placed by the normal policy; a re-placement failure is counted when
  it does not fit at that moment (it then waits in the FIFO queue);
- ``on+scheduled``: ``on``, and the scheduled pass every ``schedule_interval_seconds`` (15 s) when
  the stranded share of GPU memory (``stranded_ratio``) is at least 0.02, as
  ``Consolidator.defragment`` runs it: movers with a spare replica only, the GPUs of
  ``drain_order`` (at most ``schedule_max_moves_per_gpu`` = 1 pod to move, the node with the most
  free GPUs first) tried in turn within the 64 fit checks, each mover placed again (by key) with its
  claims released, the GPU being emptied and every free GPU held whole (``Consolidator._drain``);
  the first that places all its movers is moved as ``on`` moves (room held for the replacement).
  One GPU a pass;
- ``off``: no consolidation.

Measured over the window after the warm-up (arrivals in the window), each row over its seeds (one
simulation per seed, the waits of all pooled, the counts summed): waits (arrival to placement)
of whole-GPU pods and of gangs, a pod or gang still pending at the end counted with its wait so
far (a lower bound) and as ``never placed``; whole GPUs free (no claim, no reservation on them),
time-averaged and at the end; the GPU memory in use, time-averaged; plans searched and committed,
pods moved, GPUs the moves freed (``devices_freed`` of consolidator.py; one per scheduled drain) and
moves per GPU freed, in all and for the plans that served a waiting pod alone;
re-placement failures; the wall time of ``find_plan`` per search (the only timing; reported, never
asserted).

Prints a markdown table and writes bench/results/consolidation.json. Run:
    .venv/bin/python bench/bench_consolidation.py [--nodes 50,500] [--loads 0.65,0.8,0.9] [--seed 1]
        [--seeds 3,1] [--duration 57600,3600] [--warmup 3600,1800] [--jobs 2]
(the defaults: what `make bench` runs, about 20 minutes on 2 shared cores; 500 nodes simulated for less
time and one seed, as their allocator calls cost about ten times more. One seed's waits at 50 nodes
swing by a factor of two and more between seeds: the rows pool three)
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import percentile, summary, write_result
from bench.bench_preemption import GPU_GI, GPUS_PER_NODE, empty_cluster
from driver import DRIVER_NAME as DRIVER
from driver.allocator import ClusterState
from driver.controller.consolidation.consolidator import (
    adds_up,
    devices_freed,
    drain_order,
    stand_in,
    stranded_ratio,
    useful_movers,
    whole_hold,
)
from driver.controller.consolidation.movers import MOVABLE_LABEL, Mover, MoverRules, build_movers
from driver.controller.consolidation.search import Budget, Move, MovePlan, find_plan
from driver.controller.model.objects import allocation_node
from driver.controller.preemption.victims import DeviceKey, Placement

NAMESPACE = "bench"
POLICY = "best-fit"
VARIANTS = ("off", "on", "kai-like", "on+scheduled")
EPOCH_SECONDS = 1_800_000_000.0  # simulated time 0, as a wall time for startTime and the movers' rules
SHARE_SIZES_GI = (8, 16, 24, 32, 40, 48, 56)
GI = 1 << 30


@dataclass(frozen=True, slots=True)
class Mix:
    """The workload: GPU-load fractions, shapes and mean lifetimes (seconds)."""

    share_fraction: float = 0.6
    whole_fraction: float = 0.2
    gang_fraction: float = 0.2
    share_life_seconds: float = 3600.0
    whole_life_seconds: float = 1200.0
    gang_life_seconds: float = 1800.0
    replicas: tuple[int, int] = (1, 4)
    gang_pods: tuple[int, int] = (2, 4)
    gang_gpus_per_pod: tuple[int, int] = (1, 4)


@dataclass(frozen=True, slots=True)
class Settings:
    rules: MoverRules = field(default_factory=MoverRules)  # chart defaults: 600 s, 1800 s
    budget: Budget = field(default_factory=lambda: Budget(fit_checks=64, milliseconds=float("inf")))
    restart_seconds: tuple[float, float] = (20.0, 60.0)
    backoff_seconds: float = 30.0
    backoff_max_seconds: float = 600.0
    # The scheduled pass of ``on+scheduled`` (chart schedule.intervalSeconds, strandedRatio, maxMovesPerGPU).
    schedule_interval_seconds: float = 15.0
    schedule_stranded_ratio: float = 0.02
    schedule_max_moves_per_gpu: int = 1


@dataclass(frozen=True, slots=True)
class Job:
    """One arrival: a ReplicaSet of shares, a whole-GPU pod or a gang."""

    name: str
    kind: str  # share | whole | gang
    arrival: float
    life_seconds: float
    pods: int
    gpus_per_pod: int = 0  # whole and gang
    memory_gi: int = 0  # share, per replica

    def gpu_demand(self) -> float:
        """GPUs held while it runs."""
        return self.pods * (self.memory_gi / GPU_GI if self.kind == "share" else self.gpus_per_pod)


def build_arrivals(
    *, gpus: int, load: float, duration_seconds: float, seed: str, mix: Mix = Mix()
) -> list[Job]:
    """The Poisson arrival stream for an offered load of ``load`` x ``gpus``, in arrival order."""
    rng = random.Random(seed)
    mean_replicas = sum(mix.replicas) / 2
    mean_share_gpus = sum(SHARE_SIZES_GI) / len(SHARE_SIZES_GI) / GPU_GI
    mean_gang_gpus = sum(mix.gang_pods) / 2 * sum(mix.gang_gpus_per_pod) / 2
    rates = {
        "share": mix.share_fraction
        * load
        * gpus
        / (mean_replicas * mean_share_gpus * mix.share_life_seconds),
        "whole": mix.whole_fraction * load * gpus / mix.whole_life_seconds,
        "gang": mix.gang_fraction * load * gpus / (mean_gang_gpus * mix.gang_life_seconds),
    }
    total = sum(rates.values())
    kinds, weights = list(rates), [rates[k] / total for k in rates]
    jobs: list[Job] = []
    # The cluster starts as it would be in steady state: the jobs that arrived before 0 (from four
    # share lifetimes back) and still run, all arriving at 0 with what is left of their lifetimes.
    now = -4 * mix.share_life_seconds
    while True:
        now += rng.expovariate(total)
        if now >= duration_seconds:
            return jobs
        kind = rng.choices(kinds, weights)[0]
        name = f"{kind}-{len(jobs):06d}"
        job = _draw(rng, kind, name, now, mix)
        if now >= 0:
            jobs.append(job)
        elif now + job.life_seconds > 0:
            jobs.append(replace(job, arrival=0.0, life_seconds=now + job.life_seconds))


def _draw(rng: random.Random, kind: str, name: str, now: float, mix: Mix) -> Job:
    if kind == "share":
        return Job(name, kind, now, rng.expovariate(1 / mix.share_life_seconds),
                   pods=rng.randint(*mix.replicas), memory_gi=rng.choice(SHARE_SIZES_GI))  # fmt: skip
    if kind == "whole":
        return Job(name, kind, now, rng.expovariate(1 / mix.whole_life_seconds), pods=1, gpus_per_pod=1)
    life = rng.expovariate(1 / mix.gang_life_seconds)
    return Job(
        name,
        kind,
        now,
        life,
        pods=rng.randint(*mix.gang_pods),
        gpus_per_pod=rng.randint(*mix.gang_gpus_per_pod),
    )


def offered_load(jobs: Iterable[Job], *, gpus: int, duration_seconds: float) -> float:
    """GPU-seconds asked per second of ``duration_seconds``, over ``gpus``."""
    return sum(j.gpu_demand() * j.life_seconds for j in jobs) / (gpus * duration_seconds)


# -- objects ---------------------------------------------------------------------------------------


def build_claim(name: str, *, memory_gi: int = 0, count: int = 1) -> dict[str, Any]:
    """A share (``memory_gi``) or ``count`` whole GPUs (no capacity request: the whole device)."""
    exactly: dict[str, Any] = {"deviceClassName": "gpu.fractional.dev", "count": count}
    if memory_gi:
        exactly["capacity"] = {"requests": {"memory": f"{memory_gi}Gi"}}
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }  # fmt: skip


def build_share_pod(name: str, claim_name: str, *, owner: str, node: str, started: float) -> dict[str, Any]:
    """A running share pod of ReplicaSet ``owner``, opted in to moves."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}",
                     "labels": {MOVABLE_LABEL: "true"},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": owner,
                                          "uid": f"uid-{owner}", "controller": True}]},
        "spec": {"nodeName": node, "priority": 0,
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}],
                 "containers": [{"name": "main", "image": "x"}]},
        "status": {"phase": "Running", "startTime": _timestamp(started)},
    }  # fmt: skip


def _timestamp(simulated_seconds: float) -> str:
    return datetime.fromtimestamp(EPOCH_SECONDS + simulated_seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def allocated(claim: Mapping[str, Any], allocation: dict[str, Any]) -> dict[str, Any]:
    return {**claim, "status": {"allocation": allocation}}


def claim_uid(claim: Mapping[str, Any]) -> str:
    return str(claim["metadata"]["uid"])


def result_devices(allocation: Mapping[str, Any]) -> list[DeviceKey]:
    return [
        (str(r["driver"]), str(r["pool"]), str(r["device"]))
        for r in (allocation.get("devices") or {}).get("results") or ()
    ]


def build_state(nodes: int) -> tuple[ClusterState, list[str]]:
    return empty_cluster(nodes)


class Ledger:
    """What the state holds, per device, kept beside it: the whole GPUs free, the free memory in the
    shape of ``ClusterState.free_summary`` (for ``adds_up``), claims per device, the reservations
    too (for ``useful_movers``, ``devices_freed`` and ``drain_order``). Every claim counted or
    released goes through it."""

    def __init__(self, state: ClusterState, nodes: list[str]) -> None:
        self.state = state
        self.summary: dict[str, dict[str, dict[str, Any]]] = {
            n: {f"gpu-{g}": {"pool": n, "shares": 0, "exclusive": False, "memory_bytes_free": GPU_GI * GI,
                              "memory_bytes_total": GPU_GI * GI} for g in range(GPUS_PER_NODE)}
            for n in nodes
        }  # fmt: skip
        self.claims: dict[str, tuple[list[DeviceKey], int]] = {}  # uid -> devices, GiB each
        # claims per device, reservations too: Consolidator._holders (claims and the preemptor's holds)
        self.taken: dict[DeviceKey, int] = {}
        self.whole_free_by_node = dict.fromkeys(nodes, GPUS_PER_NODE)
        self.whole_free = len(nodes) * GPUS_PER_NODE
        self.free_gi = len(nodes) * GPUS_PER_NODE * GPU_GI

    def count(self, claim: Mapping[str, Any], allocation: dict[str, Any], *, gi_each: int) -> None:
        uid = claim_uid(claim)
        self.state.upsert_claim(allocated(claim, allocation))
        devices = result_devices(allocation)
        self.claims[uid] = (devices, gi_each)
        for device in devices:
            self._change(device, +1, -gi_each)

    def release(self, uid: str) -> None:
        devices, gi_each = self.claims.pop(uid)
        self.state.remove_claim(uid)
        for device in devices:
            self._change(device, -1, +gi_each)

    def _change(self, device: DeviceKey, shares: int, gi: int) -> None:
        _, node, name = device
        info = self.summary[node][name]
        before = info["shares"]
        info["shares"] = before + shares
        if info["shares"]:
            self.taken[device] = info["shares"]
        else:
            self.taken.pop(device, None)
        info["memory_bytes_free"] += gi * GI
        self.free_gi += gi
        change = (info["shares"] == 0) - (before == 0)
        self.whole_free_by_node[node] += change
        self.whole_free += change

    def may_fit(self, *, pods: int, gpus_per_pod: int) -> bool:
        """Whether ``pods`` pods of ``gpus_per_pod`` whole GPUs each could fit (exact: one device type)."""
        if pods * gpus_per_pod > self.whole_free:
            return False
        room = 0
        for free in self.whole_free_by_node.values():
            room += free // gpus_per_pod
            if room >= pods:
                return True
        return False


# -- the simulation --------------------------------------------------------------------------------


@dataclass(eq=False)
class Unit:
    """One FIFO entry: a share pod, a whole-GPU pod or a gang (its pods placed together)."""

    job: Job
    name: str
    arrival: float
    state: str = "pending"  # pending | running | moving | done
    instance: int = 0
    claims: list[dict[str, Any]] = field(default_factory=list)  # of the current instance
    end: float | None = None
    failed_epoch: int = -1
    backoff_until: float = 0.0
    backoff_failures: int = 0
    reserved: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    moved_at: float = 0.0
    returning: bool = False

    @property
    def shape(self) -> tuple[str, int, int, int]:
        pods = 1 if self.job.kind == "share" else self.job.pods
        return self.job.kind, self.job.memory_gi, pods, self.job.gpus_per_pod

    def new_claims(self) -> list[dict[str, Any]]:
        self.instance += 1
        job = self.job
        if job.kind == "share":
            self.claims = [build_claim(f"{self.name}-i{self.instance}", memory_gi=job.memory_gi)]
        else:
            self.claims = [build_claim(f"{self.name}-p{p}-i{self.instance}", count=job.gpus_per_pod)
                           for p in range(job.pods)]  # fmt: skip
        return self.claims

    def gi_each(self) -> int:
        return self.job.memory_gi if self.job.kind == "share" else GPU_GI


@dataclass
class Measures:
    whole_waits: list[float] = field(default_factory=list)
    gang_waits: list[float] = field(default_factory=list)
    whole_never: int = 0
    gang_never: int = 0
    whole_free_integral: float = 0.0
    used_gi_integral: float = 0.0
    plans_searched: int = 0
    plans_committed: int = 0
    pods_moved: int = 0
    gpus_freed: int = 0
    scheduled_moved: int = 0  # of pods_moved and gpus_freed: the scheduled pass's (one GPU a pass)
    scheduled_freed: int = 0
    replacement_failures: int = 0
    moved_downtime: list[float] = field(default_factory=list)
    search_ms: list[float] = field(default_factory=list)
    fit_checks: int = 0
    allocator_misses: int = 0  # the ledger said it could fit, the allocator said no


class Simulation:
    def __init__(self, *, nodes: int, variant: str, seed: str, settings: Settings = Settings()) -> None:
        self.variant = variant
        self.settings = settings
        self.seed = seed
        self.state, self.nodes = build_state(nodes)
        self.ledger = Ledger(self.state, self.nodes)
        self.rng = random.Random(f"{seed}:allocator")
        self.events: list[tuple[float, int, str, Any]] = []
        self.sequence = 0
        self.pending: list[Unit] = []
        self.epoch = 0  # bumped at every release: a pod that failed before may fit now
        self.share_pods: dict[str, dict[str, Any]] = {}  # "namespace/name" -> running share pod
        self.share_claims: dict[str, dict[str, Any]] = {}  # "namespace/name" -> its allocated claim
        self.unit_of: dict[str, Unit] = {}  # running share pod key -> its unit
        self.owner_moved_at: dict[str, float] = {}  # owner UID -> epoch seconds of its last move
        self.measures = Measures()
        self.window = (0.0, 0.0)
        self.now = 0.0

    # -- events

    def push(self, when: float, kind: str, payload: Any) -> None:
        self.sequence += 1
        heapq.heappush(self.events, (when, self.sequence, kind, payload))

    def run(self, jobs: Iterable[Job], *, duration_seconds: float, warmup_seconds: float) -> Measures:
        self.window = (warmup_seconds, duration_seconds)
        for job in jobs:
            self.push(job.arrival, "arrive", job)
        if self.variant == "on+scheduled":
            interval = self.settings.schedule_interval_seconds
            for tick in range(int(duration_seconds // interval) + 1):
                self.push(tick * interval, "tick", None)
        while self.events and self.events[0][0] < duration_seconds:
            when, _, kind, payload = heapq.heappop(self.events)
            self.advance(when)
            getattr(self, f"on_{kind}")(payload)
            if not self.events or self.events[0][0] > when:  # after the last event at this instant
                self.schedule()
        self.advance(duration_seconds)
        for unit in self.pending:
            if unit.job.kind != "share" and not unit.returning and self.in_window(unit.arrival):
                waits = self.measures.whole_waits if unit.job.kind == "whole" else self.measures.gang_waits
                waits.append(duration_seconds - unit.arrival)
                if unit.job.kind == "whole":
                    self.measures.whole_never += 1
                else:
                    self.measures.gang_never += 1
        return self.measures

    def in_window(self, when: float) -> bool:
        return self.window[0] <= when < self.window[1]

    def advance(self, when: float) -> None:
        start = max(self.now, self.window[0])
        if when > start:
            span = when - start
            self.measures.whole_free_integral += self.ledger.whole_free * span
            total_gi = len(self.nodes) * GPUS_PER_NODE * GPU_GI
            self.measures.used_gi_integral += (total_gi - self.ledger.free_gi) * span
        self.now = max(self.now, when)

    def on_arrive(self, job: Job) -> None:
        if job.kind == "share":  # one FIFO entry per replica
            units = [Unit(job, f"{job.name}-r{r}", job.arrival) for r in range(job.pods)]
        else:
            units = [Unit(job, job.name, job.arrival)]
        for unit in units:
            unit.new_claims()
        self.pending += units

    def on_depart(self, unit: Unit) -> None:
        if unit.state == "running":
            self.release(unit)
        elif unit.state == "moving":
            for held, _ in unit.reserved:
                self.ledger.release(claim_uid(held))
            unit.reserved = []
            self.epoch += 1
        elif unit.state == "pending":
            self.pending.remove(unit)
        unit.state = "done"

    def on_tick(self, _: None) -> None:
        """The scheduled pass, due: when the stranded share of GPU memory reaches the threshold."""
        if stranded_ratio(self.ledger.summary) >= self.settings.schedule_stranded_ratio:
            self.drain_one()

    def on_return(self, unit: Unit) -> None:
        """A moved pod's replacement: its reserved place (on), or the normal policy (kai-like)."""
        if unit.state != "moving":
            return
        if unit.reserved:
            for held, _ in unit.reserved:
                self.ledger.release(claim_uid(held))
            claims = unit.new_claims()
            self.start(unit, [a for _, a in unit.reserved])
            unit.reserved = []
            assert len(claims) == 1
            return
        unit.state, unit.returning = "pending", True
        unit.new_claims()
        if not self.try_place(unit):
            self.measures.replacement_failures += 1
            unit.failed_epoch = self.epoch
            self.pending.append(unit)

    # -- placement

    def allocate(self, claims: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        return self.state.allocate(
            claims, node=None, policy=POLICY, pod_groups=[[i] for i in range(len(claims))],
            exclude_nodes=frozenset(), rng=self.rng,
        )  # fmt: skip

    def allocate_together(self, claims: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """``claims`` on one node (a mover's stand-ins)."""
        return self.state.allocate(
            claims, node=None, policy=POLICY, pod_groups=[list(range(len(claims)))],
            exclude_nodes=frozenset(), rng=self.rng,
        )  # fmt: skip

    def try_place(self, unit: Unit) -> bool:
        job = unit.job
        if job.kind != "share" and not self.ledger.may_fit(pods=job.pods, gpus_per_pod=job.gpus_per_pod):
            return False
        result = self.allocate(unit.claims)
        if result is None:
            self.measures.allocator_misses += job.kind != "share"
            return False
        self.start(unit, result)
        return True

    def start(self, unit: Unit, allocations: list[dict[str, Any]]) -> None:
        job = unit.job
        for claim, allocation in zip(unit.claims, allocations, strict=True):
            self.ledger.count(claim, allocation, gi_each=unit.gi_each())
        if unit.returning or unit.state == "moving":
            self.measures.moved_downtime.append(self.now - unit.moved_at)
        elif job.kind != "share" and self.in_window(unit.arrival):
            (self.measures.whole_waits if job.kind == "whole" else self.measures.gang_waits).append(
                self.now - unit.arrival
            )
        if unit.end is None:
            unit.end = self.now + job.life_seconds
            self.push(unit.end, "depart", unit)
        unit.state = "running"
        if job.kind == "share":
            claim = allocated(unit.claims[0], allocations[0])
            pod_name = f"{unit.name}-i{unit.instance}"
            node = allocation_node(allocations[0]) or ""
            key = f"{NAMESPACE}/{pod_name}"
            self.share_pods[key] = build_share_pod(pod_name, claim["metadata"]["name"], owner=job.name,
                                                   node=node, started=self.now)  # fmt: skip
            self.share_claims[f"{NAMESPACE}/{claim['metadata']['name']}"] = claim
            self.unit_of[key] = unit

    def release(self, unit: Unit) -> None:
        for claim in unit.claims:
            self.ledger.release(claim_uid(claim))
        if unit.job.kind == "share":
            key = f"{NAMESPACE}/{unit.name}-i{unit.instance}"
            del self.share_pods[key], self.unit_of[key]
            del self.share_claims[f"{NAMESPACE}/{unit.claims[0]['metadata']['name']}"]
        self.epoch += 1

    def schedule(self) -> None:
        while True:
            self.place_pending()
            if self.variant == "off" or not self.consolidate_one():
                return

    def place_pending(self) -> None:
        failed: set[tuple[str, int, int, int]] = set()
        for unit in list(self.pending):
            if unit.shape in failed or unit.failed_epoch == self.epoch:
                continue
            if self.try_place(unit):
                self.pending.remove(unit)
            else:
                unit.failed_epoch = self.epoch
                failed.add(unit.shape)

    # -- consolidation

    def consolidate_one(self) -> bool:
        """Search a plan for the oldest pending whole-GPU pod or gang that may be served; True once one
        is committed."""
        no_plan: set[tuple[str, int, int, int]] = set()
        summary_nodes = self.nodes
        for unit in self.pending:
            job = unit.job
            if job.kind == "share" or unit.returning or self.now < unit.backoff_until:
                continue
            if self.ledger.free_gi < job.pods * job.gpus_per_pod * GPU_GI:
                continue  # adds_up would say no (one device type): skip building its argument
            if not adds_up(self.ledger.summary, summary_nodes, unit.claims):
                continue
            if unit.shape in no_plan:  # the same search on the same state found nothing a moment ago
                self.back_off(unit)
                continue
            plan = self.search(unit)
            if plan is None:
                no_plan.add(unit.shape)
                self.back_off(unit)
                continue
            self.commit(unit, plan)
            return True
        return False

    def back_off(self, unit: Unit) -> None:
        delay = min(
            self.settings.backoff_max_seconds, self.settings.backoff_seconds * 2**unit.backoff_failures
        )
        unit.backoff_failures += 1
        unit.backoff_until = self.now + delay

    def movers(self) -> list[Mover]:
        movers, _ = build_movers(
            self.share_pods.values(), self.share_claims, waiting_priority=0, now=EPOCH_SECONDS + self.now,
            rules=self.settings.rules, moved_at=self.owner_moved_at.get,
        )  # fmt: skip
        return movers

    def search(self, unit: Unit) -> MovePlan | None:
        started = time.perf_counter()
        # As the consolidator: only the movers worth a fit check (a gang of whole GPUs here).
        movers = useful_movers(self.movers(), self.ledger.summary, self.ledger.taken, whole_only=True)
        plan = (
            find_plan(
                movers,
                fits=self.fit_check(unit, movers),
                budget=self.settings.budget,
                clock=lambda: 0.0,
                group_size=unit.job.gpus_per_pod,
                groups_wanted=unit.job.pods,
            )
            if movers
            else None
        )
        self.measures.search_ms.append((time.perf_counter() - started) * 1000)
        self.measures.plans_searched += 1
        return plan

    def fit_check(
        self, unit: Unit, movers: list[Mover]
    ) -> Callable[[frozenset[str]], tuple[Placement, tuple[Move, ...]] | None]:
        """``Consolidator._fit_check`` on the bench's state, without the node CPU/memory check."""
        by_key = {m.key: m for m in movers}

        def fits(moved: frozenset[str]) -> tuple[Placement, tuple[Move, ...]] | None:
            self.measures.fit_checks += 1
            released = [c for k in sorted(moved) for c in by_key[k].claims]
            for claim in released:
                self.state.remove_claim(claim_uid(claim))
            try:
                return self.place_all(unit, [by_key[k] for k in sorted(moved)])
            finally:
                for claim in released:
                    self.state.upsert_claim(claim)

        return fits

    def place_all(self, unit: Unit, moved: list[Mover]) -> tuple[Placement, tuple[Move, ...]] | None:
        """``Consolidator._place_all`` and ``_place_mover``: the gang, then every mover, the largest first,
        as stand-ins, each held while the next is placed; the state as it was on return."""
        chosen = self.allocate(unit.claims)
        if chosen is None:
            return None
        held: list[str] = []
        try:
            for claim, allocation in zip(unit.claims, chosen, strict=True):
                self.state.upsert_claim(allocated(claim, allocation))
                held.append(claim_uid(claim))
            moves = self.place_movers(sorted(moved, key=lambda m: (-len(m.devices), m.key)), held)
            if moves is None:
                return None
            pod_nodes = tuple((f"{NAMESPACE}/{c['metadata']['name']}", allocation_node(a))
                              for c, a in zip(unit.claims, chosen, strict=True))  # fmt: skip
            return Placement(
                allocations=tuple(zip(unit.claims, chosen, strict=True)), pod_nodes=pod_nodes
            ), tuple(moves)
        finally:
            for uid in held:
                self.state.remove_claim(uid)

    def place_movers(self, movers: list[Mover], held: list[str]) -> list[Move] | None:
        """``Consolidator._place_mover`` for each mover in turn, as stand-ins of its claims on one node,
        each held (its UID appended to ``held``, for the caller to remove) while the next is placed."""
        moves: list[Move] = []
        for mover in movers:
            stand_ins = [stand_in(c) for c in mover.claims]
            result = self.allocate_together(stand_ins)
            node = next((n for a in result if (n := allocation_node(a))), None) if result else None
            if result is None or node is None:
                return None
            for copy, allocation in zip(stand_ins, result, strict=True):
                self.state.upsert_claim(allocated(copy, allocation))
                held.append(claim_uid(copy))
            pairs = tuple(zip(stand_ins, result, strict=True))
            moves.append(Move(mover=mover.key, node=node, allocations=pairs))
        return moves

    def commit(self, unit: Unit, plan: MovePlan) -> None:
        """The movers' claims released, the gang placed on the plan's placement, and (on) every move's
        place held for its replacement; the replacements come back after the restart delay."""
        measures = self.measures
        measures.plans_committed += 1
        measures.gpus_freed += devices_freed(plan, self.ledger.taken)
        self.move(plan.movers, plan.moves)
        self.pending.remove(unit)
        self.start(unit, [a for _, a in plan.placement.allocations])

    def move(self, movers: Iterable[Mover], moves: Iterable[Move]) -> None:
        """Each mover's pods evicted, their claims released; (but for kai-like) the planned place held."""
        by_mover = {m.mover: m for m in moves}
        for mover in movers:
            self.owner_moved_at[mover.owner_uid] = EPOCH_SECONDS + self.now
            for pod in mover.pods:
                key = f"{NAMESPACE}/{pod['metadata']['name']}"
                moved = self.unit_of[key]
                self.release(moved)
                moved.state, moved.moved_at = "moving", self.now
                self.measures.pods_moved += 1
                if self.variant != "kai-like":
                    moved.reserved = list(by_mover[mover.key].allocations)
                    for copy, allocation in moved.reserved:
                        self.ledger.count(copy, allocation, gi_each=moved.gi_each())
                low, high = self.settings.restart_seconds
                delay = random.Random(f"{self.seed}:{key}").uniform(low, high)
                self.push(self.now + delay, "return", moved)

    # -- the scheduled pass

    def drain_one(self) -> bool:
        """``Consolidator.defragment``: the first GPU in ``drain_order`` (movers with a spare replica)
        whose pods all find a place beside others on partly used GPUs, within the fit-check budget;
        moved as ``on`` moves them. True when one was emptied."""
        movers = [m for m in self.movers() if m.spare]
        free = [
            (DRIVER, node, name)
            for node, devices in self.ledger.summary.items() for name, info in devices.items()
            if not info["shares"]
        ]  # fmt: skip
        budget = self.settings.budget
        most = min(self.settings.schedule_max_moves_per_gpu, budget.max_moves)
        order = drain_order(movers, self.ledger.taken, self.ledger.summary, max_pods=most)
        for checks, (device, held) in enumerate(order):
            if checks >= budget.fit_checks:
                break
            moves = self.drain(held, [device, *free])
            if moves is not None:
                self.measures.scheduled_moved += sum(len(m.pods) for m in held)
                self.measures.scheduled_freed += 1
                self.measures.gpus_freed += 1
                self.move(held, moves)
                return True
        return False

    def drain(self, movers: list[Mover], kept: list[DeviceKey]) -> list[Move] | None:
        """``Consolidator._drain``: each mover placed again (by key) with its claims released and the
        ``kept`` devices held whole; the state as it was on return."""
        released = [c for m in movers for c in m.claims]
        for claim in released:
            self.state.remove_claim(claim_uid(claim))
        held: list[str] = []
        try:
            for device in kept:
                claim, allocation = whole_hold(device)
                self.state.upsert_claim(allocated(claim, allocation))
                held.append(claim_uid(claim))
            return self.place_movers(sorted(movers, key=lambda m: m.key), held)
        finally:
            for uid in held:
                self.state.remove_claim(uid)
            for claim in released:
                self.state.upsert_claim(claim)


# -- the run ---------------------------------------------------------------------------------------


def _stats(prefix: str, values: list[float]) -> dict[str, Any]:
    if not values:
        return {f"{prefix} mean s": float("nan"), f"{prefix} p50 s": float("nan"),
                f"{prefix} p90 s": float("nan"), f"{prefix} p99 s": float("nan")}  # fmt: skip
    return {
        f"{prefix} mean s": sum(values) / len(values),
        f"{prefix} p50 s": percentile(values, 50),
        f"{prefix} p90 s": percentile(values, 90),
        f"{prefix} p99 s": percentile(values, 99),
    }


@dataclass(frozen=True, slots=True)
class Outcome:
    """One simulation's measures and what the row needs beside them."""

    measures: Measures
    window_seconds: float
    gpus: int
    whole_free_end: int
    wall_seconds: float


def simulate(
    *, nodes: int, load: float, variant: str, seed: int, duration_seconds: float, warmup_seconds: float,
    settings: Settings = Settings(),
) -> Outcome:  # fmt: skip
    gpus = nodes * GPUS_PER_NODE
    stream = f"{seed}:{nodes}:{load}"
    jobs = build_arrivals(gpus=gpus, load=load, duration_seconds=duration_seconds, seed=stream)
    simulation = Simulation(nodes=nodes, variant=variant, seed=stream, settings=settings)
    started = time.perf_counter()
    measures = simulation.run(jobs, duration_seconds=duration_seconds, warmup_seconds=warmup_seconds)
    return Outcome(measures, duration_seconds - warmup_seconds, gpus, simulation.ledger.whole_free,
                   time.perf_counter() - started)  # fmt: skip


def row_of(nodes: int, load: float, variant: str, outcomes: list[Outcome]) -> dict[str, Any]:
    """One row over the seeds' simulations: waits pooled (every pod of every seed), counts summed,
    averages over the seeds."""
    runs = [o.measures for o in outcomes]
    whole = [w for m in runs for w in m.whole_waits]
    gang = [w for m in runs for w in m.gang_waits]
    moved, freed = sum(m.pods_moved for m in runs), sum(m.gpus_freed for m in runs)
    scheduled_moved, scheduled_freed = (
        sum(m.scheduled_moved for m in runs),
        sum(m.scheduled_freed for m in runs),
    )
    downtime = [d for m in runs for d in m.moved_downtime]
    searches = summary([ms for m in runs for ms in m.search_ms])
    n = len(outcomes)
    pairs = list(zip(runs, outcomes, strict=True))
    used = sum(100 * m.used_gi_integral / (o.window_seconds * o.gpus * GPU_GI) for m, o in pairs)
    return {
        "nodes": nodes, "load": load, "variant": variant, "seeds": n,
        "whole pods": len(whole), **_stats("whole wait", whole),
        "whole never placed": sum(m.whole_never for m in runs),
        "gangs": len(gang), **_stats("gang wait", gang),
        "gangs never placed": sum(m.gang_never for m in runs),
        "GPU memory used %": used / n,
        "whole GPUs free avg": sum(m.whole_free_integral / o.window_seconds for m, o in pairs) / n,
        "whole GPUs free end": sum(o.whole_free_end for o in outcomes) / n,
        "plans searched": sum(m.plans_searched for m in runs),
        "plans committed": sum(m.plans_committed for m in runs),
        "pods moved": moved, "GPUs freed": freed,
        "moves per GPU freed": _ratio(moved, freed),
        "scheduled pods moved": scheduled_moved,
        "on-demand moves per GPU freed": _ratio(moved - scheduled_moved, freed - scheduled_freed),
        "re-placement failures": sum(m.replacement_failures for m in runs),
        "moved pod down s mean": sum(downtime) / len(downtime) if downtime else float("nan"),
        "find_plan ms median": searches["median"], "find_plan ms p99": searches["p99"],
        "sim wall s": sum(o.wall_seconds for o in outcomes),
    }  # fmt: skip


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Mean waits against ``off`` of the same nodes and load (<= 0.5: halved)."""
    off = {(r["nodes"], r["load"]): r for r in rows if r["variant"] == "off"}
    for row in rows:
        base = off.get((row["nodes"], row["load"]))
        for what in ("whole", "gang"):
            mine, theirs = row[f"{what} wait mean s"], base[f"{what} wait mean s"] if base else float("nan")
            row[f"{what} wait vs off"] = mine / theirs if theirs and theirs == theirs else float("nan")


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def _per_size(parser: argparse.ArgumentParser, flag: str, text: str, sizes: int) -> list[float]:
    values = _floats(text)
    if len(values) == 1:
        values *= sizes
    if len(values) != sizes:
        parser.error(f"{flag} {text}: give one value, or one per node count")
    return values


def _simulate(case: tuple[int, float, str, int, float, float]) -> Outcome:
    nodes, load, variant, seed, duration, warmup = case
    outcome = simulate(nodes=nodes, load=load, variant=variant, seed=seed, duration_seconds=duration,
                       warmup_seconds=warmup)  # fmt: skip
    print(f"{nodes} nodes, load {load}, {variant}, seed {seed}: {outcome.wall_seconds:.1f} s",
          file=sys.stderr, flush=True)  # fmt: skip
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="50,500", help="node counts, comma-separated")
    parser.add_argument("--loads", default="0.65,0.8,0.9", help="offered loads, comma-separated")
    parser.add_argument("--seed", type=int, default=1, help="the first seed")
    parser.add_argument(
        "--seeds", default="3,1", help="seeds run (from --seed on): one, or one per node count"
    )
    parser.add_argument(
        "--duration",
        default="57600,3600",
        help="simulated seconds, warm-up included: one, or one per node count",
    )
    parser.add_argument("--warmup", default="3600,1800", help="simulated seconds not measured, as --duration")
    parser.add_argument("--jobs", type=int, default=2, help="simulations run at once (processes)")
    args = parser.parse_args()
    nodes_list = [int(n) for n in _floats(args.nodes)]
    durations = _per_size(parser, "--duration", args.duration, len(nodes_list))
    warmups = _per_size(parser, "--warmup", args.warmup, len(nodes_list))
    seeds = [int(k) for k in _per_size(parser, "--seeds", args.seeds, len(nodes_list))]
    cases = [
        (nodes, load, variant, seed, duration, warmup)
        for nodes, duration, warmup, count in zip(nodes_list, durations, warmups, seeds, strict=True)
        for load in _floats(args.loads)
        for variant in VARIANTS
        for seed in range(args.seed, args.seed + count)
    ]
    cases.sort(
        key=lambda c: (-c[0], c[2] == "off")
    )  # the largest and slowest first: the pool ends with short ones
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        done = dict(zip(cases, pool.map(_simulate, cases), strict=True))
    order = {v: i for i, v in enumerate(VARIANTS)}
    groups: dict[tuple[int, float, str], list[Outcome]] = {}
    for case in sorted(cases, key=lambda c: (c[0], c[1], order[c[2]], c[3])):
        groups.setdefault(case[:3], []).append(done[case])
    rows = [row_of(*key, outcomes) for key, outcomes in groups.items()]
    add_ratios(rows)
    header = list(rows[0])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        cells = [f"{row[h]:.2f}" if isinstance(row[h], float) else str(row[h]) for h in header]
        print("| " + " | ".join(cells) + " |")
    runs = ", ".join(f"{d:.0f} s on {n} nodes (warm-up {w:.0f} s; seeds {args.seed}-{args.seed + k - 1})"
                     for n, d, w, k in zip(nodes_list, durations, warmups, seeds, strict=True))  # fmt: skip
    idle = [
        f"{r['nodes']} nodes at {r['load']}"
        for r in rows
        if r["variant"] == "off" and not r["whole wait mean s"] and not r["gang wait mean s"]
    ]
    notes = NOTES.format(runs=runs, jobs=args.jobs)
    if idle:
        notes += f"With consolidation off, no whole-GPU pod or gang waited at all on {', '.join(idle)}.\n"
    write_result(
        "consolidation", rows, title="Consolidation: whole-GPU and gang waits under churn", notes=notes
    )


NOTES = """\
A discrete-event simulation in simulated time (bench/bench_consolidation.py docstring), in process: N nodes
x 8 GPUs of 80 GiB in the allocator's ClusterState, placements by `state.allocate(..., policy="best-fit")`;
node CPU/memory not modelled. Arrivals (Poisson, the same stream for the four variants; the cluster starts
in steady state): ReplicaSets of 1-4 share pods of 8-56 GiB, labelled movable (60 % of the offered GPU
load, lifetimes exp. mean 60 min), whole-GPU pods (20 %, mean 20 min) and gangs of 2-4 pods x 1-4 GPUs
(20 %, mean 30 min); `load` is the offered load, `GPU memory used %` what the cluster held. Simulated
{runs}; {jobs} simulations at once; a row pools its seeds (waits of all pods together, counts summed).
Consolidation: `build_movers` (min runtime 600 s, cooldown 1800 s),
`useful_movers` (as the consolidator) and `find_plan` (64 fit checks, 16 moves; its ms budget off, for
determinism) with a fit check mirroring
Consolidator._fit_check/_place_all/_place_mover without the node CPU/memory check; `on` holds each moved
pod's planned place until its replacement returns 20-60 s later; `kai-like` commits the same plans with no
reservation (the replacement is placed by the normal policy; a re-placement failure when it does not fit at
that moment); `on+scheduled` is `on` with the scheduled pass every 15 s while stranded memory is at least
2 % of all GPU memory (schedule.intervalSeconds 15, strandedRatio 0.02, maxMovesPerGPU 1: one GPU a pass,
only GPUs one move of a pod with a spare replica empties). `scheduled pods moved`: of `pods moved`, the
scheduled pass's (each freed one GPU); `on-demand moves per GPU freed`: the plans that served a waiting pod
alone. Waits: arrival to placement of whole-GPU pods and gangs arriving after the warm-up, one still
pending at the end counted with its wait so far (and in `never placed`); `vs off`: mean wait over the `off`
row's (nan where `off` waited 0). `plans searched`: consolidation attempts that built the movers (a
search with no mover included). `find_plan ms`: wall time per search, building the movers included (the
only timing; shared noisy machine). `moved pod down s mean`: eviction to the replacement's placement.
"""


if __name__ == "__main__":
    main()

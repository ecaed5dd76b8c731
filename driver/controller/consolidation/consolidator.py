"""Consolidation: when a gang of ours does not fit and no preemption serves it, move pods that may
move (``movers``) so that it fits, with a new place kept for every moved pod's replacement.

``consolidate`` runs as the job of an unschedulable gang, on a writer thread, after the preemptor
found nothing to do. In order:

1. the gang may be served: not backing off, and the free GPU memory of the nodes it may use adds
   up to what its pending claims ask (else nothing can help it but more nodes);
2. the movers (opt-in label on the pod, its namespace or its claims' DeviceClasses; guards in
   ``movers``), read under ``cache.lock`` with the namespaces opted in read before it;
3. the plan (``search.find_plan``) under ``cache.lock``, the fit check being the allocator: the
   movers' claims released, the gang placed, then each mover placed again (its pod's CPU and
   memory checked on its new node) with the gang's devices and the earlier movers' held;
4. the holds, under ``cache.lock``: a nomination for the gang (the preemptor's, source
   ``consolidation``) and a ``Reservation`` per moved pod for its replacement (the next gated
   pod of the same controller goes there);
5. the effects: a dry run of every eviction first (one refusal, a PodDisruptionBudget, and
   nothing moves: the holds are dropped, an Event says why, the gang backs off), then Events on
   the gang (``Consolidating``), ``status.nominatedNodeName``, and per moved pod the
   ``DisruptionTarget`` condition, the eviction and an Event (``Consolidated``).

What it does not do yet: make-before-break for a Deployment without a spare replica (its
``maxSurge``), and the scheduled pass on the fragmentation gauges; a moved pod's replacement is
kept its devices, not its node's CPU and memory.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from kubernetes import client

from driver import DRIVER_NAME
from driver.controller.consolidation.movers import (
    MOVABLE_LABEL,
    Mover,
    MoverRules,
    Refusals,
    build_movers,
    mover_room,
)
from driver.controller.consolidation.movers import controller_owner as controller_of
from driver.controller.consolidation.search import Budget, Move, MovePlan, cost_of, find_plan
from driver.controller.gangs.decide import (
    allocate_groups,
    group_node,
    static_exclusions,
    tentative_allocations,
)
from driver.controller.gangs.nodefit import node_rejection
from driver.controller.gangs.plan import GangPlan, gang_spec
from driver.controller.gangs.topology import decide_in_domains
from driver.controller.metrics import ControllerMetrics
from driver.controller.model.decode import bounded
from driver.controller.model.objects import (
    GangKey,
    Resources,
    allocation_node,
    is_terminated,
    node_allocatable,
    object_key,
    pod_requests,
    quantity,
)
from driver.controller.preemption.preemptor import (
    Nomination,
    Preemptor,
    Reservation,
    gang_priority,
    gang_room,
)
from driver.controller.preemption.victims import Budget as DisruptionBudget
from driver.controller.preemption.victims import (
    DeviceKey,
    Placement,
    count_violations,
    device_holders,
)
from driver.controller.view.cache import ClusterCache, Kind
from driver.errors import FractionalError, NotFoundError
from driver.kube import REQUEST_TIMEOUT_SECONDS, api_errors, new_api_client

__all__ = [
    "CONDITION_REASON",
    "EVENT_REASON_BLOCKED",
    "EVENT_REASON_CONSOLIDATED",
    "EVENT_REASON_CONSOLIDATING",
    "REPLACES_ANNOTATION",
    "Rollout",
    "ConsolidationSettings",
    "Consolidator",
    "Schedule",
    "adds_up",
    "asks_whole_devices",
    "devices_freed",
    "devices_per_pod",
    "drain_order",
    "in_window",
    "rollout_patch",
    "stranded_ratio",
    "stand_in",
    "surge_rollout",
    "useful_movers",
    "whole_hold",
]

log = logging.getLogger(__name__)

CONDITION_REASON = "ConsolidationByFractional"
EVENT_REASON_CONSOLIDATING = "Consolidating"  # on the waiting gang's pods: the moves and its place
EVENT_REASON_CONSOLIDATED = "Consolidated"  # on each moved pod: why, and where its replacement goes
EVENT_REASON_BLOCKED = "ConsolidationBlocked"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
SCHEDULED = "scheduled"  # the reservations of the scheduled pass are kept under this key
# On a Deployment's pod template, set for a make-before-break move: the moved pod's UID. Its
# replacement carries it, and takes the room kept for it by this mark (its ReplicaSet is new).
REPLACES_ANNOTATION = "fractional.dev/replaces"


@dataclass(frozen=True, slots=True)
class Schedule:
    """The scheduled pass (off by default): when the share of free GPU memory stranded on partly
    used GPUs reaches ``stranded_ratio``, within ``window`` (minutes of the UTC day, [start, end),
    wrapping past midnight; None: any time), at most every ``interval_seconds``, free one GPU by
    moving its shares beside others on partly used GPUs."""

    enabled: bool = False
    window: tuple[int, int] | None = None
    stranded_ratio: float = 0.25
    interval_seconds: float = 300.0
    max_moves_per_gpu: int = 1  # a GPU holding more pods that would move is not emptied


def in_window(window: tuple[int, int] | None, minute: int) -> bool:
    if window is None:
        return True
    start, end = window
    return start <= minute < end if start < end else minute >= start or minute < end


def stranded_ratio(free_summary: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> float:
    """Free memory on partly used GPUs over all GPU memory (0 when there is none)."""
    total = stranded = 0
    for devices in free_summary.values():
        for device in devices.values():
            total += int(device.get("memory_bytes_total") or 0)
            if device.get("shares") and not device.get("exclusive"):
                stranded += int(device.get("memory_bytes_free") or 0)
    return stranded / total if total else 0.0


@dataclass(frozen=True, slots=True)
class ConsolidationSettings:
    schedule: Schedule = field(default_factory=Schedule)
    rules: MoverRules = field(default_factory=MoverRules)
    budget: Budget = field(default_factory=Budget)
    reservation_seconds: float = 300.0  # a replacement not placed by then: its place is given up
    backoff_seconds: float = (
        30.0  # after a plan was refused or found nothing; doubling (--consolidation-retry)
    )
    backoff_max_seconds: float = 600.0


@dataclass(frozen=True, slots=True)
class Rollout:
    """A make-before-break move: the pod's Deployment rolls out a new pod (it surges), placed on
    the room kept for it, then removes the old one once the new one is ready."""

    namespace: str
    deployment: str
    surge: int
    token: str = ""  # the template annotation REPLACES_ANNOTATION's value: the moved pod's UID


def _resolve(value: Any, replicas: int, *, round_up: bool) -> int | None:
    """A rolling update's maxSurge/maxUnavailable (an int or "N%") against ``replicas``."""
    if isinstance(value, int):
        return value
    text = str(value)
    if not text.endswith("%") or not text[:-1].isdigit():
        return None
    scaled = int(text[:-1]) * replicas
    return -(-scaled // 100) if round_up else scaled // 100


def surge_rollout(deployment: Mapping[str, Any]) -> Rollout | None:
    """A Rollout when the Deployment makes before it breaks for its one replica: not paused, a
    RollingUpdate whose maxSurge resolves to at least 1 and maxUnavailable to 0 (the Deployment
    controller's rounding: surge up, unavailable down; both default to 25 %)."""
    spec = deployment.get("spec") or {}
    replicas = spec.get("replicas", 1)
    strategy = spec.get("strategy") or {}
    if spec.get("paused") or replicas != 1 or strategy.get("type", "RollingUpdate") != "RollingUpdate":
        return None
    rolling = strategy.get("rollingUpdate") or {}
    surge = _resolve(rolling.get("maxSurge", "25%"), replicas, round_up=True)
    unavailable = _resolve(rolling.get("maxUnavailable", "25%"), replicas, round_up=False)
    if surge is None or unavailable is None or surge < 1 or unavailable != 0:
        return None
    meta = deployment.get("metadata") or {}
    return Rollout(namespace=str(meta.get("namespace")), deployment=str(meta.get("name")), surge=surge)


def devices_per_pod(plan: GangPlan) -> int:
    """The most devices one group of the gang (pods sharing a node) asks for on its node."""
    return max(
        (sum(count for c in g.pending_claims for count, _ in _gpu_requests(c)) for g in plan.groups),
        default=1,
    )


def asks_whole_devices(claims: Iterable[Mapping[str, Any]]) -> bool:
    """Whether every request of ``claims`` asks for whole devices (no capacity request)."""
    return all(memory == 0 for claim in claims for _, memory in _gpu_requests(claim))


def _share_memory(claim: Mapping[str, Any]) -> int:
    """The memory a share of the claim holds (what its replacement will ask), 0 for a whole device."""
    return max((memory for _, memory in _gpu_requests(claim)), default=0)


def useful_movers(
    movers: list[Mover],
    free_summary: Mapping[str, Mapping[str, Mapping[str, Any]]],
    holders: Mapping[DeviceKey, int],
    *,
    whole_only: bool,
    refusals: dict[str, int] | None = None,
) -> list[Mover]:
    """The movers worth a fit check (the search's budget is spent on them; a hopeless one first
    in its order can use it all):

    - for a gang that asks only whole devices, those on a device that their moves can empty (every
      claim on it is a mover's, and nothing else holds it: ``holders`` counts claims and holds per
      device): freeing part of a device frees nothing whole;
    - a share whose memory is larger than every free hole on another device has nowhere to go
      (a free device counts whole).

    Refusals are counted in ``refusals`` (``pinned``, ``no_room``)."""
    on_device = _claims_per_device(movers)
    holes: list[tuple[int, DeviceKey]] = []
    for node, devices in free_summary.items():
        for name, info in devices.items():
            if not info.get("exclusive"):
                key = (DRIVER_NAME, str(info.get("pool") or node), name)
                holes.append((int(info.get("memory_bytes_free") or 0), key))
    holes.sort(reverse=True)
    kept: list[Mover] = []
    for mover in movers:
        if whole_only and not any(on_device.get(d, 0) >= holders.get(d, 0) for d in mover.devices):
            reason = "pinned"
        else:
            asked = max((_share_memory(c) for c in mover.claims), default=0)
            room = next((free for free, device in holes if device not in mover.devices), 0)
            reason = "no_room" if not mover.whole and asked > room else ""
        if reason:
            if refusals is not None:
                refusals[reason] = refusals.get(reason, 0) + len(mover.pods)
            continue
        kept.append(mover)
    return kept


def drain_order(
    movers: Iterable[Mover],
    holders: Mapping[DeviceKey, int],
    free_summary: Mapping[str, Mapping[str, Mapping[str, Any]]],
    *,
    max_pods: int = 1,
) -> list[tuple[DeviceKey, list[Mover]]]:
    """The GPUs the scheduled pass may empty, in the order it tries them: only a GPU whose every
    claim is a share mover's (``holders``: claims and holds per device, as ``Consolidator._holders``
    counts them) and that moving at most
    ``max_pods`` pods empties; the fewest pods moved first (then the least disruption, as
    ``cost_of``), then the GPU on the node with the most GPUs already free (a whole node for a gang
    sooner), then by name."""
    shares = [m for m in movers if not m.whole]
    by_device: dict[DeviceKey, list[Mover]] = {}
    for mover in shares:
        for device in mover.devices:
            by_device.setdefault(device, []).append(mover)
    on_device = _claims_per_device(shares)
    free_by_pool: dict[str, int] = {}
    for node, devices in free_summary.items():
        for info in devices.values():
            if not info.get("shares") and not info.get("exclusive"):
                pool = str(info.get("pool") or node)
                free_by_pool[pool] = free_by_pool.get(pool, 0) + 1
    drainable = [
        (d, held) for d, held in by_device.items()
        if on_device.get(d, 0) >= holders.get(d, 0) and sum(len(m.pods) for m in held) <= max_pods
    ]  # fmt: skip
    drainable.sort(key=lambda entry: (cost_of(entry[1]), -free_by_pool.get(entry[0][1], 0), entry[0]))
    return drainable


def rollout_patch(token: str) -> dict[str, Any]:
    """The Deployment patch of a make-before-break move: only the pod template's annotation."""
    return {"spec": {"template": {"metadata": {"annotations": {REPLACES_ANNOTATION: token}}}}}


def _gpu_requests(claim: Mapping[str, Any]) -> Iterable[tuple[int, int]]:
    """(device count, memory asked per device; 0 for a whole device) per request of the claim."""
    for request in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ():
        exact = request.get("exactly") or next(iter(request.get("firstAvailable") or ()), None) or {}
        count = 1 if exact.get("allocationMode") == "All" else int(exact.get("count") or 1)
        asked = (exact.get("capacity") or {}).get("requests") or {}
        yield count, int(quantity(asked.get("memory", 0))) if asked else 0


def adds_up(
    free_summary: Mapping[str, Mapping[str, Mapping[str, Any]]],
    nodes: Iterable[str],
    claims: Iterable[Mapping[str, Any]],
) -> bool:
    """Whether the free GPU memory on ``nodes`` adds up to what ``claims`` ask (a whole device
    counted at the smallest device's memory there), and enough devices are not taken whole."""
    devices = [d for node in nodes for d in (free_summary.get(node) or {}).values()]
    open_devices = [d for d in devices if not d.get("exclusive")]
    if not open_devices:
        return False
    smallest = min(int(d.get("memory_bytes_total") or 0) for d in open_devices)
    asked = count = 0
    for claim in claims:
        for devices_asked, memory in _gpu_requests(claim):
            count += devices_asked
            asked += devices_asked * (memory or smallest)
    free = sum(int(d.get("memory_bytes_free") or 0) for d in open_devices)
    return free >= asked and len(open_devices) >= count


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def stand_in(claim: dict[str, Any]) -> dict[str, Any]:
    """An unallocated copy of a mover's claim under a name and UID no real claim has: what its
    replacement will ask, placed and held as a reservation."""
    meta = claim["metadata"]
    return {
        "apiVersion": claim.get("apiVersion"),
        "kind": "ResourceClaim",
        "metadata": {
            "namespace": meta["namespace"],
            "name": f"{meta['name']}.replacement",
            "uid": f"replacement:{meta.get('uid') or meta['name']}",
        },
        "spec": claim.get("spec") or {},
    }


@dataclass
class _Backoff:
    until: float = 0.0
    failures: int = 0


@dataclass
class Consolidator:
    cache: ClusterCache
    configuration: client.Configuration
    preemptor: Preemptor  # keeps the holds: the gang's nomination and the replacements' reservations
    settings: ConsolidationSettings = ConsolidationSettings()
    identity: str = ""
    metrics: ControllerMetrics | None = None
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    backoff: dict[str, _Backoff] = field(default_factory=dict)  # under cache.lock
    moved_at: dict[str, float] = field(default_factory=dict)  # owner UID -> wall time of its last move

    # -- the job of an unschedulable gang (a writer thread) -----------------------------------------

    def _refused(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.consolidation_refused.labels(reason=reason).inc()

    def back_off(self, gang: str, why: str) -> None:
        with self.cache.lock:
            state = self.backoff.setdefault(gang, _Backoff())
            delay = min(
                self.settings.backoff_max_seconds, self.settings.backoff_seconds * (2**state.failures)
            )
            state.failures += 1
            state.until = self.clock() + delay
        log.info(
            "consolidation backs off", extra={"gang": gang, "reason": bounded(why), "delay_seconds": delay}
        )

    def retry_due(self, gang: str) -> bool:
        """The gang backed off after a consolidation that found no plan or was refused, and that
        backoff has run out: it is decided again (and may be consolidated) though neither it nor
        the capacity changed: its candidates may have aged past the minimum runtime, a budget may
        allow a disruption now. Caller holds ``cache.lock``."""
        state = self.backoff.get(gang)
        return state is not None and state.failures > 0 and self.clock() >= state.until

    def retry_in(self, gang: str) -> float | None:
        with self.cache.lock:
            state = self.backoff.get(gang)
            return None if state is None else max(0.0, state.until - self.clock())

    def consolidate(self, plan: GangPlan, *, policy: str) -> bool:
        """Move pods so that the gang fits; True once the moves are under way (the caller then says
        nothing more: the release of the movers' claims queues the gang again)."""
        gang = plan.key
        if not plan.gated:
            return False
        with self.cache.lock:
            if self.clock() < self.backoff.get(gang, _Backoff()).until or gang in self.preemptor.nominations:
                return False
            excluded = static_exclusions(self.cache, plan)
            nodes = [str(n["metadata"]["name"]) for n in self.cache.objects(Kind.NODE)]
            usable = [n for n in nodes if n not in excluded]
            pending = [c for g in plan.groups for c in g.pending_claims]
            with self.preemptor.holding_all():  # room kept for others does not count
                summary = self.cache.state.free_summary()
            if not adds_up(summary, usable, pending):
                self._refused("capacity")
                self.backoff.pop(gang, None)  # a capacity change decides it again, not a timer
                return False  # no moving makes room that is not there: only new nodes help
        if self.metrics is not None:
            self.metrics.consolidation_plans.labels(outcome="tried").inc()
        freed = 0
        held_back = ""
        with new_api_client(self.configuration) as api_client:
            try:
                namespaces, budgets = self._read_opt_ins(api_client)
            except FractionalError as error:
                self._refused("api")
                self.back_off(gang, f"cannot read namespaces or PodDisruptionBudgets: {bounded(error)}")
                return False
            with self.cache.lock:
                movers, refusals = self._movers(plan, namespaces, budgets)
            # A pod a budget holds back may still move where its Deployment replaces it first.
            surging = frozenset(self._rollouts(api_client, refusals.budget_held))
            with self.cache.lock:
                if surging:
                    movers, refusals = self._movers(plan, namespaces, budgets, surging=surging)
                with self.preemptor.holding_all():
                    summary = self.cache.state.free_summary()
                whole_only = asks_whole_devices(pending)
                holders = self._holders()
                movers = useful_movers(movers, summary, holders, whole_only=whole_only,
                                       refusals=refusals.counts)  # fmt: skip
                fits = self._fit_check(plan, movers, policy=policy)
                found = (
                    find_plan(movers, fits=fits, budget=self.settings.budget, clock=self.clock,
                              group_size=devices_per_pod(plan), groups_wanted=len(plan.groups))
                    if movers
                    else None
                )  # fmt: skip
                if found is None:
                    reason = "no_movers" if not movers else "no_plan"
                    self._refused(reason)
                    held_back = refusals.held_back()
                    log.info("no consolidation helps", extra={"gang": gang, "movers": len(movers),
                             "refused": refusals.describe()})  # fmt: skip
            rollouts: dict[str, Rollout] = {}
            if found is not None:
                rollouts = self._rollouts(api_client, found.movers)
            with self.cache.lock:
                if found is not None and rollouts:  # placed again with the old pods kept meanwhile
                    refit = self._fit_check(
                        plan, list(found.movers), policy=policy, surge=frozenset(rollouts)
                    )
                    again = refit(frozenset(m.key for m in found.movers))
                    if again is None:
                        rollouts = {}  # no room for both at once: evicted, as the others
                    else:
                        found = replace(found, placement=again[0], moves=again[1])
                if found is not None:
                    self._hold(plan, found, rollouts)
                    freed = devices_freed(found, holders)  # held as they were before this plan
            if found is None:
                self.back_off(gang, "no plan")
                if held_back:  # pods that opted in were kept from moving: say which and why
                    message = (f"consolidation for gang {gang.split('/', 1)[1]} found no plan; pods that "
                               f"opted in but may not move now: {held_back}")  # fmt: skip
                    self._say(client.CoreV1Api(api_client), plan.gated[0], reason=EVENT_REASON_BLOCKED,
                               message=message, event_type="Warning")  # fmt: skip
                return False
            return self._execute(api_client, plan, found, freed, rollouts)

    # -- the scheduled pass -----------------------------------------------------------------------

    def defragment(self, *, policy: str) -> bool:
        """The scheduled pass: free one GPU whose every holder may move and has a spare replica,
        by moving its pods beside others on partly used GPUs (never onto a free GPU: that would
        only reshuffle). True when the moves began."""
        if self.metrics is not None:
            self.metrics.consolidation_plans.labels(outcome="scheduled_tried").inc()
        with new_api_client(self.configuration) as api_client:
            try:
                namespaces, budgets = self._read_opt_ins(api_client)
            except FractionalError as error:
                self._refused("api")
                log.info("scheduled consolidation skipped", extra={"error": bounded(error)})
                return False
            with self.cache.lock:
                movers, _ = self._movers(None, namespaces, budgets)
                found = self._drain_plan([m for m in movers if m.spare], policy)
                if found is not None:
                    deadline = self.clock() + self.settings.reservation_seconds
                    by_key = {m.key: m for m in found.movers}
                    for move in found.moves:
                        self.preemptor.reservations[f"{SCHEDULED}:{move.mover}"] = Reservation(
                            owner_uid=by_key[move.mover].owner_uid, node=move.node,
                            allocations=move.allocations, deadline=deadline, gang=GangKey(SCHEDULED),
                            room=mover_room(by_key[move.mover]),
                        )  # fmt: skip
            if found is None:
                self._refused("no_plan")
                log.info("scheduled consolidation found nothing to free", extra={"movers": len(movers)})
                return False
            return self._execute_scheduled(client.CoreV1Api(api_client), found)

    def _drain_plan(self, movers: list[Mover], policy: str) -> MovePlan | None:
        """The first GPU in ``drain_order`` whose pods all find a place on another partly used GPU,
        within the search budget. Under ``cache.lock``."""
        state = self.cache.state
        summary = state.free_summary()
        holders = self._holders()
        most = min(self.settings.schedule.max_moves_per_gpu, self.settings.budget.max_moves)
        drainable = drain_order(movers, holders, summary, max_pods=most)
        free = [
            (DRIVER_NAME, str(info.get("pool") or node), name)
            for node, devices in summary.items() for name, info in devices.items()
            if not info.get("shares") and not info.get("exclusive")
        ]  # fmt: skip
        nodes = {str(n["metadata"]["name"]): n for n in self.cache.objects(Kind.NODE)}
        started = self.clock()
        for checks, (device, held) in enumerate(drainable):
            spent_ms = (self.clock() - started) * 1000.0
            if checks >= self.settings.budget.fit_checks or spent_ms >= self.settings.budget.milliseconds:
                break
            moves = self._drain(held, [device, *free], nodes, policy)
            if moves is not None:
                chosen = tuple(sorted(held, key=lambda m: m.key))
                return MovePlan(movers=chosen, moves=moves, placement=Placement((), ()), cost=cost_of(chosen),
                                fit_checks=checks + 1)  # fmt: skip
        return None

    def _drain(
        self, movers: list[Mover], kept: list[DeviceKey], nodes: Mapping[str, dict[str, Any]], policy: str
    ) -> tuple[Move, ...] | None:
        """Each mover placed again with its claims released and ``kept`` devices held whole."""
        state = self.cache.state
        released = [c for m in movers for c in m.claims]
        for claim in released:
            state.remove_claim(_claim_uid(claim))
        use = self._node_room(movers, nodes)
        try:
            with ExitStack() as held:
                held.enter_context(tentative_allocations(self.cache, [whole_hold(d) for d in kept]))
                held.enter_context(self.preemptor.holding_all())
                moves: list[Move] = []
                for mover in sorted(movers, key=lambda m: m.key):
                    move = self._place_mover(mover, nodes, use, policy)
                    if move is None:
                        return None
                    held.enter_context(tentative_allocations(self.cache, list(move.allocations)))
                    moves.append(move)
                return tuple(moves)
        finally:
            for claim in released:
                current = self.cache.get(Kind.CLAIM, str(object_key(claim)))
                state.upsert_claim(current if current is not None else claim)

    def _execute_scheduled(self, core: Any, found: MovePlan) -> bool:
        """Evict the scheduled pass's pods (a dry run of all first), each with its Event."""
        moves = {m.mover: m for m in found.moves}
        for pod in (p for m in found.movers for p in m.pods):
            try:
                self.preemptor.evict(core, pod, dry_run=True)
            except NotFoundError:
                continue
            except FractionalError as error:
                with self.cache.lock:
                    for rid in [r for r in self.preemptor.reservations if r.startswith(f"{SCHEDULED}:")]:
                        del self.preemptor.reservations[rid]
                self._refused("eviction_refused")
                log.info("scheduled consolidation refused", extra={"pod": str(object_key(pod)),
                                                                   "error": bounded(error)})  # fmt: skip
                return False
        now = self.wall()
        for mover in found.movers:
            for pod in mover.pods:
                condition = {**self._condition(None), "lastTransitionTime": _now()}
                try:
                    self.preemptor.patch_status(core, pod, {"conditions": [condition]}, "mark")
                    self.preemptor.evict(core, pod, dry_run=False)
                except NotFoundError:
                    continue
                except FractionalError as error:
                    log.warning("move failed", extra={"pod": str(object_key(pod)), "error": bounded(error)})
                    continue
                if self.metrics is not None:
                    self.metrics.consolidation_pods_moved.inc()
                message = (f"Moved by {self.identity or 'fractional-dra'} in a scheduled consolidation, to "
                           f"free a whole GPU: evicted; its owner makes the replacement; room is kept for "
                           f"it beside other shares on node {moves[mover.key].node}")  # fmt: skip
                self._say(core, pod, reason=EVENT_REASON_CONSOLIDATED, message=message)
            self.moved_at[mover.owner_uid] = now
        if self.metrics is not None:
            self.metrics.consolidation_plans.labels(outcome="scheduled_committed").inc()
            self.metrics.consolidation_gpus_freed.inc(1)
        log.info("scheduled consolidation", extra={"moved": sum(len(m.pods) for m in found.movers)})
        return True

    def _rollouts(self, api_client: client.ApiClient, movers: Iterable[Mover]) -> dict[str, Rollout]:
        """The movers with no spare replica whose Deployment surges (``surge_rollout``): their
        replacement is made before they go. A read that fails leaves the mover to eviction."""
        rollouts: dict[str, Rollout] = {}
        apps: Any = client.AppsV1Api(api_client)
        for mover in movers:
            owner = controller_of(mover.pods[0])
            if mover.spare or len(mover.pods) != 1 or owner is None or owner.get("kind") != "ReplicaSet":
                continue
            namespace = str(mover.pods[0]["metadata"]["namespace"])
            try:
                with api_errors(f"get ReplicaSet {namespace}/{owner.get('name')}"):
                    answer = apps.read_namespaced_replica_set(
                        str(owner.get("name")), namespace, _preload_content=False,
                        _request_timeout=REQUEST_TIMEOUT_SECONDS,
                    )  # fmt: skip
                deployment_ref = controller_of(json.loads(answer.data))
                if deployment_ref is None or deployment_ref.get("kind") != "Deployment":
                    continue
                with api_errors(f"get Deployment {namespace}/{deployment_ref.get('name')}"):
                    answer = apps.read_namespaced_deployment(
                        str(deployment_ref.get("name")), namespace, _preload_content=False,
                        _request_timeout=REQUEST_TIMEOUT_SECONDS,
                    )  # fmt: skip
                rollout = surge_rollout(json.loads(answer.data))
                if rollout is not None:
                    rollout = replace(rollout, token=str(mover.pods[0]["metadata"].get("uid") or mover.key))
            except FractionalError as error:
                log.info("owner not read", extra={"pod": mover.key, "error": bounded(error)})
                continue
            if rollout is not None:
                rollouts[mover.key] = rollout
        return rollouts

    def _holders(self) -> dict[DeviceKey, int]:
        """Allocated claims per device, and the nominations and reservations held there: a device
        is emptied only when the moves take every one of them off it (a reservation for another
        move's replacement, left on a GPU, kept it from being freed: the bench's whole-GPU pods
        waited for such plans). Under ``cache.lock``."""
        holders = device_holders(
            c for c in self.cache.objects(Kind.CLAIM) if (c.get("status") or {}).get("allocation")
        )
        for device, count in self.preemptor.held_per_device().items():
            holders[device] = holders.get(device, 0) + count
        return holders

    def _read_opt_ins(self, api_client: client.ApiClient) -> tuple[frozenset[str], list[DisruptionBudget]]:
        """The namespaces that opted in, and every PodDisruptionBudget, as read now."""
        return self._movable_namespaces(api_client), self.preemptor.read_budgets(api_client)

    def _movable_namespaces(self, api_client: client.ApiClient) -> frozenset[str]:
        with api_errors("list Namespaces"):
            core: Any = client.CoreV1Api(api_client)
            answer = core.list_namespace(label_selector=f"{MOVABLE_LABEL}=true", _preload_content=False,
                                         _request_timeout=REQUEST_TIMEOUT_SECONDS)  # fmt: skip
        return frozenset(str(i["metadata"]["name"]) for i in json.loads(answer.data).get("items") or ())

    def _movers(
        self, plan: GangPlan | None, namespaces: frozenset[str], budgets: list[DisruptionBudget],
        surging: frozenset[str] = frozenset(),
    ) -> tuple[list[Mover], Refusals]:  # fmt: skip
        """The movers for this gang (None: the scheduled pass, for no one), less those a
        PodDisruptionBudget would not let go now. A mover in ``surging`` is replaced before it goes
        (make before break: its Deployment keeps every replica available), so it neither needs nor
        spends a budget's allowance. Under ``cache.lock``."""
        claims = {str(object_key(c)): c for c in self.cache.objects(Kind.CLAIM)}
        classes = frozenset(
            str(c["metadata"]["name"]) for c in self.cache.objects(Kind.CLASS)
            if str(((c.get("metadata") or {}).get("labels") or {}).get(MOVABLE_LABEL, "")).lower() == "true"
        )  # fmt: skip
        waiting = {str(object_key(p)) for p in plan.gated} if plan is not None else set()
        pods = [p for p in self.cache.objects(Kind.POD) if str(object_key(p)) not in waiting]
        rooms: dict[GangKey, int] = {}

        def spare_in_gang(pod: dict[str, Any]) -> int | None:
            gang = self.cache.gang_key(pod)
            if gang.split("/", 1)[-1].startswith("pod:"):
                return None
            if gang not in rooms:
                members = [p for p in self.cache.gang_pods(gang) if not is_terminated(p)]
                spec = gang_spec(self.cache, members)
                minimum = len(members) if spec.whole or spec.min_count is None else spec.min_count
                running = sum(1 for p in members if (p.get("spec") or {}).get("nodeName"))
                rooms[gang] = max(0, running - minimum)
            return rooms[gang]

        movers, refusals = build_movers(
            pods, claims, waiting_priority=gang_priority(plan.gated) if plan is not None else 2**31,
            now=self.wall(),
            rules=self.settings.rules, movable_namespaces=namespaces, movable_classes=classes,
            moved_at=self.moved_at.get, gang_room=spare_in_gang,
        )  # fmt: skip
        allowed: list[Mover] = []
        taken: list[dict[str, Any]] = []
        for mover in movers:  # a budget's allowance spent as the movers are taken, cheapest first
            if mover.key in surging:
                allowed.append(mover)
                continue
            violations, exceeded = count_violations([*taken, *mover.pods], budgets)
            if violations:
                refusals.counts["budget"] = refusals.counts.get("budget", 0) + len(mover.pods)
                refusals.budgets.update(exceeded)
                refusals.budget_held.append(mover)
                continue
            taken += mover.pods
            allowed.append(mover)
        return allowed, refusals

    def _fit_check(
        self, plan: GangPlan, movers: list[Mover], *, policy: str, surge: frozenset[str] = frozenset()
    ) -> Callable[[frozenset[str]], tuple[Placement, tuple[Move, ...]] | None]:
        """The allocator, asked for the gang with the movers' claims released, then for every
        mover again with the gang's devices held. Called with ``cache.lock`` held."""
        by_key = {m.key: m for m in movers}
        excluded = static_exclusions(self.cache, plan)
        nodes = {str(n["metadata"]["name"]): n for n in self.cache.objects(Kind.NODE)}
        state = self.cache.state

        def fits(moved: frozenset[str]) -> tuple[Placement, tuple[Move, ...]] | None:
            released = [c for k in sorted(moved) for c in by_key[k].claims]
            for claim in released:
                state.remove_claim(_claim_uid(claim))
            try:
                return self._place_all(
                    plan, [by_key[k] for k in sorted(moved)], excluded, nodes, policy, surge
                )
            finally:
                for claim in released:
                    current = self.cache.get(Kind.CLAIM, str(object_key(claim)))
                    state.upsert_claim(current if current is not None else claim)

        return fits

    def _place_all(
        self, plan: GangPlan, moved: list[Mover], excluded: frozenset[str],
        nodes: Mapping[str, dict[str, Any]], policy: str, surge: frozenset[str] = frozenset(),
    ) -> tuple[Placement, tuple[Move, ...]] | None:  # fmt: skip
        """The gang with the movers' claims released, then each mover again. A mover in ``surge`` is
        replaced before it goes: its own devices, CPU and memory stay taken while its replacement is
        placed. Every hold (nominations, reservations: their devices, CPU and memory) is in force
        throughout: room kept for others is neither the gang's nor a mover's."""
        moves: list[Move] = []
        with ExitStack() as held:
            held.enter_context(self.preemptor.holding_all())
            if plan.topology_key is not None:
                decided = decide_in_domains(self.cache, plan, policy=policy)
                chosen = list(decided.allocations) if decided.outcome == "allocated" else None
            else:
                chosen = allocate_groups(self.cache, plan.groups, policy=policy, exclude_nodes=excluded)
            if chosen is None:
                return None
            # A mover replaced before it goes runs until its replacement is ready: its node keeps its room.
            use = self._node_room([m for m in moved if m.key not in surge], nodes)
            by_claim = {str(object_key(c)): a for c, a in chosen}
            pod_nodes: list[tuple[str, str | None]] = []
            for group in plan.groups:
                node = group_node(group, by_claim)
                pod_nodes += [(str(object_key(p)), node) for p in group.pods]
                if node is not None and node in nodes and not use(node, group.pods):
                    return None
            held.enter_context(tentative_allocations(self.cache, list(chosen)))
            for mover in sorted(moved, key=lambda m: (-len(m.devices), m.key)):  # the largest first
                if mover.key in surge:
                    move = self._place_beside(mover, nodes, use, policy)
                else:
                    move = self._place_mover(mover, nodes, use, policy)
                if move is None:
                    return None
                held.enter_context(tentative_allocations(self.cache, list(move.allocations)))
                moves.append(move)
        return Placement(allocations=tuple(chosen), pod_nodes=tuple(pod_nodes)), tuple(moves)

    def _node_room(
        self, leaving: Iterable[Mover], nodes: Mapping[str, dict[str, Any]]
    ) -> Callable[[str, Iterable[dict[str, Any]]], bool]:
        """``use(node, pods)``: count ``pods`` on ``node`` and say whether its CPU, memory and pod
        count still hold them, the pods of ``leaving`` gone from their nodes. Under ``cache.lock``."""
        usage: dict[str, Resources] = {}
        freed: dict[str, Resources] = {}
        for mover in leaving:
            for pod in mover.pods:
                node = (pod.get("spec") or {}).get("nodeName")
                if node:
                    freed[node] = freed.get(node, Resources()) + pod_requests(pod)

        def use(node: str, pods: Iterable[dict[str, Any]]) -> bool:
            if node not in usage:
                usage[node] = self.cache.node_usage(node) - freed.get(node, Resources())
            for pod in pods:
                usage[node] = usage[node] + pod_requests(pod)
            return Resources().fits_within(node_allocatable(nodes[node]) - usage[node])

        return use

    def _place_mover(
        self, mover: Mover, nodes: Mapping[str, dict[str, Any]],
        use: Callable[[str, Iterable[dict[str, Any]]], bool], policy: str,
    ) -> Move | None:  # fmt: skip
        stand_ins = [stand_in(c) for c in mover.claims]
        refused = frozenset(name for name, node in nodes.items()
                            if any(node_rejection(p, node) for p in mover.pods))  # fmt: skip
        excluded = set(refused)
        for _ in range(3):  # a node whose CPU or memory cannot take it is excluded, the allocator asked again
            result = self.cache.state.allocate(
                stand_ins, node=None, policy=policy, pod_groups=[list(range(len(stand_ins)))],
                exclude_nodes=frozenset(excluded),
            )  # fmt: skip
            if result is None:
                return None
            node = next((n for a in result if (n := allocation_node(a))), None)
            if node is None or node not in nodes:
                return None
            if use(node, mover.pods):
                allocations = tuple(zip(stand_ins, result, strict=True))
                return Move(mover=mover.key, node=node, allocations=allocations)
            excluded.add(node)
        return None

    def _place_beside(
        self, mover: Mover, nodes: Mapping[str, dict[str, Any]],
        use: Callable[[str, Iterable[dict[str, Any]]], bool], policy: str,
    ) -> Move | None:  # fmt: skip
        """``_place_mover`` with the mover's own claims counted meanwhile (make before break)."""
        state = self.cache.state
        for claim in mover.claims:
            state.upsert_claim(claim)
        try:
            return self._place_mover(mover, nodes, use, policy)
        finally:
            for claim in mover.claims:
                state.remove_claim(_claim_uid(claim))

    def _hold(self, plan: GangPlan, found: MovePlan, rollouts: Mapping[str, Rollout]) -> None:
        """The gang's nomination and the replacements' reservations. Under ``cache.lock``."""
        deadline = self.clock() + self.settings.reservation_seconds
        moved_pods = [p for m in found.movers for p in m.pods]
        self.preemptor.nominations[plan.key] = Nomination(
            priority=gang_priority(plan.gated),
            pod_nodes=dict(found.placement.pod_nodes),
            allocations=found.placement.allocations,
            victim_pods=frozenset(str(object_key(p)) for p in moved_pods),
            victim_claims=tuple(c for m in found.movers for c in m.claims),
            deadline=deadline,
            source="consolidation",
            created=str(plan.gated[0]["metadata"].get("creationTimestamp") or ""),
            room=gang_room(plan, found.placement.pod_nodes),
        )
        by_key = {m.key: m for m in found.movers}
        for move in found.moves:
            mover = by_key[move.mover]
            rollout = rollouts.get(move.mover)
            self.preemptor.reservations[f"{plan.key}:{move.mover}"] = Reservation(
                owner_uid=mover.owner_uid, node=move.node, allocations=move.allocations, deadline=deadline,
                gang=plan.key, token=rollout.token if rollout is not None else "", room=mover_room(mover),
            )  # fmt: skip

    def _drop(self, plan: GangPlan) -> None:
        with self.cache.lock:
            self.preemptor.nominations.pop(plan.key, None)
            for rid in [r for r, v in self.preemptor.reservations.items() if v.gang == plan.key]:
                del self.preemptor.reservations[rid]

    # -- effects ------------------------------------------------------------------------------------

    def _execute(
        self, api_client: client.ApiClient, plan: GangPlan, found: MovePlan, freed: int,
        rollouts: Mapping[str, Rollout],
    ) -> bool:  # fmt: skip
        core: Any = client.CoreV1Api(api_client)
        apps: Any = client.AppsV1Api(api_client)
        gang = plan.key
        waiting = plan.gated[0]
        pods = [p for m in found.movers for p in m.pods]
        for mover in found.movers:  # a dry run of every move: one refusal and nothing moves
            rollout = rollouts.get(mover.key)
            for pod in mover.pods:
                try:
                    if rollout is not None:
                        self._roll(apps, rollout, dry_run=True)
                    else:
                        self.preemptor.evict(core, pod, dry_run=True)
                except NotFoundError:
                    continue
                except FractionalError as error:
                    message = (f"consolidation for gang {gang.split('/', 1)[1]} blocked: pod "
                               f"{object_key(pod)} may not be moved now: {bounded(error)}")  # fmt: skip
                    self._drop(plan)
                    self._refused("eviction_refused")
                    self.back_off(gang, message)
                    self._say(
                        core, waiting, reason=EVENT_REASON_BLOCKED, message=message, event_type="Warning"
                    )
                    return False
        where = dict(found.placement.pod_nodes)
        moves = {m.mover: m for m in found.moves}
        self._say(
            core, waiting, reason=EVENT_REASON_CONSOLIDATING, message=self._describe(plan, found, rollouts)
        )
        for pod in plan.gated:
            node = where.get(str(object_key(pod)))
            if node:
                self.preemptor.patch_status(core, pod, {"nominatedNodeName": node}, "nominate")
        now = self.wall()
        for mover in found.movers:
            move = moves[mover.key]
            rollout = rollouts.get(mover.key)
            for pod in mover.pods:
                try:
                    if rollout is not None:
                        self._roll(apps, rollout, dry_run=False)
                    else:
                        self.preemptor.patch_status(
                            core, pod, {"conditions": [self._condition(waiting)]}, "mark"
                        )
                        self.preemptor.evict(core, pod, dry_run=False)
                except NotFoundError:
                    continue
                except FractionalError as error:
                    log.warning("move failed", extra={"gang": gang, "pod": str(object_key(pod)),
                                                      "error": bounded(error)})  # fmt: skip
                    continue  # the nomination's deadline ends the wait if this one never goes
                if self.metrics is not None:
                    self.metrics.consolidation_pods_moved.inc()
                how = (f"Deployment {rollout.deployment} rolls out its replacement first (maxSurge "
                       f"{rollout.surge}) and removes this pod once that one is ready" if rollout is not None
                       else "evicted; its owner makes the replacement")  # fmt: skip
                message = (f"Moved by {self.identity or 'fractional-dra'} so that pod {object_key(waiting)} "
                           f"fits: {how}; room is kept for the replacement on node {move.node}")  # fmt: skip
                self._say(core, pod, reason=EVENT_REASON_CONSOLIDATED, message=message, related=waiting)
            self.moved_at[mover.owner_uid] = now
        if self.metrics is not None:
            self.metrics.consolidation_plans.labels(outcome="committed").inc()
            self.metrics.consolidation_gpus_freed.inc(freed)
        with self.cache.lock:
            self.backoff.pop(gang, None)
        log.info("consolidating", extra={
            "gang": gang, "moved": len(pods), "fit_checks": found.fit_checks, "rollouts": len(rollouts),
            "nodes": ",".join(sorted({m.node for m in found.moves})),
        })  # fmt: skip
        return True

    def _roll(self, apps: Any, rollout: Rollout, *, dry_run: bool) -> None:
        """The template annotation that makes the Deployment roll out (as ``kubectl rollout restart``
        does with its own annotation)."""
        body = rollout_patch(rollout.token)
        self.preemptor.check_fence()
        with api_errors(f"patch Deployment {rollout.namespace}/{rollout.deployment}"):
            apps.patch_namespaced_deployment(
                rollout.deployment, rollout.namespace, body, dry_run="All" if dry_run else None,
                _content_type=STRATEGIC_MERGE_PATCH, _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            )  # fmt: skip

    @staticmethod
    def _describe(plan: GangPlan, found: MovePlan, rollouts: Mapping[str, Rollout]) -> str:
        name = plan.key.split("/", 1)[1]
        moves = {m.mover: m.node for m in found.moves}
        moved = ", ".join(
            f"{m.key} ({m.owner}{', make before break' if m.key in rollouts else ''}) -> {moves[m.key]}"
            for m in found.movers
        )
        placement = ", ".join(f"{p.split('/', 1)[1]} -> {n}" for p, n in found.placement.pod_nodes if n)
        return (f"Consolidating for gang {name}: moving {found.cost.pods_moved} pod(s), each with room kept "
                f"for its replacement: {moved}; nominated: {placement}")  # fmt: skip

    def _say(self, core: Any, pod: dict[str, Any], **event: Any) -> None:
        self.preemptor.emit(core, pod, action="Consolidating", **event)

    def _condition(self, waiting: dict[str, Any] | None) -> dict[str, Any]:
        if waiting is None:
            why = "fractional-dra: moving this pod to free a whole GPU (scheduled consolidation)"
        else:
            meta = waiting["metadata"]
            why = f"fractional-dra: moving this pod so that pod {meta['namespace']}/{meta['name']} fits"
        return {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": CONDITION_REASON,
            "message": why,
            "lastTransitionTime": _now(),
        }


def whole_hold(device: DeviceKey) -> tuple[dict[str, Any], dict[str, Any]]:
    """A stand-in claim holding ``device`` whole (an exclusive result), for ``tentative_allocations``."""
    driver, pool, name = device
    claim = {"metadata": {"namespace": "", "name": f"hold.{pool}.{name}", "uid": f"hold:{pool}/{name}"}}
    return claim, {
        "devices": {"results": [{"driver": driver, "pool": pool, "device": name, "request": "hold"}]}
    }


def _result_devices(allocation: Mapping[str, Any]) -> set[DeviceKey]:
    return {
        (str(r.get("driver", "")), str(r.get("pool", "")), str(r.get("device", "")))
        for r in (allocation.get("devices") or {}).get("results") or ()
    }


def _claims_per_device(movers: Iterable[Mover]) -> dict[DeviceKey, int]:
    """The movers' allocated claims, counted per device they hold."""
    counts: dict[DeviceKey, int] = {}
    for mover in movers:
        for claim in mover.claims:
            for device in _result_devices((claim.get("status") or {}).get("allocation") or {}):
                counts[device] = counts.get(device, 0) + 1
    return counts


def devices_freed(found: MovePlan, holders: Mapping[DeviceKey, int]) -> int:
    """Devices the moves leave wholly free: every claim on them moved, and no move lands there
    (``holders``: claims and holds per device before the moves)."""
    moved = _claims_per_device(found.movers)
    landing = {d for m in found.moves for _, a in m.allocations for d in _result_devices(a)}
    return sum(1 for d, n in moved.items() if holders.get(d, 0) <= n and d not in landing)


def _claim_uid(claim: dict[str, Any]) -> str:
    meta = claim.get("metadata") or {}
    return str(meta.get("uid") or f"{meta.get('namespace', '')}/{meta.get('name', '')}")

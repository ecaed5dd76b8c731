"""The decider and the jobs it hands to the writers (a pipelined write path).

The decider (the one worker thread) takes keys off the queue, several at a time when they are
there, and decides under ``cache.lock`` with no I/O (taken for the planning, then for each decision,
so that nothing else waits for a whole pass): ready gangs are decided together (``decide_all``),
and each allocation is assumed into the cache at once, so the next decision counts it. Every
write then goes to the bounded pool of writers as one job per gang or claim:

- a gang's job writes our finalizer and the allocation of each claim (with ``status.reservedFor``
  naming the pod, in the same write, for a claim that serves one pod alone: kube-scheduler's PreBind
  then has nothing to write), re-checks that no claim or
  pod was deleted meanwhile and that the nodes and devices the gang was placed on are still there
  (a Node deleted with its slices: the gang is undone and planned again, gates kept), then removes
  the gates (the commit point): in that order, on one writer thread;
- a failed write undoes exactly that gang: what its job wrote is cleared, what the decider assumed
  is forgotten, and the gang is queued again with backoff; other gangs go on (a 409 on one never
  blocks another);
- while a job runs, its gang and claims are busy: a key that touches them waits and is queued again
  when the job ends, so no decision is made on a half-written gang.

Every write checks the fence (``writer.py``): a replica that lost its lease writes nothing more.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from driver import DRIVER_NAME
from driver.allocator import check_no_claim_backend
from driver.config import DEFAULT_POLICY
from driver.controller.consolidation.consolidator import ConsolidationSettings, Consolidator
from driver.controller.diagnosis.explain import NodeOffer, best_node_offer, describe_demand
from driver.controller.gangs.burst import decide_all
from driver.controller.gangs.decide import Decision, demand_key, placement_spec, static_exclusions
from driver.controller.gangs.nodefit import node_admits_pod
from driver.controller.gangs.plan import GangPlan, Reservation, plan_gang, reservation_of
from driver.controller.kueue.check import kueue_provisions
from driver.controller.loop.provisioning import Provisioner, ProvisioningAnswer
from driver.controller.metrics import ControllerMetrics
from driver.controller.model.decode import bounded
from driver.controller.model.objects import (
    HINT_ANNOTATION,
    PLACED_ANNOTATION,
    GangKey,
    allocation_node,
    generated_for,
    has_finalizer,
    is_deleting,
    is_gated,
    is_ours,
    object_key,
    placed_by_us,
    pod_claim_refs,
    reserved_pods,
)
from driver.controller.preemption.preemptor import Preemptor
from driver.controller.preemption.refusal import RefusedShares
from driver.controller.sizing.hints import (
    Hint,
    compute_hint,
    existing_node_shapes,
    profile_shapes,
    render_hint,
)
from driver.controller.sizing.overcommit import Overcommit, compute_overcommits
from driver.controller.view.cache import HOSTNAME_LABEL, ClusterCache, Kind
from driver.controller.writes.events import REASON_FAILED, REASON_HANDED_OVER, EventRecorder
from driver.controller.writes.pipeline import Job, Writers
from driver.controller.writes.writer import ApiWriter, HaltWrites
from driver.errors import AllocationError, ConflictError, FractionalError, NotFoundError

__all__ = ["CLAIM_PREFIX", "GANG_PREFIX", "REFUSED_PREFIX", "Reconciler", "ReconcilerSettings"]

log = logging.getLogger(__name__)

GANG_PREFIX = "gang:"
CLAIM_PREFIX = "claim:"
REFUSED_PREFIX = "refused:"  # a claim a node agent refused to prepare (preemption/refusal.py)
DEFRAGMENT_JOB = "defragment:"  # the scheduled consolidation pass, one at a time
REASON_OVERCOMMITTED = "DeviceOvercommitted"
# How long a claim made for a pod may outlive that pod, allocated, before we release it ourselves
# (kube-controller-manager's garbage collector deletes it well before, unless it is behind or off).
ORPHAN_GRACE_SECONDS = 15.0


@dataclass(frozen=True, slots=True)
class ReconcilerSettings:
    policy: str = DEFAULT_POLICY
    hint_profiles: tuple[str, ...] = ()
    provisioning_requests: bool = False
    provisioning_class: str = "best-effort-atomic-scale-up.autoscaling.x-k8s.io"
    # After a request of a gang ended (Failed, BookingExpired): ask again this long after, doubling.
    provisioning_retry_seconds: float = 30.0
    provisioning_max_retry_seconds: float = 600.0
    topology_label: str = "topology.kubernetes.io/zone"
    preemption: bool = True  # evict lower-priority pods for a gang that does not fit (``Preemptor``)
    # Move pods that opted in so that a gang fits when no preemption serves it (``Consolidator``); None: off.
    consolidation: ConsolidationSettings | None = None
    # False: a claim whose own GpuConfig picks a sharing backend is refused (AllocationFailed naming the
    # field); the node's --sharing or the DeviceClass's config decides (sharing.allowClaimBackendOverride).
    allow_claim_backend_override: bool = True


@dataclass
class _Unfit:
    key: tuple[str, int] = ("", -1)  # (gang signature, capacity generation) last explained
    hint_json: str | None = None
    stale: int = 0  # explanations skipped in a row because capacity changed after the decision
    message: str = ""  # the Event's message, less what was said of its ProvisioningRequests
    provisioning: str = ""  # what was said of them
    said_at: float = float("-inf")  # time.monotonic() of its last Event write


STALE_EXPLANATIONS_SKIPPED = 3  # then say why anyway: a busy cluster must not starve the Event

# A gang that did not fit is decided again when capacity frees, but not before its backoff ends
# (1 s, doubling to 10 s while it keeps not fitting; kube-scheduler's defaults for a pod): under
# churn every freed device queued the whole backlog again, and each pass decided every gang of it.
# One gang of each demand (decide.demand_key) among those backing off is decided anyway in each
# pass: a backlog of like gangs keeps its claim on freed room against pods that just arrived (with
# all of them backing off, on the emulator at 200 nodes, new 70Gi shares took 140 of 150 GPUs freed
# while 500 whole-GPU pods waited).
UNFIT_BACKOFF_SECONDS = 1.0
UNFIT_MAX_BACKOFF_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class _Backoff:
    signature: str  # the gang as it was when it did not fit; a change ends the backoff
    failures: int
    until: float  # time.monotonic()
    demand: tuple[Any, ...] | None  # decide.demand_key of the gang then


# What an unfit gang is told (the best node's offer, the scale-up hint) is sized once per demand and
# kept for gangs that ask the same, until the inventory changes or this long has passed: sizing walks
# the whole cluster (one allocation attempt per node for the offer, the cluster rebuilt with
# template nodes for the hint). Seen on the API emulator with 200 nodes: 500 gated whole-GPU pods
# that did not fit took 190 CPU-seconds, 93 % of it sizing each pod's hint anew.
SIZING_REUSE_SECONDS = 10.0
# An unfit gang decided again (capacity changed elsewhere) and told the same words: its Event's count
# is not bumped more often than this (as client-go's event spam filter holds a repeating Event back;
# under churn every freed device decided the whole backlog again, one Event write per gang each time).
SAME_EXPLANATION_SECONDS = 30.0
SIZING_MEMO_ENTRIES = 256


@dataclass(frozen=True, slots=True)
class _Sizing:
    offer: NodeOffer | None
    hint: Hint | None
    generation: int  # the capacity generation it was sized at
    at: float  # time.monotonic() when it was sized


def _claim_keys(plan: GangPlan) -> list[str]:
    keys: list[str] = []
    for pod in plan.gated:
        namespace = pod["metadata"]["namespace"]
        keys += [f"{CLAIM_PREFIX}{namespace}/{r.claim_name}" for r in pod_claim_refs(pod) if r.claim_name]
    return keys


@dataclass
class Reconciler:
    cache: ClusterCache
    metrics: ControllerMetrics
    settings: ReconcilerSettings
    capacity_generation: Callable[[], int]
    submit: Callable[[Job], bool]  # hands a job to the writers (blocks while they are full)
    requeue: Callable[[str], None]
    requeue_later: Callable[[str], float]  # with per-key backoff
    # The key's work was written: reset its backoff. Called when the writes succeed, not when the
    # decider hands them over (a reset there made a failing gang retry every 0.15 s while
    # kube-apiserver was away, each pass logging and undoing).
    forget: Callable[[str], None] = lambda key: None
    requeue_after: Callable[[str, float], None] = lambda key, seconds: None  # once, after that long
    capacity_freed: Callable[[], None] = lambda: None  # requeues the gangs waiting for room
    gate_seen: dict[str, float] = field(default_factory=dict)
    preemptor: Preemptor | None = None  # None: neither --preemption nor --consolidation
    consolidator: Consolidator | None = None  # None: --consolidation off
    provisioner: Provisioner | None = None  # None: --provisioning-requests off
    refusals: RefusedShares | None = None  # None: refused shares are left to people
    latencies: list[float] = field(default_factory=list)
    unschedulable: set[GangKey] = field(default_factory=set)
    _unfit: dict[GangKey, _Unfit] = field(default_factory=dict)
    _backoffs: dict[GangKey, _Backoff] = field(default_factory=dict)  # the decider's alone
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _busy: dict[str, int] = field(default_factory=dict)  # key -> the job holding it
    _deferred: dict[int, set[str]] = field(default_factory=dict)  # job -> keys to queue when it ends
    _jobs: int = 0
    _overcommits: frozenset[Overcommit] = frozenset()  # as last reported
    _orphans: dict[str, float] = field(default_factory=dict)  # claim key -> when its pod was seen gone
    _sizings: OrderedDict[tuple[Any, ...], _Sizing] = field(default_factory=OrderedDict)  # _sized
    _sizing_lock: threading.Lock = field(default_factory=threading.Lock)  # guards _sizings too
    # Unfit gangs whose ProvisioningRequests changed (a condition written) or whose backoff is over:
    # decided again though neither they nor the capacity changed.
    _provisioning_due: set[GangKey] = field(default_factory=set)

    # -- the busy registry ------------------------------------------------------------------------------

    def _busy_job(self, keys: list[str]) -> int | None:
        with self._lock:
            return next((self._busy[k] for k in keys if k in self._busy), None)

    def _defer(self, job: int, key: str) -> None:
        with self._lock:
            if job in self._deferred:
                self._deferred[job].add(key)
                return
        self.requeue(key)  # it ended meanwhile

    def _start_job(
        self, keys: list[str], run: Callable[[Writers], object], *, requeue: tuple[str, ...] = ()
    ) -> None:
        """Run ``run`` on a writer with ``keys`` busy; when it ends, queue the keys deferred meanwhile
        (and ``requeue``)."""
        with self._lock:
            self._jobs += 1
            job = self._jobs
            for key in keys:
                self._busy[key] = job
            self._deferred[job] = set(requeue)

        def wrapped(writers: Writers) -> None:
            halted = False
            try:
                run(writers)
            except HaltWrites:
                halted = True  # nothing more is decided or written: as if the process died here
                raise
            except FractionalError as error:  # 409, 5xx, refused, rejected: back off and decide again
                delay = self.requeue_later(keys[0])
                self.metrics.decisions.labels(outcome="retry").inc()
                log.info("requeued", extra={"key": bounded(keys[0]), "error": bounded(error),
                         "delay_seconds": round(delay, 3)})  # fmt: skip
            else:
                for key in keys:
                    if not key.startswith(GANG_PREFIX):  # a gang's commit says itself (_commit)
                        self.forget(key)
            finally:
                with self._lock:
                    for key in keys:
                        if self._busy.get(key) == job:
                            del self._busy[key]
                    deferred = self._deferred.pop(job, set())
                for key in sorted(deferred) if not halted else ():
                    self.requeue(key)

        if not self.submit(wrapped):  # stopping: nothing will run it
            with self._lock:
                for key in keys:
                    self._busy.pop(key, None)
                self._deferred.pop(job, None)

    # -- gangs (the decider) ------------------------------------------------------------------------------

    def reconcile_gangs(self, gangs: list[GangKey]) -> None:
        started = time.monotonic()
        generation = self.capacity_generation()  # before deciding: a later change re-queues us
        ready: list[GangPlan] = []
        others: list[GangPlan] = []
        refused: list[tuple[GangPlan, AllocationError]] = []
        decided: set[tuple[Any, ...]] = set()  # demands of gangs decided in this pass (as far as known)
        backing_off: list[tuple[GangPlan, tuple[Any, ...] | None]] = []
        waiting: dict[tuple[Any, ...], list[GangKey]] = {}  # demand -> gangs left to their backoff
        passed = set(gangs)
        with self.cache.lock:
            for gang in gangs:
                key = GANG_PREFIX + gang
                plan = plan_gang(self.cache, gang)
                job = self._busy_job([key, *_claim_keys(plan)])
                if job is not None:
                    self._defer(job, key)
                    continue
                unfit = self._unfit.get(gang)
                unchanged = unfit is not None and unfit.key == (plan.signature, generation)
                if (
                    plan.action == "allocate"
                    and unchanged
                    and not self._retry_due(gang)
                    and gang not in self._provisioning_due
                ):
                    continue  # did not fit, and neither the gang nor the capacity changed since
                backoff = self._backoffs.get(gang)
                same = backoff is not None and backoff.signature == plan.signature
                if backoff is not None and same and plan.action == "allocate":
                    if (
                        time.monotonic() < backoff.until
                        and not self._retry_due(gang)
                        and gang not in self._provisioning_due
                    ):
                        backing_off.append((plan, backoff.demand))
                        continue  # did not fit moments ago: decided when its backoff ends (a timer)
                    if backoff.demand is not None:
                        decided.add(backoff.demand)
                self._admit(plan, ready, others, refused)
            # One of each demand backing off is decided anyway, unless a gang of it is already.
            for plan, demand in backing_off:
                if demand is None or demand in decided:
                    if demand is not None:
                        waiting.setdefault(demand, []).append(plan.key)
                    continue
                decided.add(demand)
                self._admit(plan, ready, others, refused)
        # Decided with cache.lock taken per decision, not for the whole pass: a pass of 64 gangs that
        # do not fit took seconds on a loaded 2-core node, and the allocation guard (kube-apiserver
        # waiting on it) and the watchers waited as long (seen on 1.37.2: reviews of 4-5 s).
        decisions = self._decide_all(ready) if ready else []
        for plan in others:
            self._act(plan)
        for plan, error in refused:
            self._failed(plan, error)
        if self.preemptor is not None:
            self.preemptor.placed(
                [
                    p.key
                    for p, o in zip(ready, decisions, strict=True)
                    if isinstance(o, Decision) and o.outcome == "allocated"
                ]
            )
        for plan, outcome in zip(ready, decisions, strict=True):
            if isinstance(outcome, AllocationError):
                self._failed(plan, outcome)
            elif outcome.outcome == "allocated":
                backoff = self._backoffs.pop(plan.key, None)
                if backoff is not None and backoff.demand is not None:
                    self._next_of_kind(backoff.demand, waiting, passed=passed)
                self._mark_unschedulable(plan.key, fit=True)
                self.metrics.decisions.labels(outcome="allocated").inc()
                self.metrics.decision_seconds.observe(time.monotonic() - started)
                # Looked at again when the job ends: pods beyond minCount (or the next pod of a basic
                # policy) wait for these, and our own ungate, assumed into the cache, sends no event
                # that would queue the gang again.
                self._start_job(
                    [GANG_PREFIX + plan.key, *_claim_keys(plan)],
                    lambda w, plan=plan, decision=outcome: self._commit(w, plan, decision),  # type: ignore[misc]
                    requeue=(GANG_PREFIX + plan.key,),
                )
            elif plan.hand_over_unfit:
                self.metrics.decisions.labels(outcome="handed_over").inc()
                self._start_job(
                    [GANG_PREFIX + plan.key, *_claim_keys(plan)],
                    lambda w, plan=plan, decision=outcome: self._hand_over(w, plan, decision),  # type: ignore[misc]
                    requeue=(GANG_PREFIX + plan.key,),
                )
            else:
                self._back_off(plan)
                self._mark_unschedulable(plan.key, fit=False)
                self.metrics.decisions.labels(outcome="unschedulable").inc()
                if self.capacity_generation() != generation:
                    # Capacity changed while we decided: that change's requeue came before the gang
                    # was marked unschedulable, so look again now rather than at the next resync.
                    self.requeue(GANG_PREFIX + plan.key)
                self._start_job(
                    [GANG_PREFIX + plan.key],
                    lambda w, plan=plan, decision=outcome: self._unschedulable(w, plan, decision, generation),  # type: ignore[misc]
                )

    def _admit(
        self,
        plan: GangPlan,
        ready: list[GangPlan],
        others: list[GangPlan],
        refused: list[tuple[GangPlan, AllocationError]],
    ) -> None:
        """Put the plan on the pass's list it belongs to."""
        if plan.action == "allocate" and (error := self._backend_refused(plan)) is not None:
            refused.append((plan, error))
        else:
            (ready if plan.action == "allocate" else others).append(plan)

    def _next_of_kind(
        self, demand: tuple[Any, ...], waiting: dict[tuple[Any, ...], list[GangKey]], passed: set[GangKey]
    ) -> None:
        """A gang of ``demand`` was placed: queue the next one backing off with that demand now (the
        room may take it too), one left waiting in this pass first, else the longest backing off."""
        if waiting.get(demand):
            self.requeue(GANG_PREFIX + waiting[demand].pop(0))
            return
        for gang, backoff in self._backoffs.items():
            if gang not in passed and backoff.demand == demand:
                self.requeue(GANG_PREFIX + gang)
                return

    def _back_off(self, plan: GangPlan) -> None:
        """The gang did not fit: not decided again before its backoff ends, and then once more."""
        previous = self._backoffs.get(plan.key)
        same = previous is not None and previous.signature == plan.signature
        failures = previous.failures + 1 if previous is not None and same else 1
        delay = min(UNFIT_MAX_BACKOFF_SECONDS, UNFIT_BACKOFF_SECONDS * 2 ** (failures - 1))
        demand = previous.demand if previous is not None and same else demand_key(plan)
        self._backoffs[plan.key] = _Backoff(plan.signature, failures, time.monotonic() + delay, demand)
        self.requeue_after(GANG_PREFIX + plan.key, delay)

    def _hand_over(self, writers: Writers, plan: GangPlan, decision: Decision) -> None:
        """A committed kube-scheduler gang's next pod does not fit: ungate it unallocated, so that
        kube-scheduler can bind the group (it holds every pod of it while one is gated); it then
        allocates this pod itself when room appears. Said on the pod, once."""
        self._ungate(writers, plan, {})
        for pod in plan.gated:
            meta = pod["metadata"]
            message = (
                f"Pod {meta['namespace']}/{meta['name']}: beyond its gang's minCount and no room now "
                f"({bounded(decision.reason)}); handed to kube-scheduler without our placement, since "
                "kube-scheduler binds no pod of the group while one still carries a scheduling gate"
            )
            writers.recorder.object_warning(
                f"handover:{meta.get('uid')}", pod, kind="Pod", reason=REASON_HANDED_OVER, message=message
            )

    def _backend_refused(self, plan: GangPlan) -> AllocationError | None:
        """With claim backend overrides forbidden: the first pending claim that names a backend."""
        if self.settings.allow_claim_backend_override:
            return None
        for group in plan.groups:
            for claim in group.pending_claims:
                try:
                    check_no_claim_backend(claim, driver=DRIVER_NAME)
                except AllocationError as error:
                    return error
        return None

    def _decide_all(self, ready: list[GangPlan]) -> list[Decision | AllocationError]:
        """``decide_all``, with the preemptor's nominations in force when there are any (then the
        whole pass holds ``cache.lock``: the nominated devices are held tentatively meanwhile)."""
        if self.preemptor is not None:
            with self.cache.lock:
                if self.preemptor.nominations or self.preemptor.reservations:
                    return self.preemptor.decide_all(
                        ready, policy=self.settings.policy, decide_all=decide_all
                    )
        return decide_all(self.cache, ready, policy=self.settings.policy)

    def _unschedulable(self, writers: Writers, plan: GangPlan, decision: Decision, generation: int) -> None:
        """An unschedulable gang's job: make room by preemption (``Preemptor``), else say why not."""
        if self.preemptor is not None:
            stale = self.capacity_generation() != generation  # decided again: the change requeued it
            if self.preemptor.preempt(plan, policy=self.settings.policy, stale=stale):
                return  # victims are going; the release of their claims queues the gang again
            consolidator = self.consolidator
            if consolidator is not None and consolidator.consolidate(plan, policy=self.settings.policy):
                return  # the moved pods are going; the same
            waits = [self.preemptor.retry_in(plan.key)]
            if self.consolidator is not None:
                waits.append(self.consolidator.retry_in(plan.key))
            if (seconds := min((w for w in waits if w is not None), default=None)) is not None:
                self.requeue_after(GANG_PREFIX + plan.key, seconds + 0.1)  # try again when it may
        self._explain(writers, plan, decision, generation)

    def provisioning_changed(self, gang: GangKey) -> None:
        """A request of the gang changed, or its backoff is over: look at it again."""
        with self._lock:
            self._provisioning_due.add(gang)
        self.requeue(GANG_PREFIX + gang)

    def _retry_due(self, gang: GangKey) -> bool:
        if self.consolidator is not None and self.consolidator.retry_due(gang):
            return True  # its backoff is over: a plan may be found now (pods aged, budgets changed)
        return (self.preemptor is not None and self.preemptor.retry_due(gang)) or (
            self.provisioner is not None and self.provisioner.retry_due(gang)
        )

    def _failed(self, plan: GangPlan, failure: AllocationError) -> None:
        self._mark_unschedulable(plan.key, fit=False)
        self.metrics.decisions.labels(outcome="error").inc()
        message = f"cannot allocate: {bounded(failure)}"
        self._start_job(
            [GANG_PREFIX + plan.key],
            lambda w: w.recorder.gang_unschedulable(plan.key, plan.gated[0], message, reason=REASON_FAILED),
        )

    def _act(self, plan: GangPlan) -> None:
        if plan.invalid:
            self._mark_unschedulable(plan.key, fit=False)
            self._start_job([GANG_PREFIX + plan.key], lambda w: self._report_invalid(w, plan))
        if plan.action == "idle":
            self._mark_unschedulable(plan.key, fit=True)
            self._unfit.pop(plan.key, None)
            self._backoffs.pop(plan.key, None)
            if self.provisioner is not None:
                self.provisioner.forget(plan.key)
        elif plan.action == "wait":
            log.debug("gang waiting", extra={"gang": plan.key, "reason": bounded(plan.reason)})
            self.metrics.decisions.labels(outcome="waiting").inc()
        elif plan.action == "release":
            keys = [GANG_PREFIX + plan.key, *(CLAIM_PREFIX + str(object_key(c)) for c in plan.release)]
            self._start_job(
                keys, lambda w: self._release_half_done(w, plan), requeue=(GANG_PREFIX + plan.key,)
            )
        elif plan.action == "ungate":
            self.metrics.decisions.labels(outcome="ungated").inc()
            self._start_job(
                [GANG_PREFIX + plan.key, *_claim_keys(plan)],
                lambda w: self._ungate(w, plan, {}),
                requeue=(GANG_PREFIX + plan.key,),
            )

    def _mark_unschedulable(self, gang: GangKey, *, fit: bool) -> None:
        with self._lock:
            if fit:
                self.unschedulable.discard(gang)
            else:
                self.unschedulable.add(gang)

    def unschedulable_gangs(self) -> list[GangKey]:
        with self._lock:
            return list(self.unschedulable)

    # -- gang jobs (writer threads) -------------------------------------------------------------------

    def _assume(self, claim: dict[str, Any], event_type: str = "MODIFIED") -> None:
        """Apply what we wrote (or just read) to the cache; when that frees devices, say so: the
        watch event of our own write then changes nothing, so nobody else would."""
        before = self.cache.claim_as_counted(str(object_key(claim)))
        applied, _ = self.cache.apply(Kind.CLAIM, event_type, claim)
        freed = event_type == "DELETED" or not (claim.get("status") or {}).get("allocation")
        if applied and before is not None and (before.get("status") or {}).get("allocation") and freed:
            self.capacity_freed()

    def _report_invalid(self, writers: Writers, plan: GangPlan) -> None:
        """An Event on each object rejected when read, and one on the gang's first pod."""
        for kind, obj, reason in plan.invalid:
            writers.recorder.object_rejected(kind.value, obj, reason)
        first_kind, first_obj, first_reason = plan.invalid[0]
        what = "ResourceClaim" if first_kind is Kind.CLAIM else "Pod"
        message = f"cannot allocate: {what} {object_key(first_obj)}: {first_reason}"
        writers.recorder.gang_unschedulable(plan.key, plan.gated[0], message, reason=REASON_FAILED)

    def _commit(self, writers: Writers, plan: GangPlan, decision: Decision) -> None:
        """Allocations, then gates; a failed write undoes this gang alone."""
        writer = writers.writer
        written: list[dict[str, Any]] = []  # each claim as stored after our last write to it
        lost = ""
        try:
            for claim, allocation in decision.allocations:
                node = allocation_node(allocation)
                if node and self._node_gone(node):  # no use writing the rest: it is undone below
                    lost = f"Node {node}"
                    break
                consumer = plan.consumer_of(str(object_key(claim)))
                written.append(writer.write_allocation(claim, allocation, reserved_for=consumer))
            with self.cache.lock:  # once per gang: the writers do not queue for the lock per write
                for stored in written:  # allocated as we assumed: nothing is freed, nobody to tell
                    self.cache.apply(Kind.CLAIM, "MODIFIED", stored)
                gone = [str(object_key(c)) for c in written if self._deleted_meanwhile(Kind.CLAIM, c)]
                gone += [str(object_key(p)) for p in plan.gated if self._deleted_meanwhile(Kind.POD, p)]
                lost = lost or self._placement_lost(decision)
            if gone:  # deleted while we placed the gang: it cannot complete, so nothing is ungated
                log.info("deleted during placement, undoing", extra={"gang": plan.key, "object": gone[0]})
                self._give_back(writer, plan, decision, written, requeue=False)
                return
            if lost:  # a node (or its devices) went away: the gang is planned again, gates kept
                log.info("placement lost during placement, undoing", extra={"gang": plan.key, "object": lost})
                self.metrics.decisions.labels(outcome="retry").inc()
                self._give_back(writer, plan, decision, written, requeue=True)
                return
        except HaltWrites:
            raise  # as if killed: nothing is undone
        except FractionalError as error:
            log.warning("gang write failed, undoing", extra={"gang": plan.key, "error": bounded(error)})
            self._give_back(writer, plan, decision, written, requeue=True)
            if isinstance(error, ConflictError | NotFoundError):
                self._refresh_claims(writer, [c for c, _ in decision.allocations])
            self.metrics.decisions.labels(outcome="retry").inc()
            return
        except Exception:  # a bug: still give back what this gang holds, then let the pool log it
            self._give_back(writer, plan, decision, written, requeue=True)
            raise
        nodes = {str(object_key(p)): node for p, node in decision.pod_nodes}
        try:
            self._ungate(writers, plan, nodes)
        except FractionalError as error:  # past the commit point: finish the gates on the next pass
            delay = self.requeue_later(GANG_PREFIX + plan.key)
            log.info(
                "ungating requeued", extra={"gang": plan.key, "error": bounded(error), "delay_seconds": delay}
            )
            return
        self.forget(GANG_PREFIX + plan.key)

    def _give_back(self, writer: ApiWriter, plan: GangPlan, decision: Decision, written: list[dict[str, Any]],
                   *, requeue: bool) -> None:  # fmt: skip
        """Undo exactly this gang: what the decider assumed, the writes made; then decide it again."""
        self.cache.forget_assumed([str(object_key(c)) for c, _ in decision.allocations])
        for pod, _node in decision.pod_nodes:
            self.cache.forget_placement(str(object_key(pod)))
        placed = frozenset(str(p["metadata"].get("uid")) for p in plan.gated if is_gated(p))
        try:
            self._undo(writer, written, placed)
        except FractionalError as error:  # what is left is a half-done gang: its next pass releases it
            log.warning("undo incomplete", extra={"gang": plan.key, "error": bounded(error)})
        self.capacity_freed()
        if requeue:
            self.requeue_later(GANG_PREFIX + plan.key)

    def _node_gone(self, node: str) -> bool:
        current = self.cache.get(Kind.NODE, node)
        return current is None or is_deleting(current)

    def _placement_lost(self, decision: Decision) -> str:
        """The first node or device the gang was placed on that the cache no longer holds (a Node
        deleted or being deleted, its slices withdrawn); empty when all are there. Under ``cache.lock``."""
        nodes: set[str] = {node for _pod, node in decision.pod_nodes if node}
        nodes |= {node for _claim, a in decision.allocations if (node := allocation_node(a))}
        for node in sorted(nodes):
            if self._node_gone(node):
                return f"Node {node}"
        published: set[tuple[str, str, str]] = set()
        pools = {
            (str(r.get("driver", "")), str(r.get("pool", "")))
            for _claim, a in decision.allocations
            for r in (a.get("devices") or {}).get("results") or ()
        }
        for resource_slice in self.cache.in_pools(Kind.SLICE, pools):
            spec = resource_slice.get("spec") or {}
            if spec.get("nodeName") and spec["nodeName"] not in nodes:
                continue
            pool = str((spec.get("pool") or {}).get("name", ""))
            published |= {
                (str(spec.get("driver", "")), pool, str(d.get("name"))) for d in spec.get("devices") or ()
            }
        for _claim, allocation in decision.allocations:
            for result in (allocation.get("devices") or {}).get("results") or ():
                device = (
                    str(result.get("driver", "")),
                    str(result.get("pool", "")),
                    str(result.get("device", "")),
                )
                if device not in published:
                    return f"device {'/'.join(device)}"
        return self._booked_twice(decision)

    def _booked_twice(self, decision: Decision) -> str:
        """A device of this gang that the allocations in the cache now hold past its capacity: another
        allocator (kube-scheduler, for an ungated pod) took the same room while we wrote. Seen on
        1.37.2 under churn. Ours yields: nothing is ungated yet, so the gang is planned again.
        Under ``cache.lock``."""
        ours: set[tuple[str, str, str]] = set()
        for _claim, allocation in decision.allocations:
            ours |= _devices_of({"status": {"allocation": allocation}})
        if not ours:
            return ""
        # Only the gang's pools and the claims on its devices, from the cache's index by pool: this
        # runs once per gang commit (a scan of every claim here took a tenth of the controller's
        # CPU in a 1,000-pod backlog on a real cluster).
        pools = {(driver, pool) for driver, pool, _device in ours}
        slices = self.cache.in_pools(Kind.SLICE, pools)
        claims = [c for c in self.cache.in_pools(Kind.CLAIM, pools) if _devices_of(c) & ours]
        for overcommit in compute_overcommits(slices, claims, only=ours):
            if overcommit.device in ours:
                return f"device {overcommit.device_name}, booked past its {overcommit.dimension} meanwhile"
        return ""

    def _deleted_meanwhile(self, kind: Kind, obj: dict[str, Any]) -> bool:
        """The deletion mark as our write returned it, or as the watch has seen it since (a new
        object under the same name counts as deleted too)."""
        current = self.cache.get(kind, str(object_key(obj)))
        return (
            is_deleting(obj)
            or current is None
            or is_deleting(current)
            or current["metadata"].get("uid") != obj["metadata"].get("uid")
        )

    def _undo(self, writer: ApiWriter, written: list[dict[str, Any]], placed: frozenset[str]) -> None:
        """Clear what this gang's job wrote: each allocation (with the reservation we wrote for one
        of ``placed``, the UIDs of the gang's pods that are gated: nothing can bind them), and our
        finalizer where an earlier version of the controller wrote one. An allocation reserved for
        anyone else (kube-scheduler's reservation of an ungated pod) is left as it is."""
        for stored in reversed(written):
            current = stored
            for _attempt in range(3):
                try:
                    if (current.get("status") or {}).get("allocation"):
                        reserved = reserved_pods(current)
                        if reserved is None or any(uid not in placed for _name, uid in reserved):
                            break  # someone else already uses it: leave it
                        current = writer.clear_allocation(current)
                        self._assume(current)
                    current = writer.remove_finalizer(current)
                    self._assume(current)
                    break
                except ConflictError:
                    meta = current["metadata"]
                    current = writer.read_claim(meta["namespace"], meta["name"])
                    self._assume(current)
                except NotFoundError:
                    break

    def _refresh_claims(self, writer: ApiWriter, claims: list[dict[str, Any]]) -> None:
        """After a 409, read the claims so the next decision starts from the server's truth."""
        for claim in claims:
            meta = claim["metadata"]
            try:
                self._assume(writer.read_claim(meta["namespace"], meta["name"]))
            except NotFoundError:
                self._assume(claim, "DELETED")

    def _ungate(self, writers: Writers, plan: GangPlan, nodes: dict[str, str | None]) -> None:
        writer = writers.writer
        for pod in plan.gated:
            key = str(object_key(pod))
            pin = self._pin(pod, nodes.get(key))
            annotations: dict[str, str | None] = {PLACED_ANNOTATION: nodes.get(key) or ""}
            if (pod["metadata"].get("annotations") or {}).get(HINT_ANNOTATION):
                annotations[HINT_ANNOTATION] = None  # placed: the scale-up hint is spent
            current = pod
            for _attempt in range(3):
                try:
                    stored = writer.ungate_pod(current, pin=pin, annotations=annotations)
                    break
                except ConflictError:
                    meta = current["metadata"]
                    current = writer.read_pod(meta["namespace"], meta["name"])
                    if not is_gated(current):
                        stored = current
                        break
            else:
                raise ConflictError(f"Pod {key}: scheduling gate: kept changing while being removed")
            with self.cache.lock:
                self.cache.apply(Kind.POD, "MODIFIED", stored)
                if nodes.get(key) is None:
                    self.cache.forget_placement(key)
            seen = self.gate_seen.pop(key, None)
            if seen is not None:
                latency = time.monotonic() - seen
                self.latencies.append(latency)
                self.metrics.ungate_seconds.observe(latency)
        writers.recorder.forget(plan.key)
        self._unfit.pop(plan.key, None)
        if self.provisioner is not None and plan.gated:
            self.provisioner.placed(writers.recorder, plan.key, str(plan.gated[0]["metadata"]["namespace"]))
        log.info("gang allocated", extra={"gang": plan.key, "pods": len(plan.gated)})

    def _pin(self, pod: dict[str, Any], node: str | None) -> tuple[str, str] | None:
        """For a pod without claims placed by us, the nodeSelector entry that pins it to ``node``."""
        if node is None or pod_claim_refs(pod):
            return None
        hostname = self.cache.hostname(node)
        return (HOSTNAME_LABEL, hostname) if hostname else None

    def _release_half_done(self, writers: Writers, plan: GangPlan) -> None:
        log.warning("releasing a half-allocated gang", extra={"gang": plan.key, "claims": len(plan.release),
                    "reason": bounded(plan.reason)})  # fmt: skip
        for claim in plan.release:
            self._release(writers.writer, claim)
        self.metrics.decisions.labels(outcome="released").inc()

    def _explain(self, writers: Writers, plan: GangPlan, decision: Decision, generation: int) -> None:
        state = self._unfit.setdefault(plan.key, _Unfit())
        key = (plan.signature, generation)
        with self._lock:
            self._provisioning_due.discard(plan.key)
        if state.key == key:
            provisioning = self._provision(writers, plan, state.hint_json)
            if provisioning is not None and provisioning.said != state.provisioning:
                state.provisioning = provisioning.said  # say what became of its requests
                message = state.message + (f"; {provisioning.said}" if provisioning.said else "")
                writers.recorder.gang_unschedulable(plan.key, plan.gated[0], message, also=plan.target)
            else:
                writers.recorder.keep_alive(plan.key)  # still so: its Event outlives the apiserver's TTL
            if provisioning is not None:
                self._annotate(writers, plan, state.hint_json, provisioning.requests)
            return  # nothing else changed since we last said why
        if self.capacity_generation() != generation and state.stale < STALE_EXPLANATIONS_SKIPPED:
            # Capacity changed since this decision (a Node seen after its slices, a pod gone): the
            # gang is decided again, so an Event now would describe a cluster that no longer is.
            state.stale += 1
            return
        state.stale = 0
        claims = [c for g in plan.groups for c in g.pending_claims]
        sizing = self._sized(plan, claims, generation)
        offer, hint = sizing.offer, sizing.hint
        name = plan.key.split("/", 1)[1]
        message = f"gang {name} ({len(plan.gated)} pods) needs {describe_demand(claims)}; "
        offered = (
            f"best node {offer.node} offers room for {offer.pods} of {len(plan.gated)} pods "
            f"({offer.shares} devices)"
            if offer and offer.shares
            else "no node offers any"
        )
        if decision.short_of != "devices":  # what is short comes first: the devices are not it
            message += f"{decision.reason}; devices: {offered}"
        else:
            message += offered
            if plan.topology_key:
                message += f"; {decision.reason}"
        hint_json = render_hint(hint) if hint else None
        message += (
            f"; scale-up hint: {hint.nodes} x {hint.profile}" if hint else "; no known node shape fits it"
        )
        provisioning = self._provision(writers, plan, hint_json)
        said = provisioning.said if provisioning is not None else ""
        now = time.monotonic()
        if (message, said, plan.signature) == (
            state.message,
            state.provisioning,
            state.key[0],
        ) and now - state.said_at < SAME_EXPLANATION_SECONDS:
            writers.recorder.keep_alive(plan.key)  # the same words, said moments ago
        else:
            writers.recorder.gang_unschedulable(
                plan.key, plan.gated[0], message + (f"; {said}" if said else ""), also=plan.target
            )
            state.said_at = now
        self._annotate(writers, plan, hint_json, provisioning.requests if provisioning is not None else {})
        state.key, state.hint_json, state.message, state.provisioning = key, hint_json, message, said

    def _sized(self, plan: GangPlan, claims: list[dict[str, Any]], generation: int) -> _Sizing:
        """The best node's offer and the scale-up hint for the gang's pending claims: from the memo
        when a gang that asks the same (claim specs, pod sizes, where its pods may run) was sized on
        this inventory at this capacity generation, or less than ``SIZING_REUSE_SECONDS`` ago."""
        pods = [p for g in plan.groups if g.pending_claims for p in g.pods] + list(plan.gated)
        placement = sorted({placement_spec(p) for p in pods})
        key = (
            self.cache.inventory_version,
            tuple(json.dumps(c.get("spec"), sort_keys=True) for c in claims),
            tuple(len(g.pending_claims) for g in plan.groups if g.pending_claims),
            tuple(placement),
        )
        with self._sizing_lock:  # one sizing at a time: the writers that wait for it reuse it
            found = self._sizing_of(key, generation)
            return found if found is not None else self._size(key, plan, claims, generation)

    def _sizing_of(self, key: tuple[Any, ...], generation: int) -> _Sizing | None:
        found = self._sizings.get(key)
        now = time.monotonic()
        if found is None or (found.generation != generation and now - found.at >= SIZING_REUSE_SECONDS):
            return None
        self._sizings.move_to_end(key)
        return found

    def _size(
        self, key: tuple[Any, ...], plan: GangPlan, claims: list[dict[str, Any]], generation: int
    ) -> _Sizing:
        now = time.monotonic()
        with self.cache.lock:
            pod_groups, start = [], 0
            for group in plan.groups:
                pod_groups.append(list(range(start, start + len(group.pending_claims))))
                start += len(group.pending_claims)
            pod_groups = [g for g in pod_groups if g]
            nodes = self.cache.objects(Kind.NODE)
            # Only nodes the gang's pods could run on: a node that just joined carries the
            # not-ready taint until its kubelet reports (seen on a real cluster), and must not be
            # named as the best offer of a gang that the planner rightly kept off it.
            node_names = [
                str(n["metadata"]["name"]) for n in nodes if all(node_admits_pod(p, n) for p in plan.gated)
            ]
            offer = best_node_offer(self.cache.state, plan.groups, node_names, policy=self.settings.policy)
            slices = self.cache.objects(Kind.SLICE)
            classes = self.cache.objects(Kind.CLASS)
            allocated = [
                c for c in self.cache.objects(Kind.CLAIM) if (c.get("status") or {}).get("allocation")
            ]
            # The hint counts only the nodes the gang's pods may use (their nodeSelector, affinity
            # and tolerations): a gang kept to one node group must not be told that room elsewhere
            # covers part of it (seen with cluster-autoscaler: the hint said 1 node where it took 2).
            refused = static_exclusions(self.cache, plan)
        shapes = profile_shapes(self.settings.hint_profiles) + existing_node_shapes(slices, nodes)
        hint = compute_hint(
            claims, pod_groups=pod_groups, shapes=shapes, cluster_slices=slices, classes=classes,
            allocated_claims=allocated, nodes=nodes, exclude_nodes=refused, policy=self.settings.policy,
            topology_label=self.settings.topology_label,
        )  # fmt: skip
        sizing = _Sizing(offer=offer, hint=hint, generation=generation, at=now)
        self._sizings[key] = sizing
        while len(self._sizings) > SIZING_MEMO_ENTRIES:
            self._sizings.popitem(last=False)
        return sizing

    def _provision(
        self, writers: Writers, plan: GangPlan, hint_json: str | None
    ) -> ProvisioningAnswer | None:
        """One step of the gang's ProvisioningRequests (None: we make none for it)."""
        if self.provisioner is None or not plan.gated or kueue_provisions(plan.gated):
            return None
        return self.provisioner.for_unfit(
            writers.recorder, plan.key, list(plan.gated), wanted=hint_json is not None,
            requeue_key=GANG_PREFIX + plan.key,
        )  # fmt: skip

    def _annotate(
        self, writers: Writers, plan: GangPlan, hint_json: str | None, requests: dict[str, str]
    ) -> None:
        """The hint on each pod, and the request that asks for it (only what differs is written)."""
        for pod in plan.gated:
            key = str(object_key(pod))
            request = requests.get(key)
            wanted = EventRecorder.hint_annotations(
                hint_json, (request, self.settings.provisioning_class) if request else None
            )
            annotations = pod["metadata"].get("annotations") or {}
            changed = {k: v for k, v in wanted.items() if annotations.get(k) != v}
            if changed:
                self.cache.apply(Kind.POD, "MODIFIED", writers.writer.annotate_pod(pod, changed))

    # -- overcommitted devices -------------------------------------------------------------------------

    def defragment(self) -> None:
        """The scheduled consolidation pass, on a writer (its API reads and evictions)."""
        consolidator = self.consolidator
        if consolidator is not None:
            self._start_job([DEFRAGMENT_JOB], lambda _w: consolidator.defragment(policy=self.settings.policy))

    def report_overcommits(self, found: tuple[Overcommit, ...]) -> None:
        """Export how many devices are overcommitted, and put a Warning Event on every claim of an
        overcommit not reported before (once per change: the same overcommit is not said again)."""
        self.metrics.overcommitted_devices.set(len({o.device for o in found}))
        current = frozenset(found)
        new = sorted(current - self._overcommits, key=lambda o: (o.device, o.dimension))
        self._overcommits = current
        for overcommit in new:
            log.warning("device overcommitted", extra={"device": overcommit.device_name,
                        "dimension": overcommit.dimension, "consumed": str(overcommit.consumed),
                        "capacity": str(overcommit.capacity), "claims": len(overcommit.claims)})  # fmt: skip
            claims = [c for key in overcommit.claims if (c := self.cache.get(Kind.CLAIM, key)) is not None]
            self._start_job(
                [f"overcommit:{overcommit.device_name}"],
                lambda w, o=overcommit, claims=claims: self._post_overcommit(w, o, claims),  # type: ignore[misc]
            )

    def _post_overcommit(
        self, writers: Writers, overcommit: Overcommit, claims: list[dict[str, Any]]
    ) -> None:
        message = f"{overcommit.describe()}; a node agent refuses to prepare a share beyond the device"
        scope = f"overcommit:{overcommit.device_name}"
        for claim in claims:
            writers.recorder.object_warning(
                scope, claim, kind="ResourceClaim", reason=REASON_OVERCOMMITTED, message=message
            )

    # -- refused shares ---------------------------------------------------------------------------------

    def reconcile_refused(self, key: str) -> None:
        """A claim whose share a node refused (``ShareRefused``): replace its pods, or say what to do."""
        refusals = self.refusals
        queue_key = REFUSED_PREFIX + key
        if refusals is None:
            return
        job = self._busy_job([queue_key])
        if job is not None:
            self._defer(job, queue_key)
            return
        decided = refusals.decide(key)
        if decided:
            self._start_job([queue_key], lambda w: refusals.act(w, decided))

    # -- claims ---------------------------------------------------------------------------------------

    def _release_if_gone(self, writer: ApiWriter, claim: dict[str, Any]) -> None:
        """Release ``claim``, reserved for one pod this controller never saw, once the API says that
        pod is gone (kube-controller-manager's resourceclaim controller asks it too, before it drops
        such a reservation); a pod that exists keeps it."""
        ((name, uid),) = reserved_pods(claim) or (("", ""),)
        namespace = claim["metadata"]["namespace"]
        try:
            found: str | None = str(writer.read_pod(namespace, name)["metadata"].get("uid"))
        except NotFoundError:
            found = None
        if found == uid:
            return  # it exists: its claim is released when it ends (the pod's deletion queues it)
        log.info("releasing claim", extra={"claim": str(object_key(claim)), "deleting": is_deleting(claim),
                 "reservation": "gone"})  # fmt: skip
        self._release(writer, claim)

    def _goes_with_its_pod(self, key: str, claim: dict[str, Any]) -> bool:
        """Whether to leave ``claim`` (allocated, unused) to kube-controller-manager: it was made
        for a pod that was deleted, so its garbage collector deletes it, and the watch's DELETE frees
        its devices as a cleared allocation would. Clearing it as well raced that controller's own
        write of the claim (it drops the gone pod from ``reservedFor``). Seen on 1.37.2 at 1,000
        nodes while 2,800 pods left: about 1,500 of its writes lost to ours in 40 s. Each loss took a
        token from its workqueue's limit of 10 retries a second, so a new gang pod whose claims it
        had to retry (its PodGroup not yet in its cache) got them about 95 s later. A claim that
        outlives its pod by ``ORPHAN_GRACE_SECONDS`` (that collector behind, or off) is released
        by us after all."""
        owner = generated_for(claim)
        if is_deleting(claim) or owner is None or not self.cache.seen_deleted(owner):
            return False
        now = time.monotonic()
        with self._lock:
            since = self._orphans.setdefault(key, now)
            if now - since >= ORPHAN_GRACE_SECONDS:
                del self._orphans[key]
                return False
        self.requeue_after(CLAIM_PREFIX + key, ORPHAN_GRACE_SECONDS - (now - since))
        return True

    def _release(self, writer: ApiWriter, claim: dict[str, Any]) -> None:
        """Clear the allocation (its reservation and device status with it), then our finalizer if an
        earlier version of the controller wrote one; each write carries the claim's
        resourceVersion: a 409 (the resourceclaim controller dropped the reservation meanwhile,
        say) requeues the key, decided again from the new version. A claim being deleted keeps its
        allocation: the object goes with it, and the watch's DELETE frees the devices as the
        cleared allocation would (at most one request per pod that leaves)."""
        current = claim
        if (current.get("status") or {}).get("allocation"):
            if not is_deleting(current):
                current = writer.clear_allocation(current)
                self._assume(current)
            self.metrics.released.inc()
        if has_finalizer(current):
            current = writer.remove_finalizer(current)
            self._assume(current)

    def reconcile_claim(self, key: str) -> None:
        """Decide what one of our claims needs (decider); any write goes to a job."""
        queue_key = CLAIM_PREFIX + key
        job = self._busy_job([queue_key])
        if job is not None:
            self._defer(job, queue_key)
            return
        claim = self.cache.get(Kind.CLAIM, key)
        if claim is None:
            with self._lock:
                self._orphans.pop(key, None)
            return
        status = claim.get("status") or {}
        users = self.cache.claim_users(key)
        mine = is_ours(claim)
        if not mine and (status.get("allocation") or not any(placed_by_us(u) for u in users)):
            return  # kube-scheduler's, or nobody's: nothing of ours to look after
        if (reason := self.cache.rejection(Kind.CLAIM, key)) is not None:
            # As read it was cut (too deep): writing it back would write the cut version. Say so once.
            self._start_job(
                [queue_key], lambda w: w.recorder.object_rejected(Kind.CLAIM.value, claim, reason)
            )
            return
        if is_deleting(claim) or (status.get("allocation") and not users):
            if not mine:
                return  # unallocated and no finalizer of ours: the object goes by itself
            with self.cache.lock:
                reservation, _pod = reservation_of(self.cache, claim)
            if reservation is Reservation.IN_USE:
                return  # in use: kube-scheduler / the resourceclaim controller unreserves it first
            if any((u.get("spec") or {}).get("nodeName") for u in users):
                return  # a bound pod runs with it (reservedFor may lag): release when the pod ends
            if reservation is Reservation.UNKNOWN:
                # Reserved for a pod never seen here (we restarted since): gone, or not seen yet?
                self._start_job([queue_key], lambda w: self._release_if_gone(w.writer, claim))
                return
            if self._goes_with_its_pod(key, claim):
                return
            log.info("releasing claim", extra={"claim": key, "deleting": is_deleting(claim),
                     "reservation": reservation.value})  # fmt: skip
            self._start_job([queue_key], lambda w: self._release(w.writer, claim))
            return
        if status.get("allocation"):
            return
        # Unallocated, with a pod we placed (or our finalizer, an earlier version's): who cleared it?
        running = [u for u in users if not is_gated(u) and (mine or placed_by_us(u))]
        if running:  # our allocation was cleared after the pod left our hands: kube-scheduler's PostFilter
            self.metrics.vanished.inc()
            log.warning(
                "allocation vanished",
                extra={"claim": key, "pod": ", ".join(sorted(str(object_key(u)) for u in running))},
            )
            # Not bound yet, in a gang: kube-scheduler's gang PostFilter undid the placement; the gang
            # is planned again as a whole (gangs/plan.py).
            gangs = {g for u in running if not (u.get("spec") or {}).get("nodeName")
                     and (g := self.cache.gang_of_pod(str(object_key(u)))) is not None}  # fmt: skip
            if gangs:
                for gang in sorted(gangs):
                    self.requeue(GANG_PREFIX + gang)
                return
        if mine:  # an earlier version's finalizer on a claim it no longer holds
            self._start_job([queue_key], lambda w: self._release(w.writer, claim))


def _devices_of(claim: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(driver, pool, device) of every result of the claim's allocation; empty when unallocated."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    return {
        (str(r.get("driver", "")), str(r.get("pool", "")), str(r.get("device", "")))
        for r in (allocation.get("devices") or {}).get("results") or ()
    }

"""Preemption for the gangs we place: the search wired to the cache, the nominations
that keep freed devices for the preemptor, and the effects (evictions, conditions, Events).

``decide_all`` runs on the decider thread inside its decide step (``cache.lock`` held, no I/O): it
places a nominated gang on its nominated nodes and holds the nominated devices against the other
gangs. ``preempt`` runs as the job of a gang found unschedulable, on a writer thread: it reads
the PodDisruptionBudgets, takes ``cache.lock`` for the search and the nomination only, and makes
its API calls (with its own ``ApiClient``) after releasing it. Its state lives under
``cache.lock``.

Effects, in order, as kube-scheduler's ``prepareCandidate`` makes them
(``pkg/scheduler/framework/preemption/preemption.go``), through the Eviction API instead of a
plain delete so that the server enforces PodDisruptionBudgets:

1. every victim is evicted with ``dryRun: [All]`` first: one refusal (a budget) stops everything
   before anything happened, so a victim gang is evicted whole or not at all;
2. the preemptor's pods get ``status.nominatedNodeName`` (their nominated placement), and the
   preemptor an Event ``Preempting`` naming the victims and the placement;
3. per victim: the ``DisruptionTarget`` condition (reason ``PreemptionByScheduler``, message
   ``"<schedulerName>: preempting to accommodate a higher priority pod"``), the eviction, and the
   Event ``Preempted`` with kube-scheduler's message ``"Preempted by pod <uid> on node <node>"``.

While the victims' claims are being released, the nominated devices, and the CPU, memory and pod
slot of the preemptor's pods on their nominated nodes, are held against every gang of equal or lower
priority; the preemptor is then allocated on its nominated nodes. A preemptor
whose evictions were refused, or that still does not fit once its victims are gone, backs off
(exponentially) before it may preempt again.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kubernetes import client

from driver.controller.gangs.decide import (
    Decision,
    allocate_groups,
    group_node,
    node_fit,
    static_exclusions,
    tentative_allocations,
)
from driver.controller.gangs.plan import GangPlan
from driver.controller.gangs.topology import decide_in_domains
from driver.controller.metrics import ControllerMetrics
from driver.controller.model.decode import bounded
from driver.controller.model.objects import (
    GangKey,
    Resources,
    node_allocatable,
    object_key,
    pod_requests,
)
from driver.controller.preemption.refusal import build_eviction
from driver.controller.preemption.victims import (
    Budget,
    Choice,
    DeviceKey,
    Placement,
    VictimUnit,
    build_victim_units,
    choose_victims,
    count_violations,
    device_holders,
    parse_budget,
    pod_priority,
    preemption_refusal,
)
from driver.controller.view.cache import ClusterCache, Kind
from driver.controller.writes.events import COMPONENT, MAX_EVENT_MESSAGE_CHARS, REPORTING_COMPONENT
from driver.controller.writes.writer import HaltWrites
from driver.errors import AllocationError, FractionalError, NotFoundError
from driver.kube import REQUEST_TIMEOUT_SECONDS, api_errors, new_api_client

__all__ = [
    "CONDITION_REASON",
    "EVENT_REASON_PREEMPTED",
    "EVENT_REASON_PREEMPTING",
    "Nomination",
    "Preemptor",
    "build_disruption_condition",
    "build_preemption_event",
]

log = logging.getLogger(__name__)

CONDITION_TYPE = "DisruptionTarget"
CONDITION_REASON = "PreemptionByScheduler"  # corev1.PodReasonPreemptionByScheduler
EVENT_REASON_PREEMPTED = "Preempted"  # on each victim, action "Preempting" (kube-scheduler's)
EVENT_REASON_PREEMPTING = "Preempting"  # on the preemptor: the victims and the nominated placement
EVENT_REASON_BLOCKED = "PreemptionBlocked"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
DEFAULT_SCHEDULER = "default-scheduler"
REPLACES_ANNOTATION = "fractional.dev/replaces"  # consolidation's make-before-break mark (consolidator.py)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_disruption_condition(preemptor: dict[str, Any]) -> dict[str, Any]:
    """The condition kube-scheduler puts on a victim before deleting it."""
    scheduler = (preemptor.get("spec") or {}).get("schedulerName") or DEFAULT_SCHEDULER
    return {
        "type": CONDITION_TYPE,
        "status": "True",
        "reason": CONDITION_REASON,
        "message": f"{scheduler}: preempting to accommodate a higher priority pod",
        "lastTransitionTime": _now(),
    }


def _reference(pod: dict[str, Any]) -> dict[str, Any]:
    meta = pod["metadata"]
    return {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "namespace": meta["namespace"],
            "uid": meta.get("uid")}  # fmt: skip


def build_preemption_event(
    pod: dict[str, Any], *, reason: str, message: str, identity: str, related: dict[str, Any] | None = None,
    event_type: str = "Normal",
) -> dict[str, Any]:  # fmt: skip
    meta = pod["metadata"]
    now = _now()
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name'][:200]}.", "namespace": meta["namespace"]},
        "involvedObject": _reference(pod),
        "reason": reason,
        "action": "Preempting",
        "message": bounded(message, MAX_EVENT_MESSAGE_CHARS - 40),
        "type": event_type,
        "source": {"component": COMPONENT},
        "reportingComponent": REPORTING_COMPONENT,
        "reportingInstance": identity or COMPONENT,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    if related is not None:
        body["related"] = _reference(related)
    return body


@dataclass
class Nomination:
    priority: int
    pod_nodes: dict[str, str | None]  # preemptor pod "namespace/name" -> node
    allocations: tuple[tuple[dict[str, Any], dict[str, Any]], ...]
    victim_pods: frozenset[str]  # "namespace/name" of every victim pod
    victim_claims: tuple[dict[str, Any], ...]
    deadline: float
    source: str = "preemption"  # or "consolidation": the victims were moved, not preempted
    created: str = ""  # the first gated pod's creationTimestamp (consolidation: its wait, once placed)
    room: tuple[tuple[str, str, Resources], ...] = ()  # (pod "namespace/name", node, its requests)

    @property
    def nodes(self) -> frozenset[str]:
        return frozenset(n for n in self.pod_nodes.values() if n)


@dataclass
class Reservation:
    """The place a consolidation planned for the replacement of a moved pod: held against every
    other gang until a new gated pod of ``owner_uid`` takes it, or ``deadline`` passes."""

    owner_uid: str
    node: str
    allocations: tuple[tuple[dict[str, Any], dict[str, Any]], ...]  # (stand-in claim, allocation)
    deadline: float
    gang: GangKey  # the waiting gang the move served
    # Make before break: the replacement comes from a new ReplicaSet; it is known by this value of
    # its annotation fractional.dev/replaces (the Deployment's template carries it), not its owner.
    token: str = ""
    room: Resources = field(default_factory=Resources)  # the replacement's CPU, memory, pod slot


def gang_room(
    plan: GangPlan, pod_nodes: Iterable[tuple[str, str | None]]
) -> tuple[tuple[str, str, Resources], ...]:
    """What a nomination keeps of its nodes' CPU, memory and pod slots: each gang pod's requests on
    the node planned for it."""
    requests = {str(object_key(p)): pod_requests(p) for g in plan.groups for p in g.pods}
    return tuple((pod, node, requests[pod]) for pod, node in pod_nodes if node and pod in requests)


@dataclass
class _Backoff:
    until: float = 0.0
    failures: int = 0


def gang_priority(pods: tuple[dict[str, Any], ...]) -> int:
    """A gang preempts with the priority of its least important gated pod."""
    return min((pod_priority(p) for p in pods), default=0)


DecideAll = Callable[..., list[Decision | AllocationError]]


@dataclass
class Preemptor:
    cache: ClusterCache
    configuration: client.Configuration
    identity: str = ""
    fence: threading.Event | None = None  # set once leadership is lost: no write goes out
    metrics: ControllerMetrics | None = None
    clock: Callable[[], float] = time.monotonic
    nomination_seconds: float = 300.0  # victims still not gone by then: give up and back off
    backoff_seconds: float = 10.0
    backoff_max_seconds: float = 300.0
    nominations: dict[GangKey, Nomination] = field(default_factory=dict)  # under cache.lock
    # Places kept for the replacements of pods a consolidation moved, by id (under cache.lock).
    reservations: dict[str, Reservation] = field(default_factory=dict)
    search: bool = True  # False (--preemption=false): only consolidation's nominations are kept here
    taken: dict[GangKey, str] = field(default_factory=dict)  # gang -> reservation its decision used
    consolidation_failed: Callable[[GangKey, str], None] | None = None  # the consolidator's backoff
    backoff: dict[GangKey, _Backoff] = field(default_factory=dict)  # under cache.lock
    evicted: int = 0  # victim pods evicted so far
    last_choice: Choice | None = None

    # -- inside the decide step (decider thread, cache.lock held, no I/O) -------------------------------

    def _held_against(self, plan: GangPlan) -> frozenset[GangKey]:
        priority = gang_priority(plan.gated)
        return frozenset(g for g, n in self.nominations.items() if g != plan.key and n.priority >= priority)

    @contextmanager
    def _holding(self, gangs: frozenset[GangKey], *, lifted: str | None = None) -> Iterator[None]:
        """Count the devices nominated to ``gangs``, and every reservation but ``lifted``, as taken
        for the duration of the block, and the CPU, memory and pod slots they keep on their nodes
        (a pod whose node counts it already, bound or placed, is not counted twice; nor is a
        reservation a replacement has just taken)."""
        self.expire_reservations()
        pairs = [pair for gang in sorted(gangs) if gang in self.nominations
                 for pair in self.nominations[gang].allocations]  # fmt: skip
        room = [(node, requests) for gang in sorted(gangs) if gang in self.nominations
                for pod, node, requests in self.nominations[gang].room
                if not self.cache.counts_pod(pod)]  # fmt: skip
        taken = set(self.taken.values())
        for rid, kept in sorted(self.reservations.items()):
            if rid != lifted:
                pairs += kept.allocations
                if rid not in taken and kept.room != Resources():
                    room.append((kept.node, kept.room))
        if not pairs and not room:
            yield
            return
        with tentative_allocations(self.cache, pairs), self.cache.holding_room(room):
            yield

    def held_per_device(self) -> dict[DeviceKey, int]:
        """Every nomination's and reservation's allocations, counted per device as ``device_holders``
        counts claims (a device held for someone is not emptied by moving the claims on it)."""
        self.expire_reservations()
        pairs = [p for n in self.nominations.values() for p in n.allocations]
        pairs += [p for r in self.reservations.values() for p in r.allocations]
        return device_holders({**claim, "status": {"allocation": allocation}} for claim, allocation in pairs)

    @contextmanager
    def holding_all(self) -> Iterator[None]:
        """Every nomination and reservation held, for the block (a consolidation's plan is made
        around them). Under ``cache.lock``."""
        with self._holding(frozenset(self.nominations)):
            yield

    def expire_reservations(self) -> None:
        now = self.clock()
        for rid in [rid for rid, r in self.reservations.items() if now >= r.deadline]:
            gone = self.reservations.pop(rid)
            log.info("reservation expired", extra={"owner": gone.owner_uid, "node": gone.node,
                                                   "gang": gone.gang})  # fmt: skip
            if self.metrics is not None:
                self.metrics.consolidation_refused.labels(reason="reservation_expired").inc()

    def _reservation_for(self, plan: GangPlan) -> str | None:
        """The reservation a lone gated pod takes: one kept for its owner (its controller)."""
        if not self.reservations or len(plan.gated) != 1:
            return None
        meta = plan.gated[0].get("metadata") or {}
        token = (meta.get("annotations") or {}).get(REPLACES_ANNOTATION)
        owner = next(
            (str(r.get("uid")) for r in meta.get("ownerReferences") or () if r.get("controller")), None
        )
        for rid, kept in sorted(self.reservations.items()):
            if (kept.token and kept.token == token) or (
                not kept.token and owner is not None and kept.owner_uid == owner
            ):
                return rid
        return None

    @contextmanager
    def holding_against(self, priority: int) -> Iterator[None]:
        """Count as taken, for the block, the devices nominated to gangs of at least ``priority``
        (kube-scheduler's own rule for nominated pods). The allocation guard checks another
        allocator's write this way, so the room a preemptor freed is not taken by a pod that
        would not have been allowed to preempt for it. Under ``cache.lock``."""
        with self._holding(frozenset(g for g, n in self.nominations.items() if n.priority >= priority)):
            yield

    def decide_all(
        self, plans: list[GangPlan], *, policy: str, decide_all: DecideAll
    ) -> list[Decision | AllocationError]:
        """``decide_all`` with the nominations in force: a nominated gang goes to its nominated nodes
        when they have room; every other gang decides with the devices nominated to gangs of at least
        its priority counted as taken. One entry per plan, in order."""
        if not self.nominations and not self.reservations:
            return decide_all(self.cache, plans, policy=policy)
        from driver.controller.gangs.decide import assume_decision  # the pipelined decider's

        results: list[Decision | AllocationError | None] = [None] * len(plans)
        by_hold: dict[frozenset[GangKey], list[int]] = {}
        for index, plan in enumerate(plans):
            decision = self.nominated_decision(plan, policy=policy) if plan.key in self.nominations else None
            if decision is None and (rid := self._reservation_for(plan)) is not None:
                decision = self.reserved_decision(plan, rid, policy=policy)
                if decision is not None:
                    self.taken[plan.key] = rid
            if decision is not None:
                assume_decision(self.cache, decision)
                results[index] = decision
            else:
                by_hold.setdefault(self._held_against(plan), []).append(index)
        for held, indexes in by_hold.items():
            with self._holding(held):
                outcomes = decide_all(self.cache, [plans[i] for i in indexes], policy=policy)
            for index, outcome in zip(indexes, outcomes, strict=True):
                results[index] = outcome
        return [r for r in results if r is not None]

    def nominated_decision(self, plan: GangPlan, *, policy: str) -> Decision | None:
        """For a nominated gang: its allocations on the nominated nodes, or None (not yet free)."""
        nomination = self.nominations.get(plan.key)
        if nomination is None or not nomination.nodes or plan.topology_key is not None:
            return None  # a gang held to one topology domain is decided by its own rule (topology.py)
        return self._decision_on(plan, nomination.nodes, self._held_against(plan), policy=policy)

    def reserved_decision(self, plan: GangPlan, rid: str, *, policy: str) -> Decision | None:
        """The replacement of a moved pod, on the node its reservation keeps (with the reservation
        lifted for it, every other hold in force), or None when it does not fit there."""
        node = self.reservations[rid].node
        return self._decision_on(
            plan, frozenset({node}), frozenset(self.nominations), policy=policy, lifted=rid
        )

    def _decision_on(
        self, plan: GangPlan, nodes: frozenset[str], held: frozenset[GangKey], *, policy: str,
        lifted: str | None = None,
    ) -> Decision | None:  # fmt: skip
        """The gang allocated on ``nodes`` only, with ``held`` nominations and every reservation but
        ``lifted`` counted as taken; None when it does not fit there: its devices, or its pods'
        CPU, memory and pod slots beside what is bound, placed or held there."""
        others = {str(n["metadata"]["name"]) for n in self.cache.objects(Kind.NODE)} - nodes
        excluded = frozenset(others) | static_exclusions(self.cache, plan)
        with self._holding(held, lifted=lifted):
            chosen = allocate_groups(self.cache, plan.groups, policy=policy, exclude_nodes=excluded)
            if chosen is None:
                return None
            pod_nodes, overflow, _ = node_fit(self.cache, plan, chosen)
        if overflow is not None:
            return None
        return Decision(outcome="allocated", allocations=tuple(chosen), pod_nodes=tuple(pod_nodes))

    def retry_due(self, gang: GangKey) -> bool:
        """The gang backed off after a preemption that did not place it (someone else, kube-scheduler
        for an ungated pod, took what its victims freed), and that backoff has run out: it may try
        again even though neither it nor the capacity changed. Caller holds ``cache.lock``."""
        state = self.backoff.get(gang)
        return state is not None and state.failures > 0 and self.clock() >= state.until

    def retry_in(self, gang: GangKey) -> float | None:
        """Seconds until the gang's backoff runs out, or None when it is not backing off."""
        with self.cache.lock:
            state = self.backoff.get(gang)
            return None if state is None else max(0.0, state.until - self.clock())

    def placed(self, gangs: list[GangKey]) -> None:
        """These gangs were allocated: their nominations, reservations taken and backoff end (one
        lock for the batch)."""
        if not self.nominations and not self.backoff and not self.taken:
            return  # nothing to end: the decider need not wait for the lock
        with self.cache.lock:
            for gang in gangs:
                nomination = self.nominations.pop(gang, None)
                if nomination is not None:
                    log.info("preemptor placed", extra={"gang": gang, "source": nomination.source})
                    if nomination.source == "consolidation" and self.metrics is not None:
                        self.metrics.consolidation_served_wait_seconds.observe(_waited(nomination.created))
                rid = self.taken.pop(gang, None)
                if rid is not None and self.reservations.pop(rid, None) is not None:
                    log.info("replacement placed on its reservation",
                             extra={"gang": gang, "reservation": rid})  # fmt: skip
                    if self.metrics is not None:
                        self.metrics.consolidation_replacements.labels(outcome="reserved").inc()
                self.backoff.pop(gang, None)

    # -- the job of an unschedulable gang (a writer thread) -----------------------------------------

    def _victims_pending(self, nomination: Nomination) -> bool:
        """Victim pods still present, or their claims still allocated."""
        for key in nomination.victim_pods:
            if self.cache.get(Kind.POD, key) is not None:
                return True
        for claim in nomination.victim_claims:
            current = self.cache.get(Kind.CLAIM, str(object_key(claim)))
            same = current is not None and current["metadata"].get("uid") == claim["metadata"].get("uid")
            if same and current is not None and (current.get("status") or {}).get("allocation"):
                return True
        return False

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.preemptions.labels(outcome=outcome).inc()

    def _gang_of(self, pod: Mapping[str, Any]) -> str | None:
        """The running pod's gang as the controller identifies gangs; None for a pod on its own."""
        gang = str(self.cache.gang_key(dict(pod)))
        return None if gang.split("/", 1)[-1].startswith("pod:") else gang

    def _fail(self, gang: GangKey, why: str, *, outcome: str | None = "gave_up") -> None:
        if outcome is not None:
            self._count(outcome)
        with self.cache.lock:
            self.nominations.pop(gang, None)
            state = self.backoff.setdefault(gang, _Backoff())
            delay = min(self.backoff_max_seconds, self.backoff_seconds * (2**state.failures))
            state.failures += 1
            state.until = self.clock() + delay
        log.info("preemption backs off", extra={"gang": gang, "reason": bounded(why), "delay_seconds": delay})

    def preempt(self, plan: GangPlan, *, policy: str, stale: bool = False) -> bool:
        """Try to make room for an unschedulable gang; True while it waits for its victims to go
        (the caller then says nothing more), False when it stays unschedulable. ``stale``: the
        capacity changed after the gang was found unschedulable (the caller decides it again): a
        nomination whose victims are gone meanwhile has not failed yet."""
        gang = plan.key
        with self.cache.lock:
            nomination = self.nominations.get(gang)
            pending = nomination is not None and self._victims_pending(nomination)
            if nomination is not None and (pending or stale) and self.clock() < nomination.deadline:
                return True
            backing_off = self.clock() < self.backoff.get(gang, _Backoff()).until
        if nomination is not None:
            if nomination.source == "consolidation":
                if self.metrics is not None:
                    self.metrics.consolidation_refused.labels(reason="not_placed").inc()
                with self.cache.lock:
                    self.nominations.pop(gang, None)
                if self.consolidation_failed is not None:  # the consolidator backs off, not preemption
                    self.consolidation_failed(gang, "still unschedulable after the pods moved for it left")
            else:
                self._fail(gang, "still unschedulable after its victims were evicted")
            return False
        if not self.search or backing_off or not plan.gated or preemption_refusal(plan.gated) is not None:
            return False
        priority = gang_priority(plan.gated)
        with new_api_client(self.configuration) as api_client:
            try:
                budgets = self.read_budgets(api_client)
            except FractionalError as error:  # cannot tell which victims a budget protects: not now
                self._fail(gang, f"cannot read PodDisruptionBudgets: {bounded(error)}")
                return False
            with self.cache.lock:
                claims = {str(object_key(c)): c for c in self.cache.objects(Kind.CLAIM)}
                units = build_victim_units(
                    self.cache.objects(Kind.POD), claims, below_priority=priority, gang_of=self._gang_of
                )
                choice = None
                if units:
                    holders = device_holders(
                        c for c in claims.values() if (c.get("status") or {}).get("allocation")
                    )
                    with self._holding(self._held_against(plan)):
                        choice = choose_victims(
                            units, fits=self._fit_check(plan, units, policy=policy), budgets=budgets,
                            holders=holders,
                        )  # fmt: skip
                self.last_choice = choice
                if choice is not None:
                    victims = [p for u in choice.victims for p in u.pods]
                    self.nominations[gang] = Nomination(
                        priority=priority,
                        pod_nodes=dict(choice.placement.pod_nodes),
                        allocations=choice.placement.allocations,
                        victim_pods=frozenset(str(object_key(p)) for p in victims),
                        victim_claims=tuple(c for u in choice.victims for c in u.claims),
                        deadline=self.clock() + self.nomination_seconds,
                        room=gang_room(plan, choice.placement.pod_nodes),
                    )
            if choice is None:
                log.info("no preemption helps", extra={"gang": gang, "candidates": len(units)})
                return False
            return self._execute(client.CoreV1Api(api_client), plan, choice, budgets)

    @staticmethod
    def read_budgets(api_client: client.ApiClient) -> list[Budget]:
        """Every PodDisruptionBudget of the cluster, as read now (consolidation reads them too)."""
        with api_errors("list PodDisruptionBudgets"):
            policy: Any = client.PolicyV1Api(api_client)  # Any: raw JSON (_preload_content=False)
            answer = policy.list_pod_disruption_budget_for_all_namespaces(
                _request_timeout=REQUEST_TIMEOUT_SECONDS, _preload_content=False
            )
        return [parse_budget(item) for item in json.loads(answer.data).get("items") or ()]

    def _fit_check(
        self, plan: GangPlan, units: list[VictimUnit], *, policy: str
    ) -> Callable[[frozenset[str]], Placement | None]:
        """The allocator, with the units' claims taken out of the state (restored after each call)
        and their pods' CPU/memory taken off their nodes. Called with ``cache.lock`` held."""
        by_key = {u.key: u for u in units}
        excluded = static_exclusions(self.cache, plan)
        nodes = {str(n["metadata"]["name"]): n for n in self.cache.objects(Kind.NODE)}
        state = self.cache.state

        def fits(removed: frozenset[str]) -> Placement | None:
            released = [c for k in removed for c in by_key[k].claims]
            for claim in released:
                state.remove_claim(_claim_uid(claim))
            try:
                if plan.topology_key is not None:  # the gang's own rule: one topology domain
                    decided = decide_in_domains(self.cache, plan, policy=policy)
                    chosen = list(decided.allocations) if decided.outcome == "allocated" else None
                else:
                    chosen = allocate_groups(self.cache, plan.groups, policy=policy, exclude_nodes=excluded)
            finally:
                for claim in released:  # as the cache holds it now (the lock is held: unchanged)
                    current = self.cache.get(Kind.CLAIM, str(object_key(claim)))
                    state.upsert_claim(current if current is not None else claim)
            if chosen is None:
                return None
            freed: dict[str, Resources] = {}
            for key in removed:
                unit = by_key[key]
                for pod in unit.pods:
                    node = (pod.get("spec") or {}).get("nodeName") or (unit.nodes[0] if unit.nodes else None)
                    if node:
                        freed[node] = freed.get(node, Resources()) + pod_requests(pod)
            by_claim = {str(object_key(c)): a for c, a in chosen}
            usage: dict[str, Resources] = {}
            pod_nodes: list[tuple[str, str | None]] = []
            for group in plan.groups:
                node = group_node(group, by_claim)
                for pod in group.pods:
                    pod_nodes.append((str(object_key(pod)), node))
                    if node is None or node not in nodes:
                        continue
                    if node not in usage:
                        usage[node] = self.cache.node_usage(node) - freed.get(node, Resources())
                    usage[node] = usage[node] + pod_requests(pod)
                    if not Resources().fits_within(node_allocatable(nodes[node]) - usage[node]):
                        return None
            return Placement(allocations=tuple(chosen), pod_nodes=tuple(pod_nodes))

        return fits

    # -- effects --------------------------------------------------------------------------------

    def _execute(self, core: Any, plan: GangPlan, choice: Choice, budgets: list[Budget]) -> bool:
        gang = plan.key
        preemptor = plan.gated[0]
        victims = [p for u in choice.victims for p in u.pods]
        ordered = sorted(victims, key=lambda p: count_violations([p], budgets)[0] == 0)  # budget risks first
        for pod in ordered:  # a dry run of every eviction: one refusal and nothing happens at all
            try:
                self.evict(core, pod, dry_run=True)
            except NotFoundError:
                continue
            except FractionalError as error:
                message = (f"preemption for gang {gang.split('/', 1)[1]} blocked: pod "
                           f"{object_key(pod)} may not be evicted now: {bounded(error)}")  # fmt: skip
                if choice.budgets_exceeded:
                    message += (f"; PodDisruptionBudget(s) {', '.join(choice.budgets_exceeded)} allow no "
                                "disruption and no cheaper choice avoids them")  # fmt: skip
                self._fail(gang, message, outcome="blocked")
                self.emit(core, preemptor, reason=EVENT_REASON_BLOCKED, message=message, event_type="Warning")
                return False
        nodes = dict(choice.placement.pod_nodes)
        self.emit(core, preemptor, reason=EVENT_REASON_PREEMPTING, message=self._describe(plan, choice))
        for pod in plan.gated:
            node = nodes.get(str(object_key(pod)))
            if node:
                self.patch_status(core, pod, {"nominatedNodeName": node}, "nominate")
        preemptor_uid = preemptor["metadata"].get("uid")
        for unit in choice.victims:
            for pod in unit.pods:
                node = (pod.get("spec") or {}).get("nodeName") or (unit.nodes[0] if unit.nodes else "")
                try:
                    condition = build_disruption_condition(preemptor)
                    self.patch_status(core, pod, {"conditions": [condition]}, "mark")
                    self.evict(core, pod, dry_run=False)
                except NotFoundError:
                    continue  # gone already: kube-scheduler counts that as done too
                except FractionalError as error:
                    log.warning("eviction failed", extra={"gang": gang, "pod": str(object_key(pod)),
                                                          "error": bounded(error)})  # fmt: skip
                    continue  # the nomination's deadline ends the wait if this one never goes
                self.evicted += 1
                if self.metrics is not None:
                    self.metrics.preemption_victims.inc()
                message = f"Preempted by pod {preemptor_uid} on node {node}"  # kube-scheduler's words
                self.emit(core, pod, reason=EVENT_REASON_PREEMPTED, message=message, related=preemptor)
        self._count("preempted")
        log.info(
            "preempted",
            extra={"gang": gang, "victims": len(victims),
                   "nodes": ",".join(sorted({n for n in nodes.values() if n})),
                   "budgets_exceeded": ",".join(choice.budgets_exceeded)},
        )  # fmt: skip
        return True

    @staticmethod
    def _describe(plan: GangPlan, choice: Choice) -> str:
        name = plan.key.split("/", 1)[1]
        victims = ", ".join(
            f"{object_key(p)} (priority {pod_priority(p)})" for u in choice.victims for p in u.pods
        )
        placement = ", ".join(
            f"{pod.split('/', 1)[1]} -> {node}" for pod, node in choice.placement.pod_nodes if node
        )
        count = sum(len(u.pods) for u in choice.victims)
        message = (f"Preempting {count} lower-priority pod(s) to place gang {name} "
                   f"(priority {gang_priority(plan.gated)}): {victims}; nominated: {placement}")  # fmt: skip
        if choice.budgets_exceeded:
            message += (f"; could not avoid violating PodDisruptionBudget(s) "
                        f"{', '.join(choice.budgets_exceeded)}")  # fmt: skip
        return message

    def check_fence(self) -> None:
        if self.fence is not None and self.fence.is_set():
            raise HaltWrites()

    def evict(self, core: Any, pod: dict[str, Any], *, dry_run: bool) -> None:
        meta = pod["metadata"]
        body = build_eviction(meta["namespace"], meta["name"], str(meta.get("uid") or ""), dry_run=dry_run)
        self.check_fence()
        with api_errors(f"evict Pod {meta['namespace']}/{meta['name']}"):
            core.create_namespaced_pod_eviction(
                meta["name"], meta["namespace"], body, _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            )  # fmt: skip

    def patch_status(self, core: Any, pod: dict[str, Any], status: dict[str, Any], what: str) -> None:
        meta = pod["metadata"]
        self.check_fence()
        with api_errors(f"{what} Pod {meta['namespace']}/{meta['name']} status"):
            core.patch_namespaced_pod_status(
                meta["name"], meta["namespace"], {"status": status}, _content_type=STRATEGIC_MERGE_PATCH,
                _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS,
            )  # fmt: skip

    def emit(
        self, core: Any, pod: dict[str, Any], *, reason: str, message: str,
        related: dict[str, Any] | None = None, event_type: str = "Normal", action: str = "Preempting",
    ) -> None:  # fmt: skip
        """An Event on ``pod`` (advice: a failed write is logged, never raised)."""
        body = build_preemption_event(pod, reason=reason, message=message, identity=self.identity,
                                      related=related, event_type=event_type)  # fmt: skip
        body["action"] = action
        self.check_fence()
        try:
            with api_errors(f"create Event for Pod {pod['metadata']['namespace']}/{pod['metadata']['name']}"):
                core.create_namespaced_event(
                    pod["metadata"]["namespace"], body, _preload_content=False,
                    _request_timeout=REQUEST_TIMEOUT_SECONDS,
                )  # fmt: skip
        except FractionalError as error:  # an Event is advice: losing one never stops the preemption
            log.warning("event not recorded", extra={"reason": reason, "error": bounded(error)})


def _waited(created: str) -> float:
    """Seconds since ``created`` (an RFC 3339 timestamp), 0 when unreadable."""
    try:
        return max(0.0, time.time() - datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp())
    except ValueError:
        return 0.0


def _claim_uid(claim: dict[str, Any]) -> str:
    meta = claim.get("metadata") or {}
    return str(meta.get("uid") or f"{meta.get('namespace', '')}/{meta.get('name', '')}")

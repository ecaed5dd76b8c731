"""The worker's two jobs: reconcile a gang (allocate, ungate, release a half-done one, explain
why it does not fit) and reconcile one of our claims (release it, notice a vanished allocation).

Runs on the one worker thread. Decisions are made under ``cache.lock`` (no I/O); writes happen
after it is released. Whatever the worker writes it also applies to the cache at once ("assume"),
so the next decision already counts it even before the watch event arrives.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from driver.controller.cache import ClusterCache, Kind
from driver.controller.decide import Decision, decide
from driver.controller.decode import bounded
from driver.controller.events import REASON_FAILED, EventRecorder
from driver.controller.explain import best_node_offer, describe_demand
from driver.controller.gangs import GangPlan, plan_gang
from driver.controller.hints import compute_hint, existing_node_shapes, profile_shapes, render_hint
from driver.controller.kueue import kueue_provisions
from driver.controller.metrics import ControllerMetrics
from driver.controller.objects import (
    HINT_ANNOTATION,
    GangKey,
    has_finalizer,
    is_deleting,
    is_gated,
    object_key,
    pod_requests,
)
from driver.controller.writer import ApiWriter, HaltWrites
from driver.errors import AllocationError, ConflictError, FractionalError, NotFoundError

__all__ = ["Reconciler", "ReconcilerSettings"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReconcilerSettings:
    policy: str = "best-fit"
    hint_profiles: tuple[str, ...] = ()
    provisioning_requests: bool = False
    provisioning_class: str = "best-effort-atomic-scale-up.autoscaling.x-k8s.io"
    topology_label: str = "topology.kubernetes.io/zone"


@dataclass
class _Unfit:
    key: tuple[str, int] = ("", -1)  # (gang signature, capacity generation) last explained
    hint_json: str | None = None


@dataclass
class Reconciler:
    cache: ClusterCache
    writer: ApiWriter
    recorder: EventRecorder
    metrics: ControllerMetrics
    settings: ReconcilerSettings
    capacity_generation: Callable[[], int]
    capacity_freed: Callable[[], None] = lambda: None  # requeues the gangs waiting for room
    gate_seen: dict[str, float] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    unschedulable: set[GangKey] = field(default_factory=set)
    _unfit: dict[GangKey, _Unfit] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- gangs ----------------------------------------------------------------------------------------

    def reconcile_gang(self, gang: GangKey) -> bool:
        """Returns True when the gang must be looked at again right away."""
        started = time.monotonic()
        generation = self.capacity_generation()  # before deciding: a later change re-queues us
        with self.cache.lock:
            plan = plan_gang(self.cache, gang)
            decision = None
            failure: AllocationError | None = None
            unfit = self._unfit.get(gang)
            if plan.action == "allocate" and unfit and unfit.key == (plan.signature, generation):
                return False  # did not fit, and neither the gang nor the capacity changed since
            if plan.action == "allocate":
                try:
                    decision = decide(self.cache, plan, policy=self.settings.policy)
                except AllocationError as error:
                    failure = error
        if failure is not None:  # the Event is an API call: never made under cache.lock
            self._mark_unschedulable(gang, fit=False)
            self.metrics.decisions.labels(outcome="error").inc()
            if plan.gated:
                self.recorder.gang_unschedulable(gang, plan.gated[0], f"cannot allocate: {bounded(failure)}",
                                                 reason=REASON_FAILED)  # fmt: skip
            return False
        if plan.invalid:
            self._report_invalid(plan)
        if plan.action == "idle":
            self._mark_unschedulable(gang, fit=True)
            self.recorder.forget(gang)
            self._unfit.pop(gang, None)
            return False
        if plan.action == "wait":
            log.debug("gang waiting", extra={"gang": gang, "reason": bounded(plan.reason)})
            self.metrics.decisions.labels(outcome="waiting").inc()
            return False
        if plan.action == "release":
            self._release_half_done(plan)
            return True
        if plan.action == "ungate":
            self._ungate(plan, {})
            self.metrics.decisions.labels(outcome="ungated").inc()
            return False
        assert decision is not None
        if decision.outcome == "allocated":
            self._commit(plan, decision)
            self._mark_unschedulable(gang, fit=True)
            self.metrics.decisions.labels(outcome="allocated").inc()
            self.metrics.decision_seconds.observe(time.monotonic() - started)
            return False
        self._mark_unschedulable(gang, fit=False)
        self.metrics.decisions.labels(outcome="unschedulable").inc()
        self._explain(plan, decision, generation)
        return False

    def _mark_unschedulable(self, gang: GangKey, *, fit: bool) -> None:
        with self._lock:
            if fit:
                self.unschedulable.discard(gang)
            else:
                self.unschedulable.add(gang)

    def unschedulable_gangs(self) -> list[GangKey]:
        with self._lock:
            return list(self.unschedulable)

    def _assume(self, claim: dict[str, Any], event_type: str = "MODIFIED") -> None:
        """Apply what we wrote (or just read) to the cache; when that frees devices, say so: the
        watch event of our own write then changes nothing, so nobody else would."""
        before = self.cache.get(Kind.CLAIM, str(object_key(claim)))
        applied, _ = self.cache.apply(Kind.CLAIM, event_type, claim)
        freed = event_type == "DELETED" or not (claim.get("status") or {}).get("allocation")
        if applied and before is not None and (before.get("status") or {}).get("allocation") and freed:
            self.capacity_freed()

    def _report_invalid(self, plan: GangPlan) -> None:
        """An Event on each object rejected when read, and one on the gang's first pod."""
        for kind, obj, reason in plan.invalid:
            self.recorder.object_rejected(kind.value, obj, reason)
        first_kind, first_obj, first_reason = plan.invalid[0]
        name = str(object_key(first_obj))
        what = "ResourceClaim" if first_kind is Kind.CLAIM else "Pod"
        self.recorder.gang_unschedulable(
            plan.key, plan.gated[0], f"cannot allocate: {what} {name}: {first_reason}", reason=REASON_FAILED
        )
        self._mark_unschedulable(plan.key, fit=False)

    def _commit(self, plan: GangPlan, decision: Decision) -> None:
        """Finalizers, then allocations, then gates; on a failed claim write undo what we wrote."""
        written: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (claim before, claim as stored now)
        try:
            for claim, allocation in decision.allocations:
                with_finalizer = self.writer.add_finalizer(claim)
                written.append((claim, with_finalizer))
                self._assume(with_finalizer)
                allocated = self.writer.write_allocation(with_finalizer, allocation)
                written[-1] = (claim, allocated)
                self._assume(allocated)
        except HaltWrites:
            raise
        except FractionalError as error:
            log.warning("gang write failed, undoing", extra={"gang": plan.key, "error": bounded(error)})
            self._undo(written)
            if isinstance(error, ConflictError | NotFoundError):
                self._refresh_claims([c for c, _ in decision.allocations])
            raise
        gone = [str(object_key(c)) for _, c in written if self._deleted_meanwhile(Kind.CLAIM, c)]
        gone += [str(object_key(p)) for p in plan.gated if self._deleted_meanwhile(Kind.POD, p)]
        if gone:  # deleted while we placed the gang: it cannot complete, so nothing is ungated
            log.info("deleted during placement, undoing", extra={"gang": plan.key, "object": gone[0]})
            self._undo(written)
            return
        nodes = {str(object_key(p)): node for p, node in decision.pod_nodes}
        self._ungate(plan, nodes)

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

    def _undo(self, written: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
        for _before, stored in reversed(written):
            current = stored
            for _attempt in range(3):
                try:
                    if (current.get("status") or {}).get("allocation"):
                        if (current.get("status") or {}).get("reservedFor"):
                            break  # someone already uses it: leave it
                        current = self.writer.clear_allocation(current)
                        self._assume(current)
                    current = self.writer.remove_finalizer(current)
                    self._assume(current)
                    break
                except ConflictError:
                    meta = current["metadata"]
                    current = self.writer.read_claim(meta["namespace"], meta["name"])
                    self._assume(current)
                except NotFoundError:
                    break

    def _refresh_claims(self, claims: list[dict[str, Any]]) -> None:
        """After a 409, read the claims so the next decision starts from the server's truth."""
        for claim in claims:
            meta = claim["metadata"]
            try:
                self._assume(self.writer.read_claim(meta["namespace"], meta["name"]))
            except NotFoundError:
                self._assume(claim, "DELETED")

    def _ungate(self, plan: GangPlan, nodes: dict[str, str | None]) -> None:
        for pod in plan.gated:
            key = str(object_key(pod))
            current = pod
            for _attempt in range(3):
                try:
                    stored = self.writer.ungate_pod(current)
                    break
                except ConflictError:
                    meta = current["metadata"]
                    current = self.writer.read_pod(meta["namespace"], meta["name"])
                    if not is_gated(current):
                        stored = current
                        break
            else:
                raise ConflictError(f"Pod {key}: scheduling gate: kept changing while being removed")
            self.cache.apply(Kind.POD, "MODIFIED", stored)
            node = nodes.get(key)
            if node:
                self.cache.assume_placement(key, node, pod_requests(pod))
            seen = self.gate_seen.pop(key, None)
            if seen is not None:
                latency = time.monotonic() - seen
                self.latencies.append(latency)
                self.metrics.ungate_seconds.observe(latency)
            if (pod["metadata"].get("annotations") or {}).get(HINT_ANNOTATION):
                self.writer.annotate_pod(stored, {HINT_ANNOTATION: None})
        self.recorder.forget(plan.key)
        self._unfit.pop(plan.key, None)
        log.info("gang allocated", extra={"gang": plan.key, "pods": len(plan.gated)})

    def _release_half_done(self, plan: GangPlan) -> None:
        log.warning("releasing a half-allocated gang", extra={"gang": plan.key, "claims": len(plan.release)})
        for claim in plan.release:
            self._release(claim)
        self.metrics.decisions.labels(outcome="released").inc()

    # -- explaining a gang that does not fit -----------------------------------------------------

    def _explain(self, plan: GangPlan, decision: Decision, generation: int) -> None:
        state = self._unfit.setdefault(plan.key, _Unfit())
        key = (plan.signature, generation)
        if state.key == key:
            return  # nothing changed since we last said why
        with self.cache.lock:
            claims = [c for g in plan.groups for c in g.pending_claims]
            pod_groups, start = [], 0
            for group in plan.groups:
                pod_groups.append(list(range(start, start + len(group.pending_claims))))
                start += len(group.pending_claims)
            pod_groups = [g for g in pod_groups if g]
            nodes = self.cache.objects(Kind.NODE)
            node_names = [str(n["metadata"]["name"]) for n in nodes]
            offer = best_node_offer(self.cache.state, plan.groups, node_names, policy=self.settings.policy)
            slices = self.cache.objects(Kind.SLICE)
            classes = self.cache.objects(Kind.CLASS)
            allocated = [
                c for c in self.cache.objects(Kind.CLAIM) if (c.get("status") or {}).get("allocation")
            ]
        name = plan.key.split("/", 1)[1]
        message = f"gang {name} ({len(plan.gated)} pods) needs {describe_demand(claims)}; "
        message += (
            f"best node {offer.node} offers room for {offer.pods} of {len(plan.gated)} pods "
            f"({offer.shares} devices)"
            if offer and offer.shares
            else "no node offers any"
        )
        if "CPU/memory" in decision.reason or "room for the pods" in decision.reason:
            message += f"; {decision.reason}"
        shapes = profile_shapes(self.settings.hint_profiles) + existing_node_shapes(slices, nodes)
        hint = compute_hint(
            claims, pod_groups=pod_groups, shapes=shapes, cluster_slices=slices, classes=classes,
            allocated_claims=allocated, nodes=nodes, policy=self.settings.policy,
            topology_label=self.settings.topology_label,
        )  # fmt: skip
        hint_json = render_hint(hint) if hint else None
        message += (
            f"; scale-up hint: {hint.nodes} x {hint.profile}" if hint else "; no known node shape fits it"
        )
        self.recorder.gang_unschedulable(plan.key, plan.gated[0], message)
        provisioning = None
        if hint is not None and self.settings.provisioning_requests and not kueue_provisions(plan.gated):
            request = self.recorder.publish_provisioning_request(
                plan.key, list(plan.gated), self.settings.provisioning_class
            )
            provisioning = (request, self.settings.provisioning_class)
        if hint_json != state.hint_json or provisioning is not None:
            for pod in plan.gated:
                annotations = pod["metadata"].get("annotations") or {}
                if annotations.get(HINT_ANNOTATION) != hint_json or provisioning is not None:
                    wanted = EventRecorder.hint_annotations(hint_json, provisioning)
                    self.cache.apply(Kind.POD, "MODIFIED", self.writer.annotate_pod(pod, wanted))
        state.key, state.hint_json = key, hint_json

    # -- claims ---------------------------------------------------------------------------------------

    def _release(self, claim: dict[str, Any]) -> None:
        current = claim
        if (current.get("status") or {}).get("allocation"):
            current = self.writer.clear_allocation(current)
            self._assume(current)
            self.metrics.released.inc()
        if has_finalizer(current):
            current = self.writer.remove_finalizer(current)
            self._assume(current)

    def reconcile_claim(self, key: str) -> None:
        claim = self.cache.get(Kind.CLAIM, key)
        if claim is None or not has_finalizer(claim):
            return
        if (reason := self.cache.rejection(Kind.CLAIM, key)) is not None:
            # As read it was cut (too deep): writing it back would write the cut version. Say so once.
            self.recorder.object_rejected(Kind.CLAIM.value, claim, reason)
            return
        status = claim.get("status") or {}
        users = self.cache.claim_users(key)
        if is_deleting(claim) or (status.get("allocation") and not users):
            if status.get("reservedFor"):
                return  # in use: the scheduler / claim controller must unreserve it first
            if any((u.get("spec") or {}).get("nodeName") for u in users):
                return  # a bound pod runs with it (reservedFor may lag): release when the pod ends
            log.info("releasing claim", extra={"claim": key, "deleting": is_deleting(claim)})
            self._release(claim)
            return
        if status.get("allocation"):
            return
        running = [u for u in users if not is_gated(u)]
        if running:  # our allocation was cleared after the pod left our hands: kube-scheduler's PostFilter
            self.metrics.vanished.inc()
            log.warning(
                "allocation vanished",
                extra={"claim": key, "pod": ", ".join(sorted(str(object_key(u)) for u in running))},
            )
        self._release(claim)  # drop the finalizer (a crash leftover when no pod ran)

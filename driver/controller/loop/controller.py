"""The allocation controller: five watchers fill the cache and enqueue keys; ONE decider thread
takes the keys due (up to ``BATCH_KEYS`` at once, so a burst is decided together) and decides them
(``reconcile.py``); a bounded pool of writer threads makes the writes (``pipeline.py``).

Keys are ``gang:<namespace>/<gang>``, ``claim:<namespace>/<name>`` and ``refused:<namespace>/<name>``
(a claim whose share a node refused at prepare: its pods are replaced), and ``overcommits:`` (the
overcommitted devices the metrics refresh found, reported by the decider). A gang that did not fit is
queued again when capacity may have grown (a slice, node or class changed, a claim lost its
allocation or went away) and on the periodic resync.

The metrics computed from the whole view (capacity, fragmentation, pending gangs) are refreshed on a
thread of their own (``metrics-refresh``), which holds ``cache.lock`` only to copy what it reads: on
40,000 GPUs a refresh takes most of a second, and no decision waits behind it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from functools import partial
from typing import Any

from kubernetes import client

from driver.controller.consolidation.consolidator import Consolidator, in_window, stranded_ratio
from driver.controller.diagnosis.explain import share_memory_requests
from driver.controller.gangs.watch import GangWatches
from driver.controller.guard.review import AllocationGuard
from driver.controller.loop.provisioning import PROVISIONING_REQUESTS, Provisioner, gang_of_request
from driver.controller.loop.reconcile import (
    CLAIM_PREFIX,
    GANG_PREFIX,
    REFUSED_PREFIX,
    Reconciler,
    ReconcilerSettings,
)
from driver.controller.loop.workqueue import WorkQueue
from driver.controller.metrics import ControllerMetrics
from driver.controller.model.decode import bounded
from driver.controller.model.gang_identity import GangSource
from driver.controller.model.objects import (
    GangKey,
    is_gated,
    is_ours,
    is_terminated,
    object_key,
    placed_by_us,
    pod_claim_refs,
)
from driver.controller.preemption.holds import (
    HOLDS_ANNOTATION,
    MAX_HOLDS_BYTES,
    HoldsError,
    decode_holds,
    encode_holds,
    restore_holds,
    take_holds,
)
from driver.controller.preemption.preemptor import Preemptor
from driver.controller.preemption.refusal import RefusedShares, parse_share_refusals
from driver.controller.sizing.overcommit import Overcommit, compute_overcommits
from driver.controller.view.cache import ClusterCache, Kind
from driver.controller.view.watch import Watcher
from driver.controller.writes.events import EventRecorder
from driver.controller.writes.pipeline import Job, WritePool, Writers
from driver.controller.writes.writer import ApiWriter, HaltWrites, WriteHook
from driver.errors import FractionalError, NotFoundError
from driver.kube import REQUEST_TIMEOUT_SECONDS, api_errors, new_api_client
from driver.kube.client import get_json

__all__ = ["Controller"]

log = logging.getLogger(__name__)

BATCH_KEYS = 64  # keys decided in one pass when that many are due (a burst)
GUARD_READ_TIMEOUT_SECONDS = 1.0  # a claim the guard reads before refusing (kube-apiserver waits for it)
METRICS_COST_RATIO = 50  # the metrics refresh waits at least 50x as long as it last took
OVERCOMMITS_KEY = "overcommits:"  # the decider reports what the last metrics refresh found
DEFRAGMENT_KEY = "defragment:"  # the scheduled consolidation pass is due (a metrics refresh found it)
WATCH_ORDER = (Kind.CLASS, Kind.NODE, Kind.SLICE, Kind.CLAIM, Kind.POD)  # pods last: they reference the rest


def _node_view(node: dict[str, Any] | None) -> Any:
    if node is None:
        return None
    return (node["metadata"].get("labels"), node.get("spec"), (node.get("status") or {}).get("allocatable"))


def _node_name(pod: dict[str, Any]) -> str | None:
    return (pod.get("spec") or {}).get("nodeName")


class _InlineWriters:
    """``write_workers=0``: each job runs on the decider thread itself, as before the pipeline
    (kept as the baseline the bench compares against)."""

    def __init__(self, configuration: client.Configuration, identity: str, fence: threading.Event,
                 hook: WriteHook | None, on_halt: Callable[[], None]) -> None:  # fmt: skip
        self._api_client = new_api_client(configuration)
        self._writers = Writers(
            writer=ApiWriter(self._api_client, hook=hook, fence=fence),
            recorder=EventRecorder(self._api_client, identity=identity, fence=fence),
        )
        self._on_halt = on_halt

    def run(self, job: Job) -> bool:
        try:
            job(self._writers)
        except HaltWrites:
            self._on_halt()
        except Exception:  # a bug in a job: logged once, as a writer thread would
            log.exception("write job failed")
        return True

    def close(self) -> None:
        self._writers.writer.close()
        self._api_client.close()  # type: ignore[no-untyped-call]


HOLDS_LOCK_WAIT_SECONDS = 0.5  # a renewal waits at most this for the holds (its deadline is seconds)


class Controller:
    def __init__(
        self,
        *,
        configuration: client.Configuration,
        settings: ReconcilerSettings,
        identity: str = "",
        metrics: ControllerMetrics | None = None,
        write_hook: WriteHook | None = None,
        watch_timeout_seconds: int = 60,
        resync_seconds: float = 30.0,
        metrics_refresh_seconds: float = 2.0,
        write_workers: int = 32,  # a pod takes three writes in a row: 32 keep up when each takes 10 ms
        write_queue: int = 64,
        batch_keys: int = BATCH_KEYS,
        gang_sources: frozenset[GangSource] | None = None,
        guard: bool = False,
        hold_decisions: bool = False,
        inherited_holds: str = "",
    ) -> None:
        """``guard``: also answer the allocation guard's reviews (``self.guard``; run.py serves it).
        ``hold_decisions``: decide nothing until ``allow_decisions()`` (the guard must be reachable
        first, see run.py). ``inherited_holds``: the holds the last leader published with its Lease,
        taken over before the first decision (``holds_snapshot`` is what this one publishes)."""
        self._configuration = configuration
        self.settings = settings
        self.identity = identity
        self.metrics = metrics or ControllerMetrics()
        self._write_hook = write_hook
        self._watch_timeout_seconds = watch_timeout_seconds
        self._resync_seconds = resync_seconds
        self._metrics_refresh_seconds = metrics_refresh_seconds
        self.stop_event = threading.Event()
        self.cache = ClusterCache(topology_label=settings.topology_label)
        self.cache.learn_workload = settings.policy == "fragmentation"
        self.queue = WorkQueue()
        self._generation_lock = threading.Lock()
        self._capacity_generation = 0
        self._gate_seen: dict[str, float] = {}
        if gang_sources is not None:
            self.cache.gang_sources = gang_sources
        self.gang_watches = GangWatches(
            configuration=configuration, cache=self.cache, metrics=self.metrics,
            enqueue_gang=lambda gang: self.queue.add(GANG_PREFIX + gang), sources=gang_sources,
            stop=self.stop_event, watch_timeout_seconds=watch_timeout_seconds,
        )  # fmt: skip
        self.watchers = [
            Watcher(
                kind=kind,
                configuration=configuration,
                cache=self.cache,
                on_event=self._on_event,
                stop=self.stop_event,
                watch_timeout_seconds=watch_timeout_seconds,
            )
            for kind in WATCH_ORDER
        ]
        if settings.provisioning_requests:  # our own requests' conditions (served: checked at start)
            self.watchers.append(
                Watcher(
                    kind=Kind.PROVISIONING_REQUEST,
                    configuration=configuration,
                    cache=self.cache,
                    on_event=self._on_event,
                    stop=self.stop_event,
                    watch_timeout_seconds=watch_timeout_seconds,
                    resource=PROVISIONING_REQUESTS,
                )
            )
        self._worker = threading.Thread(target=self._run_worker, name="allocation-worker", daemon=True)
        # Started by the decider once it decides (a synced view), stopped with it (_decider_stop).
        self._metrics_thread = threading.Thread(target=self._run_metrics, name="metrics-refresh", daemon=True)
        self._refresh_lock = threading.Lock()  # one refresh at a time, whichever thread calls it
        self._overcommits_lock = threading.Lock()
        self._overcommits_handed: tuple[Overcommit, ...] | None = None  # the last found (metrics thread)
        self._defragment_due = 0.0  # monotonic time the scheduled consolidation may run again
        self._overcommits_due: tuple[Overcommit, ...] | None = None  # found, not yet reported (decider)
        self.reconciler: Reconciler | None = None
        self._inherited_holds = inherited_holds
        self._holds_taken_over = False
        self._holds_too_large = 0  # the size last said too large, to say it once per size
        self.halted = threading.Event()
        self.fence = threading.Event()  # set when this replica may no longer write (leadership lost)
        self._decider_stop = threading.Event()  # the stop event, or a halt
        self._write_workers = write_workers  # 0: the decider writes itself (the old sequential path)
        self._batch_keys = batch_keys
        self._write_queue = write_queue
        self.pool: WritePool | None = None
        self._decisions_allowed = threading.Event()
        if not hold_decisions:
            self._decisions_allowed.set()
        self._guard_api: client.ApiClient | None = None
        self.guard: AllocationGuard | None = None
        if guard:
            self._guard_api = new_api_client(configuration)
            self.guard = AllocationGuard(
                cache=self.cache, metrics=self.metrics, read_claim=self._read_claim, holds=self._held_against
            )

    # -- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        self.gang_watches.refresh()  # which Workload/PodGroup version is served, before the pods
        if self.settings.provisioning_requests and not self._provisioning_requests_served():
            self.watchers = [w for w in self.watchers if w.kind is not Kind.PROVISIONING_REQUEST]
        for watcher in self.watchers:
            watcher.start()
        self._worker.start()

    def wait_synced(self, timeout_seconds: float) -> bool:
        deadline = time.monotonic() + timeout_seconds
        return all(w.synced.wait(max(0.0, deadline - time.monotonic())) for w in self.watchers)

    def stop_deciding(self, timeout_seconds: float = 10.0) -> None:
        """Decide nothing more and let the writes in flight finish (the decider's pass ends, its write
        pool drains), keeping the watches: the first step of a clean stop, so that a replica told to
        stop places no pod after that and the allocation guard still answers from a current view
        until it is closed. ``stop`` follows."""
        self._decider_stop.set()
        self.queue.shut_down()
        deadline = time.monotonic() + timeout_seconds
        for thread in (self._worker, self._metrics_thread):
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))

    def stop(self, timeout_seconds: float = 10.0) -> None:
        self.stop_event.set()
        self._decider_stop.set()
        self.queue.shut_down()
        self.gang_watches.stop()
        for watcher in self.watchers:
            watcher.interrupt()
        deadline = time.monotonic() + timeout_seconds
        for thread in [*self.watchers, self._worker, self._metrics_thread]:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
        if self.guard is not None:
            self.guard.close()
        if self._guard_api is not None:
            self._guard_api.close()  # type: ignore[no-untyped-call]

    def _provisioning_requests_served(self) -> bool:
        """--provisioning-requests needs cluster-autoscaler's CRD: without it we make none (said once),
        rather than wait for a watch that cannot sync."""
        api_client = new_api_client(self._configuration)
        group, version, plural = PROVISIONING_REQUESTS
        try:
            with api_errors(f"discover {group}/{version}"):
                listed = client.CustomObjectsApi(api_client).get_api_resources(
                    group, version, _request_timeout=REQUEST_TIMEOUT_SECONDS
                )
            served = any(r.name == plural for r in listed.resources or ())
        except NotFoundError:
            served = False
        except FractionalError as error:  # the server is away: the watch will wait for it
            log.warning("provisioning requests discovery failed", extra={"error": bounded(error)})
            served = True
        finally:
            api_client.close()  # type: ignore[no-untyped-call]
        if not served:
            log.error(
                "--provisioning-requests: autoscaling.x-k8s.io/v1 provisioningrequests is not served "
                "(cluster-autoscaler's CRD is not installed); no ProvisioningRequest will be made"
            )
            self.settings = replace(self.settings, provisioning_requests=False)
        return served

    def _held_against(self, priority: int) -> AbstractContextManager[None]:
        """The guard's view of the preemptor's nominations (the reconciler owns the preemptor)."""
        preemptor = self.reconciler.preemptor if self.reconciler is not None else None
        return preemptor.holding_against(priority) if preemptor is not None else contextlib.nullcontext()

    def allow_decisions(self) -> None:
        self._decisions_allowed.set()

    def _read_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The claim as the API holds it now (the guard, before it refuses); None: gone."""
        assert self._guard_api is not None
        try:
            return get_json(
                self._guard_api, f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}",
                what=f"read ResourceClaim {namespace}/{name}", timeout_seconds=GUARD_READ_TIMEOUT_SECONDS,
            )  # fmt: skip
        except NotFoundError:
            return None

    def healthy(self) -> bool:
        pool_alive = self.pool is None or self.pool.alive() or self.halted.is_set()
        return self._worker.is_alive() and pool_alive and all(w.is_alive() for w in self.watchers)

    @property
    def latencies(self) -> list[float]:
        return self.reconciler.latencies if self.reconciler else []

    # -- watch events (watcher threads: cheap, no API calls) ----------------------------------------------

    def _bump_capacity(self) -> None:
        with self._generation_lock:
            self._capacity_generation += 1
        if self.reconciler is not None:
            for gang in self.reconciler.unschedulable_gangs():
                self.queue.add(GANG_PREFIX + gang)

    def capacity_generation(self) -> int:
        with self._generation_lock:
            return self._capacity_generation

    def _on_event(self, kind: Kind, event_type: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        if kind is Kind.POD:
            self._on_pod(event_type, obj, old)
        elif kind is Kind.CLAIM:
            self._on_claim(event_type, obj, old)
        elif kind is Kind.PROVISIONING_REQUEST:
            gang = gang_of_request(obj)
            if gang is not None and self.reconciler is not None:
                self.reconciler.provisioning_changed(gang)
        elif kind is Kind.NODE:
            if event_type == "DELETED" or _node_view(obj) != _node_view(old):
                self._bump_capacity()
        else:  # slices and classes
            self._bump_capacity()

    def _on_pod(self, event_type: str, pod: dict[str, Any], old: dict[str, Any] | None) -> None:
        key = str(object_key(pod))
        gone = event_type == "DELETED" or is_terminated(pod)
        if is_gated(pod) and not gone:
            self._gate_seen.setdefault(key, time.monotonic())
            self.queue.add(GANG_PREFIX + self.cache.gang_key(pod))
        elif old is not None and is_gated(old):
            self.queue.add(GANG_PREFIX + self.cache.gang_key(old))
        if gone:
            self._gate_seen.pop(key, None)
            namespace = pod["metadata"].get("namespace")
            for ref in pod_claim_refs(pod):
                if ref.claim_name:
                    self.queue.add(f"{CLAIM_PREFIX}{namespace}/{ref.claim_name}")
            if (pod.get("spec") or {}).get("nodeName") or (old and (old.get("spec") or {}).get("nodeName")):
                self._bump_capacity()  # CPU/memory freed on a node
        elif _node_name(pod) and not (old and _node_name(old)):
            self._check_refused(pod)  # just bound: its claim's refusal may have been seen before it

    def _check_refused(self, pod: dict[str, Any]) -> None:
        namespace = pod["metadata"].get("namespace")
        for ref in pod_claim_refs(pod):
            key = f"{namespace}/{ref.claim_name}"
            claim = self.cache.get(Kind.CLAIM, key) if ref.claim_name else None
            if claim is not None and parse_share_refusals(claim):
                self.queue.add(REFUSED_PREFIX + key)

    def _on_claim(self, event_type: str, claim: dict[str, Any], old: dict[str, Any] | None) -> None:
        key = str(object_key(claim))
        if event_type != "DELETED" and parse_share_refusals(claim):
            self.queue.add(REFUSED_PREFIX + key)  # a node refused its share: replace its pods
        ours = is_ours(claim) or (old is not None and is_ours(old))
        if ours:
            self.queue.add(CLAIM_PREFIX + key)
        was_allocated = old is not None and bool((old.get("status") or {}).get("allocation"))
        is_allocated = event_type != "DELETED" and bool((claim.get("status") or {}).get("allocation"))
        if was_allocated and not is_allocated:
            self._bump_capacity()
        # A new claim (one made from a template) or one that lost its allocation may complete a
        # gang; our own allocation writes need no second look.
        if event_type == "ADDED" or (was_allocated and not is_allocated):
            for user in self.cache.claim_users(key):
                if is_gated(user):
                    self.queue.add(GANG_PREFIX + self.cache.gang_key(user))

    # -- the worker -----------------------------------------------------------------------------------

    def _resync(self) -> None:
        self.gang_watches.refresh()  # the served gang API may change (an upgrade, a CRD installed)
        for gang in self.cache.gated_gangs():
            self.queue.add(GANG_PREFIX + gang)
        for claim in self.cache.objects(Kind.CLAIM):
            if is_ours(claim):
                self.queue.add(CLAIM_PREFIX + str(object_key(claim)))
            if parse_share_refusals(claim):
                self.queue.add(REFUSED_PREFIX + str(object_key(claim)))
        for pod in self.cache.objects(Kind.POD):  # placed by us, not bound: was its allocation cleared?
            if placed_by_us(pod) and not is_gated(pod) and not (pod.get("spec") or {}).get("nodeName"):
                namespace = pod["metadata"].get("namespace")
                for ref in pod_claim_refs(pod):
                    if ref.claim_name:
                        self.queue.add(f"{CLAIM_PREFIX}{namespace}/{ref.claim_name}")

    def refresh_metrics(self) -> None:
        """Export the gauges computed from the whole view and hand the overcommitted devices found to
        the decider. Any thread may call it (the metrics thread does, see ``_run_metrics``).

        ``cache.lock`` is held only to copy what is read (about 5 ms on 40,000 GPUs with 2,000 pods
        waiting): the allocator's free capacity as a ``FreeSnapshot``, the lists of slices, claims
        and the gated gangs' pods. Everything per GPU, per claim or per pod (the summary,
        overcommits, fragmentation, capacity, the pending claims; most of a second there) runs
        without it: the watchers and the decider replace the cache's objects, never change them in
        place, and the snapshot holds its own copy of the allocator's ledger."""
        with self._refresh_lock:  # the gauges, the gang wait clock and the workload version agree
            with self.cache.lock:
                free = self.cache.state.free_snapshot()
                gangs = self.cache.gated_gangs()
                gang_pods = [pod for gang in gangs for pod in self.cache.gang_pods(gang)]
                slices = self.cache.objects(Kind.SLICE)
                claims = self.cache.objects(Kind.CLAIM)
                workload = self.cache.state.workload
                typical_version, typical = workload.version, workload.typical()
            self._hand_over_overcommits(compute_overcommits(slices, claims))
            pending_claims = self._pending_claims(gang_pods)
            summary = free.summary()
            self.metrics.gangs_pending.set(len(gangs))
            self.metrics.observe_capacity(summary, share_memory_requests(pending_claims))
            self.metrics.observe_fragmentation(summary, slices, [str(g) for g in gangs], now=time.monotonic())
            self._schedule_defragment(summary)
            self.metrics.observe_typical_workload(typical_version, typical)

    def _schedule_defragment(self, summary: dict[str, dict[str, dict[str, Any]]]) -> None:
        """Queue the scheduled consolidation pass when it is on, due, within its window and the
        stranded share of GPU memory reached its threshold."""
        settings = self.settings.consolidation
        if settings is None or not settings.schedule.enabled:
            return
        schedule = settings.schedule
        now = time.monotonic()
        if now < self._defragment_due:
            return
        minute = int(time.time() // 60) % (24 * 60)
        if not in_window(schedule.window, minute):
            return
        ratio = stranded_ratio(summary)
        if ratio < schedule.stranded_ratio:
            return
        self._defragment_due = now + schedule.interval_seconds
        log.info("scheduled consolidation due", extra={"stranded_ratio": round(ratio, 3)})
        self.queue.add(DEFRAGMENT_KEY)

    def _pending_claims(self, pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The unallocated claims of ``pods`` as the cache holds them now (each read takes the lock
        on its own: the pending claims need not agree with one another)."""
        pending = []
        for pod in pods:
            namespace = pod["metadata"]["namespace"]
            for ref in pod_claim_refs(pod):
                claim = (
                    self.cache.get(Kind.CLAIM, f"{namespace}/{ref.claim_name}") if ref.claim_name else None
                )
                if claim is not None and not (claim.get("status") or {}).get("allocation"):
                    pending.append(claim)
        return pending

    def _hand_over_overcommits(self, found: tuple[Overcommit, ...]) -> None:
        """Queue a report of ``found`` when it changed: ``report_overcommits`` keeps the reconciler's
        memory of what was said and starts Event writes, which only the decider does."""
        with self._overcommits_lock:
            if found == self._overcommits_handed:
                return
            self._overcommits_handed = self._overcommits_due = found
        self.queue.add(OVERCOMMITS_KEY)

    def _report_overcommits(self) -> None:
        """The decider's half of ``_hand_over_overcommits``: report the latest found."""
        assert self.reconciler is not None
        with self._overcommits_lock:
            found = self._overcommits_due
        if found is None:
            return
        self.reconciler.report_overcommits(found)
        with self._overcommits_lock:
            if self._overcommits_due is found:  # else a newer one is due, and queued
                self._overcommits_due = None

    def _run_metrics(self) -> None:
        """Refresh the metrics every ``metrics_refresh_seconds``, and at least ``METRICS_COST_RATIO``
        times as long as the last refresh took (a bounded share of the CPU: on a big cluster with a
        deep backlog one takes most of a second), until the decider stops."""
        while not self._decider_stop.is_set():
            started = time.monotonic()
            try:
                self.refresh_metrics()
            except Exception:  # a bug: logged once per refresh with its traceback; decisions go on
                log.exception("metrics refresh failed")
            spent = time.monotonic() - started
            self._decider_stop.wait(max(self._metrics_refresh_seconds, METRICS_COST_RATIO * spent))

    def _take_over_holds(self) -> None:
        """The view complete, before the first decision: the last leader's holds."""
        reconciler, text, self._inherited_holds = self.reconciler, self._inherited_holds, ""
        try:
            if not text or reconciler is None or reconciler.preemptor is None:
                return
            preemptor, consolidator = reconciler.preemptor, reconciler.consolidator
            try:
                holds = decode_holds(text, wall=time.time(), monotonic=preemptor.clock())
            except HoldsError as error:
                log.warning("holds not taken over", extra={"error": bounded(error)})
                return
            with self.cache.lock:
                moved_at = consolidator.moved_at if consolidator is not None else {}
                nominations, reservations = restore_holds(preemptor, moved_at, holds)
            log.info("holds taken over", extra={
                "nominations": nominations, "reservations": reservations, "moves": len(holds.moved_at),
            })  # fmt: skip
        finally:
            self._holds_taken_over = True

    def holds_snapshot(self) -> dict[str, str | None]:
        """The Lease annotation run.py publishes with each renewal: the holds as text; "" (removed)
        when there are none or they are too large to keep; None (left as the last leader wrote it)
        until they were taken over."""
        reconciler = self.reconciler
        if not self._holds_taken_over:
            return {HOLDS_ANNOTATION: None}
        if reconciler is None or reconciler.preemptor is None:
            return {HOLDS_ANNOTATION: ""}
        preemptor, consolidator = reconciler.preemptor, reconciler.consolidator
        wall = time.time()
        moved_at, cooldown = (
            (consolidator.moved_at, consolidator.settings.rules.cooldown_seconds)
            if consolidator is not None
            else ({}, 0.0)
        )
        # On the elector's thread, before a renewal: never wait long behind a decision pass.
        if not self.cache.lock.acquire(timeout=HOLDS_LOCK_WAIT_SECONDS):
            return {HOLDS_ANNOTATION: None}  # published with a later renewal
        try:
            holds = take_holds(preemptor, moved_at, cooldown_seconds=cooldown, wall=wall)
            text = encode_holds(holds, wall=wall, monotonic=preemptor.clock())
        finally:
            self.cache.lock.release()
        if len(text) > MAX_HOLDS_BYTES:
            if self._holds_too_large != len(text):
                self._holds_too_large = len(text)
                log.warning("holds too large to keep with the lease: a new leader starts without them",
                            extra={"bytes": len(text), "limit": MAX_HOLDS_BYTES})  # fmt: skip
            return {HOLDS_ANNOTATION: ""}
        return {HOLDS_ANNOTATION: text}

    def _halt(self) -> None:
        """A write raised HaltWrites: stop writing everywhere, as a killed process would."""
        self.fence.set()
        self.halted.set()
        self._decider_stop.set()

    def _run_worker(self) -> None:
        pool = WritePool(
            configuration=self._configuration, workers=self._write_workers, capacity=self._write_queue,
            identity=self.identity, fence=self.fence, hook=self._write_hook, on_halt=self._halt,
        )  # fmt: skip
        self.pool = pool
        inline = _InlineWriters(self._configuration, self.identity, self.fence, self._write_hook, self._halt)
        submit = inline.run if self._write_workers == 0 else partial(pool.submit, stop=self._decider_stop)
        self.reconciler = Reconciler(
            cache=self.cache,
            metrics=self.metrics,
            settings=self.settings,
            capacity_generation=self.capacity_generation,
            submit=submit,
            requeue=self.queue.add,
            requeue_later=self.queue.add_rate_limited,
            requeue_after=self.queue.add_after,
            forget=self.queue.forget,
            capacity_freed=self._bump_capacity,
            gate_seen=self._gate_seen,
            preemptor=Preemptor(
                cache=self.cache, configuration=self._configuration, identity=self.identity, fence=self.fence,
                metrics=self.metrics, search=self.settings.preemption,
            ) if self.settings.preemption or self.settings.consolidation is not None else None,
            refusals=RefusedShares(cache=self.cache, configuration=self._configuration, fence=self.fence),
        )  # fmt: skip
        if self.settings.consolidation is not None and self.reconciler.preemptor is not None:
            self.reconciler.consolidator = Consolidator(
                cache=self.cache, configuration=self._configuration, preemptor=self.reconciler.preemptor,
                settings=self.settings.consolidation, identity=self.identity, metrics=self.metrics,
            )  # fmt: skip
            self.reconciler.preemptor.consolidation_failed = self.reconciler.consolidator.back_off
        if self.settings.provisioning_requests:
            self.reconciler.provisioner = Provisioner(
                cache=self.cache, metrics=self.metrics, provisioning_class=self.settings.provisioning_class,
                requeue_after=self.queue.add_after, initial_backoff=self.settings.provisioning_retry_seconds,
                max_backoff=self.settings.provisioning_max_retry_seconds,
            )  # fmt: skip
        pool.start()
        try:
            for watcher in self.watchers:  # decide only on a complete view
                while not watcher.synced.wait(0.1):
                    if self.stop_event.is_set():
                        return
            if self.guard is not None:
                self.guard.mark_synced()
            self._take_over_holds()
            while not self._decisions_allowed.wait(0.1):
                if self._decider_stop.is_set():
                    return
            self._resync()
            self._metrics_thread.start()
            next_resync = time.monotonic() + self._resync_seconds
            next_sweep = time.monotonic()
            while not self._decider_stop.is_set():
                now = time.monotonic()
                if now >= next_sweep:
                    # Here, not on the metrics thread: it forgets admitted allocations that were never
                    # stored (room the decider counts), on time (the metrics back off to tens of
                    # seconds on a big cluster), and costs little (the allocations in flight only).
                    if self.guard is not None:
                        self.guard.sweep()
                    next_sweep = now + self._metrics_refresh_seconds
                if now >= next_resync:
                    self._resync()
                    next_resync = now + self._resync_seconds
                key = self.queue.get(timeout_seconds=max(0.01, min(next_resync, next_sweep) - now))
                if key is None:
                    continue
                self._process([key, *self.queue.take_ready(self._batch_keys - 1)])
            if self.halted.is_set():
                log.warning("decider halted (leadership lost, or a test's simulated crash)")
        finally:
            pool.stop(timeout_seconds=10.0)
            inline.close()

    def _process(self, keys: list[str]) -> None:
        """One pass of the decider over the keys due now; gangs are decided together."""
        assert self.reconciler is not None
        gangs = [GangKey(k[len(GANG_PREFIX) :]) for k in keys if k.startswith(GANG_PREFIX)]
        reconciler = self.reconciler
        for key in keys:
            if key.startswith(CLAIM_PREFIX):
                self._guarded([key], partial(reconciler.reconcile_claim, key[len(CLAIM_PREFIX) :]))
            elif key.startswith(REFUSED_PREFIX):
                self._guarded([key], partial(reconciler.reconcile_refused, key[len(REFUSED_PREFIX) :]))
            elif key == DEFRAGMENT_KEY:
                self._guarded([key], reconciler.defragment)
            elif key == OVERCOMMITS_KEY:
                self._guarded([key], self._report_overcommits)
        if gangs:
            self._guarded([GANG_PREFIX + g for g in gangs], lambda: reconciler.reconcile_gangs(gangs))

    def _guarded(self, keys: list[str], decide: Callable[[], None]) -> None:
        """A key's backoff is reset when its writes succeed (the reconciler's ``forget``), not here:
        deciding hands the writes over, and they may still fail."""
        try:
            decide()
        except Exception:  # a bug: log it once with its traceback, back off, keep serving the other keys
            log.exception("decision failed", extra={"keys": bounded(", ".join(keys))})
            for key in keys:
                self.queue.add_rate_limited(key)

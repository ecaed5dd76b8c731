"""``fractional controller``: metrics server, optional leader election, the controller; exit codes.

With ``--allocation-guard-port``, the leader also serves the allocation guard (driver/controller/
guard): it binds the guard's port before it starts (a bad certificate is a configuration error),
points the guard's Service at itself (``--allocation-guard-service``), and decides nothing until
``GUARD_SETTLE_SECONDS`` after that, so that another allocator's writes admitted unchecked while no
replica answered are in its view first. A clean stop first stops deciding (the writes in flight
finish), then closes the guard and withdraws the Service's endpoint.

Returns 0 after a clean stop (SIGTERM). A replica that loses its lease (no renewal within the
renew deadline, e.g. kube-apiserver away that long) does not exit: it fences its writes (nothing it
still had queued goes out), stops that term's controller, and is a candidate again in the same
process; when it leads again, its new term starts from a fresh list. Liveness (``/healthz``) says
whether this process is stuck (a dead watch, decider or write thread), never whether the API
answers.

Every request of the process but the elector's takes a token of one bucket (``--kube-api-qps``,
``--kube-api-burst``; driver/kube/ratelimit.py) attached to the one ``Configuration`` all its clients
are made from. The elector's client has none (one request every few seconds), as kube-scheduler
gives its leader election a client of its own: a lease renewal never queues behind a burst of
writes, whatever the qps.
"""

from __future__ import annotations

import gc
import logging
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kubernetes import client

from driver.config import ControllerConfig, parse_window
from driver.controller.consolidation import Budget, ConsolidationSettings, MoverRules
from driver.controller.consolidation.consolidator import Schedule
from driver.controller.guard import GuardEndpoint, GuardServer
from driver.controller.kueue.worker import KueueCheckSettings, start_admission_check
from driver.controller.loop.controller import Controller
from driver.controller.loop.elector import Clock, LeaderElector
from driver.controller.loop.reconcile import ReconcilerSettings
from driver.controller.metrics import ControllerMetrics
from driver.controller.model.gang_identity import parse_gang_sources
from driver.controller.preemption.holds import HOLDS_ANNOTATION
from driver.controller.writes.writer import WriteHook
from driver.errors import ConfigError, FractionalError
from driver.kube import load_configuration, new_api_client
from driver.kube.ratelimit import TokenBucket, attach_rate_limiter
from driver.probes import ProbeServer

__all__ = ["freeze_heap", "run_controller"]

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1
# With the allocation guard: decide nothing until this long after the guard is served and its
# EndpointSlice written. Until kube-apiserver sees the new endpoint, another allocator's writes are
# admitted unchecked (the webhook fails open); this lets those land in our cache first.
GUARD_SETTLE_SECONDS = 2.0
GUARD_ENDPOINT_CHECK_SECONDS = 30.0  # the leader checks its EndpointSlice this often (2 s after a failure)


def freeze_heap() -> int:
    """Move everything alive now (the initial list: every slice, claim, pod and node, and the
    state built from them) out of the cyclic collector's reach; returns how many objects.

    Nothing in a controller's cache is cyclic, so reference counting still frees what a later event
    replaces; what changes is that a full collection no longer walks the whole cache. Without this,
    each one took 0.2 s at 100 nodes and 1,000 pods (tens of them under a backlog, each a pause of
    the decider at whatever allocation triggered it: py-spy, bench/bench_controller.py), and grows
    with the cluster. Called once per term, after the first complete view."""
    gc.collect()
    gc.freeze()
    count = gc.get_freeze_count()
    log.info("heap frozen after the initial list", extra={"objects": count})
    return count


def settings_from_config(config: ControllerConfig) -> ReconcilerSettings:
    return ReconcilerSettings(
        policy=config.policy,
        hint_profiles=config.hint_profiles,
        provisioning_requests=config.provisioning_requests,
        provisioning_class=config.provisioning_class,
        provisioning_retry_seconds=config.provisioning_retry_seconds,
        provisioning_max_retry_seconds=config.provisioning_max_retry_seconds,
        topology_label=config.topology_label,
        preemption=config.preemption,
        consolidation=ConsolidationSettings(
            rules=MoverRules(
                min_runtime_seconds=config.consolidation_min_runtime_seconds,
                cooldown_seconds=config.consolidation_cooldown_seconds,
            ),
            budget=Budget(
                milliseconds=config.consolidation_search_ms, max_moves=config.consolidation_max_moves
            ),
            backoff_seconds=config.consolidation_retry_seconds,
            schedule=Schedule(
                enabled=config.consolidation_schedule,
                window=parse_window(config.consolidation_schedule_window),
                stranded_ratio=config.consolidation_schedule_stranded_ratio,
                max_moves_per_gpu=config.consolidation_schedule_max_moves_per_gpu,
                interval_seconds=config.consolidation_schedule_interval_seconds,
            ),
        )
        if config.consolidation
        else None,
        allow_claim_backend_override=config.allow_claim_backend_override,
    )


def run_controller(
    config: ControllerConfig,
    stop: threading.Event,
    *,
    write_hook: WriteHook | None = None,
    clock: Clock | None = None,
    started: threading.Event | None = None,
) -> int:
    """Run until ``stop`` is set; returns 0. A replica that loses the lease stands down in place
    (its writes fenced, its controller stopped) and is a candidate again: an API outage longer than
    the renew deadline costs a fresh list when it leads again, never a process restart.
    ``write_hook``, ``clock`` and ``started`` (set each time this replica leads and its controller
    runs) are for tests."""
    configuration = load_configuration(config.kubeconfig)
    metrics = ControllerMetrics()
    if config.kube_api_qps > 0:  # before any client is made: every one of them shares this bucket
        limiter = TokenBucket(
            qps=config.kube_api_qps, burst=config.kube_api_burst,
            observe=metrics.kube_api_rate_limit_seconds.observe,
        )  # fmt: skip
        attach_rate_limiter(configuration, limiter)
    term: _Term | None = None

    def healthy() -> bool:
        return term is None or term.healthy()

    server = None
    if config.metrics_port:
        server = ProbeServer(
            host=config.metrics_host,
            port=config.metrics_port,
            checks={"/healthz": lambda: (healthy(), "")},
            registry=metrics.registry,
            name="metrics-http",
        )
        server.start()
    elector: LeaderElector | None = None
    elector_thread: threading.Thread | None = None
    # Not new_api_client: the elector's few requests never wait behind the bucket's queue.
    elector_api = client.ApiClient(configuration) if config.leader_elect else None
    elector_stop = threading.Event()
    try:
        if config.leader_elect:
            assert elector_api is not None
            elector = LeaderElector(
                api_client=elector_api,
                name=config.lease_name,
                namespace=config.lease_namespace,
                identity=config.identity,
                lease_duration_seconds=config.lease_duration_seconds,
                renew_deadline_seconds=config.renew_deadline_seconds,
                retry_period_seconds=config.retry_period_seconds,
                clock=clock,
            )
            elector_thread = threading.Thread(
                target=elector.run, args=(elector_stop,), name="leader-elector", daemon=True
            )
            elector_thread.start()
        while not stop.is_set():
            if elector is not None:
                while not (stop.is_set() or elector.leading.is_set()):
                    stop.wait(POLL_SECONDS)
                if stop.is_set():
                    break
                metrics.leader.set(1)
            term = _Term(config, configuration, metrics, write_hook)
            if term.lead(stop, elector, started):
                break  # told to stop
            # Leadership lost: the term fenced its writes and stopped; stand by for the next one.
            term = None
            metrics.leader.set(0)
            metrics.leadership_lost.inc()
            assert elector is not None
            elector.publish = None  # a successor may have taken over: its holds are its own
            elector.rejoin()
        return 0
    finally:
        if term is not None:
            term.end(cleanly=True)
        elector_stop.set()
        if elector is not None:
            elector.wake()
        if elector_thread is not None:
            elector_thread.join(timeout=10)
        if elector is not None and not elector.lost.is_set():
            elector.release()
        metrics.leader.set(0)
        if elector_api is not None:
            elector_api.close()  # type: ignore[no-untyped-call]
        if server is not None:
            server.close()


class _Term:
    """One stretch of leading (every stretch, without leader election): the controller, the
    allocation guard and its endpoint, the Kueue AdmissionCheck. ``lead`` runs it until ``stop``
    (True) or a lost lease (False); it ends the term either way."""

    def __init__(
        self,
        config: ControllerConfig,
        configuration: client.Configuration,
        metrics: ControllerMetrics,
        write_hook: WriteHook | None,
    ) -> None:
        self.config = config
        self.configuration = configuration
        self.metrics = metrics
        self.write_hook = write_hook
        self.controller: Controller | None = None
        self.close_kueue_check: Callable[[float], None] | None = None
        self.guard_server: GuardServer | None = None
        self.endpoint: GuardEndpoint | None = None
        self.endpoint_api: client.ApiClient | None = None
        self.ended = False

    def healthy(self) -> bool:
        return self.controller is None or self.controller.healthy()

    def lead(
        self, stop: threading.Event, elector: LeaderElector | None, started: threading.Event | None
    ) -> bool:
        config, configuration = self.config, self.configuration
        try:
            guarded = bool(config.allocation_guard_port)
            controller = Controller(
                configuration=configuration, settings=settings_from_config(config), identity=config.identity,
                metrics=self.metrics, write_hook=self.write_hook,
                gang_sources=parse_gang_sources(config.gang_sources), guard=guarded, hold_decisions=guarded,
                inherited_holds=elector.annotation(HOLDS_ANNOTATION) if elector is not None else "",
            )  # fmt: skip
            self.controller = controller
            if elector is not None:  # the holds ride on each renewal, for a successor
                elector.publish = controller.holds_snapshot
            if guarded:
                self.guard_server = _guard_server(config, controller)
            controller.start()
            release_at = time.monotonic()
            next_endpoint_check = 0.0
            if self.guard_server is not None:
                self.guard_server.start()
                if config.allocation_guard_service:
                    self.endpoint_api = new_api_client(configuration)
                    self.endpoint = GuardEndpoint(
                        self.endpoint_api, namespace=config.lease_namespace,
                        service=config.allocation_guard_service, address=config.allocation_guard_address,
                        port=self.guard_server.port, pod_name=config.identity,
                    )  # fmt: skip
                    next_endpoint_check = _ensure_endpoint(self.endpoint)
                release_at = time.monotonic() + GUARD_SETTLE_SECONDS
            if config.kueue_admission_check:  # the AdmissionCheck fractional.dev/placement
                kueue_settings = KueueCheckSettings(
                    policy=config.policy,
                    topology_label=config.topology_label,
                    hint_profiles=config.hint_profiles,
                )
                self.close_kueue_check = start_admission_check(
                    configuration, kueue_settings, fence=controller.fence
                )
            log.info("controller started", extra={"identity": config.identity, "policy": config.policy})
            if started is not None:
                started.set()
            released = frozen = False
            while not stop.is_set():
                now = time.monotonic()
                if not frozen and controller.wait_synced(0):
                    freeze_heap()
                    frozen = True
                if not released and now >= release_at:
                    controller.allow_decisions()
                    released = True
                if self.endpoint is not None and now >= next_endpoint_check:
                    next_endpoint_check = _ensure_endpoint(self.endpoint)
                if controller.halted.is_set():
                    stop.wait(POLL_SECONDS)  # a simulated crash: stay down until told to stop
                    continue
                # The elector notices a missed deadline only after its current round, which can block
                # on a slow API for longer than the deadline; check the deadline here too, and fence
                # the writer first so nothing more goes out once a successor may have taken over.
                if elector is not None and (elector.lost.is_set() or elector.renew_overdue()):
                    controller.fence.set()
                    elector.step_down("no renewal within the renew deadline")
                    log.warning(
                        "standing down: writes fenced, a candidate again", extra={"identity": config.identity}
                    )
                    self.end(cleanly=False)
                    return False
                stop.wait(POLL_SECONDS)
            return True
        except BaseException:
            log.exception("leading ended by an error", extra={"identity": config.identity})
            self.end(cleanly=False)
            raise

    def end(self, *, cleanly: bool) -> None:
        """Stop what the term runs. ``cleanly`` (told to stop): the writes in flight finish and the
        guard's endpoint is withdrawn; otherwise (lease lost) nothing more is written at all."""
        if self.ended:
            return
        self.ended = True
        controller = self.controller
        if controller is not None:
            if cleanly:
                # Told to stop: place nothing more from here (a Deployment scaled to 0 keeps this
                # process running for the rest of its grace period, and a user then expects gated
                # pods to wait). The guard keeps answering until the writes in flight are done.
                controller.stop_deciding()
            else:
                controller.fence.set()
        if self.guard_server is not None:
            self.guard_server.close()
        if self.endpoint is not None:
            if cleanly:  # point the webhook at nobody rather than at a port about to close
                try:
                    self.endpoint.withdraw()
                except FractionalError as error:
                    log.warning("allocation guard endpoint not withdrawn", extra={"error": str(error)})
            self.endpoint.close()
        if self.endpoint_api is not None:
            self.endpoint_api.close()  # type: ignore[no-untyped-call]
        if self.close_kueue_check is not None:
            self.close_kueue_check(10.0 if cleanly else 1.0)
        if controller is not None:
            controller.stop()


def _guard_server(config: ControllerConfig, controller: Controller) -> GuardServer:
    """The guard's HTTPS server, bound now: a missing or bad certificate is a configuration error."""
    assert controller.guard is not None
    directory = Path(config.allocation_guard_cert_dir)
    try:
        return GuardServer(
            host=config.metrics_host, port=config.allocation_guard_port, cert_file=str(directory / "tls.crt"),
            key_file=str(directory / "tls.key"), review=controller.guard.review,
        )  # fmt: skip
    except (OSError, ssl.SSLError) as error:
        raise ConfigError(
            field="--allocation-guard-cert-dir (FRACTIONAL_ALLOCATION_GUARD_CERT_DIR)",
            problem=f"{directory}: tls.crt and tls.key: {error}",
        ) from error


def _ensure_endpoint(endpoint: GuardEndpoint) -> float:
    """Point the guard's Service at this replica; when to look again."""
    try:
        endpoint.ensure()
    except FractionalError as error:
        log.warning("allocation guard endpoint not written", extra={"endpointslice": endpoint.name,
                    "error": str(error)})  # fmt: skip
        return time.monotonic() + 2.0
    return time.monotonic() + GUARD_ENDPOINT_CHECK_SECONDS

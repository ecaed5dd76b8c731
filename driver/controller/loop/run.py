"""``fractional controller``: metrics server, optional leader election, the controller; exit codes.

With ``--allocation-guard-port``, the leader also serves the allocation guard (driver/controller/
guard): it binds the guard's port before it starts (a bad certificate is a configuration error),
points the guard's Service at itself (``--allocation-guard-service``), and decides nothing until
``GUARD_SETTLE_SECONDS`` after that, so that another allocator's writes admitted unchecked while no
replica answered are in its view first. A clean stop first stops deciding (the writes in flight
finish), then closes the guard and withdraws the Service's endpoint.

Returns 0 after a clean stop (SIGTERM), 1 when leadership was lost (the process must exit so that
nothing it still had in flight is written by a non-leader; the Deployment restarts it).
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path

from driver.config import ControllerConfig
from driver.controller.guard import GuardEndpoint, GuardServer
from driver.controller.kueue.worker import KueueCheckSettings, start_admission_check
from driver.controller.loop.controller import Controller
from driver.controller.loop.elector import Clock, LeaderElector
from driver.controller.loop.reconcile import ReconcilerSettings
from driver.controller.metrics import ControllerMetrics
from driver.controller.model.gang_identity import parse_gang_sources
from driver.controller.writes.writer import WriteHook
from driver.errors import ConfigError, FractionalError
from driver.kube import load_configuration, new_api_client
from driver.probes import ProbeServer

__all__ = ["run_controller"]

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1
# With the allocation guard: decide nothing until this long after the guard is served and its
# EndpointSlice written. Until kube-apiserver sees the new endpoint, another allocator's writes are
# admitted unchecked (the webhook fails open); this lets those land in our cache first.
GUARD_SETTLE_SECONDS = 2.0
GUARD_ENDPOINT_CHECK_SECONDS = 30.0  # the leader checks its EndpointSlice this often (2 s after a failure)


def settings_from_config(config: ControllerConfig) -> ReconcilerSettings:
    return ReconcilerSettings(
        policy=config.policy,
        hint_profiles=config.hint_profiles,
        provisioning_requests=config.provisioning_requests,
        provisioning_class=config.provisioning_class,
        topology_label=config.topology_label,
        preemption=config.preemption,
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
    """Run until ``stop`` is set (0) or leadership is lost (1). ``write_hook``, ``clock`` and
    ``started`` (set once this replica leads and its controller runs) are for tests."""
    configuration = load_configuration(config.kubeconfig)
    metrics = ControllerMetrics()
    controller: Controller | None = None
    close_kueue_check: Callable[[float], None] | None = None
    guard_server: GuardServer | None = None
    endpoint: GuardEndpoint | None = None
    endpoint_api = None
    next_endpoint_check = 0.0
    stopped_cleanly = False

    def healthy() -> bool:
        return controller is None or controller.healthy()

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
    elector_api = new_api_client(configuration) if config.leader_elect else None
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
            while not (stop.is_set() or elector.leading.is_set() or elector.lost.is_set()):
                stop.wait(POLL_SECONDS)
            if stop.is_set() or elector.lost.is_set():
                return 0 if stop.is_set() else 1
            metrics.leader.set(1)
        guarded = bool(config.allocation_guard_port)
        controller = Controller(
            configuration=configuration, settings=settings_from_config(config), identity=config.identity,
            metrics=metrics, write_hook=write_hook, gang_sources=parse_gang_sources(config.gang_sources),
            guard=guarded, hold_decisions=guarded,
        )  # fmt: skip
        if guarded:
            guard_server = _guard_server(config, controller)
        controller.start()
        release_at = time.monotonic()
        if guard_server is not None:
            guard_server.start()
            if config.allocation_guard_service:
                endpoint_api = new_api_client(configuration)
                endpoint = GuardEndpoint(
                    endpoint_api, namespace=config.lease_namespace, service=config.allocation_guard_service,
                    address=config.allocation_guard_address, port=guard_server.port, pod_name=config.identity,
                )  # fmt: skip
                next_endpoint_check = _ensure_endpoint(endpoint)
            release_at = time.monotonic() + GUARD_SETTLE_SECONDS
        if config.kueue_admission_check:  # the AdmissionCheck fractional.dev/placement
            kueue_settings = KueueCheckSettings(
                policy=config.policy, topology_label=config.topology_label, hint_profiles=config.hint_profiles
            )
            close_kueue_check = start_admission_check(configuration, kueue_settings, fence=controller.fence)
        log.info("controller started", extra={"identity": config.identity, "policy": config.policy})
        if started is not None:
            started.set()
        released = False
        while not stop.is_set():
            now = time.monotonic()
            if not released and now >= release_at:
                controller.allow_decisions()
                released = True
            if endpoint is not None and now >= next_endpoint_check:
                next_endpoint_check = _ensure_endpoint(endpoint)
            # The elector notices a missed deadline only after its current round, which can block on
            # a slow API for longer than the deadline; check the deadline here too, and fence the
            # writer first so nothing more goes out once a successor may have taken over.
            if elector is not None and (elector.lost.is_set() or elector.renew_overdue()):
                controller.fence.set()
                log.error("leadership lost, stopping", extra={"identity": config.identity})
                return 1
            if controller.halted.is_set():
                stop.wait(POLL_SECONDS)  # a simulated crash: stay down until told to stop
                continue
            stop.wait(POLL_SECONDS)
        stopped_cleanly = True
        return 0
    finally:
        if controller is not None and stopped_cleanly:
            # Told to stop: place nothing more from here (a Deployment scaled to 0 keeps this
            # process running for the rest of its grace period, and a user then expects gated
            # pods to wait). The guard keeps answering until the writes in flight are done.
            controller.stop_deciding()
        if guard_server is not None:
            guard_server.close()
        if endpoint is not None:
            if stopped_cleanly:  # point the webhook at nobody rather than at a port about to close
                try:
                    endpoint.withdraw()
                except FractionalError as error:
                    log.warning("allocation guard endpoint not withdrawn", extra={"error": str(error)})
            endpoint.close()
        if endpoint_api is not None:
            endpoint_api.close()  # type: ignore[no-untyped-call]
        if close_kueue_check is not None:
            close_kueue_check(10.0)
        if controller is not None:
            controller.stop()
        elector_stop.set()
        if elector_thread is not None:
            elector_thread.join(timeout=10)
        if elector is not None and not elector.lost.is_set():
            elector.release()
        metrics.leader.set(0)
        if elector_api is not None:
            elector_api.close()  # type: ignore[no-untyped-call]
        if server is not None:
            server.close()


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

"""Kubelet plugin registration (``pluginregistration.Registration``) and the socket names.

The kubelet's plugin watcher finds ``<registry-dir>/fractional.dev-reg.sock`` (with rolling updates
``fractional.dev-<podUID>-reg.sock``), calls ``GetInfo`` (1 s timeout) and then
``NotifyRegistrationStatus``. The status is informational: it is logged, exported as a metric and
kept for ``/readyz``; a refusal never stops the agent (the kubelet retries with backoff).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from driver import DRIVER_NAME
from driver.plugin.metrics import REGISTERED, REGISTRATION_NOTIFICATIONS_TOTAL
from driver.plugin.proto_gen import pluginregistration_pb2 as pb
from driver.plugin.proto_gen import pluginregistration_pb2_grpc as pb_grpc

__all__ = [
    "DRA_PLUGIN_TYPE",
    "SUPPORTED_VERSIONS",
    "RegistrationServicer",
    "RegistrationStatus",
    "SocketPaths",
    "socket_paths",
]

log = logging.getLogger(__name__)

DRA_PLUGIN_TYPE = "DRAPlugin"
# Services offered, in preference order (a 1.34+ kubelet takes the first it supports).
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")


@dataclass(frozen=True, slots=True)
class SocketPaths:
    registration: Path  # watched by the kubelet
    dra: Path  # DRA + health services; its absolute path is the advertised endpoint
    serialize_lock: Path | None  # rolling updates: flock shared by both agent pods


def socket_paths(*, registry_dir: str, plugin_dir: str, pod_uid: str | None) -> SocketPaths:
    registry, plugin = Path(registry_dir).absolute(), Path(plugin_dir).absolute()
    if pod_uid:
        return SocketPaths(
            registration=registry / f"{DRIVER_NAME}-{pod_uid}-reg.sock",
            dra=plugin / f"dra-{pod_uid}.sock",
            serialize_lock=plugin / "serialize.lock",
        )
    return SocketPaths(
        registration=registry / f"{DRIVER_NAME}-reg.sock", dra=plugin / "dra.sock", serialize_lock=None
    )


class RegistrationStatus:
    """What the kubelet last said; ``registered`` is an Event for readiness checks and tests."""

    def __init__(self) -> None:
        self.registered = threading.Event()
        self.notified = threading.Event()
        self._lock = threading.Lock()
        self._error = ""

    @property
    def error(self) -> str:
        with self._lock:
            return self._error

    def record(self, *, registered: bool, error: str) -> None:
        with self._lock:
            self._error = error
        if registered:
            self.registered.set()
        else:
            self.registered.clear()
        self.notified.set()
        REGISTERED.set(1 if registered else 0)
        REGISTRATION_NOTIFICATIONS_TOTAL.labels(registered=str(registered).lower()).inc()


class RegistrationServicer(pb_grpc.RegistrationServicer):
    def __init__(self, *, endpoint: Path, status: RegistrationStatus, driver_name: str = DRIVER_NAME) -> None:
        self._info = pb.PluginInfo(
            type=DRA_PLUGIN_TYPE,
            name=driver_name,
            endpoint=str(endpoint.absolute()),
            supported_versions=list(SUPPORTED_VERSIONS),
        )
        self._status = status

    def GetInfo(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.PluginInfo:
        return self._info

    def NotifyRegistrationStatus(
        self, request: pb.RegistrationStatus, context: grpc.ServicerContext
    ) -> pb.RegistrationStatusResponse:
        self._status.record(registered=request.plugin_registered, error=request.error)
        if request.plugin_registered:
            log.info("registered with the kubelet", extra={"endpoint": self._info.endpoint})
        else:
            log.error("kubelet refused the registration", extra={"reason": request.error})
        return pb.RegistrationStatusResponse()

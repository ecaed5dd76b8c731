"""``v1alpha1.DRAResourceHealth/NodeWatchResources``: device health streamed to the kubelet (KEP-4680).

Each message carries the **complete** list of the node's GPUs (the kubelet replaces its view with
every message), sent when a stream opens, whenever ``HealthMonitor`` reports a change, and at least
every ``resend_seconds`` (the kubelet marks a device Unknown when it is not reported again within
``health_check_timeout_seconds``, which we set to three resend periods). NICs are not monitored and
therefore not reported (the kubelet shows them as Unknown).

A stream holds one worker of the DRA server's pool for its whole life: streams are counted in a
metric, and all of them end promptly when the agent stops.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc

from driver.plugin.health import DeviceHealth
from driver.plugin.metrics import HEALTH_STREAMS
from driver.plugin.proto_gen import dra_health_v1alpha1_pb2 as pb
from driver.plugin.proto_gen import dra_health_v1alpha1_pb2_grpc as pb_grpc

__all__ = ["HealthStreamer", "build_health_response"]

MAX_MESSAGE_CHARS = 1024  # the kubelet truncates longer messages


def build_health_response(
    pool: str, snapshot: Mapping[str, DeviceHealth], *, now: float, timeout_seconds: int
) -> pb.NodeWatchResourcesResponse:
    """Pure: one stream message for ``snapshot`` (device name -> health), devices in name order."""
    devices = []
    for name in sorted(snapshot):
        health = snapshot[name]
        message = health.message or health.reason
        devices.append(
            pb.DeviceHealth(
                device=pb.DeviceIdentifier(pool_name=pool, device_name=name),
                health=pb.HealthStatus.HEALTHY if health.healthy else pb.HealthStatus.UNHEALTHY,
                last_updated_time=int(now),
                health_check_timeout_seconds=timeout_seconds,
                message=message[:MAX_MESSAGE_CHARS],
            )
        )
    return pb.NodeWatchResourcesResponse(devices=devices)


class HealthStreamer(pb_grpc.DRAResourceHealthServicer):
    def __init__(
        self,
        *,
        pool: str,
        snapshot: Callable[[], Mapping[str, DeviceHealth]],
        resend_seconds: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._pool = pool
        self._snapshot = snapshot
        self._resend_seconds = resend_seconds
        self._timeout_seconds = max(1, round(3 * resend_seconds))
        self._clock = clock
        self._changed = threading.Condition()  # guards the two fields below
        self._generation = 0
        self._closed = False

    def notify(self) -> None:
        """The monitor saw a change: every open stream sends the new list now."""
        with self._changed:
            self._generation += 1
            self._changed.notify_all()

    def close(self) -> None:
        """End every stream (agent shutdown)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _wait_for_change(self, seen: int) -> int | None:
        """The new generation after a change or the resend period; None once closed."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._closed or self._generation != seen, timeout=self._resend_seconds
            )
            return None if self._closed else self._generation

    def NodeWatchResources(
        self, request: pb.NodeWatchResourcesRequest, context: grpc.ServicerContext
    ) -> Iterator[Any]:
        HEALTH_STREAMS.inc()
        try:
            with self._changed:
                seen: int | None = self._generation
            while seen is not None and context.is_active():
                yield build_health_response(
                    self._pool, self._snapshot(), now=self._clock(), timeout_seconds=self._timeout_seconds
                )
                seen = self._wait_for_change(seen)
        finally:
            HEALTH_STREAMS.dec()

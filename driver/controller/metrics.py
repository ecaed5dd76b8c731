"""Prometheus metrics of the controller, on their own registry (served by ``driver.probes``).

A registry per controller (not the client library's global one) lets tests run several
controllers in one process.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

__all__ = ["ControllerMetrics", "compute_fragmented_bytes"]

log = logging.getLogger(__name__)


def compute_fragmented_bytes(
    free_summary: dict[str, dict[str, dict[str, Any]]], share_sizes: Iterable[int]
) -> int:
    """Free GPU memory that no pending share could use: on each device, the free memory when it is
    smaller than the smallest memory any pending share asks for (0 when nothing is pending)."""
    sizes = [s for s in share_sizes if s > 0]
    if not sizes:
        return 0
    smallest = min(sizes)
    fragmented = 0
    for devices in free_summary.values():
        for device in devices.values():
            free = int(device.get("memory_bytes_free") or 0)
            if 0 < free < smallest:
                fragmented += free
    return fragmented


class ControllerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "fractional_controller_decisions", "Gang decisions by outcome.", ["outcome"], registry=r
        )
        self.decision_seconds = Histogram(
            "fractional_controller_decision_duration_seconds",
            "Time from taking a gang off the queue to its last write.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.ungate_seconds = Histogram(
            "fractional_controller_gate_to_ungate_seconds",
            "Time from the controller first seeing a gated pod to removing its gate.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.gangs_pending = Gauge(
            "fractional_controller_gangs_pending", "Gangs with gated pods not yet allocated.", registry=r
        )
        self.memory_bytes = Gauge(
            "fractional_controller_node_gpu_memory_bytes",
            "GPU memory per node: published (capacity) and allocated.",
            ["node", "kind"],
            registry=r,
        )
        self.compute_percent = Gauge(
            "fractional_controller_node_gpu_compute_percent",
            "Guaranteed GPU compute per node, in percent of one GPU: published and allocated.",
            ["node", "kind"],
            registry=r,
        )
        self.fragmented_bytes = Gauge(
            "fractional_controller_fragmented_memory_bytes",
            "Free GPU memory that no pending share could use (devices with less free than the smallest ask).",
            registry=r,
        )
        self.vanished = Counter(
            "fractional_controller_allocations_vanished",
            "Allocations we wrote that someone else cleared (kube-scheduler's PostFilter).",
            registry=r,
        )
        self.released = Counter(
            "fractional_controller_claims_released", "Claims whose allocation we released.", registry=r
        )
        self.leader = Gauge("fractional_controller_leader", "1 while this replica leads.", registry=r)

    def observe_capacity(
        self, free_summary: dict[str, dict[str, dict[str, Any]]], share_sizes: Iterable[int]
    ) -> None:
        for node, devices in free_summary.items():
            memory_total = sum(int(d.get("memory_bytes_total") or 0) for d in devices.values())
            memory_free = sum(int(d.get("memory_bytes_free") or 0) for d in devices.values())
            compute_total = sum(
                int(d.get("compute_total") or 100) for d in devices.values() if "compute_free" in d
            )
            compute_free = sum(
                int(d.get("compute_free") or 0) for d in devices.values() if "compute_free" in d
            )
            self.memory_bytes.labels(node=node, kind="published").set(memory_total)
            self.memory_bytes.labels(node=node, kind="allocated").set(memory_total - memory_free)
            self.compute_percent.labels(node=node, kind="published").set(compute_total)
            self.compute_percent.labels(node=node, kind="allocated").set(compute_total - compute_free)
        self.fragmented_bytes.set(compute_fragmented_bytes(free_summary, share_sizes))

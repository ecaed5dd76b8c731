"""Prometheus metrics of the controller, on their own registry (served by ``driver.probes``).

A registry per controller (not the client library's global one) lets tests run several
controllers in one process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.core import GaugeHistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from driver.controller.sizing.fragmentation import (
    Fragmentation,
    build_gpu_capacities,
    compute_fragmentation,
    products_from_slices,
)

__all__ = ["SHARES_PER_GPU_BUCKETS", "WAIT_SECONDS_BUCKETS", "ControllerMetrics", "compute_fragmented_bytes"]

SHARES_PER_GPU_BUCKETS = (0, 1, 2, 4, 8, 16)
WAIT_SECONDS_BUCKETS = (1, 5, 15, 60, 300, 900, 3600)

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
        self.overcommitted_devices = Gauge(
            "fractional_controller_overcommitted_devices",
            "Devices whose allocated claims consume more than the device publishes (two allocators raced).",
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
        self.preemptions = Counter(
            "fractional_controller_preemptions",
            "Preemption attempts for gangs that did not fit, by outcome (preempted, blocked, gave_up).",
            ["outcome"],
            registry=r,
        )
        self.provisioning_requests = Counter(
            "fractional_controller_provisioning_requests",
            "ProvisioningRequests for gangs that did not fit, by event (created; ended: cluster-autoscaler "
            "wrote Failed, BookingExpired or CapacityRevoked, and we deleted it; placed: the gang was placed "
            "and we deleted it).",
            ["event"],
            registry=r,
        )
        self.preemption_victims = Counter(
            "fractional_controller_preemption_victims",
            "Lower-priority pods evicted to make room for a gang.",
            registry=r,
        )
        self.consolidation_plans = Counter(
            "fractional_controller_consolidation_plans",
            "Consolidation plans, by outcome: for gangs that did not fit and no preemption served (tried: "
            "a plan was searched; committed: its moves began), and of the scheduled pass (scheduled_tried, "
            "scheduled_committed).",
            ["outcome"],
            registry=r,
        )
        self.consolidation_refused = Counter(
            "fractional_controller_consolidation_refused",
            "Consolidations that did not happen or did not serve, by reason (capacity: free room does not "
            "add up; no_movers; no_plan; eviction_refused: a PodDisruptionBudget or the server; api; "
            "not_placed: the gang still did not fit once the moved pods left; reservation_expired: a "
            "replacement never took its place).",
            ["reason"],
            registry=r,
        )
        self.consolidation_pods_moved = Counter(
            "fractional_controller_consolidation_pods_moved",
            "Pods evicted to be moved by consolidation.",
            registry=r,
        )
        self.consolidation_gpus_freed = Counter(
            "fractional_controller_consolidation_gpus_freed",
            "GPUs the committed consolidation plans left wholly free for the gangs they served.",
            registry=r,
        )
        self.consolidation_replacements = Counter(
            "fractional_controller_consolidation_replacements",
            "Replacements of moved pods placed on the room kept for them.",
            ["outcome"],
            registry=r,
        )
        self.consolidation_served_wait_seconds = Histogram(
            "fractional_controller_consolidation_served_wait_seconds",
            "From creation to placement of the gangs a consolidation served (their first pod).",
            buckets=WAIT_SECONDS_BUCKETS,
            registry=r,
        )
        self.leader = Gauge("fractional_controller_leader", "1 while this replica leads.", registry=r)
        self.leadership_lost = Counter(
            "fractional_controller_leadership_lost",
            "Times this replica lost its lease (no renewal within the renew deadline) and stood down "
            "in place, a candidate again.",
            registry=r,
        )
        self.guard_reviews = Counter(
            "fractional_controller_allocation_guard_reviews",
            "Allocations another allocator wrote for our devices, as the allocation guard answered them "
            "(allowed, refused: past a device's capacity, starting: the guard's view not synced yet).",
            ["outcome"],
            registry=r,
        )
        self.guard_review_seconds = Histogram(
            "fractional_controller_allocation_guard_review_duration_seconds",
            "Time the allocation guard took to answer one admission review.",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=r,
        )
        self.gpus_free = Gauge(
            "fractional_controller_gpus_free", "Whole GPUs with nothing allocated on them.", registry=r
        )
        self.gpus = Gauge("fractional_controller_gpus", "GPUs published by our driver.", registry=r)
        self.stranded_bytes = Gauge(
            "fractional_controller_stranded_memory_bytes",
            "Free memory on partly used GPUs (fits shares, never a whole-GPU request).",
            registry=r,
        )
        self.largest_share_bytes = Gauge(
            "fractional_controller_largest_free_share_memory_bytes",
            "The largest memory share that still fits on one GPU of this product.",
            ["product"],
            registry=r,
        )
        self.largest_share_compute = Gauge(
            "fractional_controller_largest_free_share_compute_percent",
            "Free guaranteed compute on the GPU offering the largest memory share of this product.",
            ["product"],
            registry=r,
        )
        self.gangs_waiting = Gauge(
            "fractional_controller_gangs_waiting", "Gangs waiting for an allocation (gated).", registry=r
        )
        self.gang_longest_wait = Gauge(
            "fractional_controller_gang_longest_wait_seconds",
            "How long the longest-waiting gang has waited since the controller first saw it gated.",
            registry=r,
        )
        self.gang_api = Gauge(
            "fractional_controller_gang_api_info",
            "1 for the scheduling.k8s.io version whose Workload/PodGroup the controller reads "
            "('none': none served).",
            ["version"],
            registry=r,
        )
        self.typical_workload = Gauge(
            "fractional_controller_typical_workload_share",
            "The typical workload the fragmentation policy learned from the pods placed: the share of "
            "each pod shape (devices, memory per device in bytes, 'whole' for whole devices, CPU in "
            "millicores) among the shapes making up 95 % of them. Empty until learned, and under the "
            "other policies.",
            ["devices", "memory_bytes", "cpu_millis"],
            registry=r,
        )
        self.kube_api_rate_limit_seconds = Histogram(
            "fractional_controller_kube_api_rate_limiter_duration_seconds",
            "Time a request to kube-apiserver waited for the controller's client-side rate limit "
            "(--kube-api-qps, --kube-api-burst; as client-go's rest_client_rate_limiter_duration_seconds). "
            "Every request is counted, 0 when it did not wait; none with --kube-api-qps 0.",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self._typical_version = -1
        self._fragmentation_lock = threading.Lock()
        self._fragmentation: Fragmentation | None = None
        self._gang_first_seen: dict[str, float] = {}
        r.register(_FragmentationHistograms(self))

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

    def observe_typical_workload(self, version: int, typical: Iterable[tuple[Any, float]]) -> None:
        """The learned typical workload (``driver.allocator.fragmentation.Workload``), when it changed."""
        if version == self._typical_version:
            return
        self._typical_version = version
        self.typical_workload.clear()
        for shape, weight in typical:
            memory = "none" if not shape.devices else "whole" if shape.memory < 0 else str(shape.memory)
            self.typical_workload.labels(
                devices=str(shape.devices), memory_bytes=memory, cpu_millis=str(shape.cpu_millis)
            ).set(weight)

    def observe_fragmentation(
        self,
        free_summary: Mapping[str, Mapping[str, Mapping[str, Any]]],
        slices: Iterable[Mapping[str, Any]],
        waiting_gangs: Iterable[str],
        *,
        now: float,
    ) -> Fragmentation:
        """Fragmentation of the cluster (``driver.controller.sizing.fragmentation``); ``now`` is a
        monotonic clock reading, for how long each gang has waited since first seen waiting."""
        waiting = set(waiting_gangs)
        with self._fragmentation_lock:
            for gang in [g for g in self._gang_first_seen if g not in waiting]:
                del self._gang_first_seen[gang]
            for gang in waiting:
                self._gang_first_seen.setdefault(gang, now)
            waits = [now - self._gang_first_seen[g] for g in waiting]
        report = compute_fragmentation(
            build_gpu_capacities(free_summary, products_from_slices(slices)), waits
        )
        self.gpus.set(report.gpus)
        self.gpus_free.set(report.gpus_free)
        self.stranded_bytes.set(report.stranded_memory_bytes)
        self.largest_share_bytes.clear()
        self.largest_share_compute.clear()
        for largest in report.largest_share:
            self.largest_share_bytes.labels(product=largest.product).set(largest.memory_bytes)
            self.largest_share_compute.labels(product=largest.product).set(largest.compute_percent)
        self.gangs_waiting.set(report.gangs_waiting)
        self.gang_longest_wait.set(report.longest_wait_seconds)
        with self._fragmentation_lock:
            self._fragmentation = report
        return report

    def last_fragmentation(self) -> Fragmentation | None:
        with self._fragmentation_lock:
            return self._fragmentation


def _gauge_histogram(
    name: str, documentation: str, values: Iterable[float], bounds: Iterable[float]
) -> GaugeHistogramMetricFamily:
    values = list(values)
    buckets = [(str(bound), float(sum(1 for v in values if v <= bound))) for bound in bounds]
    buckets.append(("+Inf", float(len(values))))
    return GaugeHistogramMetricFamily(name, documentation, buckets=buckets, gsum_value=float(sum(values)))


class _FragmentationHistograms(Collector):
    """Shares per GPU and gang wait times of the last ``observe_fragmentation``, as gauge histograms."""

    def __init__(self, metrics: ControllerMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        report = self._metrics.last_fragmentation()
        shares = report.shares_per_gpu if report is not None else ()
        waits = report.gang_wait_seconds if report is not None else ()
        yield _gauge_histogram(
            "fractional_controller_gpu_shares",
            "GPUs by the number of shares allocated on them (a whole-GPU allocation counts as one).",
            shares,
            SHARES_PER_GPU_BUCKETS,
        )
        yield _gauge_histogram(
            "fractional_controller_gang_wait_seconds",
            "Waiting gangs by how long they have waited since the controller first saw them gated.",
            waits,
            WAIT_SECONDS_BUCKETS,
        )

"""Fragmentation metrics against a cluster computed by hand."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from driver import DRIVER_NAME
from driver.controller.metrics import ControllerMetrics
from driver.controller.sizing.fragmentation import (
    GpuCapacity,
    LargestShare,
    build_gpu_capacities,
    compute_fragmentation,
    products_from_slices,
)

GIB = 1024**3


def _gpu(
    pool: str, total_gib: int, free_gib: int, compute_free: int, shares: int, exclusive: bool = False
) -> dict[str, Any]:
    return {
        "pool": pool,
        "shares": shares,
        "exclusive": exclusive,
        "memory_bytes_total": total_gib * GIB,
        "memory_bytes_free": free_gib * GIB,
        "compute_total": 100,
        "compute_free": compute_free,
    }


# node-a: three H100s: one with two shares (30Gi and 40% used), one free, one taken whole; a NIC.
# node-b: two L4s: one share of 4Gi, and three shares leaving 4Gi and 10% compute.
FREE_SUMMARY: dict[str, dict[str, dict[str, Any]]] = {
    "node-a": {
        "gpu-0": _gpu("node-a", 80, 50, 60, 2),
        "gpu-1": _gpu("node-a", 80, 80, 100, 0),
        "gpu-2": _gpu("node-a", 80, 0, 0, 0, exclusive=True),
        "nic-0": {
            "pool": "node-a",
            "shares": 0,
            "exclusive": False,
            "bandwidth_free": 100,
            "bandwidth_total": 100,
        },
    },
    "node-b": {
        "gpu-0": _gpu("node-b", 24, 20, 100, 1),
        "gpu-1": _gpu("node-b", 24, 4, 10, 3),
    },
}


def _slice(pool: str, product: str, devices: list[str]) -> dict[str, Any]:
    return {
        "spec": {
            "driver": DRIVER_NAME,
            "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
            "nodeName": pool,
            "devices": [
                {"name": name, "attributes": {"productName": {"string": product}}} for name in devices
            ],
        }
    }


SLICES = [
    _slice("node-a", "NVIDIA H100 80GB HBM3", ["gpu-0", "gpu-1", "gpu-2"]),
    _slice("node-b", "NVIDIA L4", ["gpu-0", "gpu-1"]),
    {"spec": {"driver": "gpu.nvidia.com", "pool": {"name": "x"}, "devices": [{"name": "gpu-0"}]}},
]


def test_fragmentation_of_a_hand_computed_cluster() -> None:
    products = products_from_slices(SLICES)
    assert products == {
        ("node-a", "gpu-0"): "NVIDIA H100 80GB HBM3",
        ("node-a", "gpu-1"): "NVIDIA H100 80GB HBM3",
        ("node-a", "gpu-2"): "NVIDIA H100 80GB HBM3",
        ("node-b", "gpu-0"): "NVIDIA L4",
        ("node-b", "gpu-1"): "NVIDIA L4",
    }
    gpus = build_gpu_capacities(FREE_SUMMARY, products)
    assert [(g.node, g.device) for g in gpus] == [
        ("node-a", "gpu-0"),
        ("node-a", "gpu-1"),
        ("node-a", "gpu-2"),
        ("node-b", "gpu-0"),
        ("node-b", "gpu-1"),
    ]
    report = compute_fragmentation(gpus, [5.0, 30.0])
    assert report.gpus == 5
    assert report.gpus_free == 1  # node-a/gpu-1
    assert report.stranded_memory_bytes == (50 + 20 + 4) * GIB  # partly used GPUs only
    assert report.largest_share == (
        LargestShare("NVIDIA H100 80GB HBM3", 80 * GIB, 100),
        LargestShare("NVIDIA L4", 20 * GIB, 100),
    )
    assert report.shares_per_gpu == (2, 0, 1, 1, 3)  # the whole-GPU allocation counts as one
    assert (report.gangs_waiting, report.gang_wait_seconds, report.longest_wait_seconds) == (
        2,
        (30.0, 5.0),
        30.0,
    )


def test_a_product_taken_whole_everywhere_offers_no_share() -> None:
    gpu = GpuCapacity("n", "n", "gpu-0", "A100", 40 * GIB, 0, 100, 0, 0, exclusive=True)
    report = compute_fragmentation([gpu], [])
    assert report.largest_share == (LargestShare("A100", 0, 0),)
    assert (report.gpus_free, report.stranded_memory_bytes, report.longest_wait_seconds) == (0, 0, 0.0)


def test_controller_metrics_export_the_fragmentation() -> None:
    registry = CollectorRegistry()
    metrics = ControllerMetrics(registry)
    metrics.observe_fragmentation(FREE_SUMMARY, SLICES, ["team/a", "team/b"], now=100.0)
    metrics.observe_fragmentation(FREE_SUMMARY, SLICES, ["team/a", "team/c"], now=130.0)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("fractional_controller_gpus") == 5
    assert value("fractional_controller_gpus_free") == 1
    assert value("fractional_controller_stranded_memory_bytes") == 74 * GIB
    assert value("fractional_controller_largest_free_share_memory_bytes", product="NVIDIA L4") == 20 * GIB
    assert value("fractional_controller_largest_free_share_compute_percent", product="NVIDIA L4") == 100
    assert value("fractional_controller_gangs_waiting") == 2
    assert value("fractional_controller_gang_longest_wait_seconds") == 30  # team/a since 100; team/c new
    # shares per GPU (2, 0, 1, 1, 3) as a gauge histogram
    buckets = {
        le: value("fractional_controller_gpu_shares_bucket", le=le) for le in ("0", "1", "2", "4", "+Inf")
    }
    assert buckets == {"0": 1, "1": 3, "2": 4, "4": 5, "+Inf": 5}
    assert value("fractional_controller_gpu_shares_gcount") == 5
    assert value("fractional_controller_gpu_shares_gsum") == 7
    assert value("fractional_controller_gang_wait_seconds_bucket", le="1") == 1  # team/c: 0 s
    assert value("fractional_controller_gang_wait_seconds_bucket", le="60") == 2

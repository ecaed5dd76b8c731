"""How fragmented the cluster's GPUs are, computed from the allocator's view (pure functions).

- whole GPUs free: nothing allocated on them;
- memory stranded: free memory on GPUs that are partly used (a share or more holds part of them);
  it fits only shares that small, never a whole-GPU request;
- the largest share that still fits anywhere, per GPU product: the most free memory on one GPU of
  that product (and that GPU's free guaranteed compute);
- shares per GPU (a whole-GPU allocation counts as one);
- gangs waiting and for how long (from the time the controller first saw them gated).

Input: ``ClusterState.free_summary()`` (node -> device -> free/total capacities) and the
ResourceSlices, for the GPU products; NICs (no ``memory`` capacity) are left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from driver import DRIVER_NAME

__all__ = [
    "Fragmentation",
    "GpuCapacity",
    "LargestShare",
    "build_gpu_capacities",
    "compute_fragmentation",
    "products_from_slices",
]


@dataclass(frozen=True, slots=True)
class GpuCapacity:
    node: str
    pool: str
    device: str
    product: str
    memory_total_bytes: int
    memory_free_bytes: int
    compute_total_percent: int
    compute_free_percent: int
    shares: int
    exclusive: bool

    @property
    def free(self) -> bool:
        return not self.exclusive and self.shares == 0

    @property
    def partly_used(self) -> bool:
        return not self.exclusive and self.shares > 0


@dataclass(frozen=True, slots=True)
class LargestShare:
    product: str
    memory_bytes: int
    compute_percent: int


@dataclass(frozen=True, slots=True)
class Fragmentation:
    gpus: int
    gpus_free: int
    stranded_memory_bytes: int
    largest_share: tuple[LargestShare, ...]  # by product name
    shares_per_gpu: tuple[int, ...]  # one entry per GPU
    gangs_waiting: int
    gang_wait_seconds: tuple[float, ...]  # one entry per waiting gang, longest first

    @property
    def longest_wait_seconds(self) -> float:
        return self.gang_wait_seconds[0] if self.gang_wait_seconds else 0.0


def products_from_slices(slices: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], str]:
    """(pool, device) -> ``productName`` of our GPUs."""
    products: dict[tuple[str, str], str] = {}
    for resource_slice in slices:
        spec = resource_slice.get("spec") or {}
        if spec.get("driver") != DRIVER_NAME:
            continue
        pool = str((spec.get("pool") or {}).get("name") or "")
        for device in spec.get("devices") or ():
            attributes = device.get("attributes") or {}
            product = (attributes.get("productName") or {}).get("string")
            if product is not None:
                products[(pool, str(device.get("name")))] = str(product)
    return products


def build_gpu_capacities(
    free_summary: Mapping[str, Mapping[str, Mapping[str, Any]]],
    products: Mapping[tuple[str, str], str],
) -> list[GpuCapacity]:
    """The GPUs (devices with a ``memory`` capacity) of a ``free_summary``, sorted by node and name."""
    gpus = []
    for node, devices in sorted(free_summary.items()):
        for name, info in sorted(devices.items()):
            if "memory_bytes_total" not in info:
                continue
            pool = str(info.get("pool") or node)
            gpus.append(
                GpuCapacity(
                    node=node,
                    pool=pool,
                    device=name,
                    product=products.get((pool, name), "unknown"),
                    memory_total_bytes=int(info["memory_bytes_total"]),
                    memory_free_bytes=int(info.get("memory_bytes_free") or 0),
                    compute_total_percent=int(info.get("compute_total") or 100),
                    compute_free_percent=int(info.get("compute_free") or 0),
                    shares=int(info.get("shares") or 0),
                    exclusive=bool(info.get("exclusive")),
                )
            )
    return gpus


def compute_fragmentation(gpus: Sequence[GpuCapacity], gang_wait_seconds: Iterable[float]) -> Fragmentation:
    largest: dict[str, LargestShare] = {}
    for gpu in gpus:
        if gpu.exclusive:
            continue
        candidate = LargestShare(gpu.product, gpu.memory_free_bytes, gpu.compute_free_percent)
        best = largest.get(gpu.product)
        if best is None or (candidate.memory_bytes, candidate.compute_percent) > (
            best.memory_bytes,
            best.compute_percent,
        ):
            largest[gpu.product] = candidate
    for gpu in gpus:  # a product whose every GPU is taken whole still has a (zero) entry
        largest.setdefault(gpu.product, LargestShare(gpu.product, 0, 0))
    waits = tuple(sorted((max(0.0, float(w)) for w in gang_wait_seconds), reverse=True))
    return Fragmentation(
        gpus=len(gpus),
        gpus_free=sum(1 for gpu in gpus if gpu.free),
        stranded_memory_bytes=sum(gpu.memory_free_bytes for gpu in gpus if gpu.partly_used),
        largest_share=tuple(largest[product] for product in sorted(largest)),
        shares_per_gpu=tuple(1 if gpu.exclusive else gpu.shares for gpu in gpus),
        gangs_waiting=len(waits),
        gang_wait_seconds=waits,
    )

"""Per-GPU usage, computed from our ResourceSlices and the claims' allocations, and the table that
shows it with bars: what ``fractional status`` prints and what the demo ends with. Pure functions
over API-shaped dicts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from driver import DRIVER_NAME

__all__ = ["GIB", "GPUUsage", "compute_gpu_usage", "render_usage_table"]

GIB = 1024**3


def _quantity_int(value: Any) -> int:
    return int(parse_quantity(str(value)))  # type: ignore[no-untyped-call]  # the client is untyped


@dataclass(frozen=True, slots=True)
class GPUUsage:
    node: str
    device: str
    product: str
    memory_total_bytes: int
    memory_used_bytes: int
    compute_used_percent: int
    shares: int
    exclusive: bool  # allocated whole (exclusive result or all memory)


def compute_gpu_usage(slices: list[dict[str, Any]], claims: list[dict[str, Any]]) -> list[GPUUsage]:
    gpus: dict[tuple[str, str], dict[str, Any]] = {}
    for resource_slice in slices:
        spec = resource_slice["spec"]
        if spec.get("driver") != DRIVER_NAME:
            continue
        for device in spec.get("devices") or []:
            attributes = device.get("attributes") or {}
            if (attributes.get("type") or {}).get("string") != "gpu":
                continue
            capacity = device.get("capacity") or {}
            gpus[(spec["pool"]["name"], device["name"])] = {
                "node": spec.get("nodeName", spec["pool"]["name"]),
                "product": (attributes.get("productName") or {}).get("string", "?"),
                "total": _quantity_int((capacity.get("memory") or {}).get("value", 0)),
                "used": 0,
                "compute": 0,
                "shares": 0,
                "exclusive": False,
            }
    for claim in claims:
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            key = (result.get("pool"), result.get("device"))
            if result.get("driver") != DRIVER_NAME or key not in gpus:
                continue
            entry = gpus[key]
            consumed = result.get("consumedCapacity")
            if consumed is None:
                entry["used"] = entry["total"]
                entry["compute"] = 100
                entry["exclusive"] = True
                continue
            entry["used"] += _quantity_int(consumed.get("memory", 0))
            entry["compute"] += _quantity_int(consumed.get("compute", 0))
            entry["shares"] += 1
            if _quantity_int(consumed.get("memory", 0)) >= entry["total"]:
                entry["exclusive"] = True  # all of its memory: nobody else can use it
                entry["compute"] = 100
    return [
        GPUUsage(
            node=v["node"],
            device=k[1],
            product=v["product"],
            memory_total_bytes=v["total"],
            memory_used_bytes=min(v["used"], v["total"]),
            compute_used_percent=min(v["compute"], 100),
            shares=v["shares"],
            exclusive=v["exclusive"],
        )
        for k, v in sorted(gpus.items(), key=lambda item: (item[1]["node"], _device_order(item[0][1])))
    ]


def _device_order(name: str) -> tuple[str, int]:
    prefix, _, number = name.rpartition("-")
    return (prefix, int(number) if number.isdigit() else 0)


def _bar(fraction: float, width: int = 20) -> str:
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * filled + "·" * (width - filled)


def render_usage_table(usage: list[GPUUsage]) -> str:
    lines = [f"{'node':<8} {'gpu':<6} {'product':<22} {'memory used':<36} {'compute':<28} use"]
    for gpu in usage:
        fraction = gpu.memory_used_bytes / gpu.memory_total_bytes if gpu.memory_total_bytes else 0.0
        memory = f"{_bar(fraction)} {gpu.memory_used_bytes / GIB:5.1f}/{gpu.memory_total_bytes / GIB:5.1f}Gi"
        compute = f"{_bar(gpu.compute_used_percent / 100, 16)} {gpu.compute_used_percent:3d}%"
        use = "whole GPU" if gpu.exclusive else (f"{gpu.shares} shares" if gpu.shares else "free")
        lines.append(f"{gpu.node:<8} {gpu.device:<6} {gpu.product[:22]:<22} {memory:<36} {compute:<28} {use}")
    return "\n".join(lines)

"""What the demo shows at the end: per-GPU usage with bars, a packing picture, a comparison. Pure
functions over API objects (slices and claims as dicts), plus one PNG writer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from driver import DRIVER_NAME

__all__ = [
    "GPUUsage",
    "compute_gpu_usage",
    "render_scrape_excerpt",
    "render_usage_table",
    "write_packing_png",
]

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


def write_packing_png(usage: list[GPUUsage], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{g.node}\n{g.device}" for g in usage]
    used = [g.memory_used_bytes / GIB for g in usage]
    free = [(g.memory_total_bytes - g.memory_used_bytes) / GIB for g in usage]
    colors = ["#d62728" if g.exclusive else ("#1f77b4" if g.shares else "#cccccc") for g in usage]
    figure, axis = plt.subplots(figsize=(max(8.0, 0.5 * len(usage)), 4.5))
    axis.bar(range(len(usage)), used, color=colors, label="used")
    axis.bar(range(len(usage)), free, bottom=used, color="#eeeeee", edgecolor="#bbbbbb", label="free")
    for index, gpu in enumerate(usage):
        if gpu.shares and not gpu.exclusive:
            axis.text(
                index, used[index] / 2, str(gpu.shares), ha="center", va="center", color="white", fontsize=8
            )
    axis.set_xticks(range(len(usage)), labels, fontsize=6, rotation=90)
    axis.set_ylabel("GPU memory (GiB)")
    axis.set_title(title)
    from matplotlib.patches import Patch

    axis.legend(
        handles=[
            Patch(color="#1f77b4", label="shared (number = shares)"),
            Patch(color="#d62728", label="whole GPU"),
            Patch(color="#eeeeee", label="free"),
        ],
        loc="upper right",
        fontsize=8,
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


_SCRAPE_FAMILIES = (
    "fractional_gpu_utilization_ratio",
    "fractional_gpu_memory_used_bytes",
    "fractional_gpu_memory_total_bytes",
    "fractional_gpu_temperature_celsius",
    "fractional_gpu_power_watts",
    "fractional_share_memory_allocated_bytes",
    "fractional_share_compute_allocated_percent",
    "fractional_share_memory_used_bytes",
    "fractional_share_compute_used_percent",
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
)


def render_scrape_excerpt(exposition: str, *, node: str, gpu: str, pod: str) -> list[str]:
    """The lines of one /metrics scrape (Prometheus text) about one GPU and one pod's share on it:
    the per-GPU series of ``node``/``gpu``, the pod's per-share series, and its dcgm-exporter twins."""
    from prometheus_client.parser import text_string_to_metric_families

    uuid = ""
    lines: list[str] = []
    samples = [s for family in text_string_to_metric_families(exposition) for s in family.samples]
    for sample in samples:
        if sample.labels.get("node") == node and sample.labels.get("gpu") == gpu and "uuid" in sample.labels:
            uuid = sample.labels["uuid"]
            break
    for name in _SCRAPE_FAMILIES:
        for sample in samples:
            labels = sample.labels
            if sample.name != name:
                continue
            if name.startswith("fractional_gpu_"):
                keep = labels.get("node") == node and labels.get("gpu") == gpu
            elif name.startswith("fractional_share_"):
                keep = labels.get("pod") == pod and labels.get("gpu") == gpu
            else:
                keep = labels.get("pod") == pod and labels.get("UUID") == uuid
            if keep:
                text = ",".join(f'{key}="{value}"' for key, value in labels.items())
                value = int(sample.value) if float(sample.value).is_integer() else round(sample.value, 3)
                lines.append(f"{name}{{{text}}} {value}")
    return lines

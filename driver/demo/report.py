"""What the demo shows at the end besides the usage table (``driver.gpu_usage``): a packing picture
and an excerpt of a metrics scrape. Pure functions over API objects, plus one PNG writer."""

from __future__ import annotations

from pathlib import Path

from driver.gpu_usage import GIB, GPUUsage

__all__ = [
    "render_scrape_excerpt",
    "write_packing_png",
]


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

"""The demo's end-of-run report: usage per GPU from slices and allocations (pure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from driver.demo.report import render_scrape_excerpt, write_packing_png
from driver.gpu_usage import compute_gpu_usage, render_usage_table
from driver.inventory.discover import discover_inventory
from driver.slices import build_resource_slices


def _result(device: str, *, memory: str | None, compute: str = "0") -> dict[str, Any]:
    result: dict[str, Any] = {
        "request": "gpu",
        "driver": "fractional.dev",
        "pool": "node-a",
        "device": device,
    }
    if memory is not None:
        result["shareID"] = "0b5f2f5c-1c55-4a52-9d0c-0d5a2f6b9e11"
        result["consumedCapacity"] = {"memory": memory, "compute": compute}
    return result


def _claim(*results: dict[str, Any]) -> dict[str, Any]:
    return {"status": {"allocation": {"devices": {"results": list(results)}}}}


def test_usage_counts_shares_and_whole_gpus(tmp_path: Path) -> None:
    slices = build_resource_slices(discover_inventory(backend="fake", profile="l4-2x", node_name="node-a"))
    claims = [
        _claim(_result("gpu-0", memory="12Gi", compute="15")),
        _claim(_result("gpu-0", memory="4Gi", compute="20")),
        _claim(_result("gpu-1", memory=None)),  # exclusive result: the whole GPU
        _claim({**_result("nic-0", memory=None)}),  # not a GPU: ignored
        {"status": {}},  # not allocated
    ]
    usage = {u.device: u for u in compute_gpu_usage(slices, claims)}
    assert set(usage) == {"gpu-0", "gpu-1"}
    shared, whole = usage["gpu-0"], usage["gpu-1"]
    assert (shared.memory_used_bytes, shared.compute_used_percent, shared.shares) == (16 * 1024**3, 35, 2)
    assert not shared.exclusive
    assert whole.exclusive and whole.memory_used_bytes == whole.memory_total_bytes
    assert whole.compute_used_percent == 100
    table = render_usage_table(list(usage.values()))
    assert "2 shares" in table and "whole GPU" in table
    picture = write_packing_png(list(usage.values()), tmp_path / "p.png", "test")
    assert picture.read_bytes().startswith(b"\x89PNG")


_GPU0 = 'node="node-a",gpu="gpu-0",uuid="GPU-0",product="L4"'
_SHARE = 'node="node-a",namespace="demo",container="",gpu="gpu-0",uuid="GPU-0"'
_DCGM = (
    'gpu="{0}",UUID="GPU-{0}",pci_bus_id="0000:0{0}:00.0",device="nvidia{0}",modelName="L4",Hostname="node-a"'
)
SCRAPE = "\n".join(
    [
        "# TYPE fractional_gpu_utilization_ratio gauge",
        f"fractional_gpu_utilization_ratio{{{_GPU0}}} 0.25",
        'fractional_gpu_utilization_ratio{node="node-a",gpu="gpu-1",uuid="GPU-1",product="L4"} 0.0',
        "# TYPE fractional_share_memory_allocated_bytes gauge",
        f'fractional_share_memory_allocated_bytes{{{_SHARE},pod="infer-0",claim="c0"}} 1.2884901888e+010',
        f'fractional_share_memory_allocated_bytes{{{_SHARE},pod="infer-2",claim="c2"}} 1.2884901888e+010',
        "# TYPE DCGM_FI_DEV_GPU_UTIL gauge",
        f'DCGM_FI_DEV_GPU_UTIL{{{_DCGM.format(0)},namespace="demo",pod="infer-0",container=""}} 25.0',
        f'DCGM_FI_DEV_GPU_UTIL{{{_DCGM.format(1)},namespace="",pod="",container=""}} 0.0',
        "",
    ]
)


def test_scrape_excerpt_keeps_one_gpu_and_one_pod() -> None:
    lines = render_scrape_excerpt(SCRAPE, node="node-a", gpu="gpu-0", pod="infer-0")
    assert [line.split("{")[0] for line in lines] == [
        "fractional_gpu_utilization_ratio",
        "fractional_share_memory_allocated_bytes",
        "DCGM_FI_DEV_GPU_UTIL",
    ]
    assert lines[0].endswith("} 0.25") and 'gpu="gpu-0"' in lines[0]
    assert 'pod="infer-0"' in lines[1] and lines[1].endswith("} 12884901888")
    assert 'UUID="GPU-0"' in lines[2] and 'pod="infer-0"' in lines[2] and lines[2].endswith("} 25")

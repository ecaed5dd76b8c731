"""The demo's end-of-run report: usage per GPU from slices and allocations (pure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from driver.demo.report import compute_gpu_usage, render_usage_table, write_packing_png
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

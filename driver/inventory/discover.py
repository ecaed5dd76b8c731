"""One entry point over the backends, whether NVML answers on this machine (``probe_nvml``), and
the inventory table ``fractional discover`` prints."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from driver.errors import InventoryError
from driver.inventory.model import GPU, NIC, NodeInventory

__all__ = ["NVML_LIBRARY", "discover_inventory", "probe_nvml", "render_inventory_table"]

GIB = 1024**3
NVML_LIBRARY = "libnvidia-ml.so.1"  # what pynvml loads (NVML API reference, "Initialization")
_SHARE_STEP_BYTES = 256 * 1024**2
# nvmlReturn_t values (stable ABI), read from the module when it has them
_LIBRARY_NOT_FOUND = 12
_DRIVER_NOT_LOADED = 9


def probe_nvml(nvml_module: Any | None = None) -> str | None:
    """None when NVML answers here (pynvml imports and ``nvmlInit`` succeeds; it is shut down
    again), else why not, in words (e.g. "libnvidia-ml.so.1 not found")."""
    nvml = nvml_module
    if nvml is None:
        try:
            import pynvml
        except ImportError as error:
            return f"pynvml (nvidia-ml-py) is not importable: {error}"
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        code = getattr(error, "value", None)
        if code == getattr(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", _LIBRARY_NOT_FOUND):
            return f"{NVML_LIBRARY} not found"
        if code == getattr(nvml, "NVML_ERROR_DRIVER_NOT_LOADED", _DRIVER_NOT_LOADED):
            return "the NVIDIA driver is not loaded"
        return f"nvmlInit failed: {error}"
    with contextlib.suppress(nvml.NVMLError):  # it answered; discovery initializes it again
        nvml.nvmlShutdown()
    return None


def discover_inventory(
    *,
    backend: str,
    profile: str | Path | None = None,
    sysfs_root: str | Path = "/sys",
    node_name: str,
) -> NodeInventory:
    """``fake``: the profile (a shipped name such as ``h100-8x``, or a YAML path); ``nvml``: NVML + sysfs."""
    if backend == "fake":
        from driver.inventory.fake import load_profile, resolve_profile

        if not profile:
            raise InventoryError(source="fake", problem="a profile (name or file) is required")
        return load_profile(resolve_profile(profile), node_name=node_name)
    if backend == "nvml":
        from driver.inventory.nvml import discover_nvml

        return discover_nvml(node_name=node_name, sysfs_root=sysfs_root)
    raise InventoryError(source=str(backend), problem="unknown backend (known: fake, nvml)")


def render_inventory_table(inventory: NodeInventory) -> str:
    """A fixed-width table: one row per device, GPUs then NICs; memory is what a slice publishes."""
    header = ("DEVICE", "TYPE", "PRODUCT", "MEMORY (GiB)", "COMPUTE", "NUMA", "PCIE ROOT", "PAIRED")
    rows = [_gpu_row(inventory, gpu) for gpu in inventory.gpus] + [
        _nic_row(inventory, nic) for nic in inventory.nics
    ]
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]
    lines = [
        f"node {inventory.node_name}  backend {inventory.backend}  "
        f"driver {inventory.driver_version or '-'}  CUDA {inventory.cuda_driver_version or '-'}  "
        f"{len(inventory.gpus)} GPUs  {len(inventory.nics)} NICs  {len(inventory.numa_nodes)} NUMA nodes",
    ]
    lines += [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    return "\n".join(lines)


def _gpu_row(inventory: NodeInventory, gpu: GPU) -> tuple[str, ...]:
    published = gpu.memory_bytes - gpu.memory_bytes % _SHARE_STEP_BYTES
    paired = inventory.paired_nic(gpu)
    compute = f"{gpu.multiprocessors} SMs" if gpu.multiprocessors else "100%"
    return (
        gpu.name,
        "gpu",
        gpu.product_name + (" (MIG on)" if gpu.mig_enabled else ""),
        f"{published / GIB:.2f}",
        compute,
        _text(gpu.numa_node),
        gpu.pcie_root or "-",
        paired.name if paired else "-",
    )


def _nic_row(inventory: NodeInventory, nic: NIC) -> tuple[str, ...]:
    paired = inventory.paired_gpu(nic)
    product = nic.if_name + (f"/{nic.rdma_device}" if nic.rdma_device else "")
    if nic.link_speed_mbps:
        speed = nic.link_speed_mbps
        product += f" {speed // 1000} Gb/s" if speed % 1000 == 0 else f" {speed} Mb/s"
    return (
        nic.name,
        "nic",
        product,
        "-",
        "-",
        _text(nic.numa_node),
        nic.pcie_root or "-",
        paired.name if paired else "-",
    )


def _text(value: int | None) -> str:
    return "-" if value is None else str(value)

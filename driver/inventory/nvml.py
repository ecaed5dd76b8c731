"""The ``nvml`` backend: real GPU discovery through pynvml (``nvidia-ml-py``), merged with sysfs.

The module is injectable (``discover_nvml(nvml_module=...)``) so tests run a fake pynvml on
machines without GPUs. NVML errors become ``InventoryError`` naming the GPU index and the call.
NVML knows GPUs; sysfs knows the rest (NUMA node, PCIe root, local CPUs, NICs): both are joined
by PCI bus id. The calls are those of the NVML API reference (https://docs.nvidia.com/deploy/nvml-api/).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from driver.errors import InventoryError
from driver.inventory import sysfs
from driver.inventory.model import (
    GPU,
    NodeInventory,
    assign_device_names,
    normalize_pci_bus_id,
    normalize_version,
)

__all__ = ["discover_nvml"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# NVML C enums (stable ABI values of nvmlBrandType_t / nvmlDeviceArchitecture_t).
_BRANDS = {
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "GRID",
    5: "GeForce",
    6: "Titan",
    7: "NVIDIA Virtual Applications",
    8: "NVIDIA Virtual PC",
    9: "NVIDIA Virtual Compute Server",
    10: "NVIDIA RTX Virtual Workstation",
    11: "NVIDIA Cloud Gaming",
    12: "Quadro RTX",
    13: "NVIDIA RTX",
    14: "NVIDIA",
    15: "GeForce RTX",
    16: "Titan RTX",
}
_ARCHITECTURES = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
    13: "Rubin",
}
# FP32 CUDA cores per SM by compute capability (CUDA programming guide, "Arithmetic Instructions").
_CORES_PER_SM = {
    (7, 0): 64,
    (7, 2): 64,
    (7, 5): 64,
    (8, 0): 64,
    (8, 6): 128,
    (8, 7): 128,
    (8, 9): 128,
    (9, 0): 128,
    (10, 0): 128,
    (10, 3): 128,
    (11, 0): 128,
    (12, 0): 128,
    (12, 1): 128,
}
_NVML_DEVICE_MIG_ENABLE = 1
_NVML_NVLINK_MAX_LINKS = 36
_NVML_GPU_INSTANCE_PROFILE_COUNT = 0x12
_ABSENT = (
    "NVMLError_NotSupported",
    "NVMLError_InvalidArgument",
    "NVMLError_NotFound",
    "NVMLError_FunctionNotFound",
)


def discover_nvml(
    nvml_module: ModuleType | Any | None = None, *, node_name: str, sysfs_root: str | Path = "/sys"
) -> NodeInventory:
    """All GPUs NVML sees plus the NICs sysfs sees, named in PCI bus id order."""
    nvml = nvml_module if nvml_module is not None else _import_pynvml()
    reader = _NVMLReader(nvml)
    reader.call(None, "nvmlInit", nvml.nvmlInit)
    try:
        count = reader.call(None, "nvmlDeviceGetCount", nvml.nvmlDeviceGetCount)
        driver_version = _version(
            reader.call(None, "nvmlSystemGetDriverVersion", nvml.nvmlSystemGetDriverVersion), "driverVersion"
        )
        cuda_raw = reader.call(
            None, "nvmlSystemGetCudaDriverVersion_v2", nvml.nvmlSystemGetCudaDriverVersion_v2
        )
        cuda_version = f"{int(cuda_raw) // 1000}.{(int(cuda_raw) % 1000) // 10}.0"
        gpus = [reader.gpu(index) for index in range(int(count))]
        gpus = reader.link_nvlink(gpus)
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as error:  # shutting down cannot undo anything: log and go on
            log.warning("nvmlShutdown failed", extra={"error": str(error)})
    gpus = [_with_sysfs(gpu, sysfs_root) for gpu in gpus]
    nics = sysfs.discover_nics(sysfs_root)
    named_gpus, named_nics = assign_device_names(gpus, nics)
    return NodeInventory(
        node_name=node_name,
        gpus=named_gpus,
        nics=named_nics,
        numa_nodes=sysfs.read_numa_nodes(sysfs_root),
        driver_version=driver_version,
        cuda_driver_version=cuda_version,
        backend="nvml",
    )


def _import_pynvml() -> Any:
    try:
        import pynvml
    except ImportError as error:  # nvidia-ml-py is a declared dependency; say what is missing
        raise InventoryError(
            source="nvml", problem=f"pynvml (nvidia-ml-py) is not importable: {error}"
        ) from error
    return pynvml


def _version(raw: str | bytes, field: str) -> str:
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    try:
        return normalize_version(text)
    except ValueError as error:
        raise InventoryError(source="nvml", field=field, problem=str(error)) from None


def _text(raw: str | bytes) -> str:
    return (raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)).rstrip("\x00").strip()


def _with_sysfs(gpu: GPU, sysfs_root: str | Path) -> GPU:
    try:
        info = sysfs.read_pci_device(sysfs_root, gpu.pci_bus_id)
    except InventoryError:
        log.warning("GPU missing from sysfs; topology unknown", extra={"pci_bus_id": gpu.pci_bus_id})
        return gpu
    return replace(gpu, numa_node=info.numa_node, pcie_root=info.pcie_root, local_cpus=info.local_cpus)


class _NVMLReader:
    """The NVML calls for one discovery pass; every failure names the GPU index and the call."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.handles: dict[int, Any] = {}

    def call(self, index: int | None, what: str, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return function(*args, **kwargs)
        except self.nvml.NVMLError as error:
            raise InventoryError(
                source="nvml",
                device=None if index is None else f"GPU index {index}",
                field=what,
                problem=str(error),
            ) from error

    def absent(self, error: BaseException) -> bool:
        """NVML's way of saying "this GPU has no such thing" (as opposed to a failure)."""
        return any(
            isinstance(error, cls) for cls in (getattr(self.nvml, name, None) for name in _ABSENT) if cls
        )

    def gpu(self, index: int) -> GPU:
        nvml = self.nvml
        handle = self.call(index, "nvmlDeviceGetHandleByIndex", nvml.nvmlDeviceGetHandleByIndex, index)
        self.handles[index] = handle
        major, minor = self.call(
            index, "nvmlDeviceGetCudaComputeCapability", nvml.nvmlDeviceGetCudaComputeCapability, handle
        )
        pci = self.call(index, "nvmlDeviceGetPciInfo", nvml.nvmlDeviceGetPciInfo, handle)
        try:
            bus_id = normalize_pci_bus_id(pci.busId)
        except ValueError as error:
            raise InventoryError(
                source="nvml",
                device=f"GPU index {index}",
                field="nvmlDeviceGetPciInfo.busId",
                problem=str(error),
            ) from None
        brand = self.call(index, "nvmlDeviceGetBrand", nvml.nvmlDeviceGetBrand, handle)
        architecture = self.call(index, "nvmlDeviceGetArchitecture", nvml.nvmlDeviceGetArchitecture, handle)
        return GPU(
            name="",
            uuid=_text(self.call(index, "nvmlDeviceGetUUID", nvml.nvmlDeviceGetUUID, handle)),
            product_name=_text(self.call(index, "nvmlDeviceGetName", nvml.nvmlDeviceGetName, handle)),
            brand=_BRANDS.get(int(brand), "Unknown"),
            architecture=_ARCHITECTURES.get(int(architecture), "Unknown"),
            cuda_compute_capability=f"{int(major)}.{int(minor)}.0",
            memory_bytes=self.usable_memory(index, handle),
            multiprocessors=self.multiprocessors(index, handle, (int(major), int(minor))),
            pci_bus_id=bus_id,
            minor_number=self.optional(index, "nvmlDeviceGetMinorNumber", handle),
            nvml_index=index,
            mig_enabled=self.mig_enabled(index, handle),
        )

    def optional(self, index: int, what: str, *args: Any) -> Any:
        function = getattr(self.nvml, what, None)
        if function is None:
            return None
        try:
            return function(*args)
        except self.nvml.NVMLError as error:
            if self.absent(error):
                return None
            raise InventoryError(
                source="nvml", device=f"GPU index {index}", field=what, problem=str(error)
            ) from error

    def usable_memory(self, index: int, handle: Any) -> int:
        """``total - reserved`` from ``nvmlDeviceGetMemoryInfo(h, version=nvmlMemory_v2)``."""
        nvml = self.nvml
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
            return int(info.total) - int(info.reserved)
        except nvml.NVMLError as error:
            if not self.absent(error):
                raise InventoryError(
                    source="nvml",
                    device=f"GPU index {index}",
                    field="nvmlDeviceGetMemoryInfo_v2",
                    problem=str(error),
                ) from error
        log.warning("memory info v2 unsupported; publishing total memory", extra={"nvml_index": index})
        return int(self.call(index, "nvmlDeviceGetMemoryInfo", nvml.nvmlDeviceGetMemoryInfo, handle).total)

    def multiprocessors(self, index: int, handle: Any, capability: tuple[int, int]) -> int:
        """SM count of a full GPU: device attributes are for MIG handles only, so use (1) CUDA cores
        / cores per SM for the compute capability, else (2) the largest MIG GPU-instance profile's
        ``multiprocessorCount`` (a lower bound on A100: 98 of 108), else 0 with a warning."""
        cores = self.optional(index, "nvmlDeviceGetNumGpuCores", handle)
        per_sm = _CORES_PER_SM.get(capability)
        if cores and per_sm and int(cores) % per_sm == 0:
            return int(cores) // per_sm
        best = 0
        profile_count = int(
            getattr(self.nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", _NVML_GPU_INSTANCE_PROFILE_COUNT)
        )
        for profile in range(profile_count):
            info = self.optional(index, "nvmlDeviceGetGpuInstanceProfileInfo", handle, profile)
            if info is not None:
                best = max(best, int(info.multiprocessorCount))
        if best == 0:
            log.warning("SM count unknown for GPU", extra={"nvml_index": index})
        return best

    def mig_enabled(self, index: int, handle: Any) -> bool:
        modes = self.optional(index, "nvmlDeviceGetMigMode", handle)
        enabled = bool(modes) and int(modes[0]) == _NVML_DEVICE_MIG_ENABLE
        if enabled:
            log.warning("MIG is enabled; the GPU is published whole", extra={"nvml_index": index})
        return enabled

    def nvlink_remotes(self, index: int, handle: Any) -> list[str]:
        """PCI bus ids at the far end of each active NVLink (GPUs or NVSwitches)."""
        nvml = self.nvml
        remotes = []
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", _NVML_NVLINK_MAX_LINKS))):
            call = "nvmlDeviceGetNvLinkState"
            try:
                if not nvml.nvmlDeviceGetNvLinkState(handle, link):
                    continue
                call = "nvmlDeviceGetNvLinkRemotePciInfo"
                remote = nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
            except nvml.NVMLError as error:
                if self.absent(error):
                    if link == 0:
                        break  # no NVLink on this GPU at all
                    continue  # this link is absent; later ones may exist
                where = f"GPU index {index}"
                raise InventoryError(
                    source="nvml", device=where, field=f"{call}(link {link})", problem=str(error)
                ) from error
            remotes.append(normalize_pci_bus_id(remote.busId))
        return remotes

    def link_nvlink(self, gpus: list[GPU]) -> list[GPU]:
        """Peers = GPUs connected over NVLink, directly or through a shared NVSwitch; each connected
        group of two or more GPUs is one ``nvlinkDomain`` (``nvlink-<n>``, by lowest bus id)."""
        parent: dict[str, str] = {}

        def find(key: str) -> str:
            parent.setdefault(key, key)
            while parent[key] != key:
                parent[key] = parent[parent[key]]
                key = parent[key]
            return key

        for gpu in gpus:
            find(gpu.pci_bus_id)
            if gpu.nvml_index is None:
                continue
            for remote in self.nvlink_remotes(gpu.nvml_index, self.handles[gpu.nvml_index]):
                parent[find(remote)] = find(gpu.pci_bus_id)
        groups: dict[str, list[str]] = {}
        for gpu in gpus:
            groups.setdefault(find(gpu.pci_bus_id), []).append(gpu.pci_bus_id)
        linked = sorted(
            (sorted(members) for members in groups.values() if len(members) > 1), key=lambda m: m[0]
        )
        domain_of = {bus: f"nvlink-{number}" for number, members in enumerate(linked) for bus in members}
        members_of = {bus: members for members in linked for bus in members}
        return [
            replace(
                gpu,
                nvlink_domain=domain_of.get(gpu.pci_bus_id),
                nvlink_peers=tuple(
                    bus for bus in members_of.get(gpu.pci_bus_id, []) if bus != gpu.pci_bus_id
                ),
            )
            for gpu in gpus
        ]

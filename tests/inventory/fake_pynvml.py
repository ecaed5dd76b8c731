"""A fake ``pynvml`` module: just the calls ``driver.inventory.nvml`` makes, over a list of fake GPUs.

Errors are the real ``pynvml.NVMLError`` classes (``NVMLError(NVML_ERROR_NOT_SUPPORTED)`` is an
``NVMLError_NotSupported``), constants are the real ones, and string results can be ``bytes`` as
older nvidia-ml-py releases returned them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

__all__ = ["FakeGPU", "FakeNVML", "H100_CORES"]

NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
INVALID_ARGUMENT = pynvml.NVML_ERROR_INVALID_ARGUMENT
GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
H100_CORES = 132 * 128
MIB = 1024 * 1024


@dataclass
class FakeGPU:
    uuid: str
    bus_id: str  # as NVML reports it, e.g. "00000000:1B:00.0"
    name: str = "NVIDIA H100 80GB HBM3"
    brand: int = pynvml.NVML_BRAND_NVIDIA
    architecture: int = pynvml.NVML_DEVICE_ARCH_HOPPER
    capability: tuple[int, int] = (9, 0)
    total_bytes: int = 81559 * MIB
    reserved_bytes: int = 476 * MIB
    minor: int = 0
    cores: int | None = H100_CORES  # None: nvmlDeviceGetNumGpuCores is NotSupported
    mig_profile_sms: dict[int, int] = field(default_factory=dict)  # GI profile id -> multiprocessorCount
    mig_mode: tuple[int, int] | None = (0, 0)  # None: NotSupported
    nvlinks: list[str] | None = None  # remote bus ids of active links; None: NotSupported on link 0
    failing: dict[str, int] = field(default_factory=dict)  # call name -> NVML error code


class FakeNVML(SimpleNamespace):
    """Use as ``discover_nvml(nvml_module=FakeNVML(gpus), ...)``."""

    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_InvalidArgument = pynvml.NVMLError_InvalidArgument
    NVMLError_NotFound = pynvml.NVMLError_NotFound
    NVMLError_FunctionNotFound = pynvml.NVMLError_FunctionNotFound
    nvmlMemory_v2 = pynvml.nvmlMemory_v2
    NVML_NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS
    NVML_GPU_INSTANCE_PROFILE_COUNT = pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT

    def __init__(
        self,
        gpus: list[FakeGPU],
        *,
        driver_version: str | bytes = "550.54.15",
        cuda_version: int = 12040,
        as_bytes: bool = False,
        memory_v2_supported: bool = True,
    ) -> None:
        super().__init__()
        self.gpus = gpus
        self.driver_version = driver_version
        self.cuda_version = cuda_version
        self.as_bytes = as_bytes
        self.memory_v2_supported = memory_v2_supported
        self.initialized = 0
        self.shutdowns = 0
        self.calls: list[str] = []

    # helpers -----------------------------------------------------------------------------------

    def _gpu(self, handle: Any, call: str) -> FakeGPU:
        self.calls.append(call)
        if self.initialized <= self.shutdowns:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        gpu = self.gpus[handle.index]
        if call in gpu.failing:
            raise pynvml.NVMLError(gpu.failing[call])
        return gpu

    def _str(self, text: str) -> str | bytes:
        return text.encode() if self.as_bytes else text

    # system ------------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        return (
            self.driver_version if isinstance(self.driver_version, bytes) else self._str(self.driver_version)
        )

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.cuda_version

    # device ------------------------------------------------------------------------------------

    def nvmlDeviceGetHandleByIndex(self, index: int) -> SimpleNamespace:
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(INVALID_ARGUMENT)
        return SimpleNamespace(index=index)

    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes:
        return self._str(self._gpu(handle, "nvmlDeviceGetUUID").uuid)

    def nvmlDeviceGetName(self, handle: Any) -> str | bytes:
        return self._str(self._gpu(handle, "nvmlDeviceGetName").name)

    def nvmlDeviceGetBrand(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetBrand").brand

    def nvmlDeviceGetArchitecture(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetArchitecture").architecture

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        return self._gpu(handle, "nvmlDeviceGetCudaComputeCapability").capability

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetMinorNumber").minor

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> SimpleNamespace:
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        if version is None:
            return SimpleNamespace(total=gpu.total_bytes, free=gpu.total_bytes, used=0)
        if not self.memory_v2_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        usable = gpu.total_bytes - gpu.reserved_bytes
        return SimpleNamespace(
            version=version, total=gpu.total_bytes, reserved=gpu.reserved_bytes, free=usable, used=0
        )

    def nvmlDeviceGetPciInfo(self, handle: Any) -> SimpleNamespace:
        gpu = self._gpu(handle, "nvmlDeviceGetPciInfo")
        return SimpleNamespace(busId=gpu.bus_id.encode() if self.as_bytes else gpu.bus_id)

    def nvmlDeviceGetNumGpuCores(self, handle: Any) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetNumGpuCores")
        if gpu.cores is None:
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return gpu.cores

    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, handle: Any, profile: int, version: int = 2
    ) -> SimpleNamespace:
        gpu = self._gpu(handle, "nvmlDeviceGetGpuInstanceProfileInfo")
        if profile not in gpu.mig_profile_sms:
            raise pynvml.NVMLError(NOT_SUPPORTED if not gpu.mig_profile_sms else INVALID_ARGUMENT)
        return SimpleNamespace(id=profile, multiprocessorCount=gpu.mig_profile_sms[profile])

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        gpu = self._gpu(handle, "nvmlDeviceGetMigMode")
        if gpu.mig_mode is None:
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return list(gpu.mig_mode)

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetNvLinkState")
        if gpu.nvlinks is None:
            raise pynvml.NVMLError(NOT_SUPPORTED)
        if link >= len(gpu.nvlinks):
            raise pynvml.NVMLError(INVALID_ARGUMENT)
        return 1 if gpu.nvlinks[link] else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Any, link: int) -> SimpleNamespace:
        gpu = self._gpu(handle, "nvmlDeviceGetNvLinkRemotePciInfo")
        assert gpu.nvlinks is not None and gpu.nvlinks[link], "only asked for active links"
        remote = gpu.nvlinks[link]
        return SimpleNamespace(busId=remote.encode() if self.as_bytes else remote)

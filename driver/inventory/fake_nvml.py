"""The fake backend's NVML stand-in: the part of ``pynvml`` that telemetry reads, for fake GPUs.

``FakeNVML(inventory)`` answers the same calls, with the same names and error class, as pynvml
does on a real node: utilisation, memory, temperature, power, running compute processes and
per-process utilisation samples. One code path (``driver.plugin.gpu_metrics.NVMLTelemetry``)
therefore reads real GPUs and fake ones alike.

The figures follow from the processes the stand-in is told about (``start_process`` /
``end_process``): memory used is the sum of their memory, utilisation the sum of their SM
percentages (at most 100), temperature and power rise with utilisation. A GPU with no process is
idle: 0 % utilisation, no memory used, 30 °C, 15 % of its power limit. Deterministic, no clock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from driver.inventory.model import NodeInventory

__all__ = ["FakeNVML", "FakeNVMLError", "FakeProcess"]

IDLE_TEMPERATURE_CELSIUS = 30
FULL_LOAD_TEMPERATURE_RISE = 45  # °C above idle at 100 % utilisation
POWER_LIMIT_MILLIWATTS = 400_000
IDLE_POWER_FRACTION = 0.15


class FakeNVMLError(Exception):
    """pynvml's ``NVMLError``: carries the NVML return code in ``value``."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass(frozen=True, slots=True)
class FakeProcess:
    pid: int
    gpu_uuid: str
    memory_bytes: int
    sm_percent: int = 0


@dataclass(frozen=True, slots=True)
class _Handle:
    uuid: str


@dataclass(frozen=True, slots=True)
class _Utilization:
    gpu: int
    memory: int


@dataclass(frozen=True, slots=True)
class _Memory:
    total: int
    free: int
    used: int


@dataclass(frozen=True, slots=True)
class _ProcessInfo:  # pynvml's c_nvmlProcessInfo_t
    pid: int
    usedGpuMemory: int


@dataclass(frozen=True, slots=True)
class _ProcessSample:  # pynvml's c_nvmlProcessUtilizationSample_t
    pid: int
    timeStamp: int
    smUtil: int
    memUtil: int
    encUtil: int = 0
    decUtil: int = 0


class FakeNVML:
    """pynvml-shaped; method names are pynvml's (hence the camelCase)."""

    NVMLError = FakeNVMLError
    NVML_ERROR_NOT_FOUND = 6
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, inventory: NodeInventory) -> None:
        self._total = {gpu.uuid: gpu.memory_bytes for gpu in inventory.gpus}
        self._driver_version = inventory.driver_version or ""
        self._cuda_driver_version = inventory.cuda_driver_version or "0.0.0"
        self._processes: dict[int, FakeProcess] = {}
        self._lock = threading.Lock()
        self._sample_clock = 0  # a counter, not a clock: each start_process is a newer sample

    # -- what the stand-in is told -----------------------------------------------------------------

    def start_process(self, process: FakeProcess) -> None:
        if process.gpu_uuid not in self._total:
            raise FakeNVMLError(self.NVML_ERROR_NOT_FOUND)
        with self._lock:
            self._processes[process.pid] = process

    def end_process(self, pid: int) -> None:
        with self._lock:
            self._processes.pop(pid, None)

    def _on(self, uuid: str) -> list[FakeProcess]:
        with self._lock:
            return [p for p in self._processes.values() if p.gpu_uuid == uuid]

    # -- the pynvml surface ------------------------------------------------------------------------

    def nvmlSystemGetDriverVersion(self) -> str:
        return self._driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        """NVML's encoding: 12040 for CUDA 12.4."""
        major, minor, *_ = (int(part) for part in self._cuda_driver_version.split("."))
        return major * 1000 + minor * 10

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> _Handle:
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        if text not in self._total:
            raise FakeNVMLError(self.NVML_ERROR_NOT_FOUND)
        return _Handle(text)

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> _Utilization:
        processes = self._on(handle.uuid)
        used = sum(p.memory_bytes for p in processes)
        total = self._total[handle.uuid]
        return _Utilization(
            gpu=min(100, sum(p.sm_percent for p in processes)),
            memory=round(100 * used / total) if total else 0,
        )

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> _Memory:
        total = self._total[handle.uuid]
        used = min(total, sum(p.memory_bytes for p in self._on(handle.uuid)))
        return _Memory(total=total, free=total - used, used=used)

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        utilization = self.nvmlDeviceGetUtilizationRates(handle).gpu
        return IDLE_TEMPERATURE_CELSIUS + FULL_LOAD_TEMPERATURE_RISE * utilization // 100

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        """Milliwatts, as NVML reports them."""
        utilization = self.nvmlDeviceGetUtilizationRates(handle).gpu
        fraction = IDLE_POWER_FRACTION + (1 - IDLE_POWER_FRACTION) * utilization / 100
        return round(POWER_LIMIT_MILLIWATTS * fraction)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[_ProcessInfo]:
        return [_ProcessInfo(pid=p.pid, usedGpuMemory=p.memory_bytes) for p in self._on(handle.uuid)]

    def nvmlDeviceGetProcessUtilization(
        self, handle: _Handle, last_seen_timestamp: int
    ) -> list[_ProcessSample]:
        processes = self._on(handle.uuid)
        if not processes:
            raise FakeNVMLError(self.NVML_ERROR_NOT_FOUND)  # what NVML answers when it has no sample
        self._sample_clock += 1
        return [
            _ProcessSample(pid=p.pid, timeStamp=self._sample_clock, smUtil=p.sm_percent, memUtil=0)
            for p in processes
        ]

"""GPU and per-share metrics of the node agent, read from NVML at scrape time.

Per GPU (labels ``node``, ``gpu`` (device name), ``uuid``, ``product``):
``fractional_gpu_utilization_ratio``, ``fractional_gpu_memory_used_bytes``,
``fractional_gpu_memory_total_bytes``, ``fractional_gpu_temperature_celsius``,
``fractional_gpu_power_watts``, ``fractional_gpu_xid_errors_total``.

Per share, one series per GPU result of a prepared claim (labels ``namespace``, ``pod``,
``container``, ``claim``, ``gpu``, ``uuid``; also ``node``):
``fractional_share_memory_allocated_bytes``, ``fractional_share_compute_allocated_percent``
(``container`` empty: a share belongs to the claim, whichever container uses it), and, per
container running on the share, ``fractional_share_memory_used_bytes`` (NVML's per-process memory
of the running compute processes, mapped to pod and container through ``/proc/<pid>/cgroup``) and
``fractional_share_compute_used_percent`` (NVML's per-process SM utilisation samples, where the GPU
offers them). Shares come from the checkpoint, so they appear when a claim is prepared and vanish
when it is unprepared. ``container`` is the runtime's container ID (its first 12 hex digits, as
``crictl ps`` shows it): the cgroup names the container by ID, and mapping it to the container's
name would need the kubelet's pod-resources API or read access to pods, which the agent has not.

With ``--dcgm-metrics`` the same per-GPU figures are also emitted under dcgm-exporter's names and
labels (``internal/pkg/rendermetrics/render_metrics.go``: ``gpu`` (index), ``UUID``,
``pci_bus_id``, ``device`` (``nvidia<minor>``), ``modelName``, ``Hostname``; pod attributes from
``internal/pkg/transformation/const.go``: ``namespace``, ``pod``, ``container``), and, like
dcgm-exporter does for a GPU shared by several pods, one series per pod holding a share of it with
the device's figures (one series with empty pod labels when nobody does): ``DCGM_FI_DEV_GPU_UTIL``
(%), ``DCGM_FI_DEV_FB_USED`` / ``DCGM_FI_DEV_FB_FREE`` (MiB), ``DCGM_FI_DEV_GPU_TEMP`` (°C),
``DCGM_FI_DEV_POWER_USAGE`` (W).

One collector per process (``GPU_METRICS``, on the default registry) serves every agent running in
it (tests, benchmarks); each agent adds its ``GpuMetricsSource``.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from driver.inventory.model import GPU, NodeInventory
from driver.plugin.checkpoint import ClaimPhase, PreparedClaim
from driver.plugin.usage import ContainerIdentity, PodIndex, PodRef, read_process_container

__all__ = [
    "DCGM_METRIC_NAMES",
    "GPU_METRICS",
    "GpuMetricsCollector",
    "GpuMetricsSource",
    "GpuReading",
    "NVMLTelemetry",
    "ProcessReading",
    "XidCounter",
]

log = logging.getLogger(__name__)

MIB = 1024 * 1024
GPU_LABELS = ("node", "gpu", "uuid", "product")
SHARE_LABELS = ("node", "namespace", "pod", "container", "claim", "gpu", "uuid")
DCGM_LABELS = (
    "gpu",
    "UUID",
    "pci_bus_id",
    "device",
    "modelName",
    "Hostname",
    "namespace",
    "pod",
    "container",
)
DCGM_METRIC_NAMES = (
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_POWER_USAGE",
)


@dataclass(frozen=True, slots=True)
class ProcessReading:
    pid: int
    memory_used_bytes: int
    sm_percent: int | None  # None: no utilisation sample for this process


@dataclass(frozen=True, slots=True)
class GpuReading:
    uuid: str
    utilization_percent: int | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    temperature_celsius: int | None
    power_watts: float | None
    processes: tuple[ProcessReading, ...]


class NVMLTelemetry:
    """Reads the figures above through pynvml, or the fake backend's stand-in (same calls).

    Each call that fails (not supported, GPU lost) leaves its figure out; a scrape never fails."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self._handles: dict[str, Any] = {}

    def _call(self, function_name: str, *args: Any) -> Any:
        function = getattr(self.nvml, function_name, None)
        if function is None:
            return None
        try:
            return function(*args)
        except self.nvml.NVMLError:
            return None

    def _handle(self, uuid: str) -> Any:
        handle = self._handles.get(uuid)
        if handle is None:
            handle = self._call("nvmlDeviceGetHandleByUUID", uuid)
            if handle is not None:
                self._handles[uuid] = handle
        return handle

    def read(self, uuid: str) -> GpuReading:
        handle = self._handle(uuid)
        if handle is None:
            return GpuReading(uuid, None, None, None, None, None, ())
        utilization = self._call("nvmlDeviceGetUtilizationRates", handle)
        memory = self._call("nvmlDeviceGetMemoryInfo", handle)
        temperature = self._call(
            "nvmlDeviceGetTemperature", handle, int(getattr(self.nvml, "NVML_TEMPERATURE_GPU", 0))
        )
        power_mw = self._call("nvmlDeviceGetPowerUsage", handle)
        samples: dict[int, tuple[int, int]] = {}  # pid -> (timestamp, sm %), the newest sample
        for sample in self._call("nvmlDeviceGetProcessUtilization", handle, 0) or ():
            previous = samples.get(int(sample.pid))
            if previous is None or int(sample.timeStamp) >= previous[0]:
                samples[int(sample.pid)] = (int(sample.timeStamp), int(sample.smUtil))
        processes = tuple(
            ProcessReading(
                pid=int(process.pid),
                memory_used_bytes=int(process.usedGpuMemory or 0),  # None where the driver hides it
                sm_percent=samples[int(process.pid)][1] if int(process.pid) in samples else None,
            )
            for process in self._call("nvmlDeviceGetComputeRunningProcesses", handle) or ()
        )
        return GpuReading(
            uuid=uuid,
            utilization_percent=int(utilization.gpu) if utilization is not None else None,
            memory_used_bytes=int(memory.used) if memory is not None else None,
            memory_total_bytes=int(memory.total) if memory is not None else None,
            temperature_celsius=int(temperature) if temperature is not None else None,
            power_watts=int(power_mw) / 1000 if power_mw is not None else None,
            processes=processes,
        )


class XidCounter:
    """XID faults per device as the health monitor reports them (``observe`` gets each snapshot);
    a repeat of the same XID while the GPU is still unhealthy is not counted again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = defaultdict(int)
        self._seen: dict[str, tuple[int, float]] = {}

    def observe(self, snapshot: Mapping[str, Any]) -> None:
        with self._lock:
            for name, health in snapshot.items():
                xid = getattr(health, "xid", None)
                if xid is None:
                    self._seen.pop(name, None)
                    continue
                key = (int(xid), float(getattr(health, "last_updated", 0.0)))
                if self._seen.get(name) != key:
                    self._seen[name] = key
                    self._counts[name] += 1

    def count(self, device: str) -> int:
        with self._lock:
            return self._counts.get(device, 0)


@dataclass(frozen=True, slots=True)
class _ShareRow:
    claim: PreparedClaim
    gpu: GPU
    memory_bytes: int
    compute_percent: int
    pods: tuple[PodRef, ...]


class GpuMetricsSource:
    """One node agent's GPUs and prepared shares, read at scrape time."""

    def __init__(
        self,
        *,
        inventory: NodeInventory,
        nvml: Any,
        prepared_claims: Callable[[], Mapping[str, PreparedClaim]],
        pods: PodIndex,
        proc_root: str | Path = "/proc",
        dcgm_names: bool = False,
    ) -> None:
        self.inventory = inventory
        self.nvml = nvml
        self.telemetry = NVMLTelemetry(nvml)
        self.xids = XidCounter()
        self.pods = pods
        self.dcgm_names = dcgm_names
        self._prepared_claims = prepared_claims
        self._proc_root = Path(proc_root)
        self._gpus_by_name = {gpu.name: gpu for gpu in inventory.gpus}
        # pid -> its pod and container, kept while NVML lists the pid (a cgroup does not change
        # while the process lives); pids NVML no longer lists are dropped at each scrape.
        self._cgroups: dict[int, ContainerIdentity | None] = {}

    def _shares(self) -> list[_ShareRow]:
        rows = []
        claims = self._prepared_claims()
        self.pods.forget_except(claims)
        for uid, claim in sorted(claims.items()):
            if claim.phase is not ClaimPhase.COMPLETED:
                continue
            pods = self.pods.pods_of(uid)
            for device in claim.devices:
                gpu = self._gpus_by_name.get(device.device)
                if device.share is None or gpu is None:
                    continue
                share = device.share
                rows.append(
                    _ShareRow(
                        claim=claim,
                        gpu=gpu,
                        memory_bytes=share.memory_bytes,
                        compute_percent=100 if share.whole_gpu else share.compute_percent,
                        pods=pods,
                    )
                )
        return rows

    def collect_into(self, families: _Families) -> None:
        node = self.inventory.node_name
        shares = self._shares()
        shares_by_gpu: dict[str, list[_ShareRow]] = defaultdict(list)
        for row in shares:
            shares_by_gpu[row.gpu.name].append(row)
        known, cgroups = self._cgroups, {}
        for gpu in self.inventory.gpus:
            reading = self.telemetry.read(gpu.uuid)
            labels = (node, gpu.name, gpu.uuid, gpu.product_name)
            if reading.utilization_percent is not None:
                families.gauge("fractional_gpu_utilization_ratio", labels, reading.utilization_percent / 100)
            if reading.memory_used_bytes is not None:
                families.gauge("fractional_gpu_memory_used_bytes", labels, reading.memory_used_bytes)
            if reading.memory_total_bytes is not None:
                families.gauge("fractional_gpu_memory_total_bytes", labels, reading.memory_total_bytes)
            if reading.temperature_celsius is not None:
                families.gauge("fractional_gpu_temperature_celsius", labels, reading.temperature_celsius)
            if reading.power_watts is not None:
                families.gauge("fractional_gpu_power_watts", labels, reading.power_watts)
            families.counter("fractional_gpu_xid_errors", labels, self.xids.count(gpu.name))
            for process in reading.processes:
                if process.pid not in cgroups:
                    cgroups[process.pid] = (
                        known[process.pid]
                        if process.pid in known
                        else read_process_container(self._proc_root, process.pid)
                    )
            self._collect_shares(families, node, gpu, reading, shares_by_gpu.get(gpu.name, []), cgroups)
            if self.dcgm_names:
                self._collect_dcgm(families, node, gpu, reading, shares_by_gpu.get(gpu.name, []))
        self._cgroups = cgroups  # two scrapes at once: the last map wins, a lost entry is read again

    def _collect_shares(
        self,
        families: _Families,
        node: str,
        gpu: GPU,
        reading: GpuReading,
        rows: list[_ShareRow],
        cgroups: Mapping[int, ContainerIdentity | None],
    ) -> None:
        # pod UID -> the share on this GPU its processes are charged to (the first, by claim UID)
        share_of_pod: dict[str, tuple[_ShareRow, PodRef]] = {}
        for row in rows:
            for pod in row.pods:
                share_of_pod.setdefault(pod.uid, (row, pod))
        used: dict[tuple[str, str, str], list[int]] = {}  # (claim uid, pod uid, container) -> [bytes, sm]
        for process in reading.processes:
            identity = cgroups.get(process.pid)
            if identity is None or identity.pod_uid not in share_of_pod:
                continue  # not in a pod holding a share of this GPU (or its pod is not known yet)
            row, pod = share_of_pod[identity.pod_uid]
            entry = used.setdefault((row.claim.uid, pod.uid, identity.container_id[:12]), [0, 0])
            entry[0] += process.memory_used_bytes
            entry[1] += process.sm_percent or 0
        for row in rows:
            claim = row.claim
            pods = row.pods or (PodRef(claim.namespace, "", ""),)
            for pod in pods:
                labels = (node, claim.namespace, pod.name, "", claim.name, gpu.name, gpu.uuid)
                families.gauge("fractional_share_memory_allocated_bytes", labels, row.memory_bytes)
                families.gauge("fractional_share_compute_allocated_percent", labels, row.compute_percent)
                containers = sorted(
                    (key[2], value) for key, value in used.items() if key[:2] == (claim.uid, pod.uid)
                )
                for container, (memory_bytes, sm_percent) in containers or [("", [0, 0])]:
                    used_labels = (node, claim.namespace, pod.name, container, claim.name, gpu.name, gpu.uuid)
                    families.gauge("fractional_share_memory_used_bytes", used_labels, memory_bytes)
                    families.gauge("fractional_share_compute_used_percent", used_labels, min(sm_percent, 100))

    def _collect_dcgm(
        self, families: _Families, node: str, gpu: GPU, reading: GpuReading, rows: list[_ShareRow]
    ) -> None:
        index = gpu.minor_number if gpu.minor_number is not None else _device_index(gpu)
        base = (str(index), gpu.uuid, gpu.pci_bus_id, f"nvidia{index}", gpu.product_name, node)
        pods = sorted({(pod.namespace, pod.name) for row in rows for pod in row.pods})
        pod_labels = [(namespace, name, "") for namespace, name in pods] or [("", "", "")]
        for pod_label in pod_labels:
            labels = base + pod_label
            if reading.utilization_percent is not None:
                families.gauge("DCGM_FI_DEV_GPU_UTIL", labels, reading.utilization_percent)
            if reading.memory_used_bytes is not None and reading.memory_total_bytes is not None:
                families.gauge("DCGM_FI_DEV_FB_USED", labels, reading.memory_used_bytes // MIB)
                free = reading.memory_total_bytes - reading.memory_used_bytes
                families.gauge("DCGM_FI_DEV_FB_FREE", labels, free // MIB)
            if reading.temperature_celsius is not None:
                families.gauge("DCGM_FI_DEV_GPU_TEMP", labels, reading.temperature_celsius)
            if reading.power_watts is not None:
                families.gauge("DCGM_FI_DEV_POWER_USAGE", labels, reading.power_watts)


def _device_index(gpu: GPU) -> int:
    _, _, number = gpu.name.rpartition("-")
    return int(number) if number.isdigit() else 0


_HELP = {
    "fractional_gpu_utilization_ratio": ("GPU utilisation (0..1), NVML", GPU_LABELS),
    "fractional_gpu_memory_used_bytes": ("GPU memory in use, NVML", GPU_LABELS),
    "fractional_gpu_memory_total_bytes": ("GPU memory, NVML", GPU_LABELS),
    "fractional_gpu_temperature_celsius": ("GPU temperature, NVML", GPU_LABELS),
    "fractional_gpu_power_watts": ("GPU power draw, NVML", GPU_LABELS),
    "fractional_gpu_xid_errors": ("XID faults the health monitor recorded", GPU_LABELS),
    "fractional_share_memory_allocated_bytes": ("GPU memory allocated to a share", SHARE_LABELS),
    "fractional_share_compute_allocated_percent": (
        "Guaranteed compute of a share, percent of the GPU (0 = best effort)",
        SHARE_LABELS,
    ),
    "fractional_share_memory_used_bytes": (
        "GPU memory used by a container's processes on a share (NVML per-process memory)",
        SHARE_LABELS,
    ),
    "fractional_share_compute_used_percent": (
        "SM utilisation of a container's processes on a share (NVML per-process samples)",
        SHARE_LABELS,
    ),
    "DCGM_FI_DEV_GPU_UTIL": ("GPU utilization (in %).", DCGM_LABELS),
    "DCGM_FI_DEV_FB_USED": ("Framebuffer memory used (in MiB).", DCGM_LABELS),
    "DCGM_FI_DEV_FB_FREE": ("Framebuffer memory free (in MiB).", DCGM_LABELS),
    "DCGM_FI_DEV_GPU_TEMP": ("GPU temperature (in C).", DCGM_LABELS),
    "DCGM_FI_DEV_POWER_USAGE": ("Power draw (in W).", DCGM_LABELS),
}
AGENT_METRIC_NAMES = tuple(name for name in _HELP if not name.startswith("DCGM_"))


class _Families:
    """The metric families of one scrape, created on first use."""

    def __init__(self) -> None:
        self._families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

    def gauge(self, name: str, labels: tuple[str, ...], value: float) -> None:
        family = self._families.get(name)
        if family is None:
            help_text, label_names = _HELP[name]
            family = GaugeMetricFamily(name, help_text, labels=label_names)
            self._families[name] = family
        family.add_metric(labels, value)

    def counter(self, name: str, labels: tuple[str, ...], value: float) -> None:
        family = self._families.get(name)
        if family is None:
            help_text, label_names = _HELP[name]
            family = CounterMetricFamily(name, help_text, labels=label_names)
            self._families[name] = family
        family.add_metric(labels, value)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())


class GpuMetricsCollector(Collector):
    """Collects every registered source at scrape time; a source that fails is logged and skipped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: list[GpuMetricsSource] = []
        self._registered: set[int] = set()

    def add_source(self, source: GpuMetricsSource, registry: CollectorRegistry = REGISTRY) -> None:
        with self._lock:
            self._sources.append(source)
            if id(registry) not in self._registered:
                registry.register(self)
                self._registered.add(id(registry))

    def remove_source(self, source: GpuMetricsSource) -> None:
        with self._lock:
            if source in self._sources:
                self._sources.remove(source)

    def describe(self) -> list[Metric]:
        return []  # series appear and vanish with shares; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            sources = list(self._sources)
        families = _Families()
        for source in sources:
            try:
                source.collect_into(families)
            except Exception:  # a bug in one source must not fail the whole scrape: logged, skipped
                log.exception("gpu metrics not collected", extra={"node": source.inventory.node_name})
        return iter(families)


GPU_METRICS = GpuMetricsCollector()

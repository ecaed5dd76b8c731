"""The node's device model: GPUs, NICs and topology. Pure values, no I/O.

Backends (``fake``, ``nvml`` + ``sysfs``) produce these; ``driver.slices`` turns them into
ResourceSlices; the node agent prepares claims against them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

__all__ = [
    "GPU",
    "NIC",
    "NUMANode",
    "NodeInventory",
    "assign_device_names",
    "normalize_pci_bus_id",
    "normalize_version",
    "parse_cpu_list",
]

_PCI_BUS_ID = re.compile(r"^(?:([0-9a-f]{4,8}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")


@dataclass(frozen=True, slots=True)
class GPU:
    """One physical GPU (or a MIG-less whole device).

    ``name`` is ``gpu-<n>`` with n the position in PCI bus id order (never the NVML index).
    """

    name: str
    uuid: str
    product_name: str
    brand: str
    architecture: str
    cuda_compute_capability: str  # semver, e.g. "9.0.0"
    memory_bytes: int  # usable memory: total - reserved
    multiprocessors: int
    pci_bus_id: str  # normalized "0000:65:00.0"
    pcie_root: str | None = None  # e.g. "pci0000:64"
    numa_node: int | None = None
    nvlink_peers: tuple[str, ...] = ()  # PCI bus ids of peers reachable over NVLink
    nvlink_domain: str | None = None  # GPUs that share an NVLink/NVSwitch fabric have one value
    minor_number: int | None = None  # /dev/nvidia<minor>
    nvml_index: int | None = None
    local_cpus: tuple[int, ...] = ()  # CPUs close to the GPU (sysfs local_cpulist)
    mig_enabled: bool = False  # noted only: the GPU is still published whole


@dataclass(frozen=True, slots=True)
class NIC:
    """A network interface (RDMA-capable or not)."""

    name: str  # nic-<n>
    if_name: str
    pci_bus_id: str
    pcie_root: str | None = None
    numa_node: int | None = None
    rdma_device: str | None = None  # e.g. "mlx5_0"
    link_speed_mbps: int | None = None
    mac_address: str | None = None
    local_cpus: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class NUMANode:
    id: int
    cpus: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeInventory:
    node_name: str
    gpus: tuple[GPU, ...] = ()
    nics: tuple[NIC, ...] = ()
    numa_nodes: tuple[NUMANode, ...] = ()
    driver_version: str | None = None  # semver, e.g. "550.54.15"
    cuda_driver_version: str | None = None  # semver, e.g. "12.4.0"
    backend: str = "fake"
    labels: tuple[tuple[str, str], ...] = field(default=())  # extra Node labels (fake clusters)

    def gpu(self, name: str) -> GPU | None:
        return next((g for g in self.gpus if g.name == name), None)

    def nic(self, name: str) -> NIC | None:
        return next((n for n in self.nics if n.name == name), None)

    def paired_nic(self, gpu: GPU) -> NIC | None:
        """The NIC under the same PCIe root as ``gpu``, if any (first by name)."""
        if gpu.pcie_root is None:
            return None
        return next((n for n in self.nics if n.pcie_root == gpu.pcie_root), None)

    def paired_gpu(self, nic: NIC) -> GPU | None:
        """The GPU under the same PCIe root as ``nic``, if any (first by name)."""
        if nic.pcie_root is None:
            return None
        return next((g for g in self.gpus if g.pcie_root == nic.pcie_root), None)


def assign_device_names(gpus: list[GPU], nics: list[NIC]) -> tuple[tuple[GPU, ...], tuple[NIC, ...]]:
    """Name devices ``gpu-<n>`` / ``nic-<n>`` in PCI bus id order (stable across reboots)."""
    ordered_gpus = sorted(gpus, key=lambda g: g.pci_bus_id)
    ordered_nics = sorted(nics, key=lambda n: n.pci_bus_id)
    return (
        tuple(replace(g, name=f"gpu-{i}") for i, g in enumerate(ordered_gpus)),
        tuple(replace(n, name=f"nic-{i}") for i, n in enumerate(ordered_nics)),
    )


def normalize_pci_bus_id(raw: str | bytes) -> str:
    """``b'00000000:65:00.0'`` / ``'0000:65:00.0'`` / ``'65:00.0'`` -> ``'0000:65:00.0'`` (lower case).

    Raises ``ValueError`` quoting the input when it is not a PCI bus id.
    """
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else str(raw)
    text = text.strip().rstrip("\x00").lower()
    match = _PCI_BUS_ID.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a PCI bus id (DDDD:BB:DD.F)")
    domain, bus, device, function = match.groups()
    domain = domain or "0000"
    if int(domain, 16) > 0xFFFF:
        raise ValueError(f"{text!r}: the PCI domain does not fit 16 bits")
    domain = domain[-4:]
    return f"{domain}:{bus}:{device}.{function}"


def normalize_version(raw: str) -> str:
    """A dotted numeric version as semver 2.0: ``"12.4"`` -> ``"12.4.0"``, ``"535.104.05"`` -> ``"535.104.5"``

    Semver forbids leading zeros, so each component is re-rendered as an integer; raises
    ``ValueError`` quoting the input when a component is not a number or there are more than three.
    """
    parts = str(raw).strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(part.isdigit() for part in parts):
        raise ValueError(f"{raw!r} is not a dotted numeric version (e.g. 550.54.15 or 12.4)")
    numbers = [int(part) for part in parts] + [0] * (3 - len(parts))
    return ".".join(str(n) for n in numbers)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """Linux cpulist format: ``"0-3,8-11"`` -> ``(0, 1, 2, 3, 8, 9, 10, 11)``; empty text -> ``()``.

    Raises ``ValueError`` quoting the input when it is malformed.
    """
    cpus: set[int] = set()
    for chunk in str(text).strip().split(","):
        chunk = chunk.strip()
        if not chunk:
            continue
        low, sep, high = chunk.partition("-")
        try:
            first = int(low)
            last = int(high) if sep else first
        except ValueError:
            raise ValueError(f"{text!r} is not a CPU list (e.g. 0-3,8-11)") from None
        if first < 0 or last < first:
            raise ValueError(f"{text!r} is not a CPU list (e.g. 0-3,8-11)")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))

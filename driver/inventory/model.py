"""The node's device model: GPUs, NICs and topology. Pure values, no I/O.

Backends (``fake``, ``nvml`` + ``sysfs``) produce these; ``driver.slices`` turns them into
ResourceSlices; the node agent prepares claims against them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

__all__ = ["GPU", "NIC", "NUMANode", "NodeInventory", "assign_device_names"]


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


def assign_device_names(gpus: list[GPU], nics: list[NIC]) -> tuple[tuple[GPU, ...], tuple[NIC, ...]]:
    """Name devices ``gpu-<n>`` / ``nic-<n>`` in PCI bus id order (stable across reboots)."""
    ordered_gpus = sorted(gpus, key=lambda g: g.pci_bus_id)
    ordered_nics = sorted(nics, key=lambda n: n.pci_bus_id)
    return (
        tuple(replace(g, name=f"gpu-{i}") for i, g in enumerate(ordered_gpus)),
        tuple(replace(n, name=f"nic-{i}") for i, n in enumerate(ordered_nics)),
    )

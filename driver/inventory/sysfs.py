"""The ``sysfs`` backend: PCI topology (NUMA node, PCIe root, local CPUs), NUMA nodes and NICs.

Reads a configurable root (``/sys`` on a real node, a tree made by the test elsewhere). Paths
follow the Linux layout (see dranet ``pkg/inventory/sysfs.go``):

- ``bus/pci/devices/<bdf>`` is a symlink into ``devices/pci<DDDD>:<BB>/.../<bdf>``; the first
  ``pciDDDD:BB`` component of its resolved path is the device's PCIe root;
  ``numa_node`` (-1 = none) and ``local_cpulist`` live in that directory.
- ``devices/system/node/node<N>/cpulist`` lists each NUMA node's CPUs.
- ``class/net/<if>/device`` links physical interfaces to their PCI function (virtual ones have
  no ``device``); ``speed`` (Mb/s, -1 when down) and ``address`` (MAC) sit beside it.
- ``class/infiniband/<ibdev>/device`` links RDMA devices to their PCI function.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from driver.errors import InventoryError
from driver.inventory.model import NIC, NUMANode, normalize_pci_bus_id, parse_cpu_list

__all__ = ["PCIDeviceInfo", "discover_nics", "read_numa_nodes", "read_pci_device"]

log = logging.getLogger(__name__)

_PCIE_ROOT = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_NODE_DIR = re.compile(r"^node(\d+)$")


@dataclass(frozen=True, slots=True)
class PCIDeviceInfo:
    """What sysfs says about one PCI function."""

    pci_bus_id: str
    numa_node: int | None
    pcie_root: str | None
    local_cpus: tuple[int, ...]


def read_pci_device(sysfs_root: str | Path, pci_bus_id: str) -> PCIDeviceInfo:
    """NUMA node, PCIe root and local CPUs of one PCI function; raises ``InventoryError`` if absent."""
    root = Path(sysfs_root)
    bdf = normalize_pci_bus_id(pci_bus_id)
    link = root / "bus" / "pci" / "devices" / bdf
    if not link.exists():
        raise InventoryError(source=str(root), device=bdf, problem=f"{link} does not exist")
    return PCIDeviceInfo(
        pci_bus_id=bdf,
        numa_node=_read_numa_node(link / "numa_node", bdf),
        pcie_root=_pcie_root(root, link),
        local_cpus=_read_cpu_list(link / "local_cpulist", bdf),
    )


def read_numa_nodes(sysfs_root: str | Path) -> tuple[NUMANode, ...]:
    """``devices/system/node/node<N>/cpulist`` for every node, by id; ``()`` when absent."""
    base = Path(sysfs_root) / "devices" / "system" / "node"
    nodes = []
    for entry in sorted(base.glob("node*")) if base.is_dir() else []:
        match = _NODE_DIR.fullmatch(entry.name)
        if match is None:
            continue
        nodes.append(NUMANode(id=int(match.group(1)), cpus=_read_cpu_list(entry / "cpulist", entry.name)))
    return tuple(sorted(nodes, key=lambda node: node.id))


def discover_nics(sysfs_root: str | Path) -> list[NIC]:
    """Physical network functions (one per PCI bus id), with RDMA device, link speed and topology.

    Names are left empty: ``assign_device_names`` numbers NICs together with the inventory. An
    RDMA device with no netdev (InfiniBand without IPoIB) is listed with its RDMA name as ``if_name``.
    """
    root = Path(sysfs_root)
    rdma_by_bus = _rdma_devices(root)
    netdevs: dict[str, tuple[str, Path]] = {}
    net_dir = root / "class" / "net"
    for entry in sorted(net_dir.iterdir()) if net_dir.is_dir() else []:
        bdf = _bus_id_of(entry / "device")
        if bdf is None:
            continue  # virtual interface (lo, bridges, veth, bonds): no PCI function
        netdevs.setdefault(bdf, (entry.name, entry))
    nics = []
    for bdf in sorted(set(netdevs) | set(rdma_by_bus)):
        info = _optional_pci_device(root, bdf)
        if_name, net_path = netdevs.get(bdf, (rdma_by_bus.get(bdf, ""), None))
        nics.append(
            NIC(
                name="",
                if_name=if_name,
                pci_bus_id=bdf,
                pcie_root=info.pcie_root if info else None,
                numa_node=info.numa_node if info else None,
                rdma_device=rdma_by_bus.get(bdf) or _rdma_under_netdev(net_path),
                link_speed_mbps=_read_speed(net_path / "speed") if net_path else None,
                mac_address=_read_text(net_path / "address") if net_path else None,
                local_cpus=info.local_cpus if info else (),
            )
        )
    return nics


# -- helpers ----------------------------------------------------------------------------------


def _optional_pci_device(root: Path, bdf: str) -> PCIDeviceInfo | None:
    try:
        return read_pci_device(root, bdf)
    except InventoryError:
        log.warning("PCI device missing from sysfs; topology unknown", extra={"pci_bus_id": bdf})
        return None


def _pcie_root(root: Path, device_link: Path) -> str | None:
    """The first ``pciDDDD:BB`` component of the resolved device path (under ``<root>/devices``)."""
    resolved = Path(os.path.realpath(device_link))
    devices = Path(os.path.realpath(root / "devices"))
    try:
        parts = resolved.relative_to(devices).parts
    except ValueError:
        parts = resolved.parts  # a tree laid out differently: take the first root-looking component
    return next((part for part in parts if _PCIE_ROOT.fullmatch(part)), None)


def _bus_id_of(device_link: Path) -> str | None:
    """The PCI bus id a ``device`` symlink resolves to (last BDF-looking component), if any."""
    if not device_link.exists():
        return None
    for part in reversed(Path(os.path.realpath(device_link)).parts):
        if _BDF.fullmatch(part):
            return part
    return None


def _rdma_devices(root: Path) -> dict[str, str]:
    base = root / "class" / "infiniband"
    found: dict[str, str] = {}
    for entry in sorted(base.iterdir()) if base.is_dir() else []:
        bdf = _bus_id_of(entry / "device")
        if bdf is not None:
            found.setdefault(bdf, entry.name)
    return found


def _rdma_under_netdev(net_path: Path | None) -> str | None:
    if net_path is None:
        return None
    base = net_path / "device" / "infiniband"
    names = sorted(entry.name for entry in base.iterdir()) if base.is_dir() else []
    return names[0] if names else None


def _read_text(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None  # absent, or EINVAL (e.g. speed of a down link)
    return text or None


def _read_numa_node(path: Path, bdf: str) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise InventoryError(
            source=str(path), device=bdf, field="numa_node", problem=f"{text!r} is not an integer"
        ) from None
    return value if value >= 0 else None


def _read_cpu_list(path: Path, device: str) -> tuple[int, ...]:
    text = _read_text(path)
    if text is None:
        return ()
    try:
        return parse_cpu_list(text)
    except ValueError as error:
        raise InventoryError(source=str(path), device=device, field="cpulist", problem=str(error)) from None


def _read_speed(path: Path) -> int | None:
    text = _read_text(path)
    try:
        value = int(text) if text is not None else -1
    except ValueError:
        return None
    return value if value > 0 else None

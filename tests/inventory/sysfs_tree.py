"""Builds a fake sysfs tree under a test's tmp_path, laid out (with symlinks) like the real one."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["FakeSysfs"]


@dataclass
class FakeSysfs:
    root: Path
    _made: set[str] = field(default_factory=set)

    def pci(self, bdf: str, *, root: str, numa_node: int = 0, cpulist: str | None = "0-3") -> Path:
        """``devices/<root>/<root port>/<bdf>`` plus ``bus/pci/devices/<bdf>`` -> it (relative link)."""
        bus = root.split(":")[1]
        domain = root.removeprefix("pci").split(":")[0]
        device_dir = self.root / "devices" / root / f"{domain}:{bus}:00.0" / bdf
        device_dir.mkdir(parents=True, exist_ok=True)
        (device_dir / "numa_node").write_text(f"{numa_node}\n")
        if cpulist is not None:
            (device_dir / "local_cpulist").write_text(f"{cpulist}\n")
        link_dir = self.root / "bus" / "pci" / "devices"
        link_dir.mkdir(parents=True, exist_ok=True)
        link = link_dir / bdf
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(device_dir, link_dir))
        return device_dir

    def numa(self, node: int, cpulist: str) -> None:
        node_dir = self.root / "devices" / "system" / "node" / f"node{node}"
        node_dir.mkdir(parents=True, exist_ok=True)
        (node_dir / "cpulist").write_text(f"{cpulist}\n")

    def netdev(
        self,
        if_name: str,
        *,
        bdf: str | None,
        speed: str | None = "400000",
        address: str = "94:6d:ae:00:00:01",
        rdma_under_device: str | None = None,
    ) -> None:
        """``class/net/<if>``; physical ones (``bdf`` set) get a ``device`` link to the PCI function."""
        net_dir = self.root / "class" / "net" / if_name
        net_dir.mkdir(parents=True, exist_ok=True)
        (net_dir / "address").write_text(f"{address}\n")
        if speed is not None:
            (net_dir / "speed").write_text(f"{speed}\n")
        if bdf is None:
            return
        device_dir = Path(os.path.realpath(self.root / "bus" / "pci" / "devices" / bdf))
        (net_dir / "device").symlink_to(os.path.relpath(device_dir, net_dir))
        if rdma_under_device:
            (device_dir / "infiniband" / rdma_under_device).mkdir(parents=True, exist_ok=True)

    def infiniband(self, name: str, *, bdf: str) -> None:
        ib_dir = self.root / "class" / "infiniband" / name
        ib_dir.mkdir(parents=True, exist_ok=True)
        device_dir = Path(os.path.realpath(self.root / "bus" / "pci" / "devices" / bdf))
        (ib_dir / "device").symlink_to(os.path.relpath(device_dir, ib_dir))

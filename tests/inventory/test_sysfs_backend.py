"""The sysfs backend against a fake tree (real files and symlinks in tmp_path)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sysfs_tree import FakeSysfs

from driver.errors import InventoryError
from driver.inventory.sysfs import discover_nics, read_numa_nodes, read_pci_device


@pytest.fixture
def tree(tmp_path: Path) -> FakeSysfs:
    return FakeSysfs(tmp_path / "sys")


def test_pci_device_numa_root_and_local_cpus(tree: FakeSysfs) -> None:
    tree.pci("0000:65:00.0", root="pci0000:64", numa_node=1, cpulist="0-3,8-11")
    info = read_pci_device(tree.root, "0000:65:00.0")
    assert info.numa_node == 1
    assert info.pcie_root == "pci0000:64"
    assert info.local_cpus == (0, 1, 2, 3, 8, 9, 10, 11)


def test_pci_device_accepts_nvml_style_bus_ids(tree: FakeSysfs) -> None:
    tree.pci("0000:65:00.0", root="pci0000:64")
    assert read_pci_device(tree.root, b"00000000:65:00.0").pci_bus_id == "0000:65:00.0"  # type: ignore[arg-type]


def test_numa_node_minus_one_means_none(tree: FakeSysfs) -> None:
    tree.pci("0000:65:00.0", root="pci0000:64", numa_node=-1, cpulist=None)
    info = read_pci_device(tree.root, "0000:65:00.0")
    assert (info.numa_node, info.local_cpus) == (None, ())


def test_malformed_numa_node_names_file_and_field(tree: FakeSysfs) -> None:
    device_dir = tree.pci("0000:65:00.0", root="pci0000:64")
    (device_dir / "numa_node").write_text("zero\n")
    with pytest.raises(InventoryError, match=r"numa_node.*0000:65:00.0: numa_node: 'zero' is not an integer"):
        read_pci_device(tree.root, "0000:65:00.0")


def test_missing_pci_device(tree: FakeSysfs) -> None:
    with pytest.raises(InventoryError, match=r"0000:01:00\.0"):
        read_pci_device(tree.root, "0000:01:00.0")


def test_numa_nodes_sorted_by_id(tree: FakeSysfs) -> None:
    tree.numa(1, "56-111,168-223")
    tree.numa(0, "0-55,112-167")
    (tree.root / "devices" / "system" / "node" / "possible").write_text("0-1\n")  # not a node dir
    nodes = read_numa_nodes(tree.root)
    assert [node.id for node in nodes] == [0, 1]
    assert len(nodes[0].cpus) == 112 and nodes[1].cpus[0] == 56


def test_nics_physical_only_with_rdma_speed_and_mac(tree: FakeSysfs) -> None:
    tree.pci("0000:18:00.0", root="pci0000:15", numa_node=0, cpulist="0-7")
    tree.pci("0000:40:00.0", root="pci0000:3d", numa_node=0)
    tree.pci("0000:c1:00.0", root="pci0000:c0", numa_node=1)
    tree.pci("0000:d1:00.0", root="pci0000:d0", numa_node=1)
    tree.netdev("ibp24s0", bdf="0000:18:00.0", speed="400000", address="94:6D:AE:00:00:01")
    tree.infiniband("mlx5_0", bdf="0000:18:00.0")
    tree.netdev("enp64s0np0", bdf="0000:40:00.0", speed="-1", rdma_under_device="mlx5_1")  # link down
    tree.netdev("eno1", bdf="0000:c1:00.0", speed=None)  # speed unreadable
    tree.infiniband("mlx5_9", bdf="0000:d1:00.0")  # InfiniBand without a netdev
    tree.netdev("lo", bdf=None)  # virtual: no device link
    tree.netdev("docker0", bdf=None)

    nics = discover_nics(tree.root)
    assert [(n.if_name, n.pci_bus_id) for n in nics] == [
        ("ibp24s0", "0000:18:00.0"),
        ("enp64s0np0", "0000:40:00.0"),
        ("eno1", "0000:c1:00.0"),
        ("mlx5_9", "0000:d1:00.0"),
    ]
    first = nics[0]
    assert (first.rdma_device, first.link_speed_mbps, first.mac_address) == (
        "mlx5_0",
        400000,
        "94:6D:AE:00:00:01",
    )
    assert (first.numa_node, first.pcie_root, first.local_cpus) == (0, "pci0000:15", tuple(range(8)))
    assert (nics[1].rdma_device, nics[1].link_speed_mbps) == ("mlx5_1", None)
    assert (nics[2].rdma_device, nics[2].link_speed_mbps) == (None, None)
    assert (nics[3].rdma_device, nics[3].numa_node) == ("mlx5_9", 1)


def test_two_netdevs_on_one_function_are_one_nic(tree: FakeSysfs) -> None:
    tree.pci("0000:18:00.0", root="pci0000:15")
    tree.netdev("ib0", bdf="0000:18:00.0")
    tree.netdev("ib0.8001", bdf="0000:18:00.0")  # an IPoIB child interface on the same function
    assert [nic.if_name for nic in discover_nics(tree.root)] == ["ib0"]


def test_empty_root_has_nothing(tmp_path: Path) -> None:
    assert discover_nics(tmp_path) == []
    assert read_numa_nodes(tmp_path) == ()

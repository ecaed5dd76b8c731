"""The fake backend: shipped profiles load with the promised topology; bad profiles are refused
with an error naming the file, the device and the field."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.errors import InventoryError
from driver.inventory.discover import discover_inventory
from driver.inventory.fake import PROFILE_DIR, list_profiles, load_profile, resolve_profile

GIB = 1024**3


def test_shipped_profiles_are_listed() -> None:
    assert {"h100-8x", "a100-pcie-4x", "l4-2x"} <= set(list_profiles())


@pytest.mark.parametrize("name", list_profiles())
def test_every_shipped_profile_loads(name: str) -> None:
    inventory = discover_inventory(backend="fake", profile=name, node_name="node-a")
    assert inventory.node_name == "node-a"
    assert inventory.gpus and inventory.nics
    assert inventory.driver_version == "550.54.15" and inventory.cuda_driver_version == "12.4.0"
    buses = [device.pci_bus_id for device in (*inventory.gpus, *inventory.nics)]
    assert len(set(buses)) == len(buses)
    assert [gpu.name for gpu in inventory.gpus] == [f"gpu-{i}" for i in range(len(inventory.gpus))]
    assert [gpu.pci_bus_id for gpu in inventory.gpus] == sorted(gpu.pci_bus_id for gpu in inventory.gpus)
    declared = {node.id for node in inventory.numa_nodes}
    assert {device.numa_node for device in (*inventory.gpus, *inventory.nics)} <= declared


def test_h100_topology() -> None:
    inventory = load_profile(resolve_profile("h100-8x"), node_name="n")
    assert len(inventory.gpus) == 8 and len(inventory.nics) == 8
    assert {gpu.product_name for gpu in inventory.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert {(gpu.multiprocessors, gpu.cuda_compute_capability) for gpu in inventory.gpus} == {(132, "9.0.0")}
    assert 79 * GIB <= inventory.gpus[0].memory_bytes < 80 * GIB  # usable = total - reserved
    assert Counter(gpu.numa_node for gpu in inventory.gpus) == {0: 4, 1: 4}
    assert [node.id for node in inventory.numa_nodes] == [0, 1] and all(n.cpus for n in inventory.numa_nodes)
    assert {gpu.nvlink_domain for gpu in inventory.gpus} == {"nvswitch-0"}
    assert all(len(gpu.nvlink_peers) == 7 for gpu in inventory.gpus)
    for gpu in inventory.gpus:
        nics = [nic for nic in inventory.nics if nic.pcie_root == gpu.pcie_root]
        assert len(nics) == 1, gpu.name  # exactly one NIC under each GPU's PCIe root
        assert nics[0].numa_node == gpu.numa_node
        assert gpu.local_cpus == next(n.cpus for n in inventory.numa_nodes if n.id == gpu.numa_node)
    assert [nic.rdma_device for nic in inventory.nics] == [f"mlx5_{i}" for i in range(8)]
    assert {nic.link_speed_mbps for nic in inventory.nics} == {400000}


def test_a100_has_no_nvlink() -> None:
    inventory = load_profile(resolve_profile("a100-pcie-4x"))
    assert len(inventory.gpus) == 4 and len(inventory.nics) == 2
    assert all(gpu.nvlink_domain is None and gpu.nvlink_peers == () for gpu in inventory.gpus)
    assert {gpu.multiprocessors for gpu in inventory.gpus} == {108}
    assert {gpu.numa_node for gpu in inventory.gpus} == {0, 1}


def test_l4_small_node() -> None:
    inventory = load_profile(resolve_profile("l4-2x"))
    assert [(g.product_name, g.multiprocessors, g.cuda_compute_capability) for g in inventory.gpus] == [
        ("NVIDIA L4", 58, "8.9.0")
    ] * 2
    assert len(inventory.nics) == 1
    assert dict(inventory.labels) == {"node.kubernetes.io/instance-type": "l4-2x"}


def test_resolve_by_path_and_unknown_name(tmp_path: Path) -> None:
    copy = tmp_path / "mine.yaml"
    copy.write_text((PROFILE_DIR / "l4-2x.yaml").read_text())
    assert resolve_profile(str(copy)) == copy
    assert len(discover_inventory(backend="fake", profile=str(copy), node_name="x").gpus) == 2
    with pytest.raises(InventoryError, match="shipped: a100-pcie-4x, h100-8x, l4-2x"):
        resolve_profile("h200-8x")


def _h100() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((PROFILE_DIR / "h100-8x.yaml").read_text())
    return document


def _set(path: tuple[Any, ...], value: Any) -> Any:
    def mutate(document: dict[str, Any]) -> None:
        target = document
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def _delete(path: tuple[Any, ...]) -> Any:
    def mutate(document: dict[str, Any]) -> None:
        target = document
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return mutate


BAD_PROFILES = [
    pytest.param(
        _delete(("gpus", 2, "uuid")), "gpus[2] (0000:52:00.0)", "uuid", "missing", id="missing-field"
    ),
    pytest.param(
        _set(("gpus", 1, "memoryTotalMiB"), "lots"),
        "gpus[1]",
        "memoryTotalMiB",
        "expected an integer",
        id="wrong-type",
    ),
    pytest.param(
        _set(("nics", 3, "pciBusId"), "0000:1b:00.0"),
        "nics[3]",
        "pciBusId",
        "duplicate PCI bus id",
        id="duplicate-bus",
    ),
    pytest.param(
        _set(("gpus", 5, "numaNode"), 3),
        "gpus[5]",
        "numaNode",
        "NUMA node 3 is not declared",
        id="gpu-numa-undeclared",
    ),
    pytest.param(
        _set(("nics", 0, "numaNode"), 2),
        "nics[0]",
        "numaNode",
        "NUMA node 2 is not declared",
        id="nic-numa-undeclared",
    ),
    pytest.param(
        _set(("gpus", 0, "memoryTotalMiB"), -1), "gpus[0]", "memoryTotalMiB", "must be >= 0", id="negative"
    ),
    pytest.param(
        _set(("gpus", 0, "memoryReservedMiB"), 81500),
        "gpus[0]",
        "memoryReservedMiB",
        "at least 256 MiB",
        id="tiny",
    ),
    pytest.param(
        _set(("gpus", 4, "pciBusId"), "0000:zz:00.0"), "gpus[4]", "pciBusId", "not a PCI bus id", id="bus"
    ),
    pytest.param(_set(("gpus", 4, "pciBusId"), 17), "gpus[4]", "pciBusId", "(quote it)", id="unquoted-bus"),
    pytest.param(_set(("gpus", 6, "uuid"), "GPU-1234"), "gpus[6]", "uuid", "not a GPU UUID", id="uuid"),
    pytest.param(
        _set(("gpus", 7, "uuid"), "GPU-85ba7735-a1ee-4b33-aca4-b8ec4d448e9e"),
        "gpus[7]",
        "uuid",
        "duplicate",
        id="dup-uuid",
    ),
    pytest.param(
        _set(("gpus", 0, "multiprocesors"), 132), "gpus[0]", "multiprocesors", "unknown field", id="typo"
    ),
    pytest.param(
        _set(("gpus", 0, "cudaComputeCapability"), "9.x"),
        "gpus[0]",
        "cudaComputeCapability",
        "not a dotted",
        id="ver",
    ),
    pytest.param(
        _set(
            ("numaNodes", 1, "cpus"),
            "56-",
        ),
        "numaNodes[1]",
        "cpus",
        "not a CPU list",
        id="cpulist",
    ),
    pytest.param(
        _set(("nics", 2, "linkSpeedMbps"), 0), "nics[2]", "linkSpeedMbps", "must be > 0", id="speed"
    ),
    pytest.param(
        _set(("gpus", 0, "pcieRoot"), "0000:15"), "gpus[0]", "pcieRoot", "not a PCIe root", id="root"
    ),
    pytest.param(_set(("gpus", 3, "migEnabled"), "yes"), "gpus[3]", "migEnabled", "a boolean", id="bool"),
    pytest.param(_set(("gpus",), {"gpu-0": {}}), None, "gpus", "expected a list", id="gpus-not-a-list"),
]


@pytest.mark.parametrize(("mutate", "device", "field", "problem"), BAD_PROFILES)
def test_bad_profile_names_file_device_and_field(
    tmp_path: Path, mutate: Any, device: str | None, field: str, problem: str
) -> None:
    document = _h100()
    mutate(document)
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(InventoryError) as caught:
        load_profile(path)
    error = caught.value
    message = str(error)
    assert str(path) in message and error.source == str(path)
    assert error.field == field and f": {field}: " in message
    assert problem in message
    if device is not None:
        assert error.device is not None and error.device.startswith(device)
        assert device in message


@pytest.mark.parametrize(
    ("text", "problem"),
    [("gpus: [\n  - {", "not valid YAML"), ("- just\n- a list\n", "expected a mapping at the top level")],
)
def test_unparseable_profile(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(InventoryError, match=problem) as caught:
        load_profile(path)
    assert str(path) in str(caught.value)


def test_missing_file_is_an_inventory_error(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="cannot read"):
        load_profile(tmp_path / "absent.yaml")

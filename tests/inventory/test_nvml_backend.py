"""The NVML backend against a fake pynvml module and a fake sysfs tree."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest
from fake_pynvml import MIB, FakeGPU, FakeNVML
from sysfs_tree import FakeSysfs

from driver.errors import InventoryError
from driver.inventory.nvml import discover_nvml
from driver.slices import build_resource_slices

# NVML index order differs from PCI bus id order on purpose: names must follow the bus id.
H100_BUSES = ["0000:9d:00.0", "0000:1b:00.0", "0000:c3:00.0", "0000:43:00.0"]
H100_ROOTS = {"0000:1b:00.0": "pci0000:15", "0000:43:00.0": "pci0000:3d", "0000:9d:00.0": "pci0000:97",
              "0000:c3:00.0": "pci0000:bd"}  # fmt: skip
NVSWITCHES = ["0000:05:00.0", "0000:06:00.0"]


def nvml_bus(bdf: str) -> str:
    return "0000" + bdf.upper()  # NVML's 8-digit domain, upper-case hex


def h100s() -> list[FakeGPU]:
    return [
        FakeGPU(
            uuid=f"GPU-0000000{index}-1111-2222-3333-444444444444",
            bus_id=nvml_bus(bus),
            minor=index,
            nvlinks=[NVSWITCHES[0], "", NVSWITCHES[1]],  # link 1 is down
        )
        for index, bus in enumerate(H100_BUSES)
    ]


@pytest.fixture
def sysfs(tmp_path: Path) -> FakeSysfs:
    tree = FakeSysfs(tmp_path / "sys")
    tree.numa(0, "0-3")
    tree.numa(1, "4-7")
    for bus, root in H100_ROOTS.items():
        numa = 0 if bus < "0000:80" else 1
        tree.pci(bus, root=root, numa_node=numa, cpulist="0-3" if numa == 0 else "4-7")
    tree.pci("0000:18:00.0", root="pci0000:15", numa_node=0)
    tree.netdev("ibp24s0", bdf="0000:18:00.0")
    tree.infiniband("mlx5_0", bdf="0000:18:00.0")
    return tree


def test_discovers_gpus_named_by_bus_id_with_sysfs_topology(sysfs: FakeSysfs) -> None:
    nvml = FakeNVML(h100s())
    inventory = discover_nvml(nvml, node_name="gpu-node", sysfs_root=sysfs.root)

    assert inventory.node_name == "gpu-node"
    assert inventory.backend == "nvml"
    assert [gpu.pci_bus_id for gpu in inventory.gpus] == sorted(H100_BUSES)
    assert [gpu.name for gpu in inventory.gpus] == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    first = inventory.gpus[0]
    assert first.nvml_index == 1 and first.uuid.startswith("GPU-00000001")
    assert first.product_name == "NVIDIA H100 80GB HBM3"
    assert (first.brand, first.architecture) == ("NVIDIA", "Hopper")
    assert first.cuda_compute_capability == "9.0.0"
    assert first.memory_bytes == (81559 - 476) * MIB
    assert first.multiprocessors == 132
    assert first.minor_number == 1
    assert (first.numa_node, first.pcie_root, first.local_cpus) == (0, "pci0000:15", (0, 1, 2, 3))
    assert inventory.gpus[3].numa_node == 1
    assert inventory.driver_version == "550.54.15"
    assert inventory.cuda_driver_version == "12.4.0"
    assert [node.id for node in inventory.numa_nodes] == [0, 1]
    assert [(nic.name, nic.rdma_device) for nic in inventory.nics] == [("nic-0", "mlx5_0")]
    assert inventory.paired_nic(first) == inventory.nics[0]
    assert (nvml.initialized, nvml.shutdowns) == (1, 1)


def test_gpus_behind_shared_nvswitches_form_one_domain(sysfs: FakeSysfs) -> None:
    inventory = discover_nvml(FakeNVML(h100s()), node_name="n", sysfs_root=sysfs.root)
    assert {gpu.nvlink_domain for gpu in inventory.gpus} == {"nvlink-0"}
    assert inventory.gpus[0].nvlink_peers == tuple(sorted(H100_BUSES)[1:])


def test_bytes_results_of_older_pynvml_are_decoded(sysfs: FakeSysfs) -> None:
    nvml = FakeNVML(h100s(), as_bytes=True, driver_version=b"535.104.05")
    inventory = discover_nvml(nvml, node_name="n", sysfs_root=sysfs.root)
    assert isinstance(inventory.gpus[0].uuid, str) and inventory.gpus[0].uuid.startswith("GPU-")
    assert inventory.gpus[0].product_name == "NVIDIA H100 80GB HBM3"
    assert inventory.gpus[0].pci_bus_id == "0000:1b:00.0"
    assert inventory.driver_version == "535.104.5"  # semver: no leading zeros


def test_nvlink_not_supported_and_a_direct_bridge(sysfs: FakeSysfs) -> None:
    gpus = h100s()
    gpus[0].nvlinks = None  # 9d: NVLink query raises NotSupported
    gpus[1].nvlinks = [nvml_bus("0000:c3:00.0")]  # 1b <-> c3 over a bridge
    gpus[2].nvlinks = [nvml_bus("0000:1b:00.0")]
    gpus[3].nvlinks = []  # 43: links exist in NVML but none is active / present
    inventory = discover_nvml(FakeNVML(gpus), node_name="n", sysfs_root=sysfs.root)
    by_bus = {gpu.pci_bus_id: gpu for gpu in inventory.gpus}
    assert by_bus["0000:1b:00.0"].nvlink_domain == by_bus["0000:c3:00.0"].nvlink_domain == "nvlink-0"
    assert by_bus["0000:1b:00.0"].nvlink_peers == ("0000:c3:00.0",)
    assert by_bus["0000:9d:00.0"].nvlink_domain is None and by_bus["0000:9d:00.0"].nvlink_peers == ()
    assert by_bus["0000:43:00.0"].nvlink_domain is None


def test_sm_count_falls_back_to_the_largest_mig_profile(sysfs: FakeSysfs) -> None:
    gpus = h100s()[:2]
    gpus[0].cores = None
    gpus[0].mig_profile_sms = {0: 16, 2: 60, 4: 132}
    gpus[1].cores = None  # and no MIG profiles either: unknown, published without the attribute
    inventory = discover_nvml(FakeNVML(gpus), node_name="n", sysfs_root=sysfs.root)
    by_index = {gpu.nvml_index: gpu for gpu in inventory.gpus}
    assert by_index[0].multiprocessors == 132
    assert by_index[1].multiprocessors == 0
    devices = {d["name"]: d for d in build_resource_slices(inventory)[0]["spec"]["devices"]}
    assert "multiprocessors" not in devices[by_index[1].name]["attributes"]
    assert devices[by_index[0].name]["attributes"]["multiprocessors"] == {"int": 132}


@pytest.mark.parametrize(
    ("capability", "cores", "expected"),
    [((8, 0), 6912, 108), ((8, 9), 7424, 58), ((9, 0), 16896, 132), ((8, 6), 10752, 84)],
)
def test_sm_count_from_cores_per_sm(
    sysfs: FakeSysfs, capability: tuple[int, int], cores: int, expected: int
) -> None:
    gpu = h100s()[1]
    gpu.capability, gpu.cores = capability, cores
    inventory = discover_nvml(FakeNVML([gpu]), node_name="n", sysfs_root=sysfs.root)
    assert inventory.gpus[0].multiprocessors == expected


def test_memory_v2_unsupported_falls_back_to_total(sysfs: FakeSysfs) -> None:
    inventory = discover_nvml(
        FakeNVML(h100s()[:1], memory_v2_supported=False), node_name="n", sysfs_root=sysfs.root
    )
    assert inventory.gpus[0].memory_bytes == 81559 * MIB


def test_mig_mode_is_noted(sysfs: FakeSysfs) -> None:
    gpus = h100s()[:2]
    gpus[0].mig_mode = (1, 1)
    gpus[1].mig_mode = None  # NotSupported (e.g. an L4)
    inventory = discover_nvml(FakeNVML(gpus), node_name="n", sysfs_root=sysfs.root)
    assert {gpu.nvml_index: gpu.mig_enabled for gpu in inventory.gpus} == {0: True, 1: False}


@pytest.mark.parametrize("call", ["nvmlDeviceGetUUID", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetNvLinkState"])
def test_nvml_errors_name_the_gpu_index_and_the_call(sysfs: FakeSysfs, call: str) -> None:
    gpus = h100s()
    gpus[2].failing[call] = pynvml.NVML_ERROR_GPU_IS_LOST
    nvml = FakeNVML(gpus)
    with pytest.raises(InventoryError) as caught:
        discover_nvml(nvml, node_name="n", sysfs_root=sysfs.root)
    message = str(caught.value)
    assert "GPU index 2" in message
    assert "GPU is lost" in message
    assert call in message
    assert nvml.shutdowns == 1  # NVML is shut down even when discovery fails


def test_gpu_missing_from_sysfs_keeps_unknown_topology(tmp_path: Path) -> None:
    inventory = discover_nvml(FakeNVML(h100s()[:1]), node_name="n", sysfs_root=tmp_path / "empty")
    assert (inventory.gpus[0].numa_node, inventory.gpus[0].pcie_root) == (None, None)
    assert inventory.nics == () and inventory.numa_nodes == ()

"""Inventory -> ResourceSlices: shape per docs/architecture.md (Names, The share model), strict schema
validity on 1.35 and 1.37, acceptance by the emulator, chunking, taints and rendering."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes import client

from driver.cluster.apiserver import APIServer
from driver.inventory.discover import discover_inventory
from driver.inventory.fake import list_profiles
from driver.inventory.model import GPU, NIC, NodeInventory
from driver.slices import (
    build_resource_slices,
    format_binary_quantity,
    format_decimal_quantity,
    render_slices,
    slice_device_names,
)

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)

MIB = 1024**2
GIB = 1024**3
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)$")
UNHEALTHY = [{"key": "fractional.dev/unhealthy", "value": "xid-79", "effect": "NoSchedule"}]


def synthetic_inventory(gpus: int, nics: int = 0, node_name: str = "big-node") -> NodeInventory:
    return NodeInventory(
        node_name=node_name,
        gpus=tuple(
            GPU(
                name=f"gpu-{i}",
                uuid=f"GPU-{i:08x}-0000-4000-8000-000000000000",
                product_name="NVIDIA H100 80GB HBM3",
                brand="NVIDIA",
                architecture="Hopper",
                cuda_compute_capability="9.0.0",
                memory_bytes=80 * GIB - 1,
                multiprocessors=132,
                pci_bus_id=f"{i // 256:04x}:{i % 256:02x}:00.0",
                numa_node=i % 2,
            )
            for i in range(gpus)
        ),
        nics=tuple(
            NIC(
                name=f"nic-{i}",
                if_name=f"ib{i}",
                pci_bus_id=f"{0x100 + i // 256:04x}:{i % 256:02x}:00.0",
                rdma_device=f"mlx5_{i}",
                link_speed_mbps=400000,
            )
            for i in range(nics)
        ),
        driver_version="550.54.15",
        cuda_driver_version="12.4.0",
    )


def profile_slices(name: str, **kwargs: Any) -> list[dict[str, Any]]:
    inventory = discover_inventory(backend="fake", profile=name, node_name="node-1")
    return build_resource_slices(inventory, **kwargs)


CASES = [
    pytest.param(name, taints, id=f"{name}{'-tainted' if taints else ''}")
    for name in list_profiles()
    for taints in (None, {"gpu-0": UNHEALTHY, "nic-0": UNHEALTHY})
]


@pytest.mark.parametrize(("profile", "taints"), CASES)
@pytest.mark.parametrize("version", ["1.35.0", "1.37.0"])
def test_every_profile_validates_strict(profile: str, taints: Any, version: str) -> None:
    for item in profile_slices(profile, node_uid="0c5a3c4e-8f7e-4a51-9f0e-6c1d2b3a4f50", taints=taints):
        kubernetes_validate.validate(item, version, strict=True)


@pytest.mark.parametrize("version", ["1.35.0", "1.37.0"])
def test_chunked_and_tainted_slices_validate_strict(version: str) -> None:
    inventory = synthetic_inventory(150, 10)
    for taints in (None, {"gpu-3": UNHEALTHY}):
        for item in build_resource_slices(inventory, taints=taints):
            kubernetes_validate.validate(item, version, strict=True)


def test_every_profile_is_accepted_by_the_emulator(kube_configuration: client.Configuration) -> None:
    with client.ApiClient(kube_configuration) as api_client:
        api = client.ResourceV1Api(api_client)
        for name in list_profiles():
            for item in profile_slices(name) + profile_slices(name, taints={"gpu-1": UNHEALTHY}):
                item["spec"]["nodeName"] = item["spec"]["pool"]["name"] = (
                    f"{name}-{len(item['spec']['devices'])}"
                )
                item["metadata"]["generateName"] = f"{name}-"
                created = api.create_resource_slice(body=item, _request_timeout=10)
                assert created.metadata.name.startswith(f"{name}-")
                assert created.spec.devices[0].allow_multiple_allocations is True


def test_gpu_device_shape() -> None:
    (item,) = profile_slices("h100-8x", node_uid="uid-1")
    assert item["apiVersion"] == "resource.k8s.io/v1" and item["kind"] == "ResourceSlice"
    assert item["metadata"] == {
        "generateName": "node-1-fractional.dev-",
        "ownerReferences": [
            {"apiVersion": "v1", "kind": "Node", "name": "node-1", "uid": "uid-1", "controller": True}
        ],
    }
    spec = item["spec"]
    assert spec["driver"] == "fractional.dev" and spec["nodeName"] == "node-1"
    assert spec["pool"] == {"name": "node-1", "generation": 1, "resourceSliceCount": 1}
    names = [device["name"] for device in spec["devices"]]
    assert names == [f"gpu-{i}" for i in range(8)] + [f"nic-{i}" for i in range(8)]
    gpu = spec["devices"][0]
    assert gpu["allowMultipleAllocations"] is True
    attributes = gpu["attributes"]
    assert attributes["type"] == {"string": "gpu"}
    assert attributes["uuid"]["string"].startswith("GPU-")
    assert attributes["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert attributes["brand"] == {"string": "NVIDIA"} and attributes["architecture"] == {"string": "Hopper"}
    assert attributes["cudaComputeCapability"] == {"version": "9.0.0"}
    assert attributes["driverVersion"] == {"version": "550.54.15"}
    assert attributes["cudaDriverVersion"] == {"version": "12.4.0"}
    assert attributes["multiprocessors"] == {"int": 132}
    assert attributes["nvlinkDomain"] == {"string": "nvswitch-0"}
    assert attributes["resource.kubernetes.io/pciBusID"] == {"string": "0000:1b:00.0"}
    assert attributes["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:15"}
    assert attributes["resource.kubernetes.io/numaNode"] == {"int": 0}
    assert gpu["capacity"] == {
        "memory": {
            "value": "79Gi",  # (81559 - 476) MiB rounded down to 256Mi
            "requestPolicy": {
                "default": "79Gi",
                "validRange": {"min": "256Mi", "max": "79Gi", "step": "256Mi"},
            },
        },
        "compute": {
            "value": "100",
            "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}},
        },
    }
    nic = spec["devices"][8]
    assert nic["attributes"]["type"] == {"string": "nic"}
    assert nic["attributes"]["ifName"] == {"string": "ibp24s0"}
    assert nic["attributes"]["rdmaDevice"] == {"string": "mlx5_0"}
    assert nic["attributes"]["linkSpeedMbps"] == {"int": 400000}
    assert (
        nic["attributes"]["resource.kubernetes.io/pcieRoot"] == attributes["resource.kubernetes.io/pcieRoot"]
    )
    assert nic["allowMultipleAllocations"] is True
    assert nic["capacity"]["bandwidth"] == {
        "value": "400k",
        "requestPolicy": {"default": "400k", "validRange": {"min": "1", "max": "400k", "step": "1"}},
    }


def test_memory_is_rounded_down_to_256mi_and_versions_are_semver() -> None:
    for name in list_profiles():
        for item in profile_slices(name):
            for device in item["spec"]["devices"]:
                for attribute in device["attributes"].values():
                    if "version" in attribute:
                        assert SEMVER.match(attribute["version"]), attribute
                if device["attributes"]["type"]["string"] == "gpu":
                    value = device["capacity"]["memory"]["value"]
                    amount = int(value[:-2]) * (GIB if value.endswith("Gi") else MIB)
                    assert amount % (256 * MIB) == 0


def test_a100_has_no_nvlink_domain_and_odd_memory_keeps_mi() -> None:
    (item,) = profile_slices("a100-pcie-4x")
    gpu = item["spec"]["devices"][0]
    assert "nvlinkDomain" not in gpu["attributes"]
    assert gpu["capacity"]["memory"]["value"] == "40448Mi"  # 40960 - 437 MiB -> 40448Mi (39.5Gi)


def test_no_owner_reference_without_node_uid() -> None:
    (item,) = profile_slices("l4-2x")
    assert "ownerReferences" not in item["metadata"]


def test_nic_without_link_speed_is_exclusive() -> None:
    inventory = synthetic_inventory(0, 1)
    inventory = replace(inventory, nics=(replace(inventory.nics[0], link_speed_mbps=None),))
    (item,) = build_resource_slices(inventory)
    nic = item["spec"]["devices"][0]
    assert "allowMultipleAllocations" not in nic and "capacity" not in nic
    kubernetes_validate.validate(item, "1.35.0", strict=True)


def test_more_than_128_devices_are_chunked_gpus_first() -> None:
    slices = build_resource_slices(synthetic_inventory(200, 100), generation=3)
    assert [len(item["spec"]["devices"]) for item in slices] == [128, 128, 44]
    assert {item["spec"]["pool"]["resourceSliceCount"] for item in slices} == {3}
    assert {item["spec"]["pool"]["generation"] for item in slices} == {3}
    names = [device["name"] for item in slices for device in item["spec"]["devices"]]
    assert names == [f"gpu-{i}" for i in range(200)] + [f"nic-{i}" for i in range(100)]  # numeric order
    assert set().union(*(slice_device_names(item) for item in slices)) == set(names)


def test_taints_lower_the_limit_to_64() -> None:
    slices = build_resource_slices(
        synthetic_inventory(130), taints={"gpu-129": UNHEALTHY, "gpu-999": UNHEALTHY}
    )
    assert [len(item["spec"]["devices"]) for item in slices] == [64, 64, 2]
    tainted = [d for item in slices for d in item["spec"]["devices"] if "taints" in d]
    assert [(d["name"], d["taints"]) for d in tainted] == [("gpu-129", UNHEALTHY)]


def test_max_devices_per_slice_is_honoured() -> None:
    assert len(build_resource_slices(synthetic_inventory(10), max_devices_per_slice=4)) == 3


def test_empty_inventory_publishes_one_empty_slice() -> None:
    (item,) = build_resource_slices(NodeInventory(node_name="empty"))
    assert item["spec"]["devices"] == [] and item["spec"]["pool"]["resourceSliceCount"] == 1
    kubernetes_validate.validate(item, "1.37.0", strict=True)


def test_bad_taint_is_refused() -> None:
    with pytest.raises(ValueError, match="gpu-0"):
        build_resource_slices(synthetic_inventory(1), taints={"gpu-0": [{"key": "k", "effect": "Sometimes"}]})


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (80 * GIB, "80Gi"),
        (40448 * MIB, "40448Mi"),
        (256 * MIB, "256Mi"),
        (1536, "1536"),
        (1000, "1000"),
        (0, "0"),
        (1024**4, "1Ti"),
    ],
)
def test_binary_quantities(value: int, expected: str) -> None:
    assert format_binary_quantity(value) == expected


@pytest.mark.parametrize(
    ("value", "expected"), [(400000, "400k"), (100, "100"), (2500, "2500"), (1, "1"), (0, "0"), (10**9, "1G")]
)
def test_decimal_quantities(value: int, expected: str) -> None:
    assert format_decimal_quantity(value) == expected


def test_render_yaml_and_json_round_trip() -> None:
    slices = build_resource_slices(synthetic_inventory(130))
    assert list(yaml.safe_load_all(render_slices(slices, "yaml"))) == slices
    document = json.loads(render_slices(slices, "json"))
    assert document["kind"] == "List" and document["items"] == slices
    with pytest.raises(ValueError, match="toml"):
        render_slices(slices, "toml")


def test_emulator_with_sharing_off_keeps_exclusive_devices() -> None:
    (item,) = profile_slices("l4-2x")
    with (
        APIServer(disabled_features={"DRAConsumableCapacity"}) as server,
        client.ApiClient(server.configuration()) as api_client,
    ):
        created = client.ResourceV1Api(api_client).create_resource_slice(body=item, _request_timeout=10)
    assert created.spec.devices[0].allow_multiple_allocations is None
    assert created.spec.devices[0].capacity["memory"].request_policy is None


def test_the_pure_builder_does_not_know_the_publisher() -> None:
    """``driver.slices`` is pure: importing it loads neither the publisher nor the API client."""
    code = (
        "import sys, driver.slices as s; "
        "assert 'driver.publisher' not in sys.modules, 'publisher imported'; "
        "assert 'kubernetes' not in sys.modules, 'kubernetes imported'; "
        "assert not hasattr(s, 'SlicePublisher')"
    )
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=60)

"""Inventory -> ``resource.k8s.io/v1`` ResourceSlice objects (docs/architecture.md: Names, The share
model). Pure: no I/O.

One pool per node, named after the node; devices ``gpu-<n>`` then ``nic-<n>``, chunked into
slices of at most 128 devices (64 when any device carries taints). GPUs are shareable
(``allowMultipleAllocations``) with consumable ``memory`` and ``compute``; NICs with consumable
``bandwidth`` whose default is the whole link, so a plain NIC request stays exclusive-like.

This module knows nothing of the API: ``driver.publisher`` writes what it builds (and imports it,
never the other way round).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import yaml

from driver import DRIVER_NAME
from driver.inventory.model import GPU, NIC, NodeInventory

__all__ = [
    "API_VERSION",
    "MAX_DEVICES_PER_SLICE",
    "MAX_DEVICES_PER_SLICE_WITH_TAINTS",
    "SHARE_STEP_BYTES",
    "build_device_chunks",
    "build_device_classes",
    "build_devices",
    "build_gpu_device",
    "build_nic_device",
    "build_pool_slices",
    "build_resource_slice",
    "build_resource_slices",
    "format_binary_quantity",
    "format_decimal_quantity",
    "render_slices",
    "slice_device_names",
]

API_VERSION = "resource.k8s.io/v1"
MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_WITH_TAINTS = 64  # 1.35+: the limit when any device in a slice has taints
SHARE_STEP_BYTES = 256 * 1024**2  # memory shares are multiples of 256Mi
STANDARD_DOMAIN = "resource.kubernetes.io"

Taints = Mapping[str, Sequence[Mapping[str, Any]]]
"""Device name -> taint dicts (``{"key", "value"?, "effect"}``), e.g. ``fractional.dev/unhealthy``."""

_BINARY_SUFFIXES = (
    ("Ei", 1024**6),
    ("Pi", 1024**5),
    ("Ti", 1024**4),
    ("Gi", 1024**3),
    ("Mi", 1024**2),
    ("Ki", 1024),
)
_DECIMAL_SUFFIXES = (("E", 10**18), ("P", 10**15), ("T", 10**12), ("G", 10**9), ("M", 10**6), ("k", 10**3))
_DEVICE_NUMBER = re.compile(r"^(gpu|nic)-(\d+)$")


def format_binary_quantity(value: int) -> str:
    """Bytes in the canonical form an API server keeps: ``85899345920`` -> ``"80Gi"``.

    Exact binary multiples get the largest suffix; anything else is a plain integer.
    """
    if value > 0:
        for suffix, factor in _BINARY_SUFFIXES:
            if value % factor == 0:
                return f"{value // factor}{suffix}"
    return str(value)


def format_decimal_quantity(value: int) -> str:
    """A count in canonical decimal-SI form: ``400000`` -> ``"400k"``, ``100`` -> ``"100"``."""
    if value > 0:
        for suffix, factor in _DECIMAL_SUFFIXES:
            if value % factor == 0:
                return f"{value // factor}{suffix}"
    return str(value)


def build_gpu_device(gpu: GPU, inventory: NodeInventory) -> dict[str, Any]:
    """One shareable GPU: attributes plus consumable ``memory`` (256Mi steps) and ``compute`` (percent)."""
    attributes: dict[str, dict[str, Any]] = {
        "type": {"string": "gpu"},
        "uuid": {"string": gpu.uuid},
    }
    _put_string(attributes, "productName", gpu.product_name)
    _put_string(attributes, "brand", gpu.brand)
    _put_string(attributes, "architecture", gpu.architecture)
    attributes["cudaComputeCapability"] = {"version": gpu.cuda_compute_capability}
    if inventory.driver_version:
        attributes["driverVersion"] = {"version": inventory.driver_version}
    if inventory.cuda_driver_version:
        attributes["cudaDriverVersion"] = {"version": inventory.cuda_driver_version}
    if gpu.multiprocessors > 0:
        attributes["multiprocessors"] = {"int": gpu.multiprocessors}
    _put_string(attributes, "nvlinkDomain", gpu.nvlink_domain)
    _put_topology(attributes, gpu.pci_bus_id, gpu.pcie_root, gpu.numa_node)
    memory = format_binary_quantity(gpu.memory_bytes - gpu.memory_bytes % SHARE_STEP_BYTES)
    step = format_binary_quantity(SHARE_STEP_BYTES)
    return {
        "name": gpu.name,
        "allowMultipleAllocations": True,
        "attributes": attributes,
        "capacity": {
            "memory": {
                "value": memory,
                "requestPolicy": {
                    "default": memory,
                    "validRange": {"min": step, "max": memory, "step": step},
                },
            },
            "compute": {
                "value": "100",
                "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}},
            },
        },
    }


def build_nic_device(nic: NIC) -> dict[str, Any]:
    """One NIC. With a known link speed it is shareable by ``bandwidth`` (Mbps, default = the whole
    link, so a request without a bandwidth amount takes the NIC exclusively); without one it is a
    plain exclusive device."""
    attributes: dict[str, dict[str, Any]] = {"type": {"string": "nic"}}
    _put_string(attributes, "ifName", nic.if_name)
    _put_string(attributes, "rdmaDevice", nic.rdma_device)
    if nic.link_speed_mbps:
        attributes["linkSpeedMbps"] = {"int": nic.link_speed_mbps}
    _put_topology(attributes, nic.pci_bus_id, nic.pcie_root, nic.numa_node)
    device: dict[str, Any] = {"name": nic.name}
    if nic.link_speed_mbps:
        bandwidth = format_decimal_quantity(nic.link_speed_mbps)
        device["allowMultipleAllocations"] = True
        device["attributes"] = attributes
        device["capacity"] = {
            "bandwidth": {
                "value": bandwidth,
                "requestPolicy": {
                    "default": bandwidth,
                    "validRange": {"min": "1", "max": bandwidth, "step": "1"},
                },
            }
        }
    else:
        device["attributes"] = attributes
    return device


def build_devices(inventory: NodeInventory, *, taints: Taints | None = None) -> list[dict[str, Any]]:
    """Every device of the node: GPUs by number, then NICs by number; taints attached by name."""
    gpus = sorted(inventory.gpus, key=lambda gpu: _device_order(gpu.name))
    nics = sorted(inventory.nics, key=lambda nic: _device_order(nic.name))
    devices = [build_gpu_device(gpu, inventory) for gpu in gpus] + [build_nic_device(nic) for nic in nics]
    for device in devices:
        device_taints = (taints or {}).get(device["name"])
        if device_taints:
            device["taints"] = [_build_taint(taint, device["name"]) for taint in device_taints]
    return devices


def build_device_chunks(
    devices: Sequence[dict[str, Any]], *, max_devices_per_slice: int = MAX_DEVICES_PER_SLICE
) -> list[list[dict[str, Any]]]:
    """Consecutive chunks within the per-slice limit (64 when any device has taints); at least one
    (possibly empty) chunk, because an empty pool is not the same as a missing pool."""
    limit = min(max_devices_per_slice, MAX_DEVICES_PER_SLICE)
    if any(device.get("taints") for device in devices):
        limit = min(limit, MAX_DEVICES_PER_SLICE_WITH_TAINTS)
    if limit < 1:
        raise ValueError(f"max_devices_per_slice must be >= 1, found {max_devices_per_slice}")
    chunks = [list(devices[start : start + limit]) for start in range(0, len(devices), limit)]
    return chunks or [[]]


def build_resource_slice(
    *,
    node_name: str,
    devices: Sequence[dict[str, Any]],
    generation: int,
    slice_count: int,
    driver: str = DRIVER_NAME,
    node_uid: str | None = None,
) -> dict[str, Any]:
    """One ResourceSlice of the node's pool (``generateName``; the server picks the name)."""
    metadata: dict[str, Any] = {"generateName": f"{node_name}-{driver}-"}
    if node_uid:
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}
        ]
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {
            "driver": driver,
            "nodeName": node_name,
            "pool": {"name": node_name, "generation": generation, "resourceSliceCount": slice_count},
            "devices": [dict(device) for device in devices],
        },
    }


def build_resource_slices(
    inventory: NodeInventory,
    *,
    driver: str = DRIVER_NAME,
    generation: int = 1,
    node_uid: str | None = None,
    max_devices_per_slice: int = MAX_DEVICES_PER_SLICE,
    taints: Taints | None = None,
) -> list[dict[str, Any]]:
    """The node's whole pool as API-shaped camelCase dicts, ready to create."""
    chunks = build_device_chunks(
        build_devices(inventory, taints=taints), max_devices_per_slice=max_devices_per_slice
    )
    return build_pool_slices(
        chunks, node_name=inventory.node_name, generation=generation, driver=driver, node_uid=node_uid
    )


def build_pool_slices(
    chunks: Sequence[Sequence[dict[str, Any]]],
    *,
    node_name: str,
    generation: int,
    driver: str = DRIVER_NAME,
    node_uid: str | None = None,
) -> list[dict[str, Any]]:
    """One slice per chunk of devices, all of one pool generation (``resourceSliceCount`` = chunks)."""
    return [
        build_resource_slice(
            node_name=node_name,
            devices=chunk,
            generation=generation,
            slice_count=len(chunks),
            driver=driver,
            node_uid=node_uid,
        )
        for chunk in chunks
    ]


def build_device_classes() -> list[dict[str, Any]]:
    """The DeviceClasses that select our devices: ``gpu.fractional.dev`` and ``nic.fractional.dev``
    (the chart installs the same selectors; charts/fractional-dra/templates/deviceclasses.yaml)."""

    def device_class(name: str, device_type: str) -> dict[str, Any]:
        expression = (
            f'device.driver == "{DRIVER_NAME}" && device.attributes["{DRIVER_NAME}"].type == "{device_type}"'
        )
        return {
            "apiVersion": API_VERSION,
            "kind": "DeviceClass",
            "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": expression}}]},
        }

    return [device_class("gpu.fractional.dev", "gpu"), device_class("nic.fractional.dev", "nic")]


def slice_device_names(resource_slice: Mapping[str, Any]) -> frozenset[str]:
    """The set of device names in a slice (how the publisher matches existing to desired slices)."""
    devices = (resource_slice.get("spec") or {}).get("devices") or []
    return frozenset(str(device.get("name")) for device in devices)


def render_slices(slices: Iterable[Mapping[str, Any]], fmt: str) -> str:
    """``yaml``: one document per slice (``kubectl apply -f`` ready); ``json``: a ``v1`` ``List``."""
    items = [dict(item) for item in slices]
    if fmt == "yaml":
        return str(yaml.safe_dump_all(items, sort_keys=False, default_flow_style=False)).rstrip("\n")
    if fmt == "json":
        return json.dumps({"apiVersion": "v1", "kind": "List", "items": items}, indent=2)
    raise ValueError(f"output format {fmt!r} is not one of yaml, json")


def _device_order(name: str) -> tuple[str, int, str]:
    match = _DEVICE_NUMBER.fullmatch(name)
    return (match.group(1), int(match.group(2)), name) if match else ("~", 0, name)


def _put_string(attributes: dict[str, dict[str, Any]], key: str, value: str | None) -> None:
    if value:
        attributes[key] = {"string": value}


def _put_topology(
    attributes: dict[str, dict[str, Any]], pci_bus_id: str, pcie_root: str | None, numa_node: int | None
) -> None:
    attributes[f"{STANDARD_DOMAIN}/pciBusID"] = {"string": pci_bus_id}
    if pcie_root:
        attributes[f"{STANDARD_DOMAIN}/pcieRoot"] = {"string": pcie_root}
    if numa_node is not None:
        attributes[f"{STANDARD_DOMAIN}/numaNode"] = {"int": numa_node}


def _build_taint(taint: Mapping[str, Any], device: str) -> dict[str, Any]:
    if not taint.get("key") or taint.get("effect") not in ("NoSchedule", "NoExecute", "None"):
        raise ValueError(
            f"device {device}: taint {dict(taint)!r} needs a key and an effect (NoSchedule, NoExecute, None)"
        )
    built = {"key": str(taint["key"]), "effect": str(taint["effect"])}
    if taint.get("value"):
        built["value"] = str(taint["value"])
    if taint.get("timeAdded"):
        built["timeAdded"] = str(taint["timeAdded"])
    return built

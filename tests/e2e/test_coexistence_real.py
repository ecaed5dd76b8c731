"""Coexistence on the real cluster: the node agent notices GPUs also handed out elsewhere and stops
publishing them, with a Warning Event on the Node, then publishes them again once that clears.

- NVIDIA's DRA driver: a ResourceSlice of another driver on the node naming one of our GPUs' UUIDs.
- NVIDIA's device plugin: the Node advertising ``nvidia.com/gpu`` (set here through the Node's
  status, as a device plugin's kubelet would report it); it cannot say which GPUs, so all of them.

Both are undone at the end, and the test waits for our slices to be whole again.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_support import DRIVER, KubectlError, get, kubectl, list_items, wait_for
from test_driver import attribute

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

NODE = "198.18.0.3"  # the a100-pcie-4x node of the local cluster (any node of another cluster)
OTHER_DRIVER = "gpu.nvidia.com"
SLICE = "e2e-nvidia-dra-driver-slice"
# The agent re-checks at each resync (30 s by default): allow a few.
SECONDS = 180


def _node() -> str:
    names = [n["metadata"]["name"] for n in list_items("nodes")]
    return NODE if NODE in names else sorted(names)[-1]


def _our_gpus(node: str) -> dict[str, str]:
    """Our published GPUs on ``node``: device name -> UUID."""
    found = {}
    for resource_slice in list_items("resourceslices", "--field-selector", f"spec.driver={DRIVER}"):
        if resource_slice["spec"].get("nodeName") != node:
            continue
        for device in resource_slice["spec"].get("devices", []):
            if "memory" in (device.get("capacity") or {}):
                found[device["name"]] = str(attribute(device, "uuid"))
    return found


def _node_events(node: str, reason: str) -> list[dict[str, Any]]:
    return [
        e
        for e in list_items("events", "-n", "default", "--field-selector", f"involvedObject.name={node}")
        if e.get("reason") == reason and e["involvedObject"].get("kind") == "Node"
    ]


@pytest.fixture
def node(real_cluster: None) -> Iterator[str]:
    name = _node()
    whole = wait_for(lambda: _our_gpus(name), timeout=SECONDS, what=f"our GPUs on {name}")
    try:
        yield name
    finally:
        kubectl("delete", "resourceslice", SLICE, "--ignore-not-found")
        _remove_device_plugin_capacity(name)
        wait_for(lambda: _our_gpus(name) == whole, timeout=SECONDS, what="our slices whole again")


def _remove_device_plugin_capacity(node: str) -> None:
    status = get("node", node).get("status", {})
    patch = [
        {"op": "remove", "path": f"/status/{field}/nvidia.com~1gpu"}
        for field in ("capacity", "allocatable")
        if "nvidia.com/gpu" in status.get(field, {})
    ]
    if patch:
        kubectl("patch", "node", node, "--subresource=status", "--type=json", "-p", json.dumps(patch))


def test_a_second_dra_drivers_slice_with_our_uuid_withholds_that_gpu(node: str) -> None:
    gpus = _our_gpus(node)
    name, uuid = sorted(gpus.items())[-1]
    foreign = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": SLICE},
        "spec": {
            "driver": OTHER_DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0", "attributes": {"uuid": {"string": uuid}}}],
        },
    }
    kubectl("create", "-f", "-", stdin=json.dumps(foreign))
    wait_for(lambda: name not in _our_gpus(node), timeout=SECONDS, what=f"{name} withheld")
    assert set(_our_gpus(node)) == set(gpus) - {name}, "only the GPU the other driver names"
    wait_for(
        lambda: [e for e in _node_events(node, "GPUsClaimedElsewhere") if OTHER_DRIVER in e["message"]],
        timeout=SECONDS,
        what="the Warning on the Node naming the other driver",
    )
    kubectl("delete", "resourceslice", SLICE)
    wait_for(lambda: name in _our_gpus(node), timeout=SECONDS, what=f"{name} published again")
    wait_for(
        lambda: _node_events(node, "GPUsNoLongerClaimedElsewhere"), timeout=SECONDS, what="the Normal Event"
    )


def test_a_node_advertising_nvidia_gpu_withholds_all_its_gpus(node: str) -> None:
    gpus = _our_gpus(node)
    patch = [
        {"op": "add", "path": f"/status/{field}/nvidia.com~1gpu", "value": str(len(gpus))}
        for field in ("capacity", "allocatable")
    ]
    try:
        kubectl("patch", "node", node, "--subresource=status", "--type=json", "-p", json.dumps(patch))
    except KubectlError as error:
        pytest.fail(f"could not advertise nvidia.com/gpu on {node}: {error}")
    wait_for(lambda: not _our_gpus(node), timeout=SECONDS, what="every GPU of the node withheld")
    wait_for(
        lambda: [e for e in _node_events(node, "GPUsClaimedElsewhere") if "nvidia.com/gpu" in e["message"]],
        timeout=SECONDS,
        what="the Warning on the Node naming nvidia.com/gpu",
    )
    _remove_device_plugin_capacity(node)
    wait_for(lambda: _our_gpus(node) == gpus, timeout=SECONDS, what="the GPUs published again")

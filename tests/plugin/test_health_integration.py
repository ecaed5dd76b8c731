"""Device health end to end: the fake health file -> taint in the published ResourceSlice and the
kubelet's v1alpha1 health stream; clearing the file undoes both.

The delay from writing the file to the taint in the API is measured and reported (as the test
property ``taint_delay_seconds`` and on stdout with ``-s``), never asserted: the machine is noisy.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client

from driver.allocator import allocate
from driver.cluster.kubelet import KubeletSimulator
from driver.plugin.agent import NodeAgent
from driver.plugin.health import HEALTH_TAINT_KEY
from driver.slices import build_device_classes
from tests.plugin.conftest import NODE, NodeDirs, wait_for

StartAgent = Callable[..., NodeAgent]
MakeKubelet = Callable[..., KubeletSimulator]


def slice_taints(api: client.ResourceV1Api) -> dict[str, list[dict[str, Any]]]:
    """Device name -> its taints, over every slice of the node's pool (None until published)."""
    response = api.list_resource_slice(field_selector=f"spec.nodeName={NODE}", _preload_content=False)
    items = json.loads(response.data)["items"]
    return {
        device["name"]: device.get("taints") or []
        for item in items
        for device in item["spec"].get("devices") or []
    }


@pytest.fixture
def resource_api(kube_configuration: client.Configuration) -> Iterator[client.ResourceV1Api]:
    api_client = client.ApiClient(kube_configuration)
    try:
        yield client.ResourceV1Api(api_client)
    finally:
        api_client.close()


def _gpu_claim(count: int, tolerate: bool = False) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": "gpu.fractional.dev", "count": count}
    if tolerate:
        exactly["tolerations"] = [{"key": HEALTH_TAINT_KEY, "operator": "Exists"}]
    return {
        "metadata": {"name": "c", "namespace": "ns", "uid": f"uid-{count}-{tolerate}"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def assert_allocator_avoids(api: client.ResourceV1Api, *, tainted_device: str, healthy_device: str) -> None:
    """The slices as published, fed to our allocator: the tainted GPU is not chosen without a toleration."""
    response = api.list_resource_slice(field_selector=f"spec.nodeName={NODE}", _preload_content=False)
    slices = json.loads(response.data)["items"]
    classes = build_device_classes()
    for policy in ("best-fit", "first-fit"):
        (one,) = allocate([_gpu_claim(1)], slices=slices, classes=classes, node=NODE, policy=policy) or [None]
        assert one is not None and [r["device"] for r in one["devices"]["results"]] == [healthy_device]
        assert allocate([_gpu_claim(2)], slices=slices, classes=classes, node=NODE, policy=policy) is None
        tolerated = allocate([_gpu_claim(2, True)], slices=slices, classes=classes, node=NODE, policy=policy)
        assert tolerated is not None
        assert {r["device"] for r in tolerated[0]["devices"]["results"]} == {healthy_device, tainted_device}


def test_xid_taints_the_device_reports_unhealthy_and_clears(
    start_agent: StartAgent,
    make_kubelet: MakeKubelet,
    node_dirs: NodeDirs,
    resource_api: client.ResourceV1Api,
    record_property: Callable[[str, object], None],
) -> None:
    health_file = node_dirs.plugin.parent / "health.json"
    agent = start_agent(
        config={"health_file": str(health_file), "health_resend_seconds": 30.0, "resync_seconds": 300.0},
        publish_slices=True,
    )
    kubelet = make_kubelet()
    stream = kubelet.watch_health(timeout=60)
    assert {d["device_name"]: d["health"] for d in next(stream)} == {"gpu-0": "HEALTHY", "gpu-1": "HEALTHY"}
    assert agent.slices_published.wait(30)
    taints = slice_taints(resource_api)
    assert set(taints) >= {"gpu-0", "gpu-1", "nic-0"} and not any(taints.values())

    # 79: fallen off the bus (critical); 43 on gpu-0 is informational and ignored.
    written = time.monotonic()
    health_file.write_text(
        json.dumps({"gpu-0": {"xid": 43}, "gpu-1": {"xid": 79, "message": "fell off the bus"}})
    )
    tainted = wait_for(
        lambda: (t := slice_taints(resource_api))["gpu-1"] and t,
        timeout=20,  # the resync period is 300 s: only the health change can publish this soon
        what="the taint on gpu-1",
    )
    delay = time.monotonic() - written
    record_property("taint_delay_seconds", round(delay, 3))
    print(f"\nXID -> taint in the ResourceSlice: {delay:.3f} s")
    assert [{k: v for k, v in taint.items() if k != "timeAdded"} for taint in tainted["gpu-1"]] == [
        {"key": HEALTH_TAINT_KEY, "value": "xid-79", "effect": "NoSchedule"}
    ]
    assert tainted["gpu-0"] == [] and tainted["nic-0"] == []
    assert_allocator_avoids(resource_api, tainted_device="gpu-1", healthy_device="gpu-0")
    unhealthy = next(stream)  # sent on the change, long before the 30 s resend
    assert {d["device_name"]: d["health"] for d in unhealthy} == {"gpu-0": "HEALTHY", "gpu-1": "UNHEALTHY"}
    assert [d["message"] for d in unhealthy if d["device_name"] == "gpu-1"] == ["fell off the bus"]

    cleared_at = time.monotonic()
    health_file.unlink()
    wait_for(lambda: not any(slice_taints(resource_api).values()), timeout=20, what="the taint removed")
    record_property("untaint_delay_seconds", round(time.monotonic() - cleared_at, 3))
    healthy = next(stream)
    assert {d["device_name"]: d["health"] for d in healthy} == {"gpu-0": "HEALTHY", "gpu-1": "HEALTHY"}
    agent.stop()
    assert list(stream) == []

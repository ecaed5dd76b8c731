"""Coexistence with NVIDIA's device plugin and another DRA driver.

The pure part decides which of our GPUs are claimed elsewhere; on the embedded cluster the agent
notices a Node advertising ``nvidia.com/gpu`` and a second driver's slice carrying one of our UUIDs,
withholds those GPUs, says so once per change (Event on the Node, log line, gauge) and publishes
them again when the conflict clears.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from kubernetes import client
from prometheus_client import REGISTRY

from driver import DRIVER_NAME
from driver.cluster.apiserver import APIServer
from driver.inventory.model import NodeInventory
from driver.plugin.agent import NodeAgent
from driver.plugin.coexistence import (
    REASON_CLAIMED_ELSEWHERE,
    REASON_NO_LONGER_CLAIMED,
    ClaimedBy,
    Conflict,
    build_node_event,
    compute_conflicts,
    compute_report,
)
from tests.plugin.conftest import NODE, wait_for

OTHER_DRIVER = "gpu.nvidia.com"
StartAgent = Callable[..., NodeAgent]


def node_body(capacity: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": NODE}, "status": {"capacity": {"cpu": "32", **(capacity or {})}}}


def other_slice(
    attributes: dict[str, Any], *, driver: str = OTHER_DRIVER, name: str = "gpu-0"
) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{NODE}-{driver}"},
        "spec": {
            "driver": driver,
            "nodeName": NODE,
            "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": name, "attributes": {"type": {"string": "gpu"}, **attributes}}],
        },
    }


# -- which GPUs are claimed elsewhere (pure) ------------------------------------------------------


@pytest.mark.parametrize(
    ("capacity", "claimed"),
    [
        ({"nvidia.com/gpu": "2"}, "nvidia.com/gpu=2"),
        ({"nvidia.com/gpu.shared": "8"}, "nvidia.com/gpu.shared=8"),  # time-slicing, renamed
        ({"nvidia.com/mig-1g.5gb": "7", "nvidia.com/gpu": "1"}, "nvidia.com/gpu=1, nvidia.com/mig-1g.5gb=7"),
        ({"nvidia.com/gpu": "0"}, None),  # the plugin went away: the kubelet keeps the resource at 0
        ({"example.com/gpu": "2", "memory": "64Gi"}, None),
    ],
)
def test_device_plugin_capacity_claims_every_gpu(
    inventory: NodeInventory, capacity: dict[str, str], claimed: str | None
) -> None:
    conflicts = compute_conflicts(node=node_body(capacity), slices=[], inventory=inventory)
    if claimed is None:
        assert conflicts == ()
    else:
        assert conflicts == (Conflict(ClaimedBy.DEVICE_PLUGIN, claimed, ("gpu-0", "gpu-1")),)


@pytest.mark.parametrize(
    ("key", "transform"),
    [
        ("uuid", str),  # NVIDIA's DRA driver: unqualified, in its own domain
        (f"{OTHER_DRIVER}/uuid", str),
        ("uuid", str.lower),
        ("uuid", lambda uuid: uuid.removeprefix("GPU-")),
        ("parentUUID", str),  # a MIG device of our GPU
        ("example.com/UUID", str.upper),
    ],
)
def test_another_drivers_uuid_attribute_claims_that_gpu(
    inventory: NodeInventory, key: str, transform: Callable[[str], str]
) -> None:
    uuid = inventory.gpus[1].uuid
    published = other_slice({key: {"string": transform(uuid)}})
    assert compute_conflicts(node=node_body(), slices=[published], inventory=inventory) == (
        Conflict(ClaimedBy.DRA_DRIVER, f"driver {OTHER_DRIVER}, pool {NODE}", ("gpu-1",)),
    )


@pytest.mark.parametrize(
    "published",
    [
        other_slice({"uuid": {"string": "GPU-00000000-0000-0000-0000-000000000000"}}),  # not ours
        other_slice({"serial": {"string": "GPU-525c2e04-f577-4530-b5ed-9a24c758a320"}}),  # not a uuid
        other_slice({"uuid": {"int": 7}}),
        other_slice({"uuid": {"string": "GPU-525c2e04-f577-4530-b5ed-9a24c758a320"}}, driver=DRIVER_NAME),
    ],
    ids=["foreign-uuid", "other-attribute", "not-a-string", "our-own-driver"],
)
def test_slices_that_claim_nothing(inventory: NodeInventory, published: dict[str, Any]) -> None:
    assert inventory.gpus[0].uuid == "GPU-525c2e04-f577-4530-b5ed-9a24c758a320"
    assert compute_conflicts(node=node_body(), slices=[published], inventory=inventory) == ()


def test_withholding_is_a_setting(inventory: NodeInventory) -> None:
    published = other_slice({"uuid": {"string": inventory.gpus[0].uuid}})
    both = {"node": node_body({"nvidia.com/gpu": "1"}), "slices": [published], "inventory": inventory}
    on = compute_report(**both, withhold=True)
    assert on.gpus == on.withheld == ("gpu-0", "gpu-1")
    assert (on.count(ClaimedBy.DEVICE_PLUGIN), on.count(ClaimedBy.DRA_DRIVER)) == (2, 1)
    off = compute_report(**both, withhold=False)
    assert off.gpus == ("gpu-0", "gpu-1") and off.withheld == ()
    no_gpus = {**both, "inventory": replace(inventory, gpus=())}
    assert compute_report(**no_gpus, withhold=True).conflicts == ()


def test_node_event_is_found_by_kubectl_describe_node() -> None:
    from datetime import UTC, datetime

    event = build_node_event(
        node_name=NODE,
        reason=REASON_CLAIMED_ELSEWHERE,
        message="x" * 5000,
        warning=True,
        now=datetime.now(UTC),
    )
    # kubectl describe node searches involvedObject.uid == the node's name, as the kubelet records it.
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE}
    assert event["metadata"]["namespace"] == "default" and event["type"] == "Warning"
    assert len(event["message"]) <= 1024


# -- on the embedded cluster ----------------------------------------------------------------------


@pytest.fixture
def core_api(kube_configuration: client.Configuration) -> Iterator[client.CoreV1Api]:
    with client.ApiClient(kube_configuration) as api_client:
        yield client.CoreV1Api(api_client)


@pytest.fixture
def resource_api(kube_configuration: client.Configuration) -> Iterator[client.ResourceV1Api]:
    with client.ApiClient(kube_configuration) as api_client:
        yield client.ResourceV1Api(api_client)


def published_devices(api: client.ResourceV1Api) -> set[str]:
    response = api.list_resource_slice(
        field_selector=f"spec.nodeName={NODE},spec.driver={DRIVER_NAME}", _preload_content=False
    )
    return {
        device["name"] for item in json.loads(response.data)["items"] for device in item["spec"]["devices"]
    }


def node_events(api: client.CoreV1Api) -> list[tuple[str, str, str]]:
    events = api.list_namespaced_event(
        "default", field_selector=f"involvedObject.kind=Node,involvedObject.name={NODE}"
    ).items
    ordered = sorted(events, key=lambda event: int(event.metadata.resource_version))
    return [(event.type, event.reason, event.message) for event in ordered]


def claimed(claimed_by: ClaimedBy) -> float | None:
    return REGISTRY.get_sample_value(
        "fractional_plugin_gpus_claimed_elsewhere", {"node": NODE, "claimed_by": claimed_by.value}
    )


def resyncs_pass(server: APIServer, count: int = 3) -> None:
    """Wait for ``count`` more slice lists: the publisher's resyncs, each a chance to repeat itself."""
    seen = server.request_count("list", "resourceslices")
    wait_for(
        lambda: server.request_count("list", "resourceslices") >= seen + count, timeout=20, what="resyncs"
    )


def test_device_plugin_and_second_driver_are_noticed_withheld_and_cleared(
    start_agent: StartAgent,
    api_server: APIServer,
    core_api: client.CoreV1Api,
    resource_api: client.ResourceV1Api,
    inventory: NodeInventory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="driver.plugin.coexistence")
    core_api.create_node(node_body({"nvidia.com/gpu": "2"}))
    second = resource_api.create_resource_slice(other_slice({"uuid": {"string": inventory.gpus[1].uuid}}))
    agent = start_agent(publish_slices=True, config={"resync_seconds": 0.05})
    assert agent.slices_published.wait(30)

    # The device plugin's count names no GPU: none is published, the NIC is.
    assert published_devices(resource_api) == {"nic-0"}
    (event,) = node_events(core_api)
    assert event[:2] == ("Warning", REASON_CLAIMED_ELSEWHERE)
    assert "nvidia.com/gpu=2" in event[2] and f"driver {OTHER_DRIVER}, pool {NODE}" in event[2]
    assert inventory.gpus[1].uuid in event[2] and "does not publish gpu-0, gpu-1" in event[2]
    assert (claimed(ClaimedBy.DEVICE_PLUGIN), claimed(ClaimedBy.DRA_DRIVER)) == (2, 1)
    resyncs_pass(api_server)
    assert len(node_events(core_api)) == 1, "one Event per change, not one per resync"
    warnings = [r for r in caplog.records if r.getMessage() == "gpus claimed elsewhere"]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert warnings[0].withheld == ["gpu-0", "gpu-1"]  # type: ignore[attr-defined]

    # The device plugin is turned off (the kubelet keeps its resource at 0): only gpu-1 stays out.
    core_api.patch_node_status(NODE, {"status": {"capacity": {"nvidia.com/gpu": "0"}}})
    wait_for(lambda: published_devices(resource_api) == {"gpu-0", "nic-0"}, timeout=20, what="gpu-0 back")
    wait_for(lambda: len(node_events(core_api)) == 2, timeout=20, what="the second Event")
    changed = node_events(core_api)[1]
    assert changed[:2] == ("Warning", REASON_CLAIMED_ELSEWHERE) and "nvidia.com/gpu" not in changed[2]
    assert (claimed(ClaimedBy.DEVICE_PLUGIN), claimed(ClaimedBy.DRA_DRIVER)) == (0, 1)

    # The second driver goes: everything is published again, and that is said once too.
    resource_api.delete_resource_slice(second.metadata.name)
    wait_for(
        lambda: published_devices(resource_api) == {"gpu-0", "gpu-1", "nic-0"}, timeout=20, what="gpu-1 back"
    )
    wait_for(lambda: len(node_events(core_api)) == 3, timeout=20, what="the all-clear Event")
    resyncs_pass(api_server)
    assert [event[:2] for event in node_events(core_api)] == [
        ("Warning", REASON_CLAIMED_ELSEWHERE),
        ("Warning", REASON_CLAIMED_ELSEWHERE),
        ("Normal", REASON_NO_LONGER_CLAIMED),
    ]
    assert (claimed(ClaimedBy.DEVICE_PLUGIN), claimed(ClaimedBy.DRA_DRIVER)) == (0, 0)


def test_with_withholding_off_the_gpus_stay_published_and_the_warning_says_so(
    start_agent: StartAgent, core_api: client.CoreV1Api, resource_api: client.ResourceV1Api
) -> None:
    core_api.create_node(node_body({"nvidia.com/gpu": "2"}))
    agent = start_agent(publish_slices=True, config={"withhold_claimed_gpus": False})
    assert agent.slices_published.wait(30)
    assert published_devices(resource_api) == {"gpu-0", "gpu-1", "nic-0"}
    (event,) = wait_for(lambda: node_events(core_api), timeout=20, what="the Event")
    assert event[:2] == ("Warning", REASON_CLAIMED_ELSEWHERE) and "withholding is off" in event[2]
    assert claimed(ClaimedBy.DEVICE_PLUGIN) == 2

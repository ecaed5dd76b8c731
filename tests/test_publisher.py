"""The slice publisher against the API emulator, through the real client."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from kubernetes import client

from driver.cluster.apiserver import APIServer
from driver.errors import ConflictError
from driver.inventory.discover import discover_inventory
from driver.inventory.model import NodeInventory
from driver.plugin.coexistence import CoexistenceMonitor
from driver.publisher import SHARING_OFF_WARNING, SlicePublisher

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)

NODE = "node-1"
WRITES = ("create", "update", "patch", "delete", "deletecollection")
UNHEALTHY = [{"key": "fractional.dev/unhealthy", "value": "xid-79", "effect": "NoSchedule"}]


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            assert value, "condition not met before the deadline"
            return value
        threading.Event().wait(0.02)


def h100(node: str = NODE) -> NodeInventory:
    return discover_inventory(backend="fake", profile="h100-8x", node_name=node)


def many_gpus(count: int, node: str = NODE) -> NodeInventory:
    template = h100(node).gpus[0]
    gpus = tuple(
        replace(
            template,
            name=f"gpu-{i}",
            uuid=f"GPU-{i:08x}-0000-4000-8000-000000000000",
            pci_bus_id=f"0001:{i:02x}:00.0",
        )
        if i < 256
        else replace(template, name=f"gpu-{i}", pci_bus_id=f"0002:{i % 256:02x}:00.0")
        for i in range(count)
    )
    return replace(h100(node), gpus=gpus, nics=())


def writes(server: APIServer) -> int:
    return sum(server.request_count(verb, "resourceslices") for verb in WRITES)


def slices(api: client.ResourceV1Api, node: str = NODE) -> list[Any]:
    return list(api.list_resource_slice(field_selector=f"spec.nodeName={node}", _request_timeout=10).items)


@pytest.fixture
def api(kube_configuration: client.Configuration) -> Iterator[client.ResourceV1Api]:
    with client.ApiClient(kube_configuration) as api_client:
        yield client.ResourceV1Api(api_client)


@pytest.fixture(autouse=True)
def _info_logging(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)  # every log call runs (a bad ``extra`` key fails at INFO only)


@pytest.fixture
def publisher(kube_configuration: client.Configuration) -> Iterator[SlicePublisher]:
    with SlicePublisher(kube_configuration, NODE, resync_seconds=0.2, retry_seconds=0.05) as pub:
        yield pub


def create_node(configuration: client.Configuration, name: str = NODE) -> str:
    with client.ApiClient(configuration) as api_client:
        node = client.CoreV1Api(api_client).create_node({"metadata": {"name": name}}, _request_timeout=10)
    return str(node.metadata.uid)


def test_first_publish_creates_with_node_owner(
    api_server: APIServer, kube_configuration: client.Configuration, api: client.ResourceV1Api
) -> None:
    uid = create_node(kube_configuration)
    with SlicePublisher(kube_configuration, NODE) as publisher:
        result = publisher.publish(h100())
    assert (result.created, result.updated, result.deleted, result.generation) == (1, 0, 0, 1)
    assert result.sharing_enabled
    (published,) = slices(api)
    assert published.metadata.name.startswith(f"{NODE}-fractional.dev-")
    (owner,) = published.metadata.owner_references
    assert (owner.kind, owner.name, owner.uid, owner.controller) == ("Node", NODE, uid, True)
    assert published.spec.pool.name == NODE and published.spec.pool.resource_slice_count == 1
    assert len(published.spec.devices) == 16
    assert api_server.request_count("get", "nodes") == 1


def test_noop_republish_writes_nothing(
    api_server: APIServer, publisher: SlicePublisher, api: client.ResourceV1Api
) -> None:
    publisher.publish(h100())
    api_server.reset_counts()
    for _ in range(3):
        result = publisher.publish(h100())
        assert (result.writes, result.unchanged, result.generation) == (0, 1, 1)
    assert writes(api_server) == 0
    assert api_server.request_count("list", "resourceslices") == 3
    # The Node is read on every sync (its UID may change), one GET each.
    assert api_server.request_count("get", "nodes") == 3


def test_missing_node_publishes_without_owner(
    publisher: SlicePublisher, api: client.ResourceV1Api, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="driver.publisher"):
        publisher.publish(h100())
        publisher.publish(h100())
    (published,) = slices(api)
    assert not published.metadata.owner_references
    assert [r.getMessage() for r in caplog.records].count(
        "node not found; slices are published without an owner reference"
    ) == 1


def test_node_recreated_gets_the_new_owner_uid(
    kube_configuration: client.Configuration, publisher: SlicePublisher, api: client.ResourceV1Api
) -> None:
    first_uid = create_node(kube_configuration)
    publisher.publish(h100())
    with client.ApiClient(kube_configuration) as api_client:
        client.CoreV1Api(api_client).delete_node(NODE, _request_timeout=10)
    second_uid = create_node(kube_configuration)
    assert second_uid != first_uid
    result = publisher.publish(h100())
    # Updated in place; or, on a real cluster, created anew: kube-controller-manager's garbage
    # collector may already have deleted the slice that the old Node owned.
    assert (result.updated + result.created, result.generation) == (1, 1)
    (published,) = slices(api)
    assert [owner.uid for owner in published.metadata.owner_references] == [second_uid]


def test_node_missing_at_first_gets_its_owner_once_it_exists(
    kube_configuration: client.Configuration,
    publisher: SlicePublisher,
    api: client.ResourceV1Api,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="driver.publisher"):
        publisher.publish(h100())
        uid = create_node(kube_configuration)
        publisher.publish(h100())
        with client.ApiClient(kube_configuration) as api_client:
            client.CoreV1Api(api_client).delete_node(NODE, _request_timeout=10)
        publisher.publish(h100())
    (published,) = slices(api)
    # The stale owner is kept while no garbage collector ran (the bare emulator has none); on a
    # real cluster the collector deletes the slice of the deleted Node, and it comes back ownerless.
    assert [owner.uid for owner in published.metadata.owner_references or ()] in ([uid], [])
    # Logged once per disappearance: at the start, and again after the delete.
    assert [r.getMessage() for r in caplog.records].count(
        "node not found; slices are published without an owner reference"
    ) == 2


def test_slice_deleted_behind_our_back_is_recreated(
    api_server: APIServer, publisher: SlicePublisher, api: client.ResourceV1Api
) -> None:
    publisher.publish(h100())
    (first,) = slices(api)
    api.delete_resource_slice(first.metadata.name, _request_timeout=10)
    result = publisher.publish(h100())
    assert result.created == 1 and result.deleted == 0
    (again,) = slices(api)
    assert again.metadata.name != first.metadata.name
    assert len(again.spec.devices) == 16


def test_gpu_removed_updates_the_pool_in_place(publisher: SlicePublisher, api: client.ResourceV1Api) -> None:
    inventory = h100()
    publisher.publish(inventory)
    smaller = replace(inventory, gpus=inventory.gpus[:7])
    result = publisher.publish(smaller)
    assert (result.created, result.updated, result.deleted, result.generation) == (0, 1, 0, 1)
    (published,) = slices(api)
    assert "gpu-7" not in {device.name for device in published.spec.devices}
    assert len(published.spec.devices) == 15


def test_taints_are_published_and_cleared(publisher: SlicePublisher, api: client.ResourceV1Api) -> None:
    publisher.publish(h100())
    assert publisher.publish(h100(), {"gpu-2": UNHEALTHY}).updated == 1
    (published,) = slices(api)
    tainted = {d.name: [(t.key, t.effect) for t in d.taints] for d in published.spec.devices if d.taints}
    assert tainted == {"gpu-2": [("fractional.dev/unhealthy", "NoSchedule")]}
    assert (
        publisher.publish(h100(), {"gpu-2": UNHEALTHY}).writes == 0
    )  # timeAdded filled by the server is ignored
    assert publisher.publish(h100()).updated == 1
    assert not any(d.taints for d in slices(api)[0].spec.devices)


def test_over_128_devices_chunks_and_bumps_generation(
    api_server: APIServer, publisher: SlicePublisher, api: client.ResourceV1Api
) -> None:
    result = publisher.publish(many_gpus(300))
    assert (result.created, result.slice_count, result.generation) == (3, 3, 1)
    published = slices(api)
    assert sorted(len(s.spec.devices) for s in published) == [44, 128, 128]
    assert {(s.spec.pool.generation, s.spec.pool.resource_slice_count) for s in published} == {(1, 3)}

    # one device changes in one slice: generation kept, one update
    changed = many_gpus(300)
    changed = replace(
        changed,
        gpus=(*changed.gpus[:200], replace(changed.gpus[200], multiprocessors=114), *changed.gpus[201:]),
    )
    result = publisher.publish(changed)
    assert (result.created, result.updated, result.deleted, result.generation) == (0, 1, 0, 1)

    # a GPU removed from the first slice shifts every chunk: new device sets -> generation 2, old ones go
    api_server.reset_counts()
    result = publisher.publish(replace(changed, gpus=changed.gpus[1:]))
    assert result.generation == 2 and result.created == 3 and result.deleted == 3
    published = slices(api)
    assert {(s.spec.pool.generation, s.spec.pool.resource_slice_count) for s in published} == {(2, 3)}
    names = [d.name for s in published for d in s.spec.devices]
    assert len(names) == len(set(names)) == 299 and "gpu-0" not in names

    # shrinking to one slice: the surviving match is rewritten, surplus slices deleted
    result = publisher.publish(many_gpus(100))
    assert len(slices(api)) == 1 and result.slice_count == 1
    assert slices(api)[0].spec.pool.resource_slice_count == 1


def test_two_slices_changed_bumps_generation_and_rewrites_all(
    publisher: SlicePublisher, api: client.ResourceV1Api
) -> None:
    inventory = many_gpus(300)
    publisher.publish(inventory)
    gpus = list(inventory.gpus)
    gpus[5] = replace(gpus[5], multiprocessors=100)
    gpus[250] = replace(gpus[250], multiprocessors=100)
    result = publisher.publish(replace(inventory, gpus=tuple(gpus)))
    assert (result.created, result.updated, result.deleted, result.generation) == (0, 3, 0, 2)
    assert {s.spec.pool.generation for s in slices(api)} == {2}


def test_obsolete_generation_and_foreign_pool_are_deleted(
    publisher: SlicePublisher, api: client.ResourceV1Api
) -> None:
    stale = {
        "metadata": {"generateName": "stale-"},
        "spec": {"driver": "fractional.dev", "nodeName": NODE, "pool": {"name": NODE, "generation": 0,
                 "resourceSliceCount": 1}, "devices": [{"name": "gpu-99"}]},
    }  # fmt: skip
    foreign = {
        "metadata": {"generateName": "foreign-"},
        "spec": {"driver": "fractional.dev", "nodeName": NODE, "pool": {"name": "other-pool", "generation": 7,
                 "resourceSliceCount": 1}, "devices": []},
    }  # fmt: skip
    other_driver = {
        "metadata": {"generateName": "gpu-nvidia-"},
        "spec": {"driver": "gpu.nvidia.com", "nodeName": NODE, "pool": {"name": NODE, "generation": 9,
                 "resourceSliceCount": 1}, "devices": []},
    }  # fmt: skip
    publisher.publish(h100())
    for body in (stale, foreign, other_driver):
        api.create_resource_slice(body, _request_timeout=10)
    result = publisher.publish(h100())
    assert (result.deleted, result.created, result.updated) == (2, 0, 0)
    remaining = {(s.spec.driver, s.spec.pool.name, s.spec.pool.generation) for s in slices(api)}
    assert remaining == {("fractional.dev", NODE, 1), ("gpu.nvidia.com", NODE, 9)}


def test_gpus_claimed_elsewhere_are_withheld_until_the_conflict_clears(
    api_server: APIServer, kube_configuration: client.Configuration, api: client.ResourceV1Api
) -> None:
    """The coexistence check gets the Node (read once, also for the owner) and the other drivers'
    slices; what it names stays out of the pool, in place, and comes back when it stops naming it."""
    with client.ApiClient(kube_configuration) as api_client:
        core = client.CoreV1Api(api_client)
        core.create_node({"metadata": {"name": NODE}, "status": {"capacity": {"nvidia.com/gpu": "8"}}})
        gpu_names = tuple(gpu.name for gpu in h100().gpus)
        with SlicePublisher(
            kube_configuration, NODE, coexistence=CoexistenceMonitor(kube_configuration, NODE)
        ) as publisher:
            api_server.reset_counts()
            result = publisher.publish(h100())
            assert result.withheld == gpu_names and result.created == 1
            assert api_server.request_count("get", "nodes") == 1
            (published,) = slices(api)
            assert {d.name for d in published.spec.devices} == {f"nic-{i}" for i in range(8)}

            core.patch_node_status(NODE, {"status": {"capacity": {"nvidia.com/gpu": "0"}}})
            result = publisher.publish(h100())
            assert result.withheld == () and (result.updated, result.generation) == (1, 1)
            (published,) = slices(api)
            assert len(published.spec.devices) == 16


def test_conflict_on_update_is_retried_and_nothing_is_lost(
    api_server: APIServer, publisher: SlicePublisher, api: client.ResourceV1Api
) -> None:
    publisher.publish(h100())
    api_server.inject_fault(verb="update", resource="resourceslices", status=409, times=2)
    result = publisher.publish(h100(), {"gpu-0": UNHEALTHY})
    assert result.attempts == 3 and result.updated == 1
    (published,) = slices(api)
    assert [d.name for d in published.spec.devices if d.taints] == ["gpu-0"]
    assert len(published.spec.devices) == 16


def test_a_slice_deleted_between_list_and_update_is_planned_again(
    api_server: APIServer, publisher: SlicePublisher, api: client.ResourceV1Api
) -> None:
    """A Node deleted and made again under the same name: the garbage collector removes the old
    Node's slice while the agent updates it (seen with hack/localcluster fleet on 1.37.2). The 404
    is a conflict like a 409: re-list and write what is there then."""
    publisher.publish(h100())
    api_server.inject_fault(verb="update", resource="resourceslices", status=404, times=1)
    result = publisher.publish(h100(), {"gpu-0": UNHEALTHY})
    assert result.attempts == 2 and result.updated == 1
    (published,) = slices(api)
    assert [d.name for d in published.spec.devices if d.taints] == ["gpu-0"]


def test_conflict_retries_are_bounded(
    api_server: APIServer, kube_configuration: client.Configuration, api: client.ResourceV1Api
) -> None:
    with SlicePublisher(kube_configuration, NODE, max_attempts=2) as publisher:
        publisher.publish(h100())
        api_server.inject_fault(verb="update", resource="resourceslices", status=409, times=5)
        with pytest.raises(ConflictError):
            publisher.publish(h100(), {"gpu-0": UNHEALTHY})
    assert not any(d.taints for d in slices(api)[0].spec.devices)


def test_dropped_sharing_field_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    with (
        APIServer(disabled_features={"DRAConsumableCapacity"}) as server,
        SlicePublisher(server.configuration(), NODE) as publisher,
        caplog.at_level(logging.WARNING),
    ):
        first = publisher.publish(h100())
        assert first.created == 1 and first.sharing_enabled is False
        server.reset_counts()
        again = publisher.publish(h100())
        assert again.writes == 0 and again.sharing_enabled is False
        assert writes(server) == 0
        changed = publisher.publish(replace(h100(), gpus=h100().gpus[:6]))
        assert changed.updated == 1 and not publisher.sharing_enabled
    warnings = [r for r in caplog.records if r.getMessage() == SHARING_OFF_WARNING]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING


def test_run_loop_recreates_deleted_slices_and_stops(
    api_server: APIServer, publisher: SlicePublisher, api: client.ResourceV1Api
) -> None:
    stop = threading.Event()
    calls: list[int] = []

    def source() -> tuple[NodeInventory, None]:
        calls.append(1)
        return h100(), None

    thread = publisher.start(stop, source)
    try:
        assert thread.name == f"slice-publisher-{NODE}"
        (first,) = wait_for(lambda: slices(api))
        api.delete_resource_slice(first.metadata.name, _request_timeout=10)  # the kubelet wipes on restart
        wait_for(lambda: [s for s in slices(api) if s.metadata.name != first.metadata.name])
        before = len(calls)
        publisher.request_sync()
        wait_for(lambda: len(calls) > before)
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()


def test_run_loop_survives_a_failing_source(publisher: SlicePublisher, api: client.ResourceV1Api) -> None:
    stop = threading.Event()
    attempts: list[int] = []

    def flaky() -> tuple[NodeInventory, None]:
        attempts.append(1)
        if len(attempts) < 3:
            raise ConflictError("inventory not ready")
        return h100(), None

    thread = publisher.start(stop, flaky)
    try:
        wait_for(lambda: slices(api))
    finally:
        stop.set()
        thread.join(5)
    assert len(attempts) >= 3 and not thread.is_alive()


def test_inventory_for_another_node_is_refused(publisher: SlicePublisher) -> None:
    with pytest.raises(ValueError, match="node-2"):
        publisher.publish(h100("node-2"))

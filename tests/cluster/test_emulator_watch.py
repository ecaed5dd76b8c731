"""Watches through ``kubernetes.watch.Watch``: live events, resume, 410, selectors, shutdown."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client, watch

from driver.cluster.apiserver import APIServer
from tests.cluster.conftest import create_namespaces, slice_body

DEADLINE_SECONDS = 10.0


def wait_for(predicate: Callable[[], bool], timeout: float = DEADLINE_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    ready = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        ready.wait(0.01)


class _Consumer:
    """Drains a watch stream on its own thread into a queue."""

    def __init__(self, func: Callable[..., Any], return_type: type | None = None, **kwargs: Any) -> None:
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.error: BaseException | None = None
        self.watch = watch.Watch(return_type=return_type)
        self._thread = threading.Thread(target=self._run, args=(func, kwargs), name="test-watch", daemon=True)
        self._thread.start()

    def _run(self, func: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        try:
            for event in self.watch.stream(func, **kwargs):
                self.events.put(event)
        except BaseException as error:  # handed to the test thread
            self.error = error

    def take(self, count: int) -> list[tuple[str, str]]:
        return [self._next() for _ in range(count)]

    def _next(self) -> tuple[str, str]:
        event = self.events.get(timeout=DEADLINE_SECONDS)
        return event["type"], event["object"].metadata.name

    def join(self) -> bool:
        self._thread.join(DEADLINE_SECONDS)
        return not self._thread.is_alive()


@pytest.fixture
def consumers() -> Iterator[list[_Consumer]]:
    started: list[_Consumer] = []
    yield started
    for consumer in started:
        consumer.watch.stop()


def test_watch_sees_added_modified_deleted_live(
    api_server: APIServer, resource: client.ResourceV1Api, consumers: list[_Consumer]
) -> None:
    start = resource.list_resource_slice().metadata.resource_version
    consumer = _Consumer(resource.list_resource_slice, resource_version=start, timeout_seconds=60)
    consumers.append(consumer)
    wait_for(lambda: api_server.request_count("watch", "resourceslices") == 1)
    resource.create_resource_slice(slice_body("s1"))
    resource.patch_resource_slice("s1", {"metadata": {"labels": {"a": "1"}}})
    resource.delete_resource_slice("s1")
    assert consumer.take(3) == [("ADDED", "s1"), ("MODIFIED", "s1"), ("DELETED", "s1")]


def test_watch_resumes_from_resource_version(
    resource: client.ResourceV1Api, consumers: list[_Consumer]
) -> None:
    resource.create_resource_slice(slice_body("s1"))
    after_first = resource.list_resource_slice().metadata.resource_version
    resource.create_resource_slice(slice_body("s2"))
    resource.delete_resource_slice("s1")
    consumer = _Consumer(resource.list_resource_slice, resource_version=after_first, timeout_seconds=60)
    consumers.append(consumer)
    assert consumer.take(2) == [("ADDED", "s2"), ("DELETED", "s1")]


def test_watch_without_version_starts_with_current_objects(
    resource: client.ResourceV1Api, consumers: list[_Consumer]
) -> None:
    resource.create_resource_slice(slice_body("s1"))
    consumer = _Consumer(resource.list_resource_slice, timeout_seconds=60)
    consumers.append(consumer)
    assert consumer.take(1) == [("ADDED", "s1")]


def test_too_old_resource_version_is_410_gone(tmp_path: Any) -> None:
    with APIServer(history_limit=2) as server, client.ApiClient(server.configuration()) as api:
        resource = client.ResourceV1Api(api)
        resource.create_resource_slice(slice_body("s1"))
        for generation in range(2, 6):
            resource.patch_resource_slice("s1", {"spec": {"pool": {"generation": generation}}})
        with pytest.raises(client.ApiException) as caught:
            for _ in watch.Watch().stream(
                resource.list_resource_slice, resource_version="1", timeout_seconds=5
            ):
                pass
        assert caught.value.status == 410
        assert "too old resource version" in str(caught.value.reason)


def test_selector_watch_reports_objects_leaving_as_deleted(
    api_server: APIServer, core: client.CoreV1Api, consumers: list[_Consumer]
) -> None:
    start = core.list_node().metadata.resource_version
    consumer = _Consumer(core.list_node, label_selector="pool=a", resource_version=start, timeout_seconds=60)
    consumers.append(consumer)
    core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "other"}})
    core.create_node(
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "labels": {"pool": "a"}}}
    )
    core.patch_node("n1", {"metadata": {"labels": {"pool": "b"}}})
    core.patch_node("n1", {"metadata": {"labels": {"pool": "a"}}})
    assert consumer.take(3) == [("ADDED", "n1"), ("DELETED", "n1"), ("ADDED", "n1")]


def test_field_selector_watch_filters_namespaced_claims_across_namespaces(
    core: client.CoreV1Api, resource: client.ResourceV1Api, consumers: list[_Consumer]
) -> None:
    from tests.cluster.conftest import claim_body

    create_namespaces(core, "team-a", "team-b")
    start = resource.list_resource_claim_for_all_namespaces().metadata.resource_version
    consumer = _Consumer(
        resource.list_resource_claim_for_all_namespaces,
        # the client derives "V1ResourceClaim" from the list type, a model that does not exist
        return_type=client.ResourceV1ResourceClaim,
        field_selector="metadata.namespace=team-b",
        resource_version=start,
        timeout_seconds=60,
    )
    consumers.append(consumer)
    resource.create_namespaced_resource_claim("team-a", claim_body("a", "team-a"))
    resource.create_namespaced_resource_claim("team-b", claim_body("b", "team-b"))
    assert consumer.take(1) == [("ADDED", "b")]


def test_watch_timeout_seconds_ends_the_stream(resource: client.ResourceV1Api) -> None:
    events = list(watch.Watch().stream(resource.list_resource_slice, timeout_seconds=1))
    assert events == []


def test_stop_ends_open_watches_and_leaves_no_threads() -> None:
    with APIServer() as server, client.ApiClient(server.configuration()) as api:
        resource = client.ResourceV1Api(api)
        consumer = _Consumer(resource.list_resource_slice, timeout_seconds=300)
        wait_for(lambda: server.request_count("watch") == 1)
        resource.list_resource_slice()  # leaves an idle keep-alive connection open too
        server.stop()  # what is tested (the stop on leaving the block finds nothing left to do)
        assert consumer.join()
    leftovers = [thread.name for thread in threading.enumerate() if thread.name.startswith("apiserver")]
    assert leftovers == []


def test_bookmark_at_timeout_carries_a_resumable_version(
    core: client.CoreV1Api, resource: client.ResourceV1Api
) -> None:
    resource.create_resource_slice(slice_body("s1"))
    start = resource.list_resource_slice().metadata.resource_version
    core.create_node(
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}}
    )  # moves the global version
    events = list(
        watch.Watch().stream(
            resource.list_resource_slice,
            resource_version=start,
            allow_watch_bookmarks=True,
            timeout_seconds=1,
        )
    )
    assert [event["type"] for event in events] == ["BOOKMARK"]
    bookmark_version = events[0]["raw_object"]["metadata"]["resourceVersion"]
    assert int(bookmark_version) > int(start)
    resource.create_resource_slice(slice_body("s2"))
    resumed = watch.Watch().stream(
        resource.list_resource_slice, resource_version=bookmark_version, timeout_seconds=5
    )
    first = next(iter(resumed))
    assert (first["type"], first["object"].metadata.name) == ("ADDED", "s2")

"""GangUnschedulable Events follow client-go's core/v1 series: a repeat updates the
same Event (count, lastTimestamp); a pod re-created under the same name (another UID) or an Event
past the apiserver's TTL gets a new one; a gang stuck for hours keeps its Event alive."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes import client

from driver.cluster.apiserver import APIServer
from driver.controller.model.objects import GangKey
from driver.controller.writes.events import EVENT_TTL_SECONDS, REPORTING_COMPONENT, EventMemory, EventRecorder
from tests.controller.conftest import (
    NAMESPACE,
    Cluster,
    RunningController,
    gated_pod,
    gpu_claim,
    wait_for,
)

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)

GANG = GangKey(f"{NAMESPACE}/train")
MESSAGE = "gang train (2 pods) needs 2 shares of >=40Gi; no node offers any"


class FakeTime:
    """A monotonic clock and a wall clock that move together, only when told."""

    def __init__(self) -> None:
        self.seconds = 1000.0
        self.start = datetime(2030, 1, 1, tzinfo=UTC)

    def monotonic(self) -> float:
        return self.seconds

    def now(self) -> datetime:
        return self.start + timedelta(seconds=self.seconds - 1000.0)


@pytest.fixture
def api(api_server: APIServer) -> Iterator[client.ApiClient]:
    with client.ApiClient(api_server.configuration()) as api_client:
        yield api_client


@pytest.fixture
def clock() -> FakeTime:
    return FakeTime()


@pytest.fixture
def recorder(api: client.ApiClient, clock: FakeTime) -> EventRecorder:
    return EventRecorder(api, identity="test", memory=EventMemory(monotonic=clock.monotonic), now=clock.now)


def _events(api: client.ApiClient) -> list[dict[str, Any]]:
    """Our controller's Events in the namespace. Only ours: on a real cluster others write there too
    (kube-controller-manager's node-controller posts RegisteredNode and RemovingNode there, the latter
    at its next 5 s pass: after the clean-up of the test before that made the Node; seen in CI on
    1.37.2)."""
    response = client.CoreV1Api(api).list_namespaced_event(NAMESPACE, _preload_content=False)
    items: list[dict[str, Any]] = json.loads(response.data)["items"]
    ours = [e for e in items if e.get("reportingComponent") == REPORTING_COMPONENT]
    return sorted(ours, key=lambda e: (e["firstTimestamp"], e["metadata"]["name"]))


def _pod(api: client.ApiClient, name: str = "train-0") -> dict[str, Any]:
    body = gated_pod(name, [], gang="train", size=2)
    response = client.CoreV1Api(api).create_namespaced_pod(NAMESPACE, body, _preload_content=False)
    pod: dict[str, Any] = json.loads(response.data)
    return pod


def test_a_repeat_updates_the_same_event(
    api: client.ApiClient, recorder: EventRecorder, clock: FakeTime
) -> None:
    pod = _pod(api)
    assert recorder.gang_unschedulable(GANG, pod, MESSAGE)
    clock.seconds += 90
    assert recorder.gang_unschedulable(GANG, pod, MESSAGE)
    clock.seconds += 90
    assert recorder.gang_unschedulable(GANG, pod, MESSAGE)
    (event,) = _events(api)
    assert event["count"] == 3
    assert event["firstTimestamp"] == "2030-01-01T00:00:00Z"
    assert event["lastTimestamp"] == "2030-01-01T00:03:00Z"
    assert event["involvedObject"]["uid"] == pod["metadata"]["uid"]
    assert (recorder.emitted, recorder.updated) == (1, 2)


def test_a_pod_recreated_under_the_same_name_gets_its_own_event(
    api: client.ApiClient, recorder: EventRecorder
) -> None:
    first = _pod(api)
    recorder.gang_unschedulable(GANG, first, MESSAGE)
    client.CoreV1Api(api).delete_namespaced_pod("train-0", NAMESPACE, grace_period_seconds=0)
    second = _pod(api)  # a StatefulSet's (or LeaderWorkerSet's) replacement: same name, new UID
    assert second["metadata"]["uid"] != first["metadata"]["uid"]
    assert recorder.gang_unschedulable(GANG, second, MESSAGE)
    events = _events(api)
    # Listed by generated name, so in no particular order: one Event per UID, each said once.
    counts = {e["involvedObject"]["uid"]: e["count"] for e in events}
    assert counts == {first["metadata"]["uid"]: 1, second["metadata"]["uid"]: 1}


def test_after_the_event_ttl_a_repeat_creates_a_new_event(
    api: client.ApiClient, recorder: EventRecorder, clock: FakeTime
) -> None:
    pod = _pod(api)
    recorder.gang_unschedulable(GANG, pod, MESSAGE)
    clock.seconds += EVENT_TTL_SECONDS + 1  # the apiserver has deleted it by now (--event-ttl)
    assert recorder.gang_unschedulable(GANG, pod, MESSAGE)
    events = _events(api)
    assert len(events) == 2 and [e["count"] for e in events] == [1, 1]
    assert events[1]["firstTimestamp"] == events[1]["lastTimestamp"]


def test_an_event_deleted_meanwhile_is_created_again(api: client.ApiClient, recorder: EventRecorder) -> None:
    pod = _pod(api)
    recorder.gang_unschedulable(GANG, pod, MESSAGE)
    (event,) = _events(api)
    client.CoreV1Api(api).delete_namespaced_event(event["metadata"]["name"], NAMESPACE)
    assert recorder.gang_unschedulable(GANG, pod, MESSAGE)
    (again,) = _events(api)
    assert again["metadata"]["name"] != event["metadata"]["name"] and again["count"] == 1


def test_a_gang_stuck_for_hours_keeps_its_event(
    api: client.ApiClient, recorder: EventRecorder, clock: FakeTime
) -> None:
    pod = _pod(api)
    recorder.gang_unschedulable(GANG, pod, MESSAGE)
    clock.seconds += 60
    assert recorder.keep_alive(GANG) == 0  # written a minute ago: nothing to do
    for _ in range(4):  # two hours, each resync finding the gang as it was
        clock.seconds += EVENT_TTL_SECONDS / 2
        assert recorder.keep_alive(GANG) == 1
    (event,) = _events(api)  # one Event, never older than the TTL
    assert event["count"] == 5
    assert event["lastTimestamp"] == "2030-01-01T02:01:00Z"


def test_a_new_message_is_a_new_event_and_forget_ends_the_series(
    api: client.ApiClient, recorder: EventRecorder
) -> None:
    pod = _pod(api)
    recorder.gang_unschedulable(GANG, pod, MESSAGE)
    recorder.gang_unschedulable(GANG, pod, MESSAGE + "; scale-up hint: 1 x h100-8x")
    recorder.forget(GANG)  # placed; later it does not fit again
    recorder.gang_unschedulable(GANG, pod, MESSAGE)
    assert [e["count"] for e in _events(api)] == [1, 1, 1]


def test_the_controller_says_why_again_for_a_pod_recreated_under_the_same_name(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    """A StatefulSet replaces a gang's first pod (same name, new UID): the controller's next
    explanation is an Event of its own on the new pod, not a silent repeat of the old one's."""
    cluster.add_node("node-a", "l4-2x")
    for i in range(3):  # three 16Gi shares, two L4 GPUs: never fits
        cluster.create_claim(gpu_claim(f"big-{i}", memory="16Gi", compute=None))
        cluster.create_pod(gated_pod(f"big-{i}", [f"big-{i}"], gang="big", size=3))
    controller()

    def said_on(uid: str) -> bool:
        said = [e for e in cluster.events() if e["reason"] == "GangUnschedulable"]
        return any(e["involvedObject"].get("uid") == uid for e in said)

    first = cluster.pod("big-0")["metadata"]["uid"]
    wait_for(lambda: said_on(first), what="the Event on the first big-0")
    cluster.core.delete_namespaced_pod("big-0", NAMESPACE, grace_period_seconds=0)
    second = cluster.create_pod(gated_pod("big-0", ["big-0"], gang="big", size=3))["metadata"]["uid"]
    assert second != first
    wait_for(lambda: said_on(second), what="an Event on the re-created big-0")

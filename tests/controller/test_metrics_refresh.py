"""The metrics refresh runs on its own thread and never holds up a decision: on 40,000 GPUs one
takes most of a second, and a pod that arrived meanwhile used to wait for it (the decider refreshed
them itself, under the cache's lock)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from driver.allocator.state import FreeSnapshot
from driver.controller import Controller, ReconcilerSettings
from driver.controller.loop import controller as controller_module
from driver.controller.metrics import ControllerMetrics
from tests.controller.conftest import Cluster, T, gated_pod, gpu_claim, wait_for

pytestmark = pytest.mark.timeout(90)

GI = 1 << 30


class Hold:
    """Wraps a function so that its first call on the metrics thread waits until ``released``
    (longer than any ``wait_for``: a test that waits for something the hold blocks fails first)."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.released = threading.Event()
        self.left = threading.Event()

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def held(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name == "metrics-refresh" and not self.released.is_set():
                self.inside.set()
                self.released.wait(2 * T)
                self.left.set()
            return original(*args, **kwargs)

        return held


@pytest.fixture
def started(cluster: Cluster) -> Iterator[Callable[..., Controller]]:
    instances: list[Controller] = []

    def start(**overrides: Any) -> Controller:
        instance = Controller(
            configuration=cluster.server.configuration(), settings=ReconcilerSettings(),
            metrics_refresh_seconds=0.05, **overrides,
        )  # fmt: skip
        instances.append(instance)
        instance.start()
        return instance

    yield start
    for instance in instances:
        instance.stop()


@pytest.mark.parametrize(
    ("owner", "name"),
    [
        (FreeSnapshot, "summary"),
        (controller_module, "compute_overcommits"),
        (ControllerMetrics, "observe_capacity"),
        (ControllerMetrics, "observe_fragmentation"),
    ],
)
def test_a_pod_is_decided_while_a_refresh_is_under_way(
    cluster: Cluster,
    started: Callable[..., Controller],
    monkeypatch: pytest.MonkeyPatch,
    owner: Any,
    name: str,
) -> None:
    """Each per-GPU step of a refresh is held mid-way: the decider (which decides under the cache's
    lock) still places a pod meanwhile, so that step runs without the lock and off the decider."""
    hold = Hold()
    monkeypatch.setattr(owner, name, hold.wrap(getattr(owner, name)))
    cluster.add_node("node-a", "l4-2x")
    instance = started()
    try:
        assert hold.inside.wait(T), "no refresh started"
        cluster.create_claim(gpu_claim("m", memory="6Gi", compute=20))
        cluster.create_pod(gated_pod("m", ["m"]))
        wait_for(lambda: cluster.ungated("m"), what="the pod placed while the refresh is held")
        assert not hold.left.is_set()  # the refresh was held the whole time
    finally:
        hold.released.set()
    allocated = instance.metrics.memory_bytes.labels(node="node-a", kind="allocated")
    wait_for(lambda: allocated._value.get() == 6 * GI, what="a later refresh counting the allocation")


def test_no_refresh_before_decisions_start(cluster: Cluster, started: Callable[..., Controller]) -> None:
    """The refresh starts where the decider starts deciding: a synced view, decisions allowed."""
    cluster.add_node("node-a", "l4-2x")
    instance = started(hold_decisions=True)
    assert instance.wait_synced(T)
    gauge = instance.metrics.gpus
    assert gauge._value.get() == 0 and not instance._metrics_thread.is_alive()
    instance.allow_decisions()
    wait_for(lambda: gauge._value.get() == 2, what="the first refresh")
    instance.stop_deciding()
    assert not instance._metrics_thread.is_alive()  # stopped with the decider

"""The pipelined write path: decisions never wait for writes, each gang's writes keep
their order, and a failed write undoes exactly its own gang."""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from driver.cluster.apiserver import APIServer
from driver.controller import Controller, ReconcilerSettings, WriteRecord
from tests.controller.conftest import Cluster, gated_pod, gpu_claim, wait_for

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)

WRITE_DELAY_MS = 40  # what etcd adds: a sequential path would spend 3 x 40 ms per gang


@pytest.fixture
def slow_cluster(tmp_path: Path) -> Iterator[Cluster]:
    server = APIServer(write_delay_ms=WRITE_DELAY_MS)
    server.start()
    api_client = client.ApiClient(server.configuration())
    cluster = Cluster(server=server, kubeconfig=tmp_path / "unused", api_client=api_client)
    try:
        cluster.add_classes()
        cluster.add_node("node-a", "h100-8x")
        yield cluster
    finally:
        api_client.close()
        server.stop()


def _gangs(cluster: Cluster, count: int, pods: int) -> dict[str, list[str]]:
    gangs: dict[str, list[str]] = {}
    for g in range(count):
        names = [f"g{g}-{i}" for i in range(pods)]
        for name in names:
            cluster.create_claim(gpu_claim(name, memory="4Gi", compute=5))
            cluster.create_pod(gated_pod(name, [name], gang=f"g{g}", size=pods))
        gangs[f"g{g}"] = names
    return gangs


def _by_gang(records: list[WriteRecord]) -> dict[str, list[str]]:
    sequence: dict[str, list[str]] = defaultdict(list)
    for record in records:
        name = record.key.split("/", 1)[1]
        sequence[name.split("-", 1)[0]].append(f"{record.action} {name}")
    return sequence


def _start(cluster: Cluster, hook: object) -> Controller:
    instance = Controller(
        configuration=cluster.server.configuration(),
        settings=ReconcilerSettings(),
        write_hook=hook,  # type: ignore[arg-type]
    )
    instance.start()
    return instance


@pytest.mark.timeout(90)
def test_decisions_do_not_wait_for_writes_and_each_gang_keeps_its_order(slow_cluster: Cluster) -> None:
    cluster = slow_cluster
    gangs = _gangs(cluster, count=8, pods=2)
    records: list[WriteRecord] = []
    lock = threading.Lock()
    decided_while_writing = threading.Event()
    instance: Controller | None = None

    def hook(record: WriteRecord) -> None:
        with lock:
            records.append(record)
            first = len(records) == 1
        if first:  # hold this writer inside the very first write: the decider must not need it
            # A write can come before start() returns and the test holds its controller.
            wait_for(lambda: instance is not None, what="the test holds its controller")
            assert instance is not None
            registry = instance.metrics.registry

            def decided() -> float:
                return (
                    registry.get_sample_value(
                        "fractional_controller_decisions_total", {"outcome": "allocated"}
                    )
                    or 0
                )

            wait_for(lambda: decided() >= len(gangs), what="every gang decided meanwhile")
            decided_while_writing.set()

    instance = _start(cluster, hook)
    try:
        wait_for(
            lambda: all(cluster.ungated(n) for names in gangs.values() for n in names), what="all placed"
        )
        assert decided_while_writing.is_set()
        sequence = _by_gang(records)
        for gang, names in gangs.items():  # per gang: the allocation of each claim, then the gates
            expected = [f"allocate {n}" for n in names]
            assert sequence[gang] == expected + [f"ungate {n}" for n in names]
        # Pipelined: gangs were written side by side, not one after the other.
        order = [r.key.split("/", 1)[1].split("-", 1)[0] for r in records]
        runs = sum(1 for a, b in itertools.pairwise(order) if a != b)
        assert runs > len(gangs) - 1
    finally:
        instance.stop()


@pytest.mark.timeout(90)
def test_a_failed_write_undoes_exactly_its_gang(slow_cluster: Cluster) -> None:
    cluster = slow_cluster
    gangs = _gangs(cluster, count=4, pods=3)
    # The second claim of gang g2 gets one 409 on its allocation: g2 alone is undone and decided again.
    cluster.server.inject_fault(verb="update", resource="resourceclaims/status", status=409, name="g2-1")
    records: list[WriteRecord] = []
    lock = threading.Lock()

    def hook(record: WriteRecord) -> None:
        with lock:
            records.append(record)

    instance = _start(cluster, hook)
    try:
        wait_for(
            lambda: all(cluster.ungated(n) for names in gangs.values() for n in names), what="all placed"
        )
        sequence = _by_gang(records)
        for gang, names in gangs.items():
            done = [f"allocate {n}" for n in names] + [f"ungate {n}" for n in names]
            if gang != "g2":
                assert sequence[gang] == done  # untouched by g2's failure: nothing undone, written once
                continue
            assert sequence[gang][:2] == ["allocate g2-0", "deallocate g2-0"]  # what it wrote, undone
            assert sequence[gang][2:] == done  # then decided again and written whole
        assert all(cluster.allocated(n) for names in gangs.values() for n in names)
    finally:
        instance.stop()


def test_a_stop_with_a_full_queue_still_ends_every_writer(slow_cluster: Cluster) -> None:
    """A writer pool whose queue is full when it is stopped (writers held up by the client rate
    limit) once gave up on its stop marks at the first full put: the writers drained the queue and
    then waited for a job forever, each join running out its own timeout (32 writers, 10 s each)."""
    from driver.controller.writes.pipeline import WritePool

    pool = WritePool(
        configuration=slow_cluster.server.configuration(), workers=3, capacity=2, identity="test",
        fence=threading.Event(), hook=None, on_halt=lambda: None,
    )  # fmt: skip
    pool.start()
    release, never = threading.Event(), threading.Event()
    for _ in range(3 + 2):  # every writer busy, the queue full
        assert pool.submit(lambda _writers: release.wait(30), stop=never)
    stopper = threading.Thread(target=pool.stop, kwargs={"timeout_seconds": 60.0})
    stopper.start()
    release.set()
    stopper.join(60)
    assert not stopper.is_alive()
    assert not any(t.is_alive() for t in pool._threads) and pool.pending == 0  # all left, every job ran

"""Crashes, vanished allocations and leader election: nothing half-done, nothing allocated twice."""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.utils import parse_quantity

from driver.controller import Controller, HaltWrites, ReconcilerSettings, WriteRecord
from driver.controller.model.objects import allocated_by_us
from driver.controller.view.cache import Kind
from tests.controller.conftest import Cluster, RunningController, gated_pod, gpu_claim, wait_for

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)


def _make_gang(cluster: Cluster, name: str, pods: int, memory: str = "16Gi") -> list[str]:
    for i in range(pods):
        cluster.create_claim(gpu_claim(f"{name}-{i}", memory=memory, compute=None))
        cluster.create_pod(gated_pod(f"{name}-{i}", [f"{name}-{i}"], gang=name, size=pods))
    return [f"{name}-{i}" for i in range(pods)]


@pytest.mark.parametrize("crash_after_writes", [1, 3, 5, 7])
def test_restart_mid_gang_converges_with_nothing_half_done(
    cluster: Cluster, controller: Callable[..., RunningController], crash_after_writes: int
) -> None:
    cluster.add_node("node-a", "l4-2x")
    cluster.add_node("node-b", "l4-2x")
    names = _make_gang(cluster, "g", 4)
    writes: list[WriteRecord] = []

    def crash(record: WriteRecord) -> None:
        writes.append(record)
        if len(writes) >= crash_after_writes:
            raise HaltWrites()

    first = controller(write_hook=crash)
    wait_for(lambda: len(writes) >= crash_after_writes, what="the simulated crash")
    first.shutdown()
    # 4 allocations then 4 gates: the crash left a gang half-done.
    assert sum(cluster.allocated(n) for n in names) > 0
    assert not all(cluster.ungated(n) for n in names)

    controller()
    wait_for(lambda: all(cluster.ungated(n) for n in names), what="gang converged")
    devices = set()
    for name in names:
        claim = cluster.claim(name)
        assert claim is not None and not claim["metadata"].get("finalizers") and allocated_by_us(claim)
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        devices.add((result["pool"], result["device"]))
    assert len(devices) == 4  # one 16Gi share per L4: a leftover allocation would have taken a GPU twice


@contextlib.contextmanager
def _placed_one(cluster: Cluster, name: str) -> Iterator[Controller]:
    """A controller started beside one node, after it placed the gated pod ``name`` (2Gi); stopped after."""
    cluster.add_node("node-a", "l4-2x")
    cluster.create_claim(gpu_claim(name, memory="2Gi"))
    cluster.create_pod(gated_pod(name, [name]))
    instance = Controller(configuration=cluster.server.configuration(), settings=ReconcilerSettings())
    instance.start()
    try:
        wait_for(lambda: cluster.ungated(name), what=f"{name} placed")
        yield instance
    finally:
        instance.stop()


def test_vanished_allocation_is_counted(cluster: Cluster) -> None:
    with _placed_one(cluster, "v") as instance:
        # What kube-scheduler's PostFilter does when the pod fits no node: clear the allocation, and
        # the reservation we wrote with it (it clears a claim reserved for nobody or for that pod).
        claim = cluster.claim("v")
        assert claim is not None
        assert [r["uid"] for r in claim["status"]["reservedFor"]] == [cluster.pod("v")["metadata"]["uid"]]
        del claim["status"]["allocation"], claim["status"]["reservedFor"]
        cluster.resource.replace_namespaced_resource_claim_status("v", "default", claim)
        registry = instance.metrics.registry
        wait_for(lambda: registry.get_sample_value("fractional_controller_allocations_vanished_total") == 1,
                 what="counted")  # fmt: skip
        assert not cluster.allocated("v") and not cluster.has_finalizer("v")


def test_a_replica_told_to_stop_places_nothing_more_and_keeps_watching(cluster: Cluster) -> None:
    """A clean stop begins with ``stop_deciding``: on a real cluster a Deployment scaled to 0 keeps the
    process alive for the rest of its grace period (``kubectl rollout status`` returns before), and a
    pod made then must wait gated, as docs/install.md says. Seen in make e2e: the replica went on
    placing pods while it closed the allocation guard and the Kueue check. The watches stay up, so
    the guard still answers from a current view until it is closed."""
    with _placed_one(cluster, "before") as instance:
        instance.stop_deciding()
        cluster.create_claim(gpu_claim("after", memory="2Gi"))
        cluster.create_pod(gated_pod("after", ["after"]))
        wait_for(lambda: instance.cache.get(Kind.POD, "default/after") is not None, what="the pod seen")
        threading.Event().wait(1.0)  # a decider still running would place it well within this
        assert not cluster.ungated("after") and not cluster.allocated("after")


def _over_capacity(cluster: Cluster) -> list[str]:
    capacity: dict[tuple[str, str], dict[str, int]] = {}
    body = cluster.resource.list_resource_slice(_preload_content=False)
    import json

    for s in json.loads(body.data)["items"]:
        for device in s["spec"]["devices"]:
            capacity[(s["spec"]["pool"]["name"], device["name"])] = {
                k: int(parse_quantity(v["value"])) for k, v in device.get("capacity", {}).items()
            }
    used: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for claim in cluster.claims():
        for result in (
            ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results", [])
        ):
            for k, v in result.get("consumedCapacity", {}).items():
                used[(result["pool"], result["device"])][k] += int(parse_quantity(v))
    return [f"{d}: {k}" for d, caps in used.items() for k, v in caps.items() if v > capacity[d][k]]


def test_two_controllers_with_leader_election_never_double_allocate(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    for i in range(4):
        cluster.add_node(f"node-{i}", "h100-8x")  # 32 GPUs: 224 shares of 10Gi fit, 200 claims come
    # 200 pods and a 1.5 s renew deadline: no client-side rate limit (--kube-api-qps 0), which would
    # stretch the 600-odd writes over 12 s and delay each renewal behind the writers' tokens.
    lease = {"leader_elect": True, "lease_duration_seconds": 2.0, "renew_deadline_seconds": 1.5,
             "retry_period_seconds": 0.1, "kube_api_qps": 0}  # fmt: skip
    a = controller(identity="replica-a", **lease)
    b = controller(identity="replica-b", **lease)
    wait_for(lambda: a.started.is_set() or b.started.is_set(), what="a leader")
    leader, follower = (a, b) if a.started.is_set() else (b, a)
    assert not follower.started.is_set()

    def create(start: int, stop: int) -> None:
        for i in range(start, stop):
            cluster.create_claim(gpu_claim(f"c{i}", memory="10Gi", compute=10))
            cluster.create_pod(gated_pod(f"p{i}", [f"c{i}"]))

    create(0, 100)
    wait_for(lambda: sum(cluster.allocated(f"c{i}") for i in range(0, 100, 10)) >= 3, what="leader at work")
    creator = threading.Thread(target=create, args=(100, 200), name="test-creator")
    creator.start()
    assert leader.shutdown() == 0  # clean stop mid-stream: the lease is released, the follower takes over
    wait_for(follower.started.is_set, what="follower became leader")
    creator.join()
    wait_for(lambda: all(c.get("status", {}).get("allocation") for c in cluster.claims()), timeout=60,
             what="all 200 claims allocated")  # fmt: skip
    assert len(cluster.claims()) == 200
    assert _over_capacity(cluster) == []
    lease_obj: Any = client.CoordinationV1Api(cluster.api_client).read_namespaced_lease(
        "fractional-dra-controller", "default"
    )
    assert lease_obj.spec.holder_identity == ("replica-b" if leader is a else "replica-a")

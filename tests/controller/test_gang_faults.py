"""Gangs under deletion and crashes: a gang ends whole or fully released, and
no pod is ungated without all of its claims."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from driver.controller import FINALIZER, Controller, HaltWrites, ReconcilerSettings, WriteRecord
from driver.controller.model.objects import is_deleting
from driver.controller.view.cache import Kind
from tests.controller.conftest import NAMESPACE, Cluster, gated_pod, gpu_claim, wait_for

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)

GANG = 4
WRITES = 2 * GANG  # the allocation of each claim, then one gate per pod
COMMIT = GANG + 1  # the first gate removed: from here on the gang is committed


def make_gang(cluster: Cluster, name: str, pods: int = GANG, memory: str = "16Gi") -> list[str]:
    for i in range(pods):
        cluster.create_claim(gpu_claim(f"{name}-{i}", memory=memory, compute=None))
        cluster.create_pod(gated_pod(f"{name}-{i}", [f"{name}-{i}"], gang=name, size=pods))
    return [f"{name}-{i}" for i in range(pods)]


def pod_exists(cluster: Cluster, name: str) -> bool:
    return any(
        p["metadata"]["name"] == name for p in cluster.core.list_namespaced_pod(NAMESPACE).to_dict()["items"]
    )


def ours(cluster: Cluster, name: str) -> bool:
    """The claim holds something of ours: an allocation (or our finalizer, which only earlier
    versions wrote: none may appear)."""
    claim = cluster.claim(name)
    return bool(claim and (FINALIZER in (claim["metadata"].get("finalizers") or ())
                           or (claim.get("status") or {}).get("allocation")))  # fmt: skip


def gang_state(cluster: Cluster, names: list[str]) -> str:
    """'whole', 'released' or 'mixed' for the pods still there (and their claims)."""
    pods = [n for n in names if pod_exists(cluster, n)]
    ungated = [n for n in pods if cluster.ungated(n)]
    for name in ungated:  # never a pod ungated without its claim allocated
        assert cluster.allocated(name), f"pod {name} is ungated but its claim is not allocated"
    if pods and len(ungated) == len(pods):  # each of them allocated (above)
        return "whole"
    if not ungated and not any(ours(cluster, n) for n in names):
        return "released"
    return "mixed"


@dataclass
class Harness:
    cluster: Cluster
    running: list[Controller]

    def start(
        self, hook: Callable[[WriteRecord], None] | None = None, resync_seconds: float = 30.0
    ) -> Controller:
        instance = Controller(
            configuration=self.cluster.server.configuration(), settings=ReconcilerSettings(),
            write_hook=hook, resync_seconds=resync_seconds,
        )  # fmt: skip
        instance.start()
        self.running.append(instance)
        return instance


@pytest.fixture
def harness(cluster: Cluster) -> Iterator[Harness]:
    h = Harness(cluster=cluster, running=[])
    yield h
    for instance in h.running:
        instance.stop()


def delete_and_wait_seen(harness: Harness, instance: Controller, kind: Kind, name: str) -> None:
    """Delete, then wait until the controller's cache has seen it: the race is decided, not left open."""
    if kind is Kind.CLAIM:
        harness.cluster.resource.delete_namespaced_resource_claim(name, NAMESPACE)
    else:
        harness.cluster.core.delete_namespaced_pod(name, NAMESPACE)

    def seen() -> bool:
        current = instance.cache.get(kind, f"{NAMESPACE}/{name}")
        return current is None or is_deleting(current)

    wait_for(seen, what=f"the controller saw {kind.value} {name} deleted")


ACTIONS = ("kill", "delete-claim", "delete-pod", "kill+delete-claim", "kill+delete-pod", "fence+delete-pod")


def _cases() -> Iterator[tuple[int, str]]:
    for write in range(1, WRITES + 1):
        for action in ACTIONS:
            if "delete-claim" in action and write >= COMMIT:
                continue  # deleted after the gang was committed: upstream semantics, the pod stays pending
            yield write, action


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("write", "action"), list(_cases()))
def test_fault_at_every_write_of_a_gang(harness: Harness, write: int, action: str) -> None:
    cluster = harness.cluster
    cluster.add_node("node-a", "l4-2x")
    cluster.add_node("node-b", "l4-2x")  # 4 L4s: one 16Gi share each, so a leftover would block the gang
    names = make_gang(cluster, "g")
    victim = names[-1]  # its pod is ungated last: the widest window
    writes: list[WriteRecord] = []
    fired = threading.Event()
    instance: Controller | None = None

    def hook(record: WriteRecord) -> None:
        writes.append(record)
        if len(writes) != write or fired.is_set():
            return
        fired.set()
        # A write can come before start() returns and the test holds its controller.
        wait_for(lambda: instance is not None, what="the test holds its controller")
        assert instance is not None
        if action.startswith("fence"):
            instance.fence.set()  # leadership lost: no write may follow
        if "delete-claim" in action:
            delete_and_wait_seen(harness, instance, Kind.CLAIM, victim)
        if "delete-pod" in action:
            delete_and_wait_seen(harness, instance, Kind.POD, victim)
        if action.startswith("kill"):
            raise HaltWrites()

    instance = harness.start(hook)
    wait_for(fired.is_set, what=f"write {write}")
    if action.startswith(("kill", "fence")):
        wait_for(instance.halted.is_set, what="the worker halted")
        instance.stop()
        harness.start()  # a restarted (or newly elected) controller converges from what is left

    deleted_before_commit = "delete" in action and write < COMMIT
    expected = "released" if deleted_before_commit else "whole"
    wait_for(lambda: gang_state(cluster, names) == expected, what=f"gang {expected}")
    if "delete-claim" in action:
        wait_for(lambda: cluster.claim(victim) is None, what="the deleted claim gone")
    if "delete-pod" in action:
        wait_for(lambda: not ours(cluster, victim), what="the deleted pod's claim released")
    if expected == "whole":
        present = [n for n in names if pod_exists(cluster, n)]
        results = [
            r for n in present for r in (cluster.claim(n) or {})["status"]["allocation"]["devices"]["results"]
        ]
        assert len({(r["pool"], r["device"]) for r in results}) == len(present)  # no device taken twice


@pytest.mark.timeout(60)
@pytest.mark.parametrize("deleted", ["pod", "claim"])
@pytest.mark.parametrize("stop", ["kill", "lease-lost"])
def test_half_allocated_gang_is_released_after_a_restart(harness: Harness, deleted: str, stop: str) -> None:
    cluster = harness.cluster
    cluster.add_node("node-a", "l4-2x")
    cluster.add_node("node-b", "l4-2x")
    names = make_gang(cluster, "g")
    writes: list[WriteRecord] = []
    instance: Controller | None = None

    def hook(record: WriteRecord) -> None:
        writes.append(record)
        if len(writes) == 2:  # 2 of 4 claims allocated
            # A write can come before start() returns and the test holds its controller.
            wait_for(lambda: instance is not None, what="the test holds its controller")
            assert instance is not None
            if stop == "kill":
                raise HaltWrites()
            instance.fence.set()  # the next write finds the lease lost

    instance = harness.start(hook)
    wait_for(instance.halted.is_set, what="the first controller stopped mid-gang")
    instance.stop()
    assert [cluster.allocated(n) for n in names] == [True, True, False, False]
    if deleted == "pod":
        cluster.core.delete_namespaced_pod(names[3], NAMESPACE)
    else:
        cluster.resource.delete_namespaced_resource_claim(names[3], NAMESPACE)
    harness.start(resync_seconds=3600.0)  # the start-up resync is the only one
    wait_for(lambda: not any(ours(cluster, n) for n in names[:3]), what="the half gang released")
    assert not any(cluster.ungated(n) for n in names[:3])


@pytest.mark.timeout(60)
def test_claim_deleted_during_placement_leaves_every_pod_gated(harness: Harness) -> None:
    cluster = harness.cluster
    cluster.add_node("node-a", "l4-2x")
    cluster.add_node("node-b", "l4-2x")
    names = make_gang(cluster, "g")
    ungates: list[str] = []
    deleted = threading.Event()
    instance: Controller | None = None

    def hook(record: WriteRecord) -> None:
        if record.action == "ungate":
            ungates.append(record.key)
        if record.action == "allocate" and record.key.endswith(names[-1]) and not deleted.is_set():
            # A write can come before start() returns and the test holds its controller.
            wait_for(lambda: instance is not None, what="the test holds its controller")
            assert instance is not None  # the last allocation: next come the gates
            deleted.set()
            delete_and_wait_seen(harness, instance, Kind.CLAIM, names[1])

    instance = harness.start(hook)
    wait_for(lambda: cluster.claim(names[1]) is None, what="the deleted claim released and gone")
    wait_for(lambda: not any(ours(cluster, n) for n in names), what="the rest of the gang released")
    assert ungates == [] and not any(cluster.ungated(n) for n in names)
    ungates.clear()
    cluster.create_claim(gpu_claim(names[1], memory="16Gi", compute=None))  # back: the gang completes, whole
    wait_for(lambda: gang_state(cluster, names) == "whole", what="the gang placed whole")


@pytest.mark.timeout(60)
def test_claim_of_a_bound_pod_is_kept_until_the_pod_ends(harness: Harness) -> None:
    """A claim being deleted while its pod runs keeps its allocation: the controller writes nothing
    to it. (Our allocations carry no finalizer: on a cluster the chart's claims-in-use policy refuses
    such a deletion; here another finalizer holds the claim, as anyone's may.)"""
    cluster = harness.cluster
    cluster.add_node("node-a", "l4-2x")
    held = gpu_claim("c", memory="4Gi")
    held["metadata"]["finalizers"] = ["example.com/hold"]
    cluster.create_claim(held)
    cluster.create_pod(gated_pod("p", ["c"]))
    written: list[str] = []
    instance = harness.start(lambda r: written.append(r.action) if r.key.endswith("/c") else None)
    wait_for(lambda: cluster.ungated("p"), what="allocated")
    cluster.core.create_namespaced_pod_binding(
        "p", NAMESPACE, {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p"},
                         "target": {"kind": "Node", "name": "node-a"}}, _preload_content=False,
    )  # fmt: skip
    wait_for(lambda: (instance.cache.get(Kind.POD, f"{NAMESPACE}/p") or {}).get("spec", {}).get("nodeName"),
             what="the binding seen")  # fmt: skip
    delete_and_wait_seen(harness, instance, Kind.CLAIM, "c")
    # A sync point: a gang queued after the deletion was seen is decided after the claim's key.
    cluster.create_claim(gpu_claim("marker", memory="4Gi"))
    cluster.create_pod(gated_pod("marker", ["marker"]))
    wait_for(lambda: cluster.ungated("marker"), what="the marker placed")
    assert written == ["allocate"] and cluster.allocated("c")
    # Without grace: a bound pod stays Terminating until its kubelet says it stopped (the real
    # apiserver waits for it; its claim must be kept meanwhile), and there is no kubelet here.
    cluster.core.delete_namespaced_pod("p", NAMESPACE, grace_period_seconds=0)
    cluster.resource.patch_namespaced_resource_claim("c", NAMESPACE, {"metadata": {"finalizers": None}})
    wait_for(lambda: cluster.claim("c") is None, what="gone once its pod is gone and the hold lifted")
    assert written == ["allocate"]  # deleted with its allocation: the DELETE frees its devices


@pytest.mark.timeout(60)
def test_room_freed_by_the_controller_requeues_a_waiting_gang(harness: Harness) -> None:
    cluster = harness.cluster
    cluster.add_node("node-a", "l4-2x")
    cluster.create_claim(gpu_claim("big-0", memory="20Gi", compute=None))
    cluster.create_pod(gated_pod("big-0", ["big-0"]))
    cluster.create_claim(gpu_claim("big-1", memory="20Gi", compute=None))
    cluster.create_pod(gated_pod("big-1", ["big-1"]))
    harness.start(resync_seconds=3600.0)  # no periodic resync to hide a missed requeue
    wait_for(lambda: cluster.ungated("big-0") and cluster.ungated("big-1"), what="both L4s taken")
    waiting = make_gang(cluster, "w", pods=2, memory="20Gi")
    wait_for(lambda: [e for e in cluster.events() if e["reason"] == "GangUnschedulable"], what="gang refused")
    cluster.core.delete_namespaced_pod("big-0", NAMESPACE)  # never bound: nothing but our release frees room
    cluster.core.delete_namespaced_pod("big-1", NAMESPACE)
    wait_for(
        lambda: all(cluster.ungated(n) for n in waiting), what="the waiting gang placed in the freed room"
    )


def test_a_gang_whose_writes_keep_failing_backs_off_until_one_commit_succeeds(
    cluster: Cluster, harness: Harness
) -> None:
    """While kube-apiserver refuses connections, every commit of a gang fails: each retry waits
    longer than the last (its backoff is reset only once a commit succeeds, not when the decider
    hands the writes over, which made the gang retry, log and undo every 0.15 s), and once the API
    answers the gang is placed and its backoff forgotten."""
    from driver.errors import TransientError

    seen: list[int] = []
    controllers: list[Controller] = []

    def failures() -> int:
        queue = controllers[0].queue
        return max((queue.failures(k) for k in list(queue._failures) if "slow" in k), default=0)

    def hook(record: WriteRecord) -> None:
        if record.action == "allocate" and len(seen) < 4:
            seen.append(failures())
            raise TransientError("connect: [Errno 111] Connection refused")

    cluster.add_node("node-a", "l4-2x")
    controllers.append(harness.start(hook=hook))
    names = make_gang(cluster, "slow", pods=2)
    wait_for(lambda: all(cluster.ungated(n) for n in names), what="the gang placed after four refusals")
    # Each refusal finds the key's backoff at least one step further (another retry with backoff,
    # e.g. a requeue while the undo is in flight, may add a step); never back at 0.
    assert len(seen) == 4 and all(b > a for a, b in itertools.pairwise(seen)), (
        f"the backoff was reset between failed commits: {seen}"
    )
    wait_for(lambda: failures() == 0, what="the backoff forgotten once the gang was committed")

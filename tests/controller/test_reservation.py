"""The reservation written with the allocation: a claim that serves one pod alone carries
``status.reservedFor = [that pod]`` from the write of its allocation, so that kube-scheduler's PreBind
(which skips a claim already reserved for the pod it binds) writes nothing; a shared claim is left
for kube-scheduler to reserve. Every guarantee that read "allocated, reserved for nobody" as ours
holds for "reserved only for the pod we placed": the gang undo, the release of a claim whose pod
went away, kube-scheduler's PostFilter clearing both. The emulator over HTTP, the real client."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from driver.controller import Controller, ReconcilerSettings, WriteRecord
from driver.controller.gangs.plan import Reservation, reservation_of
from driver.controller.model.objects import FINALIZER, PLACED_ANNOTATION, RESERVED_FINALIZER
from driver.controller.view.cache import ClusterCache, Kind
from tests.controller.conftest import (
    NAMESPACE,
    Cluster,
    RunningController,
    gated_pod,
    gpu_claim,
    wait_for,
)
from tests.real_backend import RealAPIServer

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)


def _consumer(cluster: Cluster, pod: str) -> dict[str, str]:
    return {"resource": "pods", "name": pod, "uid": cluster.pod(pod)["metadata"]["uid"]}


def _reserved(cluster: Cluster, claim_name: str) -> list[dict[str, Any]] | None:
    claim = cluster.claim(claim_name)
    assert claim is not None
    reserved: list[dict[str, Any]] | None = (claim.get("status") or {}).get("reservedFor")
    return reserved


def _start(cluster: Cluster, hook: Callable[[WriteRecord], None] | None = None) -> Controller:
    instance = Controller(
        configuration=cluster.server.configuration(), settings=ReconcilerSettings(), write_hook=hook
    )
    instance.start()
    return instance


def _bind(cluster: Cluster, pod: str, node: str = "node-a") -> None:
    """kube-scheduler's bind (its PreBind found the claims reserved for the pod: nothing to write)."""
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod},
               "target": {"kind": "Node", "name": node}}  # fmt: skip
    cluster.core.create_namespaced_pod_binding(pod, NAMESPACE, binding, _preload_content=False)


def test_a_placed_claim_is_reserved_for_its_pod_in_the_write_of_its_allocation(cluster: Cluster) -> None:
    cluster.add_node("node-a", "l4-2x")
    cluster.create_claim(gpu_claim("solo", memory="2Gi"))
    cluster.create_pod(gated_pod("solo", ["solo"]))
    records: list[WriteRecord] = []
    instance = _start(cluster, records.append)
    try:
        wait_for(lambda: cluster.ungated("solo"), what="solo placed")
        claim = cluster.claim("solo")
        assert claim is not None and claim["status"]["allocation"]
        assert claim["status"]["reservedFor"] == [_consumer(cluster, "solo")]
        # Two writes for the pod: the allocation with its reservation, the gate (with our annotation).
        assert [r.action for r in records] == ["allocate", "ungate"]
        assert cluster.pod("solo")["metadata"]["annotations"][PLACED_ANNOTATION] == "node-a"
        assert not cluster.has_finalizer("solo")
    finally:
        instance.stop()


def test_one_status_write_per_claim_and_none_left_for_kube_scheduler(cluster: Cluster) -> None:
    """Counted at the server: one update of ``resourceclaims/status`` per claim placed and one patch
    of the pod, nothing else (no finalizer, no Event); and the reservation kube-scheduler's PreBind
    would have written (one more status update) is already there, so binding the pod changes no
    claim."""
    cluster.add_node("node-a", "l4-2x")
    names = [f"p{i}" for i in range(3)]
    for name in names:
        cluster.create_claim(gpu_claim(name, memory="2Gi"))
        cluster.create_pod(gated_pod(name, [name]))
    cluster.server.reset_counts()
    instance = _start(cluster)
    try:
        wait_for(lambda: all(cluster.ungated(n) for n in names), what="all placed")
        assert cluster.server.request_count("update", "resourceclaims/status") == len(names)
        assert cluster.server.request_count("update", "resourceclaims") == 0  # no finalizer
        assert cluster.server.request_count("patch", "pods") == len(names)  # gates
        writes = ("create", "update", "patch", "delete")
        assert sum(cluster.server.request_count(verb) for verb in writes) == 2 * len(names)
        for name in names:
            assert _reserved(cluster, name) == [_consumer(cluster, name)]
            _bind(cluster, name)
        assert cluster.server.request_count("update", "resourceclaims/status") == len(names)
    finally:
        instance.stop()


def test_a_claim_from_the_pods_template_is_reserved_for_it(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    cluster.add_node("node-a", "l4-2x")
    pod = cluster.create_pod(gated_pod("tpl", [], templates=["gpu-template"]))
    controller()
    # What kube-controller-manager would do: the claim, owned by the pod, then the pod's status.
    claim = gpu_claim("tpl-t0-abcde", memory="2Gi")
    claim["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Pod", "name": "tpl", "uid": pod["metadata"]["uid"],
         "controller": True, "blockOwnerDeletion": True}
    ]  # fmt: skip
    cluster.create_claim(claim)
    body = cluster.pod("tpl")
    body["status"] = {"resourceClaimStatuses": [{"name": "t0", "resourceClaimName": "tpl-t0-abcde"}]}
    cluster.core.replace_namespaced_pod_status("tpl", NAMESPACE, body)
    wait_for(lambda: cluster.ungated("tpl"), what="tpl placed")
    assert _reserved(cluster, "tpl-t0-abcde") == [_consumer(cluster, "tpl")]


def test_a_claim_two_pods_share_is_left_for_kube_scheduler_to_reserve(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    cluster.add_node("node-a", "l4-2x")
    cluster.create_claim(gpu_claim("shared", memory="2Gi"))
    cluster.create_claim(gpu_claim("a-own", memory="2Gi"))
    cluster.create_pod(gated_pod("a", ["shared", "a-own"]))
    cluster.create_pod(gated_pod("b", ["shared"]))
    controller()
    wait_for(lambda: cluster.ungated("a") and cluster.ungated("b"), what="both placed")
    assert cluster.allocated("shared") and _reserved(cluster, "shared") is None
    assert _reserved(cluster, "a-own") == [_consumer(cluster, "a")]


def test_a_gang_undo_clears_the_allocation_and_the_reservation(cluster: Cluster) -> None:
    """The second claim's allocation fails once (409): the first claim, allocated and reserved for its
    pod a moment before, is given back whole (allocation and reservation in one write, then our
    finalizer), every pod still gated; the gang is then placed again, reserved again."""
    cluster.add_node("node-a", "l4-2x")
    names = ["g-0", "g-1"]
    for name in names:
        cluster.create_claim(gpu_claim(name, memory="4Gi", compute=None))
        cluster.create_pod(gated_pod(name, [name], gang="g", size=2))
    cluster.server.inject_fault(verb="update", resource="resourceclaims/status", status=409, name="g-1")
    undone: list[dict[str, Any]] = []
    lock = threading.Lock()

    def hook(record: WriteRecord) -> None:
        if record.action == "deallocate" and record.key == f"{NAMESPACE}/g-0":
            claim = cluster.claim("g-0")  # as the undo left it (written before the hook is called)
            with lock:
                undone.append({"claim": claim, "gated": [not cluster.ungated(n) for n in names]})

    instance = _start(cluster, hook)
    try:
        wait_for(lambda: all(cluster.ungated(n) for n in names), what="the gang placed after the undo")
        with lock:
            (seen,) = undone
        status = seen["claim"]["status"] if seen["claim"] else {}
        assert "allocation" not in status and "reservedFor" not in status
        assert seen["gated"] == [True, True]
        for name in names:
            assert _reserved(cluster, name) == [_consumer(cluster, name)]
    finally:
        instance.stop()


@pytest.mark.parametrize("bound", [False, True], ids=["before-binding", "after-binding"])
def test_a_pod_deleted_after_placement_releases_its_claim(cluster: Cluster, bound: bool) -> None:
    """Its claim is reserved for a pod that no longer exists. kube-controller-manager drops such a
    reservation (and deallocates only claims with its own finalizer, resource.kubernetes.io/
    delete-protection, which ours never carry); we release it ourselves once we saw the pod deleted:
    allocation and reservation in one write guarded by the claim's resourceVersion. Whichever of the
    two writes second gets a 409 and looks again."""
    cluster.add_node("node-a", "l4-2x")
    cluster.create_claim(gpu_claim("left", memory="2Gi"))
    cluster.create_pod(gated_pod("left", ["left"]))
    instance = _start(cluster)
    try:
        wait_for(lambda: cluster.ungated("left"), what="left placed")
        assert _reserved(cluster, "left") == [_consumer(cluster, "left")]
        if bound:
            _bind(cluster, "left")
            wait_for(lambda: (instance.cache.get(Kind.POD, f"{NAMESPACE}/left") or {}).get("spec", {})
                     .get("nodeName"), what="the binding seen")  # fmt: skip
        cluster.core.delete_namespaced_pod("left", NAMESPACE, grace_period_seconds=0)
        wait_for(lambda: not cluster.allocated("left"), what="the claim released")
        claim = cluster.claim("left")
        assert claim is not None
        status = claim.get("status") or {}
        assert "allocation" not in status and "reservedFor" not in status
    finally:
        instance.stop()


def _placed_from_template(cluster: Cluster, name: str, memory: str = "2Gi") -> tuple[str, str]:
    """A gated pod whose claim kube-controller-manager made from its template (owned by the pod);
    returns the claim's name and the pod's UID."""
    pod = cluster.create_pod(gated_pod(name, [], templates=["gpu-template"]))
    claim_name = f"{name}-t0-abcde"
    claim = gpu_claim(claim_name, memory=memory)
    claim["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": pod["metadata"]["uid"],
         "controller": True, "blockOwnerDeletion": True}
    ]  # fmt: skip
    cluster.create_claim(claim)
    body = cluster.pod(name)
    body["status"] = {"resourceClaimStatuses": [{"name": "t0", "resourceClaimName": claim_name}]}
    cluster.core.replace_namespaced_pod_status(name, NAMESPACE, body)
    return claim_name, str(pod["metadata"]["uid"])


def test_a_claim_made_for_a_deleted_pod_is_left_to_go_with_it(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim kube-controller-manager made for a pod is deleted with that pod (its garbage
    collector), and the DELETE frees the devices. We do not clear its allocation meanwhile: that
    write raced kube-controller-manager's own (it drops the gone pod from ``reservedFor``), and
    each of its losses took a token of its workqueue's retry limit (on 1.37.2 at 1,000 nodes, a
    new gang pod's claims were made about 95 s late). Here the collector is this test: no claim
    write of ours after the pod's deletion, and the room is free once the claim is gone."""
    monkeypatch.setattr("driver.controller.loop.reconcile.ORPHAN_GRACE_SECONDS", 300.0)
    cluster.add_node("node-a", "l4-2x")
    claim_name, uid = _placed_from_template(cluster, "tpl", memory="16Gi")
    records: list[WriteRecord] = []
    instance = _start(cluster, records.append)
    try:
        wait_for(lambda: cluster.ungated("tpl"), what="tpl placed")
        assert _reserved(cluster, claim_name) == [_consumer(cluster, "tpl")]
        cluster.server.reset_counts()
        cluster.core.delete_namespaced_pod("tpl", NAMESPACE, grace_period_seconds=0)
        assert instance.reconciler is not None
        orphans = instance.reconciler._orphans
        wait_for(lambda: f"{NAMESPACE}/{claim_name}" in orphans, what="the claim seen without its pod")
        assert cluster.allocated(claim_name)
        assert cluster.server.request_count("update", "resourceclaims/status") == 0
        cluster.resource.delete_namespaced_resource_claim(claim_name, NAMESPACE)  # the collector
        wait_for(lambda: f"{NAMESPACE}/{claim_name}" not in orphans, what="the claim's deletion seen")
        # The room is free: 16Gi on each of the node's two GPUs (of 22Gi) for a new pod.
        cluster.create_claim(gpu_claim("next", memory="16Gi", count=2))
        cluster.create_pod(gated_pod("next", ["next"]))
        wait_for(lambda: cluster.ungated("next"), what="next placed in the freed room")
        assert cluster.server.request_count("update", "resourceclaims/status") == 1  # next's only
        assert not any(r.key == f"{NAMESPACE}/{claim_name}" and r.action == "deallocate" for r in records)
        assert instance.cache.seen_deleted(uid)
    finally:
        instance.stop()


@pytest.mark.real_only
def test_kube_controller_managers_collector_deletes_the_claim_and_we_write_nothing(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same case with the real collector: kube-controller-manager deletes the claim made for
    the pod once the pod is gone, our controller writes nothing to it in between, and the room is
    free for the next pod."""
    monkeypatch.setattr("driver.controller.loop.reconcile.ORPHAN_GRACE_SECONDS", 300.0)
    cluster.add_node("node-a", "l4-2x")
    claim_name, _uid = _placed_from_template(cluster, "tpl", memory="16Gi")
    records: list[WriteRecord] = []
    instance = _start(cluster, records.append)
    try:
        wait_for(lambda: cluster.ungated("tpl"), what="tpl placed")
        placed = len(records)
        cluster.core.delete_namespaced_pod("tpl", NAMESPACE, grace_period_seconds=0)
        wait_for(lambda: cluster.claim(claim_name) is None, what="the claim collected")
        assert [r for r in records[placed:] if r.key == f"{NAMESPACE}/{claim_name}"] == []
        cluster.create_claim(gpu_claim("next", memory="16Gi", count=2))
        cluster.create_pod(gated_pod("next", ["next"]))
        wait_for(lambda: cluster.ungated("next"), what="next placed in the freed room")
    finally:
        instance.stop()


def test_a_claim_that_outlives_its_pod_is_released_after_the_grace(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The garbage collector behind (or off): past ``ORPHAN_GRACE_SECONDS`` we release the claim
    ourselves, allocation and reservation in one write, as for any claim whose pod went away. The
    emulator runs no collector under these tests; the real control plane's kube-controller-manager
    deletes the claim within the half second (seen in CI), so there the case cannot be set up."""
    if isinstance(cluster.server, RealAPIServer):
        pytest.skip("kube-controller-manager's garbage collector deletes the claim with its pod")
    monkeypatch.setattr("driver.controller.loop.reconcile.ORPHAN_GRACE_SECONDS", 0.5)
    cluster.add_node("node-a", "l4-2x")
    claim_name, _uid = _placed_from_template(cluster, "late")
    instance = _start(cluster)
    try:
        wait_for(lambda: cluster.ungated("late"), what="late placed")
        cluster.core.delete_namespaced_pod("late", NAMESPACE, grace_period_seconds=0)
        wait_for(lambda: not cluster.allocated(claim_name), what="the claim released")
        assert _reserved(cluster, claim_name) is None
        assert instance.reconciler is not None and not instance.reconciler._orphans
    finally:
        instance.stop()


def test_a_claim_reserved_for_a_pod_gone_while_we_were_down_is_released(cluster: Cluster) -> None:
    """A new process never saw the pod: it asks the API (as kube-controller-manager does before it
    drops a reservation), and the pod is not there: released."""
    cluster.add_node("node-a", "l4-2x")
    cluster.create_claim(gpu_claim("orphan", memory="2Gi"))
    cluster.create_pod(gated_pod("orphan", ["orphan"]))
    first = _start(cluster)
    try:
        wait_for(lambda: cluster.ungated("orphan"), what="orphan placed")
    finally:
        first.stop()
    assert _reserved(cluster, "orphan") == [_consumer(cluster, "orphan")]
    cluster.core.delete_namespaced_pod("orphan", NAMESPACE, grace_period_seconds=0)
    second = _start(cluster)
    try:
        wait_for(lambda: not cluster.allocated("orphan"), what="the claim released")
        assert not cluster.allocated("orphan") and _reserved(cluster, "orphan") is None
    finally:
        second.stop()


def _legacy_share(cluster: Cluster, name: str, *, by: str) -> None:
    """A 2Gi share on node-a/gpu-0 as an allocator other than this controller writes it: our
    finalizer first when ``by`` is "earlier-version" (the finalizer, then the allocation, under
    another field manager); kube-scheduler's own finalizer when "kube-scheduler"."""
    claim = gpu_claim(name, memory="2Gi")
    claim["metadata"]["finalizers"] = [FINALIZER if by == "earlier-version" else RESERVED_FINALIZER]
    stored = cluster.create_claim(claim)
    stored["status"] = {"allocation": {
        "devices": {"results": [{
            "request": "gpu", "driver": "fractional.dev", "pool": "node-a", "device": "gpu-0",
            "shareID": str(uuid.uuid4()), "consumedCapacity": {"memory": "2Gi", "compute": "0"},
        }]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}]},
    }}  # fmt: skip
    cluster.resource.replace_namespaced_resource_claim_status(name, NAMESPACE, stored, field_manager=by)


def test_a_claim_an_earlier_version_allocated_is_released_and_loses_our_finalizer(cluster: Cluster) -> None:
    """Upgrades: earlier versions wrote our finalizer before each allocation and no field manager.
    Such a claim is still ours: reserved for nobody and used by no pod, it is released and the
    finalizer removed. kube-scheduler's claim beside it (its finalizer, not our manager) is not."""
    cluster.add_node("node-a", "l4-2x")
    _legacy_share(cluster, "legacy", by="earlier-version")
    _legacy_share(cluster, "theirs", by="kube-scheduler")
    instance = _start(cluster)
    try:
        wait_for(lambda: not cluster.allocated("legacy") and not cluster.has_finalizer("legacy"),
                 what="the earlier version's claim released")  # fmt: skip
        theirs = cluster.claim("theirs")
        assert theirs is not None and theirs["status"]["allocation"]
        assert theirs["metadata"]["finalizers"] == [RESERVED_FINALIZER]
    finally:
        instance.stop()


def test_a_bound_pods_claim_is_kept_while_the_pod_runs(cluster: Cluster) -> None:
    """Deleting the claim of a bound pod leaves it allocated and reserved until the pod is gone. (No
    finalizer of ours holds it: on a cluster the chart's claims-in-use policy refuses the delete;
    here another finalizer holds it, as anyone's may, and we must not clear it meanwhile.)"""
    cluster.add_node("node-a", "l4-2x")
    held = gpu_claim("kept", memory="2Gi")
    held["metadata"]["finalizers"] = ["example.com/hold"]
    cluster.create_claim(held)
    cluster.create_pod(gated_pod("kept", ["kept"]))
    instance = _start(cluster)
    try:
        wait_for(lambda: cluster.ungated("kept"), what="kept placed")
        _bind(cluster, "kept")
        wait_for(lambda: (instance.cache.get(Kind.POD, f"{NAMESPACE}/kept") or {}).get("spec", {})
                 .get("nodeName"), what="the binding seen")  # fmt: skip
        cluster.resource.delete_namespaced_resource_claim("kept", NAMESPACE)
        wait_for(lambda: (instance.cache.get(Kind.CLAIM, f"{NAMESPACE}/kept") or {}).get("metadata", {})
                 .get("deletionTimestamp"), what="the deletion seen")  # fmt: skip
        # A sync point: a pod placed after the deletion was seen is decided after the claim's key.
        cluster.create_claim(gpu_claim("marker", memory="2Gi"))
        cluster.create_pod(gated_pod("marker", ["marker"]))
        wait_for(lambda: cluster.ungated("marker"), what="the marker placed")
        assert cluster.allocated("kept") and _reserved(cluster, "kept") == [_consumer(cluster, "kept")]
        cluster.core.delete_namespaced_pod("kept", NAMESPACE, grace_period_seconds=0)
        unhold = {"metadata": {"finalizers": None}}
        cluster.resource.patch_namespaced_resource_claim("kept", NAMESPACE, unhold)
        wait_for(lambda: cluster.claim("kept") is None, what="gone once its pod is gone and the hold lifted")
    finally:
        instance.stop()


# -- reservation_of, on a cache (pure reads) -------------------------------------------------------


def _pod(name: str, uid: str, *, gated: bool = False, node: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main"}]}
    if gated:
        spec["schedulingGates"] = [{"name": "fractional.dev/allocation"}]
    if node:
        spec["nodeName"] = node
    meta = {"name": name, "namespace": NAMESPACE, "uid": uid, "resourceVersion": "1"}
    return {"metadata": meta, "spec": spec}


def _claim(*entries: dict[str, Any]) -> dict[str, Any]:
    status: dict[str, Any] = {"allocation": {"devices": {"results": []}}}
    if entries:
        status["reservedFor"] = list(entries)
    return {"metadata": {"name": "c", "namespace": NAMESPACE, "uid": "c-uid", "resourceVersion": "1"},
            "status": status}  # fmt: skip


def _entry(name: str, uid: str, **extra: str) -> dict[str, Any]:
    return {"resource": "pods", "name": name, "uid": uid, **extra}


def test_reservation_of_reads_who_may_use_the_claim() -> None:
    cache = ClusterCache(topology_label="zone")
    cache.apply(Kind.POD, "ADDED", _pod("gated", "u-gated", gated=True))
    cache.apply(Kind.POD, "ADDED", _pod("waiting", "u-waiting"))
    cache.apply(Kind.POD, "ADDED", _pod("bound", "u-bound", node="node-a"))
    cache.apply(Kind.POD, "ADDED", _pod("deleted", "u-deleted"))
    cache.apply(Kind.POD, "DELETED", _pod("deleted", "u-deleted"))
    cases = {
        "nobody": (_claim(), Reservation.NONE),
        "a gated pod": (_claim(_entry("gated", "u-gated")), Reservation.UNBOUND),
        "an ungated pod not bound yet": (_claim(_entry("waiting", "u-waiting")), Reservation.UNBOUND),
        "a bound pod": (_claim(_entry("bound", "u-bound")), Reservation.IN_USE),
        "a pod seen deleted": (_claim(_entry("deleted", "u-deleted")), Reservation.GONE),
        "an older pod of the same name": (_claim(_entry("gated", "u-older")), Reservation.UNKNOWN),
        "a pod never seen": (_claim(_entry("stranger", "u-stranger")), Reservation.UNKNOWN),
        "two pods": (_claim(_entry("gated", "u-gated"), _entry("waiting", "u-waiting")), Reservation.IN_USE),
        "a PodGroup": (
            _claim({"apiGroup": "scheduling.k8s.io", "resource": "podgroups", "name": "g", "uid": "u-g"}),
            Reservation.IN_USE,
        ),
    }
    found = {case: reservation_of(cache, claim)[0] for case, (claim, _) in cases.items()}
    assert found == {case: expected for case, (_, expected) in cases.items()}

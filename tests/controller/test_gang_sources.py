"""Gangs as people write them, end to end: the emulator at each release's gang API, the
real client, the controller in-process. Each source ((a)-(d) of ``gang_identity``) and each served
version: a gang that fits is allocated whole and ungated together; one that does not keeps every pod
gated with no allocation and gets an Event on its PodGroup (or Workload). minCount, topology,
PodGroup claims, and the kubernetes #138765 shape."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from driver.allocator import allocate
from driver.cluster.apiserver import APIServer
from driver.controller.model.objects import allocated_by_us, allocation_node
from driver.inventory.fake import load_profile
from driver.slices import build_device_classes, build_resource_slices
from tests.controller.conftest import NAMESPACE, Cluster, RunningController, gated_pod, gpu_claim, wait_for

SCHEDULING = "scheduling.k8s.io"
VERSION_OF = {"1.35": "v1alpha1", "1.36": "v1alpha2", "1.37": "v1beta1"}


@pytest.fixture
def kubernetes_version() -> str:
    return "1.37"


@pytest.fixture
def api_server(kubernetes_version: str) -> Iterator[APIServer]:
    server = APIServer(host="127.0.0.1", port=0, kubernetes_version=kubernetes_version)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _gpu_profile(tmp_path: Path, name: str, memories_mib: list[int]) -> str:
    gpus = [
        {
            "productName": f"GPU-{m // 1024}G",
            "brand": "NVIDIA",
            "architecture": "Ampere",
            "cudaComputeCapability": "8.0",
            "memoryTotalMiB": m,
            "memoryReservedMiB": 0,
            "multiprocessors": 108,
            "uuid": f"GPU-00000000-0000-0000-0000-{i:012d}",
            "pciBusId": f"0000:{16 + i:02x}:00.0",
            "pcieRoot": f"pci0000:{32 + i:02x}",
            "numaNode": 0,
            "minorNumber": i,
        }
        for i, m in enumerate(memories_mib)
    ]
    document = {
        "description": name,
        "driverVersion": "550.54.15",
        "cudaDriverVersion": "12.4",
        "numaNodes": [{"id": 0, "cpus": "0-31"}],
        "gpus": gpus,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(document), encoding="utf-8")  # JSON is YAML
    return str(path)


def _create_pod(cluster: Cluster, pod: dict[str, Any]) -> None:
    """POSTed as written: the client's 1.37 models refuse 1.35's ``spec.workloadRef``."""
    status, body = cluster.post_raw(f"/api/v1/namespaces/{NAMESPACE}/pods", json.dumps(pod))
    assert status == 201, body[:400]


def _custom(cluster: Cluster) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(cluster.api_client)


def _create(cluster: Cluster, group: str, version: str, plural: str, body: dict[str, Any]) -> None:
    _custom(cluster).create_namespaced_custom_object(group, version, NAMESPACE, plural, body)


def _podgroup(name: str, min_count: int, version: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{SCHEDULING}/{version}",
        "kind": "PodGroup",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"schedulingPolicy": {"gang": {"minCount": min_count}}, **spec},
    }


def _crd(group: str, version: str) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": {
            "spec": {"type": "object", "properties": {"minMember": {"type": "integer"}}},
            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"podgroups.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "podgroups", "singular": "podgroup", "kind": "PodGroup"},
            "versions": [
                {
                    "name": version,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {"status": {}},
                }
            ],
        },
    }


CRD_VERSIONS = {
    "coscheduling": ("scheduling.x-k8s.io", "v1alpha1"),
    "volcano": ("scheduling.volcano.sh", "v1beta1"),
}


def _prepare_source(cluster: Cluster, source: str, kubernetes_version: str) -> None:
    """What must exist before the controller starts (its discovery sees it)."""
    if source in CRD_VERSIONS:
        client.ApiextensionsV1Api(cluster.api_client).create_custom_resource_definition(
            _crd(*CRD_VERSIONS[source])
        )


def _make_gang(
    cluster: Cluster, source: str, kubernetes_version: str, gang: str, size: int, memory: str
) -> tuple[list[str], tuple[str, str] | None]:
    """``size`` gated pods of one gang as ``source`` writes it; returns the pod names and the
    (kind, name) of the object its Event must also go to."""
    version = VERSION_OF[kubernetes_version]
    target: tuple[str, str] | None = None
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    spec: dict[str, Any] = {}
    if source == "podgroup":
        _create(cluster, SCHEDULING, version, "podgroups", _podgroup(gang, size, version))
        spec = {"schedulingGroup": {"podGroupName": gang}}
        target = ("PodGroup", gang)
    elif source == "workload":
        workload = {
            "apiVersion": f"{SCHEDULING}/{version}",
            "kind": "Workload",
            "metadata": {"name": gang, "namespace": NAMESPACE},
            "spec": {"podGroups": [{"name": "workers", "policy": {"gang": {"minCount": size}}}]},
        }
        _create(cluster, SCHEDULING, version, "workloads", workload)
        spec = {"workloadRef": {"name": gang, "podGroup": "workers", "podGroupReplicaKey": "0"}}
        target = ("Workload", gang)
    elif source == "fractional":
        labels, annotations = {"fractional.dev/gang": gang}, {"fractional.dev/gang-size": str(size)}
    elif source == "kueue":
        labels = {"kueue.x-k8s.io/pod-group-name": gang}
        annotations = {"kueue.x-k8s.io/pod-group-total-count": str(size)}
    elif source == "lws":
        labels = {"leaderworkerset.sigs.k8s.io/group-key": gang}
        annotations = {"leaderworkerset.sigs.k8s.io/size": str(size)}
    else:
        group, crd_version = CRD_VERSIONS[source]
        _create(
            cluster,
            group,
            crd_version,
            "podgroups",
            {
                "apiVersion": f"{group}/{crd_version}",
                "kind": "PodGroup",
                "metadata": {"name": gang, "namespace": NAMESPACE},
                "spec": {"minMember": size},
            },
        )
        if source == "coscheduling":
            labels = {"scheduling.x-k8s.io/pod-group": gang}
        else:
            annotations = {"scheduling.k8s.io/group-name": gang}
        target = ("PodGroup", gang)
    names = []
    for i in range(size):
        name = f"{gang}-{i}"
        cluster.create_claim(gpu_claim(name, memory=memory, compute=None))
        pod = gated_pod(name, [name])
        pod["metadata"]["labels"].update(labels)
        pod["metadata"]["annotations"] = annotations
        pod["spec"].update(spec)
        _create_pod(cluster, pod)
        names.append(name)
    return names, target


SOURCE_CASES = [
    ("1.37", "podgroup"),
    ("1.36", "podgroup"),
    ("1.35", "workload"),
    ("1.37", "fractional"),
    ("1.37", "coscheduling"),
    ("1.37", "kueue"),
    ("1.37", "lws"),
    ("1.37", "volcano"),
]


@pytest.mark.parametrize(("kubernetes_version", "source"), SOURCE_CASES)
def test_a_gang_that_fits_is_placed_whole_and_one_that_does_not_waits_with_an_event(
    cluster: Cluster, controller: Callable[..., RunningController], kubernetes_version: str, source: str
) -> None:
    cluster.add_node("node-a", "l4-2x")  # two 22 GiB GPUs
    _prepare_source(cluster, source, kubernetes_version)
    sources = "all" if source in ("kueue", "lws") else "auto"  # their groups are not served here
    controller(gang_sources=sources)
    fits, _ = _make_gang(cluster, source, kubernetes_version, "small", 2, "8Gi")
    wait_for(lambda: all(cluster.ungated(n) for n in fits), what="the fitting gang ungated")
    assert all(cluster.allocated(n) for n in fits)

    unfit, target = _make_gang(cluster, source, kubernetes_version, "big", 3, "16Gi")  # 3 x 16 GiB on 2 GPUs

    def event_for(kind: str, name: str) -> bool:
        return any(
            e["involvedObject"]["kind"] == kind
            and e["involvedObject"]["name"] == name
            and e["reason"] == "GangUnschedulable"
            for e in cluster.events()
        )

    wait_for(lambda: event_for("Pod", unfit[0]), what="GangUnschedulable on the first pod")
    if target is not None:
        wait_for(lambda: event_for(*target), what=f"GangUnschedulable on the {target[0]}")
    assert not any(cluster.ungated(n) or cluster.allocated(n) for n in unfit)


def _handed_over(cluster: Cluster, name: str) -> bool:
    events = cluster.events()
    return any(e["reason"] == "HandedToKubeScheduler" and e["involvedObject"]["name"] == name for e in events)


def test_min_count_three_of_four_then_the_fourth_goes_to_kube_scheduler(
    cluster: Cluster, controller: Callable[..., RunningController], tmp_path: Path
) -> None:
    """Recorded from kube-scheduler 1.37.2 (GenericWorkload on): it binds no pod of a PodGroup while
    any pod of it still carries a scheduling gate, even with minCount pods ungated. So the fourth,
    which does not fit, is not held gated (that would strand the three): it is ungated without an
    allocation, with an Event, and kube-scheduler allocates it when room appears."""
    profile = _gpu_profile(tmp_path, "three-40g", [40960, 40960, 40960])
    cluster.add_node("node-a", profile)
    _create(cluster, SCHEDULING, "v1beta1", "podgroups", _podgroup("train", 3, "v1beta1"))
    names = []
    for i in range(4):  # 30 GiB each: three fit node-a
        cluster.create_claim(gpu_claim(f"train-{i}", memory="30Gi", compute=None))
        pod = gated_pod(f"train-{i}", [f"train-{i}"])
        pod["spec"]["schedulingGroup"] = {"podGroupName": "train"}
        _create_pod(cluster, pod)
        names.append(f"train-{i}")
    controller()
    wait_for(lambda: all(cluster.ungated(n) for n in names[:3]), what="minCount pods ungated")
    assert all(cluster.allocated(n) for n in names[:3])
    wait_for(lambda: cluster.ungated(names[3]), what="the fourth handed to kube-scheduler")
    assert not cluster.allocated(names[3]) and not cluster.has_finalizer(names[3])
    wait_for(lambda: _handed_over(cluster, names[3]), what="the HandedToKubeScheduler Event")


def test_min_count_extras_that_fit_get_our_placement(
    cluster: Cluster, controller: Callable[..., RunningController], tmp_path: Path
) -> None:
    profile = _gpu_profile(tmp_path, "four-40g", [40960, 40960, 40960, 40960])
    cluster.add_node("node-a", profile)
    _create(cluster, SCHEDULING, "v1beta1", "podgroups", _podgroup("train", 3, "v1beta1"))
    for i in range(4):
        cluster.create_claim(gpu_claim(f"train-{i}", memory="30Gi", compute=None))
        pod = gated_pod(f"train-{i}", [f"train-{i}"])
        pod["spec"]["schedulingGroup"] = {"podGroupName": "train"}
        _create_pod(cluster, pod)
    controller()
    wait_for(lambda: all(cluster.ungated(f"train-{i}") for i in range(4)), what="all four placed")
    assert all(cluster.allocated(f"train-{i}") for i in range(4))
    assert not _handed_over(cluster, "train-3")


def test_min_count_can_shrink_on_1_37(cluster: Cluster, controller: Callable[..., RunningController]) -> None:
    cluster.add_node("node-a", "l4-2x")
    _create(cluster, SCHEDULING, "v1beta1", "podgroups", _podgroup("scale", 3, "v1beta1"))
    for i in range(2):
        cluster.create_claim(gpu_claim(f"scale-{i}", memory="8Gi", compute=None))
        pod = gated_pod(f"scale-{i}", [f"scale-{i}"])
        pod["spec"]["schedulingGroup"] = {"podGroupName": "scale"}
        _create_pod(cluster, pod)
    controller()
    probe = gated_pod("probe", [])
    _create_pod(cluster, probe)
    wait_for(lambda: cluster.ungated("probe"), what="the controller has looked")
    assert not cluster.ungated("scale-0")  # 2 of 3
    group = _custom(cluster).get_namespaced_custom_object(
        SCHEDULING, "v1beta1", NAMESPACE, "podgroups", "scale"
    )
    group["spec"]["schedulingPolicy"]["gang"]["minCount"] = 2
    _custom(cluster).replace_namespaced_custom_object(
        SCHEDULING, "v1beta1", NAMESPACE, "podgroups", "scale", group
    )
    wait_for(
        lambda: cluster.ungated("scale-0") and cluster.ungated("scale-1"), what="placed after the shrink"
    )


def _label_node(cluster: Cluster, name: str, labels: dict[str, str]) -> None:
    cluster.core.patch_node(name, {"metadata": {"labels": labels}})


def test_a_topology_key_keeps_the_gang_in_one_rack_and_the_event_names_the_closest(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    rack = "example.com/rack"
    for node, value in (("r1-a", "r1"), ("r2-a", "r2"), ("r2-b", "r2")):
        cluster.add_node(node, "l4-2x")
        _label_node(cluster, node, {rack: value})
    topology = {"schedulingConstraints": {"topology": [{"key": rack}]}}
    _create(cluster, SCHEDULING, "v1beta1", "podgroups", _podgroup("ring", 3, "v1beta1", **topology))
    _create(cluster, SCHEDULING, "v1beta1", "podgroups", _podgroup("wide", 5, "v1beta1", **topology))
    for gang, size in (("ring", 3), ("wide", 5)):
        for i in range(size):  # 16 GiB of a 22 GiB L4: one pod per GPU
            cluster.create_claim(gpu_claim(f"{gang}-{i}", memory="16Gi", compute=None))
            pod = gated_pod(f"{gang}-{i}", [f"{gang}-{i}"])
            pod["spec"]["schedulingGroup"] = {"podGroupName": gang}
            _create_pod(cluster, pod)
    controller()
    wait_for(lambda: all(cluster.ungated(f"ring-{i}") for i in range(3)), what="ring placed")
    nodes = {allocation_node(cluster.claim(f"ring-{i}")["status"]["allocation"]) for i in range(3)}  # type: ignore[index]
    assert nodes <= {"r2-a", "r2-b"}, nodes  # only rack r2 holds three GPUs

    def closest() -> bool:
        return any(
            e["involvedObject"]["kind"] == "PodGroup"
            and e["involvedObject"]["name"] == "wide"
            and f"closest is {rack}=" in e["message"]
            for e in cluster.events()
        )

    wait_for(closest, what="the wide gang's Event naming the closest rack")
    assert not any(cluster.allocated(f"wide-{i}") for i in range(5))


def test_a_podgroup_claim_is_allocated_once_and_its_pods_go_to_its_node(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    cluster.add_node("node-a", "l4-2x")
    cluster.add_node("node-b", "l4-2x")
    shared = [{"name": "shared", "resourceClaimTemplateName": "one-share"}]
    _create(
        cluster, SCHEDULING, "v1beta1", "podgroups", _podgroup("team", 3, "v1beta1", resourceClaims=shared)
    )
    # The ResourceClaim controller's part: one claim for the PodGroup, named in its status.
    cluster.create_claim(gpu_claim("team-shared", memory="1Gi", compute=None))
    group = _custom(cluster).get_namespaced_custom_object(
        SCHEDULING, "v1beta1", NAMESPACE, "podgroups", "team"
    )
    group["status"] = {"resourceClaimStatuses": [{"name": "shared", "resourceClaimName": "team-shared"}]}
    _custom(cluster).replace_namespaced_custom_object_status(
        SCHEDULING, "v1beta1", NAMESPACE, "podgroups", "team", group
    )
    for i in range(3):
        cluster.create_claim(gpu_claim(f"team-{i}", memory="4Gi", compute=None))
        pod = gated_pod(f"team-{i}", [f"team-{i}"])
        pod["spec"]["schedulingGroup"] = {"podGroupName": "team"}
        pod["spec"]["resourceClaims"].append({"name": "shared", "resourceClaimTemplateName": "one-share"})
        pod["spec"]["containers"][0]["resources"]["claims"].append({"name": "shared"})
        _create_pod(cluster, pod)
    controller()
    wait_for(lambda: all(cluster.ungated(f"team-{i}") for i in range(3)), what="team placed")
    claim = cluster.claim("team-shared")
    assert claim is not None
    node = allocation_node(claim["status"]["allocation"])
    assert len(claim["status"]["allocation"]["devices"]["results"]) == 1  # allocated once
    assert {allocation_node(cluster.claim(f"team-{i}")["status"]["allocation"]) for i in range(3)} == {node}  # type: ignore[index]
    # The PodGroup's claim is reserved by kube-scheduler, for the PodGroup (KEP-5729); each pod's own
    # claim is reserved for its pod in the write of its allocation.
    assert "reservedFor" not in claim["status"]
    for i in range(3):
        own = cluster.claim(f"team-{i}")
        assert own is not None
        assert own["status"]["reservedFor"] == [
            {"resource": "pods", "name": f"team-{i}", "uid": cluster.pod(f"team-{i}")["metadata"]["uid"]}
        ]


def test_kubernetes_138765_a_share_and_a_whole_gpu_both_placed(
    cluster: Cluster, controller: Callable[..., RunningController], tmp_path: Path
) -> None:
    """One node, a free 80 GiB GPU and a free 40 GiB GPU; A asks a 40 GiB share, B the whole 80 GiB
    GPU. A greedy first pick (kube-scheduler's, pod by pod) gives A the 80 GiB GPU and strands B."""
    profile = _gpu_profile(tmp_path, "mixed", [81920, 40960])
    inventory = load_profile(profile, node_name="node-a")
    a, b = gpu_claim("a", memory="40Gi", compute=None), gpu_claim("b", memory="80Gi", compute=None)
    for claim in (a, b):
        claim["metadata"]["uid"] = claim["metadata"]["name"]
    slices, classes = build_resource_slices(inventory), build_device_classes()
    greedy = allocate([a], slices=slices, classes=classes, allocated=[], node="node-a", policy="first-fit")
    assert greedy is not None and greedy[0]["devices"]["results"][0]["device"] == "gpu-0"  # the 80 GiB one
    greedy_b = allocate(
        [b],
        slices=slices,
        classes=classes,
        allocated=[{**a, "status": {"allocation": greedy[0]}}],
        node="node-a",
        policy="first-fit",
    )
    assert greedy_b is None  # stranded

    cluster.add_node("node-a", profile)
    for name in ("a", "b"):
        cluster.create_claim(gpu_claim(name, memory="40Gi" if name == "a" else "80Gi", compute=None))
        cluster.create_pod(gated_pod(name, [name], gang="pair", size=2))
    controller()
    wait_for(lambda: cluster.ungated("a") and cluster.ungated("b"), what="both placed")
    devices = {n: cluster.claim(n)["status"]["allocation"]["devices"]["results"][0]["device"] for n in "ab"}  # type: ignore[index]
    assert devices == {"a": "gpu-1", "b": "gpu-0"}


def test_a_gang_whose_allocations_kube_scheduler_cleared_is_placed_again_whole(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    """GenericWorkload on: we ungate the gang together; kube-scheduler's gang PostFilter then clears
    the claims of a PodGroup that failed (before binding). The gang is planned again, as a whole."""
    cluster.add_node("node-a", "l4-2x")
    _create(cluster, SCHEDULING, "v1beta1", "podgroups", _podgroup("redo", 2, "v1beta1"))
    names = []
    for i in range(2):
        cluster.create_claim(gpu_claim(f"redo-{i}", memory="8Gi", compute=None))
        pod = gated_pod(f"redo-{i}", [f"redo-{i}"])
        pod["spec"]["schedulingGroup"] = {"podGroupName": "redo"}
        _create_pod(cluster, pod)
        names.append(f"redo-{i}")
    controller()
    wait_for(lambda: all(cluster.ungated(n) and cluster.allocated(n) for n in names), what="gang placed")
    uids = {n: cluster.pod(n)["metadata"]["uid"] for n in names}
    for name in names:  # the PostFilter: deallocate, as kube-scheduler does for a failed PodGroup
        claim = cluster.claim(name)
        assert claim is not None
        # Reserved for its pod alone: kube-scheduler's PostFilter deallocates such a claim too
        # (deallocateOrDeletePodClaims: reservedFor empty, or one entry with the pod's UID).
        assert [r["uid"] for r in claim["status"]["reservedFor"]] == [uids[name]]
        claim["status"] = {}  # allocation, reservedFor and devices cleared together
        cluster.resource.replace_namespaced_resource_claim_status(name, NAMESPACE, claim)
    wait_for(lambda: all(cluster.allocated(n) for n in names), what="the gang allocated again")
    assert all(allocated_by_us(cluster.claim(n) or {}) for n in names)
    # Placed again ungated, in kube-scheduler's hands already: it reserves them as it binds.
    assert all("reservedFor" not in (cluster.claim(n) or {})["status"] for n in names)


def test_a_basic_policy_places_pod_by_pod(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    """``basic: {}``: no gang. Of two pods where only the second fits, it is placed (a gang, even of
    minCount 1, would try the first and place neither)."""
    cluster.add_node("node-a", "l4-2x")
    group = {
        "apiVersion": f"{SCHEDULING}/v1beta1",
        "kind": "PodGroup",
        "metadata": {"name": "loose", "namespace": NAMESPACE},
        "spec": {"schedulingPolicy": {"basic": {}}},
    }
    _create(cluster, SCHEDULING, "v1beta1", "podgroups", group)
    for name, memory in (("loose-0", "30Gi"), ("loose-1", "16Gi")):  # 30 GiB fits no 22 GiB L4
        cluster.create_claim(gpu_claim(name, memory=memory, compute=None))
        pod = gated_pod(name, [name])
        pod["spec"]["schedulingGroup"] = {"podGroupName": "loose"}
        _create_pod(cluster, pod)
    controller()
    wait_for(lambda: cluster.ungated("loose-1") and cluster.allocated("loose-1"), what="the pod that fits")
    assert not cluster.ungated("loose-0") and not cluster.allocated("loose-0")


def test_discovery_follows_what_the_server_serves(cluster: Cluster) -> None:
    """A CRD installed later: the next refresh watches it, turns its source on (auto), and says so
    in the metric."""
    from driver.controller.gangs.watch import GangWatches
    from driver.controller.metrics import ControllerMetrics
    from driver.controller.model.gang_identity import GangSource
    from driver.controller.view.cache import ClusterCache

    cache = ClusterCache(topology_label="topology.kubernetes.io/zone")
    metrics, stop, queued = ControllerMetrics(), threading.Event(), []
    watches = GangWatches(
        configuration=cluster.server.configuration(), cache=cache, metrics=metrics,
        enqueue_gang=queued.append, sources=None, stop=stop, watch_timeout_seconds=5,
    )  # fmt: skip
    try:
        assert watches.refresh()
        assert watches.api is not None and watches.api.version == "v1beta1"
        assert GangSource.COSCHEDULING not in cache.gang_sources
        assert (
            metrics.registry.get_sample_value("fractional_controller_gang_api_info", {"version": "v1beta1"})
            == 1
        )
        client.ApiextensionsV1Api(cluster.api_client).create_custom_resource_definition(
            _crd(*CRD_VERSIONS["coscheduling"])
        )
        assert watches.refresh()
        assert GangSource.COSCHEDULING in cache.gang_sources
        assert {w.resource for w in watches.watchers()} >= {("scheduling.x-k8s.io", "v1alpha1", "podgroups")}
        _create(cluster, "scheduling.x-k8s.io", "v1alpha1", "podgroups", {
            "apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup",
            "metadata": {"name": "late", "namespace": NAMESPACE}, "spec": {"minMember": 2}})  # fmt: skip
        wait_for(lambda: f"{NAMESPACE}/coscheduling:late" in queued, what="the new PodGroup's gang queued")
    finally:
        stop.set()
        watches.stop()


def test_pods_beyond_min_count_stay_in_the_gangs_topology_domain(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    rack = "example.com/rack"
    for node, value in (("r1-a", "r1"), ("r2-a", "r2"), ("r2-b", "r2")):
        cluster.add_node(node, "l4-2x")
        _label_node(cluster, node, {rack: value})
    topology = {"schedulingConstraints": {"topology": [{"key": rack}]}}
    _create(cluster, SCHEDULING, "v1beta1", "podgroups", _podgroup("pair", 2, "v1beta1", **topology))
    for i in range(3):  # 16 GiB of a 22 GiB L4: one pod per GPU
        cluster.create_claim(gpu_claim(f"pair-{i}", memory="16Gi", compute=None))
        pod = gated_pod(f"pair-{i}", [f"pair-{i}"])
        pod["spec"]["schedulingGroup"] = {"podGroupName": "pair"}
        _create_pod(cluster, pod)
    controller()
    wait_for(lambda: cluster.ungated("pair-0") and cluster.ungated("pair-1"), what="minCount placed")
    first = {allocation_node(cluster.claim(f"pair-{i}")["status"]["allocation"]) for i in range(2)}  # type: ignore[index]
    assert first == {"r1-a"}  # the fullest rack that fits: r1
    # r2 has room, but the gang holds r1, which has none: never placed by taking r2. And not held
    # gated either (kube-scheduler binds none of the group meanwhile): handed to kube-scheduler,
    # whose own topology scheduling of the PodGroup then places it.
    wait_for(lambda: cluster.ungated("pair-2"), what="the third handed over")
    assert not cluster.allocated("pair-2")
    wait_for(lambda: _handed_over(cluster, "pair-2"), what="the HandedToKubeScheduler Event")

"""The admission check ``fractional.dev/placement`` against the emulator, the test playing Kueue:
the AdmissionCheck, a ClusterQueue naming it, Workloads with quota reserved and our check Pending.
Four 30Gi shares on GPUs with 20Gi free each -> Retry (fragmentation, scale-up hint); two GPUs free
up -> Ready with podSetUpdates; the gated pods arrive and are allocated per the plan; a workload no
node can hold -> Rejected; a reservation that drifts -> Retry. Real HTTP, real kubernetes client."""

from __future__ import annotations

import datetime
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client

from driver.allocator import allocate
from driver.cluster.apiserver import APIServer
from driver.cluster.controllers import ControllerManager
from driver.controller.kueue.check import CONTROLLER_NAME, POD_SET_ANNOTATION, RESERVATION_ANNOTATION
from driver.controller.kueue.watch import WorkloadWatch
from driver.controller.kueue.worker import KueueAdmissionCheck, KueueCheckSettings
from driver.controller.model.objects import GANG_SIZE_ANNOTATION, GATE
from driver.inventory.fake import load_profile, resolve_profile
from driver.slices import build_device_classes, build_resource_slices
from tests.controller.conftest import wait_for
from tests.kueue_support import GROUP, VERSION, install_kueue_crds

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)

NS = "default"
NOW = "2026-01-01T00:00:00Z"


@dataclass
class Cluster:
    server: APIServer
    api: client.ApiClient
    custom: client.CustomObjectsApi
    resource: client.ResourceV1Api
    core: client.CoreV1Api
    slices: list[dict[str, Any]]
    classes: list[dict[str, Any]]
    check: KueueAdmissionCheck


def _claim(name: str, memory: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": "gpu.fractional.dev",
                            "capacity": {"requests": {"memory": memory}},
                        },
                    }
                ]
            }
        },
    }


def _occupy(cluster: Cluster, name: str, memory: str, *, node: str = "node-1") -> dict[str, Any]:
    """A claim allocated as the scheduler would have (the test plays kube-scheduler)."""
    claims = cluster.resource.list_resource_claim_for_all_namespaces(_preload_content=False)
    allocated = json.loads(claims.data)["items"]
    body = _claim(name, memory)
    (allocation,) = allocate(
        [body], slices=cluster.slices, classes=cluster.classes, allocated=allocated, node=node
    )
    created = json.loads(
        cluster.resource.create_namespaced_resource_claim(NS, body, _preload_content=False).data
    )
    created["status"] = {"allocation": allocation}
    return json.loads(
        cluster.resource.replace_namespaced_resource_claim_status(
            name, NS, created, _preload_content=False
        ).data
    )


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    stop = threading.Event()
    with APIServer() as server, client.ApiClient(server.configuration()) as api:
        install_kueue_crds(api, ("admissionchecks", "clusterqueues", "workloads"))
        resource, core, custom = (
            client.ResourceV1Api(api),
            client.CoreV1Api(api),
            client.CustomObjectsApi(api),
        )
        slices = build_resource_slices(load_profile(resolve_profile("h100-8x"), node_name="node-1"))
        classes = build_device_classes()
        for device_class in classes:
            resource.create_device_class(device_class)
        for resource_slice in slices:
            resource.create_resource_slice(resource_slice)
        core.create_node(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": "node-1", "labels": {"kubernetes.io/hostname": "node-1"}},
            }
        )
        custom.create_cluster_custom_object(
            GROUP,
            VERSION,
            "admissionchecks",
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "AdmissionCheck",
                "metadata": {"name": "fractional-fit"},
                "spec": {"controllerName": CONTROLLER_NAME},
            },
        )
        custom.create_cluster_custom_object(
            GROUP,
            VERSION,
            "clusterqueues",
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "ClusterQueue",
                "metadata": {"name": "team-a"},
                "spec": {
                    "namespaceSelector": {},
                    "resourceGroups": [
                        {
                            "coveredResources": ["fractional.dev/gpu-memory"],
                            "flavors": [
                                {
                                    "name": "gpu-nodes",
                                    "resources": [
                                        {"name": "fractional.dev/gpu-memory", "nominalQuota": "632Gi"}
                                    ],
                                }
                            ],
                        }
                    ],
                    "admissionChecksStrategy": {"admissionChecks": [{"name": "fractional-fit"}]},
                },
            },
        )
        for name, memory in (("gpu-30", "30Gi"), ("gpu-100", "100Gi")):
            resource.create_namespaced_resource_claim_template(
                NS,
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaimTemplate",
                    "metadata": {"name": name, "namespace": NS},
                    "spec": {"spec": _claim(name, memory)["spec"]},
                },
            )
        check = KueueAdmissionCheck(
            api, KueueCheckSettings(resync_seconds=0.2, reservation_seconds=600), stop=stop
        )
        watcher = WorkloadWatch(api, wake=check.wake, stop=stop, timeout_seconds=1)
        check.start()
        watcher.start()
        try:
            yield Cluster(server, api, custom, resource, core, slices, classes, check)
        finally:
            stop.set()
            check.wake.set()
            watcher.interrupt()
            check.join(10)
            watcher.join(10)


def _create_workload(cluster: Cluster, name: str, template: str, count: int) -> None:
    cluster.custom.create_namespaced_custom_object(
        GROUP,
        VERSION,
        NS,
        "workloads",
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "Workload",
            "metadata": {"name": name},
            "spec": {
                "queueName": "team-a",
                "podSets": [
                    {
                        "name": "main",
                        "count": count,
                        "template": {
                            "spec": {
                                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
                                "containers": [{"name": "c", "image": "busybox"}],
                            }
                        },
                    }
                ],
            },
        },
    )
    _set_pending(cluster, name, reserve=True)


def _set_pending(cluster: Cluster, name: str, *, reserve: bool = False) -> None:
    """Kueue's part: quota reserved, every check of the ClusterQueue Pending (ours and another)."""
    workload = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, NS, "workloads", name)
    status = workload.get("status") or {}
    if reserve:
        status["conditions"] = [
            {
                "type": "QuotaReserved",
                "status": "True",
                "reason": "QuotaReserved",
                "message": "Quota reserved in ClusterQueue team-a",
                "lastTransitionTime": NOW,
            }
        ]
        status["admission"] = {
            "clusterQueue": "team-a",
            "podSetAssignments": [
                {
                    "name": p["name"],
                    "flavors": {"fractional.dev/gpu-memory": "gpu-nodes"},
                    "count": p["count"],
                }
                for p in workload["spec"]["podSets"]
            ],
        }
        status["admissionChecks"] = [
            {"name": "other-check", "state": "Pending", "message": "theirs", "lastTransitionTime": NOW}
        ]
    checks = [c for c in status.get("admissionChecks") or [] if c["name"] != "fractional-fit"]
    status["admissionChecks"] = [
        *checks,
        {"name": "fractional-fit", "state": "Pending", "message": "", "lastTransitionTime": NOW},
    ]
    workload["status"] = status
    cluster.custom.replace_namespaced_custom_object_status(GROUP, VERSION, NS, "workloads", name, workload)


def _ours(cluster: Cluster, name: str, state: str) -> dict[str, Any] | None:
    workload = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, NS, "workloads", name)
    entries = {c["name"]: c for c in (workload.get("status") or {}).get("admissionChecks") or []}
    assert entries["other-check"] == {
        "name": "other-check",
        "state": "Pending",
        "message": "theirs",
        "lastTransitionTime": NOW,
    }  # never touched
    entry = entries["fractional-fit"]
    return entry if entry["state"] == state else None


def test_retry_then_ready_then_pods_placed_per_plan(cluster: Cluster) -> None:
    fillers = [_occupy(cluster, f"filler-{i}", "59Gi") for i in range(8)]  # 79Gi GPUs: 20Gi free each
    _create_workload(cluster, "train", "gpu-30", 4)
    check = cluster.custom.get_cluster_custom_object(GROUP, VERSION, "admissionchecks", "fractional-fit")
    retry = wait_for(lambda: _ours(cluster, "train", "Retry"), what="Retry")
    active = wait_for(
        lambda: [
            c
            for c in (
                cluster.custom.get_cluster_custom_object(
                    GROUP, VERSION, "admissionchecks", "fractional-fit"
                ).get("status")
                or {}
            ).get("conditions")
            or []
            if c["type"] == "Active"
        ],
        what="Active",
    )
    assert active[0]["status"] == "True" and check["spec"]["controllerName"] == CONTROLLER_NAME
    assert "does not fit now" in retry["message"]
    assert "largest free on one GPU 20Gi" in retry["message"]
    assert "scale-up hint" in retry["message"] and "1 more node(s) like copy-of-node-1" in retry["message"]
    assert retry["requeueAfterSeconds"] == 15

    # two GPUs free up; Kueue requeues the workload and sets our check Pending again
    for filler in fillers[:2]:
        cluster.resource.delete_namespaced_resource_claim(filler["metadata"]["name"], NS)
    _set_pending(cluster, "train")
    ready = wait_for(lambda: _ours(cluster, "train", "Ready"), what="Ready")
    (update,) = ready["podSetUpdates"]
    assert update["name"] == "main"
    assert update["annotations"] == {
        RESERVATION_ANNOTATION: f"{NS}/train",
        POD_SET_ANNOTATION: "main",
        GANG_SIZE_ANNOTATION: "4",
    }
    reservation = cluster.check.reservations()[f"{NS}/train"]
    planned = {
        (r["pool"], r["device"]) for a in reservation.allocations for x in a for r in x["devices"]["results"]
    }
    freed = {
        (r["pool"], r["device"]) for f in fillers[:2] for r in f["status"]["allocation"]["devices"]["results"]
    }
    assert planned == freed  # the four shares go on the two GPUs that freed up

    # the job's pods arrive gated, with podSetUpdates merged; the controller-manager makes their claims
    with ControllerManager(cluster.server.configuration(), interval_seconds=0.05):
        for i in range(4):
            cluster.core.create_namespaced_pod(
                NS,
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": f"train-{i}",
                        "labels": {"kueue.x-k8s.io/podset": "main"},
                        "annotations": update["annotations"],
                    },
                    "spec": {
                        "schedulingGates": [{"name": GATE}],
                        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu-30"}],
                        "containers": [{"name": "c", "image": "busybox"}],
                    },
                },
            )
        wait_for(
            lambda: (
                len(
                    [
                        p
                        for p in cluster.core.list_namespaced_pod(NS).items
                        if p.metadata.name.startswith("train-") and not p.spec.scheduling_gates
                    ]
                )
                == 4
            ),
            what="pods ungated",
        )
    placed = []
    for pod in cluster.core.list_namespaced_pod(NS).items:
        if pod.metadata.name.startswith("train-"):
            claim_name = pod.status.resource_claim_statuses[0].resource_claim_name
            raw = cluster.resource.read_namespaced_resource_claim(claim_name, NS, _preload_content=False)
            results = json.loads(raw.data)["status"]["allocation"]["devices"]["results"]
            placed.extend((r["pool"], r["device"], r["consumedCapacity"]["memory"]) for r in results)
    planned_full = sorted(
        (r["pool"], r["device"], r["consumedCapacity"]["memory"])
        for a in reservation.allocations
        for x in a
        for r in x["devices"]["results"]
    )
    assert sorted(placed) == planned_full
    wait_for(lambda: f"{NS}/train" not in cluster.check.reservations(), what="the reservation released")


def test_workload_larger_than_any_node_is_rejected(cluster: Cluster) -> None:
    _create_workload(cluster, "huge", "gpu-100", 1)
    rejected = wait_for(lambda: _ours(cluster, "huge", "Rejected"), what="Rejected")
    assert "does not fit on any number of nodes" in rejected["message"]


def test_reservation_that_drifts_goes_back_to_retry(cluster: Cluster) -> None:
    _create_workload(cluster, "drift", "gpu-30", 2)
    wait_for(lambda: _ours(cluster, "drift", "Ready"), what="Ready")
    reservation = cluster.check.reservations()[f"{NS}/drift"]
    (result,) = reservation.allocations[0][0]["devices"]["results"]
    # someone else's whole-GPU claim lands on a reserved GPU (another scheduler, a manual allocation)
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "intruder", "namespace": NS},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.fractional.dev"}}]}
        },
    }
    created = json.loads(
        cluster.resource.create_namespaced_resource_claim(NS, body, _preload_content=False).data
    )
    (allocation,) = allocate(
        [body], slices=[s for s in cluster.slices], classes=cluster.classes, node="node-1"
    )
    allocation["devices"]["results"][0].update(pool=result["pool"], device=result["device"])
    allocation["devices"]["results"][0].pop("shareID", None)
    allocation["devices"]["results"][0].pop("consumedCapacity", None)
    created["status"] = {"allocation": allocation}
    cluster.resource.replace_namespaced_resource_claim_status("intruder", NS, created, _preload_content=False)
    retry = wait_for(lambda: _ours(cluster, "drift", "Retry"), what="Retry after drift")
    assert "can no longer be honoured" in retry["message"]
    assert result["device"] in retry["message"]
    wait_for(lambda: f"{NS}/drift" not in cluster.check.reservations(), what="the reservation dropped")


def test_message_timestamps_are_utc() -> None:
    from driver.controller.kueue.check import build_check_status

    workload = {
        "status": {
            "admissionChecks": [{"name": "a", "state": "Pending", "message": "", "lastTransitionTime": NOW}]
        }
    }
    now = datetime.datetime(2026, 2, 3, 4, 5, 6, tzinfo=datetime.UTC)
    (entry,) = build_check_status(
        workload, "a", state="Retry", message="m", now=now, requeue_after_seconds=30
    )
    assert entry == {
        "name": "a",
        "state": "Retry",
        "message": "m",
        "lastTransitionTime": "2026-02-03T04:05:06Z",
        "requeueAfterSeconds": 30,
    }


def test_pod_sets_plan_as_one_gang_and_a_launcher_without_claims_is_no_obstacle(cluster: Cluster) -> None:
    containers = [{"name": "c", "image": "busybox"}]
    cluster.custom.create_namespaced_custom_object(
        GROUP,
        VERSION,
        NS,
        "workloads",
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "Workload",
            "metadata": {"name": "mpi"},
            "spec": {
                "queueName": "team-a",
                "podSets": [
                    {"name": "launcher", "count": 1, "template": {"spec": {"containers": containers}}},
                    {
                        "name": "workers",
                        "count": 2,
                        "template": {
                            "spec": {
                                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu-30"}],
                                "containers": containers,
                            }
                        },
                    },
                ],
            },
        },
    )
    _set_pending(cluster, "mpi", reserve=True)
    ready = wait_for(lambda: _ours(cluster, "mpi", "Ready"), what="Ready")
    updates = {u["name"]: u["annotations"] for u in ready["podSetUpdates"]}
    assert set(updates) == {"launcher", "workers"}
    assert {a[GANG_SIZE_ANNOTATION] for a in updates.values()} == {"3"}
    with ControllerManager(cluster.server.configuration(), interval_seconds=0.05):
        cluster.core.create_namespaced_pod(
            NS,
            {  # the launcher has no claims, and no gate
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "mpi-launcher", "annotations": updates["launcher"]},
                "spec": {"containers": containers},
            },
        )
        for i in range(2):
            cluster.core.create_namespaced_pod(
                NS,
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": f"mpi-worker-{i}", "annotations": updates["workers"]},
                    "spec": {
                        "schedulingGates": [{"name": GATE}],
                        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu-30"}],
                        "containers": containers,
                    },
                },
            )
        wait_for(
            lambda: all(
                not cluster.core.read_namespaced_pod(f"mpi-worker-{i}", NS).spec.scheduling_gates
                for i in range(2)
            ),
            what="workers ungated",
        )
    wait_for(lambda: f"{NS}/mpi" not in cluster.check.reservations(), what="the reservation released")

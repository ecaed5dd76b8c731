"""The admission check's pure decisions: held reservations count as taken, a reservation whose device
is gone or taken is reported, backoff is capped, pod-set updates tie pods to the reservation."""

from __future__ import annotations

import time
from typing import Any

import pytest

from driver.controller.kueue.check import (
    RESERVATION_ANNOTATION,
    Reservation,
    build_pod_set_updates,
    build_workload_claims,
    compute_backoff_seconds,
    decide_workload,
    foreign_gates,
    reservation_problem,
    reservation_wait_reason,
)
from driver.controller.kueue.worker import _own_claim_consumer
from driver.controller.model.objects import GANG_SIZE_ANNOTATION, GATE
from driver.inventory.fake import load_profile, resolve_profile
from driver.slices import build_device_classes, build_resource_slices

SLICES = build_resource_slices(load_profile(resolve_profile("h100-8x"), node_name="node-1"))
CLASSES = build_device_classes()
NODES = [{"metadata": {"name": "node-1", "labels": {"kubernetes.io/hostname": "node-1"}}}]


def _workload(name: str, pods: int, memory: str) -> tuple[dict[str, Any], dict[str, Any]]:
    template = {
        "spec": {
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
            }
        }
    }
    workload = {
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
        "spec": {
            "podSets": [
                {
                    "name": "main",
                    "count": pods,
                    "template": {
                        "spec": {
                            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}],
                            "containers": [],
                        }
                    },
                }
            ]
        },
    }
    return workload, {"t": template}


def _reserve(name: str, pods: int, memory: str) -> Reservation:
    workload, templates = _workload(name, pods, memory)
    decision = decide_workload(
        build_workload_claims(workload, templates), slices=SLICES, classes=CLASSES, allocated=[], nodes=NODES
    )
    assert decision.state == "Ready"
    return Reservation(
        f"default/{name}", f"uid-{name}", decision.pods, decision.allocations, time.monotonic() + 60
    )


def test_a_held_reservation_counts_as_taken() -> None:
    held = _reserve("a", 8, "40Gi")  # 8 x 40Gi on 8 x 79Gi GPUs: 39Gi left on each
    workload, templates = _workload("b", 8, "40Gi")
    wanted = build_workload_claims(workload, templates)
    alone = decide_workload(wanted, slices=SLICES, classes=CLASSES, allocated=[], nodes=NODES)
    assert alone.state == "Ready"
    beside = decide_workload(wanted, slices=SLICES, classes=CLASSES, allocated=held.as_claims(), nodes=NODES)
    assert beside.state == "Retry"
    assert "largest free on one GPU 39Gi" in beside.message


def test_reservation_problems() -> None:
    held = _reserve("a", 2, "40Gi")
    assert reservation_problem(held, slices=SLICES, allocated=[]) == ""
    assert "no longer published" in reservation_problem(held, slices=[], allocated=[])
    device = held.allocations[0][0]["devices"]["results"][0]
    whole = {
        "status": {
            "allocation": {
                "devices": {"results": [{k: device[k] for k in ("driver", "pool", "device", "request")}]}
            }
        }
    }
    assert "allocated whole to another claim" in reservation_problem(held, slices=SLICES, allocated=[whole])
    share = {
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            **{k: device[k] for k in ("driver", "pool", "device", "request")},
                            "shareID": "x",
                            "consumedCapacity": {"memory": "60Gi"},
                        }
                    ]
                }
            }
        }
    }
    assert "short" in reservation_problem(held, slices=SLICES, allocated=[share])


@pytest.mark.parametrize(("retries", "seconds"), [(0, 15), (1, 30), (3, 120), (5, 480), (6, 600), (40, 600)])
def test_backoff_is_capped(retries: int, seconds: int) -> None:
    assert compute_backoff_seconds(retries) == seconds


def test_pod_set_updates_and_wait_reasons() -> None:
    workload, _ = _workload("train", 4, "1Gi")
    (update,) = build_pod_set_updates(workload, 4)
    assert update["annotations"][RESERVATION_ANNOTATION] == "default/train"
    workload["spec"]["podSets"][0]["template"]["metadata"] = {"annotations": {GANG_SIZE_ANNOTATION: "4"}}
    (kept,) = build_pod_set_updates(workload, 4)
    assert GANG_SIZE_ANNOTATION not in kept["annotations"]  # the template's own value stands
    pod = {
        "metadata": {"name": "p", "annotations": update["annotations"]},
        "spec": {"schedulingGates": [{"name": "kueue.x-k8s.io/elastic-job"}, {"name": GATE}]},
    }
    assert foreign_gates(pod) == ["kueue.x-k8s.io/elastic-job"]
    assert "Kueue's scheduling gate" in reservation_wait_reason([pod])
    pod["spec"]["schedulingGates"] = [{"name": GATE}]
    assert "admission check" in reservation_wait_reason([pod])
    pod["metadata"]["annotations"] = {}
    assert reservation_wait_reason([pod]) == ""


def test_a_pods_own_claim_is_reserved_for_it_with_its_allocation() -> None:
    """The admission check's placement writes ``reservedFor`` only for a claim the pod owns (made from
    its template); any other claim is left for kube-scheduler to reserve."""
    pod = {"metadata": {"name": "w-0", "namespace": "team", "uid": "u-pod"}}

    def claim(owner_uid: str | None, kind: str = "Pod") -> dict[str, Any]:
        owners = [{"kind": kind, "name": "x", "uid": owner_uid, "controller": True}] if owner_uid else []
        return {"metadata": {"name": "c", "namespace": "team", "ownerReferences": owners}}

    assert _own_claim_consumer(pod, claim("u-pod")) == {"resource": "pods", "name": "w-0", "uid": "u-pod"}
    assert _own_claim_consumer(pod, claim("u-other")) is None  # another pod's
    assert _own_claim_consumer(pod, claim(None)) is None  # a claim by name: maybe shared
    assert _own_claim_consumer(pod, claim("u-pod", kind="Job")) is None

"""Pure parts of the controller: pod requests, node fit, gang keys, the work queue, explanations."""

from __future__ import annotations

from typing import Any

import pytest

from driver.controller.diagnosis.explain import describe_demand, format_bytes
from driver.controller.gangs.nodefit import node_rejection
from driver.controller.loop.workqueue import WorkQueue
from driver.controller.metrics import compute_fragmented_bytes
from driver.controller.model.objects import (
    Resources,
    allocation_node,
    gang_key_of,
    gang_size_of,
    pod_claim_refs,
    pod_requests,
    resource_version_is_older,
)
from tests.controller.conftest import gpu_claim

GI = 1024**3


def _container(cpu: str, memory: str, **extra: Any) -> dict[str, Any]:
    return {"name": "c", "resources": {"requests": {"cpu": cpu, "memory": memory}}, **extra}


def test_pod_requests_follow_the_scheduler_rules() -> None:
    pod = {
        "spec": {
            "containers": [_container("500m", "1Gi"), _container("1", "1Gi")],
            "initContainers": [
                _container("3", "1Gi"),  # runs alone before the app: max(1.5, 3 + sidecar 0.25)
                _container("250m", "512Mi", restartPolicy="Always"),  # a sidecar: added to the app
            ],
            "overhead": {"cpu": "100m", "memory": "128Mi"},
        }
    }
    assert pod_requests(pod) == Resources(
        cpu_millis=3100, memory_bytes=2 * GI + 512 * 2**20 + 128 * 2**20, pods=1
    )


def test_limits_stand_in_for_missing_requests() -> None:
    pod = {"spec": {"containers": [{"name": "c", "resources": {"limits": {"cpu": "2", "memory": "3Gi"}}}]}}
    assert pod_requests(pod) == Resources(2000, 3 * GI, 1)


TAINT = {"spec": {"taints": [{"key": "gpu", "effect": "NoSchedule"}]}}
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


def _affinity(term: dict[str, Any]) -> dict[str, Any]:
    return {"affinity": {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [term]}}}}


@pytest.mark.parametrize(
    ("pod_spec", "node", "reason"),
    [
        ({}, {"spec": {"unschedulable": True}}, "cordoned"),
        ({"nodeSelector": {"zone": "a"}}, {"metadata": {"labels": {"zone": "b"}}}, "nodeSelector"),
        ({"nodeSelector": {"zone": "a"}}, {"metadata": {"labels": {"zone": "a"}}}, ""),
        ({}, {"spec": {"taints": [{"key": "gpu", "effect": "NoSchedule"}]}}, "taint gpu"),
        ({"tolerations": [{"key": "gpu", "operator": "Exists"}]}, TAINT, ""),
        ({}, {"spec": {"taints": [{"key": "gpu", "effect": "PreferNoSchedule"}]}}, ""),
        (
            _affinity({"matchExpressions": [{"key": "gpus", "operator": "Gt", "values": ["4"]}]}),
            {"metadata": {"labels": {"gpus": "2"}}},
            "affinity",
        ),
        (
            _affinity({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}),
            {"metadata": {"name": "n1"}},
            "",
        ),
    ],
)  # fmt: skip
def test_node_rejection(pod_spec: dict[str, Any], node: dict[str, Any], reason: str) -> None:
    found = node_rejection({"spec": pod_spec}, {"metadata": {"name": "n"}, **node})
    assert (reason in found) if reason else found == ""


def test_gang_keys_sizes_and_claim_refs() -> None:
    labelled = {"metadata": {"name": "p", "namespace": "ns", "labels": {"fractional.dev/gang": "train"},
                             "annotations": {"fractional.dev/gang-size": "4"}}}  # fmt: skip
    assert gang_key_of(labelled) == "ns/train" and gang_size_of(labelled) == 4
    alone = {"metadata": {"name": "p", "namespace": "ns"}}
    assert gang_key_of(alone) == "ns/pod:p" and gang_size_of(alone) == 1
    labelled["metadata"]["annotations"]["fractional.dev/gang-size"] = "four"
    assert gang_size_of(labelled) is None
    pod = {
        "spec": {"resourceClaims": [
            {"name": "a", "resourceClaimName": "claim-a"},
            {"name": "b", "resourceClaimTemplateName": "t"},
            {"name": "c", "resourceClaimTemplateName": "t"},
        ]},
        "status": {"resourceClaimStatuses": [{"name": "b", "resourceClaimName": "pod-b-x"}]},
    }  # fmt: skip
    assert [(r.entry, r.claim_name) for r in pod_claim_refs(pod)] == [
        ("a", "claim-a"),
        ("b", "pod-b-x"),
        ("c", None),
    ]


def test_allocation_node_and_resource_versions() -> None:
    allocation = {"nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": ["node-7"]}]}]}}  # fmt: skip
    assert allocation_node(allocation) == "node-7"
    assert allocation_node({"devices": {}}) is None
    assert resource_version_is_older("9", "10") and not resource_version_is_older("10", "9")
    assert not resource_version_is_older("abc", "10")


def test_work_queue_dedupes_delays_and_backs_off() -> None:
    now = [0.0]
    queue = WorkQueue(base_delay_seconds=1.0, monotonic=lambda: now[0])
    queue.add("a")
    queue.add("a")
    queue.add("b")
    assert [queue.get(0), queue.get(0), queue.get(0)] == ["a", "b", None]
    assert queue.add_rate_limited("a") == 1.0
    assert queue.add_rate_limited("a") == 2.0
    assert queue.get(0) is None
    now[0] = 1.5
    assert queue.get(0) == "a"  # the first delayed copy; the second is merged while queued
    queue.forget("a")
    assert queue.add_rate_limited("a") == 1.0


def test_describe_demand_in_words() -> None:
    claims = [gpu_claim(f"c{i}", memory="40Gi", compute=None, count=4, nvlink=True) for i in range(4)]
    assert describe_demand(claims) == "16 shares of >=40Gi on NVLink-local GPUs (per claim)"
    assert describe_demand([gpu_claim("w", memory=None, compute=None)]) == "1 whole GPUs"
    assert format_bytes(int(1.5 * GI)) == "1.5Gi"


def test_fragmentation_counts_free_memory_no_pending_share_fits() -> None:
    summary = {"n": {"gpu-0": {"memory_bytes_free": 3 * GI}, "gpu-1": {"memory_bytes_free": 20 * GI},
                     "gpu-2": {"memory_bytes_free": 0}}}  # fmt: skip
    assert compute_fragmented_bytes(summary, [8 * GI, 12 * GI]) == 3 * GI
    assert compute_fragmented_bytes(summary, []) == 0

"""Kueue itself, built from its Go module (v0.19.2, hack/upstream-build.sh) and run against the real
kube-apiserver with its CRDs and webhooks (hack/localcluster/kueue.py), in front of our admission
check ``fractional.dev/placement`` (the chart's ``controller.kueueAdmissionCheck.enabled``).

A Job in a LocalQueue whose ClusterQueue names our AdmissionCheck: Ready when it fits and its pods
run where the check planned; Retry with a message naming the fragmentation when every GPU has too
little free; Ready once room is freed; and a workload Kueue itself refuses (a pod naming a
ResourceClaim directly) never admitted. The queue objects are the shipped ``examples/kueue/`` files.

Local cluster only: it starts Kueue and turns the check on (``helm upgrade``), then undoes both.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from e2e_support import IMAGE, LOCAL_CLUSTER, REPO_ROOT, apply, get, kubectl, list_items, pod, wait_for
from kubernetes.utils import parse_quantity
from test_driver import POD_START_SECONDS, gpu_request, running, template

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not LOCAL_CLUSTER, reason="starts Kueue on the local cluster of make e2e"),
]

sys.path.insert(0, str(REPO_ROOT / "hack"))

EXAMPLES = REPO_ROOT / "examples" / "kueue"
GATE = "fractional.dev/allocation"
CHECK = "fractional-placement"
QUEUE = "team-a"


def _example(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


@pytest.fixture(scope="module")
def kueue(real_cluster: None) -> Iterator[None]:
    from localcluster.cluster import Binaries, LocalCluster
    from localcluster.driver import upgrade_driver
    from localcluster.kueue import start_kueue, stop_kueue

    local = LocalCluster()
    binaries = Binaries.build(local.version, "kueue")
    start_kueue(local, binaries)
    try:
        upgrade_driver(local, controller={"kueueAdmissionCheck": {"enabled": True}})
        kubectl("rollout", "status", "deployment", "-n", "fractional-system", "-l",
                "app.kubernetes.io/component=controller", "--timeout=300s", timeout=320)  # fmt: skip
        cluster_objects = _example("resource-flavor.yaml") + _example("admission-check.yaml")
        cluster_objects += _example("cluster-queue.yaml")
        listed = {"apiVersion": "v1", "kind": "List", "items": cluster_objects}
        kubectl("apply", "-f", "-", stdin=json.dumps(listed))
        wait_for(_check_active, timeout=120, what="our AdmissionCheck Active")
        yield
    finally:
        for kind, name in (("clusterqueue", "gpu-cluster-queue"), ("admissioncheck", CHECK),
                           ("resourceflavor", "fractional-gpu-nodes")):  # fmt: skip
            kubectl("delete", kind, name, "--ignore-not-found", "--wait=false")
        stop_kueue(local)
        upgrade_driver(local)


def _check_active() -> bool:
    conditions = get("admissioncheck", CHECK).get("status", {}).get("conditions", [])
    return any(c["type"] == "Active" and c["status"] == "True" for c in conditions)


@pytest.fixture
def queue(kueue: None, idle: str) -> str:
    (local_queue,) = _example("local-queue.yaml")
    local_queue["metadata"]["namespace"] = idle
    apply([local_queue], idle)
    return idle


def _job(name: str, pods: int, claim_source: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": {"kueue.x-k8s.io/queue-name": QUEUE}},
        "spec": {
            "parallelism": pods,
            "completions": pods,
            "suspend": True,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 1,
                    "schedulingGates": [{"name": GATE}],
                    "resourceClaims": [{"name": "gpu", **claim_source}],
                    "containers": [
                        {
                            "name": "main",
                            "image": IMAGE,
                            "command": ["sh", "-c", "exec sleep 3600"],
                            "resources": {"claims": [{"name": "gpu"}]},
                        }
                    ],
                }
            },
        },
    }


def _workload_of(job: str, namespace: str) -> dict[str, Any] | None:
    for workload in list_items("workloads.kueue.x-k8s.io", "-n", namespace):
        owners = workload["metadata"].get("ownerReferences", [])
        if any(o["kind"] == "Job" and o["name"] == job for o in owners):
            return workload
    return None


def _check_state(job: str, namespace: str) -> tuple[str, str] | None:
    workload = _workload_of(job, namespace)
    for check in (workload or {}).get("status", {}).get("admissionChecks", []):
        if check["name"] == CHECK:
            return check["state"], check.get("message", "")
    return None


def _job_pods(job: str, namespace: str) -> list[dict[str, Any]]:
    return list_items("pods", "-n", namespace, "-l", f"job-name={job}")


def _all_running(job: str, namespace: str, count: int) -> bool:
    pods = _job_pods(job, namespace)
    return len(pods) == count and all(running(p["metadata"]["name"], namespace) for p in pods)


def test_a_job_that_fits_is_admitted_and_runs_where_the_check_planned(queue: str) -> None:
    apply([template("share-8g", [gpu_request(memory="8Gi", compute="10")]),
           _job("fits", 2, {"resourceClaimTemplateName": "share-8g"})], queue)  # fmt: skip
    wait_for(lambda: (_check_state("fits", queue) or ("", ""))[0] == "Ready", timeout=180, what="Ready")
    assert get("job", "fits", queue)["spec"].get("suspend") in (False, None)
    wait_for(lambda: _all_running("fits", queue, 2), timeout=POD_START_SECONDS, what="the Job's pods running")
    workload = _workload_of("fits", queue)
    assert workload is not None
    for pod_object in _job_pods("fits", queue):
        annotations = pod_object["metadata"].get("annotations", {})
        assert annotations.get("fractional.dev/reservation") == f"{queue}/{workload['metadata']['name']}"


def _fill_to_fragments(namespace: str) -> list[str]:
    """Every GPU left with under 10 GiB free: 70 GiB on each 79 GiB h100, 30 GiB on each a100."""
    slices = list_items("resourceslices", "--field-selector", "spec.driver=fractional.dev")
    objects: list[dict[str, Any]] = []
    names = []
    for resource_slice in slices:
        for device in resource_slice["spec"].get("devices", []):
            if "memory" not in device.get("capacity", {}):
                continue
            (uuid,) = device["attributes"]["uuid"].values()
            big = parse_quantity(device["capacity"]["memory"]["value"]) > 64 * 1024**3
            name = f"filler-{len(names)}"
            request = gpu_request(
                memory="70Gi" if big else "30Gi",
                selectors=[f'device.attributes["fractional.dev"].uuid == "{uuid}"'],
            )
            filler = pod(name, {"gpu": {"resourceClaimTemplateName": name}}, command="exec sleep 3600")
            filler["spec"]["schedulingGates"] = [{"name": GATE}]
            objects += [template(name, [request]), filler]
            names.append(name)
    apply(objects, namespace)
    for name in names:
        wait_for(lambda n=name: running(n, namespace), timeout=POD_START_SECONDS, what=f"filler {name}")
    return names


def test_retry_under_fragmentation_then_ready_once_room_is_freed(queue: str) -> None:
    fillers = _fill_to_fragments(queue)
    apply([template("share-16g", [gpu_request(memory="16Gi")]),
           _job("waits", 1, {"resourceClaimTemplateName": "share-16g"})], queue)  # fmt: skip
    _, message = wait_for(
        lambda: s if (s := _check_state("waits", queue)) and s[0] == "Retry" else None,
        timeout=180,
        what="Retry from our check",
    )
    assert "largest free on one GPU" in message, message
    assert get("job", "waits", queue)["spec"].get("suspend") is True
    kubectl("delete", "pod", fillers[0], "-n", queue, "--wait=true", timeout=120)
    wait_for(
        lambda: (_check_state("waits", queue) or ("", ""))[0] == "Ready", timeout=300, what="Ready after room"
    )
    wait_for(lambda: _all_running("waits", queue, 1), timeout=POD_START_SECONDS, what="the pod running")


def test_a_workload_kueue_refuses_is_never_admitted(queue: str) -> None:
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "direct"},
        "spec": {"devices": {"requests": [gpu_request(memory="2Gi")]}},
    }
    apply([claim, _job("direct", 1, {"resourceClaimName": "direct"})], queue)

    def refused() -> str | None:
        workload = _workload_of("direct", queue)
        for condition in (workload or {}).get("status", {}).get("conditions", []):
            said = condition.get("message")
            if condition["type"] == "QuotaReserved" and condition["status"] == "False" and said:
                return str(said)
        return None

    message = wait_for(refused, timeout=120, what="Kueue's refusal")
    assert get("job", "direct", queue)["spec"].get("suspend") is True, message
    assert not _job_pods("direct", queue)

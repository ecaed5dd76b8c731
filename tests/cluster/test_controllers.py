"""The controller-manager stand-ins against the emulator alone (no kubelet: the test plays it,
marking pods Succeeded or Failed)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client

from driver.cluster.apiserver import APIServer
from driver.cluster.controllers import ControllerManager

WAIT_SECONDS = 30.0


@pytest.fixture
def cluster(api_server: APIServer) -> Iterator[client.ApiClient]:
    with (
        ControllerManager(api_server.configuration(), interval_seconds=0.05),
        client.ApiClient(api_server.configuration()) as api,
    ):
        yield api


def _wait(predicate: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT_SECONDS
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def _job(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "x"}]}},
            **spec,
        },
    }


def _pods(core: client.CoreV1Api, selector: str) -> list[Any]:
    return list(core.list_namespaced_pod("default", label_selector=selector).items)


def _finish(core: client.CoreV1Api, pod: Any, phase: str = "Succeeded") -> None:
    core.patch_namespaced_pod_status(pod.metadata.name, "default", {"status": {"phase": phase}})


def test_indexed_job_runs_parallelism_pods_until_every_index_succeeded(cluster: client.ApiClient) -> None:
    core, batch = client.CoreV1Api(cluster), client.BatchV1Api(cluster)
    batch.create_namespaced_job(
        "default", _job("indexed", completions=3, parallelism=2, completionMode="Indexed")
    )
    first = _wait(lambda: len(pods := _pods(core, "job-name=indexed")) == 2 and pods, "two pods")
    indexes = sorted(p.metadata.annotations["batch.kubernetes.io/job-completion-index"] for p in first)
    assert indexes == ["0", "1"]
    assert {p.spec.hostname for p in first} == {"indexed-0", "indexed-1"}
    for pod in first:
        _finish(core, pod)
    third = _wait(
        lambda: [p for p in _pods(core, "job-name=indexed") if p.status.phase not in ("Succeeded",)],
        "the third pod",
    )
    assert [p.metadata.annotations["batch.kubernetes.io/job-completion-index"] for p in third] == ["2"]
    _finish(core, third[0])
    job = _wait(
        lambda: (j := batch.read_namespaced_job("indexed", "default")).status.completion_time and j,
        "Complete",
    )
    assert job.status.succeeded == 3
    assert job.status.completed_indexes == "0-2"
    assert {(c.type, c.status) for c in job.status.conditions} == {
        ("SuccessCriteriaMet", "True"),
        ("Complete", "True"),
    }


def test_job_fails_past_its_backoff_limit(cluster: client.ApiClient) -> None:
    core, batch = client.CoreV1Api(cluster), client.BatchV1Api(cluster)
    batch.create_namespaced_job("default", _job("doomed", backoffLimit=0))
    (pod,) = _wait(lambda: _pods(core, "job-name=doomed"), "the pod")
    _finish(core, pod, "Failed")
    job = _wait(
        lambda: (j := batch.read_namespaced_job("doomed", "default")).status.conditions and j,
        "the Failed condition",
    )
    assert ("Failed", "True", "BackoffLimitExceeded") in {
        (c.type, c.status, c.reason) for c in job.status.conditions
    }


def test_pods_with_claim_templates_get_claims_that_go_with_them(cluster: client.ApiClient) -> None:
    core, resource = client.CoreV1Api(cluster), client.ResourceV1Api(cluster)
    request = {"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}
    devices = {"requests": [request]}
    template_spec = {"metadata": {"labels": {"from": "template"}}, "spec": {"devices": devices}}
    resource.create_namespaced_resource_claim_template(
        "default",
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "t"},
         "spec": template_spec},
    )  # fmt: skip
    core.create_namespaced_pod(
        "default",
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "user"},
         "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}],
                  "containers": [{"name": "c", "image": "x"}]}},
    )  # fmt: skip
    statuses = _wait(
        lambda: core.read_namespaced_pod("user", "default").status.resource_claim_statuses, "statuses"
    )
    (status,) = statuses
    assert status.name == "gpu" and status.resource_claim_name.startswith("user-gpu-")
    claim = resource.read_namespaced_resource_claim(status.resource_claim_name, "default")
    assert claim.metadata.labels == {"from": "template"}
    assert claim.metadata.annotations["resource.kubernetes.io/pod-claim-name"] == "gpu"
    assert (claim.metadata.owner_references[0].kind, claim.metadata.owner_references[0].controller) == (
        "Pod",
        True,
    )
    core.delete_namespaced_pod("user", "default")
    _wait(lambda: not resource.list_namespaced_resource_claim("default").items, "the claim collected")

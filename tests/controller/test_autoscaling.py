"""A gang that fits nowhere, our controller, and a stand-in for cluster-autoscaler 1.36's
ProvisioningRequest processing (hack/localcluster/autoscaler.py) with a node group that grows:
the request is written, the group grows by the nodes the gang needs, the gang is placed across the
old and new nodes and the request is deleted. Then the failures: the group at its maximum, a booking
that expired before the nodes came. (``tests/e2e`` runs it with real kubelet nodes.)"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from driver.inventory.fake import load_profile, resolve_profile
from driver.slices import build_resource_slices
from tests.controller.conftest import Cluster, RunningController, gated_pod, gpu_claim, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "hack"))

from localcluster.autoscaler import AutoscalerDouble

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)

GROUP_LABEL = "fractional.dev/node-group"
PROVISIONING = ("autoscaling.x-k8s.io", "v1", "default", "provisioningrequests")


@dataclass(frozen=True)
class Group:
    name: str
    max_size: int


@dataclass
class Groups:
    """A node group provider whose nodes are API objects: a Node (Ready, providerID, the group's
    label) and the ResourceSlices our agent publishes for the profile. ``slow``: asked to grow, it
    delivers the nodes only on ``deliver()`` (they count in its target size meanwhile)."""

    cluster: Cluster
    group: Group
    profile: str = "l4-2x"
    slow: bool = False
    publish: bool = True  # False: its nodes come Ready but no agent publishes their slices
    asked: list[int] = field(default_factory=list)
    pending: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def groups(self) -> list[Group]:
        return [self.group]

    def target_size(self, group: str) -> int:
        return len(self._nodes()) + self.pending

    def increase_size(self, group: str, delta: int) -> None:
        with self.lock:
            self.asked.append(delta)
            self.pending += delta
            if not self.slow:
                self.deliver()

    def decrease_target_size(self, group: str, delta: int) -> None:
        """Gives up nodes not delivered yet; refuses to touch a node that exists."""
        with self.lock:
            if self.pending < -delta:
                raise RuntimeError(f"{self.pending} node(s) not registered; would delete registered nodes")
            self.pending += delta

    def deliver(self) -> None:
        while self.pending:
            self.add(f"{self.group.name}-{len(self._nodes())}")
            self.pending -= 1

    def add(self, name: str) -> None:
        inventory = load_profile(resolve_profile(self.profile), node_name=name)
        allocatable = {"cpu": "64", "memory": "512Gi", "pods": "110"}
        labels = {"kubernetes.io/hostname": name, GROUP_LABEL: self.group.name, **dict(inventory.labels)}
        self.cluster.core.create_node({
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "spec": {"providerID": f"fractional-local://{self.group.name}/{name}"},
            "status": {"allocatable": allocatable, "capacity": allocatable,
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]},
        })  # fmt: skip
        for s in build_resource_slices(inventory) if self.publish else ():
            self.cluster.resource.create_resource_slice(s)
        wait_for(lambda: not self.cluster.not_ready(name), what=f"node {name} without the not-ready taint")

    def _nodes(self) -> list[Any]:
        return self.cluster.core.list_node(label_selector=f"{GROUP_LABEL}={self.group.name}").items


def _requests(custom: client.CustomObjectsApi) -> list[dict[str, Any]]:
    return list(custom.list_namespaced_custom_object(*PROVISIONING)["items"])


def _answered(custom: client.CustomObjectsApi, suffix: str = "") -> list[dict[str, Any]]:
    """Our requests (whose name ends with ``suffix``) that cluster-autoscaler answered."""
    return [
        r
        for r in _requests(custom)
        if r["metadata"]["name"].endswith(suffix) and "Provisioned" in _conditions(r)
    ]


def _conditions(request: dict[str, Any]) -> dict[str, str]:
    return {
        c["type"]: f"{c['status']}/{c['reason']}"
        for c in (request.get("status") or {}).get("conditions") or ()
    }


def _gang(cluster: Cluster, name: str, pods: int) -> None:
    for i in range(pods):  # a whole L4 (24 GB) each: an l4-2x node holds two
        cluster.create_claim(gpu_claim(f"{name}-{i}", memory="20Gi", compute=None))
        cluster.create_pod(gated_pod(f"{name}-{i}", [f"{name}-{i}"], gang=name, size=pods))


def test_the_group_grows_by_what_the_gang_needs_and_the_gang_is_placed(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    groups = Groups(cluster, Group("l4", max_size=3))
    groups.add("l4-0")  # a Ready node of the group: cluster-autoscaler copies it for new ones
    _gang(cluster, "train", 5)  # five GPUs: two on the node there, three on two new ones
    controller(provisioning_requests=True, hint_profiles=("l4-2x",))
    custom = client.CustomObjectsApi(cluster.api_client)
    with AutoscalerDouble(cluster.server.configuration(), groups, scan_seconds=0.2):
        wait_for(
            lambda: all(cluster.ungated(f"train-{i}") for i in range(5)), what="the gang placed", timeout=60
        )
        wait_for(lambda: not _requests(custom), what="its request deleted once placed")
    assert groups.asked == [2]  # once, all of it, in one group
    hosts = {
        (c["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"][0])
        for c in cluster.claims()
    }
    assert hosts == {"l4-0", "l4-1", "l4-2"}  # across the old node and the new ones


def test_a_group_at_its_maximum_is_not_found_and_asked_no_second_time(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    groups = Groups(cluster, Group("l4", max_size=2))
    groups.add("l4-0")
    _gang(cluster, "big", 5)  # needs two more nodes; the group may have one more
    controller(provisioning_requests=True, hint_profiles=("l4-2x",))
    custom = client.CustomObjectsApi(cluster.api_client)
    with AutoscalerDouble(cluster.server.configuration(), groups, scan_seconds=0.2, initial_backoff=0.2):
        (request,) = wait_for(lambda: _answered(custom), what="its answer")
        assert _conditions(request)["Provisioned"] == "False/CapacityIsNotFound"
        wait_for(
            lambda: any("CapacityIsNotFound" in (e.get("message") or "") for e in cluster.events()),
            what="the gang's Event saying so",
        )
        assert [r["metadata"]["name"] for r in _requests(custom)] == [request["metadata"]["name"]]
    assert groups.asked == []
    assert not any(cluster.ungated(f"big-{i}") for i in range(5))


def test_a_booking_that_expired_before_the_nodes_came_is_asked_for_again(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    """The second request finds the nodes of the first still coming (counted as capacity there, as
    cluster-autoscaler counts upcoming nodes): found, not asked for twice."""
    groups = Groups(cluster, Group("l4", max_size=8), slow=True)
    groups.add("l4-0")
    _gang(cluster, "late", 3)
    controller(provisioning_requests=True, hint_profiles=("l4-2x",), provisioning_retry_seconds=0.5)
    custom = client.CustomObjectsApi(cluster.api_client)
    with AutoscalerDouble(cluster.server.configuration(), groups, scan_seconds=0.2, booking_seconds=1.0):
        (second,) = wait_for(
            lambda: _answered(custom, "-a1-p0"),
            what="a second attempt after the first booking expired, answered", timeout=30,
        )  # fmt: skip
        assert _conditions(second)["Provisioned"] == "True/CapacityIsFound"
        assert groups.asked == [1] and len(_requests(custom)) == 1
        with groups.lock:
            groups.deliver()  # the cloud delivers the node of the first request
        wait_for(
            lambda: all(cluster.ungated(f"late-{i}") for i in range(3)), what="the gang placed", timeout=60
        )
        wait_for(lambda: not _requests(custom), what="its request deleted once placed")


def test_a_node_that_never_publishes_its_slices_is_waited_for_not_asked_for_twice(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    """cluster-autoscaler counts a node without its slices as unready, still coming: the booking
    expires, we ask again, it finds the node still coming; the gang waits. (Within its
    --max-node-provision-time: the next test is what comes after.)"""
    groups = Groups(cluster, Group("l4", max_size=8))
    groups.add("l4-0")
    groups.publish = False
    _gang(cluster, "dark", 3)
    controller(provisioning_requests=True, hint_profiles=("l4-2x",), provisioning_retry_seconds=0.5)
    custom = client.CustomObjectsApi(cluster.api_client)
    with AutoscalerDouble(cluster.server.configuration(), groups, scan_seconds=0.2, booking_seconds=1.0):
        (again,) = wait_for(
            lambda: _answered(custom, "-a1-p0"),
            what="the request made again, answered", timeout=30,
        )  # fmt: skip
        assert _conditions(again)["Provisioned"] == "True/CapacityIsFound"  # the node counts as coming
        assert groups.asked == [1]
        assert cluster.core.read_node("l4-1").metadata.labels[GROUP_LABEL] == "l4"  # there, Ready, dark
    assert not any(cluster.ungated(f"dark-{i}") for i in range(3))


def test_after_the_provision_timeout_a_dark_node_no_longer_counts_and_the_group_grows_again(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    """As the real cluster-autoscaler 1.36.1 did with a node whose agent never published: past
    --max-node-provision-time the scale-up timed out, the group was backed off and asked to
    decrease its target size (refused: the node registered), and the node stopped counting as
    coming. Our request, made again after the booking expired, then finds no capacity while the
    group is backed off, and grows the group by another node once the backoff is over."""
    groups = Groups(cluster, Group("l4", max_size=8))
    groups.add("l4-0")
    groups.publish = False
    _gang(cluster, "dark", 3)
    controller(provisioning_requests=True, hint_profiles=("l4-2x",), provisioning_retry_seconds=0.5)
    with AutoscalerDouble(
        cluster.server.configuration(), groups, scan_seconds=0.2, booking_seconds=1.0, initial_backoff=0.5,
        max_node_provision_seconds=1.5, group_backoff_seconds=2.0,
    ) as double:  # fmt: skip
        wait_for(lambda: len(groups.asked) == 2, what="the group grown a second time", timeout=60)
        assert double.timed_out[:1] == ["l4"] and groups.asked == [1, 1]
        assert cluster.core.read_node("l4-1").metadata.labels[GROUP_LABEL] == "l4"  # kept: it registered
        assert not double.errors, double.errors
    assert not any(cluster.ungated(f"dark-{i}") for i in range(3))

"""Consolidation end to end: the controller against the API emulator over HTTP with the real client,
evictions through ``pods/eviction`` with its budget check. The tests play the owner (a ReplicaSet):
when a moved pod goes, they create its replacement, a gated pod with the same controller reference.

One node of four A100 40GB; two 10Gi shares of one ReplicaSet left on two GPUs by churn, the other two
GPUs taken whole: a whole-GPU pod of the same priority fits only once one share moves beside the other.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes import client

from driver import why as why_module
from driver.config import WhyConfig
from driver.controller.consolidation.consolidator import EVENT_REASON_BLOCKED, EVENT_REASON_CONSOLIDATING
from driver.why import run_why
from tests.controller.conftest import NAMESPACE, Cluster, RunningController, gated_pod, gpu_claim, wait_for
from tests.controller.test_preemption import budget, events, exists, gpu_of, placed

# Not shared with --cluster=real: there kube-controller-manager's garbage collector deletes at once
# a pod whose controller reference names no object (seen on 1.37.2: s1 gone before it was placed),
# and a real ReplicaSet would make its own replacements. tests/e2e/test_consolidation_real.py moves
# the pods of a real Deployment instead.

OWNER = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "shares", "uid": "rs-shares-uid",
         "controller": True}  # fmt: skip
MOVABLE = {"fractional.dev/movable": "true", "app": "shares"}
SETTINGS: dict[str, Any] = {"consolidation": True, "consolidation_min_runtime_seconds": 60,
                            "consolidation_cooldown_seconds": 0}  # fmt: skip


def start(cluster: Cluster, name: str, *, ago: float = 3600.0) -> None:
    """What kube-scheduler and the kubelet would do once the pod is ungated: bind it, run it."""
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
               "target": {"kind": "Node", "name": "node-a"}}  # fmt: skip
    cluster.core.create_namespaced_pod_binding(name, NAMESPACE, binding, _preload_content=False)
    body = cluster.pod(name)
    started = (datetime.now(UTC) - timedelta(seconds=ago)).strftime("%Y-%m-%dT%H:%M:%SZ")
    body["status"] = {**body.get("status", {}), "phase": "Running", "startTime": started,
                      "conditions": [{"type": "Ready", "status": "True"}]}  # fmt: skip
    cluster.core.replace_namespaced_pod_status(name, NAMESPACE, body)


def create(cluster: Cluster, name: str, *, memory: str | None, owned: bool | dict[str, Any] = False,
           labels: dict[str, str] | None = None) -> None:  # fmt: skip
    """``owned``: True for the ReplicaSet OWNER, or the controller reference to write."""
    cluster.create_claim(gpu_claim(f"{name}-claim", memory=memory, compute=None))
    pod = gated_pod(name, [f"{name}-claim"])
    pod["metadata"]["labels"].update(labels or {})
    if owned:
        pod["metadata"]["ownerReferences"] = [OWNER if owned is True else owned]
    cluster.create_pod(pod)


def run(cluster: Cluster, name: str, *, memory: str | None, owned: bool | dict[str, Any] = False,
        ago: float = 3600.0, labels: dict[str, str] | None = None) -> None:  # fmt: skip
    create(cluster, name, memory=memory, owned=owned, labels=labels)
    wait_for(lambda: placed(cluster, name), what=f"{name} placed")
    start(cluster, name, ago=ago)


def spread(
    cluster: Cluster, *, ago: float = 3600.0, labels: dict[str, str] | None = None,
    owners: dict[str, dict[str, Any]] | None = None,
) -> tuple[str, str]:  # fmt: skip
    """s1 and s2 (10Gi shares of the ReplicaSet, or of ``owners``) on two GPUs, w1 and w2 whole on
    the other two."""
    cluster.add_node("node-a", "a100-pcie-4x")
    owner = owners or {"s1": True, "s2": True}
    run(cluster, "s1", memory="10Gi", owned=owner["s1"], ago=ago, labels=labels or MOVABLE)
    run(cluster, "filler", memory="29Gi")  # beside s1: that GPU is full (39.57Gi usable)
    run(cluster, "s2", memory="10Gi", owned=owner["s2"], ago=ago, labels=labels or MOVABLE)
    cluster.core.delete_namespaced_pod("filler", NAMESPACE)
    wait_for(lambda: not cluster.allocated("filler-claim"), what="the filler's share released")
    run(cluster, "w1", memory=None)
    run(cluster, "w2", memory=None)
    assert gpu_of(cluster, "s1") != gpu_of(cluster, "s2")
    return gpu_of(cluster, "s1"), gpu_of(cluster, "s2")


def why(cluster: Cluster, name: str) -> list[str]:
    return run_why(WhyConfig(kubeconfig=str(cluster.kubeconfig), pod=f"{NAMESPACE}/{name}"))


def said_unschedulable(cluster: Cluster, name: str) -> bool:
    return any(e["involvedObject"]["name"] == name and e["type"] == "Warning" for e in cluster.events())


def replace(cluster: Cluster, name: str) -> None:
    """The ReplicaSet's answer to a moved pod: a new one from the same template."""
    create(cluster, name, memory="10Gi", owned=True, labels=MOVABLE)


def test_one_share_moves_beside_the_other_and_the_whole_gpu_pod_takes_the_freed_gpu(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    controller(**SETTINGS)
    gpu1, gpu2 = spread(cluster)
    create(cluster, "whole", memory=None)
    wait_for(lambda: not exists(cluster, "s1") or not exists(cluster, "s2"), what="one share moved")
    moved = "s1" if not exists(cluster, "s1") else "s2"
    stays = "s2" if moved == "s1" else "s1"
    freed = gpu1 if moved == "s1" else gpu2
    assert exists(cluster, stays)
    (consolidating,) = events(cluster, "Consolidating")
    assert consolidating["involvedObject"]["name"] == "whole"
    assert f"default/{moved} (ReplicaSet/shares) -> node-a" in consolidating["message"]
    # The Event on the moved pod is written after its eviction: the pod can be gone a moment before.
    wait_for(lambda: events(cluster, "Consolidated"), what="the move said")
    (consolidated,) = events(cluster, "Consolidated")
    assert consolidated["involvedObject"]["name"] == moved and consolidated["related"]["name"] == "whole"
    assert cluster.pod("whole")["status"].get("nominatedNodeName") == "node-a"
    wait_for(lambda: not cluster.allocated(f"{moved}-claim"), what="the moved share's claim released")
    wait_for(lambda: placed(cluster, "whole"), what="the whole-GPU pod placed")
    assert gpu_of(cluster, "whole") == freed
    replace(cluster, "s3")
    wait_for(lambda: placed(cluster, "s3"), what="the replacement placed")
    assert gpu_of(cluster, "s3") == gpu_of(cluster, stays)  # the room kept for it: beside the other share


def test_the_replacement_takes_its_kept_room_before_another_pod_can(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    """A 30Gi share arriving after the move would fit only where the replacement's room is kept: it
    waits, and the replacement gets that room."""
    controller(**SETTINGS)
    spread(cluster)
    create(cluster, "whole", memory=None)
    wait_for(lambda: not exists(cluster, "s1") or not exists(cluster, "s2"), what="one share moved")
    wait_for(lambda: placed(cluster, "whole"), what="the whole-GPU pod placed")
    create(cluster, "intruder", memory="29Gi")
    replace(cluster, "s3")
    wait_for(lambda: placed(cluster, "s3"), what="the replacement placed")
    assert not cluster.allocated("intruder-claim")


def test_a_new_leader_keeps_the_room_the_last_one_kept_for_a_replacement(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    """The holds ride on the leader's Lease: after a failover between the move and the replacement's
    arrival, the new leader still keeps the replacement's room and the owner's cooldown."""
    lease = {"leader_elect": True, "lease_duration_seconds": 2.0, "renew_deadline_seconds": 1.5,
             "retry_period_seconds": 0.1}  # fmt: skip
    settings = {**SETTINGS, "consolidation_cooldown_seconds": 600}
    first = controller(identity="replica-a", **settings, **lease)
    wait_for(first.started.is_set, what="replica-a leading")
    spread(cluster)
    create(cluster, "whole", memory=None)
    wait_for(lambda: not exists(cluster, "s1") or not exists(cluster, "s2"), what="one share moved")
    wait_for(lambda: placed(cluster, "whole"), what="the whole-GPU pod placed")
    leases = client.CoordinationV1Api(cluster.api_client)

    def published() -> dict[str, Any]:
        lease_obj = json.loads(leases.read_namespaced_lease(
            "fractional-dra-controller", NAMESPACE, _preload_content=False).data)  # fmt: skip
        text = (lease_obj["metadata"].get("annotations") or {}).get("fractional.dev/holds")
        return json.loads(text or "{}")

    # The move's time is recorded once its eviction and Event are done, after the reservation.
    wait_for(lambda: published().get("reservations") and published().get("movedAt"),
             what="the reservation and the move published with the lease")  # fmt: skip
    assert published()["movedAt"] == {OWNER["uid"]: pytest.approx(time.time(), abs=60)}
    assert first.shutdown() == 0  # a clean stop: the lease released with the holds on it
    second = controller(identity="replica-b", **settings, **lease)
    wait_for(second.started.is_set, what="replica-b leading")
    create(cluster, "intruder", memory="29Gi")  # fits only in the room kept for the replacement
    replace(cluster, "s3")
    wait_for(lambda: placed(cluster, "s3"), what="the replacement placed")
    assert not cluster.allocated("intruder-claim")
    wait_for(lambda: not published().get("reservations"), what="the taken reservation gone from the lease")
    assert OWNER["uid"] in published()["movedAt"]  # the cooldown goes on


def test_a_disruption_budget_that_allows_nothing_keeps_every_pod_and_says_why(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    controller(**SETTINGS)
    spread(cluster)
    budget(cluster, "shares", "shares", min_available=2, allowed=0)
    create(cluster, "whole", memory=None)
    wait_for(lambda: events(cluster, "ConsolidationBlocked"), what="the refusal said")
    (blocked,) = events(cluster, "ConsolidationBlocked")[:1]
    assert blocked["involvedObject"]["name"] == "whole" and blocked["type"] == "Warning"
    assert "2 protected by a PodDisruptionBudget" in blocked["message"]
    assert "default/shares" in blocked["message"]
    assert exists(cluster, "s1") and exists(cluster, "s2")
    assert not cluster.allocated("whole-claim")
    lines = why(cluster, "whole")
    assert any(
        line.startswith("consolidation: nothing moved for it: consolidation for gang") for line in lines
    )


def test_why_says_the_pod_waits_for_pods_being_moved(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    """A finalizer keeps both shares terminating once evicted: the whole-GPU pod waits meanwhile."""
    controller(**SETTINGS)
    spread(cluster)
    for name in ("s1", "s2"):
        cluster.core.patch_namespaced_pod(name, NAMESPACE, {"metadata": {"finalizers": ["example.com/keep"]}})
    create(cluster, "whole", memory=None)
    wait_for(lambda: events(cluster, "Consolidating"), what="the consolidation said")
    lines = why(cluster, "whole")
    assert "waits for a consolidation: pods are being moved to make room for it on node node-a" in lines
    assert not cluster.allocated("whole-claim")
    for name in ("s1", "s2"):
        cluster.core.patch_namespaced_pod(name, NAMESPACE, {"metadata": {"finalizers": None}})
    wait_for(lambda: placed(cluster, "whole"), what="the whole-GPU pod placed")


def test_why_reads_the_reasons_the_controller_writes() -> None:
    assert (why_module.CONSOLIDATING, why_module.CONSOLIDATION_BLOCKED) == (
        EVENT_REASON_CONSOLIDATING,
        EVENT_REASON_BLOCKED,
    )


def test_pods_below_the_minimum_runtime_stay(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    controller(**SETTINGS)
    spread(cluster, ago=5.0)
    create(cluster, "whole", memory=None)
    wait_for(lambda: events(cluster, "ConsolidationBlocked"), what="the refusal said")
    assert "2 below the minimum runtime" in events(cluster, "ConsolidationBlocked")[0]["message"]
    assert exists(cluster, "s1") and exists(cluster, "s2")


def test_pods_that_did_not_opt_in_are_never_moved(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    controller(**SETTINGS)
    spread(cluster, labels={"app": "shares"})
    create(cluster, "whole", memory=None)
    wait_for(lambda: said_unschedulable(cluster, "whole"), what="the pod said unschedulable")
    assert exists(cluster, "s1") and exists(cluster, "s2")
    assert not events(cluster, "Consolidating") and not events(cluster, "ConsolidationBlocked")


def test_consolidation_is_off_by_default(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    controller()
    spread(cluster)
    create(cluster, "whole", memory=None)
    wait_for(lambda: said_unschedulable(cluster, "whole"), what="the pod said unschedulable")
    assert exists(cluster, "s1") and exists(cluster, "s2")
    assert not events(cluster, "Consolidating")


@pytest.mark.parametrize("namespace_label", [True])
def test_a_namespace_label_opts_its_pods_in(
    cluster: Cluster, controller: Callable[..., RunningController], namespace_label: bool
) -> None:
    core = client.CoreV1Api(cluster.api_client)
    core.patch_namespace(NAMESPACE, {"metadata": {"labels": {"fractional.dev/movable": "true"}}})
    controller(**SETTINGS)
    spread(cluster, labels={"app": "shares"})
    create(cluster, "whole", memory=None)
    wait_for(lambda: not exists(cluster, "s1") or not exists(cluster, "s2"), what="one share moved")
    wait_for(lambda: placed(cluster, "whole"), what="the whole-GPU pod placed")


def deployment(
    cluster: Cluster, name: str, *, max_surge: Any = 1, max_unavailable: Any = 0
) -> dict[str, Any]:
    """A Deployment of one replica and its ReplicaSet, as stored objects (nothing reconciles them
    here: the test plays their controllers). Returns the ReplicaSet's controller reference."""
    apps = client.AppsV1Api(cluster.api_client)
    container = {"name": "main", "image": "registry.k8s.io/pause:3.10"}
    template = {"metadata": {"labels": {"app": name}}, "spec": {"containers": [container]}}
    stored = apps.create_namespaced_deployment(NAMESPACE, {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}}, "template": template,
                 "strategy": {"type": "RollingUpdate",
                              "rollingUpdate": {"maxSurge": max_surge, "maxUnavailable": max_unavailable}}},
    }, _preload_content=False)  # fmt: skip
    owner = json.loads(stored.data)["metadata"]
    replica_set = apps.create_namespaced_replica_set(NAMESPACE, {
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {"name": f"{name}-1", "ownerReferences": [{
            "apiVersion": "apps/v1", "kind": "Deployment", "name": name, "uid": owner["uid"],
            "controller": True}]},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}}, "template": template},
    }, _preload_content=False)  # fmt: skip
    meta = json.loads(replica_set.data)["metadata"]
    return {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": meta["name"], "uid": meta["uid"],
            "controller": True}  # fmt: skip


def test_a_single_replica_deployment_that_surges_is_replaced_before_its_pod_goes(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    """Make before break: no eviction; the Deployment's template gets our annotation (a rollout),
    its new pod (a new ReplicaSet's, known by that annotation) takes the room kept for it while the
    old pod still runs, and the whole-GPU pod is placed once the Deployment removed the old one."""
    controller(**SETTINGS)
    owners = {"s1": deployment(cluster, "one"), "s2": deployment(cluster, "two")}
    spread(cluster, owners=owners)
    create(cluster, "whole", memory=None)
    wait_for(lambda: events(cluster, "Consolidated"), what="a move begun")
    (moved_event,) = events(cluster, "Consolidated")
    moved = moved_event["involvedObject"]["name"]
    stays = "s2" if moved == "s1" else "s1"
    name = "one" if moved == "s1" else "two"
    assert "rolls out its replacement first (maxSurge 1)" in moved_event["message"]
    assert exists(cluster, moved) and not cluster.pod(moved)["metadata"].get("deletionTimestamp")
    apps = client.AppsV1Api(cluster.api_client)
    stored = json.loads(apps.read_namespaced_deployment(name, NAMESPACE, _preload_content=False).data)
    token = stored["spec"]["template"]["metadata"]["annotations"]["fractional.dev/replaces"]
    assert token == cluster.pod(moved)["metadata"]["uid"]
    freed = gpu_of(cluster, moved)
    # The Deployment controller's part: a new ReplicaSet's pod from the annotated template ...
    cluster.create_claim(gpu_claim("new-claim", memory="10Gi", compute=None))
    new = gated_pod("new", ["new-claim"])
    new["metadata"]["ownerReferences"] = [{**owners[moved], "name": f"{name}-2", "uid": f"{name}-2-uid"}]
    new["metadata"]["annotations"] = {"fractional.dev/replaces": token}
    cluster.create_pod(new)
    wait_for(lambda: placed(cluster, "new"), what="the new pod placed while the old one runs")
    assert gpu_of(cluster, "new") == gpu_of(cluster, stays)
    assert not cluster.allocated("whole-claim")
    # ... then, the new pod ready, the old one removed.
    start(cluster, "new")
    cluster.core.delete_namespaced_pod(moved, NAMESPACE)
    wait_for(lambda: placed(cluster, "whole"), what="the whole-GPU pod placed")
    assert gpu_of(cluster, "whole") == freed


def test_a_budget_that_allows_nothing_does_not_stop_a_deployment_that_replaces_its_pod_first(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    """A PodDisruptionBudget guards evictions. Make before break evicts nothing: the Deployment keeps
    its replica available until the new one is ready, as in a rollout, which no budget holds. So a
    budget that allows no disruption holds back an evicted move, not a rolled-out one."""
    controller(**SETTINGS)
    owners = {"s1": deployment(cluster, "one"), "s2": deployment(cluster, "two")}
    spread(cluster, owners=owners)
    budget(cluster, "shares", "shares", min_available=2, allowed=0)
    create(cluster, "whole", memory=None)
    wait_for(lambda: events(cluster, "Consolidated"), what="a move begun")
    (moved_event,) = events(cluster, "Consolidated")
    assert "rolls out its replacement first (maxSurge 1)" in moved_event["message"]
    moved = moved_event["involvedObject"]["name"]
    assert exists(cluster, moved) and not cluster.pod(moved)["metadata"].get("deletionTimestamp")
    assert not events(cluster, "ConsolidationBlocked")


def test_a_budget_that_allows_nothing_keeps_a_pod_whose_deployment_may_not_surge(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    controller(**SETTINGS)
    owners = {"s1": deployment(cluster, "one", max_surge=0, max_unavailable=1),
              "s2": deployment(cluster, "two", max_surge=0, max_unavailable=1)}  # fmt: skip
    spread(cluster, owners=owners)
    budget(cluster, "shares", "shares", min_available=2, allowed=0)
    create(cluster, "whole", memory=None)
    wait_for(lambda: events(cluster, "ConsolidationBlocked"), what="the refusal said")
    assert "2 protected by a PodDisruptionBudget" in events(cluster, "ConsolidationBlocked")[0]["message"]
    assert exists(cluster, "s1") and exists(cluster, "s2") and not events(cluster, "Consolidated")


def test_a_deployment_that_may_not_surge_is_evicted(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    controller(**SETTINGS)
    owners = {"s1": deployment(cluster, "one", max_surge=0, max_unavailable=1),
              "s2": deployment(cluster, "two", max_surge="0%", max_unavailable="100%")}  # fmt: skip
    spread(cluster, owners=owners)
    create(cluster, "whole", memory=None)
    wait_for(lambda: not exists(cluster, "s1") or not exists(cluster, "s2"), what="one share evicted")
    # The Event follows the eviction: the pod can be gone a moment before it is written.
    wait_for(lambda: events(cluster, "Consolidated"), what="the Consolidated Event")
    assert "evicted; its owner makes the replacement" in events(cluster, "Consolidated")[0]["message"]


def test_pods_that_reach_the_minimum_runtime_are_moved_when_the_backoff_runs_out(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    """Nothing about the gang or the capacity changes while the shares age: the end of the
    consolidation's backoff alone decides the gang again (seen on 1.37.2: it waited forever)."""
    controller(**{**SETTINGS, "consolidation_retry_seconds": 1.0})
    spread(cluster, ago=55.0)
    create(cluster, "whole", memory=None)
    wait_for(lambda: events(cluster, "ConsolidationBlocked"), what="the refusal said")
    assert "below the minimum runtime" in events(cluster, "ConsolidationBlocked")[0]["message"]
    wait_for(lambda: not exists(cluster, "s1") or not exists(cluster, "s2"), what="one share moved")
    wait_for(lambda: placed(cluster, "whole"), what="the whole-GPU pod placed")


def test_the_scheduled_pass_frees_a_gpu_by_moving_a_share_beside_the_other(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    """No pod waits: with stranded memory past the threshold, the pass empties the GPU with the
    fewest pods onto another partly used GPU (never onto a free one), with room kept for the
    replacement. The shares are spread by a controller without the pass, then it takes over."""
    setup = controller()
    spread(cluster)
    setup.shutdown()
    controller(**SETTINGS, consolidation_schedule=True, consolidation_schedule_stranded_ratio=0.2,
               consolidation_schedule_interval_seconds=1.0)  # fmt: skip
    wait_for(lambda: not exists(cluster, "s1") or not exists(cluster, "s2"), what="one share moved")
    wait_for(lambda: events(cluster, "Consolidated"), what="the move said")
    (moved_event,) = events(cluster, "Consolidated")
    assert "in a scheduled consolidation, to free a whole GPU" in moved_event["message"]
    moved = moved_event["involvedObject"]["name"]
    stays = "s2" if moved == "s1" else "s1"
    replace(cluster, "s3")
    wait_for(lambda: placed(cluster, "s3"), what="the replacement placed")
    assert gpu_of(cluster, "s3") == gpu_of(cluster, stays)
    create(cluster, "whole", memory=None)  # the freed GPU takes a whole-GPU pod, no move needed
    wait_for(lambda: placed(cluster, "whole"), what="the whole-GPU pod placed")
    assert len(events(cluster, "Consolidated")) == 1


def test_the_scheduled_pass_waits_for_its_window(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    setup = controller()
    spread(cluster)
    setup.shutdown()
    now = datetime.now(UTC)
    start_at, end_at = now + timedelta(hours=2), now + timedelta(hours=3)
    window = f"{start_at:%H:%M}-{end_at:%H:%M}"
    schedule = {
        "consolidation_schedule": True, "consolidation_schedule_stranded_ratio": 0.2,
        "consolidation_schedule_interval_seconds": 1.0, "consolidation_schedule_window": window,
    }  # fmt: skip
    running = controller(**SETTINGS, **schedule)
    time.sleep(5)  # two metrics refreshes (2 s each) that would have started the pass
    assert running.thread.is_alive()
    assert exists(cluster, "s1") and exists(cluster, "s2") and not events(cluster, "Consolidated")

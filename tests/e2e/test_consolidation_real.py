"""Consolidation on the real components: a Deployment of two 10Gi shares left on two GPUs of the
a100-pcie-4x node by churn, the node's other two GPUs taken whole, and a whole-GPU pod of the same
priority that fits only once one share moves beside the other. kube-apiserver's Eviction API (and its
PodDisruptionBudgets), the real ReplicaSet and Deployment controllers making the replacements, the
chart's policies on the controller's writes.

The chart runs with ``controller.consolidation`` on (minimum runtime 45 s, no cooldown, retried after
5 s) for this module, then back to its defaults.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from e2e_support import IMAGE, LOCAL_CLUSTER, REPO_ROOT, apply, get, kubectl, list_items, wait_for
from test_driver import gpu_request, template

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not LOCAL_CLUSTER, reason="the chart's values are the local cluster harness's"),
]

NODE_PROFILE = {"fractional.dev/fake-profile": "a100-pcie-4x"}
MIN_RUNTIME = 45
MOVABLE = {"fractional.dev/movable": "true"}


@pytest.fixture(scope="module")
def consolidating(real_cluster: None) -> Iterator[None]:
    import sys

    sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "hack")]
    from localcluster.cluster import LocalCluster
    from localcluster.driver import upgrade_driver

    local = LocalCluster()
    # Retried every 5 s, doubling: a plan comes soon after the shares reach the minimum runtime.
    settings = {"enabled": True, "minRuntimeSeconds": MIN_RUNTIME, "cooldownSeconds": 0, "retrySeconds": 5}
    upgrade_driver(local, controller={"consolidation": settings})
    kubectl("rollout", "status", "deployment", "-n", "fractional-system", "-l",
            "app.kubernetes.io/component=controller", "--timeout=300s", timeout=320)  # fmt: skip
    try:
        yield
    finally:
        upgrade_driver(local)


@pytest.fixture
def room(consolidating: None, user_namespace: str) -> str:
    """The namespace, once nothing else holds a device of the a100 node (other tests' namespaces are
    deleted without waiting)."""
    (node,) = [
        n["metadata"]["name"] for n in list_items("nodes", "-l", "fractional.dev/fake-profile=a100-pcie-4x")
    ]

    def free() -> bool:
        return not any(
            (c.get("status") or {}).get("allocation")
            and any(r["pool"] == node for r in c["status"]["allocation"]["devices"]["results"])
            for c in list_items("resourceclaims", "--all-namespaces")
        )

    wait_for(free, timeout=300, what="the a100 node's GPUs free")
    return user_namespace


def _pod(name: str, claim_template: str, *, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": dict(labels or {})},
        "spec": {
            "terminationGracePeriodSeconds": 1, "nodeSelector": NODE_PROFILE,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": claim_template}],
            "containers": [{"name": "main", "image": IMAGE, "command": ["sh", "-c", "exec sleep 3600"],
                            "resources": {"claims": [{"name": "gpu"}]}}],
        },
    }  # fmt: skip


def _deployment(name: str, *, replicas: int, surge: int = 1, unavailable: int = 0) -> dict[str, Any]:
    body = _pod(name, "share", labels={"app": name, **MOVABLE})
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                 "strategy": {"type": "RollingUpdate",
                              "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}},
                 "template": {"metadata": body["metadata"], "spec": body["spec"]}},
    }  # fmt: skip


def _running(namespace: str, selector: str) -> list[dict[str, Any]]:
    pods = list_items("pods", "-n", namespace, "-l", selector)
    return [
        p for p in pods
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
    ]  # fmt: skip


def _gpu(pod: dict[str, Any], namespace: str) -> str:
    """The device of the pod's claim (made from its template, named in its status)."""
    (entry,) = get("pod", pod["metadata"]["name"], namespace)["status"]["resourceClaimStatuses"]
    claim = get("resourceclaim", entry["resourceClaimName"], namespace)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    return str(result["device"])


def _spread(namespace: str, deployments: list[dict[str, Any]]) -> dict[str, str]:
    """The shares (one per entry of ``deployments``'s replicas, in order) on two GPUs of the node,
    its other two GPUs taken whole. Returns pod name -> GPU of the shares."""
    apply([template("share", [gpu_request(memory="10Gi")]), template("filler", [gpu_request(memory="29Gi")]),
           template("whole", [gpu_request()])], namespace)  # fmt: skip
    first, *rest = deployments
    apply([first], namespace)
    wait_for(lambda: len(_running(namespace, f"app={first['metadata']['name']}")) == 1, timeout=180,
             what="the first share running")  # fmt: skip
    apply([_pod("filler", "filler", labels={"app": "filler"})], namespace)  # 39Gi on one GPU: full
    wait_for(lambda: _running(namespace, "app=filler"), timeout=180, what="the filler running")
    if rest:
        apply(rest, namespace)
    else:
        kubectl("scale", "deployment", first["metadata"]["name"], "-n", namespace, "--replicas=2")
    wait_for(lambda: len(_running(namespace, "fractional.dev/movable=true")) == 2, timeout=180,
             what="the second share running")  # fmt: skip
    kubectl("delete", "pod", "filler", "-n", namespace, "--wait=true", timeout=120)
    apply([_pod("w1", "whole", labels={"app": "whole"}), _pod("w2", "whole", labels={"app": "whole"})],
          namespace)  # fmt: skip
    wait_for(lambda: len(_running(namespace, "app=whole")) == 2, timeout=180, what="two whole GPUs taken")
    shares = {
        p["metadata"]["name"]: _gpu(p, namespace) for p in _running(namespace, "fractional.dev/movable=true")
    }
    assert len(set(shares.values())) == 2, shares
    return shares


def _events(namespace: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in list_items("events", "-n", namespace) if e.get("reason") == reason]


def _age(pod: dict[str, Any]) -> float:
    started = datetime.fromisoformat(pod["status"]["startTime"].replace("Z", "+00:00"))
    return time.time() - started.timestamp()


def test_a_share_of_a_deployment_moves_beside_the_other_and_the_whole_gpu_pod_runs(room: str) -> None:
    """Also: while the shares are younger than the minimum runtime nothing moves, and an Event on
    the waiting pod says why."""
    namespace = room
    shares = _spread(namespace, [_deployment("shares", replicas=1)])
    apply([_pod("big", "whole", labels={"app": "big"})], namespace)
    if min(_age(p) for p in _running(namespace, "app=shares")) < MIN_RUNTIME - 10:
        blocked = wait_for(lambda: _events(namespace, "ConsolidationBlocked"), timeout=60,
                           what="the refusal said")  # fmt: skip
        assert "below the minimum runtime" in blocked[0]["message"], blocked[0]
        assert set(shares) == {p["metadata"]["name"] for p in _running(namespace, "app=shares")}
    wait_for(lambda: _running(namespace, "app=big"), timeout=300, what="the whole-GPU pod running")
    (moved_event,) = _events(namespace, "Consolidated")
    moved = moved_event["involvedObject"]["name"]
    assert "evicted; its owner makes the replacement" in moved_event["message"], moved_event
    (consolidating,) = _events(namespace, "Consolidating")
    assert consolidating["involvedObject"]["name"] == "big"
    (stays,) = [name for name in shares if name != moved]
    assert _gpu(get("pod", "big", namespace), namespace) == shares[moved]
    wait_for(lambda: len(_running(namespace, "app=shares")) == 2, timeout=180, what="the replacement running")
    now = {p["metadata"]["name"]: _gpu(p, namespace) for p in _running(namespace, "app=shares")}
    (replacement,) = set(now) - set(shares)
    assert now[replacement] == now[stays] == shares[stays]  # beside the share that stayed: its room kept


def test_a_budget_that_allows_no_disruption_keeps_every_share(room: str) -> None:
    namespace = room
    _spread(namespace, [_deployment("shares", replicas=1)])
    budget = {"minAvailable": 2, "selector": {"matchLabels": {"app": "shares"}}}
    apply([{"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "shares"},
            "spec": budget}], namespace)  # fmt: skip
    wait_for(lambda: get("pdb", "shares", namespace).get("status", {}).get("currentHealthy") == 2, timeout=60,
             what="the disruption controller's count")  # fmt: skip
    apply([_pod("big", "whole", labels={"app": "big"})], namespace)

    def budget_said() -> bool:
        return any("PodDisruptionBudget" in e["message"] for e in _events(namespace, "ConsolidationBlocked"))

    wait_for(budget_said, timeout=240, what="the budget named")
    assert not _events(namespace, "Consolidated")
    assert len(_running(namespace, "app=shares")) == 2
    assert get("pod", "big", namespace)["status"].get("phase") == "Pending"


def test_a_one_replica_deployment_that_surges_is_replaced_before_its_pod_goes(room: str) -> None:
    """Make before break: the controller only annotates the Deployment's pod template; the
    Deployment controller starts the new pod (placed on the room kept for it), then removes the old
    one, so the Deployment never has less than one available replica. A PodDisruptionBudget that
    allows no disruption of the shares does not hold it back: nothing is evicted."""
    namespace = room
    shares = _spread(namespace, [_deployment("one", replicas=1), _deployment("two", replicas=1)])
    budget = {"minAvailable": 2, "selector": {"matchLabels": MOVABLE}}
    apply([{"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "shares"},
            "spec": budget}], namespace)  # fmt: skip
    wait_for(lambda: get("pdb", "shares", namespace).get("status", {}).get("currentHealthy") == 2, timeout=60,
             what="the disruption controller's count")  # fmt: skip
    assert get("pdb", "shares", namespace)["status"].get("disruptionsAllowed") == 0
    apply([_pod("big", "whole", labels={"app": "big"})], namespace)
    lowest = 1
    deadline = time.monotonic() + 360
    while not _running(namespace, "app=big"):
        assert time.monotonic() < deadline, "the whole-GPU pod never ran"
        for name in ("one", "two"):
            status = get("deployment", name, namespace).get("status", {})
            lowest = min(lowest, int(status.get("availableReplicas") or 0))
        time.sleep(1)
    assert lowest == 1, "a Deployment had no available replica during the move"
    (moved_event,) = _events(namespace, "Consolidated")
    assert "rolls out its replacement first (maxSurge 1)" in moved_event["message"], moved_event
    moved = moved_event["involvedObject"]["name"]
    assert _gpu(get("pod", "big", namespace), namespace) == shares[moved]
    after = {
        p["metadata"]["name"]: _gpu(p, namespace) for p in _running(namespace, "fractional.dev/movable=true")
    }
    assert moved not in after and len(after) == 2 and len(set(after.values())) == 1, after

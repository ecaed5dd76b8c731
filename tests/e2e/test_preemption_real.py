"""Priority preemption with the real machinery: PriorityClasses, evictions through ``pods/eviction``
(so kube-apiserver enforces PodDisruptionBudgets), the ``DisruptionTarget`` condition and the
``Preempted`` Events, on a full cluster; and kube-scheduler's own handling of an ungated
high-priority pod beside ours, which must not make the two evict more than the preemptors need.

What kube-scheduler 1.37 does for the ungated pod is recorded in ``.cluster/preemption.json``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from e2e_support import (
    AUTO_GATE_LABEL,
    REPO_ROOT,
    KubectlError,
    apply,
    get,
    kubectl,
    list_items,
    pod,
    wait_for,
)
from test_driver import POD_START_SECONDS, gpu_request, running, template

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

LOW, HIGH = "e2e-low", "e2e-high"
GATE = "fractional.dev/allocation"
RESULTS = REPO_ROOT / ".cluster" / "preemption.json"
# Victims ignore SIGTERM for a while, so that their DisruptionTarget condition can be read.
STUBBORN = "trap '' TERM; while true; do sleep 1; done"


def _priority_classes() -> None:
    for name, value in ((LOW, 100), (HIGH, 100000)):
        body = {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": name},
            "value": value,
            "preemptionPolicy": "PreemptLowerPriority",
        }
        try:
            kubectl("create", "-f", "-", stdin=json.dumps(body))
        except KubectlError as error:
            if "AlreadyExists" not in str(error) and "already exists" not in str(error):
                raise


def _whole_gpu_pod(name: str, priority: str, *, gated: bool, labels: dict[str, str] | None = None,
                   command: str = "exec sleep 3600", grace: int = 1) -> list[dict[str, Any]]:  # fmt: skip
    body = pod(name, {"gpu": {"resourceClaimTemplateName": name}}, command=command)
    body["metadata"]["labels"] = dict(labels or {})
    body["spec"]["priorityClassName"] = priority
    body["spec"]["terminationGracePeriodSeconds"] = grace
    if gated:
        body["spec"]["schedulingGates"] = [{"name": GATE}]
    else:
        body["metadata"]["labels"][AUTO_GATE_LABEL] = "disabled"
    return [template(name, [gpu_request(count=1)]), body]


def _gpu_count() -> int:
    slices = list_items("resourceslices", "--field-selector", "spec.driver=fractional.dev")
    return sum(
        1 for s in slices for d in s["spec"].get("devices", []) if "memory" in (d.get("capacity") or {})
    )


def _fill(namespace: str) -> tuple[list[str], list[str]]:
    """Every GPU held by a low-priority pod: half of them under a budget that allows no disruption."""
    total = _gpu_count()
    keep = [f"keep-{i}" for i in range(total // 2)]
    spare = [f"spare-{i}" for i in range(total - len(keep))]
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "keep"},
            "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": "keep"}}},
        }
    ]
    for name in keep:
        objects += _whole_gpu_pod(name, LOW, gated=True, labels={"app": "keep"})
    for name in spare:
        objects += _whole_gpu_pod(name, LOW, gated=True, labels={"app": "spare"}, command=STUBBORN, grace=20)
    apply(objects, namespace)
    for name in keep + spare:
        wait_for(lambda n=name: running(n, namespace), timeout=POD_START_SECONDS, what=f"filler {name}")
    return keep, spare


def _conditions(name: str, namespace: str) -> dict[str, dict[str, Any]]:
    try:
        stored = get("pod", name, namespace)
    except KubectlError:
        return {}
    return {c["type"]: c for c in stored.get("status", {}).get("conditions", [])}


def _record(case: str, figures: Any) -> None:
    recorded: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    recorded[case] = figures
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(recorded, indent=2) + "\n", encoding="utf-8")


def _events(namespace: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in list_items("events", "-n", namespace) if e.get("reason") == reason]


def test_a_high_priority_gang_preempts_what_the_budget_allows(idle: str) -> None:
    namespace = idle
    _priority_classes()
    keep, spare = _fill(namespace)
    gang = [f"urgent-{i}" for i in range(2)]
    objects: list[dict[str, Any]] = []
    for name in gang:
        body = _whole_gpu_pod(name, HIGH, gated=True)
        body[1]["metadata"]["labels"] |= {"fractional.dev/gang": "urgent"}
        body[1]["metadata"]["annotations"] = {"fractional.dev/gang-size": "2"}
        objects += body
    apply(objects, namespace)

    reasons: dict[str, str] = {}

    def disrupted() -> list[str] | None:
        for name in spare:
            condition = _conditions(name, namespace).get("DisruptionTarget", {})
            if condition.get("status") == "True":
                reasons[name] = str(condition.get("reason"))
        return sorted(reasons) if len(reasons) >= len(gang) else None

    # The controller marks each victim PreemptionByScheduler, as kube-scheduler does, then evicts it
    # through pods/eviction; kube-apiserver's eviction sets the same condition type again with its own
    # reason, EvictionByEvictionAPI (recorded from 1.37.2), so a victim may show either.
    victims = wait_for(disrupted, timeout=180, what="DisruptionTarget on the victims", interval=0.5)
    assert set(reasons.values()) <= {"PreemptionByScheduler", "EvictionByEvictionAPI"}, reasons
    _record("victims' DisruptionTarget reasons", reasons)
    for name in gang:
        wait_for(lambda n=name: running(n, namespace), timeout=POD_START_SECONDS, what=f"preemptor {name}")
    preempted = {e["involvedObject"]["name"] for e in _events(namespace, "Preempted")}
    assert set(victims) <= preempted, (victims, preempted)
    assert len(preempted) == len(gang), f"evicted more than the gang needs: {sorted(preempted)}"
    assert all(running(name, namespace) for name in keep), "a pod under the budget was evicted"
    assert _events(namespace, "Preempting"), "the preemptor's Event naming its victims"


def test_kube_schedulers_ungated_preemptor_and_ours_do_not_fight(idle: str) -> None:
    """Recorded on 1.37.2: kube-scheduler does not preempt for DRA devices (its ungated pod waits
    with FailedScheduling), while ours evicts one pod. Before the allocation guard, kube-scheduler
    then allocated the GPU that eviction freed to its own waiting pod, as our controller did: both
    were booked on it, the node agent prepared the first and refused the second (ShareRefused).
    Now the guard holds the devices nominated to our preemptor against pods of lower or equal
    priority, as kube-scheduler does for its own nominated pods: kube-scheduler's write is refused
    and ours runs on the GPU it freed. What must hold: no eviction storm (one GPU wanted by each:
    at most two evicted), none under the budget, ours running, theirs waiting with a reason, and
    no device booked twice."""
    namespace = idle
    _priority_classes()
    keep, _ = _fill(namespace)
    apply(_whole_gpu_pod("theirs", HIGH, gated=False) + _whole_gpu_pod("ours", HIGH, gated=True), namespace)
    wait_for(lambda: _events(namespace, "Preempting"), timeout=180, what="our preemptor evicting")

    def reason_of(name: str) -> str | None:
        if running(name, namespace):
            return "running"
        said = [e["reason"] for e in list_items("events", "-n", namespace)
                if e["involvedObject"]["name"] == name and e.get("type") == "Warning"]  # fmt: skip
        return said[-1] if said else None

    outcomes = {
        name: wait_for(lambda n=name: reason_of(n), timeout=240, what=f"{name} running or told why")
        for name in ("ours", "theirs")
    }
    evicted = sorted({e["involvedObject"]["name"] for e in _events(namespace, "Preempted")})
    figures: dict[str, Any] = {"outcomes": outcomes, "evicted": evicted}
    figures["overcommitted"] = sorted(
        {e["involvedObject"]["name"] for e in _events(namespace, "DeviceOvercommitted")}
    )
    _record("kube-scheduler's ungated preemptor beside ours", figures)
    assert len(evicted) <= 2, figures
    assert not set(evicted) & set(keep), figures
    assert outcomes["ours"] == "running", figures
    assert not figures["overcommitted"], figures

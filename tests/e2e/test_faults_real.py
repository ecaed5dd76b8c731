"""Faults of the real control plane and of the nodes, on the local cluster (its harness kills one
component and starts it again in place: ``python hack/localcluster restart``).

Each case applies work (a burst of 20 shares, or a gang of 6), injects the fault at once, and then
checks the same invariants:
- every pod of the work runs (the cluster has room for all of it);
- no device is booked past its capacity, and no claim names one device twice;
- the gang ran whole;
- each node's CDI specs are exactly those of the claims prepared there (none leaked, none missing);
- no container of the driver restarted (the outages here are what a rolling upgrade of the control
  plane looks like; a replica that loses its lease stands down in place, it does not exit).

Recovery, for the record (not asserted: this machine is shared): from the fault's end (the
component answering again) until every pod of the work runs, with the same work without a fault as
the baseline, written to ``.cluster/fault-recovery.json``; ``bench/bench_faults.py`` runs this file
on a fresh cluster and reports it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from e2e_support import (
    LOCAL_CLUSTER,
    REPO_ROOT,
    apply,
    cdi_files,
    get,
    kubectl,
    list_items,
    node_key,
    pod,
    wait_for,
)
from test_driver import POD_START_SECONDS, _agent_pod, _ready, gpu_request, template
from test_leader_failover import LEASE, RELEASE_NAMESPACE, _gang
from test_two_allocators import _capacities, _Sampler

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not LOCAL_CLUSTER, reason="needs the local cluster's harness to kill a component"),
]

RESULTS = REPO_ROOT / ".cluster" / "fault-recovery.json"
BURST = 20
GANG = 6
NODE = "198.18.0.2"  # the h100-8x node


# -- faults ---------------------------------------------------------------------------------------------


# kube-scheduler's and kube-controller-manager's renew deadline (client-go's default, and theirs).
UPSTREAM_RENEW_DEADLINE_SECONDS = 10.0


def _restart(component: str, down: float, *, signal: str = "KILL") -> float:
    """Kill ``component`` with ``signal`` (KILL: a crash), keep it down ``down`` seconds, start it
    again; returns when it answers its health check again (time.monotonic())."""
    subprocess.run(
        [sys.executable, "hack/localcluster", "restart", component, "--down", str(down), "--signal", signal],
        cwd=REPO_ROOT, check=True, timeout=240,
    )  # fmt: skip
    return time.monotonic()


def _outage(component: str, down: float) -> float:
    """A control-plane outage as a real control plane has it. The local cluster runs kube-scheduler
    and kube-controller-manager without leader election (one of each); a real one runs them with it,
    and each exits when it cannot renew its lease within 10 s, to be restarted by its kubelet. So
    after an outage that long they are restarted here too: kept running instead, kube-scheduler once
    kept devices in use in its own view after such outages (a pod handed to it later stayed
    "cannot allocate all claims" beside free GPUs until it was restarted)."""
    started = time.monotonic()
    end = _restart(component, down)
    if end - started > UPSTREAM_RENEW_DEADLINE_SECONDS:
        for lost_its_lease in ("kube-scheduler", "kube-controller-manager"):
            _restart(lost_its_lease, 0, signal="TERM")
    return end


def _delete_leader() -> float:
    leader = str(get("lease", LEASE, RELEASE_NAMESPACE)["spec"].get("holderIdentity") or "")
    assert leader, "no controller replica holds the lease"
    kubectl("delete", "pod", "-n", RELEASE_NAMESPACE, leader, "--grace-period=0", "--force")
    return time.monotonic()


# -- work -----------------------------------------------------------------------------------------------


def _burst(namespace: str, count: int = BURST, *, node: str | None = None, prefix: str = "s") -> list[str]:
    """``count`` pods of a small share each (one template), applied at once."""
    names = [f"{prefix}-{i}" for i in range(count)]
    objects = [template("share", [gpu_request(memory="2Gi", compute="5")])]
    objects += [pod(name, {"gpu": {"resourceClaimTemplateName": "share"}}, node=node) for name in names]
    apply(objects, namespace)
    return names


def _progress(names: list[str], namespace: str) -> tuple[bool, bool]:
    """(every pod bound to a node, every pod running)."""
    pods = {p["metadata"]["name"]: p for p in list_items("pods", "-n", namespace)}
    bound = running = True
    for name in names:
        item = pods.get(name) or {}
        phase = item.get("status", {}).get("phase")
        assert phase not in ("Failed", "Succeeded"), f"pod {namespace}/{name} ended: {phase}"
        bound = bound and bool(item.get("spec", {}).get("nodeName"))
        running = running and phase == "Running"
    return bound, running


def _all_running(names: list[str], namespace: str) -> bool:
    return _progress(names, namespace)[1]


def _wait_recorded(case: str, names: list[str], namespace: str, end: float) -> None:
    """Until every pod runs; records the seconds from ``end`` until every pod was bound (the
    controller's and kube-scheduler's part) and until every pod ran (the kubelets' part too)."""
    bound_at: list[float] = []

    def done() -> bool:
        bound, running = _progress(names, namespace)
        if bound and not bound_at:
            bound_at.append(time.monotonic())
        return running

    wait_for(done, timeout=POD_START_SECONDS, what=f"{case}: every pod running", interval=0.5)
    _record(case, time.monotonic() - end, (bound_at or [time.monotonic()])[0] - end, len(names))


# -- invariants -----------------------------------------------------------------------------------------


def _driver_restarts() -> dict[str, int]:
    """restartCount per container of the driver's pods (deleted pods excluded)."""
    counts = {}
    for item in list_items("pods", "-n", RELEASE_NAMESPACE):
        if item["metadata"].get("deletionTimestamp"):
            continue
        for status in item.get("status", {}).get("containerStatuses", []):
            counts[f"{item['metadata']['name']}/{status['name']}"] = int(status.get("restartCount", 0))
    return counts


def _prepared_claims() -> dict[str, set[str]]:
    """Node -> UIDs of our claims reserved for a pod bound there (what the kubelet has prepared).
    Bound, not only reserved: the controller reserves a claim for its one pod in the write of the
    allocation, before the pod is bound (a pod still gated or pending has nothing prepared)."""
    bound = {
        (p["metadata"]["namespace"], p["metadata"]["uid"])
        for p in list_items("pods", "--all-namespaces")
        if (p.get("spec") or {}).get("nodeName")
    }
    nodes: dict[str, set[str]] = {}
    for claim in list_items("resourceclaims", "--all-namespaces"):
        status = claim.get("status") or {}
        allocation = status.get("allocation")
        namespace = claim["metadata"]["namespace"]
        reserved = {(namespace, r.get("uid")) for r in status.get("reservedFor") or ()}
        if not allocation or not reserved & bound:
            continue
        for term in (allocation.get("nodeSelector") or {}).get("nodeSelectorTerms", []):
            for field in term.get("matchFields", []) + term.get("matchExpressions", []):
                if field.get("key") in ("metadata.name", "kubernetes.io/hostname"):
                    for node in field.get("values", []):
                        nodes.setdefault(node, set()).add(claim["metadata"]["uid"])
    return nodes


def _cdi_uids(node: str) -> set[str]:
    return {name.rsplit("_", 1)[-1].removesuffix(".json") for name in cdi_files(node)}


def _check_invariants(names: list[str], namespace: str, restarts_before: dict[str, int]) -> None:
    booked = _Sampler(_capacities(), namespace)
    booked.sample()  # every claim in the cluster, once
    assert not booked.over, f"devices booked past capacity: {booked.over}"
    assert not booked.doubled, f"claims naming one device twice: {booked.doubled}"
    assert _all_running(names, namespace), "a pod of the work is not running"
    nodes = [n["metadata"]["name"] for n in list_items("nodes")]

    def cdi_matches() -> bool:
        prepared = _prepared_claims()
        return all(_cdi_uids(node) == prepared.get(node, set()) for node in nodes)

    # Other tests' namespaces are deleted without waiting: their claims' specs go as they are unprepared.
    wait_for(cdi_matches, timeout=120, what="each node's CDI specs to match the claims prepared there")
    after = _driver_restarts()
    restarted = {name: (restarts_before[name], count) for name, count in after.items()
                 if name in restarts_before and count != restarts_before[name]}  # fmt: skip
    assert not restarted, f"driver containers restarted (before, after): {restarted}"


def _record(case: str, running: float, bound: float, pods: int) -> None:
    results: dict[str, Any] = json.loads(RESULTS.read_text(encoding="utf-8")) if RESULTS.exists() else {}
    results[case] = {"seconds_to_all_running": round(running, 2), "seconds_to_all_bound": round(bound, 2),
                     "pods": pods}  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _settled(namespace: str) -> None:
    """Until kube-controller-manager has made the namespace's default ServiceAccount: after a
    kube-apiserver restart its watches are refused for a moment (RBAC not loaded yet) and back off for
    up to a minute, and until then no pod can be created in a new namespace."""
    wait_for(
        lambda: get("serviceaccount", "default", namespace), timeout=180,
        what=f"the ServiceAccount {namespace}/default (kube-controller-manager caught up)",
    )  # fmt: skip


def _run(
    case: str, namespace: str, work: Callable[[str], list[str]], fault: Callable[[], float] | None
) -> None:
    _settled(namespace)
    before = _driver_restarts()
    names = work(namespace)
    end = fault() if fault is not None else time.monotonic()
    _wait_recorded(case, names, namespace, end)
    _check_invariants(names, namespace, before)


def _gang_work(namespace: str) -> list[str]:
    return _gang(namespace, "g", GANG)


# -- the cases ------------------------------------------------------------------------------------------

FAULTS: dict[str, Callable[[], float] | None] = {
    "none": None,
    "kube-apiserver-3s": lambda: _outage("kube-apiserver", 3),
    "kube-apiserver-15s": lambda: _outage("kube-apiserver", 15),
    "etcd-5s": lambda: _outage("etcd", 5),
    "leader-pod-deleted": _delete_leader,
}


@pytest.mark.parametrize("fault", ["none", "kube-apiserver-3s", "kube-apiserver-15s", "etcd-5s"])
def test_a_burst_of_shares_rides_out_a_control_plane_fault(user_namespace: str, fault: str) -> None:
    _run(f"shares/{fault}", user_namespace, _burst, FAULTS[fault])


@pytest.mark.parametrize("fault", ["none", "kube-apiserver-3s", "kube-apiserver-15s", "leader-pod-deleted"])
def test_a_gang_commit_rides_out_a_control_plane_fault(user_namespace: str, fault: str) -> None:
    _run(f"gang/{fault}", user_namespace, _gang_work, FAULTS[fault])


@pytest.mark.parametrize("process", ["kubelet", "containerd"])
def test_running_shares_survive_a_restart_of_their_nodes(user_namespace: str, process: str) -> None:
    """The shares keep running (the same containers), the plugin registers again with the new
    kubelet, no live claim is unprepared, and a new share on the node is prepared afterwards."""
    _settled(user_namespace)
    names = _burst(user_namespace, 4, node=NODE)
    wait_for(
        lambda: _all_running(names, user_namespace), timeout=POD_START_SECONDS, what="the shares running"
    )
    containers = {name: _container_id(name, user_namespace) for name in names}
    # Only this case's claims: other cases' namespaces are deleted without waiting, and their
    # claims' CDI specs go, rightly, when their pods finish terminating, which a kubelet restart
    # may well hasten (seen twice in a full make e2e run: four other claims' specs gone).
    live = {c["metadata"]["uid"] for c in list_items("resourceclaims", "-n", user_namespace)}
    assert len(live) == len(names) and live <= _cdi_uids(NODE), "a share's CDI spec is missing before"
    before = _driver_restarts()
    agent = _agent_pod(NODE)["metadata"]["name"]
    _restart(f"{node_key(NODE)}-{process}", 3)
    wait_for(
        lambda: _ready(get("node", NODE)),
        timeout=120,
        what=f"node {NODE} Ready after its {process} restarted",
    )
    assert {name: _container_id(name, user_namespace) for name in names} == containers, (
        "a share's container changed"
    )
    # A spec the agent rewrites is absent for a moment; one that stays gone was unprepared. Twice in
    # one make e2e run (1.37.2, 2026-12-06) three or four of the four were gone at this point, never
    # in isolation since: the agent's log then says which path removed them.
    gone = live - _cdi_uids(NODE)
    if gone:
        print(f"\nCDI specs of live claims missing right after the {process} restart: {sorted(gone)}")
        wait_for(lambda: not (live - _cdi_uids(NODE)) or None, timeout=30, interval=1.0,
                 what=f"the CDI specs of live claims {sorted(live - _cdi_uids(NODE))} (agent log: "
                      f"{kubectl('logs', '-n', RELEASE_NAMESPACE, agent, '--tail=60')[-6000:]})")  # fmt: skip
    later = _burst(user_namespace, 1, node=NODE, prefix="after")
    every = names + later
    wait_for(
        lambda: _all_running(every, user_namespace), timeout=POD_START_SECONDS, what="a new share on the node"
    )
    assert _agent_pod(NODE)["metadata"]["name"] == agent, "the agent's pod was replaced"
    _check_invariants(every, user_namespace, before)


def test_shares_being_prepared_when_their_nodes_agent_is_deleted_all_run(user_namespace: str) -> None:
    _settled(user_namespace)
    before = _driver_restarts()
    agent = _agent_pod(NODE)["metadata"]["name"]
    names = _burst(user_namespace, 10, node=NODE)
    time.sleep(1.0)  # the first of them reach the kubelet
    kubectl("delete", "pod", "-n", RELEASE_NAMESPACE, agent, "--grace-period=0", "--force")
    _wait_recorded("shares-on-one-node/agent-pod-deleted", names, user_namespace, time.monotonic())
    _check_invariants(names, user_namespace, before)


def _container_id(name: str, namespace: str) -> tuple[str, int]:
    (status,) = get("pod", name, namespace)["status"]["containerStatuses"]
    return str(status.get("containerID")), int(status.get("restartCount", 0))

"""Leader election with the chart's two controller replicas on a real cluster: when the leader's
pod goes (deleted, or its process killed outright), the other replica takes the Lease and places
the gangs that arrived meanwhile, all or nothing.

The failover times are written to ``.cluster/leader-failover.json`` for the record: from the
leader's end to the Lease naming the other replica, to the allocation guard's EndpointSlice naming
it, and to the first gang placed after it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from e2e_support import LOCAL_CLUSTER, REPO_ROOT, apply, get, kubectl, list_items, pod, wait_for
from test_driver import POD_START_SECONDS, gpu_request, running, template

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

RELEASE_NAMESPACE = "fractional-system"
LEASE = "fractional-dra-controller"
GUARD_SERVICE = "fractional-dra-controller-allocation-guard"
GATE = "fractional.dev/allocation"
RESULTS = REPO_ROOT / ".cluster" / "leader-failover.json"


def _holder() -> str:
    return str(get("lease", LEASE, RELEASE_NAMESPACE)["spec"].get("holderIdentity") or "")


def _controller_pods() -> list[str]:
    pods = list_items("pods", "-n", RELEASE_NAMESPACE, "-l", "app.kubernetes.io/component=controller")
    return sorted(
        p["metadata"]["name"]
        for p in pods
        if not p["metadata"].get("deletionTimestamp") and p.get("status", {}).get("phase") == "Running"
    )


def _gang(namespace: str, gang: str, size: int) -> list[str]:
    objects: list[dict[str, Any]] = []
    names = [f"{gang}-{i}" for i in range(size)]
    for name in names:
        objects += [
            template(name, [gpu_request(memory="4Gi", compute="5")]),
            pod(name, {"gpu": {"resourceClaimTemplateName": name}}, gang=(gang, size)),
        ]
    apply(objects, namespace)
    return names


def _ungated(names: list[str], namespace: str) -> int:
    return sum(
        1
        for name in names
        if GATE not in [g["name"] for g in get("pod", name, namespace)["spec"].get("schedulingGates", [])]
    )


def controller_rolled_out() -> None:
    """Wait until no rolling update of the controller is under way. A module before may have left
    one going: helm's wait returned with one old replica still running. The Lease then moves to a
    new replica while the next module runs, and the new leader's allocation guard answers 503
    ("starting") until its view is synced: seen in make e2e after the Kueue cases (an old replica
    taken for the standby here) and in test_policies_real (claim writes refused mid-module)."""
    if not list_items("deployments", "-n", RELEASE_NAMESPACE, "-l", "app.kubernetes.io/component=controller"):
        return
    kubectl("rollout", "status", "deployment", "-n", RELEASE_NAMESPACE, "-l",
            "app.kubernetes.io/component=controller", "--timeout=300s", timeout=320)  # fmt: skip


def _two_replicas_and_a_leader() -> tuple[str, str]:
    controller_rolled_out()
    pods = wait_for(lambda: _controller_pods() if len(_controller_pods()) == 2 else None, timeout=300,
                    what="two running controller replicas")  # fmt: skip
    leader = wait_for(lambda: _holder() if _holder() in pods else None, timeout=120, what="a leader")
    wait_for(lambda: _guard_endpoint() == leader, timeout=60, what="the allocation guard on the leader")
    (standby,) = [p for p in pods if p != leader]
    return leader, standby


def _process_of(pod_name: str) -> int:
    """The pid on this machine of the controller running in ``pod_name`` (local cluster only)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if f"FRACTIONAL_IDENTITY={pod_name}".encode() in environ and b"controller" in cmdline:
            return int(entry.name)
    raise AssertionError(f"no process of {pod_name} on this machine")


def _guard_endpoint() -> str | None:
    """The pod the allocation guard's Service points at (the leader writes its EndpointSlice)."""
    slices = list_items("endpointslices", "-n", RELEASE_NAMESPACE, "-l",
                        f"kubernetes.io/service-name={GUARD_SERVICE}")  # fmt: skip
    targets = [e.get("targetRef", {}).get("name") for s in slices for e in s.get("endpoints") or ()]
    return targets[0] if len(targets) == 1 else None


def _renewed_after(moment: datetime) -> bool:
    renewed = get("lease", LEASE, RELEASE_NAMESPACE)["spec"].get("renewTime")
    return bool(renewed) and datetime.fromisoformat(renewed.replace("Z", "+00:00")) > moment


def _failover(namespace: str, end_leader: str, gang: str) -> dict[str, float]:
    leader, standby = _two_replicas_and_a_leader()
    names = _gang(namespace, gang, 4)  # arrives while the leader goes away
    ended = datetime.now(UTC)
    started = time.monotonic()
    if end_leader == "kill":
        os.kill(_process_of(leader), signal.SIGKILL)
    else:
        kubectl("delete", "pod", leader, "-n", RELEASE_NAMESPACE, "--wait=false")
    half_placed: list[int] = []

    def led_again() -> bool:
        count = _ungated(names, namespace)
        if 0 < count < len(names):
            half_placed.append(count)
        # A deleted leader's successor is the standby. A killed one's may also be its own
        # container, restarted by the kubelet under the same identity (the pod name).
        successors = (standby,) if end_leader == "delete" else (standby, leader)
        return _holder() in successors and _renewed_after(ended)

    wait_for(led_again, timeout=120, what="a replica leading again", interval=0.5)
    lease_seconds = time.monotonic() - started
    new_holder = _holder()
    # The allocation guard follows the leader: its EndpointSlice names the new leader's pod.
    wait_for(lambda: _guard_endpoint() == new_holder, timeout=60, interval=0.5,
             what="the guard's endpoint on the new leader")  # fmt: skip
    guard_seconds = time.monotonic() - started
    for name in names:
        wait_for(lambda n=name: running(n, namespace), timeout=POD_START_SECONDS, what=f"gang pod {name}")
    placed_seconds = time.monotonic() - started
    assert _ungated(names, namespace) == len(names)
    return {
        "lease_taken_s": round(lease_seconds, 1),
        "gang_running_s": round(placed_seconds, 1),
        "allocation_guard_on_the_new_leader_s": round(guard_seconds, 1),
        "new_leader_is_the_standby": float(new_holder == standby),
        "samples_with_the_gang_half_ungated": float(len(half_placed)),
    }


def _record(case: str, figures: dict[str, float]) -> None:
    recorded: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    recorded[case] = figures
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(recorded, indent=2) + "\n", encoding="utf-8")


def test_the_standby_takes_over_when_the_leaders_pod_is_deleted(namespace: str) -> None:
    """A deleted pod stops cleanly: the leader releases the Lease, so the standby leads at once."""
    figures = _failover(namespace, "delete", "after-delete")
    _record("leader pod deleted", figures)


@pytest.mark.skipif(not LOCAL_CLUSTER, reason="kills the leader's process on this machine")
def test_the_standby_takes_over_when_the_leader_is_killed(namespace: str) -> None:
    """A killed leader releases nothing: the standby waits out the Lease (15 s), then leads; the
    kubelet restarts the killed container, which comes back as the standby."""
    figures = _failover(namespace, "kill", "after-kill")
    _record("leader process killed", figures)

"""Gangs from the real Workload/PodGroup API (``scheduling.k8s.io`` v1beta1 on 1.37 with
GenericWorkload on, v1alpha2 on 1.36), with kube-scheduler's own gang scheduling on as well: our
controller places the gang's claims all or nothing and removes its gates, then kube-scheduler's
gang cycle binds the group. The two never deadlock: every gang either runs whole or waits whole.

Cases: a gang across both nodes; one that cannot fit, held with its Event on the PodGroup;
``minCount`` below the gang's size; the kubernetes #138765 shape (a share and a whole GPU that a
greedy first pick strands); and one gang of ours beside one of kube-scheduler's alone on the same
GPUs. Needs the cluster's GPUs free: each case first waits for other tests' claims to go.
"""

from __future__ import annotations

from typing import Any

import pytest
from e2e_support import AUTO_GATE_LABEL, DRIVER, IMAGE, apply, get, kubectl, list_items, wait_for
from kubernetes.utils import parse_quantity
from test_driver import (
    GANG_DECISION_SECONDS,
    GIB,
    POD_START_SECONDS,
    attribute,
    gpu_request,
    our_results,
    our_slices,
    running,
    template,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

GROUP = "scheduling.k8s.io"
GATE = "fractional.dev/allocation"


@pytest.fixture(scope="module")
def podgroups(real_cluster: None) -> str:
    """The served PodGroup version (v1beta1 or v1alpha2), or skip."""
    served = kubectl("api-versions").split()
    for version in ("v1beta1", "v1alpha2"):
        if f"{GROUP}/{version}" in served:
            return version
    pytest.skip("this cluster serves no scheduling.k8s.io PodGroup API (GenericWorkload off or 1.35)")


def _podgroup(name: str, min_count: int, version: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{version}",
        "kind": "PodGroup",
        "metadata": {"name": name},
        "spec": {"schedulingPolicy": {"gang": {"minCount": min_count}}},
    }


def _member(name: str, group: str, request: dict[str, Any], *, gated: bool = True) -> list[dict[str, Any]]:
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "schedulingGroup": {"podGroupName": group},
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": name}],
            "containers": [
                {
                    "name": "main",
                    "image": IMAGE,
                    "command": ["sh", "-c", "exec sleep 3600"],
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }
    if gated:
        body["spec"]["schedulingGates"] = [{"name": GATE}]
    else:
        body["metadata"]["labels"] = {AUTO_GATE_LABEL: "disabled"}
    return [template(name, [request]), body]


def _gang(namespace: str, group: str, size: int, min_count: int, version: str, request: dict[str, Any],
          *, gated: bool = True) -> list[str]:  # fmt: skip
    names = [f"{group}-{i}" for i in range(size)]
    objects = [_podgroup(group, min_count, version)]
    for name in names:
        objects += _member(name, group, request, gated=gated)
    apply(objects, namespace)
    return names


def _node_of(name: str, namespace: str) -> str | None:
    node = get("pod", name, namespace)["spec"].get("nodeName")
    return str(node) if node else None


def _gated(name: str, namespace: str) -> bool:
    return GATE in [g["name"] for g in get("pod", name, namespace)["spec"].get("schedulingGates", [])]


def _allocated(name: str, namespace: str) -> bool:
    statuses = get("pod", name, namespace).get("status", {}).get("resourceClaimStatuses", [])
    return any(
        (get("resourceclaim", s["resourceClaimName"], namespace).get("status") or {}).get("allocation")
        for s in statuses
        if s.get("resourceClaimName")
    )


def test_a_gang_across_both_nodes_is_placed_whole(idle: str, podgroups: str) -> None:
    # Three pods of four whole GPUs: the h100 node holds two, the a100 node one.
    names = _gang(idle, "wide", 3, 3, podgroups, gpu_request(count=4))
    for name in names:
        wait_for(lambda n=name: running(n, idle), timeout=POD_START_SECONDS, what=f"gang pod {name}")
    nodes = {_node_of(name, idle) for name in names}
    assert len(nodes) == 2, nodes


def test_a_gang_that_cannot_fit_waits_whole_with_its_event_on_the_podgroup(idle: str, podgroups: str) -> None:
    names = _gang(idle, "huge", 3, 3, podgroups, gpu_request(count=8))

    def event_on_podgroup() -> dict[str, Any] | None:
        for event in list_items("events", "-n", idle):
            involved = event.get("involvedObject", {})
            if involved.get("kind") == "PodGroup" and involved.get("name") == "huge":
                return event
        return None

    event = wait_for(event_on_podgroup, timeout=GANG_DECISION_SECONDS, what="an Event on the PodGroup")
    assert event["type"] == "Warning" and event["reason"] == "GangUnschedulable", event
    for name in names:
        assert _gated(name, idle) and _node_of(name, idle) is None and not _allocated(name, idle)


def test_min_count_places_that_many_and_hands_the_rest_to_kube_scheduler(idle: str, podgroups: str) -> None:
    """Four pods of four whole GPUs on 12 GPUs, minCount 3: we place three. kube-scheduler binds no
    pod of the group while one carries a gate, so the fourth (no room) is handed to it ungated, with
    an Event, rather than held: then the three bind, and kube-scheduler places the fourth itself once
    room is freed."""
    names = _gang(idle, "most", 4, 3, podgroups, gpu_request(count=4))
    first = names[:3]
    for name in first:
        wait_for(lambda n=name: running(n, idle), timeout=POD_START_SECONDS, what=f"gang pod {name}")
    assert not _gated(names[3], idle) and not _allocated(names[3], idle)
    handed = [
        e
        for e in list_items("events", "-n", idle)
        if e.get("reason") == "HandedToKubeScheduler" and e["involvedObject"]["name"] == names[3]
    ]
    assert handed, "the Event saying the fourth went to kube-scheduler"
    kubectl("delete", "pod", first[0], "-n", idle, "--wait=true", timeout=120)
    wait_for(lambda: running(names[3], idle), timeout=POD_START_SECONDS, what="the fourth placed")
    assert all(running(name, idle) for name in first[1:])


def test_kubernetes_138765_a_share_and_a_whole_gpu_both_placed(idle: str, podgroups: str) -> None:
    """A 20 GiB share that may use an h100 X or an a100 Y, and a whole GPU that must be X. A greedy
    pick that gives the share X strands the whole GPU; the gang is placed with the share on Y."""
    devices = sorted(
        ((s["spec"]["nodeName"], d) for s in our_slices() for d in s["spec"].get("devices", [])),
        key=lambda entry: (entry[0], entry[1]["name"]),
    )
    gpus = [(node, d) for node, d in devices if "memory" in d.get("capacity", {})]
    big = next(d for _, d in gpus if _memory(d) >= 64 * GIB)  # an h100 (80 GiB)
    small = next(d for _, d in gpus if _memory(d) < 64 * GIB)  # an a100-pcie (40 GiB)
    x, y = attribute(big, "uuid"), attribute(small, "uuid")
    share = gpu_request(memory="20Gi", selectors=[f'device.attributes["{DRIVER}"].uuid in ["{x}", "{y}"]'])
    whole = gpu_request(selectors=[f'device.attributes["{DRIVER}"].uuid == "{x}"'])
    objects = [_podgroup("pair", 2, podgroups)]
    objects += _member("pair-share", "pair", share) + _member("pair-whole", "pair", whole)
    apply(objects, idle)
    chosen = {}
    for name in ("pair-share", "pair-whole"):
        wait_for(lambda n=name: running(n, idle), timeout=POD_START_SECONDS, what=f"pod {name}")
        (status,) = get("pod", name, idle)["status"]["resourceClaimStatuses"]
        allocation = get("resourceclaim", status["resourceClaimName"], idle)["status"]["allocation"]
        (result,) = our_results(allocation)
        chosen[name] = result["device"]
    assert chosen == {"pair-share": small["name"], "pair-whole": big["name"]}, (chosen, x, y)


def _memory(device: dict[str, Any]) -> float:
    return float(parse_quantity(device["capacity"]["memory"]["value"]))


def test_our_gang_and_kube_schedulers_gang_on_the_same_gpus_never_deadlock(idle: str, podgroups: str) -> None:
    """Our gang (gated) and kube-scheduler's (ungated, its own gang cycle), two pods of four whole
    GPUs each: 16 GPUs wanted, 12 there. Whatever runs, runs whole; what waits, waits whole."""
    ours = _gang(idle, "ours", 2, 2, podgroups, gpu_request(count=4))
    theirs = _gang(idle, "theirs", 2, 2, podgroups, gpu_request(count=4), gated=False)
    everyone = ours + theirs

    def decided() -> list[str] | None:
        bound = [n for n in everyone if _node_of(n, idle)]
        return bound if len(bound) >= 2 else None

    wait_for(decided, timeout=POD_START_SECONDS, what="at least one gang bound")
    for gang in (ours, theirs):
        bound = [n for n in gang if _node_of(n, idle)]
        assert len(bound) in (0, len(gang)), f"half a gang bound: {bound} of {gang}"
    running_gangs = [g for g in (ours, theirs) if all(_node_of(n, idle) for n in g)]
    assert running_gangs, "neither gang placed: a deadlock"
    # Free the winner's GPUs: the other gang then runs, whole.
    for name in running_gangs[0]:
        kubectl("delete", "pod", name, "-n", idle, "--wait=false")
    other = theirs if running_gangs[0] is ours else ours
    for name in other:
        wait_for(lambda n=name: running(n, idle), timeout=POD_START_SECONDS, what=f"pod {name} after room")

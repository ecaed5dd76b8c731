"""A share a node refused at prepare (the agent's ``ShareRefused`` status on the claim) leads to a
new pod with a new allocation, not a pod stuck in ContainerCreating: the pure decision first, then
the controller against the API emulator, with the claim allocated and reserved as kube-scheduler
would have done it (written directly: a pod without our gate), and the refusal as the agent writes it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client

from driver.controller import Controller
from driver.controller.preemption.refusal import (
    SHARE_REFUSED_REASON,
    RefusalAction,
    ShareRefusal,
    build_eviction,
    decide_share_refused,
    parse_share_refusals,
)
from driver.controller.writes.events import REASON_SHARE_REFUSED
from driver.plugin.status import REFUSED_REASON, build_refused_statuses
from driver.plugin.status import ShareRefusal as AgentRefusal
from tests.controller.conftest import NAMESPACE, Cluster, RunningController, gpu_claim, wait_for

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)

NODE = "node-a"
ERROR = (
    "ResourceClaim default/{claim}: device node-a/gpu-0: memory: requested 10Gi (10737418240 bytes) with "
    "20Gi (21474836480 bytes) already prepared for 2 other claims: over the capacity of "
    "22Gi (23622320128 bytes)"
)


def owner(kind: str, name: str, *, controller: bool = True) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": kind, "name": name, "uid": str(uuid.uuid4()),
            "controller": controller}  # fmt: skip


def pod_body(
    name: str, *, owners: Sequence[dict[str, Any]] = (), namespace: str = NAMESPACE,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """A pod kube-scheduler bound (no gate of ours), its claim made from a template."""
    metadata = {"name": name, "namespace": namespace, "ownerReferences": list(owners), "labels": labels or {}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "nodeName": NODE,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu-share"}],
            "containers": [
                {
                    "name": "main",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }


def pod_status(name: str, phase: str) -> dict[str, Any]:
    return {"phase": phase, "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": f"{name}-gpu"}]}


def claim_status(pod: dict[str, Any], share_id: str, refused: str | None) -> dict[str, Any]:
    """Allocated and reserved as kube-scheduler does it; ``refused``: the agent's error, as it writes it."""
    result = {"request": "gpu", "driver": "fractional.dev", "pool": NODE, "device": "gpu-0",
              "shareID": share_id, "consumedCapacity": {"memory": "10Gi", "compute": "30"}}  # fmt: skip
    status: dict[str, Any] = {
        "allocation": {
            "devices": {"results": [result]},
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}
                ]
            },
        },
        "reservedFor": [{"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}],
    }
    if refused is not None:
        refusal = AgentRefusal(pool=NODE, device="gpu-0", share_ids=(share_id,), message=refused)
        status["devices"] = build_refused_statuses(refusal, now=datetime.now(UTC))
    return status


def pod_owner_reference(pod: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"],
            "controller": True, "blockOwnerDeletion": True}  # fmt: skip


# -- pure ----------------------------------------------------------------------------------------


def stored_pod(name: str, *, owners: Sequence[dict[str, Any]] = (), phase: str = "Pending",
               namespace: str = NAMESPACE) -> dict[str, Any]:  # fmt: skip
    pod = pod_body(name, owners=owners, namespace=namespace)
    pod["metadata"]["uid"] = str(uuid.uuid4())
    pod["status"] = pod_status(name, phase)
    return pod


def claim_for(pod: dict[str, Any], *, own: bool = True, refused: bool = True) -> dict[str, Any]:
    name = f"{pod['metadata']['name']}-gpu"
    meta: dict[str, Any] = {"name": name, "namespace": pod["metadata"]["namespace"], "uid": str(uuid.uuid4())}
    if own:
        meta["ownerReferences"] = [pod_owner_reference(pod)]
    error = ERROR.format(claim=name) if refused else None
    return {"metadata": meta, "status": claim_status(pod, str(uuid.uuid4()), error)}


def test_the_agent_and_the_controller_agree_on_the_reason() -> None:
    assert SHARE_REFUSED_REASON == REFUSED_REASON


def test_parse_reads_only_our_refused_entries() -> None:
    pod = stored_pod("p")
    claim = claim_for(pod)
    (refusal,) = parse_share_refusals(claim)
    assert refusal == ShareRefusal(pool=NODE, device="gpu-0", message=ERROR.format(claim="p-gpu"))
    ready = claim_for(pod, refused=False)
    condition = {"type": "Ready", "status": "True", "reason": "Prepared"}
    ready["status"]["devices"] = [
        {"driver": "fractional.dev", "pool": NODE, "device": "gpu-0", "conditions": [condition]}
    ]
    assert parse_share_refusals(ready) == ()
    foreign = claim_for(pod)
    foreign["status"]["devices"][0]["driver"] = "gpu.example.com"
    assert parse_share_refusals(foreign) == ()


@pytest.mark.parametrize(
    ("owners", "namespace", "own", "action", "advice"),
    [
        ([owner("ReplicaSet", "web-7d9")], NAMESPACE, True, RefusalAction.EVICT,
         "evicting the pod: its ReplicaSet web-7d9 re-creates it, and the new pod's claim is allocated anew"),
        ([], NAMESPACE, True, RefusalAction.ADVISE, "the pod has no controller to re-create it"),
        ([owner("ReplicaSet", "web-7d9", controller=False)], NAMESPACE, True, RefusalAction.ADVISE,
         "the pod has no controller to re-create it"),
        ([owner("Job", "train")], NAMESPACE, False, RefusalAction.ADVISE,
         "the claim is not the pod's own (made from its template), so a new pod would get the same"),
        ([owner("DaemonSet", "agent")], "kube-system", True, RefusalAction.ADVISE,
         "pods in namespace kube-system are not evicted"),
    ],
)  # fmt: skip
def test_decide(
    owners: list[dict[str, Any]], namespace: str, own: bool, action: RefusalAction, advice: str
) -> None:
    pod = stored_pod("p", owners=owners, namespace=namespace)
    (decided,) = decide_share_refused(claim_for(pod, own=own), [pod])
    assert (decided.action, decided.uid, decided.key) == (action, pod["metadata"]["uid"], f"{namespace}/p")
    assert decided.advice.startswith(advice)
    assert decided.message == (
        f"node {NODE} refused to prepare ResourceClaim {namespace}/p-gpu: {ERROR.format(claim='p-gpu')}; "
        f"{decided.advice}"
    )


def test_decide_leaves_alone_what_is_not_stuck_on_the_refusal() -> None:
    owned = [owner("ReplicaSet", "web-7d9")]
    pod = stored_pod("p", owners=owned)
    claim = claim_for(pod)
    assert (
        decide_share_refused(claim, [stored_pod("p", owners=owned, phase="Running")]) == ()
    )  # other UID too
    running = {**pod, "status": {**pod["status"], "phase": "Running"}}
    assert decide_share_refused(claim, [running]) == ()
    unbound = {**pod, "spec": {**pod["spec"], "nodeName": None}}
    assert decide_share_refused(claim, [unbound]) == ()
    deleting = {**pod, "metadata": {**pod["metadata"], "deletionTimestamp": "2025-06-01T12:00:00Z"}}
    assert decide_share_refused(claim, [deleting]) == ()
    assert decide_share_refused(claim, [pod], done={pod["metadata"]["uid"]}) == ()
    assert decide_share_refused(claim_for(pod, refused=False), [pod]) == ()
    not_reserved = claim_for(pod)
    not_reserved["status"]["reservedFor"] = []
    assert decide_share_refused(not_reserved, [pod]) == ()
    assert len(decide_share_refused(claim, [pod])) == 1


def test_the_eviction_names_the_pods_uid_and_nothing_else() -> None:
    assert build_eviction("ns", "p", "u-1") == {
        "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "p", "namespace": "ns"},
        "deleteOptions": {"preconditions": {"uid": "u-1"}},
    }  # fmt: skip
    assert build_eviction("ns", "p", "u-1", dry_run=True)["deleteOptions"]["dryRun"] == ["All"]


# -- the controller against the API ---------------------------------------------------------------


def replica_set(cluster: Cluster, name: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """A real ReplicaSet (one replica, the pod made by hand counts as it) to own a pod: the owner
    reference with its uid, and the labels its selector matches. A made-up owner would not do on a
    real cluster: kube-controller-manager's garbage collector deletes a pod whose owner does not exist.
    """
    labels = {"app": name}
    body = {
        "apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels},
            "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]},
        }},
    }  # fmt: skip
    made = client.AppsV1Api(cluster.api_client).create_namespaced_replica_set(NAMESPACE, body)
    reference = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": name, "uid": made.metadata.uid,
                 "controller": True, "blockOwnerDeletion": True}  # fmt: skip
    return [reference], labels


def create_refused(
    cluster: Cluster, name: str, *, owner_set: str | None = None, phase: str = "Pending",
    refused: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """A bound pod, its claim allocated on a GPU and reserved for it, and (``refused``) the node's
    refusal; ``owner_set``: the name of a ReplicaSet made to own it."""
    owners, labels = replica_set(cluster, owner_set) if owner_set else ([], {})
    pod = cluster.create_pod(pod_body(name, owners=owners, labels=labels))
    pod["status"] = pod_status(name, phase)
    pod = json.loads(
        cluster.core.replace_namespaced_pod_status(name, NAMESPACE, pod, _preload_content=False).data
    )
    body = gpu_claim(f"{name}-gpu", memory="10Gi", compute=30)
    body["metadata"]["ownerReferences"] = [pod_owner_reference(pod)]
    claim = cluster.create_claim(body)
    claim["status"] = claim_status(
        pod, str(uuid.uuid4()), ERROR.format(claim=f"{name}-gpu") if refused else None
    )
    cluster.resource.replace_namespaced_resource_claim_status(f"{name}-gpu", NAMESPACE, claim)
    return pod


def refusal_events(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    return [
        e
        for e in cluster.events()
        if e["reason"] == REASON_SHARE_REFUSED and e["involvedObject"]["name"] == name
    ]


def evicted(cluster: Cluster, name: str) -> bool:
    try:
        return bool(cluster.pod(name)["metadata"].get("deletionTimestamp"))
    except client.ApiException as error:
        if error.status == 404:
            return True
        raise


@pytest.fixture
def node(cluster: Cluster) -> None:
    cluster.add_node(NODE, "l4-2x")


def running(cluster: Cluster, controller: Callable[..., RunningController]) -> None:
    """Start the controller and wait until it acts: what follows reaches it through its watches."""
    controller()
    create_refused(cluster, "warm-up")
    wait_for(lambda: refusal_events(cluster, "warm-up"), what="the controller acting")


def test_a_refused_pod_of_a_replica_set_is_evicted_and_told_why(
    cluster: Cluster, node: None, controller: Callable[..., RunningController]
) -> None:
    running(cluster, controller)
    pod = create_refused(cluster, "web-1", owner_set="web-7d9")
    wait_for(lambda: evicted(cluster, "web-1"), what="the refused pod evicted")
    (event,) = wait_for(lambda: refusal_events(cluster, "web-1"), what="the ShareRefused Event")
    assert event["type"] == "Warning" and event["involvedObject"]["uid"] == pod["metadata"]["uid"]
    assert event["message"] == (
        f"node {NODE} refused to prepare ResourceClaim default/web-1-gpu: {ERROR.format(claim='web-1-gpu')}; "
        "evicting the pod: its ReplicaSet web-7d9 re-creates it, and the new pod's claim is allocated anew"
    )
    assert cluster.server.request_count("create", "pods/eviction") == 1


def test_a_bare_pod_is_left_in_place_and_told_what_to_do_once(
    cluster: Cluster, node: None, controller: Callable[..., RunningController]
) -> None:
    running(cluster, controller)
    pod = create_refused(cluster, "bare")
    (event,) = wait_for(lambda: refusal_events(cluster, "bare"), what="the ShareRefused Event")
    assert event["message"].endswith(
        "the pod has no controller to re-create it: delete it and create it again, so that its claim is "
        "allocated anew"
    )
    # The agent writes the claim again (another message): the pod was dealt with, nothing more is said.
    claim = cluster.claim("bare-gpu")
    assert claim is not None
    claim["status"] = claim_status(
        pod, claim["status"]["allocation"]["devices"]["results"][0]["shareID"], "x"
    )
    cluster.resource.replace_namespaced_resource_claim_status("bare-gpu", NAMESPACE, claim)
    create_refused(cluster, "later")  # decided after the change above: its Event is the barrier
    wait_for(lambda: refusal_events(cluster, "later"), what="the later pod's Event")
    assert [(e["count"], e["message"]) for e in refusal_events(cluster, "bare")] == [(1, event["message"])]
    assert not cluster.pod("bare")["metadata"].get("deletionTimestamp")
    assert cluster.server.request_count("create", "pods/eviction") == 0


def test_a_running_pod_is_left_alone(
    cluster: Cluster, node: None, controller: Callable[..., RunningController]
) -> None:
    running(cluster, controller)
    create_refused(cluster, "running", owner_set="web-7d9", phase="Running")
    create_refused(cluster, "later")  # decided after the running one: its Event is the barrier
    wait_for(lambda: refusal_events(cluster, "later"), what="the later pod's Event")
    assert refusal_events(cluster, "running") == []
    assert not cluster.pod("running")["metadata"].get("deletionTimestamp")
    assert cluster.server.request_count("create", "pods/eviction") == 0


def test_nothing_is_evicted_or_said_behind_a_lost_lease(
    cluster: Cluster, node: None, fenced: Controller
) -> None:
    create_refused(cluster, "web-1", owner_set="web-7d9")
    wait_for(fenced.halted.is_set, what="the fenced controller halted at its first write, the eviction")
    assert not evicted(cluster, "web-1")
    assert refusal_events(cluster, "web-1") == []
    assert cluster.server.request_count("create", "pods/eviction") == 0

"""The ProvisioningRequests we write for a gang that fits nowhere, and what we do with each answer
cluster-autoscaler 1.36 writes (its source at tag cluster-autoscaler-1.36.1): pure, no API.

What cluster-autoscaler reads decides the shapes: it copies each PodTemplate ``count`` times,
looks a ``resourceClaimName`` up in its claim informer and never resolves a
``resourceClaimTemplateName`` (kubernetes/autoscaler#10065), so every template names the pod's own
generated claims; identical pods of one podSet share what they name, so a pod with claims of its own
is its own podSet; and a request holds at most 32 podSets.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from driver.controller.model.gang_identity import (
    COSCHEDULING_LABEL,
    KUEUE_GROUP_LABEL,
    KUEUE_TOTAL_ANNOTATION,
    LWS_GROUP_LABEL,
    LWS_SIZE_ANNOTATION,
    VOLCANO_ANNOTATION,
    identify,
)
from driver.controller.model.objects import GANG_LABEL, GANG_SIZE_ANNOTATION, ClaimRef, GangKey
from driver.controller.sizing.provisioning import (
    ATTEMPT_ANNOTATION,
    GANG_ANNOTATION,
    GANG_HASH_LABEL,
    MAX_POD_SETS,
    PARTS_ANNOTATION,
    Action,
    Phase,
    Unresolved,
    build_requests,
    gang_hash,
    phase_of,
    plan_provisioning,
    retry_delay,
)

CLASS = "best-effort-atomic-scale-up.autoscaling.x-k8s.io"
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def pod(name: str, *, labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
        spec: dict[str, Any] | None = None, cpu: str = "1", template: str | None = "gpu-share",
        shared: str | None = None) -> dict[str, Any]:  # fmt: skip
    """A gated pod whose claim comes from ``template`` (generated as ``<name>-gpu-<suffix>``, as
    kube-controller-manager names it), or names the ``shared`` claim."""
    entries, statuses = [], []
    if template:
        entries.append({"name": "gpu", "resourceClaimTemplateName": template})
        statuses.append({"name": "gpu", "resourceClaimName": f"{name}-gpu-x7k2p"})
    if shared:
        entries.append({"name": "shared", "resourceClaimName": shared})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "team-a", "uid": f"uid-{name}", "labels": dict(labels or {}),
                     "annotations": dict(annotations or {})},
        "spec": {
            "schedulingGates": [{"name": "fractional.dev/allocation"}],
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "nodeSelector": {"pool": "gpu"},
            **(spec or {}),
            "resourceClaims": entries,
            "containers": [{"name": "main", "image": "trainer:1", "command": ["python"],
                            "env": [{"name": "RANK", "value": name}],
                            "resources": {"requests": {"cpu": cpu},
                                          "claims": [{"name": e["name"]} for e in entries]}}],
        },
        "status": {"resourceClaimStatuses": statuses},
    }  # fmt: skip


# Every gang source the controller reads, as its pods carry it (driver/controller/model/gang_identity.py).
SOURCES: dict[str, tuple[dict[str, str], dict[str, str], dict[str, Any]]] = {
    "podgroup": ({}, {}, {"schedulingGroup": {"podGroupName": "train"}}),
    "workload": (
        {},
        {},
        {"workloadRef": {"name": "train", "podGroup": "workers", "podGroupReplicaKey": "0"}},
    ),
    "fractional": ({GANG_LABEL: "train"}, {GANG_SIZE_ANNOTATION: "3"}, {}),
    "coscheduling": ({COSCHEDULING_LABEL: "train"}, {}, {}),
    "kueue": ({KUEUE_GROUP_LABEL: "train"}, {KUEUE_TOTAL_ANNOTATION: "3"}, {}),
    "lws": ({LWS_GROUP_LABEL: "0f2c1e"}, {LWS_SIZE_ANNOTATION: "3"}, {}),
    "volcano": ({}, {VOLCANO_ANNOTATION: "train"}, {}),
}


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_each_pod_is_its_own_pod_set_naming_its_generated_claim(source: str) -> None:
    labels, annotations, spec = SOURCES[source]
    pods = [pod(f"w-{i}", labels=labels, annotations=annotations, spec=spec) for i in range(3)]
    gang = identify(pods[0]).key
    assert identify(pods[0]).source is not None and gang.startswith("team-a/")
    (part,) = build_requests(gang, pods, provisioning_class=CLASS)
    request = part.request
    assert DNS_SUBDOMAIN.match(request["metadata"]["name"])
    assert request["metadata"]["namespace"] == "team-a"
    assert request["spec"]["provisioningClassName"] == CLASS
    assert [s["count"] for s in request["spec"]["podSets"]] == [1, 1, 1]
    assert [s["podTemplateRef"]["name"] for s in request["spec"]["podSets"]] == [
        t["metadata"]["name"] for t in part.templates
    ]
    for index, template in enumerate(part.templates):
        assert DNS_SUBDOMAIN.match(template["metadata"]["name"])
        claims = template["template"]["spec"]["resourceClaims"]
        # a name cluster-autoscaler finds in its claim informer, never a template it cannot resolve
        assert claims == [{"name": "gpu", "resourceClaimName": f"w-{index}-gpu-x7k2p"}]
        assert template["template"]["spec"]["tolerations"] == pods[0]["spec"]["tolerations"]
        assert template["template"]["spec"]["nodeSelector"] == {"pool": "gpu"}
        assert template["template"]["metadata"]["labels"] == labels
        container = template["template"]["spec"]["containers"][0]
        assert set(container) == {"name", "image", "resources"}  # what scheduling reads, not env
        assert "schedulingGates" not in template["template"]["spec"]  # a gated pod is never placed
        assert template["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Pod", "name": f"w-{index}", "uid": f"uid-w-{index}"}
        ]
    assert {o["name"] for o in request["metadata"]["ownerReferences"]} == {"w-0", "w-1", "w-2"}
    assert part.pods == ("team-a/w-0", "team-a/w-1", "team-a/w-2")
    for obj in (request, *part.templates):
        assert obj["metadata"]["labels"][GANG_HASH_LABEL] == gang_hash(gang)
        assert obj["metadata"]["annotations"][GANG_ANNOTATION] == gang
        assert obj["metadata"]["annotations"][ATTEMPT_ANNOTATION] == "0"


def test_pods_that_share_their_claim_are_one_pod_set_and_pods_that_differ_are_apart() -> None:
    gang = GangKey("team-a/serve")
    alike = [pod(f"r-{i}", template=None, shared="kv-cache") for i in range(4)]
    bigger = pod("big", template=None, shared="kv-cache", cpu="8")
    (part,) = build_requests(gang, [*alike, bigger], provisioning_class=CLASS)
    assert [s["count"] for s in part.request["spec"]["podSets"]] == [4, 1]
    first, second = part.templates
    assert first["template"]["spec"]["resourceClaims"] == [
        {"name": "shared", "resourceClaimName": "kv-cache"}
    ]
    assert second["template"]["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "8"}
    assert len(first["metadata"]["ownerReferences"]) == 4


def test_a_claim_shared_through_a_podgroup_is_named_as_the_cache_resolves_it() -> None:
    """KEP-5729: the pods' entry matches the PodGroup's claim; one claim serves them all."""
    gang = GangKey("team-a/podgroup:train")
    pods = [pod(f"w-{i}", spec={"schedulingGroup": {"podGroupName": "train"}}) for i in range(2)]
    for p in pods:
        p["status"] = {}  # the pods' own statuses name nothing: the PodGroup's does

    def claims_of(p: dict[str, Any]) -> tuple[ClaimRef, ...]:
        return (ClaimRef(entry="gpu", claim_name="train-gpu-abcde", from_template=True),)

    (part,) = build_requests(gang, pods, provisioning_class=CLASS, claims_of=claims_of)
    # alike but for their names, the one claim shared: one podSet of two that share it, as they will
    assert [s["count"] for s in part.request["spec"]["podSets"]] == [2]
    (template,) = part.templates
    assert template["template"]["spec"]["resourceClaims"] == [
        {"name": "gpu", "resourceClaimName": "train-gpu-abcde"}
    ]


def test_a_claim_not_created_yet_waits_and_one_not_needed_is_left_out() -> None:
    gang = GangKey("team-a/train")
    waiting = pod("w-0")
    waiting["status"] = {}
    with pytest.raises(Unresolved, match=r"w-0.*'gpu'"):
        build_requests(gang, [waiting], provisioning_class=CLASS)
    unneeded = pod("w-1")
    unneeded["status"] = {"resourceClaimStatuses": [{"name": "gpu"}]}  # no claim name: none needed
    (part,) = build_requests(gang, [unneeded], provisioning_class=CLASS)
    assert "resourceClaims" not in part.templates[0]["template"]["spec"]


def test_a_gang_above_32_distinct_pods_is_asked_for_in_parts() -> None:
    gang = GangKey("team-a/" + "very-long-training-job-name-" * 8)  # names stay valid when cut
    pods = [pod(f"w-{i}") for i in range(70)]
    parts = build_requests(gang, pods, provisioning_class=CLASS, attempt=2)
    assert [len(p.request["spec"]["podSets"]) for p in parts] == [MAX_POD_SETS, MAX_POD_SETS, 6]
    assert [p for part in parts for p in part.pods] == [f"team-a/w-{i}" for i in range(70)]
    names = [p.name for p in parts]
    assert len(set(names)) == 3
    for part in parts:
        assert part.request["metadata"]["annotations"][PARTS_ANNOTATION] == "3"
        assert part.request["metadata"]["annotations"][ATTEMPT_ANNOTATION] == "2"
        for obj in (part.request, *part.templates):
            assert DNS_SUBDOMAIN.match(obj["metadata"]["name"]), obj["metadata"]["name"]
            assert len(obj["metadata"]["name"]) <= 253


# -- the answers, as cluster-autoscaler 1.36 writes them ------------------------------------------


def request(name: str = "train-scale-up-1a2b3c4d-a0-p0", *conditions: tuple[str, str, str],
            attempt: int = 0, parts: int = 1) -> dict[str, Any]:  # fmt: skip
    return {
        "metadata": {"name": name, "namespace": "team-a",
                     "annotations": {ATTEMPT_ANNOTATION: str(attempt), PARTS_ANNOTATION: str(parts)}},
        "status": {"conditions": [
            {"type": t, "status": s, "reason": r, "message": "", "lastTransitionTime": "2026-12-06T08:00:00Z"}
            for t, s, r in conditions
        ]},
    }  # fmt: skip


ACCEPTED = ("Accepted", "True", "Accepted")  # injector.go MarkAsAccepted
NOT_FOUND = ("Provisioned", "False", "CapacityIsNotFound")  # it retries itself, 1 to 10 min
PROVISIONED = ("Provisioned", "True", "CapacityIsProvisioned")  # the group asked to grow, no node yet
FOUND = ("Provisioned", "True", "CapacityIsFound")  # it fits on what exists
EXPIRED = ("BookingExpired", "True", "CapacityReservationTimeExpired")  # 10 min after Provisioned
FAILED = ("Failed", "True", "FailedToCreatePods")  # final
REVOKED = ("CapacityRevoked", "True", "Revoked")  # in the API, never written by 1.36


@pytest.mark.parametrize(
    ("conditions", "phase"),
    [
        ((), Phase.WAITING),
        ((ACCEPTED,), Phase.WAITING),
        ((ACCEPTED, NOT_FOUND), Phase.WAITING),
        ((ACCEPTED, PROVISIONED), Phase.PROVISIONED),
        ((ACCEPTED, FOUND), Phase.PROVISIONED),
        ((ACCEPTED, PROVISIONED, EXPIRED), Phase.ENDED),
        ((ACCEPTED, FAILED), Phase.ENDED),
        ((ACCEPTED, NOT_FOUND, ("Failed", "True", "Expired")), Phase.ENDED),  # 7 days without capacity
        ((ACCEPTED, PROVISIONED, REVOKED), Phase.ENDED),
        ((ACCEPTED, PROVISIONED, ("BookingExpired", "False", "")), Phase.PROVISIONED),
    ],
)
def test_the_phase_of_each_answer(conditions: tuple[tuple[str, str, str], ...], phase: Phase) -> None:
    assert phase_of(request("r", *conditions))[0] is phase


def step(alive: list[dict[str, Any]], *, failures: int = 0, retry_at: float = 0.0, now: float = 100.0,
         next_attempt: int = 0) -> Any:  # fmt: skip
    return plan_provisioning(
        alive, next_attempt=next_attempt, failures=failures, retry_at=retry_at, now=now,
        initial_backoff=30.0, max_backoff=600.0,
    )  # fmt: skip


def test_none_alive_asks_and_one_alive_is_never_asked_twice() -> None:
    assert step([]).action is Action.CREATE
    for conditions in ((), (ACCEPTED,), (ACCEPTED, NOT_FOUND), (ACCEPTED, PROVISIONED)):
        answer = step([request("r", *conditions)], next_attempt=1)
        assert answer.action is Action.WAIT and answer.delay == 0.0
    provisioned = step([request("r", ACCEPTED, PROVISIONED)])
    assert provisioned.phase is Phase.PROVISIONED and "CapacityIsProvisioned" in provisioned.reason


@pytest.mark.parametrize("end", [EXPIRED, FAILED, REVOKED])
def test_an_ended_request_is_retired_and_asked_again_after_a_backoff(end: tuple[str, str, str]) -> None:
    retire = step([request("r", ACCEPTED, PROVISIONED, end)], failures=0)
    assert retire.action is Action.RETIRE and retire.delay == 30.0 and end[0] in retire.reason
    later = step([request("r", ACCEPTED, end)], failures=3)
    assert later.delay == 240.0
    waiting = step([], failures=1, retry_at=130.0, now=100.0, next_attempt=1)
    assert waiting.action is Action.WAIT and waiting.delay == 30.0
    again = step([], failures=1, retry_at=130.0, now=131.0, next_attempt=1)
    assert again.action is Action.CREATE and again.attempt == 1


def test_one_ended_part_retires_every_part() -> None:
    parts = [request("p0", ACCEPTED, PROVISIONED, parts=2), request("p1", ACCEPTED, FAILED, parts=2)]
    assert step(parts).action is Action.RETIRE


def test_a_half_made_attempt_is_completed_not_asked_anew() -> None:
    half = step([request("p0", ACCEPTED, attempt=1, parts=3)], next_attempt=2)
    assert half.action is Action.CREATE and half.attempt == 1


def test_the_backoff_doubles_up_to_its_maximum() -> None:
    assert [retry_delay(n, initial=30.0, maximum=600.0) for n in range(7)] == [
        0.0, 30.0, 60.0, 120.0, 240.0, 480.0, 600.0,
    ]  # fmt: skip

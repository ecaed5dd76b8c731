"""What the controller asks cluster-autoscaler for, and what it does with each answer: pure.

A gang that fits nowhere gets ProvisioningRequests (``autoscaling.x-k8s.io/v1``) that
cluster-autoscaler 1.36 can simulate. What it can and cannot read (its source at tag
``cluster-autoscaler-1.36.1``, docs/autoscaling.md):

- It makes each podSet's ``count`` pods from the referenced PodTemplate, copied as they are. A claim
  named with ``resourceClaimName`` is looked up in its ResourceClaim informer and allocated in its
  simulation; a ``resourceClaimTemplateName`` is never resolved (kubernetes/autoscaler#10065), so
  such a pod fits nowhere. Every template here therefore names the pod's own generated claims.
- The pods of one podSet are identical, so they share the claims they name. A pod with claims of its
  own is its own podSet (``count`` 1); pods alike in everything, their claims included (a claim they
  share by name), are one podSet. A request holds at most 32 podSets (the CRD's ``maxItems``): a gang
  with more distinct pods is asked for in parts of at most 32, each all-or-nothing on its own.
- The best-effort-atomic class writes ``Provisioned=True`` as soon as the node group was asked to
  grow, books that capacity in its own simulations for 10 minutes, then writes ``BookingExpired``;
  ``Failed`` is final; ``Provisioned=False`` it retries itself (1 to 10 minutes). It never writes
  ``CapacityRevoked`` today; it is read as an end too.

``plan_provisioning`` decides, from the gang's requests as the watch shows them: create them (none
alive, the backoff over), wait (alive and not ended: one request per gang at a time), or retire them
(one part ended: all parts are deleted, and the gang asks again after a backoff).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from driver.controller.model.objects import ClaimRef, GangKey, pod_claim_refs

__all__ = [
    "ATTEMPT_ANNOTATION",
    "GANG_ANNOTATION",
    "GANG_HASH_LABEL",
    "MANAGED_BY",
    "MAX_POD_SETS",
    "PARTS_ANNOTATION",
    "Action",
    "Phase",
    "ProvisioningPart",
    "Step",
    "Unresolved",
    "attempt_of",
    "build_requests",
    "gang_hash",
    "phase_of",
    "plan_provisioning",
    "request_name",
    "retry_delay",
]

MAX_POD_SETS = 32  # the ProvisioningRequest CRD's spec.podSets maxItems
GANG_HASH_LABEL = "fractional.dev/gang-hash"  # on our requests and their PodTemplates
GANG_ANNOTATION = "fractional.dev/gang"  # the gang key itself (a label value cannot hold it)
ATTEMPT_ANNOTATION = "fractional.dev/attempt"
PARTS_ANNOTATION = "fractional.dev/parts"  # how many requests the attempt has (a gang above 32 pods)
MANAGED_BY = {"app.kubernetes.io/managed-by": "fractional-dra"}
_NAME_LIMIT = 253
_ENDING_CONDITIONS = ("Failed", "BookingExpired", "CapacityRevoked")


def gang_hash(gang: GangKey) -> str:
    return hashlib.sha256(gang.encode()).hexdigest()[:16]


def _stem(gang: GangKey) -> str:
    name = gang.split("/", 1)[1].replace("pod:", "pod-")
    base = "".join(ch if ch.isalnum() or ch in "-." else "-" for ch in name.lower()).strip("-.") or "gang"
    return f"{base[:200].rstrip('-.')}-scale-up-{gang_hash(gang)[:8]}"


def request_name(gang: GangKey, attempt: int, part: int) -> str:
    """Stable per gang, attempt and part: ``<gang>-scale-up-<hash>-a<attempt>-p<part>``."""
    return f"{_stem(gang)}-a{attempt}-p{part}"


class Unresolved(ValueError):
    """A pod's claim is not known yet (made from a template, not yet created): ask later."""


@dataclass(frozen=True, slots=True)
class ProvisioningPart:
    """One request and the PodTemplates it names (created first: cluster-autoscaler fails a request
    whose template is missing for good), and the pods it is for (``pods``: namespace/name)."""

    request: dict[str, Any]
    templates: tuple[dict[str, Any], ...]
    pods: tuple[str, ...]

    @property
    def name(self) -> str:
        return str(self.request["metadata"]["name"])


ClaimsOf = Callable[[dict[str, Any]], tuple[ClaimRef, ...]]


def _template_spec(pod: dict[str, Any], claims_of: ClaimsOf) -> dict[str, Any]:
    """What of a pod the scheduler (and so cluster-autoscaler's simulation) reads, its claims named."""
    spec = pod.get("spec") or {}
    keep = ("initContainers", "nodeSelector", "affinity", "tolerations", "priorityClassName", "priority",
            "overhead", "topologySpreadConstraints", "schedulerName", "runtimeClassName", "nodeName",
            "hostNetwork", "volumes")  # fmt: skip
    shape = {k: spec[k] for k in keep if k in spec}
    shape["containers"] = [
        {k: c[k] for k in ("name", "image", "resources", "ports") if k in c}
        for c in spec.get("containers") or ()
    ]
    shape["initContainers"] = [
        {k: c[k] for k in ("name", "image", "resources", "restartPolicy") if k in c}
        for c in spec.get("initContainers") or ()
    ]
    if not shape["initContainers"]:
        del shape["initContainers"]
    claims = []
    key = f"{pod['metadata'].get('namespace')}/{pod['metadata'].get('name')}"
    for ref in claims_of(pod):
        if ref.claim_name is None:
            raise Unresolved(f"pod {key}: claim {ref.entry!r} not created yet (from a template)")
        claims.append({"name": ref.entry, "resourceClaimName": ref.claim_name})
    if claims:
        shape["resourceClaims"] = claims
    return shape


def build_requests(
    gang: GangKey,
    pods: Sequence[dict[str, Any]],
    *,
    provisioning_class: str,
    attempt: int = 0,
    claims_of: ClaimsOf = pod_claim_refs,
) -> list[ProvisioningPart]:
    """The requests for the gang's ``pods`` (parts of at most 32 podSets, in the pods' order). Each
    request and template is owned by the pods it is for, so that the garbage collector removes
    them with the gang. ``claims_of``: a pod's claims by entry (the cache's resolves those shared
    through a PodGroup). Raises ``Unresolved`` while a pod's claim is not created yet."""
    if not pods:
        return []
    namespace = str(pods[0]["metadata"]["namespace"])
    sets: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
    for pod in pods:
        spec = _template_spec(pod, claims_of)
        labels = dict(pod["metadata"].get("labels") or {})
        key = json.dumps([spec, labels], sort_keys=True)
        sets.setdefault(key, (spec, []))[1].append(pod)
    ordered = list(sets.values())
    parts: list[ProvisioningPart] = []
    count = -(-len(ordered) // MAX_POD_SETS)
    labels = {**MANAGED_BY, GANG_HASH_LABEL: gang_hash(gang)}
    annotations = {GANG_ANNOTATION: gang, ATTEMPT_ANNOTATION: str(attempt), PARTS_ANNOTATION: str(count)}
    for index, start in enumerate(range(0, len(ordered), MAX_POD_SETS)):
        chunk = ordered[start : start + MAX_POD_SETS]
        name = request_name(gang, attempt, index)
        templates, pod_sets, members = [], [], []
        for set_index, (spec, set_pods) in enumerate(chunk):
            template_name = f"{name[: _NAME_LIMIT - 4]}-{set_index}"
            templates.append({
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": template_name, "namespace": namespace, "labels": dict(labels),
                             "annotations": dict(annotations), "ownerReferences": _owners(set_pods)},
                "template": {
                    "metadata": {"labels": dict(set_pods[0]["metadata"].get("labels") or {})},
                    "spec": spec,
                },
            })  # fmt: skip
            pod_sets.append({"podTemplateRef": {"name": template_name}, "count": len(set_pods)})
            members += set_pods
        spec_body: dict[str, Any] = {"provisioningClassName": provisioning_class, "podSets": pod_sets}
        request = {
            "apiVersion": "autoscaling.x-k8s.io/v1",
            "kind": "ProvisioningRequest",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels),
                         "annotations": dict(annotations), "ownerReferences": _owners(members)},
            "spec": spec_body,
        }  # fmt: skip
        keys = tuple(f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in members)
        parts.append(ProvisioningPart(request=request, templates=tuple(templates), pods=keys))
    return parts


def _owners(pods: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pods as owners (not controllers, not blocking): the object goes when the last of them goes."""
    owners = []
    for pod in pods:
        uid = pod["metadata"].get("uid")
        if uid:
            owners.append({"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"], "uid": uid})
    return owners


# -- the answers ----------------------------------------------------------------------------------


class Phase(StrEnum):
    WAITING = "waiting"  # created; not provisioned yet (no condition, Accepted, Provisioned=False)
    PROVISIONED = "provisioned"  # Provisioned=True and its booking holds: the nodes are coming
    ENDED = "ended"  # Failed, BookingExpired or CapacityRevoked: it will do nothing more


def _conditions(request: dict[str, Any]) -> dict[str, dict[str, Any]]:
    conditions = (request.get("status") or {}).get("conditions") or ()
    return {str(c.get("type")): c for c in conditions if isinstance(c, dict)}


def phase_of(request: dict[str, Any]) -> tuple[Phase, str]:
    """The request's phase and, for people, why (the deciding condition's type, reason, message)."""
    conditions = _conditions(request)
    for kind in _ENDING_CONDITIONS:
        condition = conditions.get(kind)
        if condition is not None and condition.get("status") == "True":
            return Phase.ENDED, _describe(condition)
    provisioned = conditions.get("Provisioned")
    if provisioned is not None and provisioned.get("status") == "True":
        return Phase.PROVISIONED, _describe(provisioned)
    if provisioned is not None:
        return Phase.WAITING, _describe(provisioned)
    accepted = conditions.get("Accepted")
    return Phase.WAITING, _describe(accepted) if accepted else "not yet seen by cluster-autoscaler"


def _describe(condition: dict[str, Any]) -> str:
    text = f"{condition.get('type')}={condition.get('status')}"
    if condition.get("reason"):
        text += f" ({condition['reason']})"
    if condition.get("message"):
        text += f": {condition['message']}"
    return text


def _number(request: dict[str, Any], annotation: str, default: int) -> int:
    try:
        return int(((request.get("metadata") or {}).get("annotations") or {}).get(annotation, default))
    except (TypeError, ValueError):
        return default


def attempt_of(request: dict[str, Any]) -> int:
    return _number(request, ATTEMPT_ANNOTATION, 0)


class Action(StrEnum):
    CREATE = "create"  # write the requests (and templates) of ``attempt``
    WAIT = "wait"  # nothing to write now (``delay``: look again then, 0: when something changes)
    RETIRE = "retire"  # delete every request of the gang (one ended), then ask again after ``delay``


@dataclass(frozen=True, slots=True)
class Step:
    action: Action
    reason: str
    attempt: int = 0
    delay: float = 0.0
    phase: Phase | None = None


def retry_delay(failures: int, *, initial: float, maximum: float) -> float:
    """Doubling from ``initial`` after each ended request, at most ``maximum``."""
    return min(maximum, initial * (2 ** max(0, failures - 1))) if failures > 0 else 0.0


def plan_provisioning(
    alive: Sequence[dict[str, Any]],
    *,
    next_attempt: int,
    failures: int,
    retry_at: float,
    now: float,
    initial_backoff: float,
    max_backoff: float,
) -> Step:
    """What to do for an unfit gang, given its requests as watched (``alive``, every attempt), the
    attempt to use next, how many requests of it ended so
    far (``failures``) and when it may ask again (``retry_at``, on the caller's clock ``now``)."""
    if alive:
        phases = [(phase_of(r), r) for r in alive]
        ended = [(why, r) for (phase, why), r in phases if phase is Phase.ENDED]
        if ended:
            why, request = ended[0]
            delay = retry_delay(failures + 1, initial=initial_backoff, maximum=max_backoff)
            name = request["metadata"]["name"]
            why = f"ProvisioningRequest {name} ended: {why}"
            return Step(Action.RETIRE, why, delay=delay, phase=Phase.ENDED)
        current = max(attempt_of(r) for r in alive)
        mine = [r for r in alive if attempt_of(r) == current]
        provisioned = [why for (phase, why), _ in phases if phase is Phase.PROVISIONED]
        phase = Phase.PROVISIONED if provisioned else Phase.WAITING
        names = ", ".join(sorted(str(r["metadata"]["name"]) for r in mine))
        if len(mine) < _number(mine[0], PARTS_ANNOTATION, 1):
            # An earlier pass stopped half-way: the parts that are missing (the others answer 409).
            return Step(Action.CREATE, f"completing {names}", attempt=current, phase=phase)
        reason = provisioned[0] if provisioned else phases[0][0][1]
        return Step(Action.WAIT, f"ProvisioningRequest {names}: {reason}", attempt=current, phase=phase)
    if now < retry_at:
        return Step(Action.WAIT, "asking cluster-autoscaler again after a backoff", attempt=next_attempt,
                    delay=retry_at - now)  # fmt: skip
    return Step(Action.CREATE, "no ProvisioningRequest alive", attempt=next_attempt)

"""Which running pods a consolidation may move, and why the others may not. Pure: dicts in, values out.

A pod may move only when all of these hold (each refusal is counted by its reason):

- ``owner``: a controller re-creates it (its controller ``ownerReference`` is a ReplicaSet,
  StatefulSet, Job, ReplicationController or LeaderWorkerSet): an evicted pod of its own would be
  gone for good;
- ``not_opted_in``: it opted in, by the label ``fractional.dev/movable: "true"`` on the pod, on its
  namespace, or on the DeviceClass of every device request of its claims (off for everything else);
- ``priority``: its priority is not above the waiting pod's (priority preemption serves the other case);
- ``min_runtime``: it has run at least the minimum runtime (from ``status.startTime``);
- ``cooldown``: its owner had no pod moved within the cooldown;
- ``gang``: moving it leaves its gang at or above its minimum count of running pods;
- ``state``: it runs (bound, not gated, not terminating) and holds an allocated claim.

Pods that share a claim move together (one ``Mover``); the claims of a mover must serve only its pods.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from driver.controller.model.objects import (
    Resources,
    allocation_node,
    is_deleting,
    is_gated,
    is_terminated,
    object_key,
    pod_claim_refs,
    pod_requests,
)
from driver.controller.preemption.victims import DeviceKey, pod_priority

__all__ = [
    "MOVABLE_LABEL",
    "RECREATING_OWNERS",
    "Mover",
    "MoverRules",
    "Refusals",
    "build_movers",
    "controller_owner",
    "pod_started",
]

MOVABLE_LABEL = "fractional.dev/movable"
RECREATING_OWNERS = frozenset(
    {"ReplicaSet", "StatefulSet", "Job", "ReplicationController", "LeaderWorkerSet"}
)


@dataclass(frozen=True, slots=True)
class MoverRules:
    min_runtime_seconds: float = 600.0
    cooldown_seconds: float = 1800.0


@dataclass(frozen=True, slots=True)
class Mover:
    """Pods that move together (one pod, or pods sharing a claim) and the claims they release."""

    key: str  # the first pod's "namespace/name"
    pods: tuple[dict[str, Any], ...]
    claims: tuple[dict[str, Any], ...]  # allocated; the replacement gets claims of the same spec
    owner_uid: str  # the controller that re-creates the pods
    owner: str  # "Kind/name", for messages
    priority: int
    devices: frozenset[DeviceKey]
    nodes: tuple[str, ...]
    whole: bool  # holds a device whole (not a share of it)
    spare: bool  # its owner has another running pod (the workload keeps serving meanwhile)


def mover_room(mover: Mover) -> Resources:
    """The CPU, memory and pod slots the mover's replacement will take: its pods' requests."""
    return sum((pod_requests(pod) for pod in mover.pods), Resources())


@dataclass
class Refusals:
    """Running pods with allocated claims that may not move, counted by reason."""

    counts: dict[str, int] = field(default_factory=dict)
    budgets: set[str] = field(default_factory=set)  # "namespace/name" of the budgets that held pods back
    budget_held: list[Mover] = field(default_factory=list)  # the movers those budgets held back

    def describe(self) -> str:
        return ", ".join(f"{n} {r}" for r, n in sorted(self.counts.items())) or "none"

    def held_back(self) -> str:
        """The refusals of pods that opted in (every reason but owner and not_opted_in), in words;
        empty when none was held back."""
        words = {
            "priority": "of higher priority", "min_runtime": "below the minimum runtime",
            "cooldown": "in their owner's cooldown", "gang": "needed by their gang",
            "state": "not running", "budget": "protected by a PodDisruptionBudget",
        }  # fmt: skip
        parts = [f"{n} {words[r]}" for r, n in sorted(self.counts.items()) if r in words]
        if self.budgets:
            parts.append(f"budgets: {', '.join(sorted(self.budgets))}")
        return "; ".join(parts)


def controller_owner(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or ():
        if ref.get("controller"):
            return dict(ref)
    return None


def pod_started(pod: Mapping[str, Any]) -> float | None:
    """``status.startTime`` as seconds since the epoch, or None."""
    text = (pod.get("status") or {}).get("startTime")
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _opted_in(value: Any) -> bool:
    return str(value).lower() == "true"


def _labels(obj: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return ((obj or {}).get("metadata") or {}).get("labels") or {}


def _claim_classes(claim: Mapping[str, Any]) -> set[str]:
    classes: set[str] = set()
    for request in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ():
        exactly = request.get("exactly")
        if exactly is not None:
            classes.add(str(exactly.get("deviceClassName") or ""))
        for sub in request.get("firstAvailable") or ():
            classes.add(str(sub.get("deviceClassName") or ""))
    return classes


def _devices(claim: Mapping[str, Any]) -> list[tuple[DeviceKey, bool]]:
    """(device, shared) per result that is not admin access."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    return [
        ((str(r.get("driver", "")), str(r.get("pool", "")), str(r.get("device", ""))), bool(r.get("shareID")))
        for r in (allocation.get("devices") or {}).get("results") or ()
        if not r.get("adminAccess")
    ]


def build_movers(
    pods: Iterable[dict[str, Any]],
    claims: Mapping[str, dict[str, Any]],
    *,
    waiting_priority: int,
    now: float,
    rules: MoverRules,
    movable_namespaces: frozenset[str] = frozenset(),
    movable_classes: frozenset[str] = frozenset(),
    moved_at: Callable[[str], float | None] = lambda owner_uid: None,
    gang_room: Callable[[dict[str, Any]], int | None] = lambda pod: None,
) -> tuple[list[Mover], Refusals]:
    """The movers among ``pods`` (module docstring) and the refusals of the rest.

    ``claims``: "namespace/name" -> claim. ``moved_at``: when a pod of this owner was last moved
    (epoch seconds) or None. ``gang_room``: None for a pod on its own, else how many running pods
    its gang has above its minimum (0: none may leave).
    """
    refusals = Refusals()
    running = [p for p in pods if not is_terminated(p)]
    by_claim: dict[str, list[dict[str, Any]]] = {}
    for pod in running:
        namespace = pod["metadata"].get("namespace")
        for ref in pod_claim_refs(pod):
            if ref.claim_name:
                by_claim.setdefault(f"{namespace}/{ref.claim_name}", []).append(pod)
    running_by_owner: dict[str, int] = {}
    for pod in running:
        owner = controller_owner(pod)
        if owner is not None and (pod.get("spec") or {}).get("nodeName") and not is_deleting(pod):
            running_by_owner[str(owner.get("uid"))] = running_by_owner.get(str(owner.get("uid")), 0) + 1

    seen: set[str] = set()
    movers: list[Mover] = []
    for pod in sorted(running, key=lambda p: str(object_key(p))):
        key = str(object_key(pod))
        if key in seen:
            continue
        # The pods that share any of this pod's claims, transitively.
        group: dict[str, dict[str, Any]] = {key: pod}
        held: dict[str, dict[str, Any]] = {}
        todo = [pod]
        while todo:
            member = todo.pop()
            namespace = member["metadata"].get("namespace")
            for ref in pod_claim_refs(member):
                claim_key = f"{namespace}/{ref.claim_name}" if ref.claim_name else None
                claim = claims.get(claim_key) if claim_key else None
                if claim_key is None or claim is None or not (claim.get("status") or {}).get("allocation"):
                    continue
                held[claim_key] = claim
                for other in by_claim.get(claim_key, ()):
                    other_key = str(object_key(other))
                    if other_key not in group:
                        group[other_key] = other
                        todo.append(other)
        seen.update(group)
        if not held:
            continue  # holds no device: nothing to free by moving it
        members = [group[k] for k in sorted(group)]
        reason = _refusal(
            members, held.values(), waiting_priority=waiting_priority, now=now, rules=rules,
            movable_namespaces=movable_namespaces, movable_classes=movable_classes, moved_at=moved_at,
            gang_room=gang_room,
        )  # fmt: skip
        if reason is not None:
            refusals.counts[reason] = refusals.counts.get(reason, 0) + len(members)
            continue
        owner = controller_owner(members[0]) or {}
        owner_uid = str(owner.get("uid"))
        devices: dict[DeviceKey, bool] = {}
        nodes: set[str] = set()
        for claim in held.values():
            for device, shared in _devices(claim):
                devices[device] = devices.get(device, True) and shared
            node = allocation_node((claim.get("status") or {}).get("allocation"))
            if node:
                nodes.add(node)
        movers.append(
            Mover(
                key=str(object_key(members[0])),
                pods=tuple(members),
                claims=tuple(held[k] for k in sorted(held)),
                owner_uid=owner_uid,
                owner=f"{owner.get('kind')}/{owner.get('name')}",
                priority=max(pod_priority(p) for p in members),
                devices=frozenset(devices),
                nodes=tuple(sorted(nodes)),
                whole=any(not shared for shared in devices.values()),
                spare=running_by_owner.get(owner_uid, 0) > len(members),
            )
        )
    return movers, refusals


def _refusal(
    pods: list[dict[str, Any]],
    claims: Iterable[dict[str, Any]],
    *,
    waiting_priority: int,
    now: float,
    rules: MoverRules,
    movable_namespaces: frozenset[str],
    movable_classes: frozenset[str],
    moved_at: Callable[[str], float | None],
    gang_room: Callable[[dict[str, Any]], int | None],
) -> str | None:
    owners = {str((controller_owner(p) or {}).get("uid")) for p in pods}
    for pod in pods:
        owner = controller_owner(pod)
        if owner is None or owner.get("kind") not in RECREATING_OWNERS:
            return "owner"
    if len(owners) != 1:
        return "owner"  # pods of two workloads share a claim: no one replacement takes it over
    for pod in pods:
        if is_gated(pod) or is_deleting(pod) or not (pod.get("spec") or {}).get("nodeName"):
            return "state"
    claim_list = list(claims)
    classes = set().union(*(_claim_classes(c) for c in claim_list)) if claim_list else set()
    for pod in pods:
        namespace = str(pod["metadata"].get("namespace"))
        if not (
            _opted_in(_labels(pod).get(MOVABLE_LABEL))
            or namespace in movable_namespaces
            or (classes and classes <= movable_classes)
        ):
            return "not_opted_in"
    if any(pod_priority(p) > waiting_priority for p in pods):
        return "priority"
    for pod in pods:
        started = pod_started(pod)
        if started is None or now - started < rules.min_runtime_seconds:
            return "min_runtime"
    last = moved_at(next(iter(owners)))
    if last is not None and now - last < rules.cooldown_seconds:
        return "cooldown"
    rooms = [gang_room(p) for p in pods]
    gang_members = [r for r in rooms if r is not None]
    if gang_members and min(gang_members) < len(gang_members):
        return "gang"
    return None

"""What a gang needs next, read from the cache: wait, release a half-done allocation, allocate, or
just ungate. Pure over the cache's snapshots (the caller holds ``cache.lock``).

A gang is the gated pods sharing a ``fractional.dev/gang`` label value in a namespace (a gated
pod without the label is a gang of one). It is ready when ``fractional.dev/gang-size`` pods exist
and every claim of every gated pod exists. Claims of any driver are allocated: the allocator
follows upstream semantics over every published slice, so all of a pod's claims land on one node;
leaving another driver's claims to kube-scheduler could pick a node where ours do not fit, and its
PostFilter would then clear our allocation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from driver.controller.cache import ClusterCache, Kind
from driver.controller.objects import (
    GangKey,
    allocation_node,
    gang_size_of,
    has_finalizer,
    is_deleting,
    is_gated,
    object_key,
    pod_claim_refs,
)

__all__ = ["GangPlan", "PodGroup", "plan_gang"]


@dataclass(frozen=True, slots=True)
class PodGroup:
    """Gated pods that must share one node (one pod, or pods sharing an unallocated claim)."""

    pods: tuple[dict[str, Any], ...]
    pending_claims: tuple[dict[str, Any], ...]  # unallocated claims, in pod order, each once
    pinned_node: str | None  # the node of an already-allocated claim of these pods
    conflict: str = ""  # already-allocated claims on different nodes


@dataclass(frozen=True, slots=True)
class GangPlan:
    key: GangKey
    action: str  # idle | wait | release | allocate | ungate
    reason: str = ""
    gated: tuple[dict[str, Any], ...] = ()
    groups: tuple[PodGroup, ...] = ()
    release: tuple[dict[str, Any], ...] = ()  # claims we allocated for a gang left half-done
    size: int = 0
    signature: str = ""  # changes when what the gang asks for changes
    all_pods: tuple[dict[str, Any], ...] = field(default=())


def _is_allocated(claim: dict[str, Any]) -> bool:
    return bool((claim.get("status") or {}).get("allocation"))


def _is_ours(claim: dict[str, Any]) -> bool:
    status = claim.get("status") or {}
    return bool(status.get("allocation")) and has_finalizer(claim) and not status.get("reservedFor")


def plan_gang(cache: ClusterCache, key: GangKey) -> GangPlan:
    pods = [p for p in cache.gang_pods(key) if not is_deleting(p)]
    gated = tuple(p for p in pods if is_gated(p))
    if not gated:
        return GangPlan(key=key, action="idle")
    sizes = [gang_size_of(p) for p in pods]
    if any(size is None for size in sizes):
        return GangPlan(
            key=key, action="wait", reason="fractional.dev/gang-size is not a positive integer", gated=gated
        )
    size = max(s for s in sizes if s is not None)
    if len(pods) < size:
        return GangPlan(
            key=key, action="wait", reason=f"{len(pods)} of {size} pods exist", gated=gated, size=size
        )

    # Resolve each gated pod's claims.
    claims_of: list[list[dict[str, Any]]] = []
    for pod in gated:
        namespace = pod["metadata"]["namespace"]
        resolved: list[dict[str, Any]] = []
        for ref in pod_claim_refs(pod):
            if ref.claim_name is None:
                return GangPlan(
                    key=key,
                    action="wait",
                    gated=gated,
                    size=size,
                    reason=f"pod {pod['metadata']['name']}: claim for {ref.entry} not created yet",
                )
            claim = cache.get(Kind.CLAIM, f"{namespace}/{ref.claim_name}")
            if claim is None or is_deleting(claim):
                return GangPlan(
                    key=key,
                    action="wait",
                    gated=gated,
                    size=size,
                    reason=f"pod {pod['metadata']['name']}: ResourceClaim {ref.claim_name} not found",
                )
            resolved.append(claim)
        claims_of.append(resolved)

    # Group pods that share an unallocated claim (they must share its node).
    parent = list(range(len(gated)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for index, claims in enumerate(claims_of):
        for claim in claims:
            if (claim.get("status") or {}).get("allocation"):
                continue
            claim_key = object_key(claim)
            if claim_key in owner:
                parent[find(index)] = find(owner[claim_key])
            else:
                owner[claim_key] = index

    members: dict[int, list[int]] = {}
    for index in range(len(gated)):
        members.setdefault(find(index), []).append(index)

    groups: list[PodGroup] = []
    pending_total = 0
    for indexes in members.values():
        pending: list[dict[str, Any]] = []
        seen: set[str] = set()
        nodes: set[str] = set()
        for index in indexes:
            for claim in claims_of[index]:
                allocation = (claim.get("status") or {}).get("allocation")
                if allocation:
                    node = allocation_node(allocation)
                    if node:
                        nodes.add(node)
                elif object_key(claim) not in seen:
                    seen.add(object_key(claim))
                    pending.append(claim)
        pending_total += len(pending)
        conflict = (
            f"already-allocated claims are on different nodes: {sorted(nodes)}" if len(nodes) > 1 else ""
        )
        groups.append(
            PodGroup(
                pods=tuple(gated[i] for i in indexes),
                pending_claims=tuple(pending),
                pinned_node=min(nodes) if nodes else None,
                conflict=conflict,
            )
        )

    signature = "|".join(
        p["metadata"]["name"] + ":" + ",".join(f"{object_key(c)}@{_is_allocated(c)}" for c in cs)
        for p, cs in zip(gated, claims_of, strict=True)
    )
    base = GangPlan(
        key=key,
        action="allocate",
        gated=gated,
        groups=tuple(groups),
        size=size,
        signature=signature,
        all_pods=tuple(pods),
    )
    if pending_total == 0:
        return GangPlan(
            key=key,
            action="ungate",
            gated=gated,
            groups=tuple(groups),
            size=size,
            signature=signature,
            all_pods=tuple(pods),
        )

    # A gang half-allocated by us (a crash mid-gang): every pod still gated, some claims ours.
    if len(gated) == len(pods):
        gated_keys = {object_key(p) for p in gated}
        release = []
        for claims in claims_of:
            for claim in claims:
                if not _is_ours(claim) or claim in release:
                    continue
                users = {object_key(u) for u in cache.claim_users(str(object_key(claim)))}
                if users <= gated_keys:
                    release.append(claim)
        if release:
            return GangPlan(
                key=key,
                action="release",
                gated=gated,
                release=tuple(release),
                size=size,
                reason="gang was left half-allocated",
                signature=signature,
                all_pods=tuple(pods),
            )
    return base

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
from driver.controller.kueue import reservation_wait_reason
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

__all__ = ["MAX_GANG_PODS", "GangPlan", "PodGroup", "held_claims", "plan_gang"]

MAX_GANG_PODS = 4096  # a gang-size annotation above this is refused, not searched for


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
    invalid: tuple[tuple[Kind, dict[str, Any], str], ...] = ()  # objects rejected when read, and why


def _is_allocated(claim: dict[str, Any]) -> bool:
    return bool((claim.get("status") or {}).get("allocation"))


def _is_ours(claim: dict[str, Any]) -> bool:
    status = claim.get("status") or {}
    return bool(status.get("allocation")) and has_finalizer(claim) and not status.get("reservedFor")


def held_claims(cache: ClusterCache, gated: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
    """Claims of ``gated`` pods that we allocated and that nothing else uses: no pod outside these
    (a gated pod being deleted never ran, so it does not count). What a gang that cannot complete
    gives back."""
    gated_keys = {object_key(p) for p in gated}
    held: list[dict[str, Any]] = []
    seen: set[str] = set()
    for pod in gated:
        namespace = pod["metadata"]["namespace"]
        for ref in pod_claim_refs(pod):
            claim_key = f"{namespace}/{ref.claim_name}"
            claim = cache.get(Kind.CLAIM, claim_key) if ref.claim_name else None
            if claim is None or claim_key in seen or not _is_ours(claim):
                continue
            if cache.rejection(Kind.CLAIM, claim_key) is not None:
                continue  # never written back as read (it was cut when decoded)
            seen.add(claim_key)
            users = cache.claim_users(claim_key)
            if all(object_key(u) in gated_keys or (is_gated(u) and is_deleting(u)) for u in users):
                held.append(claim)
    return tuple(held)


def _cannot_complete(cache: ClusterCache, plan: GangPlan) -> GangPlan:
    """A gang that must wait gives back what a half-done placement left it (a crash, a lost lease, a
    pod or claim deleted meanwhile): it allocates again, whole, once it can complete."""
    release = held_claims(cache, plan.gated)
    if not release:
        return plan
    return GangPlan(
        key=plan.key, action="release", gated=plan.gated, release=release, size=plan.size,
        reason=f"gang cannot complete ({plan.reason}); releasing a half-done allocation",
        invalid=plan.invalid,
    )  # fmt: skip


def plan_gang(cache: ClusterCache, key: GangKey) -> GangPlan:
    pods = [p for p in cache.gang_pods(key) if not is_deleting(p)]
    gated = tuple(p for p in pods if is_gated(p))
    if not gated:
        return GangPlan(key=key, action="idle")
    if kueue_reason := reservation_wait_reason(gated):  # issue 14: Kueue's gate, or the check places them
        return GangPlan(key=key, action="wait", reason=kueue_reason, gated=gated)
    invalid = tuple(
        (Kind.POD, p, reason)
        for p in gated
        if (reason := cache.rejection(Kind.POD, str(object_key(p)))) is not None
    )
    if invalid:
        return _cannot_complete(
            cache, GangPlan(key=key, action="wait", reason="a pod was rejected", gated=gated, invalid=invalid)
        )
    sizes = [gang_size_of(p) for p in pods]
    if any(size is None for size in sizes):
        return _cannot_complete(
            cache,
            GangPlan(
                key=key,
                action="wait",
                reason="fractional.dev/gang-size is not a positive integer",
                gated=gated,
            ),
        )
    size = max(s for s in sizes if s is not None)
    if size > MAX_GANG_PODS:
        return _cannot_complete(
            cache,
            GangPlan(key=key, action="wait", gated=gated,
                     reason=f"fractional.dev/gang-size {size} is over the limit of {MAX_GANG_PODS} pods"),
        )  # fmt: skip
    # Once a pod of the gang was ungated the gang is committed (ungating is the commit point):
    # the rest of it follows even when a member has gone since; it is not held back or released.
    committed = any(not is_gated(p) for p in pods)
    if len(pods) < size and not committed:
        return _cannot_complete(
            cache,
            GangPlan(
                key=key, action="wait", reason=f"{len(pods)} of {size} pods exist", gated=gated, size=size
            ),
        )

    # Resolve each gated pod's claims.
    claims_of: list[list[dict[str, Any]]] = []
    rejected: list[tuple[Kind, dict[str, Any], str]] = []
    for pod in gated:
        namespace = pod["metadata"]["namespace"]
        resolved: list[dict[str, Any]] = []
        for ref in pod_claim_refs(pod):
            if ref.claim_name is None:
                return _cannot_complete(
                    cache,
                    GangPlan(key=key, action="wait", gated=gated, size=size,
                             reason=f"pod {pod['metadata']['name']}: claim for {ref.entry} not created yet"),
                )  # fmt: skip
            claim = cache.get(Kind.CLAIM, f"{namespace}/{ref.claim_name}")
            if claim is None or is_deleting(claim):
                return _cannot_complete(
                    cache,
                    GangPlan(key=key, action="wait", gated=gated, size=size,
                             reason=f"pod {pod['metadata']['name']}: ResourceClaim {ref.claim_name} "
                             + ("not found" if claim is None else "is being deleted")),
                )  # fmt: skip
            reason = cache.rejection(Kind.CLAIM, f"{namespace}/{ref.claim_name}")
            if reason is not None:
                rejected.append((Kind.CLAIM, claim, reason))
            resolved.append(claim)
        claims_of.append(resolved)
    if rejected:
        return _cannot_complete(
            cache,
            GangPlan(key=key, action="wait", gated=gated, size=size, reason="a claim was rejected",
                     invalid=tuple(rejected)),
        )  # fmt: skip

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
        release = held_claims(cache, gated)
        if release:
            return GangPlan(
                key=key,
                action="release",
                gated=gated,
                release=release,
                size=size,
                reason="gang was left half-allocated",
                signature=signature,
                all_pods=tuple(pods),
            )
    return base

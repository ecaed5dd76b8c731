"""What a gang needs next, read from the cache: wait, release a half-done allocation, allocate, or
just ungate. Pure over the cache's snapshots (the caller holds ``cache.lock``).

A gang is the gated pods sharing one identity (``gang_identity``: a PodGroup, a Workload's pod
group, our ``fractional.dev/gang`` label, or a third-party marker; a gated pod without one is a
gang of one). Its first ``minCount`` pods (by name) are placed together when that many exist and
every claim of theirs exists; pods beyond ``minCount``, and every pod of a ``basic`` policy, are
then placed one by one as they come, never by taking devices from the first ones; such a pod of a
kube-scheduler gang (a ``scheduling.k8s.io`` PodGroup or Workload) that does not fit is handed to
kube-scheduler ungated (``hand_over_unfit``), because kube-scheduler binds no pod of the group
while one still carries a scheduling gate (kube-scheduler 1.37.2, GenericWorkload). When
kube-scheduler's gang PostFilter clears our allocations before the pods bind, the gang is planned
again as a whole. Claims of any driver are allocated: the allocator follows upstream semantics
over every published slice, so all of a pod's claims land on one node;
leaving another driver's claims to kube-scheduler could pick a node where ours do not fit, and its
PostFilter would then clear our allocation.

A claim that serves exactly one gated pod of the placement (made from its template, or named by it
alone, and not one of its PodGroup's claims) is reserved for that pod in the write of its allocation
(``GangPlan.reserved_for``): kube-scheduler's PreBind then finds it reserved and writes nothing.
Whether an allocation is still ours to give back is read from its reservation
(``reservation_of``): reserved for nobody, for a pod never bound (gated, or not bound yet), or for a
pod seen deleted is as good as unreserved; a bound pod, several consumers or a PodGroup are not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from driver.controller.kueue.check import reservation_wait_reason
from driver.controller.model.gang_identity import (
    GangSpec,
    binds_to_podgroup,
    identify,
    podgroup_claim,
    resolve,
)
from driver.controller.model.objects import (
    GangKey,
    allocated_by_us,
    allocation_node,
    has_finalizer,
    is_deleting,
    is_gated,
    object_key,
    placed_by_us,
    pod_claim_refs,
    pod_consumer,
    reserved_pods,
)
from driver.controller.view.cache import ClusterCache, Kind

__all__ = [
    "MAX_GANG_PODS",
    "GangPlan",
    "PodGroup",
    "Reservation",
    "gang_spec",
    "held_claims",
    "plan_gang",
    "reservation_of",
]

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
    topology_key: str | None = None  # every pod on nodes sharing this label's value
    target: dict[str, Any] | None = None  # the PodGroup (or Workload) Events also go to
    # A pod of a committed kube-scheduler gang (beyond minCount) that does not fit now is handed to
    # kube-scheduler ungated, not held: kube-scheduler binds none of the group while one is gated.
    hand_over_unfit: bool = False
    # (claim key, pod name, pod UID): a pending claim that serves that one pod alone, reserved for
    # it in the write of its allocation.
    reserved_for: tuple[tuple[str, str, str], ...] = ()

    def consumer_of(self, claim_key: str) -> dict[str, str] | None:
        """The ``status.reservedFor`` entry to write with this claim's allocation, or None (a claim
        several pods share, or a PodGroup's: kube-scheduler reserves it)."""
        for key, name, uid in self.reserved_for:
            if key == claim_key:
                return {"resource": "pods", "name": name, "uid": uid}
        return None


class Reservation(StrEnum):
    """What a claim's ``status.reservedFor`` says about who may be using it (``reservation_of``)."""

    NONE = "none"  # reserved for nobody
    UNBOUND = "unbound"  # for one pod, known and not bound to a node: nothing of it runs
    GONE = "gone"  # for one pod seen deleted
    UNKNOWN = "unknown"  # for one pod this controller has not seen: only the API can say
    IN_USE = "in-use"  # for a bound pod, several consumers, or a PodGroup


def reservation_of(cache: ClusterCache, claim: dict[str, Any]) -> tuple[Reservation, dict[str, Any] | None]:
    """Classify the claim's reservation, with the reserved pod when the cache holds it (under
    ``cache.lock``). A pod that is gated or being deleted cannot be bound (kube-apiserver refuses the
    binding), and one that is not bound ran nothing with the claim: an allocation reserved for it
    alone is ours to give back as if unreserved, kube-scheduler's PostFilter rule
    (``len(reservedFor) == 1 && uid == pod``) seen from our side."""
    pods = reserved_pods(claim)
    if pods is None or len(pods) > 1:
        return Reservation.IN_USE, None
    if not pods:
        return Reservation.NONE, None
    ((name, uid),) = pods
    namespace = (claim.get("metadata") or {}).get("namespace")
    pod = cache.get(Kind.POD, f"{namespace}/{name}")
    if pod is not None and str(pod["metadata"].get("uid")) == uid:
        if (pod.get("spec") or {}).get("nodeName"):
            return Reservation.IN_USE, pod
        return Reservation.UNBOUND, pod
    if cache.seen_deleted(uid):
        return Reservation.GONE, None
    return Reservation.UNKNOWN, None


def _is_allocated(claim: dict[str, Any]) -> bool:
    return bool((claim.get("status") or {}).get("allocation"))


def _is_ours(cache: ClusterCache, claim: dict[str, Any]) -> bool:
    """Allocated by us (``allocated_by_us``) and reserved for nobody, for a gated pod or for a pod
    gone."""
    if not allocated_by_us(claim):
        return False
    reservation, pod = reservation_of(cache, claim)
    if reservation is Reservation.UNBOUND:
        return pod is not None and is_gated(pod)
    return reservation in (Reservation.NONE, Reservation.GONE)


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
            if claim is None or claim_key in seen or not _is_ours(cache, claim):
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


def gang_spec(cache: ClusterCache, pods: list[dict[str, Any]]) -> GangSpec:
    """The gang's spec, read from its first pod's identity and the cached gang objects."""
    ref = identify(pods[0], cache.gang_sources)

    def lookup(kind: str, key: str) -> dict[str, Any] | None:
        return cache.get(Kind(kind), key)

    return resolve(ref, lookup)


def _placement_undone(cache: ClusterCache, pod: dict[str, Any]) -> bool:
    """An ungated pod, not bound, that we placed (``placed_by_us``; or with a claim carrying the
    finalizer of an earlier version), with a claim that lost its allocation and is reserved for
    nobody: kube-scheduler's gang PostFilter cleared it (it clears the reservation with the
    allocation: ``reservedFor`` is only allowed while allocated)."""
    if is_gated(pod) or (pod.get("spec") or {}).get("nodeName"):
        return False
    placed = placed_by_us(pod)
    namespace = pod["metadata"]["namespace"]
    for ref in pod_claim_refs(pod):
        claim = cache.get(Kind.CLAIM, f"{namespace}/{ref.claim_name}") if ref.claim_name else None
        if claim is not None and (placed or has_finalizer(claim)) \
                and not (claim.get("status") or {}).get("allocation") \
                and not (claim.get("status") or {}).get("reservedFor"):  # fmt: skip
            return True
    return False


def _single_pod_claims(
    cache: ClusterCache,
    gated: tuple[dict[str, Any], ...],
    claims_of: list[list[dict[str, Any]]],
    podgroup_claims: set[str],
) -> tuple[tuple[str, str, str], ...]:
    """(claim key, pod name, pod UID) of each pending claim that serves exactly one pod of ``gated``,
    a pod still gated: no other pod the cache knows names it, it is not one of a PodGroup's claims,
    and it is not owned by another pod (a claim made from a template is owned by its pod). A pod
    placed again after kube-scheduler's PostFilter cleared its claims is ungated, in kube-scheduler's
    hands already: its claims are left for kube-scheduler to reserve, as they were before."""
    found: dict[str, tuple[str, str, str]] = {}
    for pod, claims in zip(gated, claims_of, strict=True):
        meta = pod["metadata"]
        uid = str(meta.get("uid") or "")
        if not is_gated(pod):
            continue
        for claim in claims:
            claim_key = str(object_key(claim))
            if not uid or _is_allocated(claim) or claim_key in podgroup_claims or claim_key in found:
                continue
            owner = next(
                (o for o in claim["metadata"].get("ownerReferences") or () if o.get("controller")), None
            )
            if owner is not None and owner.get("kind") == "Pod" and str(owner.get("uid")) != uid:
                continue
            users = cache.claim_users(claim_key)
            if len(users) == 1 and str(users[0]["metadata"].get("uid")) == uid:
                consumer = pod_consumer(pod)
                found[claim_key] = (claim_key, consumer["name"], consumer["uid"])
    return tuple(found.values())


def _one_by_one(cache: ClusterCache, gated: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
    """Pods placed one by one (a basic policy, or beyond minCount): those whose claims are all
    allocated (just ungate them), else the first gated pod alone; the next follows when it is ungated."""
    ready = []
    for pod in gated:
        namespace = pod["metadata"]["namespace"]
        refs = pod_claim_refs(pod)
        claims = [
            cache.get(Kind.CLAIM, f"{namespace}/{r.claim_name}") if r.claim_name else None for r in refs
        ]
        if all(c is not None and _is_allocated(c) for c in claims):
            ready.append(pod)
    return tuple(ready) or gated[:1]


def plan_gang(cache: ClusterCache, key: GangKey) -> GangPlan:
    pods = [p for p in cache.gang_pods(key) if not is_deleting(p)]
    gated = tuple(p for p in pods if is_gated(p))
    replanning = False
    if not gated:
        gated = tuple(p for p in pods if _placement_undone(cache, p))
        if not gated:
            return GangPlan(key=key, action="idle")
        replanning = True  # kube-scheduler's PostFilter cleared our allocations: place them again, whole
    if kueue_reason := reservation_wait_reason(gated):  # Kueue's gate, or the check places them
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
    spec = gang_spec(cache, pods)
    if spec.invalid or spec.waiting:
        return _cannot_complete(
            cache, GangPlan(key=key, action="wait", reason=spec.invalid or spec.waiting, gated=gated,
                            target=spec.target),
        )  # fmt: skip
    size = len(pods) if spec.whole or spec.min_count is None else spec.min_count
    if size > MAX_GANG_PODS:
        return _cannot_complete(
            cache,
            GangPlan(key=key, action="wait", gated=gated,
                     reason=f"gang size {size} is over the limit of {MAX_GANG_PODS} pods"),
        )  # fmt: skip
    # Once a pod of the gang was ungated the gang is committed (ungating is the commit point):
    # the rest of it follows even when a member has gone since; it is not held back or released.
    committed = any(not is_gated(p) for p in pods) and not replanning
    if len(pods) < size and not committed:
        return _cannot_complete(
            cache,
            GangPlan(
                key=key,
                action="wait",
                reason=f"{len(pods)} of {size} pods exist",
                gated=gated,
                size=size,
                target=spec.target,
            ),
        )
    # Pod by pod (no gang, or the pods beyond minCount), else the first minCount pods together; the
    # rest follow one by one once these are placed.
    gated = _one_by_one(cache, gated) if spec.basic or committed else gated[:size]

    # Resolve each gated pod's claims.
    claims_of: list[list[dict[str, Any]]] = []
    podgroup_claims: set[str] = set()  # claims a PodGroup's pods share: kube-scheduler reserves them
    rejected: list[tuple[Kind, dict[str, Any], str]] = []
    for pod in gated:
        namespace = pod["metadata"]["namespace"]
        resolved: list[dict[str, Any]] = []
        for ref in pod_claim_refs(pod):
            if ref.claim_name is None:
                ref = podgroup_claim(pod, ref, spec)
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
            if binds_to_podgroup(pod, ref.entry, spec):
                podgroup_claims.add(str(object_key(claim)))
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
        f"{p['metadata']['name']}/{p['metadata'].get('uid')}:"
        + ",".join(f"{object_key(c)}@{_is_allocated(c)}" for c in cs)
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
        topology_key=spec.topology_key,
        target=spec.target,
        hand_over_unfit=committed and spec.scheduler_gang,
        reserved_for=_single_pod_claims(cache, gated, claims_of, podgroup_claims),
    )
    if pending_total == 0 and not (len(gated) == 1 and size <= 1 and not pod_claim_refs(gated[0])):
        # Every claim is allocated already: nothing to decide. (A lone gated pod without claims is
        # decided: we choose its node, so that it does not take CPU where GPUs need it.)
        return GangPlan(
            key=key,
            action="ungate",
            gated=gated,
            groups=tuple(groups),
            size=size,
            signature=signature,
            all_pods=tuple(pods),
            target=spec.target,
        )

    # A gang half-allocated by us (a crash mid-gang): every pod still gated, some claims ours.
    if not committed:
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

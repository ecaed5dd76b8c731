"""Choose allocations for a ready gang: one allocator call for all of its pending claims, then a
node-fit check of each pod's CPU/memory/pod-count requests; a node that fails it is excluded and
the allocator asked again (bounded). Runs under ``cache.lock``; no I/O.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from driver.controller.gangs.nodefit import node_rejection
from driver.controller.gangs.plan import GangPlan, PodGroup
from driver.controller.model.objects import (
    Resources,
    allocation_node,
    object_key,
    pod_claim_refs,
    pod_requests,
)
from driver.controller.view.cache import ClusterCache, Kind

__all__ = [
    "Decision",
    "Exclusions",
    "allocate_groups",
    "assume_decision",
    "decide",
    "demand_key",
    "group_node",
    "learn_plan",
    "node_fit",
    "placement_spec",
    "room_exclusions",
    "short_dimension",
    "static_exclusions",
    "tentative_allocations",
    "without_devices",
]

MAX_NODE_FIT_ATTEMPTS = 8
FRAGMENTATION = "fragmentation"  # the policy that ranks a pod's nodes by the fragment it adds
RANKED_TRIES = 4  # ranked nodes tried before the best-fit path decides


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: str  # allocated | unschedulable
    allocations: tuple[tuple[dict[str, Any], dict[str, Any]], ...] = ()  # (claim, status.allocation)
    pod_nodes: tuple[tuple[dict[str, Any], str | None], ...] = ()  # (pod, node it will run on)
    reason: str = ""
    short_of: str = "devices"  # unschedulable: what is short (devices | CPU | memory | pod count)


def short_dimension(shortfall: str) -> str:
    """The node-fit dimension a ``Resources.shortfall`` text names: CPU, memory or pod count."""
    text = shortfall.split(": ", 1)[-1]
    if text.startswith("cpu"):
        return "CPU"
    if text.startswith("memory"):
        return "memory"
    return "pod count"


@contextmanager
def tentative_allocations(
    cache: ClusterCache, pairs: list[tuple[dict[str, Any], dict[str, Any]]]
) -> Iterator[None]:
    """Count ``pairs`` as allocated in the allocator state for the duration of the block."""
    added: list[dict[str, Any]] = []
    try:
        for claim, allocation in pairs:
            assumed = copy.deepcopy(claim)
            assumed.setdefault("status", {})["allocation"] = allocation
            added.append(claim)
            cache.state.upsert_claim(assumed)
        yield
    finally:
        for claim in added:
            current = cache.claim_as_counted(str(object_key(claim)))
            cache.state.upsert_claim(current if current is not None else claim)


def allocate_groups(
    cache: ClusterCache,
    groups: tuple[PodGroup, ...],
    *,
    policy: str,
    exclude_nodes: frozenset[str],
) -> list[tuple[dict[str, Any], dict[str, Any]]] | None:
    """Allocate every pending claim of ``groups`` in the cluster state, or None when they cannot all fit.

    Groups pinned to a node (by a claim allocated earlier) are allocated there first and held as
    tentative allocations while the free groups are allocated together in one call.
    """
    pinned = [g for g in groups if g.pinned_node is not None and g.pending_claims]
    free = [g for g in groups if g.pinned_node is None and g.pending_claims]
    chosen: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for group in pinned:
        if group.conflict or group.pinned_node in exclude_nodes:
            return None
        with tentative_allocations(cache, chosen):
            result = cache.state.allocate(list(group.pending_claims), node=group.pinned_node, policy=policy)
        if result is None:
            return None
        chosen.extend(zip(group.pending_claims, result, strict=True))
    if free:
        claims: list[dict[str, Any]] = []
        pod_groups: list[list[int]] = []
        for group in free:
            pod_groups.append(list(range(len(claims), len(claims) + len(group.pending_claims))))
            claims.extend(group.pending_claims)
        with tentative_allocations(cache, chosen):
            result = cache.state.allocate(
                claims, node=None, policy=policy, pod_groups=pod_groups, exclude_nodes=exclude_nodes
            )
        if result is None:
            return None
        chosen.extend(zip(claims, result, strict=True))
    return chosen


def placement_spec(pod: dict[str, Any]) -> str:
    """What of a pod decides which nodes it may run on (nodeSelector, affinity, tolerations), as a key."""
    spec = pod.get("spec") or {}
    return repr((spec.get("nodeSelector"), spec.get("affinity"), spec.get("tolerations")))


class Exclusions:
    """Static exclusions: each distinct pod placement spec (nodeSelector, affinity, tolerations) is
    judged once per node, and the answer kept in the cache until a Node's labels or spec change or
    a node gains or loses slices (``ClusterCache.exclusion_memo``): a decision does not walk every
    Node again."""

    def __init__(self, cache: ClusterCache) -> None:
        self._cache = cache
        self._by_spec = cache.exclusion_memo()
        orphans = self._by_spec.get("orphans")
        if orphans is None:
            nodes = {str(n["metadata"]["name"]) for n in cache.objects(Kind.NODE)}
            slice_nodes = {
                str(s["spec"]["nodeName"])
                for s in cache.objects(Kind.SLICE)
                if (s.get("spec") or {}).get("nodeName")
            }
            orphans = self._by_spec["orphans"] = frozenset(name for name in slice_nodes if name not in nodes)
        self._orphans = orphans

    def rejecting(self, pod: dict[str, Any]) -> frozenset[str]:
        """Nodes kube-scheduler would not put ``pod`` on (``nodefit.node_rejection``)."""
        key = placement_spec(pod)
        found = self._by_spec.get(key)
        if found is None:
            nodes = self._cache.objects(Kind.NODE)
            found = frozenset(str(n["metadata"]["name"]) for n in nodes if node_rejection(pod, n))
            self._by_spec[key] = found
        return found

    def of(self, plan: GangPlan) -> frozenset[str]:
        excluded = set(self._orphans)
        for group in plan.groups:
            if group.pending_claims:
                for pod in group.pods:
                    excluded |= self.rejecting(pod)
        return frozenset(excluded)


def room_exclusions(
    cache: ClusterCache, plan: GangPlan, *, memo: dict[Resources, frozenset[str]] | None = None
) -> frozenset[str]:
    """Nodes that cannot take even the smallest pod of ``plan`` that still needs devices (its CPU,
    memory and pod slot, against what is bound or placed there now): the allocator never looks at
    them. Exact for a gang of one; for larger gangs ``node_fit`` still checks the pods together.
    ``memo`` keeps the answer per smallest pod while nothing is assumed (one burst): the scan is of
    every node."""
    wanting = [pod_requests(p) for g in plan.groups if g.pending_claims for p in g.pods]
    if not wanting:
        return frozenset()
    smallest = Resources(
        min(r.cpu_millis for r in wanting), min(r.memory_bytes for r in wanting), min(r.pods for r in wanting)
    )
    if memo is None:
        return cache.nodes_without_room(smallest)
    if smallest not in memo:
        memo[smallest] = cache.nodes_without_room(smallest)
    return memo[smallest]


def static_exclusions(cache: ClusterCache, plan: GangPlan) -> frozenset[str]:
    """Nodes no pod with pending claims could run on: cordoned, unmatched selectors/affinity,
    untolerated taints, or slices published for a node that has no Node object."""
    return Exclusions(cache).of(plan)


def group_node(group: PodGroup, allocations: dict[str, dict[str, Any]]) -> str | None:
    if group.pinned_node:
        return group.pinned_node
    for claim in group.pending_claims:
        node = allocation_node(allocations.get(str(object_key(claim))))
        if node:
            return node
    return None


def node_fit(
    cache: ClusterCache,
    plan: GangPlan,
    chosen: list[tuple[dict[str, Any], dict[str, Any]]],
) -> tuple[list[tuple[dict[str, Any], str | None]], str | None, str]:
    """Each pod's node, and the first node whose CPU/memory/pods it overflows (with the shortfall)."""
    by_claim = {str(object_key(c)): a for c, a in chosen}
    usage: dict[str, Resources] = {}
    pod_nodes: list[tuple[dict[str, Any], str | None]] = []
    for group in plan.groups:
        node = group_node(group, by_claim)
        for pod in group.pods:
            pod_nodes.append((pod, node))
            allocatable = None if node is None else cache.allocatable(node)
            if node is None or allocatable is None:
                continue
            requests = pod_requests(pod)
            if node not in usage:
                usage[node] = cache.node_usage(node)
            free = allocatable - usage[node]
            if not requests.fits_within(free):
                return pod_nodes, node, f"{node}: {requests.shortfall(free)}"
            usage[node] = usage[node] + requests
    return pod_nodes, None, ""


def demand_key(plan: GangPlan) -> tuple[Any, ...] | None:
    """What ``decide`` reads of a plan, its names and UIDs aside: two plans with the same key get the
    same answer from the same cluster (their pending claims' specs, each pod's requests, where it
    may run, how many claims it has and its priority, which decides the preemptor's nominations it
    must leave alone, in the same groups). None for a plan that depends on more
    (a claim already allocated pins its pods to a node; a topology domain counts the pods bound)."""
    if plan.topology_key is not None or any(g.pinned_node or g.conflict for g in plan.groups):
        return None
    groups = []
    for group in plan.groups:
        specs = tuple(json.dumps(c.get("spec"), sort_keys=True) for c in group.pending_claims)
        pods = []
        for pod in group.pods:
            priority = (pod.get("spec") or {}).get("priority")
            pods.append((pod_requests(pod), placement_spec(pod), len(pod_claim_refs(pod)), priority))
        groups.append((specs, tuple(pods)))
    return tuple(groups)


def decide(
    cache: ClusterCache, plan: GangPlan, *, policy: str, extra_exclude: frozenset[str] = frozenset()
) -> Decision:
    """Node usage counts bound pods and pods we ungated that kube-scheduler has not bound yet.
    ``extra_exclude``: nodes outside the topology domain being tried (``topology.py``)."""
    if without_devices(plan):
        pod = plan.groups[0].pods[0]
        rejecting = Exclusions(cache).rejecting(pod) | cache.nodes_without_room(pod_requests(pod))
        return _node_for_pod_without_devices(cache, plan, rejecting | extra_exclude, policy=policy)
    static = set(static_exclusions(cache, plan)) | extra_exclude
    no_room = room_exclusions(cache, plan) - static
    excluded = static | no_room
    fits_nowhere = False  # the fragmentation ranking found no node with room that takes the devices
    if policy == FRAGMENTATION:
        ranked = _ranked_decision(cache, plan, frozenset(excluded))
        if isinstance(ranked, Decision):
            return ranked
        fits_nowhere = ranked is NOWHERE
    last_shortfall = ""
    for _attempt in range(MAX_NODE_FIT_ATTEMPTS):
        chosen = (
            None
            if fits_nowhere
            else allocate_groups(cache, plan.groups, policy=policy, exclude_nodes=frozenset(excluded))
        )
        if chosen is None:
            if not last_shortfall and no_room:
                last_shortfall = _shortfall_elsewhere(cache, plan, frozenset(static), no_room, policy=policy)
            if not last_shortfall:
                return Decision(outcome="unschedulable", reason="devices do not fit")
            # The devices fit only on nodes the pods' requests overflow: name what those nodes lack.
            short = short_dimension(last_shortfall)
            return Decision(
                outcome="unschedulable",
                reason=f"node {short} is short where the devices fit ({last_shortfall})",
                short_of=short,
            )
        pod_nodes, misfit, shortfall = node_fit(cache, plan, chosen)
        if misfit is None:
            return Decision(outcome="allocated", allocations=tuple(chosen), pod_nodes=tuple(pod_nodes))
        last_shortfall = shortfall
        excluded.add(misfit)
    short = short_dimension(last_shortfall)
    return Decision(
        outcome="unschedulable", reason=f"node {short} is short ({last_shortfall})", short_of=short
    )


def without_devices(plan: GangPlan) -> bool:
    """One gated pod that asks for no devices at all (it carries our gate: its namespace opted in)."""
    if len(plan.groups) != 1 or len(plan.groups[0].pods) != 1:
        return False
    group = plan.groups[0]
    return not group.pending_claims and group.pinned_node is None and not pod_claim_refs(group.pods[0])


def _node_for_pod_without_devices(
    cache: ClusterCache, plan: GangPlan, excluded: frozenset[str], *, policy: str
) -> Decision:
    """The node for a pod without devices, which the pod is pinned to when ungated (a nodeSelector
    on the node's hostname label: a gated pod may narrow where it runs). fragmentation: the node
    where its CPU strands the least device memory for the typical workload; best-fit: the node with
    the least free device memory (GPUs taken already), then the least CPU left; first-fit: the first
    by name. Nodes without a hostname label cannot be pinned and are left out."""
    pod = plan.groups[0].pods[0]
    requests = pod_requests(pod)
    chosen: str | None = None
    if policy == FRAGMENTATION:
        ranked = cache.state.rank_nodes_without_devices(
            cpu_millis=requests.cpu_millis,
            cpu_free=cache.cpu_free,
            exclude_nodes=_Unpinnable(cache, excluded),
            limit=1,
        )
        chosen = ranked[0] if ranked else None
    nodes = [] if chosen else [n for n in cache.state.node_names() if n not in excluded and cache.hostname(n)]
    if chosen is None and nodes:
        if policy == "first-fit":
            chosen = min(nodes)
        else:
            free = cache.state.node_free
            chosen = min(nodes, key=lambda n: (free.get(n, 0), cache.cpu_free(n) - requests.cpu_millis, n))
    if chosen is None:
        return Decision(
            outcome="unschedulable",
            reason="no node has room for the pod's CPU, memory and a pod slot",
            short_of="CPU",
        )
    return Decision(outcome="allocated", pod_nodes=((pod, chosen),))


class _Unpinnable:
    """The nodes a pod without devices may not go to: those ``excluded``, and those without a
    hostname label to pin it with (asked only of the nodes a ranking offers)."""

    def __init__(self, cache: ClusterCache, excluded: frozenset[str]) -> None:
        self._cache, self._excluded = cache, excluded

    def __contains__(self, node: object) -> bool:
        return node in self._excluded or not self._cache.hostname(str(node))


class _Nowhere:
    """The ranking's answer that no node outside those excluded takes the pod's devices and CPU."""


NOWHERE = _Nowhere()


def _one_free_pod(plan: GangPlan) -> PodGroup | None:
    """The plan's group when it is one pod with claims to allocate and no node chosen for it."""
    if len(plan.groups) != 1:
        return None
    group = plan.groups[0]
    if len(group.pods) != 1 or group.pinned_node or group.conflict or not group.pending_claims:
        return None
    return group


def ranked_by_model(cache: ClusterCache, plan: GangPlan) -> bool:
    """Whether the fragmentation policy ranks the plan's nodes (one free pod of a shape the model
    scores, once a workload is learned); every other plan is decided as best-fit decides it."""
    group = _one_free_pod(plan)
    if group is None:
        return False
    return cache.state.ranks(list(group.pending_claims), cpu_millis=pod_requests(group.pods[0]).cpu_millis)


def _ranked_nodes(cache: ClusterCache, plan: GangPlan, excluded: frozenset[str]) -> list[str] | None:
    """``ClusterState.rank_nodes`` for a plan of one free pod, its first ``RANKED_TRIES`` nodes
    (empty: no node takes it); None when the plan is not one such pod or the model does not rank it."""
    group = _one_free_pod(plan)
    if group is None:
        return None
    requests = pod_requests(group.pods[0])
    return cache.state.rank_nodes(
        list(group.pending_claims),
        cpu_millis=requests.cpu_millis,
        cpu_free=cache.cpu_free,
        exclude_nodes=excluded,
        limit=RANKED_TRIES,
    )


def _nodes_taking(cache: ClusterCache, plan: GangPlan, nodes: Sequence[str]) -> list[str] | None:
    """``ClusterState.nodes_taking`` for a plan of one free pod; None as ``_ranked_nodes``."""
    group = _one_free_pod(plan)
    if group is None:
        return None
    return cache.state.nodes_taking(
        list(group.pending_claims),
        cpu_millis=pod_requests(group.pods[0]).cpu_millis,
        cpu_free=cache.cpu_free,
        nodes=nodes,
    )


def _ranked_decision(
    cache: ClusterCache, plan: GangPlan, excluded: frozenset[str]
) -> Decision | _Nowhere | None:
    """One pod's claims on the node that adds the least fragment (``ClusterState.rank_nodes``): the
    first of the best ``RANKED_TRIES`` where its claims allocate. ``NOWHERE`` when the ranking says
    no node takes them (the ranking's fit is exact for the shapes it scores: the caller need not
    search again). None when the plan is not one free pod, the model does not score its shape, or
    no ranked node takes it: the caller decides as best-fit does."""
    ranked = _ranked_nodes(cache, plan, excluded)
    if ranked is None:
        return None
    if not ranked:
        return NOWHERE
    claims = list(plan.groups[0].pending_claims)
    for node in ranked[:RANKED_TRIES]:
        result = cache.state.allocate(claims, node=node, policy=FRAGMENTATION)
        if result is None:
            continue
        chosen = list(zip(claims, result, strict=True))
        pod_nodes, misfit, _ = node_fit(cache, plan, chosen)
        if misfit is None:
            return Decision(outcome="allocated", allocations=tuple(chosen), pod_nodes=tuple(pod_nodes))
    return None


def _shortfall_elsewhere(
    cache: ClusterCache,
    plan: GangPlan,
    static: frozenset[str],
    no_room: frozenset[str],
    *,
    policy: str,
) -> str:
    """The devices do not fit on the nodes with room: would they fit on the others (``no_room``)?
    Then name what those lack (the pods wait for CPU or memory, not devices). Empty when they fit
    nowhere. A plan of one pod group goes on one node, and none with room takes it, so only the
    nodes without room are searched (a pod that fits nowhere is the trace's most common failure);
    a larger gang may mix the two."""
    exclude = static
    if len(plan.groups) == 1:
        candidates: Collection[str] = no_room
        if policy == FRAGMENTATION:  # the fragmentation model knows where the devices fit
            taking = _nodes_taking(cache, plan, sorted(no_room))
            if taking is not None:
                if not taking:
                    return ""
                candidates = frozenset(taking)
        exclude = static | frozenset(n for n in cache.state.node_names() if n not in candidates)
    chosen = allocate_groups(cache, plan.groups, policy=policy, exclude_nodes=exclude)
    if chosen is None:
        return ""
    return node_fit(cache, plan, chosen)[2]


def assume_decision(cache: ClusterCache, decision: Decision) -> None:
    """Count an allocated decision at once (devices, and the pods' CPU/memory on their nodes), so the
    next decision sees it while the writers are still writing it."""
    cache.assume_allocations(list(decision.allocations))
    for pod, node in decision.pod_nodes:
        if node:
            cache.assume_placement(str(object_key(pod)), node, pod_requests(pod))


def learn_plan(cache: ClusterCache, plan: GangPlan) -> None:
    """Count the plan's pods in the typical workload (the fragmentation policy's), each once, when
    first decided, whether they are placed or not: the workload is what arrives. A pod counts with
    its own claims still to allocate, or as a pod without devices when it refers to no claim."""
    for group in plan.groups:
        pending = {str(object_key(claim)): claim for claim in group.pending_claims}
        for pod in group.pods:
            if cache.has_learned(pod):  # a pod waiting is decided again each pass
                continue
            namespace = pod["metadata"].get("namespace")
            refs = pod_claim_refs(pod)
            own = [pending[k] for r in refs if (k := f"{namespace}/{r.claim_name}") in pending]
            if own or not refs:
                cache.learn_pod(pod, own)

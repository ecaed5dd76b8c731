"""A gang's topology constraint (``schedulingConstraints.topology[].key``, at most one): every pod
on nodes sharing that node label's value. Each domain (a value of the label) is tried on its own,
as kube-scheduler's topology-aware workload scheduling (KEP-5732) runs one placement per value;
of the domains that fit, the fullest (least free device memory before placement: the tightest fit)
is chosen, so emptier domains stay whole for larger gangs. When none fits, the reason names the
domain that came closest (the most pods placed greedily). Runs under ``cache.lock``; no I/O.
"""

from __future__ import annotations

from typing import Any

from driver.controller.gangs.decide import Decision, decide, tentative_allocations
from driver.controller.gangs.plan import GangPlan
from driver.controller.model.objects import allocation_node, is_gated, pod_claim_refs
from driver.controller.view.cache import ClusterCache, Kind

__all__ = ["decide_in_domains", "domains"]


def domains(nodes: list[dict[str, Any]], key: str) -> dict[str, frozenset[str]]:
    """Label value -> the nodes carrying it (nodes without the label are in no domain)."""
    found: dict[str, set[str]] = {}
    for node in nodes:
        value = (node["metadata"].get("labels") or {}).get(key)
        if value is not None:
            found.setdefault(str(value), set()).add(str(node["metadata"]["name"]))
    return {value: frozenset(names) for value, names in sorted(found.items())}


def _pods_that_fit(cache: ClusterCache, plan: GangPlan, exclude: frozenset[str], policy: str) -> int:
    """How many of the gang's pods fit in a domain when its pod groups are placed one by one."""
    chosen: list[tuple[dict[str, Any], dict[str, Any]]] = []
    placed = 0
    for group in plan.groups:
        if not group.pending_claims:
            placed += len(group.pods)
            continue
        node = group.pinned_node
        if node is not None and node in exclude:
            continue
        with tentative_allocations(cache, chosen):
            result = cache.state.allocate(
                list(group.pending_claims), node=node, policy=policy, exclude_nodes=exclude
            )
        if result is not None:
            chosen.extend(zip(group.pending_claims, result, strict=True))
            placed += len(group.pods)
    return placed


def _placed_nodes(cache: ClusterCache, plan: GangPlan) -> set[str]:
    """Nodes the gang's ungated pods run on or were allocated for (bound, or their claims' node)."""
    nodes: set[str] = set()
    for pod in plan.all_pods:
        if is_gated(pod):
            continue
        if (pod.get("spec") or {}).get("nodeName"):
            nodes.add(str(pod["spec"]["nodeName"]))
            continue
        namespace = pod["metadata"]["namespace"]
        for ref in pod_claim_refs(pod):
            claim = cache.get(Kind.CLAIM, f"{namespace}/{ref.claim_name}") if ref.claim_name else None
            node = allocation_node(((claim or {}).get("status") or {}).get("allocation"))
            if node:
                nodes.add(node)
    return nodes


def decide_in_domains(cache: ClusterCache, plan: GangPlan, *, policy: str) -> Decision:
    """Pods placed after the gang's first ones (beyond minCount) stay in the domain those hold."""
    key = plan.topology_key
    assert key is not None
    nodes = cache.objects(Kind.NODE)
    everything = frozenset(str(n["metadata"]["name"]) for n in nodes) | frozenset(cache.state.node_free)
    found = domains(nodes, key)
    held = {value for value, members in found.items() if members & _placed_nodes(cache, plan)}
    if held:
        found = {value: members for value, members in found.items() if value in held}
    fitting: list[tuple[float, str, Decision]] = []
    for value, members in found.items():
        decision = decide(cache, plan, policy=policy, extra_exclude=everything - members)
        if decision.outcome == "allocated":
            free = float(sum(cache.state.node_free.get(n, 0) for n in members))
            fitting.append((free, value, decision))
    if fitting:
        return min(fitting, key=lambda item: (item[0], item[1]))[2]
    total = sum(len(g.pods) for g in plan.groups)
    if not found:
        return Decision(outcome="unschedulable", reason=f"topology {key}: no node carries the label")
    counts = {
        value: _pods_that_fit(cache, plan, everything - members, policy) for value, members in found.items()
    }
    closest = max(counts, key=lambda value: (counts[value], -len(value)))
    return Decision(
        outcome="unschedulable",
        reason=f"topology {key}: no domain has room for the pods; closest is {key}={closest} "
        f"({counts[closest]} of {total} pods fit)",
    )

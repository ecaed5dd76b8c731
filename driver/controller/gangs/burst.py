"""Ready gangs decided together, in one pass of the decider (``cache.lock`` taken per step; no I/O).

Gangs whose pods are free to go anywhere are placed in one ``allocate_many`` call (a burst packs
better decided together); the rest, and any gang the burst could not place, are decided one at a
time afterwards: in its topology's domains (``topology``) or on the whole cluster (``decide``).
Under the fragmentation policy, a pod whose nodes the model ranks is one of the rest: the model
ranks its nodes against the cluster as the pods before it left it. Each allocated decision is
assumed into the cache before the next one is made.
"""

from __future__ import annotations

from typing import Any

from driver.allocator import GroupAllocationError
from driver.controller.gangs.decide import (
    FRAGMENTATION,
    Decision,
    Exclusions,
    assume_decision,
    decide,
    demand_key,
    learn_plan,
    node_fit,
    ranked_by_model,
    room_exclusions,
    without_devices,
)
from driver.controller.gangs.plan import GangPlan
from driver.controller.gangs.topology import decide_in_domains
from driver.controller.model.objects import Resources
from driver.controller.view.cache import ClusterCache
from driver.errors import AllocationError

__all__ = ["decide_all"]


def decide_all(
    cache: ClusterCache, plans: list[GangPlan], *, policy: str
) -> list[Decision | AllocationError]:
    """Decide ready gangs together; each allocated decision is assumed before the next is made.
    Gangs whose pods are not pinned to a node by an earlier allocation are placed in one
    ``allocate_many`` call (a burst packs better decided together); a gang that did not fit there,
    or whose pods overflow a node's CPU/memory, is decided again on its own afterwards. One entry
    per plan, in order: a Decision, or the fatal AllocationError.

    ``cache.lock`` is taken for the burst, then for each gang decided on its own (it is
    re-entrant: a caller that holds it keeps it for the whole pass)."""
    with cache.lock:
        if policy == FRAGMENTATION:
            for plan in plans:
                learn_plan(cache, plan)
        results = _burst(cache, plans, policy=policy)
    # A gang that asks what one before it in this pass could not have is not decided again: the
    # pass only takes room, so it cannot fit either (a backlog of like pods that do not fit: one
    # search over the cluster per pass, not one per pod).
    unfit: dict[tuple[Any, ...], Decision] = {}
    for index, plan in enumerate(plans):
        if results[index] is not None:
            continue
        key = demand_key(plan)
        if key is not None and key in unfit:
            results[index] = unfit[key]
            continue
        with cache.lock:
            try:
                if plan.topology_key is not None:  # one domain at a time
                    decision = decide_in_domains(cache, plan, policy=policy)
                else:
                    decision = decide(cache, plan, policy=policy)
            except AllocationError as error:
                results[index] = error
                continue
            if decision.outcome == "allocated":
                assume_decision(cache, decision)
            elif key is not None:
                unfit[key] = decision
        results[index] = decision
    return [r for r in results if r is not None]


def _burst(
    cache: ClusterCache, plans: list[GangPlan], *, policy: str
) -> list[Decision | AllocationError | None]:
    """The burst of ``decide_all`` (``cache.lock`` held): an entry per plan placed, None for the rest."""
    results: list[Decision | AllocationError | None] = [None] * len(plans)
    batch = [
        i for i, plan in enumerate(plans)
        if plan.topology_key is None and not any(g.pinned_node or g.conflict for g in plan.groups)
        and not without_devices(plan)
        # fragmentation ranks each such pod's nodes in turn; the rest go as under best-fit
        and not (policy == FRAGMENTATION and ranked_by_model(cache, plan))
    ]  # fmt: skip
    if len(batch) > 1:
        exclusions = Exclusions(cache)
        # Each plan's excluded nodes, once per burst: nothing is assumed until the burst is placed,
        # so a retry after a group that did not fit sees the same ones; plans whose smallest pod is
        # the same share the scan of every node's room (a backlog of like pods: one scan).
        without_room: dict[Resources, frozenset[str]] = {}
        excluded = {
            index: exclusions.of(plans[index]) | room_exclusions(cache, plans[index], memo=without_room)
            for index in batch
        }
        while batch:
            groups, pod_groups, excludes = [], [], []
            for index in batch:
                claims: list[dict[str, Any]] = []
                members: list[list[int]] = []
                for group in plans[index].groups:
                    if group.pending_claims:
                        members.append(list(range(len(claims), len(claims) + len(group.pending_claims))))
                        claims.extend(group.pending_claims)
                groups.append(claims)
                pod_groups.append(members)
                excludes.append(excluded[index])
            try:
                placed = cache.state.allocate_many(
                    groups, node=None, policy=policy, pod_groups=pod_groups, exclude_nodes=excludes
                )
            except GroupAllocationError as error:
                results[batch[error.group]] = error.cause
                del batch[error.group]
                continue
            for index, claims, allocations in zip(batch, groups, placed, strict=True):
                if allocations is None:
                    continue  # decided on its own below, after the others are counted
                chosen = list(zip(claims, allocations, strict=True))
                pod_nodes, misfit, _ = node_fit(cache, plans[index], chosen)
                if misfit is None:
                    decision = Decision(
                        outcome="allocated", allocations=tuple(chosen), pod_nodes=tuple(pod_nodes)
                    )
                    assume_decision(cache, decision)
                    results[index] = decision
            break
    return results

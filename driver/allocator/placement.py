"""Placement: node mode (one node, like kube-scheduler's Filter) and cluster mode (choose nodes, gangs).

Node mode runs the per-node search; best-fit first (bounded), then first-fit when best-fit finds
nothing or runs out of budget, so best-fit never fails where first-fit succeeds.

Cluster mode places pod groups (claims that must share a node) one after another, each tentatively
applied to the ledger so later groups see it, and undoes everything unless every group fits (a gang is
all-or-nothing). Candidate nodes come from the free-capacity index when every request of the group
asks for the same indexed capacity (``memory``): only nodes with a device that has enough free are
looked at, in best-fit order (shared devices in use first, a single share going to the fullest by
all of a device's capacities, ``room_score``, then unused devices); otherwise all nodes are scanned.
Nodes that cannot take a group are remembered per (group signature, node version), and infeasible
gangs are rejected by capacity pre-checks (total free, per-node free, devices per node) before any
search.
Multi-group gangs first try one node for everything, then prefer nodes the gang already uses, then
nodes sharing the topology label value, then the nodes with the most free capacity.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from driver.allocator.backends import backend_for
from driver.allocator.capacity import CAPACITY_WEIGHTS, compute_consumption, room_score, room_term
from driver.allocator.model import Claim, Request, parse_claim
from driver.allocator.quantity import Number
from driver.allocator.results import render_allocation
from driver.allocator.search import BudgetExceeded, NodeSearch, Solution, distinct_slots
from driver.allocator.state import ClusterData, LedgerEntry
from driver.errors import AllocationError

__all__ = [
    "POLICIES",
    "Placed",
    "hold_solutions",
    "ledger_of",
    "parse_claims",
    "pod_groups_of",
    "render_placed",
    "solve",
]

POLICIES = ("fragmentation", "best-fit", "first-fit")
"""``fragmentation`` ranks the nodes of a one-claim pod by ``ClusterState.rank_nodes`` (the caller
asks); everything the allocator chooses itself under it is chosen as under ``best-fit``."""

BEST_FIT_BUDGET = 20_000
SINGLE_NODE_GANG_BUDGET = 2_000  # a non-final attempt: the gang is placed pod by pod next
FIRST_FIT_BUDGET = 200_000  # roughly kube-scheduler's 10 s Filter timeout, in Python steps
FEASIBLE_NODES_COMPARED = 8
GANG_SINGLE_NODE_TRIES = 64
SCORED_DEVICES = 512  # in-use devices scored by every capacity per single-share placement, at most


class _InvalidPools(Exception):
    """No solution on this node and one of its pools is invalid (node-local error upstream)."""


def search_node(
    state: ClusterData, node: str, claims: Sequence[Claim], best_fit: bool, *, exhaustive: bool = True
) -> Solution | None:
    """``exhaustive=False``: best-fit's bounded search only, no first-fit fallback. For attempts whose
    failure is not final (a gang tried on one node before it is placed pod by pod): proving that
    nine identical pods do not fit on eight GPUs would otherwise walk every order of them."""
    view = state.view(node)
    slots = sum(
        len(slot.alternatives[0:1]) * max(1, slot.alternatives[0].count) for c in claims for slot in c.slots
    )
    if best_fit:
        try:
            solution = NodeSearch(
                state=state, node=node, pools=view.pools, candidates=view.candidates, claims=claims,
                best_fit=True, budget=BEST_FIT_BUDGET if exhaustive else SINGLE_NODE_GANG_BUDGET,
                max_solutions=1 if slots <= 1 else FEASIBLE_NODES_COMPARED,
            ).run()  # fmt: skip
            if solution is not None:
                return solution
        except BudgetExceeded:
            pass
        if not exhaustive:
            return None
    try:
        solution = NodeSearch(
            state=state, node=node, pools=view.pools, candidates=view.candidates, claims=claims,
            best_fit=False, budget=FIRST_FIT_BUDGET,
        ).run()  # fmt: skip
    except BudgetExceeded:
        solution = None
    if solution is None and view.has_invalid:
        raise _InvalidPools()
    return solution


Placed = list[tuple[str, Solution]]  # per pod group: (node, solution of its claims)


def parse_claims(state: ClusterData, raw_claims: Sequence[Mapping[str, Any]], policy: str) -> list[Claim]:
    if policy not in POLICIES:
        raise AllocationError(f"policy: unknown policy {policy!r} (expected {', '.join(POLICIES)})")
    state.refresh()
    return [parse_claim(raw, state.classes) for raw in raw_claims]


def solve(
    state: ClusterData,
    claims: Sequence[Claim],
    *,
    node: str | None,
    best_fit: bool,
    groups: Sequence[tuple[int, ...]],
    exclude_nodes: frozenset[str] | set[str],
) -> Placed | None:
    """Where ``claims`` go (all or none), without rendering; holds nothing when it returns.

    Node mode (``node`` set): one pod group of every claim on that node. Cluster mode: one entry per
    pod group of ``groups`` (see ``pod_groups``), each on one node.
    """
    if node is not None:
        try:
            solution = search_node(state, node, claims, best_fit)
        except _InvalidPools:
            raise AllocationError(f"node {node}: invalid resource pools were encountered") from None
        return None if solution is None else [(node, solution)]
    return _Gang(state, claims, groups, best_fit, exclude_nodes).place()


def render_placed(
    claims: Sequence[Claim], groups: Sequence[tuple[int, ...]], placed: Placed, rng: random.Random | None
) -> list[dict[str, Any]]:
    """``status.allocation`` dicts, one per claim in order."""
    allocations: list[dict[str, Any] | None] = [None] * len(claims)
    for group, (chosen, solution) in zip(groups, placed, strict=True):
        for claim_index, entries in zip(group, solution.entries, strict=True):
            allocations[claim_index] = render_allocation(claims[claim_index], entries, chosen, rng)
    return [a for a in allocations if a is not None]


def ledger_of(solution: Solution) -> tuple[LedgerEntry, ...]:
    """What ``solution`` would hold in the ledger (admin results hold nothing, as upstream)."""
    entries = []
    for claim_entries in solution.entries:
        for entry in claim_entries:
            if entry.request.admin:
                continue
            device = entry.candidate.device
            consumed = tuple(entry.consumed.items()) if entry.consumed is not None else ()
            backend = backend_for(entry.request.backends, device.id[0]) if device.allow_multiple else None
            entries.append(LedgerEntry(device.id, device.allow_multiple, consumed, backend))
    return tuple(entries)


def hold_solutions(state: ClusterData, placed: Placed) -> list[str]:
    """Hold every solution of ``placed`` in ``state``; the uids to ``release``."""
    return [state.hold(ledger_of(solution)) for _, solution in placed]


def pod_groups_of(
    pod_groups: Sequence[Sequence[int]] | None, count: int, node: str | None
) -> list[tuple[int, ...]]:
    """The pod groups placement works on: node mode has one (every claim), cluster mode ``pod_groups``
    with every claim not listed as a group of its own."""
    if node is not None:
        return [tuple(range(count))]
    return _groups(pod_groups, count)


def _groups(pod_groups: Sequence[Sequence[int]] | None, count: int) -> list[tuple[int, ...]]:
    groups: list[tuple[int, ...]] = []
    seen: set[int] = set()
    for group in pod_groups or ():
        members = tuple(i for i in group if i not in seen)
        for index in members:
            if not 0 <= index < count:
                raise AllocationError(f"pod_groups: claim index {index} is out of range 0..{count - 1}")
            seen.add(index)
        if members:
            groups.append(members)
    groups.extend((i,) for i in range(count) if i not in seen)
    return groups


def _single_share(claims: Sequence[Claim]) -> Request | None:
    """The request of a group that is one claim asking for one device with capacities, else None."""
    if len(claims) != 1 or len(claims[0].slots) != 1 or claims[0].constraints:
        return None
    alternatives = claims[0].slots[0].alternatives
    if len(alternatives) != 1:
        return None
    request = alternatives[0]
    if request.all_mode or request.count != 1 or not request.capacity or request.admin:
        return None
    return request


def _indexed_demand(claims: Sequence[Claim], state: ClusterData) -> tuple[str, Number, Number] | None:
    """(capacity key, a device size some device must offer, smallest total) when every request asks for one
    indexed key. Both numbers are lower bounds: for a firstAvailable request the smallest alternative counts.
    """
    key = None
    largest: Number = 0
    total: Number = 0
    for claim in claims:
        for slot in claim.slots:
            smallest = None
            smallest_single: Number | None = None
            for request in slot.alternatives:
                if request.all_mode or not request.capacity:
                    return None
                asked = dict(request.capacity)
                if key is None:
                    key = next((k for k in asked if k in state.indexes), None)
                    if key is None:
                        return None
                if key not in asked:
                    return None
                single = asked[key]
                smallest_single = single if smallest_single is None else min(smallest_single, single)
                need = single * request.count
                smallest = need if smallest is None else min(smallest, need)
            total += smallest or 0
            largest = max(largest, smallest_single or 0)
    if key is None:
        return None
    return key, largest, total


class _Gang:
    def __init__(
        self,
        state: ClusterData,
        claims: Sequence[Claim],
        groups: Sequence[tuple[int, ...]],
        best_fit: bool,
        exclude: frozenset[str] | set[str],
    ) -> None:
        self.state = state
        self.claims = claims
        self.groups = groups
        self.best_fit = best_fit
        self.exclude = exclude
        self._nodes: list[str] | None = None
        self.tentative: list[str] = []

    @property
    def nodes(self) -> list[str]:
        """Candidate nodes in name order (built only by the paths that scan nodes)."""
        if self._nodes is None:
            exclude = self.exclude
            names = self.state.node_names()
            self._nodes = [n for n in names if n not in exclude] if exclude else list(names)
        return self._nodes

    def allowed(self, node: str) -> bool:
        return node not in self.exclude and self.state.is_node(node)

    # ------------------------------------------------------------ the gang

    def place(self) -> list[tuple[str, Solution]] | None:
        state = self.state
        if not self.state.node_names():
            return None
        if not self._prechecks():
            return None
        try:
            if len(self.groups) > 1 and self.best_fit:
                whole = self._single_node()
                if whole is not None:
                    return whole
            order = list(range(len(self.groups)))
            if self.best_fit:
                order.sort(key=lambda g: -(self._demand(self.groups[g]) or (0, 0, 0))[2])
            chosen: dict[int, tuple[str, Solution]] = {}
            used: list[str] = []
            for group_index in order:
                group_claims = [self.claims[i] for i in self.groups[group_index]]
                choice = self._choose(group_claims, used, multi=len(self.groups) > 1)
                if choice is None:
                    return None
                chosen[group_index] = choice
                if choice[0] not in used:
                    used.append(choice[0])
                self._hold(choice[1])
            return [chosen[g] for g in range(len(self.groups))]
        finally:
            for uid in self.tentative:
                state.release(uid)

    def _hold(self, solution: Solution) -> None:
        self.tentative.append(self.state.hold(ledger_of(solution)))

    def _demand(self, group: Sequence[int]) -> tuple[str, Number, Number] | None:
        return _indexed_demand([self.claims[i] for i in group], self.state)

    def _prechecks(self) -> bool:
        """Cheap necessary conditions for indexed demands: total free, per-node free, devices per node."""
        state = self.state
        most = state.max_candidates()
        for group in self.groups:
            for i in group:
                for slot in self.claims[i].slots:
                    fewest = min((r.count for r in slot.alternatives if not r.all_mode), default=0)
                    if fewest > most:
                        return False  # one request needs more distinct devices than any node has
        demands = [self._demand(g) for g in self.groups]
        if any(d is None for d in demands) or state.has_global_pools:
            return True
        total = sum(d[2] for d in demands if d is not None)
        if len({d[0] for d in demands if d is not None}) == 1 and state.total_free < total:
            return False
        simple = (
            len(self.groups) == 1
            and all(len(c.slots) == 1 and c.slots[0].alternatives[0].count == 1 for c in self.claims)
            and len(self.claims) == 1
        )
        if simple:
            return True  # the index walk itself rejects a single device request quickly
        best_node_free = max((state.node_free.get(n, 0) for n in self.nodes), default=0)
        for group, demand in zip(self.groups, demands, strict=True):
            assert demand is not None
            key, largest, group_total = demand
            if group_total > best_node_free:
                return False
            counts = [slot.alternatives[0].count for i in group for slot in self.claims[i].slots]
            counts += [distinct_slots(self.claims[i], c) for i in group for c in self.claims[i].constraints
                       if c.kind == "distinct"]  # fmt: skip
            needed_devices = max(counts, default=1)
            if needed_devices > 1:
                per_node: dict[str, int] = {}
                enough = False
                for (node, _), _in_use, _free in state.indexes[key].iter_at_least(largest):
                    if self.allowed(node):
                        per_node[node] = per_node.get(node, 0) + 1
                        if per_node[node] >= needed_devices:
                            enough = True
                            break
                if not enough:
                    return False
        return True

    def _single_node(self) -> list[tuple[str, Solution]] | None:
        claims = [self.claims[i] for group in self.groups for i in group]
        demand = _indexed_demand(claims, self.state)
        tries = 0
        for node in self._nodes_by_free(demand[2] if demand else 0):
            tries += 1
            if tries > GANG_SINGLE_NODE_TRIES:
                break
            solution = self._evaluate(node, claims, exhaustive=False)
            if solution is None:
                continue
            result = []
            offset = 0
            for group in self.groups:
                part = Solution(solution.entries[offset : offset + len(group)], solution.score)
                offset += len(group)
                result.append((node, part))
            return result
        return None

    # ------------------------------------------------------------ one group

    def _signature(self, claims: Sequence[Claim], exhaustive: bool = True) -> Any:
        return (tuple(c.signature for c in claims), self.best_fit, exhaustive)

    def _evaluate(
        self,
        node: str,
        claims: Sequence[Claim],
        *,
        exhaustive: bool = True,
        signature: Any = None,
        memo: dict[str, tuple[int, int]] | None = None,
    ) -> Solution | None:
        """The node's solution for ``claims``, or None; a None is remembered until the node changes.
        A caller trying many nodes passes ``signature`` and its ``memo`` (``infeasible_memo``)."""
        state = self.state
        if signature is None:
            signature = self._signature(claims, exhaustive)
        if memo is None:
            memo = state.infeasible_memo(signature)
        version = state.node_version(node)
        if memo.get(node) == version:
            return None
        try:
            solution = search_node(state, node, claims, self.best_fit, exhaustive=exhaustive)
        except _InvalidPools:
            solution = None
        if solution is None:
            state.remember_infeasible(signature, node, version)
        return solution

    def _choose(
        self, claims: Sequence[Claim], used: Sequence[str], *, multi: bool
    ) -> tuple[str, Solution] | None:
        if used:
            found = [(n, s) for n in used if (s := self._evaluate(n, claims)) is not None]
            if found:
                return min(found, key=lambda item: (item[1].score, self.state.node_free.get(item[0], 0)))
            label = self.state.topology_label
            zone = self.state.labels(used[0]).get(label)
            if zone is not None:
                same = self._pick(claims, lambda n: self.state.labels(n).get(label) == zone, multi)
                if same is not None:
                    return same
        return self._pick(claims, None, multi)

    def _pick(self, claims: Sequence[Claim], accept: Any, multi: bool) -> tuple[str, Solution] | None:
        found: list[tuple[str, Solution]] = []
        first_rank: Any = None
        examined = 0
        signature = self._signature(claims)
        memo = self.state.infeasible_memo(signature)
        for node, rank in self._candidates(claims, multi):
            if accept is not None and not accept(node):
                continue
            if found and self.best_fit and rank is not None:
                if rank != first_rank:
                    break
                examined += 1
                if examined > FEASIBLE_NODES_COMPARED:
                    break
                fullest = min(self.state.node_free.get(n, 0) for n, _ in found)
                if not multi and self.state.node_free.get(node, 0) >= fullest:
                    continue  # same device rank: only a fuller node can win the tie-break
            solution = self._evaluate(node, claims, signature=signature, memo=memo)
            if solution is None:
                continue
            if not self.best_fit:
                return node, solution
            if not found:
                first_rank = rank
            found.append((node, solution))
            if len(found) >= FEASIBLE_NODES_COMPARED:
                break
        if not found:
            return None
        if multi:
            return min(found, key=lambda item: (item[1].score, -self.state.node_free.get(item[0], 0)))
        return min(found, key=lambda item: (item[1].score, self.state.node_free.get(item[0], 0), item[0]))

    def _candidates(self, claims: Sequence[Claim], multi: bool) -> Iterator[tuple[str, Any]]:
        """Nodes worth a search, best first, with a rank (index bucket) where the index produced them."""
        state = self.state
        demand = _indexed_demand(claims, state)
        if demand is None or state.has_global_pools:
            if not self.best_fit:
                yield from ((n, None) for n in self.nodes)
            else:
                yield from ((n, None) for n in self._nodes_by_free(0, emptiest_first=multi))
            return
        key, largest, total = demand
        if multi and self.best_fit:
            yield from ((n, None) for n in self._nodes_by_free(total))
            return
        seen: set[str] = set()
        if not self.best_fit:
            for (node, _), _in_use, _free in state.indexes[key].iter_at_least(largest):
                if self.allowed(node):
                    seen.add(node)
            yield from ((n, None) for n in sorted(seen))
            return
        share = _single_share(claims)
        if share is not None:
            for node, score in self._scored_share_nodes(key, largest, share):
                if node not in seen:
                    seen.add(node)
                    yield node, ("scored", score)
        # A share goes to devices that may be shared before it takes one that may not whole; a request
        # for whole devices the other way round.
        index = state.indexes[key]
        for (node, _), in_use, free in index.iter_at_least(largest, unshareable_first=share is None):
            if node in seen or not self.allowed(node):
                continue
            seen.add(node)
            yield node, (in_use, free)

    def _scored_share_nodes(self, key: str, largest: Number, request: Request) -> list[tuple[str, float]]:
        """Nodes of the in-use shared devices that can take ``request``, fullest first by every
        capacity (``room_score``, the load before the share), not by memory alone.

        The index lists in-use devices by ascending free memory, so the memory part of the score only
        grows along the walk: it stops once that part alone passes the best score found (exact for
        devices of one size, a heuristic across sizes), or after SCORED_DEVICES devices.
        """
        state = self.state
        scored: list[tuple[float, float, int, str]] = []
        best: float | None = None
        examined = 0
        for (node, device_id), in_use, free in state.indexes[key].iter_at_least(largest):
            if not in_use or examined >= SCORED_DEVICES:
                break
            if not self.allowed(node):
                continue
            device = state.indexed_device(device_id)
            if device is None:
                continue
            examined += 1
            used = 1.0 - float(free) / float(device.capacity[key].value)
            if best is not None and CAPACITY_WEIGHTS.get(key, 1.0) * room_term(used) > best:
                break
            committed = state.committed_consumed(device_id)
            consumed = compute_consumption(device, request.capacity, committed, None)
            if consumed is None:
                continue
            score = room_score(device, committed)
            after = room_score(device, committed, consumed)  # ties: the device the share fills most
            scored.append((score, after, len(scored), node))
            best = score if best is None else min(best, score)
        scored.sort()
        return [(node, score) for score, _, _, node in scored]

    def _nodes_by_free(self, at_least: Number, *, emptiest_first: bool = True) -> Iterator[str]:
        """The nodes with at least ``at_least`` free, emptiest (or fullest) first, ties by name,
        from the order the state keeps (``nodes_by_free``): a pick stops after a few nodes, and
        ordering every node for every gang took a fifth of the controller's CPU at 5,000 nodes
        (py-spy, the production-size bench's fill)."""
        exclude = self.exclude
        for node in self.state.nodes_by_free(at_least, emptiest_first=emptiest_first):
            if node not in exclude:
                yield node

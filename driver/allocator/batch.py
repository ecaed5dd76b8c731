"""Bursts: many independent groups placed together (docs/architecture.md: Contracts, ``allocate_many``).

A group is one pod's claims or a whole gang; each is all-or-nothing on its own, and a group that does
not fit never stops the others. Groups are placed largest first by their normalised demand (each
requested capacity divided by the largest device's value of it; a request without capacities asks
for a whole device), each tentatively held so the next sees it, and everything is released before
returning: ``allocate_many`` holds nothing, like ``allocate``.

With best-fit, each pass then compacts: for each device the pass opened, least loaded first, its
groups are moved onto devices already in use (the device blocked meanwhile), and the move is kept
only when every one of them finds room without opening another device; the groups that did not fit
are then tried once more, so each one left out was refused beside the final placement of the others.

A few orders are tried and the pass that places the most groups, then the most demand, then opens
the fewest devices is kept: largest first by the largest normalised dimension of a group, and with
best-fit also by the sum of its dimensions and by each dimension alone; last, the input (arrival)
order, so a batch never places fewer groups than deciding them one by one would. Vector bin packing
has no single best order; a handful of passes is cheap next to what a badly packed GPU costs.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from driver.allocator.model import Claim, DeviceID
from driver.allocator.placement import (
    Placed,
    hold_solutions,
    parse_claims,
    pod_groups_of,
    render_placed,
    solve,
)
from driver.allocator.state import ClusterData, LedgerEntry
from driver.errors import AllocationError

__all__ = ["GroupAllocationError", "demand_of", "place_many"]

PORTFOLIO_MAX_GROUPS = 400  # above this, one largest-first pass (each pass costs one allocation per group)
WHOLE_DEVICE = 1.0
ALL_MODE_DEMAND = 1e9  # "every matching device": placed first


class GroupAllocationError(AllocationError):
    """A fatal allocation error (upstream's sense) in one group of a batch; ``group`` is its index."""

    def __init__(self, *, group: int, cause: AllocationError) -> None:
        super().__init__(f"group {group}: {cause}")
        self.group = group
        self.cause = cause


@dataclass(frozen=True, slots=True)
class _Group:
    index: int
    claims: tuple[Claim, ...]
    pods: tuple[tuple[int, ...], ...]
    exclude: frozenset[str] | set[str]
    demand: dict[str, float]  # capacity key (or "" for whole devices) -> normalised demand


def demand_of(claims: Sequence[Claim], scale: Mapping[str, float]) -> dict[str, float]:
    """Normalised demand of ``claims``: per capacity key, requested / the largest device value of it,
    summed over requests (their first alternative: the one the search tries first). A request without
    capacities counts one whole device in every dimension ("" stands for all of them)."""
    demand: dict[str, float] = {}
    for claim in claims:
        for slot in claim.slots:
            request = slot.alternatives[0]
            if request.all_mode:
                demand[""] = demand.get("", 0.0) + ALL_MODE_DEMAND
                continue
            if not request.capacity:
                demand[""] = demand.get("", 0.0) + WHOLE_DEVICE * request.count
                continue
            for key, value in request.capacity:
                largest = scale.get(key)
                if largest:
                    demand[key] = demand.get(key, 0.0) + float(value) / largest * request.count
    return demand


def _size(demand: Mapping[str, float], key: str | None) -> float:
    whole = demand.get("", 0.0)
    if key is None:
        return whole + max((v for k, v in demand.items() if k), default=0.0)
    if key == "+":
        return whole * max(1, len(demand) - 1) + sum(v for k, v in demand.items() if k)
    return whole + demand.get(key, 0.0)


def _orders(groups: Sequence[_Group], best_fit: bool) -> list[list[int]]:
    """Largest first by the largest dimension, (best-fit) by the sum and by each dimension; then the
    input order."""
    keys: list[str | None] = [None]
    if best_fit and len(groups) <= PORTFOLIO_MAX_GROUPS:
        dimensions = sorted({k for g in groups for k in g.demand if k})
        if len(dimensions) > 1:
            keys += ["+", *dimensions]
    orders: list[list[int]] = []
    for key in keys:
        order = sorted(range(len(groups)), key=lambda i: -_size(groups[i].demand, key))  # stable
        if order not in orders:
            orders.append(order)
    arrival = list(range(len(groups)))
    if len(groups) <= PORTFOLIO_MAX_GROUPS and arrival not in orders:
        orders.append(arrival)
    return orders


def _devices(result: Placed) -> set[DeviceID]:
    return {
        entry.candidate.device.id
        for _, solution in result
        for claim_entries in solution.entries
        for entry in claim_entries
    }


def _in_use(state: ClusterData, device_id: DeviceID) -> bool:
    return bool(state.share_count(device_id) or state.exclusive_in_use(device_id))


class _Pass:
    """One pass over the groups in one order, holding what it places until ``release``."""

    def __init__(
        self, state: ClusterData, groups: Sequence[_Group], node: str | None, best_fit: bool
    ) -> None:
        self.state = state
        self.groups = groups
        self.node = node
        self.best_fit = best_fit
        self.placed: dict[int, Placed] = {}
        self.held: dict[int, list[str]] = {}
        self.opened: dict[DeviceID, None] = {}  # devices unused before this pass, in opening order

    def solve(self, position: int) -> Placed | None:
        group = self.groups[position]
        try:
            return solve(
                self.state, group.claims, node=self.node, best_fit=self.best_fit, groups=group.pods,
                exclude_nodes=group.exclude,
            )  # fmt: skip
        except AllocationError as error:
            raise GroupAllocationError(group=group.index, cause=error) from error

    def keep(self, position: int, result: Placed) -> None:
        for device_id in _devices(result):
            if not _in_use(self.state, device_id):
                self.opened[device_id] = None
        self.placed[position] = result
        self.held[position] = hold_solutions(self.state, result)

    def drop(self, position: int) -> Placed:
        for uid in self.held.pop(position):
            self.state.release(uid)
        return self.placed.pop(position)

    def run(self, order: Sequence[int]) -> None:
        for position in order:
            if not self.groups[position].claims:
                self.placed[position] = []
                self.held[position] = []
                continue
            result = self.solve(position)
            if result is not None:
                self.keep(position, result)

    def compact(self) -> None:
        """Try to empty each device this pass opened, least loaded first: move its groups onto devices
        already in use (the device itself blocked meanwhile); keep the move only if every group found
        room without opening another device."""
        for device_id in sorted(self.opened, key=self._load):
            users = [p for p, result in self.placed.items() if device_id in _devices(result)]
            if not users:
                continue
            old = {p: self.drop(p) for p in users}
            block = self.state.hold((LedgerEntry(device_id, False, ()),))
            moved: list[int] = []
            for position in sorted(users, key=lambda p: -_size(self.groups[p].demand, None)):
                result = self.solve(position)
                if result is None or any(not _in_use(self.state, d) for d in _devices(result)):
                    break
                self.placed[position] = result
                self.held[position] = hold_solutions(self.state, result)
                moved.append(position)
            self.state.release(block)
            if len(moved) == len(users):
                del self.opened[device_id]
                continue
            for position in moved:
                self.drop(position)
            for position, result in old.items():
                self.placed[position] = result
                self.held[position] = hold_solutions(self.state, result)

    def _load(self, device_id: DeviceID) -> float:
        load = 0.0
        for position, result in self.placed.items():
            if device_id in _devices(result):
                load += _size(self.groups[position].demand, "+")
        return load

    def release(self) -> None:
        for uids in self.held.values():
            for uid in uids:
                self.state.release(uid)
        self.held.clear()


def _one_pass(
    state: ClusterData, groups: Sequence[_Group], order: Sequence[int], node: str | None, best_fit: bool
) -> dict[int, Placed]:
    one = _Pass(state, groups, node, best_fit)
    try:
        one.run(order)
        if best_fit and not _compaction_is_futile(state, groups):
            one.compact()
            one.run([p for p in order if p not in one.placed])  # compacting may have made room
    finally:
        one.release()
    return one.placed


def _compaction_is_futile(state: ClusterData, groups: Sequence[_Group]) -> bool:
    """Single shares of one shape (a Deployment scaling up) on shared devices that are all alike
    (one GPU model): compaction cannot empty a device. Placed one after another with nothing
    released, a share opens a device only when no device in use has room for it (best-fit tries
    devices in use first), and room only shrinks; so every device in use but the last one opened is
    full for this shape, and the last one, holding at least one, has room for fewer than a full one
    holds. A mixed burst, or GPUs of several sizes, still compacts."""
    first = groups[0]
    if len(first.claims) != 1 or len(first.claims[0].slots) != 1 or len(state.share_shapes()) != 1:
        return False
    alternatives = first.claims[0].slots[0].alternatives
    if len(alternatives) != 1 or alternatives[0].count != 1 or not alternatives[0].capacity:
        return False  # not a single share
    shape = (first.claims[0].signature, first.pods, first.exclude)
    return all(
        (g.claims[0].signature if len(g.claims) == 1 else None, g.pods, g.exclude) == shape for g in groups
    )


def _quality(state: ClusterData, groups: Sequence[_Group], placed: Mapping[int, Placed]) -> tuple[Any, ...]:
    """Lower is better: most groups placed, most demand placed, fewest devices newly opened."""
    demand = sum(_size(groups[i].demand, None) for i in placed)
    opened = set()
    for result in placed.values():
        for _, solution in result:
            for claim_entries in solution.entries:
                for entry in claim_entries:
                    device_id = entry.candidate.device.id
                    if not (state.share_count(device_id) or state.exclusive_in_use(device_id)):
                        opened.add(device_id)
    return (-len(placed), -round(demand, 9), len(opened))


def place_many(
    state: ClusterData,
    raw_groups: Sequence[Sequence[Mapping[str, Any]]],
    *,
    node: str | None,
    policy: str,
    pod_groups: Sequence[Sequence[Sequence[int]] | None] | None,
    exclude_nodes: frozenset[str] | set[str] | Sequence[frozenset[str] | set[str]],
    rng: random.Random | None,
) -> list[list[dict[str, Any]] | None]:
    """One entry per group in input order: its allocations (one per claim), or None when it does not fit."""
    if pod_groups is not None and len(pod_groups) != len(raw_groups):
        raise AllocationError(f"pod_groups: {len(pod_groups)} entries for {len(raw_groups)} groups")
    if not isinstance(exclude_nodes, (set, frozenset)) and len(exclude_nodes) != len(raw_groups):
        raise AllocationError(f"exclude_nodes: {len(exclude_nodes)} entries for {len(raw_groups)} groups")
    best_fit = policy == "best-fit"
    scale = state.capacity_scale()
    groups: list[_Group] = []
    for index, raw_claims in enumerate(raw_groups):
        try:
            claims = tuple(parse_claims(state, raw_claims, policy))
            pods = tuple(pod_groups_of(pod_groups[index] if pod_groups else None, len(claims), node))
        except AllocationError as error:
            raise GroupAllocationError(group=index, cause=error) from error
        exclude = exclude_nodes if isinstance(exclude_nodes, (set, frozenset)) else exclude_nodes[index]
        groups.append(_Group(index, claims, pods, exclude, demand_of(claims, scale)))
    if not groups:
        return []
    best: tuple[tuple[Any, ...], dict[int, Placed]] | None = None
    for order in _orders(groups, best_fit):
        placed = _one_pass(state, groups, order, node, best_fit)
        quality = _quality(state, groups, placed)
        if best is None or quality < best[0]:
            best = (quality, placed)
    assert best is not None
    results: list[list[dict[str, Any]] | None] = []
    for position, group in enumerate(groups):
        result = best[1].get(position)
        results.append(None if result is None else render_placed(group.claims, group.pods, result, rng))
    return results

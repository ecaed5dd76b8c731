"""The consolidation plan: the fewest moves, then the least disruption, that let a waiting gang fit
with every moved pod re-placed. Pure: the fit check is passed in (the consolidator asks the
allocator with the movers' claims taken out, the gang placed, then each mover placed again).

Cost, compared in this order: pods moved; movers whose owner has no other running pod (their
workload stops serving while the replacement starts); movers holding a whole device (a share
re-starts sooner and is more often re-placed next to others); devices disturbed.

Search, bounded by ``Budget`` (fit checks and milliseconds, whichever runs out first):

1. steps: the movers on one device; for a gang whose pods need several devices on one node, the
   movers on that many of a node's devices (its cheapest); the movers on one node; each sorted by
   its cost;
2. each step alone, cheapest first (for a gang of several pods or devices, with half the budget
   at most): the first that fits is the
   fewest-moves answer among single devices or nodes (the common case: free one GPU, or one node's
   GPUs, for a whole-GPU pod);
3. else the cheapest steps of a kind together (a pod's devices per node first, then devices,
   then nodes), growing (doubling, then bisection) to the shortest prefix that fits;
4. then reprieve: movers are handed back one by one, most disruptive first, while it still fits.

A plan never exceeds ``max_moves`` pods; the gang must not fit with nothing moved (the caller
checks that: its decider found it unschedulable), so a plan never only reshuffles.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from driver.controller.consolidation.movers import Mover
from driver.controller.preemption.victims import Placement

__all__ = ["Budget", "Move", "MovePlan", "PlanCost", "PlanFit", "find_plan"]


@dataclass(frozen=True, slots=True)
class Move:
    """Where a mover's replacement goes: its claims' allocations on ``node``."""

    mover: str  # Mover.key
    node: str
    allocations: tuple[tuple[dict[str, Any], dict[str, Any]], ...]  # (old claim, new status.allocation)


@dataclass(frozen=True, slots=True, order=True)
class PlanCost:
    pods_moved: int
    without_spare: int
    whole_devices: int
    devices_disturbed: int


@dataclass(frozen=True, slots=True)
class MovePlan:
    movers: tuple[Mover, ...]
    moves: tuple[Move, ...]
    placement: Placement  # the waiting gang's, once the movers are gone
    cost: PlanCost
    fit_checks: int = 0


PlanFit = Callable[[frozenset[str]], tuple[Placement, tuple[Move, ...]] | None]
"""``fits(moved mover keys)``: the gang's placement and every mover's new place, or None."""


@dataclass(frozen=True, slots=True)
class Budget:
    fit_checks: int = 64
    milliseconds: float = 250.0
    max_moves: int = 16


def cost_of(movers: Sequence[Mover]) -> PlanCost:
    return PlanCost(
        pods_moved=sum(len(m.pods) for m in movers),
        without_spare=sum(len(m.pods) for m in movers if not m.spare),
        whole_devices=sum(1 for m in movers if m.whole),
        devices_disturbed=len(frozenset().union(*(m.devices for m in movers))) if movers else 0,
    )


@dataclass
class _Search:
    movers: dict[str, Mover]
    fits: PlanFit
    budget: Budget
    clock: Callable[[], float]
    started: float = 0.0
    checks: int = 0
    memo: dict[frozenset[str], tuple[Placement, tuple[Move, ...]] | None] = field(default_factory=dict)

    def spent(self) -> bool:
        elapsed_ms = (self.clock() - self.started) * 1000.0
        return self.checks >= self.budget.fit_checks or elapsed_ms >= self.budget.milliseconds

    def size(self, keys: frozenset[str]) -> int:
        return sum(len(self.movers[k].pods) for k in keys)

    def fit(self, keys: frozenset[str]) -> tuple[Placement, tuple[Move, ...]] | None:
        if keys in self.memo:
            return self.memo[keys]
        if not keys or self.size(keys) > self.budget.max_moves or self.spent():
            return None
        self.checks += 1
        self.memo[keys] = self.fits(keys)
        return self.memo[keys]

    def cost(self, keys: frozenset[str]) -> tuple[PlanCost, tuple[str, ...]]:
        return cost_of([self.movers[k] for k in keys]), tuple(sorted(keys))

    def shortest_prefix(self, steps: list[frozenset[str]]) -> frozenset[str] | None:
        prefixes: list[frozenset[str]] = []
        removed: frozenset[str] = frozenset()
        for step in steps:
            removed = removed | step
            if self.size(removed) > self.budget.max_moves:
                break
            prefixes.append(removed)
        if not prefixes:
            return None
        low, high = 0, 1
        while True:
            index = min(high, len(prefixes)) - 1
            if self.fit(prefixes[index]) is not None:
                high = index
                break
            if index == len(prefixes) - 1 or self.spent():
                return None
            low, high = index + 1, high * 2
        while low < high:
            middle = (low + high) // 2
            if self.fit(prefixes[middle]) is not None:
                high = middle
            else:
                low = middle + 1
        return prefixes[high] if self.fit(prefixes[high]) is not None else None

    def reprieve(self, keys: frozenset[str]) -> frozenset[str]:
        order = sorted(keys, key=lambda k: (self.movers[k].spare, not self.movers[k].whole,
                                            -len(self.movers[k].pods), k))  # fmt: skip
        for key in order:
            if len(keys) == 1 or self.spent():
                break
            candidate = keys - {key}
            if self.fit(candidate) is not None:
                keys = candidate
        return keys


def _steps(
    movers: Sequence[Mover], search: _Search, group_size: int
) -> tuple[list[frozenset[str]], list[frozenset[str]], list[frozenset[str]]]:
    """The steps: the movers on one device; on the ``group_size`` cheapest devices of one node (the
    devices one pod of the gang needs there); on one node. Each list sorted by cost."""
    by_device: dict[Any, set[str]] = {}
    by_node: dict[str, set[str]] = {}
    devices_of_node: dict[str, set[Any]] = {}
    for mover in movers:
        for device in mover.devices:
            by_device.setdefault(device, set()).add(mover.key)
        for node in mover.nodes:
            by_node.setdefault(node, set()).add(mover.key)
            devices_of_node.setdefault(node, set()).update(mover.devices)
    devices = sorted({frozenset(s) for s in by_device.values()}, key=search.cost)
    groups: set[frozenset[str]] = set()
    if group_size > 1:
        for node_devices in devices_of_node.values():
            cheapest = sorted((frozenset(by_device[d]) for d in node_devices), key=search.cost)[:group_size]
            if len(cheapest) == group_size:
                groups.add(frozenset().union(*cheapest))
    nodes = sorted({frozenset(s) for s in by_node.values()}, key=search.cost)
    return devices, sorted(groups, key=search.cost), nodes


def find_plan(
    movers: Sequence[Mover],
    *,
    fits: PlanFit,
    budget: Budget = Budget(),
    clock: Callable[[], float] = time.monotonic,
    group_size: int = 1,
    groups_wanted: int = 1,
) -> MovePlan | None:
    """The cheapest plan found within the budget (module docstring), or None. ``group_size``: the
    devices the largest pod of the gang needs on one node (its steps then also free that many
    devices of one node at once); ``groups_wanted``: the gang's pods that each need a node of
    their own choosing (its groups)."""
    search = _Search(movers={m.key: m for m in movers}, fits=fits, budget=budget, clock=clock)
    search.started = clock()
    if not movers:
        return None
    devices, groups, nodes = _steps(movers, search, group_size)
    found: frozenset[str] | None = None
    singles = sorted({*devices, *groups, *nodes}, key=search.cost)
    # A gang of several pods or devices rarely fits in one step: half the budget at most, the
    # growing steps need the rest. A pod of one device spends all of it on single steps if need be.
    single_checks = budget.fit_checks // 2 if group_size > 1 or groups_wanted > 1 else budget.fit_checks
    for step in singles:
        if search.spent() or search.checks >= single_checks:
            break
        if search.fit(step) is not None:
            found = step
            break
    for steps in (groups, devices, nodes):
        if found is None and steps:
            found = search.shortest_prefix(steps)
    if found is None:
        return None
    found = search.reprieve(found)
    fitted = search.fit(found)
    assert fitted is not None  # memoized: every key set kept was seen fitting
    placement, moves = fitted
    chosen = tuple(sorted((search.movers[k] for k in found), key=lambda m: m.key))
    return MovePlan(
        movers=chosen,
        moves=moves,
        placement=placement,
        cost=cost_of(chosen),
        fit_checks=search.checks,
    )

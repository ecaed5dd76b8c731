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

With best-fit, a burst made only of single shares (one claim, one request of one device
with capacities: a Deployment scaling up, many pods at once) is first planned as vector bin packing
(``_Packer``): best-fit constructions in the same orders, then a search that closes opened devices
one at a time, bounded by ``PLAN_STEPS`` fit tests (not by the clock: the same burst gets the same
plan on any machine) and stopped early at the volume bound. Each share is then placed on its planned
device by the search itself (one candidate), so every rule is checked by the same code as always.
When every share is placed so, that is the answer and no portfolio runs (every group is placed: no
order places more). Anything else (gangs, multi-claim pods, a burst that does not all fit, GPUs whose
quantities are not whole numbers, global pools, a selector error, shares under different sharing
backends) goes through the portfolio as before; so does a burst of one shape on alike devices,
which one best-fit pass already packs into the fewest.
Figures: BENCHMARKS.md, "burst packing on held-out traces".
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from driver.allocator.backends import (
    backend_for,
    backends_compatible,
    device_default_backend,
    device_runs_backend,
)
from driver.allocator.capacity import compute_consumption
from driver.allocator.celenv import SelectorError, evaluate_selector
from driver.allocator.model import Claim, DeviceID, Request
from driver.allocator.placement import (
    Placed,
    hold_solutions,
    parse_claims,
    pod_groups_of,
    render_placed,
    solve,
)
from driver.allocator.pools import Candidate
from driver.allocator.quantity import Number
from driver.allocator.search import NodeSearch
from driver.allocator.state import ClusterData, LedgerEntry
from driver.errors import AllocationError

__all__ = ["GroupAllocationError", "demand_of", "place_many"]

PORTFOLIO_MAX_GROUPS = 400  # above this, one largest-first pass (each pass costs one allocation per group)
WHOLE_DEVICE = 1.0
ALL_MODE_DEMAND = 1e9  # "every matching device": placed first
PLAN_MAX_SHARES = 400  # bursts of more single shares use the portfolio
PLAN_MAX_DEVICES = 512  # shared devices a plan may look at (in use, plus as many unused as shares)
# Fit tests per burst, chosen on tuning seeds 1..1000 (bench/packing_traces.py says how): about 85 ms
# on one core of this project's 2-core machine for a burst that spends it all (one that cannot reach
# its bound); most stop far earlier, at the bound.
PLAN_STEPS = 400_000
PLAN_SEED = 26  # the planner's own generator (tie-breaks, tabu tenures): same burst, same plan
PLACE_STEPS = 100  # the search placing one planned share on its one device
TABU_TENURE = 3
WAITING_GROWTH = 0.1  # each swap, a waiting share's weight grows by this much of its own


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
    # What the search reads of the group (its claims' signatures, pod groups and excluded nodes):
    # groups with equal keys fit or fail alike on the same ledger.
    key: tuple[Any, ...] = ()


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
        """Place the groups in ``order``. A group like one that did not fit earlier in this run is
        not searched: the run only takes room (a backlog of like pods that do not fit costs one
        search of the cluster, not one per pod)."""
        failed: set[tuple[Any, ...]] = set()
        for position in order:
            group = self.groups[position]
            if not group.claims:
                self.placed[position] = []
                self.held[position] = []
                continue
            if group.key in failed:
                continue
            result = self.solve(position)
            if result is not None:
                self.keep(position, result)
            else:
                failed.add(group.key)

    def compact(self) -> None:
        """Try to empty each device this pass opened, least loaded first: move its groups onto devices
        already in use (the device itself blocked meanwhile); keep the move only if every group found
        room without opening another device."""
        for device_id in sorted(self.opened, key=self._load):
            users = [p for p, result in self.placed.items() if device_id in _devices(result)]
            if not users or any(_needs_unused_device(self.groups[p]) for p in users):
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


def _needs_unused_device(group: _Group) -> bool:
    """A request of the group takes whole devices in every alternative (no capacity asked, no admin
    access): it can only go to a device nothing uses, so moving the group onto devices in use, what
    ``compact`` tries, cannot succeed. Skipping it leaves every result as it was; trying it cost a
    whole search of the cluster per device the group opened (8 per 8-GPU pod: at 1,000 nodes x 8
    GPUs, nine tenths of a burst's time, about 300 ms per pod)."""
    return any(
        all(not request.capacity and not request.admin for request in slot.alternatives)
        for claim in group.claims
        for slot in claim.slots
    )


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
    return _one_shape_on_alike_devices(state, groups)


def _one_shape_on_alike_devices(state: ClusterData, groups: Sequence[_Group]) -> bool:
    """Every group is the same single share, and every shared device has the same capacities."""
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


# ---------------------------------------------------------------- the planner (single shares)


@dataclass(frozen=True, slots=True)
class _Bin:
    """A shared device planned shares may go to, and whether it holds shares already."""

    node: str
    candidate: Candidate
    in_use: bool


class _Packer:
    """Vector bin packing of shares onto devices, exact and in whole numbers, bounded by steps.

    A device's room and a share's size are packed into one integer, a lane of bits per capacity whose
    top bit is a guard: ``(room | guard) - size`` keeps every guard bit exactly when the share fits in
    every capacity, so a fit test is one subtraction for any number of capacities. ``sizes[i][k]`` is
    share ``i`` on devices of kind ``k`` (equal capacities and policies); ``eligible[i]`` the devices
    its selectors, taints, nodes and sharing backend allow; ``linear`` a size or a room as the sum over
    capacities of its fraction of the largest device. A device in use costs nothing; a plan costs the
    devices it opens. ``steps`` counts fit tests: the same input takes the same path on any machine.
    """

    def __init__(
        self,
        *,
        room: list[int],
        room_linear: list[float],
        kinds: list[int],
        in_use: list[bool],
        nodes: list[int],
        sizes: list[list[int]],
        linear: list[list[float]],
        eligible: list[list[bool]],
        guard: int,
        steps: int,
    ) -> None:
        self.room = room
        self.room_linear = room_linear
        self.kinds = kinds
        self.in_use = in_use
        self.nodes = nodes
        self.sizes = sizes
        self.linear = linear
        self.eligible = eligible
        self.guard = guard
        self.steps = steps
        self.random = random.Random(PLAN_SEED)
        # What a waiting share weighs: the square of its size, so that one large share waiting
        # instead of two smaller ones of the same total counts as progress (small ones fit gaps).
        self.weight = [max(row) ** 2 for row in linear]

    def cost(self, where: Sequence[int]) -> int:
        return len({d for d in where if not self.in_use[d]})

    # ------------------------------------------------------------ constructions

    def construct(self, order: Sequence[int]) -> list[int] | None:
        """Best fit in ``order``: each share onto the device in use or opened with the least room
        left (linear measure) that takes it; otherwise it opens a device on the node with the most
        devices open (as the real best-fit keeps whole nodes free). None if a share fits nowhere."""
        guard, kinds, sizes, linear = self.guard, self.kinds, self.sizes, self.linear
        room = list(self.room)
        left = list(self.room_linear)
        active = sorted((left[d], d) for d in range(len(room)) if self.in_use[d])  # least room first
        opened = list(self.in_use)
        per_node: dict[int, int] = {}
        for _, device in active:
            per_node[self.nodes[device]] = per_node.get(self.nodes[device], 0) + 1
        where = [-1] * len(sizes)
        for share in order:
            size = sizes[share]
            eligible = self.eligible[share]
            best = -1
            for position, (_, device) in enumerate(active):
                if eligible[device] and ((room[device] | guard) - size[kinds[device]]) & guard == guard:
                    best = device
                    del active[position]
                    self.steps -= position + 1
                    break
            else:
                self.steps -= len(active)
                best_key: tuple[int, int] | None = None
                for device in range(len(room)):
                    if opened[device] or not eligible[device]:
                        continue
                    if ((room[device] | guard) - size[kinds[device]]) & guard != guard:
                        continue
                    key = (-per_node.get(self.nodes[device], 0), device)
                    if best_key is None or key < best_key:
                        best_key, best = key, device
                self.steps -= len(room)
                if best < 0:
                    return None
                opened[best] = True
                per_node[self.nodes[best]] = per_node.get(self.nodes[best], 0) + 1
            kind = kinds[best]
            room[best] -= size[kind]
            left[best] -= linear[share][kind]
            bisect.insort(active, (left[best], best))
            where[share] = best
        return where

    # ------------------------------------------------------------ improvement

    def improve(self, where: list[int], bound: int) -> list[int]:
        """Close opened devices one at a time (``close_one``) until the bound or the budget."""
        best = where
        while self.cost(best) > bound and self.steps > 0:
            found = self.close_one(best)
            if found is None:
                break
            best = found
        return best

    def close_one(self, where: list[int]) -> list[int] | None:
        """A plan opening one device fewer than ``where``, or None when the budget runs out first.

        The two opened devices holding the least are emptied and their shares wait; the plan is found
        once the waiting shares fit on one of those two (or none waits). Until then, over and over:
        each waiting share that fits elsewhere goes in (fullest device first); then the best swap is
        made, a waiting share in for one or two shares of a device, those that weigh the least (the
        weight waiting drops the most, or grows the least), and each share still waiting grows
        heavier, so that none waits for ever. Tabu: a share taken out of a device does not go back
        for a few swaps, and one put in stays as long. Every device stays within capacity
        throughout: a consistent neighbourhood search, after Buljubasic and Vasquez's for bin packing.
        """
        guard, kinds, sizes, linear = self.guard, self.kinds, self.sizes, self.linear
        base = self.weight
        weight = list(base)
        load: dict[int, float] = {}
        for share, device in enumerate(where):
            if not self.in_use[device]:
                load[device] = load.get(device, 0.0) + base[share]
        spare = sorted(load, key=lambda d: (load[d], d))[:2]
        if len(spare) < 2:
            spare = []  # the one device opened must hold nothing
        closing = set(spare) or set(load)
        targets = [d for d in range(len(self.room)) if self.in_use[d] or (d in load and d not in closing)]
        room = list(self.room)
        left = list(self.room_linear)
        members: dict[int, list[int]] = {d: [] for d in targets}
        waiting: list[int] = []
        where = list(where)
        for share, device in enumerate(where):
            if device in closing:
                waiting.append(share)
                where[share] = -1
            else:
                room[device] -= sizes[share][kinds[device]]
                left[device] -= linear[share][kinds[device]]
                members[device].append(share)
        subsets: dict[int, list[tuple[float, int, tuple[int, ...]]]] = {}
        tabu_in: dict[int, list[int]] = {}  # share -> per device, the first swap it may go back
        tabu_out: dict[int, int] = {}
        fresh = list(waiting)  # waiting shares not yet tried on every device
        changed = -1  # the device the last swap changed
        iteration = 0
        while self.steps > 0:
            iteration += 1
            still: list[int] = []
            for share in sorted(waiting, key=lambda s: (-weight[s], s)):
                size = sizes[share]
                eligible = self.eligible[share]
                chosen = -1
                tried = targets if share in fresh else (changed,)
                self.steps -= len(tried)
                for device in tried:
                    if (
                        eligible[device]
                        and ((room[device] | guard) - size[kinds[device]]) & guard == guard
                        and (chosen < 0 or left[device] < left[chosen])
                    ):
                        chosen = device
                if chosen < 0:
                    still.append(share)
                    continue
                room[chosen] -= size[kinds[chosen]]
                left[chosen] -= linear[share][kinds[chosen]]
                members[chosen].append(share)
                subsets.pop(chosen, None)
                where[share] = chosen
            waiting = still
            last = self._holds_all(waiting, spare)
            if last is not None:
                for share in waiting:
                    where[share] = last
                return where
            move = self._best_swap(
                waiting, targets, room, members, subsets, weight, tabu_in, tabu_out, iteration
            )
            if move is None:  # every swap is tabu (a small burst): the best one regardless
                move = self._best_swap(waiting, targets, room, members, subsets, weight, {}, {}, iteration)
            if move is None:
                return None
            share, device, out = move
            kind = kinds[device]
            for taken in out:
                room[device] += sizes[taken][kind]
                left[device] += linear[taken][kind]
                members[device].remove(taken)
                where[taken] = -1
                waiting.append(taken)
                if taken not in tabu_in:
                    tabu_in[taken] = [0] * len(room)
                tabu_in[taken][device] = iteration + TABU_TENURE + self.random.randrange(TABU_TENURE)
            room[device] -= sizes[share][kind]
            left[device] -= linear[share][kind]
            members[device].append(share)
            subsets.pop(device, None)
            where[share] = device
            waiting.remove(share)
            tabu_out[share] = iteration + TABU_TENURE
            fresh, changed = list(out), device
            for share in waiting:
                weight[share] += base[share] * WAITING_GROWTH
        return None

    def _holds_all(self, waiting: Sequence[int], spare: Sequence[int]) -> int | None:
        """The spare device that takes every waiting share (-1 when none waits), or None."""
        if not waiting:
            return -1
        guard = self.guard
        for device in spare:
            kind = self.kinds[device]
            if all(self.eligible[s][device] for s in waiting):
                total = sum(self.sizes[s][kind] for s in waiting)
                if ((self.room[device] | guard) - total) & guard == guard:
                    return device
        return None

    def _best_swap(
        self,
        waiting: list[int],
        targets: list[int],
        room: list[int],
        members: dict[int, list[int]],
        subsets: dict[int, list[tuple[float, int, tuple[int, ...]]]],
        weight: list[float],
        tabu_in: dict[int, list[int]],
        tabu_out: dict[int, int],
        iteration: int,
    ) -> tuple[int, int, tuple[int, ...]] | None:
        """(waiting share, device, its shares to take out) of the best swap allowed, or None.

        ``subsets`` caches each device's sets of one or two shares, lightest first (a device's entry
        is dropped when its shares change): the first that makes room is the best on that device."""
        guard, kinds, sizes = self.guard, self.kinds, self.sizes
        best = float("inf")
        ties = 0
        chosen: tuple[int, int, tuple[int, ...]] | None = None
        draw = self.random.random
        never = [0] * len(room)
        barred = [tabu_in.get(share, never) for share in waiting]
        heaviest = max(weight[share] for share in waiting)
        self.steps -= len(targets)
        for device in targets:
            options = subsets.get(device)
            if options is None:
                kind = kinds[device]
                inside = members[device]
                options = [(weight[a], sizes[a][kind], (a,)) for a in inside]
                options += [(weight[a] + weight[b], sizes[a][kind] + sizes[b][kind], (a, b))
                            for i, a in enumerate(inside) for b in inside[i + 1:]]  # fmt: skip
                options.sort()
                subsets[device] = options
                self.steps -= len(options)
            if not options or options[0][0] - heaviest > best:
                continue
            free = room[device] | guard
            kind = kinds[device]
            for share, bar in zip(waiting, barred, strict=True):
                if not self.eligible[share][device] or bar[device] > iteration:
                    continue
                size = sizes[share][kind]
                share_weight = weight[share]
                for out_weight, out_size, out in options:
                    self.steps -= 1
                    delta = out_weight - share_weight
                    if delta > best:
                        break
                    if (free + out_size - size) & guard != guard or (len(out) == 1 and out_size == size):
                        continue
                    if any(tabu_out.get(s, 0) > iteration for s in out):
                        continue
                    if delta < best:
                        best, ties, chosen = delta, 1, (share, device, out)
                    else:
                        ties += 1
                        if draw() * ties < 1:
                            chosen = (share, device, out)
                    break
        return chosen


def _share_request(group: _Group) -> Request | None:
    """The request of a group that is one claim asking for one share (a device, with capacities)."""
    if len(group.claims) != 1 or len(group.pods) != 1:
        return None
    claim = group.claims[0]
    if len(claim.slots) != 1 or claim.constraints or len(claim.slots[0].alternatives) != 1:
        return None
    request = claim.slots[0].alternatives[0]
    if request.all_mode or request.count != 1 or not request.capacity or request.admin:
        return None
    return request


def _plan_devices(state: ClusterData, node: str | None, shares: int) -> list[_Bin] | None:
    """The shared devices a plan may use: on ``node``, or (cluster mode) every shared device in use
    and the first ``shares`` unused ones in the free index's order; None above PLAN_MAX_DEVICES."""
    bins: list[_Bin] = []
    if node is not None:
        for candidate in state.view(node).candidates:
            device = candidate.device
            if device.allow_multiple and not device.consumes and not state.exclusive_in_use(device.id):
                bins.append(_Bin(node, candidate, bool(state.share_count(device.id))))
        return bins if len(bins) <= PLAN_MAX_DEVICES else None
    by_node: dict[str, dict[DeviceID, Candidate]] = {}
    unused: list[_Bin] = []
    for key in sorted(state.indexes):
        for (name, device_id), in_use, free in state.indexes[key].iter_at_least(0):
            if not in_use and len(unused) >= shares:
                break
            if (in_use and not free) or not state.is_node(name):
                continue
            candidates = by_node.get(name)
            if candidates is None:
                candidates = by_node[name] = {c.device.id: c for c in state.view(name).candidates}
            found = candidates.get(device_id)
            if found is None or not found.device.allow_multiple or found.device.consumes:
                continue
            (bins if in_use else unused).append(_Bin(name, found, in_use))
            if len(bins) + len(unused) > PLAN_MAX_DEVICES:
                return None
    return bins + unused


def _eligible(
    state: ClusterData, request: Request, bins: Sequence[_Bin], exclude: frozenset[str] | set[str]
) -> list[bool]:
    """Per device: the request's selectors accept it, its taints are tolerated, its node is not
    excluded, and its node runs the request's sharing backend beside the shares already there
    (backends.py): what the search checks besides room. Raises SelectorError as a selector does."""
    allowed = []
    for planned in bins:
        device = planned.candidate.device
        driver = device.id[0]
        backend = backend_for(request.backends, driver)
        default = device_default_backend(device.attributes, driver)
        ok = (
            planned.node not in exclude
            and device_runs_backend(device.attributes, driver, backend)
            and all(
                backends_compatible(backend, other, default)
                for other in state.committed_backends(device.id) or ()
            )
            and all(evaluate_selector(selector, device.facts) for _, selector in request.selectors)
        )
        if ok:
            for taint in device.taints:
                if taint.effect in ("NoSchedule", "NoExecute") and not any(
                    t.tolerates(taint) for t in request.tolerations
                ):
                    ok = False
                    break
        allowed.append(ok)
    return allowed


def _plan(state: ClusterData, groups: Sequence[_Group], node: str | None) -> dict[int, Placed] | None:
    """Best-fit bursts of single shares: plan every share's device with ``_Packer`` (constructions,
    then closing devices), then place each on its device through the search itself, so every rule
    is checked by the same code. None (the portfolio decides) for other groups, a burst that does
    not all fit, selector errors, global pools, or quantities that are not whole numbers."""
    requests = [_share_request(g) for g in groups]
    if len(groups) > PLAN_MAX_SHARES or state.has_global_pools or any(r is None for r in requests):
        return None
    if len({r.backends for r in requests if r is not None}) > 1:
        return None  # shares under different sharing backends may not mix: the search sorts them out
    bins = _plan_devices(state, node, len(groups))
    if not bins:
        return None
    dimensions = sorted({key for b in bins for key in b.candidate.device.capacity})
    scale = {key: max(float(b.candidate.device.capacity[key].value) for b in bins
                      if key in b.candidate.device.capacity) for key in dimensions}  # fmt: skip
    kinds: dict[int, int] = {}
    kind_devices = []
    for planned in bins:
        device = planned.candidate.device
        if device.capacity_id not in kinds:
            kinds[device.capacity_id] = len(kinds)
            kind_devices.append(device)
    rooms: list[dict[str, Number]] = []
    for planned in bins:
        device = planned.candidate.device
        committed = state.committed_consumed(device.id) or {}
        rooms.append({k: spec.value - committed.get(k, 0) for k, spec in device.capacity.items()})
    consumptions: list[list[dict[str, Number] | None]] = []
    eligible: list[list[bool]] = []
    classes: dict[Any, list[bool]] = {}
    for group, request in zip(groups, requests, strict=True):
        assert request is not None
        exclude = frozenset(group.exclude) if node is None else frozenset()
        kind_of_request = (request.class_name, tuple(s.expression for _, s in request.selectors),
                           request.tolerations, request.backends, exclude)  # fmt: skip
        allowed = classes.get(kind_of_request)
        if allowed is None:
            try:
                allowed = classes[kind_of_request] = _eligible(state, request, bins, exclude)
            except SelectorError:
                return None  # the portfolio's search reports it, naming the group
        row = [compute_consumption(device, request.capacity, None, None) for device in kind_devices]
        if None in row:
            allowed = [a and row[kinds[b.candidate.device.capacity_id]] is not None
                       for a, b in zip(allowed, bins, strict=True)]  # fmt: skip
        consumptions.append(row)
        eligible.append(allowed)
    amounts = [*rooms, *(c for row in consumptions for c in row if c is not None)]
    amounts += [{k: spec.value for k, spec in d.capacity.items()} for d in kind_devices]
    unit: dict[str, int] = {}
    for amount in amounts:
        for key, value in amount.items():
            if not isinstance(value, int) or value < 0:
                return None  # not whole numbers (or an overcommitted device): left to the search
            unit[key] = math.gcd(unit.get(key, 0), value)
    widest = max(((v // unit[k]).bit_length() for a in amounts for k, v in a.items() if unit[k]), default=1)
    lane = widest + 1
    guard = sum(1 << (d * lane + lane - 1) for d in range(len(dimensions)))

    def pack(amount: Mapping[str, Number]) -> tuple[int, float]:
        packed, linear = 0, 0.0
        for d, key in enumerate(dimensions):
            value = int(amount.get(key, 0))
            if value:
                packed |= value // unit[key] << (d * lane)
                linear += value / scale[key]
        return packed, linear

    packed_rooms = [pack(r) for r in rooms]
    packed_sizes = [[pack(c) if c is not None else (0, 0.0) for c in row] for row in consumptions]
    node_index = {name: i for i, name in enumerate(dict.fromkeys(b.node for b in bins))}
    packer = _Packer(
        room=[r for r, _ in packed_rooms], room_linear=[f for _, f in packed_rooms],
        kinds=[kinds[b.candidate.device.capacity_id] for b in bins], in_use=[b.in_use for b in bins],
        nodes=[node_index[b.node] for b in bins], sizes=[[p for p, _ in row] for row in packed_sizes],
        linear=[[f for _, f in row] for row in packed_sizes], eligible=eligible, guard=guard,
        steps=PLAN_STEPS,
    )  # fmt: skip
    where = _construct_best(packer, groups, dimensions)
    if where is None:
        return None
    where = packer.improve(where, _opened_bound(packer, bins, lane, len(dimensions)))
    return _realize(state, groups, node, bins, where)


def _construct_best(packer: _Packer, groups: Sequence[_Group], dimensions: Sequence[str]) -> list[int] | None:
    """The cheapest construction over a few orders: largest first by the largest dimension, by
    the sum, by each dimension alone; then the input order."""
    keys: list[str | None] = [None, "+", *dimensions] if len(dimensions) > 1 else [None]
    orders: list[list[int]] = []
    for key in keys:
        order = sorted(range(len(groups)), key=lambda i: -_size(groups[i].demand, key))
        if order not in orders:
            orders.append(order)
    arrival = list(range(len(groups)))
    if arrival not in orders:
        orders.append(arrival)
    best: list[int] | None = None
    for order in orders:
        if best is not None and packer.steps <= 0:
            break  # a huge burst: the budget went on constructions
        where = packer.construct(order)
        if where is not None and (best is None or packer.cost(where) < packer.cost(best)):
            best = where
    return best


def _opened_bound(packer: _Packer, bins: Sequence[_Bin], lane: int, dimensions: int) -> int:
    """Devices any plan must open, per capacity (a share's smallest size counts): what the shares
    need beyond the room of the devices in use, over the largest unused device; and the shares over
    half of that device, no two of which share one, less one for each device in use."""
    mask = (1 << (lane - 1)) - 1
    in_use = sum(1 for b in bins if b.in_use)
    bound = 0
    for d in range(dimensions):
        smallest = [min((size >> (d * lane)) & mask for size in row) for row in packer.sizes]
        need = sum(smallest)
        largest = 0
        for index, planned in enumerate(bins):
            room = (packer.room[index] >> (d * lane)) & mask
            if planned.in_use:
                need -= room
            else:
                largest = max(largest, room)
        if largest > 0:
            bound = max(bound, -(-need // largest), sum(1 for s in smallest if 2 * s > largest) - in_use)
    return bound


def _realize(
    state: ClusterData, groups: Sequence[_Group], node: str | None, bins: Sequence[_Bin], where: Sequence[int]
) -> dict[int, Placed] | None:
    """Each share placed on its planned device by the search (first-fit over that one candidate),
    held so the next sees it; a share the search refuses there is placed by best-fit as usual.
    Everything is released before returning; None if some share finds no room at all."""
    placed: dict[int, Placed] = {}
    held: list[str] = []
    try:
        for position, device_index in enumerate(where):
            group = groups[position]
            planned = bins[device_index]
            view = state.view(planned.node)
            try:
                solution = NodeSearch(
                    state=state, node=planned.node, pools=view.pools, candidates=(planned.candidate,),
                    claims=group.claims, best_fit=False, budget=PLACE_STEPS,
                ).run()  # fmt: skip
                result: Placed | None = [(planned.node, solution)] if solution is not None else None
                if result is None:
                    result = solve(state, group.claims, node=node, best_fit=True, groups=group.pods,
                                   exclude_nodes=group.exclude)  # fmt: skip
            except AllocationError as error:
                raise GroupAllocationError(group=group.index, cause=error) from error
            if result is None:
                return None
            placed[position] = result
            held.extend(hold_solutions(state, result))
    finally:
        for uid in held:
            state.release(uid)
    return placed


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
    best_fit = policy != "first-fit"
    scale = state.capacity_scale()
    groups: list[_Group] = []
    shared = frozenset(exclude_nodes) if isinstance(exclude_nodes, (set, frozenset)) else None
    for index, raw_claims in enumerate(raw_groups):
        try:
            claims = tuple(parse_claims(state, raw_claims, policy))
            pods = tuple(pod_groups_of(pod_groups[index] if pod_groups else None, len(claims), node))
        except AllocationError as error:
            raise GroupAllocationError(group=index, cause=error) from error
        exclude = shared if shared is not None else frozenset(exclude_nodes[index])  # type: ignore[index]
        key = (tuple(c.signature for c in claims), pods, exclude)
        groups.append(_Group(index, claims, pods, exclude, demand_of(claims, scale), key))
    if not groups:
        return []
    best: tuple[tuple[Any, ...], dict[int, Placed]] | None = None
    # One shape on alike devices: one best-fit pass is already the fewest devices (each device in use
    # takes all of that shape it can, each opened one as many as any device holds), so no plan.
    planned = (
        _plan(state, groups, node) if best_fit and not _one_shape_on_alike_devices(state, groups) else None
    )
    if planned is not None:
        best = ((), planned)
    for order in _orders(groups, best_fit) if planned is None else ():
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

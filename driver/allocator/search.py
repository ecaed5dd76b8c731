"""The per-node device search: upstream's depth-first allocator, with best-fit candidate ordering.

``NodeSearch(...).run()`` allocates a list of claims on one node, like ``Allocator.Allocate`` of
upstream ``structured/internal/incubating/allocator_incubating.go`` (kubernetes
``staging/src/k8s.io/dynamic-resource-allocation``): claims in order, requests in order, device
slots in order; within a request candidates continue after the previous pick (combinations, never
the same device twice); ``firstAvailable`` alternatives in order with the rest of the search under
each; the 32-result limit moves on to the next alternative; per-candidate checks in upstream order
(in use, selectors, capacity, counters, taints, constraints) with everything undone on backtrack
(counters included, as fixed by kubernetes PR #140431).

``best_fit=True`` changes only the *order* in which valid candidates are tried (packing first: shared
devices in use, then the fullest by every capacity, normalised (``room_score``: the load before the
share, not the room it would leave); then topology; then upstream order) and keeps the best of the
first few complete solutions; every check is the same code, so a best-fit allocation is one the
first-fit rules accept. A step budget bounds the search; the caller falls back to first-fit when
best-fit runs out of budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from driver.allocator.backends import (
    backend_for,
    backends_compatible,
    device_default_backend,
    device_runs_backend,
)
from driver.allocator.capacity import compute_consumption, room_score
from driver.allocator.celenv import SelectorError, evaluate_selector
from driver.allocator.model import (
    MAX_RESULTS,
    Claim,
    Constraint,
    Device,
    DeviceID,
    Request,
    attribute_set,
    lookup_attribute,
)
from driver.allocator.pools import Candidate, PoolView
from driver.allocator.quantity import Number
from driver.errors import AllocationError

__all__ = ["BudgetExceeded", "CommittedState", "Entry", "NodeSearch", "Solution", "distinct_slots"]

_NO_TAINT_EFFECTS = ("NoSchedule", "NoExecute")


class CommittedState(Protocol):
    def exclusive_in_use(self, device_id: DeviceID) -> bool: ...
    def share_count(self, device_id: DeviceID) -> int: ...
    def committed_consumed(self, device_id: DeviceID) -> dict[str, Number] | None: ...
    def committed_backends(self, device_id: DeviceID) -> dict[str | None, int] | None: ...
    def counters_available(self, pool_key: tuple[str, str]) -> dict[tuple[str, str], Number]: ...


class BudgetExceeded(Exception):
    """The search used its step budget without an answer."""


class _LimitExceeded(Exception):
    """errAllocationResultMaxSizeExceeded: a branch would exceed 32 results for one claim."""


class _Enough(Exception):
    """Best-fit collected enough complete solutions."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One allocated device of a claim (shareID is added when the result is rendered)."""

    request: Request
    candidate: Candidate
    consumed: dict[str, Number] | None  # None for exclusive devices


@dataclass(frozen=True, slots=True)
class Solution:
    entries: tuple[tuple[Entry, ...], ...]  # per claim, in allocation order
    score: tuple[Any, ...]


class _MatchState:
    """matchAttribute with list-type attributes (DRAListTypeAttributes): the values of every device so
    far must have a common element. A scalar is a set of one, so for scalars this is equality; an
    empty list or an unknown type never matches. The running intersection is a stack, so a backtrack
    restores it exactly (upstream keeps one set and narrows it for good: kubernetes PR #140326)."""

    __slots__ = ("constraint", "stack")

    def __init__(self, constraint: Constraint) -> None:
        self.constraint = constraint
        self.stack: list[tuple[str, frozenset[Any]]] = []

    def add(self, request: Request, device: Device) -> bool:
        value = lookup_attribute(device, self.constraint.attribute)
        if value is None:
            return False
        values = attribute_set(value)
        if values is None:
            return False
        if self.stack:
            kind, common = self.stack[-1]
            if kind != values[0] or not common & values[1]:
                return False
            values = (kind, common & values[1])
        self.stack.append(values)
        return True

    def remove(self, request: Request, device: Device) -> None:
        self.stack.pop()


class _DistinctState:
    """distinctAttribute with list-type attributes: each device's values must be disjoint from those
    of every device stored. As upstream: the first device is stored unchecked; a later device with an
    empty list or an unknown type fails; a stored value of unknown type is skipped; values of another
    kind never collide. Upstream quirk kept: values are stored per (parent) request name, the last
    device overwriting, and a removal drops that request's entry."""

    __slots__ = ("by_request", "constraint", "count")

    def __init__(self, constraint: Constraint) -> None:
        self.constraint = constraint
        self.by_request: dict[str, tuple[str, Any]] = {}
        self.count = 0

    def add(self, request: Request, device: Device) -> bool:
        value = lookup_attribute(device, self.constraint.attribute)
        if value is None:
            return False
        if self.count:
            values = attribute_set(value)
            if values is None:
                return False
            for stored in self.by_request.values():
                other = attribute_set(stored)
                if other is not None and other[0] == values[0] and other[1] & values[1]:
                    return False
        self.by_request[request.parent] = value
        self.count += 1
        return True

    def remove(self, request: Request, device: Device) -> None:
        self.by_request.pop(request.parent, None)
        self.count -= 1


def distinct_slots(claim: Claim, constraint: Constraint) -> int:
    """Requests that every alternative of which falls under ``constraint`` (each needs its own value)."""
    return sum(1 for slot in claim.slots if all(_applies(constraint, r) for r in slot.alternatives))


def _applies(constraint: Constraint, request: Request) -> bool:
    names = constraint.requests
    return not names or request.parent in names or request.name in names


class NodeSearch:
    """One allocation attempt of ``claims`` on ``node`` against committed state ``state``."""

    def __init__(
        self,
        *,
        state: CommittedState,
        node: str,
        pools: Sequence[PoolView],
        candidates: Sequence[Candidate],
        claims: Sequence[Claim],
        best_fit: bool,
        budget: int,
        max_solutions: int = 8,
    ) -> None:
        self.state = state
        self.node = node
        self.pools = pools
        self.candidates = candidates
        self.claims = claims
        self.best_fit = best_fit
        self.budget = budget
        self.max_solutions = max_solutions
        self.steps = 0
        self.allocating_exclusive: dict[DeviceID, int] = {}
        self.allocating_by_claim: dict[DeviceID, dict[int, int]] = {}
        self.allocating_capacity: dict[DeviceID, dict[str, Number]] = {}
        self.allocating_shares: dict[DeviceID, int] = {}
        self.allocating_backends: dict[DeviceID, dict[str | None, int]] = {}
        self.allocating_counters: dict[tuple[str, str], dict[tuple[str, str], Number]] = {}
        self.results: list[list[Entry]] = [[] for _ in claims]
        self.constraint_states: list[list[_MatchState | _DistinctState]] = [
            [_MatchState(c) if c.kind == "match" else _DistinctState(c) for c in claim.constraints]
            for claim in claims
        ]
        self.all_lists: dict[tuple[int, int, int], list[Candidate]] = {}
        self.hopeless: set[tuple[int, int, int]] = set()
        self.solutions: list[Solution] = []
        self.impossible = False

    # ------------------------------------------------------------ entry point

    def run(self) -> Solution | None:
        """The solution (best-fit: the best found), or None; raises AllocationError or BudgetExceeded."""
        for claim_index, claim in enumerate(self.claims):
            self._prepare_claim(claim_index, claim)
        if self.impossible:
            return None
        try:
            found = self._step(0, 0, -1, 0, None, 0)
        except _Enough:
            found = True
        except _LimitExceeded as error:
            raise AllocationError("allocation result would exceed the claim limit of 32 devices") from error
        if self.best_fit:
            if not self.solutions:
                return None
            return min(self.solutions, key=lambda s: s.score)
        if not found:
            return None
        return Solution(tuple(tuple(r) for r in self.results), ())

    def _prepare_claim(self, claim_index: int, claim: Claim) -> None:
        minimum = 0
        for slot_index, slot in enumerate(claim.slots):
            counts = []
            for alt_index, request in enumerate(slot.alternatives):
                if request.all_mode:
                    devices = self._all_devices(claim, request)
                    self.all_lists[(claim_index, slot_index, alt_index)] = devices
                    counts.append(len(devices))
                else:
                    counts.append(request.count)
                    if request.count > 1 and self._hopeless(claim_index, request):
                        self.hopeless.add((claim_index, slot_index, alt_index))
            minimum += min(counts)
        if minimum > MAX_RESULTS:
            raise AllocationError(
                f"ResourceClaim {claim.key}: spec.devices.requests: number of requested devices {minimum} "
                f"exceeds the claim limit of {MAX_RESULTS}"
            )
        for constraint in claim.constraints:
            if constraint.kind != "distinct":
                continue
            values = {lookup_attribute(c.device, constraint.attribute) for c in self.candidates}
            values.discard(None)
            if distinct_slots(claim, constraint) > len(values):
                self.impossible = True  # each covered request needs a value no other one holds

    def _all_devices(self, claim: Claim, request: Request) -> list[Candidate]:
        for pool in self.pools:
            if pool.incomplete or pool.invalid:
                raise AllocationError(
                    f"ResourceClaim {claim.key}: request {request.name} asks for all devices, "
                    f"but resource pool "
                    f"{pool.key[0]}/{pool.key[1]} is currently being updated"
                    + (f" ({pool.invalid})" if pool.invalid else "")
                )
        devices = []
        for candidate in self.candidates:
            if not self._selectable(claim, request, candidate):
                continue
            committed = self.state.committed_consumed(candidate.device.id)
            if compute_consumption(candidate.device, request.capacity, committed, None) is None:
                continue
            devices.append(candidate)
        return devices

    def _hopeless(self, claim_index: int, request: Request) -> bool:
        """Fewer individually usable devices than ``count``: no search needed (a pure shortcut)."""
        usable = 0
        for candidate in self.candidates:
            device = candidate.device
            if not request.admin and self.state.exclusive_in_use(device.id):
                continue
            try:
                if not self._selectable(self.claims[claim_index], request, candidate):
                    continue
            except AllocationError:
                return False  # let the search reach (and report) it in upstream order
            committed = self.state.committed_consumed(device.id)
            if compute_consumption(device, request.capacity, committed, None) is None:
                continue
            usable += 1
            if usable >= request.count:
                return False
        return True

    # ------------------------------------------------------------ recursion

    def _tick(self) -> None:
        self.steps += 1
        if self.steps > self.budget:
            raise BudgetExceeded()

    def _step(
        self, ci: int, si: int, alt: int, k: int, order: Sequence[Candidate] | None, start: int
    ) -> bool:
        if ci == len(self.claims):
            return self._complete()
        claim = self.claims[ci]
        if si == len(claim.slots):
            try:
                return self._step(ci + 1, 0, -1, 0, None, 0)
            except _LimitExceeded:
                return False  # a later claim's limit: other choices here may let it use fewer devices
        slot = claim.slots[si]
        if alt < 0:
            all_exceeded = True  # every alternative hit the limit: no choice before this request helps
            for alt_index, request in enumerate(slot.alternatives):
                if (ci, si, alt_index) in self.hopeless:
                    if len(self.results[ci]) + request.count <= MAX_RESULTS:
                        all_exceeded = False
                    continue
                try:
                    if self._step(ci, si, alt_index, 0, None, 0):
                        return True
                    all_exceeded = False
                except _LimitExceeded:
                    continue
            if all_exceeded:
                raise _LimitExceeded()
            return False
        request = slot.alternatives[alt]
        all_list = self.all_lists.get((ci, si, alt))
        needed = len(all_list) if all_list is not None else request.count
        if request.all_mode and not all_list:
            return False
        if k >= needed:
            return self._step(ci, si + 1, -1, 0, None, 0)
        if len(self.results[ci]) + needed - k > MAX_RESULTS:
            raise _LimitExceeded()  # checked before descending, as upstream does
        if all_list is not None:
            self._tick()
            undo = self._try(ci, request, all_list[k], all_mode=True)
            if undo is None:
                return False
            try:
                if self._step(ci, si, alt, k + 1, None, 0):
                    return True
            except _LimitExceeded:
                undo()
                raise
            undo()
            return False
        if order is None:
            order = self._ordered(ci, request) if self.best_fit else self.candidates
        last = len(order) - (needed - k)  # each of the request's devices comes later in ``order``
        for index in range(start, len(order)):
            if index > last:
                break  # too few candidates left for the devices still to choose
            self._tick()
            undo = self._try(ci, request, order[index], all_mode=False)
            if undo is None:
                continue
            try:
                if self._step(ci, si, alt, k + 1, order, index + 1):
                    return True
            except _LimitExceeded:
                undo()  # the enclosing firstAvailable loop tries its next subrequest on a clean state
                raise
            undo()
        return False

    def _complete(self) -> bool:
        if not self.best_fit:
            return True
        entries = tuple(tuple(r) for r in self.results)
        self.solutions.append(Solution(entries, self.score(entries)))
        if len(self.solutions) >= self.max_solutions:
            raise _Enough()
        return False

    # ------------------------------------------------------------ checks

    def _selectable(self, claim: Claim, request: Request, candidate: Candidate) -> bool:
        device = candidate.device
        for label, selector in request.selectors:
            try:
                if not evaluate_selector(selector, device.facts):
                    return False
            except SelectorError as error:
                raise AllocationError(
                    f"ResourceClaim {claim.key}: request {request.name}: {label} on device "
                    f"{device.id[0]}/{device.id[1]}/{device.id[2]}: {error}"
                ) from error
        return True

    def _try(
        self, ci: int, request: Request, candidate: Candidate, *, all_mode: bool
    ) -> Callable[[], None] | None:
        device = candidate.device
        device_id = device.id
        state = self.state
        if request.admin:
            if ci in self.allocating_by_claim.get(device_id, ()):
                return None
        elif (
            state.exclusive_in_use(device_id)
            or self.allocating_exclusive.get(device_id)
            or (not device.allow_multiple and state.share_count(device_id))
        ):
            return None
        claim = self.claims[ci]
        backend = backend_for(request.backends, device_id[0])
        if device.allow_multiple and not request.admin and not self._backend_fits(device, backend):
            return None
        if not self._selectable(claim, request, candidate):
            return None
        committed = state.committed_consumed(device_id)
        allocating = self.allocating_capacity.get(device_id)
        consumed = compute_consumption(device, request.capacity, committed, allocating)
        if consumed is None:
            return None
        paid = False
        if device.consumes and not (
            device.allow_multiple and (state.share_count(device_id) or self.allocating_shares.get(device_id))
        ):
            if not self._reserve_counters(candidate):
                return None
            paid = True
        for taint in device.taints:
            if taint.effect in _NO_TAINT_EFFECTS and not any(t.tolerates(taint) for t in request.tolerations):
                if paid:
                    self._release_counters(candidate)
                return None
        added: list[_MatchState | _DistinctState] = []
        for constraint_state in self.constraint_states[ci]:
            if not _applies(constraint_state.constraint, request):
                continue
            if not constraint_state.add(request, device):
                for earlier in reversed(added):
                    earlier.remove(request, device)
                if paid:
                    self._release_counters(candidate)
                if all_mode:
                    raise AllocationError(
                        f"ResourceClaim {claim.key}: request {request.name}: cannot add device "
                        f"{device_id[0]}/{device_id[1]}/{device_id[2]} "
                        "because a claim constraint would not be satisfied "
                        f"({constraint_state.constraint.kind} {constraint_state.constraint.attribute})"
                    )
                return None
            added.append(constraint_state)
        shared = device.allow_multiple
        if shared:
            current = self.allocating_capacity.setdefault(device_id, {})
            for key, value in consumed.items():
                current[key] = current.get(key, 0) + value
            self.allocating_shares[device_id] = self.allocating_shares.get(device_id, 0) + 1
            backends = self.allocating_backends.setdefault(device_id, {})
            backends[backend] = backends.get(backend, 0) + 1
        else:
            if not request.admin:
                self.allocating_exclusive[device_id] = self.allocating_exclusive.get(device_id, 0) + 1
            by_claim = self.allocating_by_claim.setdefault(device_id, {})
            by_claim[ci] = by_claim.get(ci, 0) + 1
        entry = Entry(request, candidate, consumed if shared else None)
        self.results[ci].append(entry)

        def undo() -> None:
            self.results[ci].pop()
            if shared:
                current = self.allocating_capacity[device_id]
                for key, value in consumed.items():
                    current[key] -= value
                self.allocating_shares[device_id] -= 1
                backends = self.allocating_backends[device_id]
                backends[backend] -= 1
                if not backends[backend]:
                    del backends[backend]
                if not self.allocating_shares[device_id]:
                    del self.allocating_shares[device_id]
                    del self.allocating_capacity[device_id]
                    del self.allocating_backends[device_id]
            else:
                if not request.admin:
                    self.allocating_exclusive[device_id] -= 1
                    if not self.allocating_exclusive[device_id]:
                        del self.allocating_exclusive[device_id]
                by_claim = self.allocating_by_claim[device_id]
                by_claim[ci] -= 1
                if not by_claim[ci]:
                    del by_claim[ci]
            for constraint_state in reversed(added):
                constraint_state.remove(request, device)
            if paid:
                self._release_counters(candidate)

        return undo

    def _backend_fits(self, device: Device, backend: str | None) -> bool:
        """The device's node can run ``backend``, and it mixes with every share already there or
        placed in this pass (``backends.py``)."""
        driver = device.id[0]
        if not device_runs_backend(device.attributes, driver, backend):
            return False
        default = device_default_backend(device.attributes, driver)
        for present in (self.state.committed_backends(device.id), self.allocating_backends.get(device.id)):
            if present and not all(backends_compatible(backend, other, default) for other in present):
                return False
        return True

    def _reserve_counters(self, candidate: Candidate) -> bool:
        pool_key = candidate.pool_key
        available = self.state.counters_available(pool_key)
        using = self.allocating_counters.setdefault(pool_key, {})
        for set_name, counters in candidate.device.consumes:
            for counter, value in counters:
                key = (set_name, counter)
                using[key] = using.get(key, 0) + value
        if all(value - using.get(key, 0) >= 0 for key, value in available.items()):
            return True
        self._release_counters(candidate)
        return False

    def _release_counters(self, candidate: Candidate) -> None:
        using = self.allocating_counters[candidate.pool_key]
        for set_name, counters in candidate.device.consumes:
            for counter, value in counters:
                using[(set_name, counter)] -= value

    # ------------------------------------------------------------ best-fit ordering and scoring

    def _packing_key(
        self,
        device: Device,
        committed: dict[str, Number] | None,
        allocating: dict[str, Number] | None,
        consumed: dict[str, Number],
    ) -> tuple[int, float, float]:
        """(0 for a shared device already in use, else 1; how empty it is before this share, from its
        ``committed`` load and what this pass is ``allocating`` there: ``room_score``, fullest first;
        then how empty the share leaves it). The last only breaks ties (after the topology distance,
        where the caller orders by it), chiefly between empty devices
        of different sizes: the share goes to the one it fills most, the smallest that takes it, and
        a larger one stays whole for a larger ask (kubernetes #138765: a 20 GiB share that may use an
        80 GiB or a 40 GiB GPU takes the 40 GiB one, and a whole-GPU claim still finds the 80 GiB)."""
        in_use = self.state.share_count(device.id) or self.allocating_shares.get(device.id)
        opened = 0 if (device.allow_multiple and in_use) else 1
        if not device.allow_multiple:
            return (opened, 0.0, 0.0)
        after = {k: v + (allocating or {}).get(k, 0) for k, v in consumed.items()}
        return (opened, room_score(device, committed, allocating), room_score(device, committed, after))

    def _topology_distance(self, ci: int, device: Device) -> int:
        chosen = self.results[ci]
        if not chosen:
            return 0
        best = 2
        for entry in chosen:
            other = entry.candidate.device
            if device.pcie_root is not None and other.pcie_root == device.pcie_root:
                return 0
            if device.numa_node is not None and other.numa_node == device.numa_node:
                best = 1
        return best

    def _ordered(self, ci: int, request: Request) -> list[Candidate]:
        """The candidates ``request`` may take, best-fit order. Left out beforehand, as ``_try``
        would refuse them anyway: a device taken whole, one whose capacity cannot take the request,
        and one the request's selectors refuse (a NIC beside the GPUs; with the pruning in
        ``_step``, a claim for all 8 GPUs of a node took 263 steps (3 ms) to prove that the one
        solution was the only one). A selector that fails to evaluate keeps its device: the search
        reaches it in order and reports it as before."""
        claim = self.claims[ci]
        keyed = []
        for candidate in self.candidates:
            device = candidate.device
            if not request.admin and self.state.exclusive_in_use(device.id):
                continue
            try:
                if not self._selectable(claim, request, candidate):
                    continue
            except AllocationError:
                pass
            committed = self.state.committed_consumed(device.id)
            allocating = self.allocating_capacity.get(device.id)
            consumed = compute_consumption(device, request.capacity, committed, allocating)
            if consumed is None:
                continue
            opened, room, after = self._packing_key(device, committed, allocating, consumed)
            distance = self._topology_distance(ci, device)
            keyed.append(((opened, room, distance, after, candidate.position), candidate))
        keyed.sort(key=lambda item: item[0])
        return [candidate for _, candidate in keyed]

    def score(self, entries: tuple[tuple[Entry, ...], ...]) -> tuple[Any, ...]:
        """Lower is better: (devices newly opened, how empty the shared devices it uses were before it
        (``room_score`` of each, summed: the fewest and fullest), topology tier, how empty it leaves
        them (the last tie, see ``_packing_key``))."""
        opened = 0
        room = 0.0
        after = 0.0
        tier = 0
        devices: dict[DeviceID, Device] = {}
        consumed_by: dict[DeviceID, dict[str, Number]] = {}
        for claim_entries in entries:
            roots = {e.candidate.device.pcie_root for e in claim_entries}
            numas = {e.candidate.device.numa_node for e in claim_entries}
            if len(claim_entries) > 1:
                tier += (
                    0
                    if (len(roots) == 1 and None not in roots)
                    else 1
                    if (len(numas) == 1 and None not in numas)
                    else 2
                )
            for entry in claim_entries:
                device = entry.candidate.device
                if device.id not in devices:
                    devices[device.id] = device
                    if not (device.allow_multiple and self.state.share_count(device.id)):
                        opened += 1
                    if device.allow_multiple:
                        room += room_score(device, self.state.committed_consumed(device.id))
                if device.allow_multiple:
                    total = consumed_by.setdefault(device.id, {})
                    for key, value in (entry.consumed or {}).items():
                        total[key] = total.get(key, 0) + value
        for device_id, consumed in consumed_by.items():
            after += room_score(devices[device_id], self.state.committed_consumed(device_id), consumed)
        return (opened, room, tier, after)

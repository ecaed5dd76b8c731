"""Fragmentation-aware node choice: keep the cluster able to take the pods that usually arrive.

After "Beware of Fragmentation" (Weng et al., USENIX ATC '23, FGD). A node's free GPU memory is a
*fragment* for a kind of pod when that kind cannot use it there: the node lacks the CPU for it, or
has fewer usable devices than it asks for (then all of the node's free memory is lost to it), or a
device is too small for its share or of a model its selectors refuse (that device's free memory is
lost to it). A node's fragment is the expectation of that over the *typical workload*, and a
placement costs what it adds to its node's fragment (``delta``): the pod goes where it adds least.

Pods without devices are part of the typical workload, as in FGD: none of a node's free memory is
of use to them, so their term is all of it. A placement takes the same memory on every node, so
their term shifts every candidate's added fragment alike; through the sigmoid and its cut to an
integer it changes which placements tie. Counting them, and every pod as it arrives rather than as
it is placed, raised the share of Alibaba's trace allocated (BENCHMARKS.md) by about 0.3 points.

What differs from FGD:
- The typical workload is learned from the pods the controller sees arrive (``Workload``: decayed
  counts per shape, the shapes that make up 95 % of them), each counted once whether it is placed or
  not, not read from a trace in advance. The caller counts them (``ClusterState.learn``).
- Memory in bytes (devices of different sizes compare; FGD has one size), scored as FGD scores
  it: a sigmoid of the added fragment in thousandths of the node's largest device, cut to an
  integer; ties go to nodes already in use (some device memory taken) before untouched ones, then
  to the nodes in one fixed pseudo-random order (a hash of their names), as FGD's go to one random
  node order per run. All three matter on Alibaba's trace: exact differences with best-fit ties
  allocated 1.4 points less of the cluster, and a new random order per decision 2 points less (it
  spreads equal choices over every node, where a fixed order fills the same nodes first). Keeping
  untouched nodes for last among ties raised it from 95.06 / 95.25 % to 95.21 / 95.39 % (at 100 /
  130 % arrived, seeds 42-51; higher on every seed); ordering ties by how full the node is (least
  free device memory, then CPU) lost 0.3 points, and emptiest first 6.6 (seeds 42-45).
- A bounded search: a score is kept per (the node's devices as they are, the pod's shape, the
  node's CPU class: which typical shapes' CPU its free CPU covers before and after the pod), so
  nodes alike share one and a node costs a lookup until its devices or its class change; at most
  ``FRESH_SCORES`` scores not kept are computed per decision (nodes in best-fit order), so a
  decision stays within milliseconds at thousands of nodes whatever the shape.
- Nodes kept in groups (``rank_index``): ``rank_grouped`` scores each group of nodes alike (devices
  and free CPU) once, and visits only the nodes it returns, where ``rank`` visits every node given.
  It needs each change of a node's free CPU reported (``cpu_changed``); the state reports each
  change of its devices.

Pure: the caller says how much CPU each node has free (``cpu_free``).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any

from driver.allocator.celenv import SelectorError, evaluate_selector
from driver.allocator.model import Claim, Device, Request
from driver.allocator.rank_index import NodeGroups
from driver.allocator.state import ClusterData

__all__ = ["FRESH_SCORES", "KEPT_POD_SELECTORS", "WHOLE", "Fragmentation", "Shape", "Workload", "shape_of"]

WHOLE = -1
"""A shape's per-device memory when it takes each device whole."""

FRESH_SCORES = 24
"""Scores not kept from earlier decisions, computed at most per decision (the nodes left over follow
the scored ones, in best-fit order)."""

KEPT_POD_SELECTORS = 64
"""Selectors of pods that the typical workload lacks, kept known when it is derived again (a node's
state says which selectors accept each device: one more makes every node's state anew)."""

_RELEARN_FIRST = 16  # the typical workload is derived again after 16, 32, 64, ... observations,
_RELEARN_EVERY = 4096  # then every 4,096: each derivation makes every node state a fresh one


@dataclass(frozen=True, slots=True)
class Shape:
    """A kind of device pod: its CPU, and ``devices`` devices of ``memory`` bytes each (``WHOLE``:
    each device whole), on the devices its request's class and selectors accept (``selector``)."""

    cpu_millis: int
    devices: int
    memory: int
    selector: tuple[Any, ...]


def shape_of(claims: list[Claim], cpu_millis: int) -> tuple[Shape, Request] | None:
    """The shape of a pod with one claim of one request for ``count`` devices (with or without a
    memory share), and that request; None for anything else (the caller places it otherwise)."""
    if len(claims) != 1 or claims[0].constraints or len(claims[0].slots) != 1:
        return None
    alternatives = claims[0].slots[0].alternatives
    if len(alternatives) != 1:
        return None
    request = alternatives[0]
    if request.all_mode or request.admin or request.count < 1:
        return None
    memory = WHOLE
    for key, value in request.capacity or ():
        if key.rsplit("/", 1)[-1] == "memory":
            memory = int(value)
        else:
            return None  # compute or another capacity: not a shape this model scores
    selector = (request.class_name, tuple(s.expression for _, s in request.selectors))
    return Shape(cpu_millis, request.count, memory, selector), request


class Workload:
    """The device pods placed so far, as decayed counts per shape (half-life ``half_life`` pods),
    and the typical workload derived from them: the most frequent shapes making up ``cover`` of it,
    with their weights. ``version`` changes when the typical workload is derived again."""

    def __init__(self, *, half_life: int = 8192, cover: float = 0.95) -> None:
        self._decay = 0.5 ** (1 / half_life)
        self._cover = cover
        self._counts: dict[Shape, float] = {}
        self._requests: dict[Shape, Request | None] = {}
        self._scale = 1.0  # counts are stored divided by the decay so far (renormalized when large)
        self.observed = 0
        self.version = 0
        self._typical: tuple[tuple[Shape, float], ...] = ()
        self._next = _RELEARN_FIRST

    def observe(self, shape: Shape, request: Request | None) -> None:
        """Count one arriving pod of ``shape`` (``request``: its device request; None for a pod
        without devices)."""
        self._scale /= self._decay
        self._counts[shape] = self._counts.get(shape, 0.0) + self._scale
        self._requests.setdefault(shape, request)
        if self._scale > 1e12:
            self._counts = {s: c / self._scale for s, c in self._counts.items() if c / self._scale > 1e-9}
            self._requests = {s: r for s, r in self._requests.items() if s in self._counts}
            self._scale = 1.0
        self.observed += 1
        if self.observed >= self._next:
            self._next = (
                self.observed * 2 if self.observed < _RELEARN_EVERY else self.observed + _RELEARN_EVERY
            )
            self._derive()

    def _derive(self) -> None:
        ranked = sorted(self._counts.items(), key=lambda item: (-item[1], repr(item[0])))
        total = sum(count for _, count in ranked)
        kept: list[tuple[Shape, float]] = []
        covered = 0.0
        for shape, count in ranked:
            if covered >= self._cover * total:
                break
            kept.append((shape, count))
            covered += count
        self._typical = tuple((shape, count / covered) for shape, count in kept)
        self.version += 1

    def typical(self) -> tuple[tuple[Shape, float], ...]:
        """(shape, weight) of the typical workload, weights adding up to 1; empty until learned."""
        return self._typical

    def request(self, shape: Shape) -> Request | None:
        return self._requests[shape]


# A node state as scored: free CPU, and per device (total, free, which typical selectors accept it).
_Devices = tuple[tuple[int, int, tuple[bool, ...]], ...]
_State = tuple[int, _Devices]


class Fragmentation:
    """Ranks nodes for a device pod by the fragment its placement adds (see the module)."""

    def __init__(self, state: ClusterData, workload: Workload) -> None:
        self.state = state
        self.workload = workload
        self._version = -1
        self._weighted: list[tuple[int, int, int, int, float]] = []  # cpu, devices, memory, selector, weight
        self._selectors: list[tuple[Any, ...]] = []  # distinct selectors: the typical shapes', then pods'
        self._requests: dict[tuple[Any, ...], Request | None] = {}
        # per device: its facts (a slice stored again brings new ones), and which of the first
        # selectors of ``_selectors`` accept it (extended as pods bring selectors the typical
        # workload lacks, so a new one costs one answer per device)
        self._device_accepts: dict[Any, tuple[Any, tuple[bool, ...]]] = {}
        self._global_version = -1  # the state's global version the node states were taken at
        self._outside_held: dict[tuple[Any, ...], tuple[int, bool]] = {}  # selector -> (inventory, answer)
        # node -> (its version, CPU free, its state, its devices' number, selectors known then)
        self._nodes: dict[str, tuple[Any, int, _State, int, int]] = {}
        self._state_numbers: dict[_Devices, int] = {}
        self._shape_numbers: dict[Shape, int] = {}
        self._thresholds: list[int] = []  # the typical shapes' CPU, sorted
        # (devices' number, shape number, CPU class before, CPU class after) -> FGD's score of the
        # placement (None: it does not fit). A score depends on the node's CPU only through which
        # typical shapes' CPU it covers before and after the pod (its class: ``bisect``), so nodes
        # whose devices are alike share one score whatever CPU each has left within a class.
        self._scores: dict[tuple[int, int, int, int], int | None] = {}
        self._fits: dict[tuple[int, int], bool] = {}  # (devices' number, shape number): enough devices
        self._free_memory: list[int] = []  # per devices' number: their free memory
        self._untouched: list[bool] = []  # per devices' number: none of their memory is taken
        self._state_terms: dict[_Devices, tuple[int, list[tuple[int, int]]]] = {}
        self._devices_of: list[_Devices] = []  # per devices' number: the devices
        # ``rank_grouped``'s groups, valid while no node's devices' number changed meaning; the
        # nodes whose devices (the state reports them) or free CPU (``cpu_changed``) changed since
        self._groups = NodeGroups()
        self._groups_valid = False
        self._group_names: list[str] | None = None  # the state's node list the groups were taken from
        self._changed = state.watch_nodes()

    # ------------------------------------------------------------ learned workload

    def learned(self) -> bool:
        """Whether a typical workload is learned, so that ``rank`` ranks the shapes it scores."""
        self._refresh()
        return bool(self._weighted)

    def _refresh(self) -> None:
        if self.workload.version == self._version:
            return
        self._version = self.workload.version
        typical = self.workload.typical()
        before, requests = self._selectors, self._requests
        self._selectors = list(dict.fromkeys(s.selector for s, _ in typical))
        self._requests = {s.selector: self.workload.request(s) for s, _ in typical}
        # the pods' own selectors seen before stay known (each new one makes every node state anew)
        kept = [selector for selector in before if selector not in self._requests][:KEPT_POD_SELECTORS]
        for selector in kept:
            self._selectors.append(selector)
            self._requests[selector] = requests[selector]
        self._carry_accepts(before)
        self._weighted = [
            (s.cpu_millis, s.devices, s.memory, self._selectors.index(s.selector), w) for s, w in typical
        ]
        self._thresholds = sorted({s.cpu_millis for s, _ in typical})
        self._nodes.clear()
        self._scores.clear()
        self._state_terms.clear()
        self._state_numbers.clear()
        self._fits.clear()
        self._free_memory.clear()
        self._untouched.clear()
        self._devices_of.clear()
        self._groups_valid = False

    def _carry_accepts(self, before: list[tuple[Any, ...]]) -> None:
        """Keep each device's answers for the selectors known before and again now (``_selectors``
        just derived again: most are), in the new order, up to the first new one."""
        where = {selector: i for i, selector in enumerate(before)}
        kept: list[int] = []
        for selector in self._selectors:
            if selector not in where:
                break
            kept.append(where[selector])
        if not kept:
            self._device_accepts.clear()
            return
        needed = max(kept) + 1  # answers a device must hold to carry them
        self._device_accepts = {
            device: (facts, tuple(accepts[i] for i in kept))
            for device, (facts, accepts) in self._device_accepts.items()
            if len(accepts) >= needed
        }

    @staticmethod
    def _accepts_device(request: Request | None, device: Device) -> bool:
        if request is None:
            return True  # a pod without devices: its selector is never asked about
        try:  # each answer is kept with the device's facts (``evaluate_selector``)
            return all(evaluate_selector(s, device.facts) for _, s in request.selectors)
        except SelectorError:
            return False

    # ------------------------------------------------------------ node states

    def _node_state(self, node: str, cpu_free: int) -> tuple[int, _State]:
        """The node's state as scored, and its devices' number (equal devices, on any node, share
        one). ``rank`` checks first whether the one held is current (the same test, inlined)."""
        version = self.state.node_versions.get(node, 0)
        held = self._nodes.get(node)
        selectors = len(self._selectors)
        if held is not None and held[0] == version and held[1] == cpu_free and held[4] == selectors:
            return held[3], held[2]
        known = self._device_accepts
        devices = []
        for candidate in self.state.view(node).candidates:
            device = candidate.device
            key = device.memory_key
            if key is None or candidate.slice.node_name is None:
                continue
            total = int(device.capacity[key].value)
            if self.state.exclusive_in_use(device.id) or (
                not device.allow_multiple and self.state.share_count(device.id)
            ):
                free = 0
            else:
                free = total - int((self.state.committed_consumed(device.id) or {}).get(key, 0))
            held_accepts = known.get(device.id)
            accepts = held_accepts[1] if held_accepts is not None and held_accepts[0] is device.facts else ()
            if len(accepts) < selectors:
                accepts += tuple(
                    self._accepts_device(self._requests[s], device) for s in self._selectors[len(accepts) :]
                )
                known[device.id] = (device.facts, accepts)
            devices.append((total, free, accepts))
        state = (cpu_free, tuple(sorted(devices)))
        number = self._state_numbers.get(state[1])
        if number is None:
            if len(self._state_numbers) > 500_000:  # forget every number: none is held any more
                self._state_numbers.clear()
                self._fits.clear()
                self._free_memory.clear()
                self._untouched.clear()
                self._devices_of.clear()
                self._scores.clear()
                self._nodes.clear()
                self._groups_valid = False
            number = self._state_numbers[state[1]] = len(self._state_numbers)
            self._free_memory.append(sum(free for _, free, _ in state[1]))
            self._untouched.append(all(free == total for total, free, _ in state[1]))
            self._devices_of.append(state[1])
        self._nodes[node] = (version, cpu_free, state, number, selectors)
        return number, state

    # ------------------------------------------------------------ scoring

    def _terms(self, devices: _Devices) -> tuple[int, list[tuple[int, int]]]:
        """The state's total free memory, and per typical shape: its usable devices and the free
        memory it cannot use on the devices (CPU aside). Kept per state (``_state_terms``)."""
        total = 0
        for _, free, _ in devices:
            total += free
        terms = []
        for _, _count, memory, selector, _ in self._weighted:
            usable = 0
            lost = 0
            for size, free, accepts in devices:
                if accepts[selector] and ((free == size) if memory == WHOLE else (free >= memory)):
                    usable += 1
                else:
                    lost += free
            terms.append((usable, lost))
        return total, terms

    def _delta(self, node_state: _State, shape: Shape, selector: int) -> float | None:
        """The least the pod adds to this node state's fragment over its device choices (None: it
        does not fit). Only the devices it takes and the node's CPU change, so each typical shape's
        terms are updated, not computed again."""
        cpu, devices = node_state
        if cpu < shape.cpu_millis:
            return None
        fits = _usable(devices, shape, selector)
        if len(fits) < shape.devices:
            return None
        terms = self._state_terms.get(devices)
        if terms is None:
            if len(self._state_terms) > 200_000:
                self._state_terms.clear()
            terms = self._state_terms[devices] = self._terms(devices)
        total, per_shape = terms
        after_cpu = cpu - shape.cpu_millis
        if shape.devices == 0:
            options: list[list[int]] = [[]]
        elif shape.memory == WHOLE or shape.devices > 1:
            options = [fits[: shape.devices]]  # devices of one size and kind are alike: take the first
        else:
            options = [[i] for i in fits if i == 0 or devices[i] != devices[i - 1]]
        best: float | None = None
        for taken in options:
            changes = []
            taken_memory = 0
            for i in taken:
                size, free, accepts = devices[i]
                after = 0 if shape.memory == WHOLE else free - shape.memory
                taken_memory += free - after
                changes.append((size, free, after, accepts))
            after_total = total - taken_memory
            delta = 0.0
            for (shape_cpu, count, memory, index, weight), (usable, lost) in zip(
                self._weighted, per_shape, strict=True
            ):
                if count == 0:  # a pod without devices uses none of the free memory
                    delta += weight * (after_total - total)
                    continue
                before = lost if cpu >= shape_cpu and usable >= count else total
                for size, free, after, accepts in changes:
                    if accepts[index]:
                        fitted = (free == size) if memory == WHOLE else free >= memory
                        fits_after = (after == size) if memory == WHOLE else after >= memory
                        if fitted:
                            usable -= 1
                        else:
                            lost -= free
                        if fits_after:
                            usable += 1
                        else:
                            lost += after
                    else:
                        lost += after - free
                now = lost if after_cpu >= shape_cpu and usable >= count else after_total
                delta += weight * (now - before)
            if best is None or delta < best:
                best = delta
        return best

    def _prepare(self, shape: Shape, request: Request | None) -> int | None:
        """The index of the pod's selector in ``_selectors`` (added if new), with the learned
        workload and the node states current; None when nothing is learned yet."""
        self._refresh()
        if not self._weighted:
            return None
        self.state.refresh()
        if self.state.global_version != self._global_version:  # every node's version moved
            self._global_version = self.state.global_version
            self._nodes.clear()
            self._groups_valid = False
        if shape.selector not in self._selectors:
            self._selectors.append(shape.selector)
            self._requests[shape.selector] = request
            self._groups_valid = False  # every node's devices get one more answer: a new number
        return self._selectors.index(shape.selector)

    def _outside(self, selector: tuple[Any, ...], request: Request) -> bool:
        """Whether the request accepts a device the model leaves out of every node state: one with
        no memory capacity (a NIC), or one not attached to a node. Asked only when no node takes the
        pod in the model, whose answer would then say it fits nowhere (one look at every device: 35
        ms at 5,000 nodes); kept per selector until a slice changes."""
        version = self.state.inventory_version
        held = self._outside_held.get(selector)
        if held is not None and held[0] == version:
            return held[1]
        found = False
        for node in self.state.node_names():
            for candidate in self.state.view(node).candidates:
                device = candidate.device
                if (device.memory_key is None or candidate.slice.node_name is None) and self._accepts_device(
                    request, device
                ):
                    found = True
                    break
            if found:
                break
        if len(self._outside_held) > 10_000:
            self._outside_held.clear()
        self._outside_held[selector] = (version, found)
        return found

    def _fit(self, number: int, node_state: _State, shape: Shape, shape_number: int, selector: int) -> bool:
        """Whether a node state (its devices' ``number``) has enough devices for the shape; kept."""
        fit = self._fits.get((number, shape_number))
        if fit is None:
            fit = self._fits[(number, shape_number)] = (
                len(_usable(node_state[1], shape, selector)) >= shape.devices
            )
        return fit

    def taking(
        self, shape: Shape, request: Request, nodes: Iterable[str], cpu_free: Callable[[str], int]
    ) -> list[str] | None:
        """``nodes`` whose devices can take the pod's, their CPU aside, in the order given (exact
        for the pods ``rank`` ranks); None where ``rank`` gives None."""
        selector = self._prepare(shape, request)
        if selector is None:
            return None
        shape_number = self._shape_numbers.setdefault(shape, len(self._shape_numbers))
        taking = []
        for node in nodes:
            number, node_state = self._node_state(node, cpu_free(node))
            if self._fit(number, node_state, shape, shape_number, selector):
                taking.append(node)
        if not taking and request is not None and self._outside(shape.selector, request):
            return None
        return taking

    def rank(
        self,
        shape: Shape,
        request: Request | None,
        nodes: Iterable[str],
        cpu_free: Callable[[str], int],
    ) -> list[str] | None:
        """``nodes`` that can take the pod's devices and CPU, best first: those scored (the least
        added fragment, ties to nodes in use before untouched ones, then in one fixed node order),
        then the rest in best-fit order; empty when none can. None when the workload is not learned
        yet, or when none can in the model but devices it leaves out may take the pod (``_outside``):
        the caller keeps its own order. ``request``: the pod's device request (None for a pod
        without devices, ``shape.devices`` 0). The nodes are grouped for this call alone
        (``rank_grouped`` keeps its groups)."""
        selector = self._prepare(shape, request)
        if selector is None:
            return None
        groups = NodeGroups()
        for node in nodes:
            cpu = cpu_free(node)
            if cpu >= shape.cpu_millis:
                groups.place(node, (self._node_state(node, cpu)[0], cpu))
        return self._ranked(groups, shape, request, selector, (), None)

    # ------------------------------------------------------------ the same ranking, from groups

    def cpu_changed(self, node: str) -> None:
        """``node``'s free CPU changed (``rank_grouped``'s source of it says so)."""
        self._changed.add(node)

    def rank_grouped(
        self,
        shape: Shape,
        request: Request | None,
        exclude: Container[str],
        cpu_free: Callable[[str], int],
        limit: int | None = None,
    ) -> list[str] | None:
        """``rank`` of every node of the state but ``exclude``: the same nodes in the same order,
        its first ``limit`` only (None: all), from groups kept as the nodes change, so that only the
        nodes returned are visited. ``cpu_free`` must report each of its changes (``cpu_changed``)."""
        selector = self._prepare(shape, request)
        if selector is None:
            return None
        self._sync_groups(cpu_free)
        return self._ranked(self._groups, shape, request, selector, exclude, limit)

    def _ranked(
        self,
        groups: NodeGroups,
        shape: Shape,
        request: Request | None,
        selector: int,
        exclude: Container[str],
        limit: int | None,
    ) -> list[str] | None:
        """``rank``'s order over ``groups`` but ``exclude``, its first ``limit``: each group of nodes
        alike (devices and free CPU) scored once. Keys not scored yet are met in best-fit order (the
        least free device memory, then CPU, then name); past ``FRESH_SCORES`` of them, their nodes
        follow every scored one, in that order."""
        scores = self._scores
        shape_number = self._shape_numbers.setdefault(shape, len(self._shape_numbers))
        thresholds = self._thresholds
        pod_cpu, classify = shape.cpu_millis, bisect.bisect_right
        free_memory, untouched, devices_of = self._free_memory, self._untouched, self._devices_of
        scored: list[tuple[int, bool, list[tuple[int, str]]]] = []
        fresh: list[tuple[int, int, str, int, tuple[int, int, int, int], list[tuple[int, str]]]] = []
        for (number, cpu), members in groups.groups.items():
            if cpu < pod_cpu:
                continue
            key = (number, shape_number, classify(thresholds, cpu), classify(thresholds, cpu - pod_cpu))
            found = scores.get(key, _UNSCORED)
            if found is _UNSCORED:
                if not self._fit(number, (cpu, devices_of[number]), shape, shape_number, selector):
                    scores[key] = None
                    continue
                first = min((node for _, node in members if node not in exclude), default=None)
                if first is not None:
                    fresh.append((free_memory[number], cpu, first, number, key, members))
            elif isinstance(found, int):
                scored.append((found, untouched[number], members))
        fresh.sort(key=lambda entry: entry[:3])
        rest: list[tuple[int, int, list[tuple[int, str]]]] = []
        computed = 0
        for free, cpu, _, number, key, members in fresh:
            found = scores.get(key, _UNSCORED)  # a group before it in this pass may share its key
            if found is _UNSCORED:
                if computed >= FRESH_SCORES:
                    rest.append((free, cpu, members))
                    continue
                computed += 1
                node_state = (cpu, devices_of[number])
                delta = self._delta(node_state, shape, selector)
                found = None if delta is None else _score(delta, node_state)
                if len(scores) > 500_000:
                    scores.clear()
                scores[key] = found
            if isinstance(found, int):
                scored.append((found, untouched[number], members))
        scored.sort(key=lambda entry: entry[:2])
        ranked = _first_members(scored, exclude, limit)
        if rest and (limit is None or len(ranked) < limit):
            left = sorted(
                (free, cpu, node) for free, cpu, members in rest for _, node in members if node not in exclude
            )
            ranked.extend(node for _, _, node in left[: None if limit is None else limit - len(ranked)])
        if not ranked and request is not None and self._outside(shape.selector, request):
            return None  # devices the model does not see may take it: not "fits nowhere"
        return ranked

    def _sync_groups(self, cpu_free: Callable[[str], int]) -> None:
        """Bring the groups up to date: the changed nodes moved, nodes come and gone, or every node
        grouped anew where the devices' numbers changed meaning."""
        names = self.state.node_names()
        if self._groups_valid and names is not self._group_names:
            known = set(names)
            for node in self._groups.nodes():
                if node not in known:
                    self._groups.remove(node)
            for node in names:
                if node not in self._groups:
                    self._regroup(node, cpu_free)
            self._group_names = names
        if self._groups_valid and self._changed:
            changed = list(self._changed)
            self._changed.clear()
            for node in changed:
                if node in self._groups:  # else not one of the state's nodes
                    self._regroup(node, cpu_free)
        while not self._groups_valid:  # again if the numbers are forgotten on the way (``_node_state``)
            self._groups_valid = True
            self._groups.clear()
            self._changed.clear()
            for node in names:
                self._regroup(node, cpu_free)
            self._group_names = names

    def _regroup(self, node: str, cpu_free: Callable[[str], int]) -> None:
        cpu = cpu_free(node)
        number, _ = self._node_state(node, cpu)
        self._groups.place(node, (number, cpu))


def _first_members(
    scored: list[tuple[int, bool, list[tuple[int, str]]]], exclude: Container[str], limit: int | None
) -> list[str]:
    """The nodes of groups sorted by (score, untouched), each run of equal ones in ``tie`` order,
    but ``exclude``: the first ``limit`` (None: all)."""
    ranked: list[str] = []
    start = 0
    while start < len(scored) and (limit is None or len(ranked) < limit):
        end = start + 1
        while end < len(scored) and scored[end][:2] == scored[start][:2]:
            end += 1
        runs = [members for _, _, members in scored[start:end]]
        for _, node in runs[0] if len(runs) == 1 else heapq.merge(*runs):
            if node in exclude:
                continue
            ranked.append(node)
            if limit is not None and len(ranked) >= limit:
                break
        start = end
    return ranked


_UNSCORED = object()


def _usable(devices: _Devices, shape: Shape, selector: int) -> list[int]:
    """The devices ``shape`` can take a share of (or, ``WHOLE``, take whole), by position."""
    memory = shape.memory
    return [
        i for i, (size, free, accepts) in enumerate(devices)
        if accepts[selector] and ((free == size) if memory == WHOLE else free >= memory)
    ]  # fmt: skip


def _score(delta: float, node_state: _State) -> int:
    """The added fragment as FGD scores it, on a scale of 0 (best) to 100: a sigmoid of the added
    fragment in thousandths of the node's largest device, cut to an integer (placements within
    about 40 thousandths of a device tie)."""
    size = max((total for total, _, _ in node_state[1]), default=1) or 1
    milli = delta * 1000 / size
    if milli > 50_000:
        return 100
    if milli < -50_000:
        return 0
    return int(100 / (1 + math.exp(-milli / 1000)))

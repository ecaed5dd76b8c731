"""ClusterData: incremental indexes of slices, classes, nodes and allocated claims.

The data half of the public ``ClusterState`` (``driver.allocator.cluster`` adds allocation on top, so
this module never imports placement: data below, decisions above).

Updates touch only what they change: a slice marks the nodes of its pool dirty (all nodes for a slice
without ``nodeName``), and a dirty node's pool view and index entries are rebuilt on the next
allocation; a claim updates the ledger, the free-capacity index entries of its devices and the
version of their nodes (which invalidates cached "does not fit" answers for those nodes only).
"""

from __future__ import annotations

import bisect
from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from driver.allocator.backends import allocation_backends, backend_for
from driver.allocator.index import FreeIndex
from driver.allocator.model import Device, DeviceID, Slice, parse_slice
from driver.allocator.pools import Candidate, PoolView, gather_pools
from driver.allocator.quantity import Number, parse_quantity

__all__ = ["ClusterData", "FreeSnapshot", "LedgerEntry", "NodeView", "ledger_entries"]


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    device_id: DeviceID
    shared: bool
    consumed: tuple[tuple[str, Number], ...]
    backend: str | None = None  # shared: the sharing backend it asked for (None: the node's; backends.py)


@dataclass(frozen=True, slots=True)
class NodeView:
    pools: tuple[PoolView, ...]
    candidates: tuple[Candidate, ...]
    has_invalid: bool
    has_global: bool  # some candidate comes from a slice without nodeName


@dataclass(frozen=True, slots=True)
class FreeSnapshot:
    """What ``ClusterData.free_summary`` reads, copied (``ClusterData.free_snapshot``, a few
    milliseconds on 40,000 GPUs) so that the summary itself (a tenth of a second there) is computed
    without the lock that guards the state: ``summary()`` equals ``free_summary()`` at the copy."""

    candidates: tuple[tuple[str, tuple[Candidate, ...]], ...]  # per node, in node order
    exclusive: frozenset[DeviceID]
    shares: Mapping[DeviceID, int]
    consumed: Mapping[DeviceID, Mapping[str, Number]]

    def summary(self) -> dict[str, dict[str, dict[str, Any]]]:
        return _summarize(self.candidates, self.exclusive, self.shares, self.consumed)


def _summarize(
    candidates: Iterable[tuple[str, tuple[Candidate, ...]]],
    exclusive: Container[DeviceID],
    shares: Mapping[DeviceID, int],
    consumed_by_device: Mapping[DeviceID, Mapping[str, Number]],
) -> dict[str, dict[str, dict[str, Any]]]:
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for node, node_candidates in candidates:
        devices: dict[str, dict[str, Any]] = {}
        for candidate in node_candidates:
            device = candidate.device
            consumed = consumed_by_device.get(device.id) or {}
            in_use = device.id in exclusive
            info: dict[str, Any] = {
                "pool": device.id[1],
                "shares": shares.get(device.id, 0),
                "exclusive": in_use,
            }
            for key, spec in device.capacity.items():
                name = key.rsplit("/", 1)[-1]
                free = 0 if in_use else spec.value - consumed.get(key, 0)
                prefix = "memory_bytes" if name == "memory" else name
                info[f"{prefix}_free"] = free
                info[f"{prefix}_total"] = spec.value
            devices[device.name] = info
        summary[node] = devices
    return summary


def ledger_entries(claim: Mapping[str, Any]) -> tuple[LedgerEntry, ...]:
    """What an allocated claim holds: admin results block nothing, shareID means shared.

    As the scheduler's ``pkg/scheduler/framework/plugins/dynamicresources/allocateddevices.go``.
    """
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        return ()
    entries = []
    for result in (allocation.get("devices") or {}).get("results") or ():
        if result.get("adminAccess"):
            continue
        device_id = (result.get("driver", ""), result.get("pool", ""), result.get("device", ""))
        if result.get("shareID"):
            consumed = tuple(
                (k, parse_quantity(v)) for k, v in (result.get("consumedCapacity") or {}).items()
            )
            backend = backend_for(
                allocation_backends(allocation, str(result.get("request", ""))), device_id[0]
            )
            entries.append(LedgerEntry(device_id, True, consumed, backend))
        else:
            entries.append(LedgerEntry(device_id, False, ()))
    return tuple(entries)


class ClusterData:
    """The allocator's view of the cluster; ``driver.allocator.ClusterState`` adds allocation to it."""

    def __init__(self, topology_label: str = "topology.kubernetes.io/zone") -> None:
        self.topology_label = topology_label
        self._slices: dict[str, Slice] = {}
        self._pools: dict[tuple[str, str], dict[str, Slice]] = {}
        self._pool_nodes: dict[tuple[str, str], dict[str, int]] = {}
        self._pool_global: dict[tuple[str, str], int] = {}
        self._node_pools: dict[str, dict[tuple[str, str], int]] = {}
        self._classes: dict[str, dict[str, Any]] = {}
        self._labels: dict[str, dict[str, str]] = {}
        self._views: dict[str, NodeView] = {}
        self._dirty: dict[str, None] = {}
        self._all_dirty = False
        self._node_versions: dict[str, int] = {}
        self._node_watchers: list[set[str]] = []  # ``watch_nodes``
        self.global_version = 0
        self.inventory_version = 0  # changes with every slice stored or removed
        self._claims: dict[str, tuple[LedgerEntry, ...]] = {}
        self._exclusive: dict[DeviceID, int] = {}
        self._shares: dict[DeviceID, int] = {}
        self._consumed: dict[DeviceID, dict[str, Number]] = {}  # each device's dict replaced, never changed
        self._backends: dict[DeviceID, dict[str | None, int]] = {}  # shared devices: shares per backend
        self._counter_cache: dict[tuple[str, str], dict[tuple[str, str], Number]] = {}
        self._device_home: dict[DeviceID, tuple[str, Device]] = {}  # devices of nodeName slices
        self._node_items: dict[str, list[DeviceID]] = {}
        self.indexes: dict[str, FreeIndex] = {}
        self.node_free: dict[str, Number] = {}  # change it only through _set_node_free
        self._free_order: list[tuple[Number, str]] | None = None  # nodes_by_free's, kept in step
        self.infeasible: dict[Any, dict[str, tuple[int, int]]] = {}  # signature -> node -> version
        self._infeasible_count = 0
        self.total_free: Number = 0
        self._node_list: list[str] | None = None
        self._max_candidates: int | None = None
        self._holds = 0
        self._scale: dict[str, float] | None = None
        self._share_shapes: frozenset[tuple[tuple[str, Number], ...]] | None = None

    # ------------------------------------------------------------ slices, classes, nodes

    def upsert_slice(self, raw: Mapping[str, Any]) -> None:
        parsed = parse_slice(raw)
        self.inventory_version += 1
        if parsed.name in self._slices:
            self.remove_slice(parsed.name)
        self._slices[parsed.name] = parsed
        key = parsed.pool_key
        self._pools.setdefault(key, {})[parsed.name] = parsed
        if parsed.node_name is not None:
            nodes = self._pool_nodes.setdefault(key, {})
            nodes[parsed.node_name] = nodes.get(parsed.node_name, 0) + 1
            pools = self._node_pools.setdefault(parsed.node_name, {})
            pools[key] = pools.get(key, 0) + 1
        else:
            self._pool_global[key] = self._pool_global.get(key, 0) + 1
        self._touch_pool(key)

    def remove_slice(self, name: str) -> None:
        parsed = self._slices.pop(name, None)
        if parsed is None:
            return
        self.inventory_version += 1
        key = parsed.pool_key
        self._touch_pool(key)
        del self._pools[key][name]
        if not self._pools[key]:
            del self._pools[key]
        if parsed.node_name is not None:
            nodes = self._pool_nodes[key]
            nodes[parsed.node_name] -= 1
            if not nodes[parsed.node_name]:
                del nodes[parsed.node_name]
                self._dirty[parsed.node_name] = None
            if not nodes:
                del self._pool_nodes[key]
            pools = self._node_pools[parsed.node_name]
            pools[key] -= 1
            if not pools[key]:
                del pools[key]
            if not pools:
                del self._node_pools[parsed.node_name]
        else:
            self._pool_global[key] -= 1
            if not self._pool_global[key]:
                del self._pool_global[key]

    def _touch_pool(self, key: tuple[str, str]) -> None:
        self._node_list = None
        self._free_order = None
        self._scale = None
        self._share_shapes = None
        self._counter_cache.pop(key, None)
        if self._pool_global.get(key):
            self._all_dirty = True
            self.global_version += 1
        for node in self._pool_nodes.get(key, {}):
            self._dirty[node] = None

    @property
    def has_global_pools(self) -> bool:
        return bool(self._pool_global)

    def upsert_class(self, raw: Mapping[str, Any]) -> None:
        self._classes[(raw.get("metadata") or {}).get("name", "")] = dict(raw)

    def remove_class(self, name: str) -> None:
        self._classes.pop(name, None)

    @property
    def classes(self) -> dict[str, dict[str, Any]]:
        return self._classes

    def upsert_node(self, name: str, labels: Mapping[str, str] | None) -> None:
        new = dict(labels or {})
        if self._labels.get(name) != new or name not in self._labels:
            self._labels[name] = new
            self._dirty[name] = None
            self._node_list = None
            self._free_order = None

    def remove_node(self, name: str) -> None:
        if self._labels.pop(name, None) is not None:
            self._dirty[name] = None
            self._node_list = None
            self._free_order = None

    def labels(self, node: str) -> dict[str, str]:
        return self._labels.get(node, {})

    def node_names(self) -> list[str]:
        """Candidate nodes, sorted: the known nodes, else the nodeName values of slices."""
        if self._node_list is None:
            self._node_list = sorted(self._labels) if self._labels else sorted(self._node_pools)
        return self._node_list

    def nodes_by_free(self, at_least: Number, *, emptiest_first: bool) -> Iterator[str]:
        """``node_names()`` with at least ``at_least`` free (``node_free``; 0 for a node without
        one), emptiest (or fullest) first, ties by name. The order is kept sorted as the free
        amounts change, so a caller that stops after a few nodes costs no pass over all of them
        (a heap of every node for each decision was most of a whole-GPU decision at 5,000 nodes);
        what is yielded is a copy, unaffected by changes made while the caller iterates."""
        order = self._free_order
        if order is None:
            free = self.node_free
            order = self._free_order = sorted((free.get(n, 0), n) for n in self.node_names())
        if not emptiest_first:
            yield from (node for _, node in order[bisect.bisect_left(order, (at_least,)) :])
            return
        snapshot = order[bisect.bisect_left(order, (at_least,)) :]
        end = len(snapshot)
        while end > 0:  # the largest amounts first, each run of equal amounts in name order
            begin = bisect.bisect_left(snapshot, (snapshot[end - 1][0],), 0, end)
            yield from (node for _, node in snapshot[begin:end])
            end = begin

    def _set_node_free(self, node: str, free: Number | None) -> None:
        """``node_free[node]`` becomes ``free`` (None: no entry, read as 0), the order kept in step."""
        old = self.node_free.get(node, 0)
        if free is None:
            self.node_free.pop(node, None)
        else:
            self.node_free[node] = free
        order = self._free_order
        new = 0 if free is None else free
        if order is None or new == old:
            return
        at = bisect.bisect_left(order, (old, node))
        if at < len(order) and order[at] == (old, node):
            del order[at]
            bisect.insort(order, (new, node))

    def is_node(self, name: str) -> bool:
        return name in self._labels if self._labels else name in self._node_pools

    def publishes_devices(self, node: str) -> bool:
        """Whether a ResourceSlice of ``node`` is known (its devices are ours to place)."""
        return node in self._node_pools

    # ------------------------------------------------------------ claims (the ledger)

    def upsert_claim(self, raw: Mapping[str, Any]) -> None:
        metadata = raw.get("metadata") or {}
        uid = metadata.get("uid") or f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"
        self.remove_claim(uid)
        entries = ledger_entries(raw)
        if entries:
            self._apply(uid, entries)

    def remove_claim(self, uid: str) -> None:
        entries = self._claims.pop(uid, None)
        if entries is None:
            return
        for entry in entries:
            device_id = entry.device_id
            if entry.shared:
                self._shares[device_id] -= 1
                consumed = dict(self._consumed[device_id])  # replaced, never changed: free_snapshot
                for key, value in entry.consumed:
                    consumed[key] -= value
                self._consumed[device_id] = consumed
                backends = self._backends[device_id]
                backends[entry.backend] -= 1
                if not backends[entry.backend]:
                    del backends[entry.backend]
                if not self._shares[device_id]:
                    del self._shares[device_id]
                    del self._consumed[device_id]
                    del self._backends[device_id]
            else:
                self._exclusive[device_id] -= 1
                if not self._exclusive[device_id]:
                    del self._exclusive[device_id]
            self._device_changed(device_id)

    def _apply(self, uid: str, entries: tuple[LedgerEntry, ...]) -> None:
        self._claims[uid] = entries
        for entry in entries:
            device_id = entry.device_id
            if entry.shared:
                self._shares[device_id] = self._shares.get(device_id, 0) + 1
                consumed = dict(self._consumed.get(device_id) or {})  # replaced, never changed
                for key, value in entry.consumed:
                    consumed[key] = consumed.get(key, 0) + value
                self._consumed[device_id] = consumed
                backends = self._backends.setdefault(device_id, {})
                backends[entry.backend] = backends.get(entry.backend, 0) + 1
            else:
                self._exclusive[device_id] = self._exclusive.get(device_id, 0) + 1
            self._device_changed(device_id)

    def assume(self, claims: Iterable[Mapping[str, Any]]) -> None:
        """Count claims carrying ``status.allocation`` as allocated before the API confirms them."""
        for claim in claims:
            self.upsert_claim(claim)

    def _device_changed(self, device_id: DeviceID) -> None:
        self._counter_cache.pop((device_id[0], device_id[1]), None)
        home = self._device_home.get(device_id)
        if home is None:
            self.global_version += 1
            return
        node, device = home
        self._node_versions[node] = self._node_versions.get(node, 0) + 1
        for watcher in self._node_watchers:
            watcher.add(node)
        self._index_device(node, device)

    # ------------------------------------------------------------ CommittedState for the search

    def exclusive_in_use(self, device_id: DeviceID) -> bool:
        return device_id in self._exclusive

    def exclusive_count(self, device_id: DeviceID) -> int:
        return self._exclusive.get(device_id, 0)

    def share_count(self, device_id: DeviceID) -> int:
        return self._shares.get(device_id, 0)

    def committed_consumed(self, device_id: DeviceID) -> dict[str, Number] | None:
        return self._consumed.get(device_id)

    def committed_backends(self, device_id: DeviceID) -> dict[str | None, int] | None:
        """Shares on a shared device per sharing backend asked for (None: the node's default)."""
        return self._backends.get(device_id)

    def claim_ledger(self, uid: str) -> tuple[LedgerEntry, ...]:
        """What is counted now for the claim with this uid (empty when nothing is)."""
        return self._claims.get(uid, ())

    def device(self, device_id: DeviceID) -> Device | None:
        """The device as its pool's current generation publishes it (any slice, nodeName or not)."""
        slices = self._pools.get((device_id[0], device_id[1]))
        if not slices:
            return None
        generation = max(s.generation for s in slices.values())
        for slice_ in slices.values():
            if slice_.generation != generation:
                continue
            for device in slice_.devices:
                if device.name == device_id[2]:
                    return device
        return None

    def indexed_device(self, device_id: DeviceID) -> Device | None:
        """A device of a nodeName slice that a built node view holds (what the free index lists)."""
        home = self._device_home.get(device_id)
        return home[1] if home is not None else None

    def counters_available(self, pool_key: tuple[str, str]) -> dict[tuple[str, str], Number]:
        cached = self._counter_cache.get(pool_key)
        if cached is not None:
            return cached
        slices = list(self._pools.get(pool_key, {}).values())
        available: dict[tuple[str, str], Number] = {}
        if slices:
            generation = max(s.generation for s in slices)
            current = [s for s in slices if s.generation == generation]
            for slice_ in current:
                for set_name, counters in slice_.counters.items():
                    for counter, value in counters.items():
                        available[(set_name, counter)] = value
            for slice_ in current:
                for device in slice_.devices:
                    if not device.consumes:
                        continue
                    if device.id in self._exclusive or device.id in self._shares:
                        for set_name, consumed in device.consumes:
                            for counter, value in consumed:
                                key = (set_name, counter)
                                available[key] = available.get(key, 0) - value
        self._counter_cache[pool_key] = available
        return available

    # ------------------------------------------------------------ node views and the free index

    def infeasible_memo(self, signature: Any) -> dict[str, tuple[int, int]]:
        """Per node, the version at which a search for ``signature`` found nothing there (read only;
        ``remember_infeasible`` adds). One lookup of the signature per pick, then one of each node:
        hashing the signature with every node was most of a whole-GPU pick at 5,000 nodes."""
        return self.infeasible.get(signature) or {}

    def remember_infeasible(self, signature: Any, node: str, version: tuple[int, int]) -> None:
        if self._infeasible_count > 500_000:
            self.infeasible.clear()
            self._infeasible_count = 0
        memo = self.infeasible.get(signature)
        if memo is None:
            memo = self.infeasible[signature] = {}
        if node not in memo:
            self._infeasible_count += 1
        memo[node] = version

    def node_version(self, node: str) -> tuple[int, int]:
        return (self._node_versions.get(node, 0), self.global_version)

    @property
    def node_versions(self) -> Mapping[str, int]:
        """Per node, a number that changes whenever its devices or their use change (absent: 0).
        ``node_version`` pairs it with ``global_version``; this is for callers that check thousands
        of nodes and watch ``global_version`` themselves. Read only."""
        return self._node_versions

    def watch_nodes(self) -> set[str]:
        """A set that each node is added to whenever its version (``node_versions``) moves; the
        caller empties it as it reads it. ``global_version`` moving is not in it."""
        watcher: set[str] = set()
        self._node_watchers.append(watcher)
        return watcher

    def refresh(self) -> None:
        """Rebuild the views and index entries of dirty nodes."""
        if self._all_dirty:
            self._all_dirty = False
            self._dirty.update(dict.fromkeys(self._views))
            self._dirty.update(dict.fromkeys(self._node_pools))
        if not self._dirty:
            return
        dirty, self._dirty = self._dirty, {}
        self._max_candidates = None
        for node in dirty:
            self._views.pop(node, None)
            self._node_versions[node] = self._node_versions.get(node, 0) + 1
            for watcher in self._node_watchers:
                watcher.add(node)
            for device_id in self._node_items.pop(node, ()):
                home = self._device_home.pop(device_id, None)
                if home is not None and home[1].memory_key is not None:
                    self.indexes[home[1].memory_key].remove((node, device_id))
            self.total_free -= self.node_free.get(node, 0)
            self._set_node_free(node, None)
            if node in self._node_pools or node in self._labels:
                self.view(node)

    def max_candidates(self) -> int:
        """The most devices any node can allocate from (a bound for gang pre-checks)."""
        if self._max_candidates is None:
            self._max_candidates = max((len(self.view(n).candidates) for n in self.node_names()), default=0)
        return self._max_candidates

    def view(self, node: str) -> NodeView:
        view = self._views.get(node)
        if view is not None:
            return view
        keys = dict.fromkeys(self._node_pools.get(node, {}))
        keys.update(dict.fromkeys(self._pool_global))
        pools, candidates = gather_pools(
            {k: self._pools[k] for k in keys if k in self._pools}, node, self.labels(node)
        )
        has_global = any(c.slice.node_name is None for c in candidates)
        view = NodeView(pools, candidates, any(p.invalid for p in pools), has_global)
        self._views[node] = view
        items = []
        for candidate in candidates:
            if candidate.slice.node_name is None:
                continue
            device = candidate.device
            self._device_home[device.id] = (node, device)
            items.append(device.id)
            self._index_device(node, device)
        self._node_items[node] = items
        return view

    def _index_device(self, node: str, device: Device) -> None:
        key = device.memory_key
        if key is None:
            return
        index = self.indexes.get(key)
        if index is None:
            index = self.indexes[key] = FreeIndex()
        item = (node, device.id)
        total = device.capacity[key].value
        old_free = index.free_of(item)
        if device.allow_multiple:
            used = (self._consumed.get(device.id) or {}).get(key, 0)
            if device.id in self._exclusive:
                free: Number = 0
                index.remove(item)
            else:
                free = total - used
                index.put(item, in_use=bool(self._shares.get(device.id)), free=free)
        elif device.id in self._exclusive or device.id in self._shares:
            free = 0
            index.remove(item)
        else:
            free = total
            index.put(item, in_use=False, free=free, shareable=False)
        self._set_node_free(node, self.node_free.get(node, 0) - old_free + free)
        self.total_free += free - old_free

    # ------------------------------------------------------------ allocation and summaries

    def capacity_scale(self) -> dict[str, float]:
        """Per capacity key, the largest value any device publishes (to normalise demands)."""
        if self._scale is None:
            scale: dict[str, float] = {}
            for slice_ in self._slices.values():
                for device in slice_.devices:
                    for key, spec in device.capacity.items():
                        value = float(spec.value)
                        if value > scale.get(key, 0.0):
                            scale[key] = value
            self._scale = scale
        return self._scale

    def share_shapes(self) -> frozenset[tuple[tuple[str, Number], ...]]:
        """The distinct capacity sets of the devices that take shares (one entry: every shared
        device is alike, as on a cluster of one GPU model)."""
        if self._share_shapes is None:
            self._share_shapes = frozenset(
                tuple(sorted((key, spec.value) for key, spec in device.capacity.items()))
                for slice_ in self._slices.values()
                for device in slice_.devices
                if device.allow_multiple and device.memory_key is not None
            )
        return self._share_shapes

    def hold(self, entries: tuple[LedgerEntry, ...]) -> str:
        """Count ``entries`` as allocated under a fresh private uid (a tentative hold); see ``release``."""
        self._holds += 1
        uid = f"\x00hold-{self._holds}"
        self._apply(uid, entries)
        return uid

    def release(self, uid: str) -> None:
        """Undo a ``hold``."""
        self.remove_claim(uid)

    def free_summary(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Per node and device: free and total of each capacity (memory as memory_bytes_*)."""
        self.refresh()
        nodes = ((node, self.view(node).candidates) for node in self.node_names())
        return _summarize(nodes, self._exclusive, self._shares, self._consumed)

    def free_snapshot(self) -> FreeSnapshot:
        """A copy of what ``free_summary`` reads, to summarize later without the caller's lock
        (Devices, candidates and the per-device dicts of ``_consumed`` are replaced, never changed:
        shallow copies of the ledger's dicts are enough)."""
        self.refresh()
        return FreeSnapshot(
            candidates=tuple((node, self.view(node).candidates) for node in self.node_names()),
            exclusive=frozenset(self._exclusive),
            shares=dict(self._shares),
            consumed=dict(self._consumed),
        )

"""The controller's view of the cluster, filled only by the watchers (and by what the worker itself
just wrote, the "assume" step), plus the allocator's incremental ``ClusterState``.

One re-entrant lock guards everything; the worker holds it while it decides (pure CPU work, the
allocator included) and never across an API call. Stale events (an older resourceVersion than
what we already hold, e.g. a watch event that trails our own write) are ignored, like upstream's
assume cache.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from typing import Any

from driver.allocator import ClusterState
from driver.controller.model.gang_identity import (
    ALL_SOURCES,
    GangRef,
    GangSource,
    identify,
    podgroup_claim,
    resolve,
)
from driver.controller.model.objects import (
    ClaimRef,
    GangKey,
    ObjectKey,
    Resources,
    is_gated,
    is_terminated,
    kept_managed_fields,
    node_allocatable,
    object_key,
    pod_claim_refs,
    pod_requests,
    resource_version_is_older,
)

__all__ = ["HOSTNAME_LABEL", "POD_STATUS_READ", "ClusterCache", "Kind", "trim"]

HOSTNAME_LABEL = "kubernetes.io/hostname"  # what a pod without devices is pinned by

MAX_DELETED_UIDS = 100_000
MAX_ROOM_CHANGES = 50_000  # node usage changes kept for nodes_without_room's memos
MAX_ROOM_MEMO = 256  # distinct requests whose nodes without room are kept


class Kind(StrEnum):
    SLICE = "resourceslices"
    CLASS = "deviceclasses"
    CLAIM = "resourceclaims"
    POD = "pods"
    NODE = "nodes"
    # Gang objects (``gang_identity``): watched at the version the server serves, when served.
    PODGROUP = "podgroups"
    WORKLOAD = "workloads"
    COSCHEDULING_PODGROUP = "podgroups.scheduling.x-k8s.io"
    VOLCANO_PODGROUP = "podgroups.scheduling.volcano.sh"
    # Our own requests to cluster-autoscaler (--provisioning-requests): watched for their conditions.
    PROVISIONING_REQUEST = "provisioningrequests.autoscaling.x-k8s.io"


def _rv(obj: dict[str, Any] | None) -> str | None:
    return None if obj is None else (obj.get("metadata") or {}).get("resourceVersion")


def _slice_pools(resource_slice: dict[str, Any] | None) -> set[tuple[str, str]]:
    spec = (resource_slice or {}).get("spec") or {}
    return {(str(spec.get("driver", "")), str((spec.get("pool") or {}).get("name", "")))} if spec else set()


def _claim_pools(claim: dict[str, Any] | None) -> set[tuple[str, str]]:
    allocation = ((claim or {}).get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or ()
    return {(str(r.get("driver", "")), str(r.get("pool", ""))) for r in results}


def _slice_node(resource_slice: dict[str, Any]) -> Any:
    return (resource_slice.get("spec") or {}).get("nodeName")


def _placement_view(node: dict[str, Any]) -> tuple[Any, Any]:
    """What of a Node decides which pods may go there (not its status, which changes often)."""
    return (node.get("metadata") or {}).get("labels"), node.get("spec")


POD_STATUS_READ = ("phase", "startTime", "resourceClaimStatuses", "nominatedNodeName")
"""What of a pod's status the controller reads; the rest (conditions, container statuses, IPs) is
not held."""
_POD_STATUS_KEYS = frozenset(POD_STATUS_READ)


def trim(kind: Kind, obj: dict[str, Any]) -> None:
    """Drop ``metadata.managedFields`` from an object about to be held (as kube-scheduler's and
    kube-controller-manager's informers do): nothing here reads them but whether an allocation is
    ours (``kept_managed_fields``, one small entry on such a claim), a write leaves them out (the
    writer strips them) and so keeps the live ones on the server, and they are a third of a pod's
    size (its fieldsV1 trees). A pod's status keeps only ``POD_STATUS_READ``: the rest was a
    quarter of a running pod as held (4 of 17 KiB; pods are only ever patched, never written back
    whole). A slice's device attribute and capacity values are shared (``_share_values``)."""
    if kind is Kind.POD:
        status = obj.get("status")
        if isinstance(status, dict) and not status.keys() <= _POD_STATUS_KEYS:
            obj["status"] = {key: status[key] for key in POD_STATUS_READ if key in status}
    metadata = obj.get("metadata")
    if isinstance(metadata, dict) and "managedFields" in metadata:
        kept = kept_managed_fields(obj) if kind is Kind.CLAIM else []
        if kept:
            metadata["managedFields"] = kept
        else:
            del metadata["managedFields"]
    if kind is Kind.SLICE:
        _share_values(obj)


_SHARED_VALUES: dict[str, Any] = {}
_SHARED_VALUES_MAX = 50_000


def _share_values(resource_slice: dict[str, Any]) -> None:
    """Hold one object for each attribute or capacity value that devices publish alike (a GPU
    model's name, architecture, driver version, memory and its request policy), instead of one per
    device as decoded: 67 KiB of Python objects a node of 8 GPUs became 13 KiB (measured with
    tracemalloc), about 270 MiB at 5,000 nodes. Held objects are never changed in place (an update
    replaces the whole object), so sharing their leaves is safe. Values seen once (a UUID, a PCI
    address) are remembered too until the memo is full, then it starts afresh."""
    spec = resource_slice.get("spec")
    if not isinstance(spec, dict):
        return
    for device in spec.get("devices") or ():
        if not isinstance(device, dict):
            continue
        for field_name in ("attributes", "capacity"):
            values = device.get(field_name)
            if not isinstance(values, dict):
                continue
            shared = {}
            for name, value in values.items():
                key = f"{field_name}:{value!r}"
                held = _SHARED_VALUES.get(key)
                if held is None:
                    if len(_SHARED_VALUES) >= _SHARED_VALUES_MAX:
                        _SHARED_VALUES.clear()
                    held = _SHARED_VALUES[key] = value
                shared[sys.intern(name) if isinstance(name, str) else name] = held
            device[field_name] = shared


def _uid(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("uid") or object_key(obj))


class ClusterCache:
    def __init__(self, *, topology_label: str) -> None:
        self.lock = threading.RLock()
        self.state = ClusterState(topology_label=topology_label)
        self.state.track_cpu(self.cpu_free)  # reported from ``_room_changed``
        self._objects: dict[Kind, dict[ObjectKey, dict[str, Any]]] = {kind: {} for kind in Kind}
        self._gang_pods: dict[GangKey, set[ObjectKey]] = defaultdict(set)
        self._pod_gang: dict[ObjectKey, GangKey] = {}
        self._claim_users: dict[ObjectKey, set[ObjectKey]] = defaultdict(set)
        self._pod_claims: dict[ObjectKey, tuple[ObjectKey, ...]] = {}
        self._bound: dict[ObjectKey, tuple[str, Resources]] = {}
        self._usage: dict[str, Resources] = defaultdict(Resources)
        self._allocatable: dict[str, Resources] = {}  # per Node, parsed once per version
        self._cpu_free: dict[str, int] = {}  # per Node: allocatable CPU less usage (``_room_changed``)
        # What depends only on the Nodes' labels and specs and on which nodes have slices (which
        # nodes a pod spec excludes): kept across decisions, emptied when one of those changes.
        self._exclusion_memo: dict[str, frozenset[str]] = {}
        # Counts the changes of what a node could offer at all (a slice stored or removed, a Node
        # added, removed, or changed as ``_exclusion_memo`` sees it): what is sized from the
        # inventory (the scale-up hints) is kept while it stays the same.
        self._inventory_version = 0
        self._placed: dict[ObjectKey, tuple[str, Resources]] = {}
        self._rejected: dict[tuple[Kind, ObjectKey], str] = {}  # objects we must not act on, and why
        # (driver, pool) -> the slices of that pool, and the claims with a result in it (as stored):
        # a gang's commit checks only its own pools, not every claim in the cluster.
        self._pool_slices: dict[tuple[str, str], set[ObjectKey]] = defaultdict(set)
        self._pool_claims: dict[tuple[str, str], set[ObjectKey]] = defaultdict(set)
        # UIDs seen deleted: a write's answer that arrives after the watch's DELETED must not bring
        # the object back (the worker assumes what it wrote). Bounded, oldest forgotten first.
        self._deleted_uids: OrderedDict[str, None] = OrderedDict()
        # Allocations decided but not yet seen written (the writers are behind): the allocator
        # counts these versions until the server's version carries an allocation, or we forget them.
        self._assumed: dict[ObjectKey, dict[str, Any]] = {}
        # The pods counted in the typical workload (``learn_pod``), by key: the UID counted.
        self._learned: dict[ObjectKey, str] = {}
        # nodes_without_room, kept per requests and brought up to date from the nodes whose usage or
        # allocatable changed since (``_room_changes``; ``_room_base``: the changes dropped before it)
        self._room_changes: list[str] = []
        self._room_base = 0
        self._room_memo: dict[Resources, tuple[int, set[str]]] = {}
        self.learn_workload = False  # set under the fragmentation policy: count kube-scheduler's pods
        self.gang_sources: frozenset[GangSource] = ALL_SOURCES  # set from --gang-sources / discovery

    def _lookup(self, kind: str, key: str) -> dict[str, Any] | None:
        return self._objects[Kind(kind)].get(ObjectKey(key))

    def gang_key(self, pod: dict[str, Any]) -> GangKey:
        """The pod's gang among the sources turned on (``gang_identity.identify``); a pod whose
        PodGroup or Workload pod group has a ``basic`` policy is a gang of one (pod by pod)."""
        with self.lock:
            ref = identify(pod, self.gang_sources)
            if ref.source in (GangSource.PODGROUP, GangSource.WORKLOAD) and resolve(ref, self._lookup).basic:
                meta = pod.get("metadata") or {}
                return GangKey(f"{meta.get('namespace')}/pod:{meta.get('name')}")
            return ref.key

    def reindex_gang(self, gang: GangKey) -> set[GangKey]:
        """Index the gang's pods again (their PodGroup changed: its claims, its size, a basic
        policy); returns the gangs they belong to now."""
        with self.lock:
            now: set[GangKey] = set()
            for key in list(self._gang_pods.get(gang, ())):
                self._index_pod(key, self._objects[Kind.POD][key])
                if (moved := self._pod_gang.get(key)) is not None:
                    now.add(moved)
            return now

    def set_gang_sources(self, sources: frozenset[GangSource]) -> None:
        """Turn gang sources on or off; every pod is indexed again."""
        with self.lock:
            self.gang_sources = sources
            for key, pod in self._objects[Kind.POD].items():
                self._index_pod(key, pod)

    # -- updates (watchers, and the worker's assume step) ------------------------------------------

    def apply(
        self,
        kind: Kind,
        event_type: str,
        obj: dict[str, Any],
        *,
        rejected: str | None = None,
        listed: bool = False,
        trimmed: bool = False,
    ) -> tuple[bool, dict[str, Any] | None]:
        """Apply one watch event; returns (applied, the object held before). ``rejected``: why the
        object as read cannot be trusted (cut by the bounded decoder); the worker leaves it alone.
        ``trimmed``: the caller has already passed ``obj`` through ``trim``."""
        key = object_key(obj)
        if not trimmed:
            trim(kind, obj)
        with self.lock:
            old = self._objects[kind].get(key)
            if event_type == "DELETED":
                if old is None or (_uid(old) != _uid(obj) and resource_version_is_older(_rv(obj), _rv(old))):
                    return False, old
                del self._objects[kind][key]
                self._rejected.pop((kind, key), None)
                self._on_removed(kind, key, old)
                self._remember_deleted(_uid(old))
                return True, old
            if old is not None and _uid(old) == _uid(obj) and resource_version_is_older(_rv(obj), _rv(old)):
                return False, old
            if (
                old is not None
                and _rv(obj) is not None
                and _rv(obj) == _rv(old)
                and _uid(old) == _uid(obj)
                and self._rejected.get((kind, key)) == rejected
            ):
                return False, old  # the version we hold (the echo of our own write): nothing changed
            if not listed and _uid(obj) in self._deleted_uids:
                return False, old  # an answer to our write, overtaken by the object's deletion
            self._objects[kind][key] = obj
            if rejected is None:
                self._rejected.pop((kind, key), None)
            else:
                self._rejected[(kind, key)] = rejected
            self._on_stored(kind, key, obj, old)
            return True, old

    def rejection(self, kind: Kind, key: str) -> str | None:
        """Why the object at ``key`` was rejected when read, or None when it is fine."""
        with self.lock:
            return self._rejected.get((kind, ObjectKey(key)))

    def replace(
        self,
        kind: Kind,
        objs: list[dict[str, Any]],
        rejected: dict[int, str] | None = None,
        *,
        trimmed: bool = False,
    ) -> list[tuple[str, dict[str, Any]]]:
        """A fresh LIST: store it and drop what is gone. Returns the changes as synthetic events.
        ``rejected``: index in ``objs`` -> why that object was rejected when read. ``trimmed``: every
        object has passed through ``trim`` already (the watcher trims each page as it arrives; a
        second pass over 5,000 nodes' slices cost 0.67 s of start-up)."""
        changes: list[tuple[str, dict[str, Any]]] = []
        reasons = rejected or {}
        with self.lock:
            fresh = {object_key(o) for o in objs}
            for key, old in list(self._objects[kind].items()):
                if key not in fresh:
                    del self._objects[kind][key]
                    self._rejected.pop((kind, key), None)
                    self._on_removed(kind, key, old)
                    self._remember_deleted(_uid(old))
                    changes.append(("DELETED", old))
            for index, obj in enumerate(objs):
                applied, previous = self.apply(
                    kind, "MODIFIED", obj, rejected=reasons.get(index), listed=True, trimmed=trimmed
                )
                if applied and (previous is None or _rv(previous) != _rv(obj)):
                    changes.append(("ADDED" if previous is None else "MODIFIED", obj))
        return changes

    def _remember_deleted(self, uid: str) -> None:
        self._deleted_uids[uid] = None
        if len(self._deleted_uids) > MAX_DELETED_UIDS:
            self._deleted_uids.popitem(last=False)

    def _index_pools(
        self, kind: Kind, key: ObjectKey, obj: dict[str, Any] | None, old: dict[str, Any] | None
    ) -> None:
        index = self._pool_slices if kind is Kind.SLICE else self._pool_claims
        pools_of = _slice_pools if kind is Kind.SLICE else _claim_pools
        for pool in pools_of(old) - pools_of(obj):
            index[pool].discard(key)
            if not index[pool]:
                del index[pool]
        for pool in pools_of(obj):
            index[pool].add(key)

    def _on_stored(self, kind: Kind, key: ObjectKey, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        if kind in (Kind.SLICE, Kind.CLAIM):
            self._index_pools(kind, key, obj, old)
        if kind is Kind.SLICE:
            if old is None or _slice_node(old) != _slice_node(obj):
                self._exclusion_memo.clear()
            self._inventory_version += 1
            self.state.upsert_slice(obj)
        elif kind is Kind.CLASS:
            self.state.upsert_class(obj)
        elif kind is Kind.CLAIM:
            if old is not None and _uid(old) != _uid(obj):
                self.state.remove_claim(_uid(old))
            assumed = self._assumed.get(key)
            if assumed is not None:
                if _uid(assumed) == _uid(obj) and not (obj.get("status") or {}).get("allocation"):
                    self.state.upsert_claim(assumed)  # our allocation is still on its way
                    return
                del self._assumed[key]  # the server's version wins from here on
            self.state.upsert_claim(obj)
        elif kind is Kind.NODE:
            if old is None or _placement_view(old) != _placement_view(obj):
                self._exclusion_memo.clear()
                self._inventory_version += 1
            name = str(obj["metadata"]["name"])
            self.state.upsert_node(name, dict(obj["metadata"].get("labels") or {}))
            self._allocatable[name] = node_allocatable(obj)
            self._room_changed(name)
        elif kind is Kind.POD:
            self._index_pod(key, obj)

    def _on_removed(self, kind: Kind, key: ObjectKey, old: dict[str, Any]) -> None:
        if kind in (Kind.SLICE, Kind.CLAIM):
            self._index_pools(kind, key, None, old)
        if kind is Kind.SLICE:
            self._exclusion_memo.clear()
            self._inventory_version += 1
            self.state.remove_slice(str(old["metadata"]["name"]))
        elif kind is Kind.CLASS:
            self.state.remove_class(str(old["metadata"]["name"]))
        elif kind is Kind.CLAIM:
            assumed = self._assumed.pop(key, None)
            if assumed is not None and _uid(assumed) != _uid(old):
                self.state.remove_claim(_uid(assumed))
            self.state.remove_claim(_uid(old))
        elif kind is Kind.NODE:
            self._exclusion_memo.clear()
            self._inventory_version += 1
            self.state.remove_node(str(old["metadata"]["name"]))
            self._allocatable.pop(str(old["metadata"]["name"]), None)
            self._room_changed(str(old["metadata"]["name"]))
        elif kind is Kind.POD:
            self._unindex_pod(key)
            self._drop_placement(key)
            self._learned.pop(key, None)

    def _unindex_pod(self, key: ObjectKey) -> None:
        gang = self._pod_gang.pop(key, None)
        if gang is not None:
            self._gang_pods[gang].discard(key)
            if not self._gang_pods[gang]:
                del self._gang_pods[gang]
        for claim_key in self._pod_claims.pop(key, ()):
            self._claim_users[claim_key].discard(key)
            if not self._claim_users[claim_key]:
                del self._claim_users[claim_key]
        bound = self._bound.pop(key, None)
        if bound is not None:
            node, requests = bound
            self._usage[node] = self._usage[node] - requests
            self._room_changed(node)

    def _drop_placement(self, key: ObjectKey) -> None:
        placed = self._placed.pop(key, None)
        if placed is not None:
            node, requests = placed
            self._usage[node] = self._usage[node] - requests
            self._room_changed(node)

    def claim_refs(self, pod: dict[str, Any]) -> tuple[ClaimRef, ...]:
        """The pod's claims by entry, a claim it shares through its PodGroup (KEP-5729) resolved."""
        with self.lock:
            return self._claim_refs(pod, identify(pod, self.gang_sources))

    def _claim_refs(self, pod: dict[str, Any], ref: GangRef) -> tuple[ClaimRef, ...]:
        refs = pod_claim_refs(pod)
        if ref.source is GangSource.PODGROUP:
            spec = resolve(ref, self._lookup)
            refs = tuple(podgroup_claim(pod, r, spec) if r.claim_name is None else r for r in refs)
        return refs

    def _index_pod(self, key: ObjectKey, pod: dict[str, Any]) -> None:
        self._unindex_pod(key)
        if is_terminated(pod) or (pod.get("spec") or {}).get("nodeName"):
            self._drop_placement(key)  # bound (now counted as bound) or finished
        if is_terminated(pod):
            return
        ref = identify(pod, self.gang_sources)
        if is_gated(pod) or ref.source is not None:
            gang = self.gang_key(pod)
            self._pod_gang[key] = gang
            self._gang_pods[gang].add(key)
        namespace = (pod.get("metadata") or {}).get("namespace")
        refs = self._claim_refs(pod, ref)
        claim_keys = tuple(ObjectKey(f"{namespace}/{r.claim_name}") for r in refs if r.claim_name)
        self._pod_claims[key] = claim_keys
        for claim_key in claim_keys:
            self._claim_users[claim_key].add(key)
        node = (pod.get("spec") or {}).get("nodeName")
        if node:
            requests = pod_requests(pod)
            self._bound[key] = (node, requests)
            self._usage[node] = self._usage[node] + requests
            self._room_changed(node)
            if self.learn_workload and not refs and self.state.publishes_devices(node):
                self._learn(key, pod, [], requests.cpu_millis)  # kube-scheduler placed it beside devices

    def has_learned(self, pod: dict[str, Any]) -> bool:
        """Whether this pod (this UID) is counted in the typical workload already."""
        with self.lock:
            return self._learned.get(object_key(pod)) == _uid(pod)

    def learn_pod(self, pod: dict[str, Any], claims: list[dict[str, Any]]) -> None:
        """Count a pod in the typical workload of the fragmentation policy, once: the first time it
        is decided (``claims``: its own claims; none for a pod without devices). Pods without devices
        that kube-scheduler binds to a node publishing devices are counted when first seen bound."""
        with self.lock:
            self._learn(object_key(pod), pod, claims, pod_requests(pod).cpu_millis)

    def _learn(
        self, key: ObjectKey, pod: dict[str, Any], claims: list[dict[str, Any]], cpu_millis: int
    ) -> None:
        uid = _uid(pod)
        if self._learned.get(key) == uid:
            return
        self._learned[key] = uid
        self.state.learn(claims, cpu_millis=cpu_millis)

    def assume_allocations(self, pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
        """Count each (claim, allocation) as allocated now, before the writers have written it (or,
        for the allocation guard, before another allocator's write admitted now is stored). Returns
        the versions assumed, in order (``forget_assumed_version`` takes one back)."""
        assumed_versions = []
        with self.lock:
            for claim, allocation in pairs:
                assumed = {**claim, "status": {**(claim.get("status") or {}), "allocation": allocation}}
                self._assumed[object_key(claim)] = assumed
                self.state.upsert_claim(assumed)
                assumed_versions.append(assumed)
        return assumed_versions

    def assumed(self, claim_key: str) -> dict[str, Any] | None:
        """The version assumed for this claim while one is in flight, else None."""
        with self.lock:
            return self._assumed.get(ObjectKey(claim_key))

    def forget_assumed_version(self, claim_key: str, version: dict[str, Any]) -> bool:
        """``forget_assumed`` for this claim only while ``version`` (as ``assume_allocations``
        returned it) is still what is assumed; False when something else replaced it meanwhile."""
        with self.lock:
            if self._assumed.get(ObjectKey(claim_key)) is not version:
                return False
            self.forget_assumed([claim_key])
            return True

    def forget_assumed(self, claim_keys: list[str]) -> None:
        """Stop counting what we assumed for these claims (their writes failed): back to the server's."""
        with self.lock:
            for claim_key in claim_keys:
                assumed = self._assumed.pop(ObjectKey(claim_key), None)
                if assumed is None:
                    continue
                current = self._objects[Kind.CLAIM].get(ObjectKey(claim_key))
                if current is None or _uid(current) != _uid(assumed):
                    self.state.remove_claim(_uid(assumed))
                if current is not None:
                    self.state.upsert_claim(current)

    def claim_as_counted(self, claim_key: str) -> dict[str, Any] | None:
        """The claim as the allocator counts it: our assumed version while one is in flight."""
        with self.lock:
            key = ObjectKey(claim_key)
            return self._assumed.get(key) or self._objects[Kind.CLAIM].get(key)

    def forget_placement(self, pod_key: str) -> None:
        with self.lock:
            self._drop_placement(ObjectKey(pod_key))

    def assume_placement(self, pod_key: str, node: str, requests: Resources) -> None:
        """Count a pod we ungated on ``node`` until kube-scheduler binds it (or it goes away)."""
        key = ObjectKey(pod_key)
        with self.lock:
            if key not in self._objects[Kind.POD] or key in self._bound:
                return
            self._drop_placement(key)
            self._placed[key] = (node, requests)
            self._usage[node] = self._usage[node] + requests
            self._room_changed(node)

    def counts_pod(self, pod_key: str) -> bool:
        """Whether the pod's requests are in its node's usage already (bound, or placed by us)."""
        key = ObjectKey(pod_key)
        with self.lock:
            return key in self._bound or key in self._placed

    @contextmanager
    def holding_room(self, held: Sequence[tuple[str, Resources]]) -> Iterator[None]:
        """Count each ``(node, requests)`` of ``held`` as used on its node for the block: the CPU,
        memory and pod slot kept for a pod that a nomination or reservation has a place for, and
        that no node counts yet. Caller holds ``lock`` for the block."""
        with self.lock:
            for node, requests in held:
                self._usage[node] = self._usage[node] + requests
                self._room_changed(node)
            try:
                yield
            finally:
                for node, requests in held:
                    self._usage[node] = self._usage[node] - requests
                    self._room_changed(node)

    # -- reads (callers that need several to agree hold ``lock``) ------------------------------------

    def get(self, kind: Kind, key: str) -> dict[str, Any] | None:
        with self.lock:
            return self._objects[kind].get(ObjectKey(key))

    def objects(self, kind: Kind) -> list[dict[str, Any]]:
        with self.lock:
            return list(self._objects[kind].values())

    def in_pools(self, kind: Kind, pools: set[tuple[str, str]]) -> list[dict[str, Any]]:
        """The slices of these (driver, pool) pools, or the claims (as stored) with a result in one."""
        index = self._pool_slices if kind is Kind.SLICE else self._pool_claims
        with self.lock:
            keys = {key for pool in pools for key in index.get(pool, ())}
            return [self._objects[kind][key] for key in keys]

    def seen_deleted(self, uid: str) -> bool:
        """Whether an object with this UID was seen deleted (by a watch or a relist) since this
        cache started; the oldest of the last ``MAX_DELETED_UIDS`` are forgotten."""
        with self.lock:
            return uid in self._deleted_uids

    def count(self, kind: Kind) -> int:
        with self.lock:
            return len(self._objects[kind])

    def gang_pods(self, gang: GangKey) -> list[dict[str, Any]]:
        with self.lock:
            pods = [self._objects[Kind.POD][k] for k in self._gang_pods.get(gang, ())]
        return sorted(pods, key=lambda p: str(p["metadata"]["name"]))

    def gang_of_pod(self, pod_key: str) -> GangKey | None:
        with self.lock:
            return self._pod_gang.get(ObjectKey(pod_key))

    def gated_gangs(self) -> list[GangKey]:
        with self.lock:
            return [
                gang
                for gang, keys in self._gang_pods.items()
                if any(is_gated(self._objects[Kind.POD][k]) for k in keys)
            ]

    def claim_users(self, claim_key: str) -> list[dict[str, Any]]:
        """Non-terminated pods whose spec (or template status) names this claim."""
        with self.lock:
            return [self._objects[Kind.POD][k] for k in self._claim_users.get(ObjectKey(claim_key), ())]

    def node_usage(self, node: str) -> Resources:
        """Requests of the non-terminated pods bound to ``node`` or placed there by us."""
        with self.lock:
            return self._usage.get(node, Resources())

    def exclusion_memo(self) -> dict[str, frozenset[str]]:
        """A scratch dict for node sets computed from the Nodes' labels and specs and from which
        nodes have slices only; emptied whenever one of those changes (not on status updates)."""
        return self._exclusion_memo

    @property
    def inventory_version(self) -> int:
        """Changes with any slice, and with a Node's arrival, removal, labels or spec."""
        return self._inventory_version

    def allocatable(self, node: str) -> Resources | None:
        """The Node's ``status.allocatable`` as parsed when it was stored (None: no such Node)."""
        return self._allocatable.get(node)

    def hostname(self, node: str) -> str | None:
        """The Node's ``kubernetes.io/hostname`` label (None: no Node, or no label)."""
        value = self.state.labels(node).get(HOSTNAME_LABEL)  # the Node's labels, as stored
        return str(value) if value else None

    def cpu_free(self, node: str) -> int:
        """CPU millicores of ``node`` that no bound or placed pod requests (allocatable less usage)."""
        return self._cpu_free.get(node, 0)  # called for every node of a decision: kept, not derived

    def nodes_without_room(self, requests: Resources) -> frozenset[str]:
        """Nodes whose allocatable, less what is bound or placed there, cannot take ``requests``.
        Kept per ``requests`` between calls: a call looks again only at the nodes changed since."""
        with self.lock:
            now = self._room_base + len(self._room_changes)
            held = self._room_memo.get(requests)
            if held is not None and held[0] >= self._room_base:
                short = held[1]
                for node in set(self._room_changes[held[0] - self._room_base :]):
                    if self._short_of_room(node, requests):
                        short.add(node)
                    else:
                        short.discard(node)
            else:
                short = {node for node in self._allocatable if self._short_of_room(node, requests)}
                if len(self._room_memo) >= MAX_ROOM_MEMO:
                    self._room_memo.clear()
            self._room_memo[requests] = (now, short)
            return frozenset(short)

    def _short_of_room(self, node: str, requests: Resources) -> bool:
        allocatable = self._allocatable.get(node)
        if allocatable is None:
            return False  # gone: no longer a node
        return not requests.fits_within(allocatable - (self._usage.get(node) or Resources()))

    def _room_changed(self, node: str) -> None:
        """Every change of a node's allocatable or usage comes through here."""
        allocatable = self._allocatable.get(node)
        if allocatable is None:
            self._cpu_free.pop(node, None)
        else:
            usage = self._usage.get(node)
            self._cpu_free[node] = allocatable.cpu_millis - (0 if usage is None else usage.cpu_millis)
        self.state.cpu_changed(node)
        self._room_changes.append(node)
        if len(self._room_changes) > MAX_ROOM_CHANGES:  # memos older than this look at every node
            self._room_base += len(self._room_changes)
            self._room_changes.clear()

"""Scale-up hints: how many nodes of which shape would make a gang fit. Pure (no I/O beyond reading
the shipped profile files once).

Candidate shapes are node profiles (``fake_devices/*.yaml``, or the files given) and copies of the
nodes already in the cluster (one per distinct device shape). For each shape we run the allocator
over the cluster as it is plus ``n`` template nodes of that shape, for the smallest ``n`` that makes
the whole gang fit (binary search: more nodes never hurt). The best hint has the smallest ``n``,
then the least GPU memory added, then a shipped profile before a copied node, then the name.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from driver.allocator import ClusterState
from driver.controller.model.objects import allocation_node, quantity
from driver.inventory.fake import list_profiles, load_profile, resolve_profile
from driver.slices import build_resource_slices

__all__ = [
    "Hint",
    "NodeShape",
    "build_template",
    "compute_hint",
    "existing_node_shapes",
    "place_greedily",
    "profile_shapes",
    "render_hint",
]

MAX_TEMPLATE_NODES = 64


@dataclass(frozen=True, slots=True)
class NodeShape:
    """A node one could add: its slices (with ``{node}`` placeholders resolved per copy) and labels."""

    name: str  # profile name, or "copy-of-<node>"
    slices: tuple[dict[str, Any], ...]  # as published for a node named ``template_node``
    labels: tuple[tuple[str, str], ...]
    template_node: str
    gpu_memory_bytes: int  # total GPU memory of one node (the "cost" tie-break)
    gpus: int


@dataclass(frozen=True, slots=True)
class Hint:
    profile: str
    nodes: int
    allocations: tuple[dict[str, Any], ...]  # one per claim, as the allocator returned them
    node_names: tuple[str, ...]  # the template nodes used, in order


def _capacity_bytes(device: dict[str, Any], name: str) -> int:
    value = ((device.get("capacity") or {}).get(name) or {}).get("value")
    return int(quantity(value)) if value is not None else 0


def _is_gpu(device: dict[str, Any]) -> bool:
    return ((device.get("attributes") or {}).get("type") or {}).get("string") == "gpu"


def _shape_from_slices(
    name: str, node: str, slices: Sequence[dict[str, Any]], labels: dict[str, str]
) -> NodeShape:
    devices = [d for s in slices for d in (s.get("spec") or {}).get("devices") or ()]
    gpus = [d for d in devices if _is_gpu(d)]
    return NodeShape(
        name=name,
        slices=tuple(slices),
        labels=tuple(sorted(labels.items())),
        template_node=node,
        gpu_memory_bytes=sum(_capacity_bytes(d, "memory") for d in gpus),
        gpus=len(gpus),
    )


@lru_cache(maxsize=32)
def _profile_shape(name_or_path: str) -> NodeShape:
    path = resolve_profile(name_or_path)
    node = "template"
    inventory = load_profile(path, node_name=node)
    labels = dict(inventory.labels)
    name = path.stem if str(name_or_path) == path.stem or "/" in str(name_or_path) else str(name_or_path)
    return _shape_from_slices(name, node, build_resource_slices(inventory), labels)


def profile_shapes(names_or_paths: Iterable[str] = ()) -> list[NodeShape]:
    """Shapes of the given profiles (names or files); all shipped profiles when none are given."""
    return [_profile_shape(str(p)) for p in (tuple(names_or_paths) or tuple(list_profiles()))]


def existing_node_shapes(
    slices: Iterable[dict[str, Any]], nodes: Iterable[dict[str, Any]]
) -> list[NodeShape]:
    """One shape per distinct device set among the cluster's nodes ("copy-of-<first node>")."""
    by_node: dict[str, list[dict[str, Any]]] = {}
    for s in slices:
        node = (s.get("spec") or {}).get("nodeName")
        if node:
            by_node.setdefault(str(node), []).append(s)
    labels_of = {str(n["metadata"]["name"]): dict(n["metadata"].get("labels") or {}) for n in nodes}
    shapes: dict[str, NodeShape] = {}
    for node in sorted(by_node):
        if node not in labels_of:
            continue
        devices = sorted(
            (
                json.dumps({k: v for k, v in d.items() if k != "name"}, sort_keys=True)
                for s in by_node[node]
                for d in (s.get("spec") or {}).get("devices") or ()
            ),
        )
        signature = json.dumps(devices)
        if signature not in shapes:
            shapes[signature] = _shape_from_slices(f"copy-of-{node}", node, by_node[node], labels_of[node])
    return list(shapes.values())


def build_template(shape: NodeShape, node: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The slices and labels of one template node named ``node``."""
    slices = []
    for index, original in enumerate(shape.slices):
        s = copy.deepcopy(original)
        s["metadata"] = {"name": f"{node}-{s['spec']['driver']}-{index}"}
        s["spec"]["nodeName"] = node
        s["spec"]["pool"] = {**s["spec"]["pool"], "name": node}
        slices.append(s)
    labels = {k: v for k, v in shape.labels if k != "kubernetes.io/hostname"}
    labels["kubernetes.io/hostname"] = node
    return slices, labels


def place_greedily(
    state: ClusterState,
    claims: Sequence[dict[str, Any]],
    groups: Sequence[Sequence[int]],
    *,
    node: str | None = None,
    exclude_nodes: frozenset[str] = frozenset(),
    policy: str = "best-fit",
) -> tuple[list[dict[str, Any] | None], int]:
    """Allocate the pod groups one after another, each counted before the next, without
    backtracking across groups. Cheap where a joint search that must prove "does not fit" can take
    seconds; and when it places every group, a joint search would succeed too (so a hint built on
    it really fits). Returns (allocation per claim, groups placed); ``state`` is left as it was."""
    allocations: list[dict[str, Any] | None] = [None] * len(claims)
    tentative: list[dict[str, Any]] = []
    placed = 0
    try:
        for group in groups:
            result = state.allocate(
                [claims[i] for i in group], node=node, policy=policy, exclude_nodes=exclude_nodes
            )
            if result is None:
                break
            for index, allocation in zip(group, result, strict=True):
                allocations[index] = allocation
                tentative.append(claims[index])
                state.upsert_claim({**claims[index], "status": {"allocation": allocation}})
            placed += 1
    finally:
        for claim in tentative:
            state.upsert_claim(claim)  # unallocated again: its tentative share is gone
    return allocations, placed


def _template_names(shape: NodeShape, count: int) -> list[str]:
    base = shape.name.replace("/", "-").replace(".", "-").lower()
    return [f"scale-up-{base}-{i}" for i in range(count)]


def compute_hint(
    claims: Sequence[dict[str, Any]],
    *,
    pod_groups: Sequence[Sequence[int]],
    shapes: Sequence[NodeShape],
    cluster_slices: Iterable[dict[str, Any]] = (),
    classes: Iterable[dict[str, Any]] = (),
    allocated_claims: Iterable[dict[str, Any]] = (),
    nodes: Iterable[dict[str, Any]] = (),
    exclude_nodes: frozenset[str] = frozenset(),
    policy: str = "best-fit",
    topology_label: str = "topology.kubernetes.io/zone",
    max_nodes: int = MAX_TEMPLATE_NODES,
) -> Hint | None:
    """The best shape and node count that make ``claims`` fit (None when no shape can)."""
    if not claims:
        return None
    limit = max(1, min(max_nodes, len(pod_groups) or len(claims)))
    state = ClusterState(topology_label=topology_label)
    for c in classes:
        state.upsert_class(c)
    for s in cluster_slices:
        state.upsert_slice(s)
    for n in nodes:
        state.upsert_node(str(n["metadata"]["name"]), dict(n["metadata"].get("labels") or {}))
    for claim in allocated_claims:
        state.upsert_claim(claim)
    names_of: dict[str, list[str]] = {}
    for shape in shapes:
        names_of[shape.name] = _template_names(shape, limit)
        for node in names_of[shape.name]:
            slices, labels = build_template(shape, node)
            state.upsert_node(node, labels)
            for s in slices:
                state.upsert_slice(s)
    every_template = frozenset(n for names in names_of.values() for n in names)
    groups = [list(g) for g in pod_groups] or [[i] for i in range(len(claims))]

    def attempt(shape: NodeShape, count: int) -> list[dict[str, Any]] | None:
        allowed = set(names_of[shape.name][:count])
        excluded = exclude_nodes | (every_template - allowed)
        allocations, placed = place_greedily(state, claims, groups, exclude_nodes=excluded, policy=policy)
        return [a for a in allocations if a is not None] if placed == len(groups) else None

    best: tuple[tuple[int, int, bool, str], Hint] | None = None
    for shape in shapes:
        if attempt(shape, limit) is None:
            continue
        low, high = 1, limit
        while low < high:  # smallest count that fits
            middle = (low + high) // 2
            if attempt(shape, middle) is None:
                low = middle + 1
            else:
                high = middle
        result = attempt(shape, low)
        if result is None:  # defensive: the search ended on a fitting count
            continue
        used = sorted({n for n in (allocation_node(a) for a in result) if n in every_template})
        count = max(1, len(used)) if used else low
        hint = Hint(profile=shape.name, nodes=count, allocations=tuple(result), node_names=tuple(used))
        rank = (count, count * shape.gpu_memory_bytes, shape.name.startswith("copy-of-"), shape.name)
        if best is None or rank < best[0]:
            best = (rank, hint)
    return None if best is None else best[1]


def render_hint(hint: Hint) -> str:
    """The ``fractional.dev/scale-up-hint`` annotation value."""
    return json.dumps({"profile": hint.profile, "nodes": hint.nodes}, separators=(",", ":"))

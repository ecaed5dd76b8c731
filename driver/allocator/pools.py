"""Pool gathering for one node (upstream ``GatherPools``, ``internal/incubating/pools_incubating.go``)
and node-selector matching.

``gather_pools`` sees the slices of every candidate pool and answers the ordered pools the node can
allocate from: highest generation wins; a pool short of ``resourceSliceCount`` slices for this node is
rechecked against all of its slices (a newer generation elsewhere makes it obsolete and it is dropped;
still short makes it incomplete); complete pools are validated (unique device and counter-set names,
resolvable ``consumesCounters``). Order: pools by (has binding conditions, driver, pool), slices by
name, devices in slice order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from driver.allocator.model import Device, Slice

__all__ = ["Candidate", "PoolView", "gather_pools", "matches_node_selector"]


def _requirement_matches(requirement: Mapping[str, Any], value: str | None) -> bool:
    operator = requirement.get("operator", "")
    values: list[str] = list(requirement.get("values") or ())
    if operator == "In":
        return value is not None and value in values
    if operator == "NotIn":
        return value is None or value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    if operator in ("Gt", "Lt") and value is not None and len(values) == 1:
        try:
            left, right = int(value), int(values[0])
        except ValueError:
            return False
        return left > right if operator == "Gt" else left < right
    return False


def matches_node_selector(selector: Mapping[str, Any] | None, node: str, labels: Mapping[str, str]) -> bool:
    """A core/v1 NodeSelector: terms are ORed, requirements within a term ANDed; empty terms match nothing."""
    if not selector:
        return False
    for term in selector.get("nodeSelectorTerms") or ():
        expressions = term.get("matchExpressions") or ()
        fields = term.get("matchFields") or ()
        if not expressions and not fields:
            continue
        if all(_requirement_matches(r, labels.get(r.get("key", ""))) for r in expressions) and all(
            _requirement_matches(r, node if r.get("key") == "metadata.name" else None) for r in fields
        ):
            return True
    return False


def device_targets(device: Device, node: str, labels: Mapping[str, str]) -> bool:
    if device.node_name is not None:
        return device.node_name == node
    if device.all_nodes:
        return True
    return matches_node_selector(device.node_selector, node, labels)


def slice_targets(slice_: Slice, node: str, labels: Mapping[str, str]) -> bool:
    if slice_.node_name is not None:
        return slice_.node_name == node
    if slice_.all_nodes:
        return True
    if slice_.node_selector is not None:
        return matches_node_selector(slice_.node_selector, node, labels)
    if slice_.per_device:
        return any(device_targets(d, node, labels) for d in slice_.devices)
    return False


@dataclass(frozen=True, slots=True)
class Candidate:
    """A device as the search sees it on one node: its pool and slice, and its position in pool order."""

    position: int
    pool_key: tuple[str, str]
    slice: Slice
    device: Device


@dataclass(frozen=True, slots=True)
class PoolView:
    key: tuple[str, str]
    generation: int
    slices: tuple[Slice, ...]
    incomplete: bool
    invalid: str | None
    binding_last: bool


def _validate(key: tuple[str, str], slices: list[Slice], others: list[Slice]) -> str | None:
    """Why the pool is invalid, or None (upstream ``buildPool``).

    ``slices`` target the node; ``others`` are the pool's slices of the same generation that do not,
    read only when the pool looked incomplete from the node's slices alone (upstream's re-scan). Device
    names must be unique among ``slices``; counter-set names unique across both; and every device of
    both must consume only counters that exist, so a bad device on another node invalidates the pool
    here too (``partitionable-devices-validation-error-on-non-targeting-slice``).
    """
    for slice_ in (*slices, *others):
        if slice_.invalid:
            return slice_.invalid
    names: set[str] = set()
    for slice_ in slices:
        for device in slice_.devices:
            if device.name in names:
                return f"pool {key[0]}/{key[1]}: duplicate device name {device.name!r}"
            names.add(device.name)
    sets: dict[str, dict[str, Any]] = {}
    for slice_ in (*slices, *others):
        for set_name in slice_.counter_set_names:
            if set_name in sets:
                return f"pool {key[0]}/{key[1]}: duplicate counter set {set_name!r}"
            sets[set_name] = slice_.counters.get(set_name, {})
    for slice_ in (*slices, *others):
        for device in slice_.devices:
            for set_name, counters in device.consumes:
                if set_name not in sets:
                    return f"pool {key[0]}/{key[1]}: device {device.name}: unknown counter set {set_name!r}"
                for counter, _ in counters:
                    if counter not in sets[set_name]:
                        return (
                            f"pool {key[0]}/{key[1]}: device {device.name} references unknown counter "
                            f"{counter!r} in set {set_name!r}"
                        )
    return None


def gather_pools(
    pools: Mapping[tuple[str, str], Mapping[str, Slice]], node: str, labels: Mapping[str, str]
) -> tuple[tuple[PoolView, ...], tuple[Candidate, ...]]:
    """The pools usable on ``node`` (ordered) and their devices as candidates in allocation order."""
    views: list[PoolView] = []
    for key, by_name in pools.items():
        all_slices = list(by_name.values())
        relevant = [s for s in all_slices if slice_targets(s, node, labels)]
        if not relevant:
            continue
        generation = max(s.generation for s in relevant)
        current = [s for s in relevant if s.generation == generation]
        expected = current[0].count
        incomplete = False
        others: list[Slice] = []
        if len(current) != expected:
            if any(s.generation > generation for s in all_slices):
                continue  # obsolete
            current_names = {s.name for s in current}
            others = [s for s in all_slices if s.generation == generation and s.name not in current_names]
            incomplete = len(current) + len(others) != expected
        current.sort(key=lambda s: s.name)
        others.sort(key=lambda s: s.name)
        invalid = None if incomplete else _validate(key, current, others)
        binding_last = any(d.binding_conditions for s in current for d in s.devices)
        views.append(PoolView(key, generation, tuple(current), incomplete, invalid, binding_last))
    views.sort(key=lambda v: (v.binding_last, v.key))
    candidates: list[Candidate] = []
    for view in views:
        if view.incomplete or view.invalid:
            continue
        for slice_ in view.slices:
            for device in slice_.devices:
                if slice_.per_device and not device_targets(device, node, labels):
                    continue
                candidates.append(Candidate(len(candidates), view.key, slice_, device))
    return tuple(views), tuple(candidates)

"""Rendering a search solution as ``status.allocation`` (AllocationResult) dicts, as upstream
``structured/internal/incubating/allocator_incubating.go`` assembles them."""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence
from typing import Any

from driver.allocator.model import Claim
from driver.allocator.quantity import format_quantity
from driver.allocator.search import Entry

__all__ = ["new_share_id", "render_allocation"]

# Share IDs must be unique, not secret. uuid4() reads os.urandom for every ID, and that call lets go
# of the GIL: the decider, holding the cache lock, then waited up to a switch interval (5 ms) to get
# it back, once per share, while the writers waited for the lock. A generator seeded once from the OS
# (random.Random() with no seed reads os.urandom) gives the same 122 random bits without the syscall.
_SHARE_IDS = random.Random()


def new_share_id(rng: random.Random | None) -> str:
    """A lowercase RFC-4122 (version 4) UUID; from ``rng`` when given, so tests can reproduce it."""
    return str(uuid.UUID(int=(rng or _SHARE_IDS).getrandbits(128), version=4))


def _node_selector(entries: Sequence[Entry], node: str) -> dict[str, Any] | None:
    expressions: list[dict[str, Any]] = []
    fields: list[dict[str, Any]] = []
    for entry in entries:
        slice_ = entry.candidate.slice
        device = entry.candidate.device
        if slice_.node_name is not None or device.node_name is not None or device.binds_to_node:
            return {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            }
        selector = slice_.node_selector if slice_.node_selector is not None else device.node_selector
        for term in (selector or {}).get("nodeSelectorTerms") or ():
            for requirement in term.get("matchExpressions") or ():
                if requirement not in expressions:
                    expressions.append(requirement)
            for requirement in term.get("matchFields") or ():
                if requirement not in fields:
                    fields.append(requirement)
    if not expressions and not fields:
        return None
    merged: dict[str, Any] = {}
    if expressions:
        merged["matchExpressions"] = expressions
    if fields:
        merged["matchFields"] = fields
    return {"nodeSelectorTerms": [merged]}


def _configs(claim: Claim, entries: Sequence[Entry]) -> list[dict[str, Any]]:
    all_parents = [slot.name for slot in claim.slots]
    chosen = [entry.request for entry in entries]
    configs: list[dict[str, Any]] = []
    by_class: dict[str, list[str]] = {}
    for request in chosen:
        names = by_class.setdefault(request.class_name, [])
        if request.name not in names:
            names.append(request.name)
    for class_name, names in by_class.items():
        spec = (claim.classes.get(class_name) or {}).get("spec") or {}
        parents = {name.split("/", 1)[0] for name in names}
        covers_all = parents >= set(all_parents)
        for config in spec.get("config") or ():
            item: dict[str, Any] = {"source": "FromClass"}
            if not covers_all:
                item["requests"] = list(names)
            item.update({k: v for k, v in config.items() if k != "requests"})
            configs.append(item)
    chosen_names = {request.name for request in chosen} | {request.parent for request in chosen}
    for config in claim.config:
        requests = list(config.get("requests") or ())
        if requests and not any(name in chosen_names for name in requests):
            continue
        item = {"source": "FromClaim"}
        if requests and not {name.split("/", 1)[0] for name in requests} >= set(all_parents):
            item["requests"] = requests
        item.update({k: v for k, v in config.items() if k != "requests"})
        configs.append(item)
    return configs


def render_allocation(
    claim: Claim, entries: Sequence[Entry], node: str, rng: random.Random | None
) -> dict[str, Any]:
    results = []
    for entry in entries:
        device = entry.candidate.device
        result: dict[str, Any] = {
            "request": entry.request.name,
            "driver": device.id[0],
            "pool": device.id[1],
            "device": device.name,
        }
        if entry.request.admin:
            result["adminAccess"] = True
        if entry.request.tolerations_raw:
            result["tolerations"] = [dict(t) for t in entry.request.tolerations_raw]
        if device.binding_conditions:
            result["bindingConditions"] = list(device.binding_conditions)
        if device.binding_failure_conditions:
            result["bindingFailureConditions"] = list(device.binding_failure_conditions)
        if device.allow_multiple:
            result["shareID"] = new_share_id(rng)
            if entry.consumed:
                result["consumedCapacity"] = {k: format_quantity(v) for k, v in entry.consumed.items()}
        results.append(result)
    devices: dict[str, Any] = {"results": results}
    configs = _configs(claim, entries)
    if configs:
        devices["config"] = configs
    allocation: dict[str, Any] = {"devices": devices}
    selector = _node_selector(entries, node)
    if selector is not None:
        allocation["nodeSelector"] = selector
    return allocation

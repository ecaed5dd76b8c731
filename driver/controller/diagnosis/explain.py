"""Why a gang does not fit, in words: what it asks for and what the best single node offers.

``describe_demand`` reads the claims (pure); ``best_node_offer`` asks the allocator, node by node,
how many of the gang's pods fit there alone (under ``cache.lock``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from driver.allocator import ClusterState
from driver.controller.gangs.plan import PodGroup
from driver.controller.model.objects import quantity
from driver.controller.sizing.hints import place_greedily

__all__ = ["NodeOffer", "best_node_offer", "describe_demand", "format_bytes", "share_memory_requests"]

_GPU_CLASS = "gpu.fractional.dev"


def format_bytes(value: int) -> str:
    for suffix, factor in (("Ti", 1024**4), ("Gi", 1024**3), ("Mi", 1024**2)):
        if value >= factor:
            amount = value / factor
            return f"{amount:.0f}{suffix}" if amount == int(amount) else f"{amount:.1f}{suffix}"
    return f"{value}B"


def _requests(claim: dict[str, Any]) -> list[tuple[dict[str, Any], int]]:
    """(the request or its first alternative, device count) per request of a claim."""
    out = []
    for request in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ():
        exact = request.get("exactly") or next(iter(request.get("firstAvailable") or ()), None) or {}
        count = 1 if exact.get("allocationMode") == "All" else int(exact.get("count") or 1)
        out.append((exact, count))
    return out


def share_memory_requests(claims: Sequence[dict[str, Any]]) -> list[int]:
    """The memory each GPU share of ``claims`` asks for, in bytes (fragmentation metric)."""
    sizes = []
    for claim in claims:
        for exact, _count in _requests(claim):
            memory = ((exact.get("capacity") or {}).get("requests") or {}).get("memory")
            if memory is not None:
                sizes.append(int(quantity(memory)))
    return sizes


def _locality(claims: Sequence[dict[str, Any]]) -> str:
    names = set()
    for claim in claims:
        for constraint in ((claim.get("spec") or {}).get("devices") or {}).get("constraints") or ():
            attribute = str(constraint.get("matchAttribute") or "")
            if attribute.endswith("nvlinkDomain"):
                names.add("on NVLink-local GPUs")
            elif attribute.endswith("pcieRoot"):
                names.add("under one PCIe root")
            elif attribute.endswith("numaNode"):
                names.add("on one NUMA node")
            elif attribute:
                names.add(f"with equal {attribute}")
            if constraint.get("distinctAttribute"):
                names.add("on distinct GPUs")
    return (" " + " and ".join(sorted(names)) + " (per claim)") if names else ""


def describe_demand(claims: Sequence[dict[str, Any]]) -> str:
    """E.g. "16 shares of >=40Gi (15% compute) on NVLink-local GPUs (per claim)"."""
    kinds: Counter[str] = Counter()
    for claim in claims:
        for exact, count in _requests(claim):
            cls = exact.get("deviceClassName", "?")
            asked = (exact.get("capacity") or {}).get("requests") or {}
            if cls == _GPU_CLASS and asked:
                what = "shares"
                if "memory" in asked:
                    what += f" of >={format_bytes(int(quantity(asked['memory'])))}"
                if "compute" in asked:
                    what += f" ({asked['compute']}% compute)"
            elif cls == _GPU_CLASS:
                what = "whole GPUs"
            else:
                what = f"devices of class {cls}"
            kinds[what] += count
    parts = [f"{count} {what}" for what, count in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))]
    return (", ".join(parts) or "no devices") + _locality(claims)


@dataclass(frozen=True, slots=True)
class NodeOffer:
    node: str
    pods: int  # gang pods (groups) that fit on this node alone
    shares: int  # devices those pods would get


def best_node_offer(
    state: ClusterState,
    groups: Sequence[PodGroup],
    nodes: Sequence[str],
    *,
    policy: str,
) -> NodeOffer | None:
    """For each node, how many of the gang's pods fit there alone, placed one after another; the
    node offering the most devices wins."""
    pending = [g for g in groups if g.pending_claims]
    if not pending:
        return None
    claims = [c for g in pending for c in g.pending_claims]
    indexes, start = [], 0
    for group in pending:
        indexes.append(list(range(start, start + len(group.pending_claims))))
        start += len(group.pending_claims)
    best: NodeOffer | None = None
    for node in sorted(nodes):
        allocations, placed = place_greedily(state, claims, indexes, node=node, policy=policy)
        shares = sum(len(((a or {}).get("devices") or {}).get("results") or ()) for a in allocations)
        if best is None or (shares, placed) > (best.shares, best.pods):
            best = NodeOffer(node=node, pods=placed, shares=shares)
    return best

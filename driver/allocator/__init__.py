"""Structured allocator: upstream DRA semantics, best-fit placement, gangs (pure: dicts in, dicts out).

Public API::

    allocate(claims, *, slices, classes, allocated=(), node=None, policy="best-fit", nodes=None,
             pod_groups=None, exclude_nodes=frozenset(), rng=None) -> list[dict] | None
    allocate_many(groups, *, slices, classes, allocated=(), node=None, policy="best-fit", nodes=None,
                  pod_groups=None, exclude_nodes=frozenset(), rng=None) -> list[list[dict] | None]
    ClusterState(topology_label="topology.kubernetes.io/zone")   # incremental, for the controller;
        # .allocate(...) and .allocate_many(...) take the same keywords minus the cluster's objects
    check_booking(state, claim) -> tuple[Overbooking, ...]   # would this allocation, written by
        # anyone, book a device past its capacity given what the state counts for other claims?

``allocate`` returns one ``status.allocation`` dict per claim, in order, or None when the claims cannot
all be allocated; it raises AllocationError for what upstream treats as fatal. ``allocate_many`` places
many independent groups (a pod's claims, or a gang) at once, each all-or-nothing on its own, and
answers one entry per group in order (None for a group that does not fit); a fatal error in one group
raises GroupAllocationError naming it. See docs/architecture.md: Contracts.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from driver.allocator.backends import check_no_claim_backend
from driver.allocator.batch import GroupAllocationError
from driver.allocator.booking import Overbooking, check_booking
from driver.allocator.cluster import ClusterState
from driver.errors import AllocationError

__all__ = [
    "AllocationError",
    "ClusterState",
    "GroupAllocationError",
    "Overbooking",
    "allocate",
    "allocate_many",
    "check_booking",
    "check_no_claim_backend",
]


def _build_state(
    *,
    slices: Iterable[Mapping[str, Any]],
    classes: Iterable[Mapping[str, Any]],
    allocated: Iterable[Mapping[str, Any]],
    nodes: Mapping[str, Mapping[str, str]] | None,
    topology_label: str,
) -> ClusterState:
    state = ClusterState(topology_label=topology_label)
    for device_class in classes:
        state.upsert_class(device_class)
    for resource_slice in slices:
        state.upsert_slice(resource_slice)
    for name, labels in (nodes or {}).items():
        state.upsert_node(name, labels)
    for claim in allocated:
        state.upsert_claim(claim)
    return state


def allocate(
    claims: Sequence[Mapping[str, Any]],
    *,
    slices: Iterable[Mapping[str, Any]],
    classes: Iterable[Mapping[str, Any]],
    allocated: Iterable[Mapping[str, Any]] = (),
    node: str | None = None,
    policy: str = "best-fit",
    nodes: Mapping[str, Mapping[str, str]] | None = None,
    pod_groups: Sequence[Sequence[int]] | None = None,
    exclude_nodes: frozenset[str] | set[str] = frozenset(),
    rng: random.Random | None = None,
    topology_label: str = "topology.kubernetes.io/zone",
) -> list[dict[str, Any]] | None:
    """Allocate ``claims`` (a gang: all or none) on ``node``, or choose nodes when ``node`` is None."""
    state = _build_state(
        slices=slices, classes=classes, allocated=allocated, nodes=nodes, topology_label=topology_label
    )
    return state.allocate(
        claims, node=node, policy=policy, pod_groups=pod_groups, exclude_nodes=exclude_nodes, rng=rng
    )


def allocate_many(
    groups: Sequence[Sequence[Mapping[str, Any]]],
    *,
    slices: Iterable[Mapping[str, Any]],
    classes: Iterable[Mapping[str, Any]],
    allocated: Iterable[Mapping[str, Any]] = (),
    node: str | None = None,
    policy: str = "best-fit",
    nodes: Mapping[str, Mapping[str, str]] | None = None,
    pod_groups: Sequence[Sequence[Sequence[int]] | None] | None = None,
    exclude_nodes: frozenset[str] | set[str] | Sequence[frozenset[str] | set[str]] = frozenset(),
    rng: random.Random | None = None,
    topology_label: str = "topology.kubernetes.io/zone",
) -> list[list[dict[str, Any]] | None]:
    """Place many independent ``groups`` of claims at once; one entry per group (None: does not fit)."""
    state = _build_state(
        slices=slices, classes=classes, allocated=allocated, nodes=nodes, topology_label=topology_label
    )
    return state.allocate_many(
        groups, node=node, policy=policy, pod_groups=pod_groups, exclude_nodes=exclude_nodes, rng=rng
    )

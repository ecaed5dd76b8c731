"""ClusterState: the allocator's incremental cluster data (``state``) with its two entry points.

``allocate`` places one set of claims (a gang: all or none); ``allocate_many`` places many independent
groups at once (``batch``). Data lives below in ``state``; the decisions above it in ``placement`` and
``batch`` import the data, never the reverse.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any

from driver.allocator.batch import place_many
from driver.allocator.fragmentation import WHOLE, Fragmentation, Shape, Workload, shape_of
from driver.allocator.model import Request
from driver.allocator.placement import parse_claims, pod_groups_of, render_placed, solve
from driver.allocator.state import ClusterData
from driver.errors import AllocationError

__all__ = ["ClusterState"]


class ClusterState(ClusterData):
    """The allocator's view of the cluster, updated incrementally; see ``driver.allocator``."""

    def __init__(self, topology_label: str = "topology.kubernetes.io/zone") -> None:
        super().__init__(topology_label)
        self.workload = Workload()
        self._fragmentation = Fragmentation(self, self.workload)
        self._cpu_source: Callable[[str], int] | None = None  # ``track_cpu``

    def learn(self, claims: Sequence[Mapping[str, Any]], *, cpu_millis: int) -> None:
        """Count one arriving pod (its claims and CPU; no claims: a pod without devices) in the
        typical workload (``fragmentation``). Pods of shapes the model does not score are left out."""
        if not claims:
            self.workload.observe(Shape(cpu_millis, 0, WHOLE, ()), None)
            return
        try:
            found = self._shape(claims, cpu_millis)
        except AllocationError:
            return
        if found is not None:
            self.workload.observe(*found)

    def track_cpu(self, source: Callable[[str], int]) -> None:
        """``source`` gives each node's free CPU and reports each change (``cpu_changed``): the
        rankings asked with it come from nodes kept in groups (``rank_index``), not from a look at
        every node."""
        self._cpu_source = source

    def cpu_changed(self, node: str) -> None:
        """The free CPU ``track_cpu``'s source gives for ``node`` changed."""
        self._fragmentation.cpu_changed(node)

    def rank_nodes(
        self,
        claims: Sequence[Mapping[str, Any]],
        *,
        cpu_millis: int,
        cpu_free: Callable[[str], int],
        exclude_nodes: frozenset[str] | set[str] = frozenset(),
        limit: int | None = None,
    ) -> list[str] | None:
        """Nodes for one pod's ``claims`` (its CPU ``cpu_millis``; ``cpu_free`` per node), the least
        added fragment first (``fragmentation``), the first ``limit`` of them (None: all); empty
        when none can take them. None when the pod is not of a shape the model scores or nothing is
        learned yet: the caller then lets ``allocate`` choose."""
        found = self._shape(claims, cpu_millis)
        if found is None:
            return None
        return self._rank(found[0], found[1], cpu_free, exclude_nodes, limit)

    def ranks(self, claims: Sequence[Mapping[str, Any]], *, cpu_millis: int) -> bool:
        """Whether ``rank_nodes`` ranks one pod's ``claims`` (a shape the model scores, and a
        workload learned), so that the pod is not decided as best-fit decides it. False for claims
        that cannot be parsed: ``allocate`` raises their error."""
        if not self._fragmentation.learned():
            return False
        try:
            return self._shape(claims, cpu_millis) is not None
        except AllocationError:
            return False

    def nodes_taking(
        self,
        claims: Sequence[Mapping[str, Any]],
        *,
        cpu_millis: int,
        cpu_free: Callable[[str], int],
        nodes: Sequence[str],
    ) -> list[str] | None:
        """``nodes`` whose devices can take one pod's ``claims``, their CPU aside, in the order
        given: exact for the pods ``rank_nodes`` ranks, and None where it gives None."""
        found = self._shape(claims, cpu_millis)
        if found is None:
            return None
        return self._fragmentation.taking(found[0], found[1], nodes, cpu_free)

    def _shape(self, claims: Sequence[Mapping[str, Any]], cpu_millis: int) -> tuple[Shape, Request] | None:
        return shape_of(parse_claims(self, claims, "best-fit"), cpu_millis)

    def rank_nodes_without_devices(
        self,
        *,
        cpu_millis: int,
        cpu_free: Callable[[str], int],
        exclude_nodes: Container[str] = frozenset(),
        limit: int | None = None,
    ) -> list[str] | None:
        """Nodes for a pod that asks for no devices, the least device memory its CPU strands for
        the typical workload first (``fragmentation``), the first ``limit`` (None: all); None until
        a workload is learned."""
        return self._rank(Shape(cpu_millis, 0, WHOLE, ()), None, cpu_free, exclude_nodes, limit)

    def _rank(
        self,
        shape: Shape,
        request: Request | None,
        cpu_free: Callable[[str], int],
        exclude_nodes: Container[str],
        limit: int | None,
    ) -> list[str] | None:
        """From the node groups where ``cpu_free`` is the tracked source, else from every node."""
        if self._cpu_source is not None and cpu_free == self._cpu_source:
            return self._fragmentation.rank_grouped(shape, request, exclude_nodes, cpu_free, limit)
        nodes = [n for n in self.node_names() if n not in exclude_nodes]
        ranked = self._fragmentation.rank(shape, request, nodes, cpu_free)
        return ranked if ranked is None or limit is None else ranked[:limit]

    def allocate(
        self,
        claims: Sequence[Mapping[str, Any]],
        *,
        node: str | None = None,
        policy: str = "best-fit",
        pod_groups: Sequence[Sequence[int]] | None = None,
        exclude_nodes: frozenset[str] | set[str] = frozenset(),
        rng: random.Random | None = None,
    ) -> list[dict[str, Any]] | None:
        """One ``status.allocation`` per claim in order, or None when they cannot all be allocated."""
        parsed = parse_claims(self, claims, policy)
        if not parsed:
            return []
        groups = pod_groups_of(pod_groups, len(parsed), node)
        placed = solve(
            self,
            parsed,
            node=node,
            best_fit=policy != "first-fit",
            groups=groups,
            exclude_nodes=exclude_nodes,
        )
        return None if placed is None else render_placed(parsed, groups, placed, rng)

    def allocate_many(
        self,
        groups: Sequence[Sequence[Mapping[str, Any]]],
        *,
        node: str | None = None,
        policy: str = "best-fit",
        pod_groups: Sequence[Sequence[Sequence[int]] | None] | None = None,
        exclude_nodes: frozenset[str] | set[str] | Sequence[frozenset[str] | set[str]] = frozenset(),
        rng: random.Random | None = None,
    ) -> list[list[dict[str, Any]] | None]:
        """One entry per group, in order: its allocations, or None when that group does not fit.

        ``pod_groups``: per group, what ``allocate`` takes as ``pod_groups`` (or None). ``exclude_nodes``:
        one set for every group, or one per group. Raises ``GroupAllocationError`` (an AllocationError
        naming the group's index) for a group with a fatal error; nothing is held either way.
        """
        return place_many(
            self, groups, node=node, policy=policy, pod_groups=pod_groups, exclude_nodes=exclude_nodes,
            rng=rng,
        )  # fmt: skip

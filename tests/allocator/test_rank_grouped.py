"""The fragmentation ranking from groups of nodes alike (``rank_index``) equals the look at every node.

``rank`` visits every node for each decision: at 5,000 alike nodes a decision took 8 ms in the
median, 1.5 at 1,000 (the issue "Production size" allows 2x from 1,000 to 5,000). The controller's
cache reports each change of a node's free CPU (``ClusterState.track_cpu`` / ``cpu_changed``), and
the state each change of its devices, so the nodes are kept in groups and each group is scored once.
The answer must be the same nodes in the same order, through allocations, releases, CPU changes,
nodes coming and going, and new selectors.
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from driver.allocator import ClusterState
from tests.allocator.test_fragmentation_policy import _claim, _slice, _state, _teach


class _Cpu:
    """Each node's free CPU, reporting every change to the state as the controller's cache does."""

    def __init__(self, state: ClusterState, free: dict[str, int]) -> None:
        self.state, self.free = state, free
        state.track_cpu(self.of)

    def of(self, node: str) -> int:
        return self.free.get(node, 0)

    def set(self, node: str, cpu: int) -> None:
        self.free[node] = cpu
        self.state.cpu_changed(node)


def _both(
    state: ClusterState,
    cpu: _Cpu,
    claim: dict[str, Any],
    pod_cpu: int,
    exclude: frozenset[str],
    limit: int | None,
) -> tuple[list[str] | None, list[str] | None]:
    grouped = state.rank_nodes(
        [claim], cpu_millis=pod_cpu, cpu_free=cpu.of, exclude_nodes=exclude, limit=limit
    )
    every = state.rank_nodes([claim], cpu_millis=pod_cpu, cpu_free=lambda n: cpu.of(n), exclude_nodes=exclude)
    return grouped, every if every is None or limit is None else every[:limit]


def test_alike_nodes_rank_in_the_fixed_tie_order_and_the_used_one_first() -> None:
    nodes = {f"n{i:02d}": [(80, "H100")] * 8 for i in range(20)}
    state = _state(nodes)
    cpu = _Cpu(state, dict.fromkeys(nodes, 64_000))
    _teach(state, [(_claim(10), 4000), (_claim(None), 8000)], 20)
    first, every = _both(state, cpu, _claim(10), 4000, frozenset(), None)
    assert first == every and len(first or ()) == 20
    state.upsert_claim(dict(used := _claim(10), status={"allocation": state.allocate([used], node="n07")[0]}))
    cpu.set("n07", 60_000)
    ranked, every = _both(state, cpu, _claim(10), 4000, frozenset(), 3)
    assert ranked == every and ranked and ranked[0] == "n07"  # a node in use before untouched ones
    ranked, every = _both(state, cpu, _claim(10), 4000, frozenset({"n07"}), 3)
    assert ranked == every and "n07" not in (ranked or ())


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_the_grouped_ranking_equals_the_look_at_every_node(seed: int) -> None:
    rng = random.Random(seed)
    models = ("A100", "L4", "T4")
    nodes = {f"n{i}": [(rng.choice((16, 80)), rng.choice(models))] * rng.choice((1, 2, 4)) for i in range(10)}
    state = _state(nodes)
    cpu = _Cpu(state, {n: rng.choice((8000, 16_000, 32_000)) for n in nodes})
    typical = [(_claim(rng.choice((4, 8, None))), rng.choice((1000, 4000))) for _ in range(3)]
    _teach(state, typical, 8)
    held: list[tuple[dict[str, Any], str]] = []
    for _ in range(25):
        action = rng.randrange(6)
        if action == 0 and held:  # a release
            claim, node = held.pop(rng.randrange(len(held)))
            state.remove_claim(claim["metadata"]["uid"])
        elif action == 1:  # CPU taken or freed
            cpu.set(rng.choice(list(nodes)), rng.choice((0, 2000, 8000, 16_000, 32_000)))
        elif action == 2:  # a node goes, or comes back
            node = rng.choice(list(nodes))
            if rng.random() < 0.5:
                state.remove_slice(f"{node}-slice")
                state.remove_node(node)
            else:
                state.upsert_slice(_slice(node, nodes[node]))
                state.upsert_node(node, {"kubernetes.io/hostname": node})
        elif action == 3:  # a pod of a model list not seen before: a new selector
            _teach(state, [(_claim(4, models=(rng.choice(models),)), 1000)], 1)
        else:  # an allocation where the pod fits
            claim = _claim(rng.choice((4, 8, 16, None)), models=rng.choice(((), (rng.choice(models),))))
            node = rng.choice(list(nodes))
            allocation = state.allocate([claim], node=node)
            if allocation:
                state.upsert_claim(dict(claim, status={"allocation": allocation[0]}))
                held.append((claim, node))
        probe = _claim(
            rng.choice((4, 8, 16, None)), count=rng.choice((1, 1, 2)), models=rng.choice(((), ("L4",)))
        )
        exclude = frozenset(n for n in nodes if rng.random() < 0.2)
        grouped, every = _both(
            state, cpu, probe, rng.choice((0, 1000, 8000)), exclude, rng.choice((None, 1, 4))
        )
        assert grouped == every
        pod_cpu, limit = rng.choice((0, 1000, 8000)), rng.choice((None, 1))
        grouped = state.rank_nodes_without_devices(
            cpu_millis=pod_cpu, cpu_free=cpu.of, exclude_nodes=exclude, limit=limit
        )
        every = state.rank_nodes_without_devices(
            cpu_millis=pod_cpu, cpu_free=lambda n: cpu.of(n), exclude_nodes=exclude, limit=limit
        )
        assert grouped == every  # a pod without devices

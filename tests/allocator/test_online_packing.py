"""Online best-fit packs at least as well as first-fit: each share placed alone, in order.

The traces are bench/packing_traces.py's, on its tuning seeds (what the rule was chosen on), and the two
measures are bench/bench_allocator.py's: GPUs used placing a whole trace on 13 nodes x 8 GPUs (lower is
better), and shares placed on one node of 8 GPUs before the first refusal (higher is better), summed
over a family's traces. A change to the best-fit order that packs worse than upstream's order on any
family fails here; the held-out seeds stay in the bench, for reporting only.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest
from allocator_builders import gpu_cluster, share

from driver.allocator import ClusterState

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from packing_traces import CLUSTER_NODES, FAMILIES, TUNING_SEEDS, packing_trace

PREFIX_GPUS = 8


def _state(nodes: int) -> ClusterState:
    return gpu_cluster(nodes)


def _place(
    state: ClusterState, raw: dict[str, Any], policy: str, rng: random.Random
) -> tuple[str, str] | None:
    """The (node, GPU) the share went to, held in ``state``; None when it fits nowhere."""
    allocation = state.allocate([raw], policy=policy, rng=rng)
    if allocation is None:
        return None
    state.assume([{**raw, "status": {"allocation": allocation[0]}}])
    placed = allocation[0]["devices"]["results"][0]
    return placed["pool"], placed["device"]


def _gpus_used(shares: list[tuple[int, int]], policy: str) -> int:
    state = _state(CLUSTER_NODES)
    rng = random.Random(0)
    used = set()
    for index, (memory_gi, compute) in enumerate(shares):
        where = _place(state, share(f"o{index}", memory_gi, compute), policy, rng)
        assert where is not None, "CLUSTER_NODES x 8 GPUs hold every trace"
        used.add(where)
    return len(used)


def _prefix(shares: list[tuple[int, int]], policy: str) -> int:
    state = _state(PREFIX_GPUS // 8)
    rng = random.Random(0)
    for index, (memory_gi, compute) in enumerate(shares):
        if _place(state, share(f"p{index}", memory_gi, compute), policy, rng) is None:
            return index
    return len(shares)


@pytest.mark.parametrize("family", FAMILIES)
def test_online_best_fit_packs_at_least_as_well_as_first_fit_on_the_tuning_traces(family: str) -> None:
    traces = [packing_trace(family, seed) for seed in TUNING_SEEDS]
    gpus = {policy: sum(_gpus_used(t, policy) for t in traces) for policy in ("first-fit", "best-fit")}
    prefix = {policy: sum(_prefix(t, policy) for t in traces) for policy in ("first-fit", "best-fit")}
    assert gpus["best-fit"] <= gpus["first-fit"], gpus
    assert prefix["best-fit"] >= prefix["first-fit"], prefix

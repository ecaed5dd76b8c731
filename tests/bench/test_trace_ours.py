"""bench/trace_ours.py: the controller's decision path on a made-up trace, refereed by the harness.

The harness's own cluster checks every placement the controller makes (never past a GPU's capacity,
a node's CPU or memory, or the pod's GPU model), so a replay that finishes is the invariant; on top
of that: a pod fails only when no node of the harness's cluster could take it right then, and the
share mapping is exact (shares fit one GPU exactly when their milli add up to 1,000).
"""

from __future__ import annotations

import random

import pytest

from bench.fgd_trace import Cluster, Run, TraceNode, TracePod, replay
from bench.trace_ours import OursPolicy

MODELS = ("G2", "T4", "P100")


def _trace(seed: int) -> tuple[list[TraceNode], Run]:
    rng = random.Random(seed)
    nodes = [
        TraceNode(f"node-{i:02d}", rng.choice((8_000, 32_000, 96_000)), rng.choice((32_768, 262_144)),
                  rng.choice((1, 2, 4, 8)), rng.choice(MODELS))
        for i in range(10)
    ]  # fmt: skip
    pods = []
    for i in range(160):
        kind = rng.random()
        if kind < 0.15:
            gpus, milli = 0, 0
        elif kind < 0.65:
            gpus, milli = 1, rng.choice((100, 250, 333, 460, 500, 810))
        else:
            gpus, milli = rng.choice((1, 1, 2, 4)), 1000
        spec = tuple(sorted(rng.sample(MODELS, rng.choice((1, 2))))) if gpus and rng.random() < 0.3 else ()
        pods.append(TracePod(f"pod-{i:03d}", rng.choice((1_000, 4_000, 12_000)), rng.choice((1_024, 16_384)),
                             gpus, milli, spec))  # fmt: skip
    return nodes, Run(seed=seed, pods=pods, node_order=list(range(len(nodes))), originals=tuple(pods),
                      first_copy=len(pods))  # fmt: skip


@pytest.mark.parametrize("all_pods", [False, True])
@pytest.mark.parametrize("policy", ["best-fit", "fragmentation"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_placement_passes_the_referee_and_a_pod_fails_only_where_nothing_fits(
    seed: int, policy: str, all_pods: bool
) -> None:
    nodes, run = _trace(seed)

    class Watched(OursPolicy):
        """Checks each refusal against a copy of the cluster as it was just before it."""

        def __init__(self) -> None:
            super().__init__(nodes, seed=seed, policy=policy, all_pods=all_pods)
            self.shadow = Cluster(nodes)

        def place(self, pod: TracePod):  # type: ignore[no-untyped-def]
            choice = super().place(pod)
            if choice is None:
                assert not any(self.shadow.fits(pod, n) for n in range(len(nodes))), f"{pod} fits but failed"
            return choice

        def placed(self, pod: TracePod, node: int, gpus: tuple[tuple[int, int], ...]) -> None:
            self.shadow.apply(pod, node, gpus)

    result = replay(nodes, run, Watched())  # raises PlacementError on any invalid placement
    placed = [p for p in result.placements if p[0] is not None]
    assert len(placed) >= 20  # the cluster fills: 160 pods ask for more than 10 nodes hold
    assert result.events[-1][1] == sum(m for _, gpus in placed for _, m in gpus)


def test_three_shares_of_333_share_one_gpu_and_a_fourth_does_not() -> None:
    nodes = [TraceNode("only", 64_000, 262_144, 1, "T4")]
    pods = [TracePod(f"p{i}", 1_000, 1_024, 1, 333, ()) for i in range(4)] + [
        TracePod("q", 1_000, 1_024, 1, 1, ())
    ]
    run = Run(seed=0, pods=pods, node_order=[0], originals=tuple(pods), first_copy=len(pods))
    result = replay(nodes, run, OursPolicy(nodes, seed=0))
    assert [p[0] for p in result.placements] == [0, 0, 0, None, 0]  # 999 milli, then 1 more fits exactly
    assert result.placements[0][1] == ((0, 333),)

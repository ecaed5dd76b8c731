"""bench/bench_consolidation.py's pieces: the seeded arrival stream and its offered load, the ledger
kept beside the allocator's state, one fragmented node under the three variants, and the ratios."""

from __future__ import annotations

import pytest

from bench.bench_consolidation import (
    GPU_GI,
    GPUS_PER_NODE,
    Job,
    Simulation,
    add_ratios,
    build_arrivals,
    offered_load,
)

LONG = 1e6  # seconds: outlives every test run


@pytest.mark.parametrize("load", [0.65, 0.9])
def test_the_arrival_stream_is_seeded_starts_in_steady_state_and_offers_the_load(load: float) -> None:
    gpus, duration = 50 * GPUS_PER_NODE, 20 * 3600.0
    jobs = build_arrivals(gpus=gpus, load=load, duration_seconds=duration, seed="7")
    assert jobs == build_arrivals(gpus=gpus, load=load, duration_seconds=duration, seed="7")
    assert jobs != build_arrivals(gpus=gpus, load=load, duration_seconds=duration, seed="8")
    later = [j for j in jobs if j.arrival > 0]
    assert offered_load(later, gpus=gpus, duration_seconds=duration) == pytest.approx(load, rel=0.1)
    by_kind = {k: offered_load([j for j in later if j.kind == k], gpus=gpus, duration_seconds=duration)
               for k in ("share", "whole", "gang")}  # fmt: skip
    assert by_kind["share"] / load == pytest.approx(0.6, abs=0.08)
    assert by_kind["gang"] / load == pytest.approx(0.2, abs=0.08)
    running_at_start = sum(j.gpu_demand() for j in jobs if j.arrival == 0)
    assert running_at_start == pytest.approx(load * gpus, rel=0.2)  # the population of steady state
    assert all(8 <= j.memory_gi <= 56 for j in jobs if j.kind == "share")
    assert all(2 <= j.pods <= 4 and 1 <= j.gpus_per_pod <= 4 for j in jobs if j.kind == "gang")


@pytest.mark.parametrize("variant", ["on", "kai-like"])
def test_the_ledger_agrees_with_the_allocator_state_after_churn_and_moves(variant: str) -> None:
    jobs = build_arrivals(gpus=4 * GPUS_PER_NODE, load=0.9, duration_seconds=4 * 3600.0, seed="3")
    simulation = Simulation(nodes=4, variant=variant, seed="3")
    measures = simulation.run(jobs, duration_seconds=4 * 3600.0, warmup_seconds=0.0)
    assert measures.pods_moved > 0  # the moves and reservations went through the ledger too
    state = simulation.state.free_summary()
    for node, devices in simulation.ledger.summary.items():
        for name, info in devices.items():
            assert info["memory_bytes_free"] == state[node][name]["memory_bytes_free"], (node, name)
    whole = sum(1 for d in state.values() for i in d.values() if i["memory_bytes_free"] == GPU_GI << 30)
    assert simulation.ledger.whole_free == whole


def _fragmented_node(*, extra: list[Job]) -> list[Job]:
    """One node: six GPUs taken by whole-GPU pods, two holding one 40 GiB share each (a third share
    left at 100 s), every share movable from 600 s; a whole-GPU pod arrives at 1000 s."""
    whole = [Job(f"whole-{i}", "whole", 0.0, LONG, pods=1, gpus_per_pod=1) for i in range(6)]
    shares = [
        Job("share-a", "share", 0.0, LONG, pods=1, memory_gi=40),
        Job("share-b", "share", 0.0, 100.0, pods=1, memory_gi=40),  # beside share-a (best fit)
        Job("share-c", "share", 0.0, LONG, pods=1, memory_gi=40),
    ]
    return [*whole, *shares, Job("waiting", "whole", 1000.0, LONG, pods=1, gpus_per_pod=1), *extra]


@pytest.mark.parametrize(
    ("variant", "waits", "never", "moved", "failures"),
    [("off", [1000.0], 1, 0, 0), ("on", [0.0], 0, 1, 0), ("kai-like", [0.0], 0, 1, 1)],
)
def test_a_whole_gpu_pod_waits_for_a_move_whose_room_only_on_keeps(
    variant: str, waits: list[float], never: int, moved: int, failures: int
) -> None:
    """A 40 GiB share arriving 10 s after the move takes the moved pod's room unless it is reserved."""
    jobs = _fragmented_node(extra=[Job("share-d", "share", 1010.0, LONG, pods=1, memory_gi=40)])
    simulation = Simulation(nodes=1, variant=variant, seed="1")
    measures = simulation.run(jobs, duration_seconds=2000.0, warmup_seconds=1.0)  # the fill at 0 not measured
    assert (measures.whole_waits, measures.whole_never) == (waits, never)
    assert (measures.pods_moved, measures.gpus_freed, measures.replacement_failures) == (
        moved,
        moved,
        failures,
    )
    assert measures.plans_committed == moved
    if variant == "on":  # the replacement took its reserved room; share-d still waits for one
        assert [u.name for u in simulation.pending] == ["share-d-r0"]
        assert len(measures.moved_downtime) == 1 and 20.0 <= measures.moved_downtime[0] <= 60.0
    if variant == "kai-like":  # share-d took the room; the replacement waits
        assert [u.name for u in simulation.pending] in (["share-a-r0"], ["share-c-r0"])


def test_no_move_before_the_minimum_runtime() -> None:
    jobs = [j if j.name != "waiting" else Job("waiting", "whole", 500.0, LONG, pods=1, gpus_per_pod=1)
            for j in _fragmented_node(extra=[])]  # fmt: skip
    simulation = Simulation(nodes=1, variant="on", seed="1")
    measures = simulation.run(jobs, duration_seconds=700.0, warmup_seconds=1.0)
    assert (measures.plans_searched, measures.pods_moved) == (1, 0)  # searched at 500 s: no mover
    assert measures.whole_never == 1


def test_waits_are_compared_with_off_of_the_same_nodes_and_load() -> None:
    rows = [
        {"nodes": 50, "load": 0.9, "variant": "off", "whole wait mean s": 40.0, "gang wait mean s": 0.0},
        {"nodes": 50, "load": 0.9, "variant": "on", "whole wait mean s": 10.0, "gang wait mean s": 0.0},
        {"nodes": 500, "load": 0.9, "variant": "on", "whole wait mean s": 5.0, "gang wait mean s": 1.0},
    ]
    add_ratios(rows)
    assert [r["whole wait vs off"] for r in rows[:2]] == [1.0, 0.25]
    assert rows[1]["gang wait vs off"] != rows[1]["gang wait vs off"]  # nan: off never waited
    assert rows[2]["whole wait vs off"] != rows[2]["whole wait vs off"]  # nan: no off row


@pytest.mark.parametrize(("variant", "moved"), [("on", 0), ("on+scheduled", 1)])
def test_the_scheduled_pass_empties_a_gpu_with_one_move_and_keeps_the_room(variant: str, moved: int) -> None:
    """One node: five GPUs taken whole; p and s-r0 (40 GiB each) fill a GPU, s-r1 and q another, x
    (24 GiB, at 50 s) a third. Once q leaves (100 s), s-r1 is alone on its GPU and its ReplicaSet has
    another running pod: from its minimum runtime on (600 s) the pass moves it beside x, and the
    replacement takes the room kept for it. Nobody waits, so ``on`` alone moves nothing."""
    jobs = [
        *(Job(f"whole-{i}", "whole", 0.0, LONG, pods=1, gpus_per_pod=1) for i in range(5)),
        Job("p", "share", 0.0, LONG, pods=1, memory_gi=40),
        Job("s", "share", 0.0, LONG, pods=2, memory_gi=40),
        Job("q", "share", 0.0, 100.0, pods=1, memory_gi=40),
        Job("x", "share", 50.0, LONG, pods=1, memory_gi=24),
    ]
    simulation = Simulation(nodes=1, variant=variant, seed="1")
    measures = simulation.run(jobs, duration_seconds=1000.0, warmup_seconds=1.0)
    assert (measures.pods_moved, measures.scheduled_moved, measures.scheduled_freed) == (moved, moved, moved)
    assert measures.gpus_freed == moved and measures.plans_committed == 0  # no waiting pod was served
    assert simulation.ledger.whole_free == moved
    if moved:
        assert len(measures.moved_downtime) == 1 and 20.0 <= measures.moved_downtime[0] <= 60.0
        assert not simulation.pending  # the replacement took its room beside x
        holders = sorted(simulation.ledger.taken.values())
        assert holders == [1, 1, 1, 1, 1, 2, 2]  # five whole pods, p + s-r0, x + the replacement

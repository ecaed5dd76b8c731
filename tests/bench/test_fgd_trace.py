"""bench/fgd_trace.py and bench/fgd_policies.py: the FGD paper's trace replay and its BestFit and FGD
policies, on small made-up traces whose answers are worked out by hand (or by a plain re-statement of
the rule, for the random cross-checks)."""

from __future__ import annotations

import io
import math
import random
import re
from collections.abc import Sequence
from pathlib import Path

import pytest

from bench.fgd_policies import BestFitPolicy, FGDPolicy, best_gpus, make_policy
from bench.fgd_trace import (
    Cluster,
    GpuAssignment,
    Placement,
    PlacementError,
    Run,
    TraceNode,
    TracePod,
    TypicalPod,
    bin_allocation,
    build_run,
    columns,
    figures_from_placements,
    load_nodes,
    load_pods,
    replay,
    typical_pods,
    write_placements,
)

NODE_HEADER = "sn,cpu_milli,memory_mib,gpu,model"
POD_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time"


def node(name: str, cpu_milli: int, gpus: int, model: str = "T4", memory_mib: int = 1_000_000) -> TraceNode:
    return TraceNode(name, cpu_milli, memory_mib, gpus, model)


def pod(
    name: str,
    cpu_milli: int,
    num_gpu: int = 0,
    gpu_milli: int = 0,
    spec: tuple[str, ...] = (),
    memory_mib: int = 1,
) -> TracePod:
    return TracePod(name, cpu_milli, memory_mib, num_gpu, gpu_milli, spec)


def shape(cpu_milli: int, num_gpu: int, gpu_milli: int, count: int) -> TypicalPod:
    return TypicalPod(cpu_milli, num_gpu, gpu_milli, (), count, 0.0)


def fixed_run(node_order: Sequence[int], pods: Sequence[TracePod] = ()) -> Run:
    return Run(
        seed=0, pods=list(pods), node_order=list(node_order), originals=tuple(pods), first_copy=len(pods)
    )


def write(path: Path, lines: Sequence[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- reading the trace ---------------------------------------------------------------------------------


def test_rows_become_nodes_and_pods_normalised_as_the_simulator_reads_them(tmp_path: Path) -> None:
    nodes = load_nodes(
        write(tmp_path / "nodes.csv", [NODE_HEADER, "n1,64000,262144,2,P100", "n0,8000,1024,0,"])
    )
    assert nodes == [TraceNode("n1", 64000, 262144, 2, "P100"), TraceNode("n0", 8000, 1024, 0, "")]
    pods = load_pods(
        write(
            tmp_path / "pods.csv",
            [
                POD_HEADER,
                "cpu-only,4000,100,0,500,T4,LS,Running,0",  # num_gpu 0: GPU columns ignored
                "share,6000,200,1,460,,LS,Running,1",
                "spec,1000,0,2,1000,V100M16|V100M32,BE,Running,2",
                "over,1000,1,1,1500,,LS,Running,3",  # clamped to 1000
                "under,1000,1,1,-5,,LS,Running,4",  # clamped to 0
            ],
        )
    )
    assert pods == [
        TracePod("cpu-only", 4000, 100, 0, 0, ()),
        TracePod("share", 6000, 200, 1, 460, ()),
        TracePod("spec", 1000, 0, 2, 1000, ("V100M16", "V100M32")),
        TracePod("over", 1000, 1, 1, 1000, ()),
        TracePod("under", 1000, 1, 1, 0, ()),
    ]
    assert [p.demand for p in pods] == [0, 460, 2000, 1000, 0]


def test_a_pod_list_without_gpu_spec_reads_as_any_model(tmp_path: Path) -> None:
    path = write(
        tmp_path / "multigpu.csv", ["name,cpu_milli,memory_mib,num_gpu,gpu_milli", "p,1000,10,4,1000"]
    )
    assert load_pods(path) == [TracePod("p", 1000, 10, 4, 1000, ())]


@pytest.mark.parametrize(
    ("lines", "where"),
    [
        (
            [POD_HEADER, "a,1000,1,1,500,,,,", "b,lots,1,1,500,,,,"],
            r"line 3: column 'cpu_milli': 'lots' is not",
        ),
        ([POD_HEADER, "a,1000,1,-1,500,,,,"], r"line 2: column 'num_gpu': -1 is below 0"),
        (
            [POD_HEADER, "a,1000,1,1,500,,,,", "a,1000,1,1,500,,,,"],
            r"line 3: column 'name': 'a' appears twice",
        ),
        ([POD_HEADER, "a,1000,1"], r"line 2: column 'num_gpu': missing"),
        (
            ["name,cpu_milli,memory_mib,num_gpu", "a,1,1,1"],
            r"line 1: column 'gpu_milli': missing from the header",
        ),
    ],
)
def test_bad_pod_rows_are_refused_naming_file_line_and_column(
    tmp_path: Path, lines: list[str], where: str
) -> None:
    path = write(tmp_path / "pods.csv", lines)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": " + where):
        load_pods(path)


def test_bad_node_rows_are_refused_naming_file_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path / "nodes.csv", [NODE_HEADER, "n0,8000,1024,2,T4", "n1,8000,1024,two,T4"])
    with pytest.raises(
        ValueError, match=re.escape(str(path)) + r": line 3: column 'gpu': 'two' is not an integer"
    ):
        load_nodes(path)


# --- one run: shuffle, tune, node order ----------------------------------------------------------------


def total_demand(run: Run) -> int:
    return sum(p.demand for p in run.pods)


def test_tune_up_appends_named_copies_while_the_next_draw_stays_within_the_target() -> None:
    nodes = [node("n", 64000, 10)]  # 10,000 milli; x 1.5 = 15,000
    pods = [pod("b", 1000, 1, 1000), pod("a", 1000, 1, 1000)]
    run = build_run(nodes, pods, seed=7, inflate=1.5)
    assert run.first_copy == 2 and sorted(p.name for p in run.pods[:2]) == ["a", "b"]
    copies = run.pods[2:]
    # 2,000 + 13 x 1,000 = 15,000 exactly: landing on the target is allowed, one more would cross
    assert len(copies) == 13 and total_demand(run) == 15_000
    assert [re.sub(r"^[ab]", "", p.name) for p in copies] == [f"-tuned-{i}" for i in range(13)]
    assert [run.trace_name(i) for i in range(2, 15)] == [p.name.split("-")[0] for p in copies]
    assert run.originals == (pods[1], pods[0])  # sorted by name


def test_the_tune_test_uses_the_per_gpu_milli_so_a_multi_gpu_copy_can_overshoot() -> None:
    nodes = [node("n", 64000, 10)]
    run = build_run(nodes, [pod("g4", 1000, 4, 1000)], seed=1, inflate=1.5)
    # 4,000 -> 8,000 -> 12,000 -> (12,000 + 1,000 <= 15,000) 16,000; then 16,000 + 1,000 > 15,000
    assert len(run.pods) == 4 and total_demand(run) == 16_000


def test_cpu_only_copies_are_appended_and_never_stop_the_loop() -> None:
    nodes = [node("n", 64000, 1)]  # target 2,000 at x 2
    pods = [pod("cpu", 1000), pod("gpu", 1000, 1, 500)]
    cpu_copies, cpu_after_last_gpu = 0, 0
    for seed in range(20):
        run = build_run(nodes, pods, seed, inflate=2.0)
        kinds = [p.num_gpu for p in run.pods[run.first_copy :]]
        assert sum(kinds) == 3 and total_demand(run) == 2_000  # 500 + 3 x 500; the 4th GPU draw stops it
        cpu_copies += kinds.count(0)
        cpu_after_last_gpu += len(kinds) - 1 - max(i for i, k in enumerate(kinds) if k)
    assert cpu_copies > 0
    assert cpu_after_last_gpu > 0  # at D == T a CPU-only draw (m = 0) still does not cross


def test_tune_up_stops_at_the_first_draw_that_would_cross_even_if_a_smaller_one_fits() -> None:
    nodes = [node("n", 64000, 10)]  # target 10,000
    pods = [pod("big", 1000, 1, 1000), pod("small", 1000, 1, 100)]
    gaps = []
    for seed in range(30):
        gap = 10_000 - total_demand(build_run(nodes, pods, seed, inflate=1.0))
        assert 0 <= gap < 1000
        gaps.append(gap)
    assert max(gaps) >= 100  # stopped by a big draw with room left for a small pod


def test_tune_down_removes_random_pods_and_keeps_the_order_of_the_rest() -> None:
    nodes = [node("n", 64000, 1)]  # 1,000 milli
    pods = [pod(f"g{i}", 1000, 1, 500) for i in range(6)] + [pod(f"c{i}", 1000) for i in range(4)]
    tail_only = []
    for seed in range(10):
        shuffled = build_run(nodes, pods, seed, inflate=3.0).pods  # demand 3,000 = target: no tuning
        assert sorted(p.name for p in shuffled) == sorted(p.name for p in pods)
        run = build_run(nodes, pods, seed, inflate=1.0)
        assert total_demand(run) == 1_000  # removals stop at the first demand <= 1,000
        assert run.first_copy == len(run.pods) and len(run.pods) < len(pods)
        names = iter(p.name for p in shuffled)
        assert all(p.name in names for p in run.pods)  # a subsequence of the shuffled order
        tail_only.append(run.pods == shuffled[: len(run.pods)])
    assert not all(tail_only)  # removed anywhere, not from the end


def test_the_node_order_is_a_seeded_permutation_over_the_nodes_by_name() -> None:
    nodes = [node(f"n{i}", 1000, 1) for i in range(6)]
    pods = [pod("p", 1000, 1, 100)]
    run = build_run(nodes, pods, seed=5)
    assert sorted(run.node_order) == list(range(6))
    assert build_run(nodes, pods, seed=5) == run
    assert len({tuple(build_run(nodes, pods, seed).node_order) for seed in range(10)}) > 1
    # neither the node list's order nor the pod list's changes a seed's run
    flipped = build_run(nodes[::-1], pods[::-1], seed=5)
    assert flipped.node_order == run.node_order[::-1] and flipped.pods == run.pods


def test_a_trace_without_gpu_demand_cannot_be_tuned_up() -> None:
    with pytest.raises(ValueError, match="no pod asks for GPU milli"):
        build_run([node("n", 1000, 1)], [pod("c", 100)], seed=1)


# --- binning -------------------------------------------------------------------------------------------


def test_binning_rounds_as_python_falls_back_to_neighbours_and_leaves_blanks() -> None:
    # one GPU: arrive% = round(A / 10), alloc% = round(U / 10, 2)
    events = [(0, 0), (5, 5), (15, 10), (25, 20), (1000, 999), (1000, 1000)]
    bins = bin_allocation(events, total_gpus=1)
    assert list(bins) == list(range(131))
    assert bins[0] == 0.25  # A = 5 -> 0.5 rounds to even 0: (0 + 0.5) / 2
    assert bins[2] == 1.5  # 1.5 -> 2 and 2.5 -> 2
    assert bins[1] == 0.88  # none at 1: bins 0 and 2, (0 + 0.5 + 1 + 2) / 4 = 0.875, rounded half to even
    assert bins[3] == 1.5  # none at 3: bin 2 only
    assert bins[4] is None and bins[98] is None and bins[102] is None
    assert bins[99] == bins[100] == bins[101] == 99.95
    assert columns(events, 1) == (99.95, None)


def test_each_events_allocation_is_rounded_before_the_mean() -> None:
    # 1234 / 70 = 17.628... -> 17.63; 35 / 10 = 3.5 -> 4 and 45 / 10 = 4.5 -> 4 (half to even)
    assert bin_allocation([(700, 1234)], total_gpus=7)[10] == 17.63
    bins = bin_allocation([(35, 10), (45, 30)], total_gpus=1)
    assert bins[4] == 2.0 and bins[3] == 2.0 and bins[6] is None


# --- the cluster: feasibility and placement checks -----------------------------------------------------


@pytest.fixture
def cluster() -> Cluster:
    return Cluster(
        [
            node("t4", 8000, 2, "T4", 16000),
            node("v100", 4000, 4, "V100", 8000),
            node("cpu", 1000, 0, "", 1000),
        ]
    )


def test_a_node_is_feasible_for_cpu_memory_model_and_k_gpus_with_m_free_each(cluster: Cluster) -> None:
    def fitting(p: TracePod) -> list[bool]:
        assert cluster.feasible(p).tolist() == [cluster.fits(p, i) for i in range(3)]
        return [cluster.fits(p, i) for i in range(3)]

    assert fitting(pod("cpu", 5000)) == [True, False, False]
    assert fitting(pod("mem", 1000, memory_mib=9000)) == [True, False, False]
    assert fitting(pod("model", 1000, 1, 100, ("V100",))) == [False, True, False]
    assert fitting(pod("two", 1000, 2, 1000)) == [True, True, False]
    cluster.apply(pod("share", 1000, 1, 300), 0, ((0, 300),))
    assert fitting(pod("two", 1000, 2, 1000)) == [False, True, False]  # one T4 GPU is no longer free
    assert fitting(pod("two", 1000, 2, 700)) == [True, True, False]  # 700 and 1000 free
    assert fitting(pod("one", 1000, 1, 1000)) == [True, True, False]
    assert fitting(pod("eight", 1000, 8, 100)) == [False, False, False]


@pytest.mark.parametrize(
    ("placement", "problem"),
    [
        ((pod("p", 1000, 1, 300), 0, ((0, 300),)), "GPU 0: 300 milli asked, 200 free"),
        ((pod("p", 9000, 1, 100), 0, ((1, 100),)), "CPU 9000m asked, 7000m free"),
        ((pod("p", 1000, 1, 100, memory_mib=20000), 0, ((1, 100),)), "memory 20000 MiB asked"),
        ((pod("p", 1000, 1, 100, ("V100",)), 0, ((1, 100),)), "model T4 is not one of V100"),
        ((pod("p", 1000, 2, 1000), 1, ((0, 1000),)), "2 GPUs asked, 1 given"),
        ((pod("p", 1000, 1, 500), 1, ((0, 400),)), "GPU 0: 400 milli given, the pod takes 500 per GPU"),
        ((pod("p", 1000, 2, 1000), 1, ((0, 1000), (0, 1000))), "a GPU given twice"),
        ((pod("p", 1000, 1, 500), 1, ((4, 500),)), "GPU 4: no such GPU (the node has 4)"),
        ((pod("p", 1000), 1, ((0, 100),)), "a CPU-only pod given GPUs"),
        ((pod("p", 1000), 7, ()), "no such node"),
    ],
)
def test_apply_refuses_an_invalid_placement_and_changes_nothing(
    cluster: Cluster, placement: tuple[TracePod, int, GpuAssignment], problem: str
) -> None:
    cluster.apply(pod("first", 1000, 1, 800), 0, ((0, 800),))
    before = (cluster.cpu_free.copy(), cluster.memory_free.copy(), cluster.gpu_free.copy())
    with pytest.raises(PlacementError, match=re.escape(problem)):
        cluster.apply(*placement)
    assert all(
        (a == b).all()
        for a, b in zip(before, (cluster.cpu_free, cluster.memory_free, cluster.gpu_free), strict=True)
    )


def test_apply_takes_cpu_memory_and_each_gpus_milli(cluster: Cluster) -> None:
    cluster.apply(pod("p", 3000, 2, 400, memory_mib=500), 1, ((1, 400), (3, 400)))
    assert cluster.cpu_free.tolist() == [8000, 1000, 1000]
    assert cluster.memory_free.tolist() == [16000, 7500, 1000]
    assert cluster.gpu_free[1].tolist() == [1000, 600, 1000, 600]
    assert cluster.gpu_free_total.tolist() == [2000, 3200, 0]


# --- FGD's typical pods --------------------------------------------------------------------------------


def test_typical_pods_group_by_shape_rank_by_count_then_size_and_cut_at_the_threshold() -> None:
    pods = (
        [pod(f"s{i}", 1000, 1, 500) for i in range(5)]
        + [pod(f"c{i}", 2000) for i in range(3)]  # CPU-only pods count too
        + [pod(f"w{i}", 1000, 1, 1000) for i in range(3)]
        + [pod("t4", 4000, 1, 500, ("T4",)), pod("two", 500, 2, 1000)]
    )
    kept = typical_pods(pods, threshold=0.8)  # 10.4 of 13 pods: 5 + 3 + 3
    assert [(t.cpu_milli, t.num_gpu, t.gpu_milli, t.count) for t in kept] == [
        (1000, 1, 500, 5),
        (2000, 0, 0, 3),  # tied on count with the whole-GPU shape: the larger CPU first
        (1000, 1, 1000, 3),
    ]
    assert [t.weight for t in kept] == [5 / 11, 3 / 11, 3 / 11]
    everything = typical_pods(pods, threshold=0.95)
    assert [(t.cpu_milli, t.gpu_spec) for t in everything[3:]] == [(4000, ("T4",)), (500, ())]


def test_typical_pods_stop_as_soon_as_the_threshold_is_covered_and_break_ties_by_m_then_k() -> None:
    pods = [pod(f"a{i}", 1000, 1, 300) for i in range(10)] + [pod(f"b{i}", 1000, 1, 200) for i in range(10)]
    assert [t.gpu_milli for t in typical_pods(pods, threshold=0.5)] == [300]  # exactly 50%: enough
    pods = [pod(f"a{i}", 1000, 1, 1000) for i in range(2)] + [pod(f"b{i}", 1000, 2, 1000) for i in range(2)]
    assert [t.num_gpu for t in typical_pods(pods, threshold=1.0)] == [2, 1]


# --- BestFit -------------------------------------------------------------------------------------------

FOUR_NODES = [node("a", 32000, 2), node("b", 64000, 4), node("c", 32000, 2), node("d", 33000, 2)]


def test_best_fit_takes_the_least_room_left_after_truncating_the_score() -> None:
    whole = pod("p", 16000, 1, 1000)
    # a and c: s = 16000/128000/2 + 1000/8000/2 = 0.125 -> 87; b: 0.375 -> 62; d: 0.12890625 -> 87.1 -> 87
    assert BestFitPolicy(FOUR_NODES, fixed_run([1, 0, 2, 3])).place(whole) == (0, ((0, 1000),))
    assert BestFitPolicy(FOUR_NODES, fixed_run([2, 0, 3, 1])).place(whole) == (3, ((0, 1000),))  # d ties a
    assert BestFitPolicy(FOUR_NODES, fixed_run([3, 0, 1, 2])).place(whole) == (2, ((0, 1000),))


def test_best_fit_puts_a_fractional_pod_on_the_tightest_gpu_that_fits() -> None:
    policy = BestFitPolicy([node("a", 32000, 3)], fixed_run([0]))
    for taken in (((0, 600),), ((2, 200),)):
        policy.placed(pod("x", 1000, 1, taken[0][1]), 0, taken)  # free: 400, 1000, 800
    assert policy.place(pod("p", 1000, 1, 300)) == (0, ((0, 300),))
    assert policy.place(pod("p", 1000, 1, 500)) == (0, ((2, 500),))
    assert policy.place(pod("p", 1000, 1, 900)) == (0, ((1, 900),))
    assert policy.place(pod("p", 1000, 2, 1000)) is None


# --- FGD -----------------------------------------------------------------------------------------------


def test_fgd_takes_the_first_gpu_reaching_the_nodes_truncated_best_score() -> None:
    # typical: CPU-only (weight 0.99) and 1 x 500 milli (0.01); the node's GPUs are free 600 and 1000
    policy = FGDPolicy(
        [node("x", 10000, 2)], fixed_run([0]), typical=[shape(1000, 0, 0, 99), shape(1000, 1, 500, 1)]
    )
    policy.placed(pod("a", 100, 1, 400), 0, ((0, 400),))
    # 300 on GPU 0 leaves 300 < 500: delta = 0.99 x 300 - 0.01 x 300 = 294 -> 100 sigmoid(0.294) = 57.3 -> 57
    # 300 on GPU 1 leaves 700:        delta = 0.99 x 300                = 297 -> 57.37 -> 57: a tie, GPU 0
    assert policy.place(pod("b", 100, 1, 300)) == (0, ((0, 300),))


def test_fgd_prefers_the_node_whose_fragment_shrinks_and_breaks_ties_by_priority() -> None:
    nodes = [node("x", 10000, 2), node("y", 10000, 2), node("w", 10000, 2)]
    policy = FGDPolicy(nodes, fixed_run([2, 0, 1]), typical=[shape(1000, 1, 500, 1)])
    # every node fresh: 300 leaves 700 and 1000, no fragment before or after: 50 everywhere, y first
    assert policy.place(pod("b", 100, 1, 300)) == (1, ((0, 300),))
    policy.placed(pod("a", 100, 1, 600), 2, ((1, 600),))  # w: 1000 and 400 free, 400 is fragment
    # 400 on w's GPU 1 removes the 400 fragment: 100 sigmoid(0.4) = 59.9 -> 59 beats the 50s
    assert policy.place(pod("c", 100, 1, 400)) == (2, ((1, 400),))


def test_fgd_scores_whole_gpu_and_cpu_only_pods_on_the_node_after_them() -> None:
    nodes = [node("p", 8000, 4), node("q", 8000, 2)]
    typical = [shape(1000, 2, 1000, 1), shape(4000, 0, 0, 1)]
    # one GPU: p (4 free) loses 1000 of CPU-only fragment: delta 500 -> 62; q can no longer host 2 GPUs:
    # its fragment stays 2000 -> 50
    assert FGDPolicy(nodes, fixed_run([1, 0]), typical).place(pod("w", 1000, 1, 1000)) == (0, ((0, 1000),))
    # 7,500 CPU leaves 500: the 2-GPU shape no longer fits either node: p delta -2000 -> 11, q -1000 -> 26
    assert FGDPolicy(nodes, fixed_run([0, 1]), typical).place(pod("c", 7500)) == (1, ())


def test_a_pod_that_fits_one_node_goes_there() -> None:
    nodes = [node("small", 2000, 1), node("big", 64000, 8)]
    for policy in (
        BestFitPolicy(nodes, fixed_run([0, 1])),
        FGDPolicy(nodes, fixed_run([0, 1]), [shape(1, 1, 1, 1)]),
    ):
        assert policy.place(pod("p", 4000, 2, 1000)) == (1, ((0, 1000), (1, 1000)))
        assert policy.place(pod("p", 1000, 2, 1000, ("V100",))) is None


# --- random cross-checks against a plain statement of each rule ----------------------------------------


class PlainPolicy:
    """BestFit or FGD as the method states them, one node and one GPU at a time, in plain Python."""

    def __init__(self, name: str, nodes: Sequence[TraceNode], run: Run) -> None:
        self.name = name
        self.cluster = Cluster(nodes)
        self.priority = run.node_order
        self.typical = typical_pods(run.originals)
        self.kept = sum(t.count for t in self.typical)

    def fragment(self, node: int, cpu: int, free: list[int]) -> int:
        model, total, out = self.cluster.nodes[node].model, sum(free), 0
        for t in self.typical:
            fits = sum(1 for g in free if g >= t.gpu_milli) >= t.num_gpu and cpu >= t.cpu_milli
            if t.gpu_milli == 0 or (t.gpu_spec and model not in t.gpu_spec) or not fits:
                out += t.count * total
            else:
                out += t.count * sum(g for g in free if g < t.gpu_milli)
        return out

    def fgd_score(self, node: int, cpu: int, free: list[int], taken: dict[int, int]) -> int:
        after = [g - taken.get(j, 0) for j, g in enumerate(free)]
        delta = (
            self.fragment(node, cpu, free) - self.fragment(node, cpu - self.pod.cpu_milli, after)
        ) / self.kept
        return int(1.0 / (1.0 + math.exp(-delta / 1000.0)) * 100.0)

    def place(self, pod: TracePod) -> Placement | None:
        self.pod = pod
        best: tuple[int, int, Placement] | None = None
        for n in range(len(self.cluster.nodes)):
            if not self.cluster.fits(pod, n):
                continue
            cpu, free = (
                int(self.cluster.cpu_free[n]),
                self.cluster.gpu_free[n, : self.cluster.gpu_count[n]].tolist(),
            )
            roomy = sorted((g, j) for j, g in enumerate(free) if g >= pod.gpu_milli)[: pod.num_gpu]
            gpus = tuple(sorted((j, pod.gpu_milli) for _, j in roomy))
            if self.name == "best-fit":
                left = (cpu - pod.cpu_milli) / 128000.0 * 0.5 + (sum(free) - pod.demand) / 8000.0 * 0.5
                score = int((1.0 - left) * 100.0)
            elif pod.fractional:
                score = -1
                for j, g in enumerate(free):
                    if g >= pod.gpu_milli and (s := self.fgd_score(n, cpu, free, {j: pod.gpu_milli})) > score:
                        score, gpus = s, ((j, pod.gpu_milli),)
            else:
                score = self.fgd_score(n, cpu, free, dict(gpus))
            if best is None or (score, -self.priority[n]) > best[:2]:
                best = (score, -self.priority[n], (n, gpus))
        return None if best is None else best[2]

    def placed(self, pod: TracePod, node: int, gpus: GpuAssignment) -> None:
        self.cluster.apply(pod, node, gpus)


def random_trace(seed: int) -> tuple[list[TraceNode], list[TracePod]]:
    rng = random.Random(seed)
    nodes = [
        node(f"n{i}", rng.choice((4000, 8000, 16000)), rng.choice((1, 2, 4)), rng.choice("AB"), 64000)
        for i in range(6)
    ]
    pods = []
    for i in range(40):
        kind = rng.random()
        cpu = rng.choice((500, 1000, 2000, 4000))
        spec = rng.choice(((), (), ("A",), ("B",), ("A", "B")))
        if kind < 0.2:
            pods.append(pod(f"p{i:02}", cpu))
        elif kind < 0.6:
            pods.append(pod(f"p{i:02}", cpu, 1, rng.choice((100, 250, 300, 500, 700, 900)), spec))
        elif kind < 0.9:
            pods.append(pod(f"p{i:02}", cpu, rng.choice((1, 2, 4)), 1000, spec))
        else:
            pods.append(pod(f"p{i:02}", cpu, 2, 500, spec))  # no trace has these; the rules still apply
    return nodes, pods


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["best-fit", "fgd"])
def test_the_vectorised_policies_place_every_pod_as_the_plain_rules_do(name: str, seed: int) -> None:
    nodes, pods = random_trace(seed)
    run = build_run(nodes, pods, seed)
    fast = replay(nodes, run, make_policy(name, nodes, run))
    plain = replay(nodes, run, PlainPolicy(name, nodes, run))
    assert fast.placements == plain.placements
    assert 0 < fast.failed < len(run.pods)


# --- the replay and the placements file ----------------------------------------------------------------


class FirstFit:
    name = "first-fit"

    def __init__(self, nodes: Sequence[TraceNode], overbook: bool = False) -> None:
        self.cluster, self.overbook = Cluster(nodes), overbook

    def place(self, pod: TracePod) -> Placement | None:
        for n in range(len(self.cluster.nodes)):
            if self.overbook or self.cluster.fits(pod, n):
                return n, tuple((j, pod.gpu_milli) for j in range(pod.num_gpu))
        return None

    def placed(self, pod: TracePod, node: int, gpus: GpuAssignment) -> None:
        self.cluster.apply(pod, node, gpus)


def test_replay_logs_every_pod_and_counts_failed_pods_as_arrived() -> None:
    nodes = [node("n", 4000, 1)]
    pods = [pod("a", 1000, 1, 600), pod("b", 1000, 1, 600), pod("c", 1000), pod("d", 1000, 1, 400)]
    result = replay(nodes, fixed_run([0], pods), FirstFit(nodes))
    assert result.events == [(600, 600), (1200, 600), (1200, 600), (1600, 1000)]
    assert result.placements == [(0, ((0, 600),)), (None, ()), (0, ()), (0, ((0, 400),))]
    assert result.failed == 1 and len(result.place_seconds) == 4 and result.total_gpus == 1


def test_replay_refuses_a_policy_that_places_past_a_gpus_capacity() -> None:
    nodes = [node("n", 4000, 1)]
    run = fixed_run([0], [pod("a", 1000, 1, 600), pod("b", 1000, 1, 600)])
    with pytest.raises(PlacementError, match="pod b on node n: GPU 0: 600 milli asked, 400 free"):
        replay(nodes, run, FirstFit(nodes, overbook=True))


def test_the_figures_can_be_derived_from_the_placements_file_and_the_two_csvs(tmp_path: Path) -> None:
    rng = random.Random(11)
    node_lines = [NODE_HEADER] + [
        f"n{i},{rng.choice((16000, 32000))},65536,4,{'AB'[i % 2]}" for i in range(8)
    ]
    pod_lines = [POD_HEADER]
    for i in range(80):
        num_gpu, milli = rng.choice(
            ((0, 0), (1, 100), (1, 200), (1, 300))
        )  # the run ends within 0.3% of 130%
        spec = rng.choice(("", "", "A"))
        pod_lines.append(
            f"pod-{i:03},{rng.choice((1000, 2000, 4000))},1024,{num_gpu},{milli},{spec},LS,Running,0"
        )
    nodes_csv, pods_csv = write(tmp_path / "nodes.csv", node_lines), write(tmp_path / "pods.csv", pod_lines)
    nodes, pods = load_nodes(nodes_csv), load_pods(pods_csv)
    placements_csv = tmp_path / "placements.csv"
    expected = {}
    with open(placements_csv, "w", newline="", encoding="utf-8") as handle:
        for seed, name in ((1, "best-fit"), (2, "fgd")):
            run = build_run(nodes, pods, seed)
            result = replay(nodes, run, make_policy(name, nodes, run))
            write_placements(handle, seed, run, result, nodes, header=seed == 1)
            expected[seed] = columns(result.events, result.total_gpus)
            assert None not in expected[seed]
    assert figures_from_placements(placements_csv, nodes_csv, pods_csv) == expected

    rows = placements_csv.read_text(encoding="utf-8").splitlines()
    assert rows[0] == "seed,index,name,node,gpus" and rows.count(rows[0]) == 1
    assert {row.split(",")[2] for row in rows[1:]} <= {p.name for p in pods}  # copies under their trace names
    assert any(row.endswith(",,") for row in rows)  # a failed pod: no node, no GPUs
    assert any(re.fullmatch(r"1,\d+,pod-\d+,n\d,\d:\d+", row) for row in rows)


def test_a_placements_file_that_overbooks_a_gpu_is_refused(tmp_path: Path) -> None:
    nodes_csv = write(tmp_path / "nodes.csv", [NODE_HEADER, "n0,8000,1024,1,A"])
    pods_csv = write(tmp_path / "pods.csv", [POD_HEADER, "a,1000,1,1,600,,,,", "b,1000,1,1,600,,,,"])
    placements = write(
        tmp_path / "placements.csv", ["seed,index,name,node,gpus", "1,0,a,n0,0:600", "1,1,b,n0,0:600"]
    )
    with pytest.raises(ValueError, match=r"line 3: pod b on node n0: GPU 0: 600 milli asked, 400 free"):
        figures_from_placements(placements, nodes_csv, pods_csv)


def test_write_placements_names_copies_by_their_original_and_lists_gpus() -> None:
    nodes = [node("n", 64000, 2)]
    run = build_run(nodes, [pod("a", 1000, 1, 1000)], seed=1, inflate=1.0)  # one copy: 2,000 = target
    result = replay(nodes, run, BestFitPolicy(nodes, run))
    buffer = io.StringIO()
    write_placements(buffer, 9, run, result, nodes)
    assert buffer.getvalue().splitlines() == ["seed,index,name,node,gpus", "9,0,a,n,0:1000", "9,1,a,n,1:1000"]


def test_best_gpus_takes_the_lowest_indexed_free_gpus_for_a_whole_gpu_pod() -> None:
    cluster = Cluster([node("n", 64000, 4)])
    cluster.apply(pod("x", 1, 1, 500), 0, ((1, 500),))
    assert best_gpus(cluster, pod("p", 1, 2, 1000), 0) == ((0, 1000), (2, 1000))
    assert best_gpus(cluster, pod("p", 1, 1, 500), 0) == ((1, 500),)
    assert best_gpus(cluster, pod("p", 1), 0) == ()

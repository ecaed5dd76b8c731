#!/usr/bin/env python3
"""Packing on Alibaba's production GPU trace (cluster-trace-gpu-v2023), against the FGD paper's table.

The method is the paper's ("Beware of Fragmentation: Scheduling GPU-Sharing Workloads with
Fragmentation Gradient Descent", Weng et al., USENIX ATC '23), re-implemented in bench/fgd_trace.py:
1,213 GPU nodes, the trace's pods shuffled per seed and copied until the GPU demand that arrived
reaches 130 % of the cluster, one pod at a time, no departures, a pod that fits nowhere fails and
still counts as arrived. The figure is the share of all GPU capacity allocated, averaged over the
events whose arrived demand rounds to 100 % (and to 130 %), then over the seeds.

Policies: ``best-fit`` and ``fgd`` are the paper's two (bench/fgd_policies.py, written by us from its
description), here to validate the harness against the published means; ``ours`` places every pod
with the allocation controller's own decision path (bench/trace_ours.py, which states the mapping
of ``gpu_milli`` onto our share model and how CPU-only pods are placed).

One trace::

    bench/bench_trace.py --nodes NODES.csv --pods PODS.csv --seeds 42-51 [--inflate 1.3]
                         [--policy ours|best-fit|fgd ...] [--placements OUT.csv] [--json OUT.json]

The whole table (``make bench TRACE_DIR=<folder of the trace's CSVs>``, or ``--trace-dir``): the 17
published variants x the three policies x seeds 42-51, written to bench/results/trace.json and
BENCHMARKS.md. Without a trace folder it says so in one line and writes nothing: the trace is
published for study and research use, and the project never holds a copy of it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import percentile, write_result
from bench.fgd_policies import make_policy
from bench.fgd_trace import (
    Policy,
    TraceNode,
    build_run,
    columns,
    load_nodes,
    load_pods,
    replay,
    write_placements,
)

POLICIES = ("best-fit", "fgd", "ours")
# The controller with CPU-only pods placed by it too (their namespace labelled
# fractional.dev/placement=all-pods, opt-in), and the controller under --policy best-fit.
EXTRA_POLICIES = ("ours-all-pods", "ours-best-fit", "ours-best-fit-all-pods")
TABLE_POLICIES = (
    "best-fit",
    "fgd",
    "ours",
    "ours-all-pods",
    "ours-best-fit",
    "ours-best-fit-all-pods",
)
NODE_FILE = "openb_node_list_gpu_node.csv"

# The published means over seeds 42-51 of the simulator's released results
# (experiments/analysis/expected_results/analysis_allo_discrete.csv), columns 100 and 130, in %.
PUBLISHED: dict[str, dict[str, tuple[float, float]]] = {
    "default": {"best-fit": (92.86, 93.08), "fgd": (95.23, 95.39)},
    "cpu050": {"best-fit": (93.56, 93.79), "fgd": (95.00, 95.21)},
    "cpu100": {"best-fit": (93.26, 93.44), "fgd": (95.21, 95.35)},
    "cpu200": {"best-fit": (92.15, 92.40), "fgd": (94.82, 95.05)},
    "cpu250": {"best-fit": (91.21, 91.45), "fgd": (93.20, 93.41)},
    "gpushare40": {"best-fit": (91.44, 91.69), "fgd": (93.96, 94.15)},
    "gpushare60": {"best-fit": (89.06, 89.36), "fgd": (91.25, 91.40)},
    "gpushare80": {"best-fit": (86.66, 87.01), "fgd": (89.08, 89.30)},
    "gpushare100": {"best-fit": (84.62, 85.01), "fgd": (86.64, 86.90)},
    "multigpu20": {"best-fit": (93.73, 93.93), "fgd": (95.53, 95.65)},
    "multigpu30": {"best-fit": (94.57, 94.72), "fgd": (96.36, 96.46)},
    "multigpu40": {"best-fit": (95.10, 95.23), "fgd": (96.91, 96.99)},
    "multigpu50": {"best-fit": (95.62, 95.74), "fgd": (97.09, 97.18)},
    "gpuspec10": {"best-fit": (93.10, 93.30), "fgd": (94.66, 94.95)},
    "gpuspec20": {"best-fit": (88.46, 93.30), "fgd": (94.66, 94.84)},
    "gpuspec25": {"best-fit": (85.67, 93.23), "fgd": (93.91, 94.74)},
    "gpuspec33": {"best-fit": (80.39, 93.09), "fgd": (87.84, 94.55)},
}


def parse_seeds(text: str) -> list[int]:
    """``42-51`` or ``42,45,50`` (or both: ``42-44,50``)."""
    seeds: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            seeds.extend(range(int(first), int(last) + 1) if dash else [int(first)])
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--seeds: {part!r} is not a seed or a range like 42-51"
            ) from None
    if not seeds:
        raise argparse.ArgumentTypeError("--seeds: no seed given")
    return seeds


def new_policy(name: str, nodes: Sequence[TraceNode], run: Any) -> Policy:
    if name.startswith("ours"):
        from bench.trace_ours import OursPolicy  # the controller's import cost only where it runs
        from driver.config import DEFAULT_POLICY

        policy = "best-fit" if name.startswith("ours-best-fit") else DEFAULT_POLICY
        return OursPolicy(nodes, seed=run.seed, policy=policy, all_pods=name.endswith("-all-pods"))
    return make_policy(name, nodes, run)


def run_one(nodes_csv: str, pods_csv: str, seed: int, inflate: float, policy: str) -> dict[str, Any]:
    """One policy on one seeded run: both columns, failures, decision times, and the placements."""
    nodes, pods = load_nodes(nodes_csv), load_pods(pods_csv)
    run = build_run(nodes, pods, seed, inflate)
    started = time.process_time()
    result = replay(nodes, run, new_policy(policy, nodes, run))
    at_100, at_130 = columns(result.events, result.total_gpus)
    seconds = result.place_seconds
    return {
        "seed": seed, "policy": policy, "pods": len(run.pods), "failed": result.failed,
        "at_100": at_100, "at_130": at_130,
        "decision_ms_median": statistics.median(seconds) * 1000,
        "decision_ms_p99": percentile(seconds, 99) * 1000,
        "cpu_s": time.process_time() - started, "run": run, "replay": result,
    }  # fmt: skip


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.fmean(present), 2) if len(present) == len(values) and present else None


def run_trace(
    nodes_csv: str, pods_csv: str, seeds: list[int], inflate: float, policies: Sequence[str], jobs: int
) -> dict[str, list[dict[str, Any]]]:
    """Every (policy, seed) of one trace, ``jobs`` at a time; per policy its runs in seed order."""
    tasks = [(nodes_csv, pods_csv, seed, inflate, policy) for policy in policies for seed in seeds]
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            done = list(pool.map(run_one, *zip(*tasks, strict=True)))
    else:
        done = [run_one(*task) for task in tasks]
    by_policy: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    for result in done:
        by_policy[result["policy"]].append(result)
    return by_policy


def summarize(policy: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "policy": policy,
        "at_100": _mean([r["at_100"] for r in runs]),
        "at_130": _mean([r["at_130"] for r in runs]),
        "per_seed_100": [r["at_100"] for r in runs],
        "per_seed_130": [r["at_130"] for r in runs],
        "failed_mean": statistics.fmean(r["failed"] for r in runs),
        "decision_ms_median": statistics.median(r["decision_ms_median"] for r in runs),
        "decision_ms_p99": max(r["decision_ms_p99"] for r in runs),
        "cpu_s_per_run": statistics.median(r["cpu_s"] for r in runs),
    }


def one_trace(args: argparse.Namespace) -> int:
    policies = args.policy or list(POLICIES)
    by_policy = run_trace(args.nodes, args.pods, args.seeds, args.inflate, policies, args.jobs)
    nodes = load_nodes(args.nodes)
    summaries = []
    for policy, runs in by_policy.items():
        summary = summarize(policy, runs)
        summaries.append(summary)
        median, p99 = summary["decision_ms_median"], summary["decision_ms_p99"]
        failed = summary["failed_mean"]
        print(f"{policy}: at 100% {summary['at_100']}  at 130% {summary['at_130']}  (failed pods "
              f"{failed:.0f} a run; decision median {median:.3f} ms, p99 {p99:.3f} ms)")  # fmt: skip
        for r in runs:
            print(
                f"  seed {r['seed']}: {r['at_100']} / {r['at_130']}  ({r['pods']} pods, {r['failed']} failed)"
            )
    if args.placements:
        with open(args.placements, "w", newline="", encoding="utf-8") as handle:
            first = True
            for runs in by_policy.values():
                for r in runs:
                    write_placements(handle, r["seed"], r["run"], r["replay"], nodes, header=first)
                    first = False
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=2) + "\n", encoding="utf-8")
    return 0


def whole_table(
    trace_dir: Path,
    seeds: list[int],
    inflate: float,
    jobs: int,
    variants: list[str],
    policies: Sequence[str] = TABLE_POLICIES,
    result: str = "trace",
) -> int:
    """The table for ``variants`` (``policies`` beside the published columns), written as the bench
    result ``result`` (its own section of BENCHMARKS.md: held-out variants can have theirs)."""
    nodes_csv = trace_dir / NODE_FILE
    rows: list[dict[str, Any]] = []
    for variant in variants:
        pods_csv = trace_dir / f"openb_pod_list_{variant}.csv"
        started = time.monotonic()
        by_policy = run_trace(str(nodes_csv), str(pods_csv), seeds, inflate, policies, jobs)
        summaries = {p: summarize(p, runs) for p, runs in by_policy.items()}
        published = PUBLISHED[variant]
        row: dict[str, Any] = {"variant": variant}
        for column, position in (("100", 0), ("130", 1)):
            row[f"paper best-fit {column}"] = published["best-fit"][position]
            row[f"paper fgd {column}"] = published["fgd"][position]
            for policy in policies:
                row[f"{policy} {column}"] = summaries[policy][f"at_{column}"]
        for policy in policies:
            if policy.startswith("ours"):
                median, p99 = summaries[policy]["decision_ms_median"], summaries[policy]["decision_ms_p99"]
                row[f"{policy} ms median / p99"] = f"{median:.2f} / {p99:.2f}"
        rows.append(row)
        print(f"{variant}: {json.dumps({k: v for k, v in row.items() if k != 'variant'})} "
              f"({time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip
    span = f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else str(seeds[0])
    title = "Packing on Alibaba's production trace, against the FGD paper"
    if result != "trace":
        title += f" ({result}: seeds {span})"
    # The trace's folder is the user's, outside the checkout: recorded as the variable that names it.
    argv = [arg.replace(str(trace_dir), "$TRACE_DIR") for arg in sys.argv]
    command = " ".join([Path(sys.executable).name, *argv])
    write_result(result, rows, title=title, notes=NOTES.format(seeds=span), command=command)
    return 0


NOTES = """\
Alibaba's GPU cluster trace of 2023 (1,213 nodes, 6,212 GPUs of seven models) replayed as in
"Beware of Fragmentation" (Weng et al., USENIX ATC '23): per seed ({seeds}) the trace's pods are
shuffled and copied until the arrived GPU demand reaches 130 % of the cluster, one pod at a time,
no departures; a pod that fits nowhere fails and still counts as arrived. Each cell is the share of
all GPU capacity allocated (%), averaged over the events whose arrived demand rounds to 100 % (or
130 %), then over the seeds. "paper" columns are the published means (the simulator's released
results); "best-fit" and "fgd" are the paper's two policies written by us from its description,
which check the harness; "ours" is the allocation controller's own decision path (plan_gang,
decide_all, the allocator; bench/trace_ours.py). Mapping: a trace GPU is one device of 1,000 x 256 MiB
of memory, a share of m milli asks for m x 256 MiB (so shares fit one GPU exactly when their milli
add up to 1,000; compute is not asked), a whole GPU asks for a device with no capacity, gpu_spec is a
CEL selector on our productName attribute, and a node's allocatable is the trace's CPU and memory.
"ours" is the default install: the controller's default policy (fragmentation), and CPU-only pods
placed as kube-scheduler's default profile would (bench/trace_ours.py: KubeSchedulerDefault).
"ours-all-pods": the namespace opted in (fractional.dev/placement=all-pods), so the controller
places the CPU-only pods too. "ours-best-fit" and "ours-best-fit-all-pods": the same with
--policy best-fit (CPU-only pods of an opted-in namespace then go to nodes whose GPUs are taken
already). Under fragmentation the typical workload is learned from the pods as they arrive, each
once, CPU-only pods included (driver/allocator/fragmentation.py).
Decision time: the controller's
in-process time per pod (median of the runs' medians, and the largest p99), this machine, the runs
two at a time on its two cores."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", help="the node list CSV (openb_node_list_gpu_node.csv)")
    parser.add_argument("--pods", help="a pod list CSV (openb_pod_list_<variant>.csv)")
    parser.add_argument("--seeds", type=parse_seeds, default=parse_seeds("42-51"))
    parser.add_argument("--inflate", type=float, default=1.3, help="arrived GPU demand, x the cluster (1.3)")
    parser.add_argument("--policy", action="append", choices=POLICIES + EXTRA_POLICIES,
                        help="repeat for several (default: best-fit, fgd, ours; the whole table: "
                             "all six)")  # fmt: skip
    parser.add_argument("--result", default="trace",
                        help="the whole table's result name (trace; e.g. trace-held-out)")  # fmt: skip
    parser.add_argument("--variants", help="whole table: only these variants (comma-separated)")
    parser.add_argument("--placements", help="write every placement here (CSV: seed,index,name,node,gpus)")
    parser.add_argument("--json", help="write the per-policy figures here")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time (CPU count)")
    parser.add_argument("--trace-dir", default=os.environ.get("TRACE_DIR", ""),
                        help="the whole table from this folder of trace CSVs (or $TRACE_DIR)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.inflate <= 0:
        parser.error(f"--inflate: {args.inflate} is not a positive ratio")
    if args.nodes or args.pods:
        if not (args.nodes and args.pods):
            parser.error("--nodes and --pods go together")
        return one_trace(args)
    if not args.trace_dir:
        print("bench_trace: skipped, no trace folder (make bench TRACE_DIR=<folder of the trace's CSVs>)")
        return 0
    trace_dir = Path(args.trace_dir.rstrip("/") or "/")
    if not (trace_dir / NODE_FILE).is_file():
        parser.error(f"--trace-dir: {trace_dir} has no {NODE_FILE}")
    variants = args.variants.split(",") if args.variants else list(PUBLISHED)
    unknown = [v for v in variants if v not in PUBLISHED]
    if unknown:
        parser.error(f"--variants: {', '.join(unknown)} not among the published: {', '.join(PUBLISHED)}")
    if not re.fullmatch(r"trace[a-z0-9-]*", args.result):
        parser.error(f"--result: {args.result!r} is not trace or trace-<name> (lower case, digits, -)")
    policies = args.policy or list(TABLE_POLICIES)
    return whole_table(trace_dir, args.seeds, args.inflate, args.jobs, variants, policies, args.result)


if __name__ == "__main__":
    sys.exit(main())

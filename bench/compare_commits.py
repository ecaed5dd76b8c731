#!/usr/bin/env python3
"""The controller's backlog at two commits, alternated in one run: the check that would have caught
the slowdown between 8e44aa9 and 62d945c (issue "Production size", about half the rate).

    bench/compare_commits.py --base REV [--head REV] [--pods 1000] [--nodes 100] [--rounds 3]

Each commit is checked out in a temporary git worktree (``--head`` defaults to the working tree as
it is, uncommitted changes included) and runs the backlog of ``bench/bench_controller.py`` from its
own code, in a process of its own: ``--pods`` gated pods (one 12Gi / 15 % share each) drained by
the pipelined controller from the embedded API, ``--nodes`` x h100-8x. The two alternate
``--rounds`` times, so that the machine's noise falls on both. Per commit, the medians of:

- ``rate``: pods decided and written per second, from the controller's first complete view;
- ``controller_ms``: the controller's CPU per pod during the drain (its whole process: the bench
  creates nothing meanwhile);
- ``apiserver_ms``: the embedded API's CPU per pod (its own process), over the same time.

Then head / base for each. Rates move by a fifth from run to run on a shared 2-core machine; the CPU
per pod moves less, and says which side of the wire a change landed on. A commit whose
``bench/bench_controller.py`` lacks ``run_once``/``start_apiserver``/``wait_latencies`` (before
8e44aa9) cannot be measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# Run inside the measured commit's tree: its own bench_controller, its own driver.
_RUNNER = r"""
import argparse, json, os, sys, time
sys.path.insert(0, os.getcwd())
from bench import bench_controller as bench
emulator = {}
start_apiserver = bench.start_apiserver
def started(*args, **kwargs):
    process, configuration = start_apiserver(*args, **kwargs)
    emulator["pid"] = process.pid
    return process, configuration
def cpu(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
measured = {}
wait_latencies = bench.wait_latencies
def waited(controller, count, timeout):
    ours, theirs, begin = time.process_time(), cpu(emulator["pid"]), time.monotonic()
    wait_latencies(controller, count, timeout)
    measured.update(
        rate=count / (time.monotonic() - begin),
        controller_ms=(time.process_time() - ours) / count * 1000,
        apiserver_ms=(cpu(emulator["pid"]) - theirs) / count * 1000,
    )
bench.start_apiserver, bench.wait_latencies = started, waited
pods, nodes = int(sys.argv[1]), int(sys.argv[2])
args = argparse.Namespace(pods=pods, nodes=nodes, stream=0, policy="best-fit", write_delay_ms=0,
                          writers=32, repeats=1)
bench.run_once(args, write_delay_ms=0, sequential=False, stream=False)
print("RESULT " + json.dumps(measured))
"""

MEASURES = ("rate", "controller_ms", "apiserver_ms")


def checkout(rev: str, into: Path) -> Path:
    """A detached worktree of ``rev`` under ``into``."""
    tree = into / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(tree), rev],
                   check=True, capture_output=True)  # fmt: skip
    return tree


def measure(tree: Path, pods: int, nodes: int) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(pods), str(nodes)],
        cwd=tree, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": str(tree)},
    )  # fmt: skip
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, float] = json.loads(line.removeprefix("RESULT "))
            return result
    raise SystemExit(f"{tree}: no result (exit {done.returncode})\n{done.stderr[-2000:]}")


def compare(base: Path, head: Path, *, pods: int, nodes: int, rounds: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
    for _ in range(rounds):
        for name, tree in (("base", base), ("head", head)):
            runs[name].append(measure(tree, pods, nodes))
            print(f"{name}: " + " ".join(f"{k} {runs[name][-1][k]:.2f}" for k in MEASURES), flush=True)
    medians = {
        name: {k: round(statistics.median(r[k] for r in rs), 2) for k in MEASURES}
        for name, rs in runs.items()
    }
    ratios = {k: round(medians["head"][k] / medians["base"][k], 3) for k in MEASURES if medians["base"][k]}
    return {"pods": pods, "nodes": nodes, "rounds": rounds, **medians, "head_over_base": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--head", help="the commit measured (default: the working tree as it is)")
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="compare-commits-") as workdir:
        trees = [checkout(args.base, Path(workdir))]
        trees.append(checkout(args.head, Path(workdir)) if args.head else ROOT)
        try:
            result = compare(trees[0], trees[1], pods=args.pods, nodes=args.nodes, rounds=args.rounds)
        finally:
            for tree in trees:
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                                   check=False, capture_output=True)  # fmt: skip
    result["base"] = {"rev": args.base, **result["base"]}
    result["head"] = {"rev": args.head or "working tree", **result["head"]}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

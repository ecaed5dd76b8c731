"""The Kueue admission check's plan: how long ``decide_workload`` takes for a 64-pod workload on
100 nodes x 8 GPUs (``h100-8x``), pure (no API), as the check runs it per Pending workload.

Scenarios (each timed ``--repeat`` times; median, p99, iqr):
- ready-empty: 64 pods x one 20Gi share on an empty cluster -> Ready;
- ready-busy: the same with every GPU already holding a 59Gi share (20Gi free each, 800 GPUs);
  a 20Gi share still fits on each -> Ready;
- retry-fragmented: 64 pods x one 30Gi share on that busy cluster -> Retry (does not fit now),
  which also searches the scale-up hint;
- ready-gang-whole: 64 pods x 8 whole GPUs (512 of 800 GPUs) -> Ready.

Prints a markdown table and writes bench/results/kueue.json. Run:
    .venv/bin/python bench/bench_kueue.py [--pods 64] [--nodes 100] [--repeat 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import summary, write_result
from driver.allocator import ClusterState
from driver.controller.kueue.check import WorkloadClaims, build_workload_claims, decide_workload
from driver.inventory.fake import load_profile, resolve_profile
from driver.slices import build_device_classes, build_resource_slices


def _cluster(nodes: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    slices, node_objects = [], []
    profile = resolve_profile("h100-8x")
    for index in range(nodes):
        name = f"node-{index:03d}"
        slices += build_resource_slices(load_profile(profile, node_name=name))
        node_objects.append({"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}})
    return slices, node_objects


def _template(memory: str | None, count: int = 1) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": "gpu.fractional.dev", "count": count}
    if memory:
        exactly["capacity"] = {"requests": {"memory": memory}}
    return {
        "metadata": {"name": "t"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}},
    }


def _workload(pods: int) -> dict[str, Any]:
    return {
        "metadata": {"name": "bench", "namespace": "default"},
        "spec": {"podSets": [{"name": "main", "count": pods, "template": {"spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}], "containers": []}}}]},
    }  # fmt: skip


def _fillers(slices: list[dict[str, Any]], classes: list[dict[str, Any]], gpus: int) -> list[dict[str, Any]]:
    """One 59Gi share on every GPU (79Gi each): 20Gi free everywhere."""
    state = ClusterState()
    for device_class in classes:
        state.upsert_class(device_class)
    for resource_slice in slices:
        state.upsert_slice(resource_slice)
    claims = []
    for index in range(gpus):
        claim = {"metadata": {"name": f"fill-{index}", "namespace": "default", "uid": f"fill-{index}"},
                 "spec": _template("59Gi")["spec"]["spec"]}  # fmt: skip
        result = state.allocate([claim], policy="first-fit")
        assert result is not None
        claim = {**claim, "status": {"allocation": result[0]}}
        state.upsert_claim(claim)
        claims.append(claim)
    return claims


def _time(wanted: WorkloadClaims, repeat: int, **kwargs: Any) -> tuple[dict[str, float], str]:
    seconds, state = [], ""
    for _ in range(repeat):
        started = time.perf_counter()
        decision = decide_workload(wanted, **kwargs)
        seconds.append(time.perf_counter() - started)
        state = decision.state
    return summary(seconds), state


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    slices, nodes = _cluster(args.nodes)
    classes = build_device_classes()
    busy = _fillers(slices, classes, args.nodes * 8)
    cases = [
        ("ready-empty", _template("20Gi"), []),
        ("ready-busy", _template("20Gi"), busy),
        ("retry-fragmented", _template("30Gi"), busy),
        ("ready-gang-whole", _template(None, count=8), []),
    ]
    rows = []
    for scenario, template, allocated in cases:
        wanted = build_workload_claims(_workload(args.pods), {"t": template})
        stats, state = _time(
            wanted, args.repeat, slices=slices, classes=classes, allocated=allocated, nodes=nodes
        )
        rows.append({
            "scenario": scenario, "pods": args.pods, "nodes": args.nodes, "gpus": args.nodes * 8,
            "state": state,
            "plan_median_ms": round(stats["median"] * 1000, 1), "plan_p99_ms": round(stats["p99"] * 1000, 1),
            "plan_iqr_ms": round(stats["iqr"] * 1000, 1), "runs": int(stats["n"]),
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=64)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rows = run(args)
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")
    path = write_result(
        "kueue", rows, title="Kueue admission check: one plan (decide_workload)",
        notes="Pure planning as the check runs it for one Pending Workload: all pod sets as one gang with "
        "the allocator (best-fit), against 100 h100-8x nodes (800 GPUs); retry-fragmented also runs the "
        "scale-up hint search. No API calls are timed.",
    )  # fmt: skip
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()

"""The allocator's decisions for the production-size fill, in process, at 1,000 and 5,000 nodes.

The fill of ``bench/production_scale.py`` (``fill_plan``: 8-GPU pods to 80 % of the GPUs, 1-GPU pods to
85 %, shares of 10Gi/10 %, 20Gi/25 % and 40Gi/50 % to 90 %, in one seeded shuffled order) decided one
pod at a time through ``ClusterState.allocate_many`` (the controller's burst entry point, best-fit),
each allocation committed into the state before the next, on N h100-8x nodes (the profile's slice,
built once by our slice code and renamed per node). No API, no controller process: what is measured is
the decision alone, the part of our controller's CPU that grew with the cluster (py-spy on the
real control plane at 5,000 nodes: 93 % of its CPU).

Per size: ``ms_per_pod`` (mean over every decision), the median and p99, and per shape the mean;
``searches`` (node searches run) and ``vs_smallest`` (ms_per_pod over the smallest size's: the issue
"Production size" asks at most 2x from 1,000 to 5,000 nodes). ``digest``: a hash of every placement
(pool and device per claim), equal between two commits when they place alike. ``--tree DIR[,DIR]``
decides with the allocator of other checkouts (``driver`` imported from there), one row each per size:
before and after, in one run.

``--path controller`` decides each pod as the controller does (``plan_gang`` and ``decide_all`` over
the controller's cache, the pod gated, its claim allocated, then bound; a section of its own), under
each ``--policy`` (fragmentation, the controller's default, and best-fit), the nodes with the
fleet's allocatable (224 CPUs, 2000Gi, 110 pods). Under fragmentation the model ranks the whole-GPU
pods, and the shares (memory and compute) are decided as best-fit decides them. ``--path both``
(the default) writes both sections.

    .venv/bin/python bench/bench_fill_decisions.py [--sizes 1000,5000] [--tree DIR,.]
        [--path allocator|controller|both] [--policy fragmentation,best-fit]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # after PYTHONPATH: a child imports ``driver`` from the tree under test

from bench._common import write_result  # noqa: E402


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


def measure(nodes: int) -> dict[str, Any]:
    """Run in a child process whose ``driver`` is the tree under test (see ``main``)."""
    from bench.production_scale import fill_plan
    from driver.allocator import ClusterState, placement
    from driver.inventory.fake import load_profile, resolve_profile
    from driver.slices import build_device_classes, build_resource_slices

    state = ClusterState()
    for device_class in build_device_classes():
        state.upsert_class(device_class)
    template = build_resource_slices(load_profile(resolve_profile("h100-8x"), node_name="template"))
    for index in range(nodes):
        name = f"node-{index:05d}"
        state.upsert_node(name, {"kubernetes.io/hostname": name})
        for number, built in enumerate(template):
            body = copy.deepcopy(built)
            body["spec"]["nodeName"] = name
            body["spec"]["pool"]["name"] = name
            body["metadata"] = {"name": f"{name}-{number}", "uid": f"{name}-{number}", "resourceVersion": "1"}
            state.upsert_slice(body)
    searches = 0
    original = placement.search_node

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal searches
        searches += 1
        return original(*args, **kwargs)

    placement.search_node = counted  # type: ignore[assignment]
    times: dict[str, list[float]] = {}
    digest = hashlib.sha256()
    failed = 0
    for index, (_, shape) in enumerate(fill_plan(8 * nodes)):
        raw = {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": f"c{index}", "namespace": "bench", "uid": f"uid-{index}"},
            "spec": shape.template()["spec"]["spec"],
        }  # fmt: skip
        began = time.perf_counter()
        (result,) = state.allocate_many([[raw]])
        times.setdefault(shape.name, []).append(time.perf_counter() - began)
        if result is None:
            failed += 1
            continue
        taken = sorted((r["pool"], r["device"]) for r in result[0]["devices"]["results"])
        digest.update(repr(taken).encode())
        raw["status"] = {"allocation": result[0]}
        state.upsert_claim(raw)
    return {**_timings(nodes, times, failed), "searches": searches, "digest": digest.hexdigest()[:12]}


def _timings(nodes: int, times: dict[str, list[float]], failed: int) -> dict[str, Any]:
    """A row's size, failures and decision times: per pod, and the mean per shape."""
    every = [t for values in times.values() for t in values]
    row: dict[str, Any] = {
        "nodes": nodes, "gpus": 8 * nodes, "pods": len(every), "failed": failed,
        "decide_s": round(sum(every), 2),
        "ms_per_pod": round(statistics.mean(every) * 1000, 3),
        "ms_p50": round(statistics.median(every) * 1000, 3),
        "ms_p99": round(_percentile(every, 0.99) * 1000, 3),
    }  # fmt: skip
    for name, values in times.items():
        row[f"ms_{name}"] = round(statistics.mean(values) * 1000, 3)
    return row


def measure_controller(nodes: int, policy: str) -> dict[str, Any]:
    """``measure`` through the controller's decision path (``--path controller``)."""
    from bench.production_scale import fill_plan, pod_body
    from driver.controller.gangs.burst import decide_all
    from driver.controller.gangs.decide import Decision
    from driver.controller.gangs.plan import plan_gang
    from driver.controller.model.objects import object_key
    from driver.controller.view.cache import ClusterCache, Kind
    from driver.inventory.fake import load_profile, resolve_profile
    from driver.slices import build_device_classes, build_resource_slices

    cache = ClusterCache(topology_label="topology.kubernetes.io/zone")
    cache.learn_workload = policy == "fragmentation"
    for device_class in build_device_classes():
        device_class.setdefault("metadata", {})["resourceVersion"] = "1"
        cache.apply(Kind.CLASS, "ADDED", device_class)
    template = build_resource_slices(load_profile(resolve_profile("h100-8x"), node_name="template"))
    allocatable = {"cpu": "224", "memory": "2000Gi", "pods": "110"}
    for index in range(nodes):
        name = f"node-{index:05d}"
        cache.apply(Kind.NODE, "ADDED", {"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": name, "uid": name, "resourceVersion": "1",
                                 "labels": {"kubernetes.io/hostname": name}},
                    "status": {"allocatable": allocatable, "capacity": allocatable}})  # fmt: skip
        for number, built in enumerate(template):
            body = copy.deepcopy(built)
            body["spec"]["nodeName"] = name
            body["spec"]["pool"]["name"] = name
            body["metadata"] = {"name": f"{name}-{number}", "uid": f"{name}-{number}", "resourceVersion": "1"}
            cache.apply(Kind.SLICE, "ADDED", body)
    versions = iter(range(2, 10**9))
    times: dict[str, list[float]] = {}
    digest = hashlib.sha256()
    failed = 0
    for index, (name, shape) in enumerate(fill_plan(8 * nodes)):
        meta = {
            "name": name,
            "namespace": "bench",
            "uid": f"uid-{index}",
            "resourceVersion": str(next(versions)),
        }
        claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": meta,
                 "spec": shape.template()["spec"]["spec"]}  # fmt: skip
        pod = pod_body(name, shape, gated=True)
        pod["metadata"].update(uid=f"pod-{index}", namespace="bench", resourceVersion=str(next(versions)))
        pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": name}]
        cache.apply(Kind.CLAIM, "ADDED", claim)
        cache.apply(Kind.POD, "ADDED", pod)
        began = time.perf_counter()
        [decision] = decide_all(cache, [plan_gang(cache, cache.gang_key(pod))], policy=policy)
        times.setdefault(shape.name, []).append(time.perf_counter() - began)
        if not isinstance(decision, Decision) or decision.outcome != "allocated":
            failed += 1
            cache.apply(Kind.POD, "DELETED", pod)
            cache.apply(Kind.CLAIM, "DELETED", claim)
            continue
        [(_, allocation)] = decision.allocations
        [(_, node)] = decision.pod_nodes
        digest.update(
            repr(sorted((r["pool"], r["device"]) for r in allocation["devices"]["results"])).encode()
        )
        allocated = dict(claim, metadata={**meta, "resourceVersion": str(next(versions))})
        allocated["status"] = {"allocation": allocation}
        cache.apply(Kind.CLAIM, "MODIFIED", allocated)  # the API's echo of the write
        cache.forget_assumed([str(object_key(claim))])
        bound = copy.deepcopy(pod)
        bound["metadata"]["resourceVersion"] = str(next(versions))
        bound["spec"].pop("schedulingGates", None)
        bound["spec"]["nodeName"] = node
        cache.apply(Kind.POD, "MODIFIED", bound)
        cache.forget_placement(str(object_key(pod)))
    return {
        "path": f"controller, {policy}",
        **_timings(nodes, times, failed),
        "digest": digest.hexdigest()[:12],
    }


def _commit_of(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, check=False)  # fmt: skip
    return out.stdout.strip() or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,5000", help="node counts, comma-separated")
    parser.add_argument("--tree", default=".", help="checkouts whose allocator decides (a,b)")
    parser.add_argument("--path", choices=("allocator", "controller", "both"), default="both")
    parser.add_argument(
        "--policy", default="fragmentation,best-fit", help="--path controller: the policies, comma-separated"
    )
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child: one size, a JSON row
    args = parser.parse_args()
    if args.one is not None:
        row = measure(args.one) if args.path == "allocator" else measure_controller(args.one, args.policy)
        print(json.dumps(row))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    notes = (__doc__ or "").split("\n\n", 1)[1].rsplit("\n\n", 1)[0]
    if args.path in ("allocator", "both"):
        rows = _rows(args.tree, sizes, "allocator", [None])
        title = "Allocator: the production-size fill, decided in process"
        path = write_result("fill_decisions", rows, title=title, notes=notes)
        print(f"written {path}")
    if args.path in ("controller", "both"):
        rows = _rows(args.tree, sizes, "controller", args.policy.split(","))
        title = "The controller's decisions for the production-size fill, in process"
        path = write_result("fill_decisions_controller", rows, title=title, notes=notes)
        print(f"written {path}")


def _rows(trees: str, sizes: list[int], path: str, policies: list[str | None]) -> list[dict[str, Any]]:
    """One row per tree, policy and size, each from a child process (``--one``)."""
    rows: list[dict[str, Any]] = []
    for tree in [Path(t).resolve() for t in trees.split(",")]:
        for policy in policies:
            smallest: float | None = None
            for nodes in sizes:
                environment = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{ROOT}"}
                done = subprocess.run(
                    [sys.executable, __file__, "--one", str(nodes), "--path", path,
                     *(["--policy", policy] if policy else [])], env=environment, cwd=tree,
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                row = {
                    "allocator_commit": _commit_of(tree),
                    **json.loads(done.stdout.strip().splitlines()[-1]),
                }
                smallest = row["ms_per_pod"] if smallest is None else smallest
                row["vs_smallest"] = round(row["ms_per_pod"] / smallest, 2)
                rows.append(row)
                print(row, flush=True)
    return rows


if __name__ == "__main__":
    main()

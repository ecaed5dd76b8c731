"""Gangs: time to place a 64-pod gang on 100 nodes x 8 GPUs, and to reject one that
cannot fit.

Setup: 100 ``h100-8x`` nodes (the shipped profile: 8 H100s, NVLink, NICs) in the controller's
``ClusterCache`` as the watchers fill it (Node objects, ResourceSlices, DeviceClasses), and a
``scheduling.k8s.io/v1beta1`` PodGroup with ``minCount: 64``; 64 gated pods point at it with
``spec.schedulingGroup``, each with one claim. Measured: the controller's decision for the gang,
``plan_gang`` (identity, minCount, claims) then ``decide_all`` (the allocator and the node-fit
check), as the decider runs it under ``cache.lock``; no API writes. Shapes:

- ``place 64 x 8 GPUs``: each pod asks 8 whole GPUs (a whole node); all 100 nodes free: placed.
- ``place 64 x 1 share``: each pod asks a 40 GiB / 30 % share: placed.
- ``reject 64 x 8 GPUs``: the same whole-node gang while 37 nodes each hold one small share, so
  only 63 nodes are wholly free: rejected (all or nothing).

Prints a markdown table and writes bench/results/gangs.json. Run:
    .venv/bin/python bench/bench_gangs.py [--nodes 100] [--pods 64] [--runs 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import summary, write_result
from driver.controller.gangs.burst import decide_all
from driver.controller.gangs.plan import plan_gang
from driver.controller.model.objects import GATE, GangKey
from driver.controller.view.cache import ClusterCache, Kind
from driver.inventory.fake import load_profile, resolve_profile
from driver.slices import build_device_classes, build_resource_slices

NAMESPACE = "bench"


def _claim(name: str, exactly: dict[str, Any], allocation: dict[str, Any] | None = None) -> dict[str, Any]:
    claim: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}", "resourceVersion": "1"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.fractional.dev", **exactly}}]
            }
        },
    }
    if allocation is not None:
        claim["status"] = {"allocation": allocation}
    return claim


def _pod(name: str, claim: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}", "resourceVersion": "1"},
        "spec": {
            "schedulingGates": [{"name": GATE}],
            "schedulingGroup": {"podGroupName": "train"},
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "containers": [{"name": "c", "image": "x", "resources": {"requests": {"cpu": "1"}}}],
        },
    }


def build(
    nodes: int, pods: int, exactly: dict[str, Any], *, taken_nodes: int
) -> tuple[ClusterCache, GangKey]:
    cache = ClusterCache(topology_label="topology.kubernetes.io/zone")
    profile = resolve_profile("h100-8x")
    for device_class in build_device_classes():
        cache.apply(
            Kind.CLASS, "ADDED", {**device_class, "metadata": {**device_class["metadata"], "uid": "c"}}
        )
    for index in range(nodes):
        name = f"node-{index:03d}"
        inventory = load_profile(profile, node_name=name)
        allocatable = {"cpu": "192", "memory": "2Ti", "pods": "110"}
        cache.apply(
            Kind.NODE,
            "ADDED",
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "uid": f"uid-{name}", "labels": {}},
                "status": {"allocatable": allocatable},
            },
        )
        for number, piece in enumerate(build_resource_slices(inventory)):
            piece["metadata"] = {"name": f"{name}-{number}", "uid": f"uid-{name}-{number}"}
            cache.apply(Kind.SLICE, "ADDED", piece)
    for index in range(taken_nodes):  # one small share on gpu-0 of the first nodes
        name = f"node-{index:03d}"
        allocation = {
            "devices": {
                "results": [
                    {
                        "request": "gpu",
                        "driver": "fractional.dev",
                        "pool": name,
                        "device": "gpu-0",
                        "shareID": f"00000000-0000-0000-0000-{index:012d}",
                        "consumedCapacity": {"memory": "4Gi", "compute": "0"},
                    }
                ]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [name]}]}
                ]
            },
        }
        cache.apply(
            Kind.CLAIM,
            "ADDED",
            _claim(f"taken-{index}", {"capacity": {"requests": {"memory": "4Gi"}}}, allocation),
        )
    cache.apply(
        Kind.PODGROUP,
        "ADDED",
        {
            "apiVersion": "scheduling.k8s.io/v1beta1",
            "kind": "PodGroup",
            "metadata": {"name": "train", "namespace": NAMESPACE, "uid": "uid-pg"},
            "spec": {"schedulingPolicy": {"gang": {"minCount": pods}}},
        },
    )
    for index in range(pods):
        cache.apply(Kind.CLAIM, "ADDED", _claim(f"train-{index}", exactly))
        cache.apply(Kind.POD, "ADDED", _pod(f"train-{index}", f"train-{index}"))
    return cache, GangKey(f"{NAMESPACE}/podgroup:train")


SHAPES = (
    ("place 64 x 8 GPUs", {"count": 8}, 0, "allocated"),
    ("place 64 x 1 share", {"capacity": {"requests": {"memory": "40Gi", "compute": "30"}}}, 0, "allocated"),
    ("reject 64 x 8 GPUs", {"count": 8}, 37, "unschedulable"),
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--pods", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for label, exactly, taken, expected in SHAPES:
        taken_nodes = max(0, args.nodes - args.pods + 1) if taken else 0
        times = []
        for _ in range(args.runs):
            cache, gang = build(args.nodes, args.pods, exactly, taken_nodes=taken_nodes)
            with cache.lock:
                started = time.perf_counter()
                plan = plan_gang(cache, gang)
                (decision,) = decide_all(cache, [plan], policy="best-fit")
                times.append(time.perf_counter() - started)
            outcome = getattr(decision, "outcome", type(decision).__name__)
            if outcome != expected:
                raise SystemExit(f"{label}: expected {expected}, got {outcome}")
        stats = summary(times)
        rows.append(
            {
                "case": label.replace("64", str(args.pods)),
                "nodes": args.nodes,
                "pods": args.pods,
                "outcome": expected,
                "median_s": stats["median"],
                "p99_s": stats["p99"],
                "iqr_s": stats["iqr"],
                "runs": stats["n"],
            }
        )
    notes = (
        "The controller's decision for one gang (plan_gang + decide_all under cache.lock), no API "
        "writes; 100 h100-8x nodes; a PodGroup with minCount 64. The reject case leaves 63 nodes "
        "wholly free for 64 whole-node pods."
    )
    write_result(
        "gangs", rows, title="Gangs: place or reject a 64-pod gang on 100 nodes x 8 GPUs", notes=notes
    )
    for row in rows:
        median, p99 = row["median_s"], row["p99_s"]
        print(f"| {row['case']} | {row['outcome']} | median {median:.3f} s | p99 {p99:.3f} s |")


if __name__ == "__main__":
    main()

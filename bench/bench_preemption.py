"""Priority preemption: time to choose the victims for a 16-GPU gang in a full cluster.

Setup: 100 nodes x 8 GPUs (80 GiB each) in the allocator's ``ClusterState``, filled with 2,000
shares of 8-32 GiB at mixed priorities (100/500/1000/5000; about a tenth of them in lower-priority
gangs of 4), placed first-fit in a random order of GPUs, so no GPU is wholly free. The preemptor
(priority 2000) is a 16-GPU gang of whole GPUs, in two shapes: 2 pods x 8 GPUs (one claim of 8
each) and 16 pods x 1 GPU. Measured: ``choose_victims`` (driver/controller/preemption/victims.py) with the
allocator as its fit check, as the controller runs it; units are built once per run (included).

Prints a markdown table and writes bench/results/preemption.json. Run:
    .venv/bin/python bench/bench_preemption.py [--nodes 100] [--shares 2000] [--runs 5]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import summary, write_result
from driver.allocator import ClusterState
from driver.controller.model.objects import GANG_LABEL
from driver.controller.preemption.victims import Placement, build_victim_units, choose_victims
from driver.slices import build_device_classes

GPUS_PER_NODE = 8
GPU_GI = 80
PRIORITIES = ((100, 0.55), (500, 0.25), (1000, 0.15), (5000, 0.05))
PREEMPTOR_PRIORITY = 2000


def gpu(index: int) -> dict[str, Any]:
    step = 256 << 20
    return {
        "name": f"gpu-{index}",
        "attributes": {"type": {"string": "gpu"}, "uuid": {"string": f"GPU-{index}"}},
        "capacity": {
            "memory": {"value": f"{GPU_GI}Gi", "requestPolicy": {"default": f"{GPU_GI}Gi", "validRange": {
                "min": str(step), "max": f"{GPU_GI}Gi", "step": str(step)}}},
            "compute": {"value": "100", "requestPolicy": {"default": "0", "validRange": {
                "min": "0", "max": "100", "step": "1"}}},
        },
        "allowMultipleAllocations": True,
    }  # fmt: skip


def node_slice(node: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-gpus"},
        "spec": {"driver": "fractional.dev", "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                 "devices": [gpu(i) for i in range(GPUS_PER_NODE)]},
    }  # fmt: skip


def claim(name: str, *, memory_gi: int, count: int = 1) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": "gpu.fractional.dev", "count": count,
                               "capacity": {"requests": {"memory": f"{memory_gi}Gi"}}}  # fmt: skip
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "bench", "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }  # fmt: skip


def allocated(name: str, node: str, device: str, memory_gi: int) -> dict[str, Any]:
    body = claim(name, memory_gi=memory_gi)
    body["status"] = {"allocation": {
        "devices": {"results": [{"request": "gpu", "driver": "fractional.dev", "pool": node, "device": device,
                                 "shareID": str(uuid.uuid4()),
                                 "consumedCapacity": {"memory": f"{memory_gi}Gi", "compute": "0"}}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
    }}  # fmt: skip
    return body


def empty_cluster(nodes: int) -> tuple[ClusterState, list[str]]:
    """``nodes`` nodes of GPUS_PER_NODE GPUs in a fresh ``ClusterState``, nothing allocated."""
    state = ClusterState()
    for device_class in build_device_classes():
        state.upsert_class(device_class)
    names = [f"node-{i:03d}" for i in range(nodes)]
    for node in names:
        state.upsert_node(node, {"kubernetes.io/hostname": node})
        state.upsert_slice(node_slice(node))
    return state, names


def build_cluster(
    nodes: int, shares: int, seed: int
) -> tuple[ClusterState, list[dict[str, Any]], dict[str, Any]]:
    rng = random.Random(seed)
    state, names = empty_cluster(nodes)
    free = {(n, f"gpu-{g}"): GPU_GI for n in names for g in range(GPUS_PER_NODE)}
    devices = list(free)
    pods: list[dict[str, Any]] = []
    claims: dict[str, dict[str, Any]] = {}
    gang_left, gang_name, gang_priority = 0, "", 0
    for index in range(shares):
        memory = rng.choice((8, 16, 24, 32))
        if index < len(devices):  # one share on every GPU first: none is wholly free
            target: tuple[str, str] | None = devices[index]
        else:
            rng.shuffle(devices)
            target = next((d for d in devices if free[d] >= memory), None)
        if target is None:
            break
        free[target] -= memory
        name = f"share-{index:04d}"
        body = allocated(f"{name}-claim", target[0], target[1], memory)
        claims[f"bench/{name}-claim"] = body
        state.upsert_claim(body)
        if gang_left == 0 and rng.random() < 0.025:
            gang_left, gang_name = 4, f"gang-{index}"
            gang_priority = rng.choice((100, 500))
        labels = {GANG_LABEL: gang_name} if gang_left else {}
        priority = gang_priority if gang_left else rng.choices(*zip(*PRIORITIES, strict=True))[0]
        gang_left = max(0, gang_left - 1)
        pods.append({
            "metadata": {"name": name, "namespace": "bench", "labels": labels},
            "spec": {"priority": priority, "priorityClassName": f"p{priority}",
                     "resourceClaims": [{"name": "gpu", "resourceClaimName": f"{name}-claim"}],
                     "containers": [{"name": "main", "image": "x"}]},
            "status": {"phase": "Running"},
        })  # fmt: skip
    return state, pods, claims


def run(state: ClusterState, pods: list[dict[str, Any]], claims: dict[str, dict[str, Any]],
        gang: list[dict[str, Any]], groups: list[list[int]]) -> tuple[float, Any]:  # fmt: skip
    started = time.perf_counter()
    units = build_victim_units(pods, claims, below_priority=PREEMPTOR_PRIORITY)
    by_key = {u.key: u for u in units}

    def fits(removed: frozenset[str]) -> Placement | None:
        released = [c for k in removed for c in by_key[k].claims]
        for body in released:
            state.remove_claim(body["metadata"]["uid"])
        try:
            result = state.allocate(gang, policy="best-fit", pod_groups=groups)
        finally:
            for body in released:
                state.upsert_claim(body)
        return None if result is None else Placement(tuple(zip(gang, result, strict=True)), ())

    choice = choose_victims(units, fits=fits)
    return time.perf_counter() - started, choice


def _counted(priorities: tuple[int, ...]) -> str:
    """(500, 500, 100) -> "2x500 1x100"."""
    return " ".join(f"{priorities.count(p)}x{p}" for p in sorted(set(priorities), reverse=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--shares", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=17)
    args = parser.parse_args()
    state, pods, claims = build_cluster(args.nodes, args.shares, args.seed)
    shapes = {
        "2 pods x 8 GPUs": ([claim(f"train-{p}", memory_gi=GPU_GI, count=8) for p in range(2)], [[0], [1]]),
        "16 pods x 1 GPU": ([claim(f"train-{p}", memory_gi=GPU_GI) for p in range(16)],
                            [[p] for p in range(16)]),
    }  # fmt: skip
    rows = []
    for shape, (gang, groups) in shapes.items():
        times, choice = [], None
        for _ in range(args.runs):
            seconds, choice = run(state, pods, claims, gang, groups)
            times.append(seconds * 1000)
        stats = summary(times)
        victims = [p for u in choice.victims for p in u.pods] if choice else []
        rows.append({
            "gang": shape, "nodes": args.nodes, "gpus": args.nodes * GPUS_PER_NODE, "shares": len(pods),
            "victim_choice_ms_median": stats["median"], "victim_choice_ms_p99": stats["p99"],
            "iqr_ms": stats["iqr"], "runs": stats["n"],
            "victims": len(victims),
            "victim_unit_priorities": _counted(choice.cost.priorities) if choice else "-",
            "devices_disturbed": choice.cost.devices_disturbed if choice else 0,
            "fit_checks": choice.fit_checks if choice else 0,
        })  # fmt: skip
    header = list(rows[0])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        cells = [f"{row[h]:.1f}" if isinstance(row[h], float) else str(row[h]) for h in header]
        print("| " + " | ".join(cells) + " |")
    notes = (
        "100 nodes x 8 GPUs (80 GiB) filled with 2,000 shares of 8-32 GiB at priorities 100/500/1000/5000 "
        "(some in gangs of 4), no GPU wholly free; the preemptor has priority 2000. Time = building the "
        "victim units + choose_victims with the allocator as fit check (fit_checks = allocator calls); "
        "victim_unit_priorities counts victim units (a gang is one)."
    )
    write_result(
        "preemption", rows, title="Priority preemption: victim choice for a 16-GPU gang", notes=notes
    )


if __name__ == "__main__":
    main()

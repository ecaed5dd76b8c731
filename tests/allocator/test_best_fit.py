"""Best-fit counts every capacity, normalised (not memory alone): a share goes where it closes a device
in whichever capacity binds, keeping room shaped for what comes next."""

from __future__ import annotations

import random
import uuid
from typing import Any

import pytest
from allocator_builders import OURS, node_slice, our_classes, share

from driver.allocator import ClusterState


def _live(name: str, node: str, memory_gi: int, compute: int) -> dict[str, Any]:
    result = {
        "request": "gpu", "driver": OURS, "pool": node, "device": "gpu-0",
        "shareID": str(uuid.UUID(int=random.Random(name).getrandbits(128), version=4)),
        "consumedCapacity": {"memory": f"{memory_gi}Gi", "compute": str(compute)},
    }  # fmt: skip
    return {**share(name, memory_gi, compute), "status": {"allocation": {"devices": {"results": [result]}}}}


def _two_gpus(
    cluster_mode: bool, used_a: tuple[int, int], used_b: tuple[int, int]
) -> tuple[ClusterState, str | None]:
    """GPUs a and b with shares already using (GiB, %) of each: one GPU per node in cluster mode
    (the node choice is the device choice), else one two-GPU node (gpu-0 is a, gpu-1 is b)."""
    state = ClusterState()
    for device_class in our_classes():
        state.upsert_class(device_class)
    if cluster_mode:
        state.upsert_slice(node_slice("a", gpus=1))
        state.upsert_slice(node_slice("b", gpus=1))
        state.assume([_live("live-a", "a", *used_a), _live("live-b", "b", *used_b)])
        return state, None
    state.upsert_slice(node_slice("n0", gpus=2))
    live_b = _live("live-b", "n0", *used_b)
    live_b["status"]["allocation"]["devices"]["results"][0]["device"] = "gpu-1"
    state.assume([_live("live-a", "n0", *used_a), live_b])
    return state, "n0"


def _place_then(
    state: ClusterState, node: str | None, cluster_mode: bool, first: dict[str, Any], second: dict[str, Any]
) -> None:
    """``first`` goes to GPU b, and ``second`` still fits afterwards."""
    rng = random.Random(0)
    result = state.allocate([first], node=node, rng=rng)
    assert result is not None
    placed = result[0]["devices"]["results"][0]
    assert (placed["pool"], placed["device"]) == (("b", "gpu-0") if cluster_mode else ("n0", "gpu-1"))
    state.assume([{**first, "status": {"allocation": result[0]}}])
    assert state.allocate([second], node=node, rng=rng) is not None


@pytest.mark.parametrize("cluster_mode", [True, False])
def test_compute_counts_as_much_as_memory(cluster_mode: bool) -> None:
    """GPU a keeps 40 GiB and 90 % compute, GPU b 45 GiB and 45 %. A 35 GiB / 40 % share leaves a
    with 5 GiB / 50 % (memory-only best-fit's pick: the least memory left) or b with 10 GiB / 5 %.
    Counting compute too it goes to b, and a can still take a 30 GiB / 80 % share afterwards."""
    state, node = _two_gpus(cluster_mode, (40, 10), (35, 55))
    _place_then(state, node, cluster_mode, share("first", 35, 40), share("second", 30, 80))


@pytest.mark.parametrize("cluster_mode", [True, False])
def test_compute_left_over_weighs_double(cluster_mode: bool) -> None:
    """GPU a keeps 28 GiB and 70 % compute, GPU b 56 GiB and 35 %. A 20 GiB / 20 % share leaves a with
    8 GiB / 50 % or b with 36 GiB / 15 %. Weighing the fractions left equally (sum of square roots:
    1.02 against 1.06) it goes to a; with compute weighing double (1.73 against 1.45, the weight the
    bench's families chose) it goes to b, and a can then still take a 25 GiB / 60 % share, which
    would otherwise fit nowhere."""
    state, node = _two_gpus(cluster_mode, (52, 30), (24, 65))
    _place_then(state, node, cluster_mode, share("first", 20, 20), share("second", 25, 60))

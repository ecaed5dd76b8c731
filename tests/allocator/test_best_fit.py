"""Best-fit counts every capacity, normalised (not memory alone): a share goes to the fullest device in
use that can take it, fullness being the weighted L4 norm of the fractions used (compute counting
double: ``capacity.room_score``), keeping the emptier devices' room for what comes next."""

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
    """GPU a has 50 % of its memory and 10 % of its compute in use, GPU b 44 % and 55 %. Memory alone
    a is the fuller (and a 35 GiB / 40 % share would leave it the least memory); counting compute too
    b is, so the share goes to b, and a can still take a 30 GiB / 80 % share afterwards."""
    state, node = _two_gpus(cluster_mode, (40, 10), (35, 55))
    _place_then(state, node, cluster_mode, share("first", 35, 40), share("second", 30, 80))


@pytest.mark.parametrize("cluster_mode", [True, False])
def test_compute_left_over_weighs_double(cluster_mode: bool) -> None:
    """GPU a has 65 % of its memory and 30 % of its compute in use, GPU b 30 % and 65 %. Weighing the
    capacities equally they are as full as each other, and upstream order would pick a; with compute
    weighing double (the weight the bench's families chose) b is the fuller, so a 20 GiB / 20 % share
    goes to b, and a can then still take a 25 GiB / 60 % share, which would otherwise fit nowhere."""
    state, node = _two_gpus(cluster_mode, (52, 30), (24, 65))
    _place_then(state, node, cluster_mode, share("first", 20, 20), share("second", 25, 60))


@pytest.mark.parametrize("cluster_mode", [True, False])
def test_the_fullest_device_takes_the_share_not_the_one_it_would_leave_tightest(cluster_mode: bool) -> None:
    """GPU a has 30 GiB and 60 % compute in use, GPU b 60 GiB and 5 %. A 20 GiB / 5 % share would
    leave a with 30 GiB / 35 % and b with 0 GiB / 90 %: scored by the room left after it (square roots,
    compute double: 1.80 against 1.90) it went to a. Ranked by the load before it, b is the fuller
    (L4, compute double: 0.32 against 0.28), so it goes to b, and a keeps room for a 45 GiB / 35 %
    share that would otherwise fit nowhere (the rule that packs at least as well as
    first-fit on every family of bench/packing_traces.py's tuning traces)."""
    state, node = _two_gpus(cluster_mode, (30, 60), (60, 5))
    _place_then(state, node, cluster_mode, share("first", 20, 5), share("second", 45, 35))


def test_an_empty_device_is_chosen_by_how_much_the_share_fills_it() -> None:
    """kubernetes #138765 across two nodes (seen on the real 1.37.2 cluster): a 20 GiB share that may
    use an 80 GiB GPU X or a 40 GiB GPU Y, and a whole-GPU claim that must have X. Ranked by their
    load before the share, both GPUs are empty and tie; the share then goes to the one it fills
    most, Y, and X stays whole for the claim that needs it."""
    slices = [node_slice("node-a", gpus=8, memory_gi=80), node_slice("node-b", gpus=4, memory_gi=40)]
    for device in slices[1]["spec"]["devices"]:
        device["attributes"]["uuid"] = {"string": "GPU-B" + device["attributes"]["uuid"]["string"][4:]}
    x, y = "GPU-0000", "GPU-B0000"  # gpu-0 of the 80 GiB node, gpu-0 of the 40 GiB node
    share_claim = share("share", 20)
    share_claim["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"].pop("compute")
    selector = f'device.attributes["{OURS}"].uuid == "{x}" || device.attributes["{OURS}"].uuid == "{y}"'
    share_claim["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": selector}}
    ]
    whole = share("whole", 80)
    whole["spec"]["devices"]["requests"][0]["exactly"].pop("capacity")  # a whole GPU: its default
    whole["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": f'device.attributes["{OURS}"].uuid == "{x}"'}}
    ]
    state = ClusterState()
    for raw in [*slices, *our_classes()]:
        (state.upsert_slice if raw["kind"] == "ResourceSlice" else state.upsert_class)(raw)
    for node in ("node-a", "node-b"):
        state.upsert_node(node, {})
    placed = state.allocate([share_claim, whole], node=None, policy="best-fit", pod_groups=[[0], [1]])
    assert placed is not None
    pools = [result["pool"] for allocation in placed for result in allocation["devices"]["results"]]
    assert pools == ["node-b", "node-a"]

"""check_booking: would an allocation someone else wrote book a device past its capacity?

The allocation guard asks this of every allocation kube-scheduler writes for our devices, against
what the controller's state counts for every other claim."""

from __future__ import annotations

from typing import Any

import pytest
from allocator_builders import GI, OURS, allocated_result, node_slice, with_allocation

from driver.allocator import ClusterState, check_booking


def share_result(device: str, memory_gi: int, compute: int = 0, *, share_id: str = "s") -> dict[str, Any]:
    return allocated_result(
        device, pool="node-a", driver=OURS, request="gpu", shareID=share_id,
        consumedCapacity={"memory": f"{memory_gi}Gi", "compute": str(compute)},
    )  # fmt: skip


def whole_result(device: str) -> dict[str, Any]:
    return allocated_result(device, pool="node-a", driver=OURS, request="gpu")


def claim_with(uid: str, *results: dict[str, Any]) -> dict[str, Any]:
    return with_allocation(
        {"metadata": {"name": uid, "namespace": "default", "uid": uid}, "spec": {}},
        {"devices": {"results": list(results)}},
    )


def state_with(*claims: dict[str, Any], multi: bool = True) -> ClusterState:
    state = ClusterState()
    state.upsert_slice(node_slice("node-a", gpus=2, memory_gi=80, multi=multi))
    for claim in claims:
        state.upsert_claim(claim)
    return state


def test_a_share_that_fits_exactly_is_no_overbooking() -> None:
    state = state_with(claim_with("a", share_result("gpu-0", 60, 40, share_id="1")))
    assert check_booking(state, claim_with("b", share_result("gpu-0", 20, 60, share_id="2"))) == ()


@pytest.mark.parametrize(
    ("memory_gi", "compute", "dimension", "asked", "booked"),
    [(21, 10, "memory", 21 * GI, 60 * GI), (10, 61, "compute", 61, 40)],
)
def test_a_share_past_memory_or_compute_names_the_dimension_and_the_figures(
    memory_gi: int, compute: int, dimension: str, asked: int, booked: int
) -> None:
    state = state_with(claim_with("a", share_result("gpu-0", 60, 40, share_id="1")))
    (found,) = check_booking(state, claim_with("b", share_result("gpu-0", memory_gi, compute, share_id="2")))
    assert (found.device, found.dimension, found.asked, found.booked) == (
        (OURS, "node-a", "gpu-0"),
        dimension,
        asked,
        booked,
    )
    text = found.describe()
    assert f"{OURS}/node-a/gpu-0" in text and dimension in text
    if dimension == "memory":
        assert f"{memory_gi}Gi asked, 60Gi of 80Gi" in text


def test_two_shares_of_one_claim_on_one_device_count_together() -> None:
    state = state_with(claim_with("a", share_result("gpu-0", 40, share_id="1")))
    two = claim_with("b", share_result("gpu-0", 30, share_id="2"), share_result("gpu-0", 20, share_id="3"))
    (found,) = check_booking(state, two)
    assert (found.dimension, found.asked) == ("memory", 50 * GI)


def test_the_whole_device_beside_a_share_or_a_share_beside_the_whole_device() -> None:
    shared = state_with(claim_with("a", share_result("gpu-0", 1, share_id="1")))
    (found,) = check_booking(shared, claim_with("b", whole_result("gpu-0")))
    assert (found.dimension, found.asked, found.booked) == ("exclusive", 1, 1)
    assert "the whole device" in found.describe()
    whole = state_with(claim_with("a", whole_result("gpu-0")))
    (found,) = check_booking(whole, claim_with("b", share_result("gpu-0", 1, share_id="2")))
    assert (found.dimension, found.asked, found.booked) == ("exclusive", 0, 1)
    assert check_booking(whole, claim_with("b", whole_result("gpu-1"))) == ()  # another device


def test_a_device_without_multiple_allocations_takes_one_claim() -> None:
    state = state_with(claim_with("a", whole_result("gpu-0")), multi=False)
    (found,) = check_booking(state, claim_with("b", whole_result("gpu-0")))
    assert found.dimension == "exclusive"
    assert check_booking(state_with(multi=False), claim_with("b", whole_result("gpu-0"))) == ()


def test_what_the_state_counts_for_the_claim_itself_is_set_aside() -> None:
    """The same claim counted already (assumed in flight, or admitted once and sent again): its own
    entries never stand in its way."""
    mine = claim_with("a", share_result("gpu-0", 70, share_id="1"))
    state = state_with(mine)
    assert check_booking(state, mine) == ()
    assert check_booking(state, claim_with("a", share_result("gpu-0", 80, share_id="9"))) == ()


def test_admin_access_and_unpublished_devices_are_not_checked() -> None:
    state = state_with(claim_with("a", whole_result("gpu-0")))
    admin = allocated_result("gpu-0", pool="node-a", driver=OURS, request="gpu", adminAccess=True)
    assert check_booking(state, claim_with("b", admin)) == ()
    gone = allocated_result("gpu-7", pool="node-a", driver=OURS, request="gpu")
    assert check_booking(state, claim_with("b", gone)) == ()
    assert check_booking(state, claim_with("b")) == ()  # no results at all


def test_only_the_current_generation_of_a_pool_is_compared() -> None:
    state = ClusterState()
    state.upsert_slice(node_slice("node-a", gpus=1, memory_gi=80, generation=1))
    newer = node_slice("node-a", gpus=1, memory_gi=40, generation=2)
    newer["metadata"]["name"] = "node-a-newer"
    state.upsert_slice(newer)
    (found,) = check_booking(state, claim_with("b", share_result("gpu-0", 60, share_id="2")))
    assert found.capacity == 40 * GI

"""Upstream details beyond the conformance table: how fast the 32-result limit prunes, unknown attribute
types failing only where read, and list-type matchAttribute surviving a backtrack."""

from __future__ import annotations

from typing import Any

import pytest
from allocator_builders import DRIVER, claim, device, device_class, exact, first_available, resource_slice

from driver.allocator import AllocationError, ClusterState, allocate
from driver.allocator.model import parse_claim
from driver.allocator.search import NodeSearch


def _devices(allocation: dict[str, Any]) -> list[str]:
    return [r["device"] for r in allocation["devices"]["results"]]


def test_limit_is_checked_before_descending() -> None:
    """prioritized-list-max-allocation-limit-request: upstream answers after 75 allocateOne calls; a
    search that finds the limit only once 32 devices are placed walks C(64, 32) combinations."""
    state = ClusterState()
    state.upsert_class(device_class())
    state.upsert_slice(resource_slice("s1", [device(f"device-{i}") for i in range(64)]))
    state.refresh()
    raw = claim(
        "c",
        first_available("req0", exact("subReq0", count=32), exact("subReq1", count=16)),
        first_available("req1", exact("subReq0", count=32), exact("subReq1", count=16)),
    )
    view = state.view("node1")
    search = NodeSearch(
        state=state, node="node1", pools=view.pools, candidates=view.candidates,
        claims=[parse_claim(raw, state.classes)], best_fit=False, budget=1_000,
    )  # fmt: skip
    solution = search.run()
    assert solution is not None
    assert [e.request.name for e in solution.entries[0]] == ["req0/subReq1"] * 16 + ["req1/subReq1"] * 16
    assert search.steps <= 100


def test_an_unknown_attribute_type_fails_only_where_read() -> None:
    """The pool stays valid: with no selector and no constraint reading it, the device is allocated;
    a constraint that reads it rejects that device (another one matches); a selector fails, as
    upstream's CEL fails building the device's attributes."""
    odd = device("device-1", attributes={"future": {"float": "1.5"}, "model": "a"})
    plain = [
        device("device-2", attributes={"future": "x", "model": "a"}),
        device("device-3", attributes={"future": "x"}),
    ]
    slices = [resource_slice("s1", [odd, *plain])]
    no_selectors = device_class(selectors=[])
    result = allocate([claim("c")], slices=slices, classes=[no_selectors], node="node1", policy="first-fit")
    assert result is not None and _devices(result[0]) == ["device-1"]

    matching = claim("c", exact(count=2), constraints=[{"matchAttribute": f"{DRIVER}/future"}])
    result = allocate([matching], slices=slices, classes=[no_selectors], node="node1", policy="first-fit")
    assert result is not None and _devices(result[0]) == ["device-2", "device-3"]

    with pytest.raises(AllocationError, match="attribute future: unsupported attribute value"):
        allocate([claim("c")], slices=slices, classes=[device_class()], node="node1", policy="first-fit")


def test_list_match_intersection_is_restored_on_backtrack() -> None:
    """{a,b}, {b}, {a}, {a}, three devices with a common element: picking {b} second leaves no third,
    and after backtracking the running intersection is {a,b} again, so {a} then {a} fit. (Upstream
    narrowed the intersection for good, kubernetes PR #140326, and found nothing.)"""
    values = [["a", "b"], ["b"], ["a"], ["a"]]
    slices = [
        resource_slice(
            "s1", [device(f"device-{i}", attributes={"s": {"strings": v}}) for i, v in enumerate(values)]
        )
    ]
    raw = claim("c", exact(count=3), constraints=[{"matchAttribute": f"{DRIVER}/s"}])
    for policy in ("first-fit", "best-fit"):
        result = allocate([raw], slices=slices, classes=[device_class()], node="node1", policy=policy)
        assert result is not None and _devices(result[0]) == ["device-0", "device-2", "device-3"]

"""Upstream conformance scenarios (``allocatortesting/allocator_testing.go``): first-fit matches,
best-fit agrees."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest
from conformance_cases import CASES, FAIL, Case, Error

from driver.allocator import AllocationError, allocate
from driver.allocator.quantity import parse_quantity

UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def _run(case: Case, policy: str) -> list[dict[str, Any]] | None:
    return allocate(
        case.claims,
        slices=case.slices,
        classes=case.classes,
        allocated=case.allocated,
        node=case.node,
        policy=policy,
        nodes=case.nodes,
        rng=random.Random(1),
    )


def _summary(allocation: dict[str, Any]) -> list[tuple[Any, ...]]:
    out = []
    for result in allocation["devices"]["results"]:
        item: tuple[Any, ...] = (result["request"], result["pool"], result["device"])
        if "shareID" in result:
            assert UUID.match(result["shareID"]), result
            consumed = result.get("consumedCapacity")
            item += ({k: parse_quantity(v) for k, v in consumed.items()} if consumed else None,)
        else:
            assert "consumedCapacity" not in result
        out.append(item)
    return out


def _expected(case: Case) -> list[list[tuple[Any, ...]]]:
    expected = []
    for claim_results in case.expect:
        rows = []
        for row in claim_results:
            if len(row) == 4:
                consumed = row[3]
                row = (*row[:3], {k: parse_quantity(v) for k, v in consumed.items()} if consumed else None)
            rows.append(row)
        expected.append(rows)
    return expected


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_first_fit_matches_upstream(case: Case) -> None:
    if isinstance(case.expect, Error):
        with pytest.raises(AllocationError, match=re.escape(case.expect.text)):
            _run(case, "first-fit")
        return
    result = _run(case, "first-fit")
    if case.expect == FAIL:
        assert result is None
        return
    assert result is not None
    assert [_summary(a) for a in result] == _expected(case)
    if case.node_selector is not None or case.name == "all-nodes-device":
        assert result[0].get("nodeSelector") == case.node_selector


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_best_fit_agrees_on_feasibility(case: Case) -> None:
    if isinstance(case.expect, Error):
        with pytest.raises(AllocationError):
            _run(case, "best-fit")
        return
    result = _run(case, "best-fit")
    assert (result is None) == (case.expect == FAIL)
    if result is not None:
        assert [len(a["devices"]["results"]) for a in result] == [len(r) for r in case.expect]

"""Property tests: allocations respect capacities, exclusivity, policies and constraints; best-fit never
fails where first-fit succeeds for one claim; same input and seed give the same result; gangs are
all-or-nothing. The checker below re-derives the rules independently of the allocator's code."""

from __future__ import annotations

import random
from typing import Any

from allocator_builders import OURS, claim, exact, node_slice, our_classes, share
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from driver.allocator import ClusterState
from driver.allocator.quantity import parse_quantity

MI = 1 << 20
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

clusters = st.lists(
    st.tuples(st.integers(1, 3), st.sampled_from([4, 8, 16]), st.booleans()), min_size=1, max_size=3
)
claim_specs = st.lists(
    st.one_of(
        st.tuples(
            st.just("share"), st.integers(1, 32).map(lambda h: h / 2), st.sampled_from([0, 10, 50, 100])
        ),
        st.tuples(st.just("whole"), st.just(0), st.just(0)),
        st.tuples(st.just("pair"), st.integers(1, 16).map(lambda h: h / 2), st.just(0)),
    ),
    min_size=1,
    max_size=6,
)


def _build(
    cluster: list[tuple[int, int, bool]],
) -> tuple[ClusterState, dict[tuple[str, str], dict[str, Any]]]:
    state = ClusterState()
    for device_class in our_classes():
        state.upsert_class(device_class)
    devices = {}
    for index, (gpus, memory_gi, multi) in enumerate(cluster):
        node = f"n{index}"
        raw = node_slice(node, gpus=gpus, memory_gi=memory_gi, multi=multi)
        state.upsert_slice(raw)
        for device in raw["spec"]["devices"]:
            devices[(node, device["name"])] = device
    return state, devices


def _claim(index: int, spec: tuple[str, float, int]) -> dict[str, Any]:
    kind, memory_gi, compute = spec
    if kind == "share":
        return share(f"c{index}", memory_gi, compute)
    if kind == "whole":
        return claim(f"c{index}", exact("gpu", class_name="gpu.fractional.dev"))
    memory = {"memory": f"{int(memory_gi * 1024)}Mi"}
    return claim(
        f"c{index}",
        exact("a", class_name="gpu.fractional.dev", capacity=memory),
        exact("b", class_name="gpu.fractional.dev", capacity=memory),
        constraints=[{"distinctAttribute": f"{OURS}/uuid"}],
    )


def _check(
    devices: dict[tuple[str, str], dict[str, Any]], placed: list[tuple[dict[str, Any], dict[str, Any]]]
) -> None:
    """Every device within capacity, exclusive devices used once, shares only on shareable devices."""
    used: dict[tuple[str, str], dict[str, int]] = {}
    exclusive: dict[tuple[str, str], int] = {}
    for raw, allocation in placed:
        requests = {r["name"]: r["exactly"] for r in raw["spec"]["devices"]["requests"]}
        chosen = []
        for result in allocation["devices"]["results"]:
            key = (result["pool"], result["device"])
            device = devices[key]
            chosen.append(key)
            node_selector = allocation["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"]
            assert node_selector == [result["pool"]]
            if not device.get("allowMultipleAllocations"):
                assert "shareID" not in result and "consumedCapacity" not in result
                exclusive[key] = exclusive.get(key, 0) + 1
                continue
            consumed = {k: parse_quantity(v) for k, v in result["consumedCapacity"].items()}
            assert set(consumed) == set(device["capacity"])  # every capacity, zeros included
            asked = {k: parse_quantity(v) for k, v in (requests[result["request"]].get("capacity") or {}).get(
                "requests", {}).items()}  # fmt: skip
            memory_total = parse_quantity(device["capacity"]["memory"]["value"])
            assert consumed["memory"] % (256 * MI) == 0
            assert consumed["memory"] >= asked.get("memory", memory_total)
            assert consumed["compute"] == asked.get("compute", 0)
            totals = used.setdefault(key, {})
            for name, value in consumed.items():
                totals[name] = totals.get(name, 0) + value
        if len(requests) == 2:
            assert len(set(chosen)) == 2  # distinctAttribute on uuid
    for key, count in exclusive.items():
        assert count == 1 and key not in used
    for key, totals in used.items():
        for name, value in totals.items():
            assert value <= parse_quantity(devices[key]["capacity"][name]["value"])


def _sequence(cluster: Any, specs: Any, policy: str, node: str | None, seed: int) -> list[Any]:
    state, devices = _build(cluster)
    rng = random.Random(seed)
    placed = []
    outcomes = []
    for index, spec in enumerate(specs):
        raw = _claim(index, spec)
        result = state.allocate([raw], policy=policy, node=node, rng=rng)
        outcomes.append(result)
        if result is not None:
            placed.append((raw, result[0]))
            state.assume([{**raw, "status": {"allocation": result[0]}}])
    _check(devices, placed)
    return outcomes


@SETTINGS
@given(clusters, claim_specs, st.sampled_from(["best-fit", "first-fit"]), st.booleans())
def test_allocations_are_valid_and_deterministic(
    cluster: Any, specs: Any, policy: str, node_mode: bool
) -> None:
    node = "n0" if node_mode else None
    first = _sequence(cluster, specs, policy, node, seed=11)
    assert _sequence(cluster, specs, policy, node, seed=11) == first


@SETTINGS
@given(clusters, claim_specs, st.booleans())
def test_best_fit_never_fails_where_first_fit_succeeds(cluster: Any, specs: Any, node_mode: bool) -> None:
    state, devices = _build(cluster)
    node = "n0" if node_mode else None
    placed = []
    for index, spec in enumerate(specs):
        raw = _claim(index, spec)
        plain = state.allocate([raw], policy="first-fit", node=node)
        best = state.allocate([raw], policy="best-fit", node=node, rng=random.Random(index))
        if plain is not None:
            assert best is not None
        if best is not None:
            placed.append((raw, best[0]))
            state.assume([{**raw, "status": {"allocation": best[0]}}])
    _check(devices, placed)


@SETTINGS
@given(clusters, claim_specs, claim_specs, st.sampled_from(["best-fit", "first-fit"]))
def test_gangs_are_all_or_nothing(cluster: Any, before: Any, gang_specs: Any, policy: str) -> None:
    state, devices = _build(cluster)
    placed = []
    for index, spec in enumerate(before):
        raw = _claim(index, spec)
        result = state.allocate([raw])
        if result is not None:
            placed.append((raw, result[0]))
            state.assume([{**raw, "status": {"allocation": result[0]}}])
    summary = state.free_summary()
    gang = [_claim(100 + i, spec) for i, spec in enumerate(gang_specs)]
    result = state.allocate(gang, policy=policy, rng=random.Random(3))
    assert state.free_summary() == summary  # allocate() itself holds nothing
    if result is None:
        return
    assert len(result) == len(gang)
    _check(devices, placed + list(zip(gang, result, strict=True)))

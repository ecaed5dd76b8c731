"""Cluster mode (node=None), gangs, pod groups, exclusion, topology, results, incremental ClusterState."""

from __future__ import annotations

import random
from typing import Any

import pytest
from allocator_builders import (
    DRIVER,
    OURS,
    allocated_claim,
    allocated_result,
    claim,
    device,
    device_class,
    exact,
    first_available,
    node_slice,
    our_classes,
    resource_slice,
    share,
)

from driver.allocator import AllocationError, ClusterState, allocate
from driver.allocator.quantity import parse_quantity

GI = 1 << 30


def _state(nodes: dict[str, dict[str, Any]], **slice_args: Any) -> ClusterState:
    state = ClusterState()
    for device_class_ in our_classes():
        state.upsert_class(device_class_)
    for name, labels in nodes.items():
        state.upsert_node(name, labels)
        state.upsert_slice(node_slice(name, **slice_args))
    return state


def _placed(allocation: dict[str, Any]) -> list[tuple[str, str]]:
    return [(r["pool"], r["device"]) for r in allocation["devices"]["results"]]


def _assume(state: ClusterState, claims: list[dict[str, Any]], allocations: list[dict[str, Any]]) -> None:
    for raw, allocation in zip(claims, allocations, strict=True):
        state.assume([{**raw, "status": {"allocation": allocation}}])


def whole(name: str, count: int = 1) -> dict[str, Any]:
    return claim(name, exact("gpu", class_name="gpu.fractional.dev", count=count))


def test_best_fit_fills_a_shared_gpu_before_opening_another() -> None:
    state = _state({"a": {}, "b": {}}, gpus=2, memory_gi=40)
    first = share("c0", 10)
    allocations = state.allocate([first], rng=random.Random(0))
    assert allocations is not None
    _assume(state, [first], allocations)
    second = state.allocate([share("c1", 20)], rng=random.Random(0))
    assert second is not None and _placed(second[0]) == _placed(allocations[0])
    result = second[0]["devices"]["results"][0]
    assert {k: parse_quantity(v) for k, v in result["consumedCapacity"].items()} == {
        "memory": 20 * GI,
        "compute": 0,
    }
    assert result["request"] == "gpu" and len(result["shareID"]) == 36


def test_first_fit_cluster_takes_first_node_and_device_in_order() -> None:
    state = _state({"b": {}, "a": {}}, gpus=2, memory_gi=40)
    allocations = state.allocate([share("c0", 10)], policy="first-fit")
    assert allocations is not None and _placed(allocations[0]) == [("a", "gpu-0")]
    assert allocations[0]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["a"]


def test_gang_fits_on_one_node_when_it_can() -> None:
    state = _state({"a": {}, "b": {}, "c": {}}, gpus=4, memory_gi=40)
    busy = share("busy", 30)
    taken = state.allocate([busy], node="b")
    assert taken is not None
    _assume(state, [busy], taken)
    gang = [whole(f"w{i}") for i in range(4)]
    allocations = state.allocate(gang)
    assert allocations is not None
    assert len({pool for a in allocations for pool, _ in _placed(a)}) == 1


def test_gang_spans_nodes_all_or_nothing_and_prefers_the_topology_label() -> None:
    nodes = {"a1": {"zone": "a"}, "a2": {"zone": "a"}, "b1": {"zone": "b"}, "b2": {"zone": "b"}}
    state = _state(nodes, gpus=2, memory_gi=40)
    gang = [whole(f"w{i}") for i in range(4)]
    allocations = state.allocate(gang)
    assert allocations is not None
    pools = {pool for a in allocations for pool, _ in _placed(a)}
    assert len(pools) == 2
    assert len({nodes[p]["zone"] for p in pools}) == 1
    before = state.free_summary()
    assert state.allocate([whole(f"x{i}") for i in range(9)]) is None  # 9 GPUs asked of 8
    assert state.free_summary() == before  # nothing held after a failed gang


@pytest.mark.parametrize(
    "gang",
    [
        [whole("five", count=5)],  # 5 devices asked of 4 on every node
        [share(f"big{i}", 40) for i in range(9)],  # more memory than the cluster has
        [claim("many", *[exact(f"r{i}", class_name="gpu.fractional.dev", capacity={"memory": "40Gi"})
                          for i in range(5)], constraints=[{"distinctAttribute": f"{OURS}/uuid"}])],
    ],
)  # fmt: skip
def test_infeasible_gangs_are_rejected(gang: list[dict[str, Any]]) -> None:
    state = _state({f"n{i}": {} for i in range(2)}, gpus=4, memory_gi=40)
    assert state.allocate(gang) is None
    assert state.allocate(gang, policy="first-fit") is None


def test_infeasible_gang_on_many_nodes_is_rejected_by_prechecks_without_search() -> None:
    state = _state({f"n{i:03d}": {} for i in range(200)}, gpus=4, memory_gi=40)
    assert state.allocate([whole("five", count=5)]) is None
    assert not state.infeasible  # rejected before any node search


def test_pod_groups_land_on_one_node() -> None:
    state = _state({"a": {}, "b": {}}, gpus=2, memory_gi=40)
    claims = [whole("p0"), whole("p1"), whole("q0"), whole("q1")]
    allocations = state.allocate(claims, pod_groups=[[0, 1], [2, 3]])
    assert allocations is not None
    nodes = [_placed(a)[0][0] for a in allocations]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
    assert state.allocate([whole("x"), whole("y"), whole("z")], pod_groups=[[0, 1, 2]]) is None


def test_exclude_nodes() -> None:
    state = _state({"a": {}, "b": {}}, gpus=1, memory_gi=40)
    allocations = state.allocate([share("c", 5)], exclude_nodes=frozenset({"a"}))
    assert allocations is not None and _placed(allocations[0])[0][0] == "b"
    assert state.allocate([share("c", 5)], exclude_nodes=frozenset({"a", "b"})) is None


def test_best_fit_pairs_gpu_and_nic_on_one_pcie_root() -> None:
    state = _state({"a": {}}, gpus=4, memory_gi=40, nics=2, multi=False)
    busy = whole("busy")
    first = state.allocate([busy], node="a", policy="first-fit")
    assert first is not None and _placed(first[0]) == [("a", "gpu-0")]
    _assume(state, [busy], first)
    pair = claim(
        "pair", exact("gpu", class_name="gpu.fractional.dev"), exact("nic", class_name="nic.fractional.dev")
    )
    best = state.allocate([pair], node="a")
    plain = state.allocate([pair], node="a", policy="first-fit")
    assert best is not None and plain is not None
    assert _placed(plain[0]) == [("a", "gpu-1"), ("a", "nic-0")]  # gpu-1 is on pci0, nic-0 on pci0: lucky
    gpu, nic = _placed(best[0])
    roots = {"gpu-0": 0, "gpu-1": 0, "gpu-2": 1, "gpu-3": 1, "nic-0": 0, "nic-1": 1}
    assert roots[gpu[1]] == roots[nic[1]]


def test_results_config_admin_bindings_and_deterministic_share_ids() -> None:
    classes = [device_class(config=[{"opaque": {"driver": DRIVER, "parameters": {"c": 0}}}])]
    slices = [resource_slice("s", [device("d1", multi=True, binding_conditions=["ready"]), device("d2")])]
    raw = claim(
        "c",
        exact("req0"),
        exact("req1", tolerations=[{"key": "k", "operator": "Exists"}]),
        config=[{"requests": ["req1"], "opaque": {"driver": DRIVER, "parameters": {"x": 1}}},
                {"opaque": {"driver": DRIVER, "parameters": {"y": 2}}}],
    )  # fmt: skip
    first = allocate([raw], slices=slices, classes=classes, node="node1", rng=random.Random(7))
    again = allocate([raw], slices=slices, classes=classes, node="node1", rng=random.Random(7))
    assert first == again
    assert first is not None
    results = first[0]["devices"]["results"]
    assert "adminAccess" not in results[0]  # nil, not false
    assert results[0]["bindingConditions"] == ["ready"] and results[0]["bindingFailureConditions"] == [
        "failed"
    ]
    assert "consumedCapacity" not in results[0]  # a shared device without capacities
    assert results[1]["tolerations"] == [{"key": "k", "operator": "Exists"}]
    assert first[0]["devices"]["config"] == [
        {"source": "FromClass", "opaque": {"driver": DRIVER, "parameters": {"c": 0}}},
        {"source": "FromClaim", "requests": ["req1"], "opaque": {"driver": DRIVER, "parameters": {"x": 1}}},
        {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {"y": 2}}},
    ]


def test_unknown_policy_and_bad_pod_group_are_errors() -> None:
    state = _state({"a": {}})
    with pytest.raises(AllocationError, match="unknown policy"):
        state.allocate([share("c", 1)], policy="worst-fit")
    with pytest.raises(AllocationError, match="out of range"):
        state.allocate([share("c", 1)], pod_groups=[[3]])


def _objects(seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rng = random.Random(seed)
    slices = [node_slice(f"n{i}", gpus=2, memory_gi=40) for i in range(4)]
    allocated = []
    for i in range(6):
        node = f"n{rng.randrange(4)}"
        gpu = f"gpu-{rng.randrange(2)}"
        allocated.append(
            allocated_claim(
                f"old{i}",
                allocated_result(gpu, pool=node, driver=OURS, request="gpu",
                                 shareID=f"00000000-0000-4000-8000-{i:012d}",
                                 consumedCapacity={"memory": "5Gi", "compute": "0"}),
            )
        )  # fmt: skip
    return slices, allocated


def test_incremental_updates_equal_a_fresh_build() -> None:
    slices, allocated = _objects(3)
    state = ClusterState()
    for device_class_ in our_classes():
        state.upsert_class(device_class_)
    for resource_slice_ in slices:
        state.upsert_slice(resource_slice_)
    state.upsert_slice(node_slice("gone", gpus=8))
    for raw in allocated:
        state.upsert_claim(raw)
    state.allocate([share("warm", 1)])  # builds views and indexes before the updates below
    state.remove_slice("gone-fractional.dev")
    state.upsert_slice(node_slice("n1", gpus=2, memory_gi=40, generation=2))
    state.upsert_claim(
        allocated_claim("extra", allocated_result("gpu-0", pool="n2", driver=OURS, request="gpu"))
    )
    state.remove_claim("uid-default-extra")
    state.remove_claim("uid-default-old0")
    final_slices = [s for s in slices if s["metadata"]["name"] != "n1-fractional.dev"]
    final_slices.append(node_slice("n1", gpus=2, memory_gi=40, generation=2))
    claims = [share(f"c{i}", size) for i, size in enumerate((5, 12, 20, 40, 3))]
    for policy in ("best-fit", "first-fit"):
        fresh = allocate(
            claims, slices=final_slices, classes=our_classes(), allocated=allocated[1:], policy=policy,
            rng=random.Random(5),
        )  # fmt: skip
        assert state.allocate(claims, policy=policy, rng=random.Random(5)) == fresh
    assert state.free_summary() == fresh_state(final_slices, allocated[1:]).free_summary()


def fresh_state(slices: list[dict[str, Any]], allocated: list[dict[str, Any]]) -> ClusterState:
    state = ClusterState()
    for resource_slice_ in slices:
        state.upsert_slice(resource_slice_)
    for raw in allocated:
        state.upsert_claim(raw)
    return state


def test_cluster_mode_finds_the_smaller_first_available_alternative() -> None:
    state = _state({"a": {}}, gpus=1, memory_gi=40)
    busy = share("busy", 30)
    taken = state.allocate([busy])
    assert taken is not None
    _assume(state, [busy], taken)
    prioritized = claim(
        "p",
        first_available(
            "gpu",
            exact("big", class_name="gpu.fractional.dev", capacity={"memory": "20Gi"}),
            exact("small", class_name="gpu.fractional.dev", capacity={"memory": "8Gi"}),
        ),
    )
    for policy in ("best-fit", "first-fit"):
        allocations = state.allocate([prioritized], policy=policy)
        assert allocations is not None
        assert allocations[0]["devices"]["results"][0]["request"] == "gpu/small"


def test_free_snapshot_summarizes_as_free_summary_did_when_taken() -> None:
    """``free_snapshot`` is taken under the controller's lock and summarized without it: later
    changes to the ledger (a share added to and one removed from the same device, a whole GPU
    taken) must not show in it."""
    state = _state({"a": {}, "b": {}}, gpus=2, memory_gi=40)

    def place(raw: dict[str, Any]) -> None:
        allocations = state.allocate([raw], policy="first-fit")
        assert allocations is not None
        _assume(state, [raw], allocations)

    place(share("c0", 10))
    place(share("c1", 5))
    before = state.free_summary()
    snapshot = state.free_snapshot()
    place(share("c2", 7))  # on the device of c0 and c1 (first-fit)
    state.remove_claim("uid-default-c0")
    place(whole("w0"))
    assert state.free_summary() != before
    assert snapshot.summary() == before
    assert state.free_snapshot().summary() == state.free_summary()

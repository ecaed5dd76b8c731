"""The node agent refuses shares that would take a GPU past the capacity it publishes (memory and
compute), whatever the allocation says: the last line of defence against a bad or racing allocator."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes.utils.quantity import parse_quantity
from prometheus_client import REGISTRY

from driver.cluster.kubelet import KubeletSimulator
from driver.inventory.model import NodeInventory
from driver.plugin.agent import NodeAgent
from driver.plugin.devices import published_capacity
from driver.plugin.state import CapacityExceededError
from driver.slices import build_gpu_device
from tests.plugin.conftest import Claims, NodeDirs, new_share_id, result
from tests.plugin.test_state import Env, claim

GIB = 1024**3


@pytest.fixture
def env(tmp_path: Path, inventory: NodeInventory) -> Env:
    return Env(tmp_path, inventory)


def refused() -> float:
    return (
        REGISTRY.get_sample_value("fractional_plugin_prepare_refused_total", {"reason": "overcommit"}) or 0.0
    )


def share(memory: str, compute: str, device: str = "gpu-0") -> dict[str, Any]:
    return result(device, share_id=new_share_id(), memory=memory, compute=compute)


def test_capacity_is_what_the_slice_publishes(inventory: NodeInventory) -> None:
    for gpu in inventory.gpus:
        published = build_gpu_device(gpu, inventory)["capacity"]
        capacity = published_capacity(gpu)
        assert capacity.memory_bytes == int(parse_quantity(published["memory"]["value"]))
        assert capacity.compute_percent == int(parse_quantity(published["compute"]["value"]))
    assert published_capacity(inventory.gpus[0]).memory_bytes == 22 * GIB  # l4-2x: 22.16 GiB usable


def test_three_10gi_60_percent_shares_in_one_call(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    """Three shares in one call overcommit a GPU: 30Gi of memory limits and 180% of compute on one
    22Gi GPU."""
    state = env.state()
    claims = [claim([share("10Gi", "60")]) for _ in range(3)]
    before = refused()
    with caplog.at_level(logging.WARNING, logger="driver.plugin.state"):
        outcomes = state.prepare_many(claims)
    assert not isinstance(outcomes[claims[0].uid], Exception)
    for refused_claim in claims[1:]:
        error = outcomes[refused_claim.uid]
        assert isinstance(error, CapacityExceededError)
        assert str(error) == (
            f"ResourceClaim ns/{refused_claim.ref.name}: device node-a/gpu-0: compute: requested 60% with "
            "60% already prepared for 1 other claim: over the capacity of 100%"
        )
    assert refused() == before + 2
    assert sorted(state.prepared_claims()) == [claims[0].uid]
    assert env.spec_files() == [f"k8s.fractional.dev-gpu_{claims[0].uid}.json"]
    lines = [r for r in caplog.records if r.getMessage() == "claim refused: device over capacity"]
    assert (
        [(r.claim_uid, r.device, r.dimension, r.requested, r.prepared, r.capacity) for r in lines]
        == [  # type: ignore[attr-defined]
            (c.uid, "node-a/gpu-0", "compute", 60, 60, 100) for c in claims[1:]
        ]
    )


def test_memory_counts_every_other_claim_on_the_gpu_and_never_the_claim_itself(env: Env) -> None:
    first = claim([share("10Gi", "0")])
    second = claim([share("10Gi", "0")])
    env.state("boot-1").prepare_many([first, second])
    rebooted = env.state("boot-2")  # entries of an earlier boot are redone, and checked again
    assert rebooted.prepare(first)[0].share is not None  # its own record is not counted twice
    third = claim([share("4Gi", "0")])
    with pytest.raises(CapacityExceededError) as raised:
        rebooted.prepare(third)
    assert str(raised.value) == (
        f"ResourceClaim ns/{third.ref.name}: device node-a/gpu-0: memory: requested 4Gi (4294967296 bytes) "
        "with 20Gi (21474836480 bytes) already prepared for 2 other claims: over the capacity of "
        "22Gi (23622320128 bytes)"
    )
    assert third.uid not in rebooted.prepared_claims()
    rebooted.prepare(claim([share("2Gi", "0")]))  # exactly full is fine
    rebooted.prepare(claim([share("4Gi", "0", device="gpu-1")]))  # the other GPU has its own


def test_a_share_without_memory_takes_the_whole_gpu(env: Env) -> None:
    state = env.state()
    state.prepare(claim([result("gpu-0", share_id=new_share_id())]))  # memory defaults to all of it
    with pytest.raises(CapacityExceededError, match=r"memory: requested 256Mi .* capacity of 22Gi"):
        state.prepare(claim([share("256Mi", "0")]))


def test_refusal_reaches_the_kubelet_as_the_claims_error(
    start_agent: Callable[..., NodeAgent],
    make_kubelet: Callable[..., KubeletSimulator],
    claims: Claims,
    node_dirs: NodeDirs,
) -> None:
    start_agent()
    kubelet = make_kubelet()
    refs = [claims.create(f"share-{i}", [share("10Gi", "30")]) for i in range(3)]
    answer = kubelet.prepare(refs)
    assert [answer[ref["uid"]]["error"] for ref in refs[:2]] == ["", ""]
    assert answer[refs[2]["uid"]]["devices"] == []
    assert answer[refs[2]["uid"]]["error"] == (
        "ResourceClaim default/share-2: device node-a/gpu-0: memory: requested 10Gi (10737418240 bytes) "
        "with 20Gi (21474836480 bytes) already prepared for 2 other claims: over the capacity of "
        "22Gi (23622320128 bytes)"
    )
    assert len(list(node_dirs.cdi.glob("*.json"))) == 2

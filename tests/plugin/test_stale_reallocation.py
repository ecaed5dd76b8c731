"""A claim re-allocated under the same UID (its Unprepare missed, or lost) is prepared again with its
new devices: the old preparation is undone first, and stale devices are never answered."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from driver.inventory.model import NodeInventory
from driver.plugin import cdi
from driver.plugin.checkpoint import Checkpoint, ClaimPhase, render_checkpoint
from driver.plugin.claims import Claim, ClaimRef, parse_claim
from driver.plugin.sharing.base import ContainerEdits
from tests.plugin.conftest import new_share_id, result
from tests.plugin.test_state import Env, SimulatedCrash, claim


@pytest.fixture
def env(tmp_path: Path, inventory: NodeInventory) -> Env:
    return Env(tmp_path, inventory)


def reallocated(old: Claim, *results: dict[str, object]) -> Claim:
    """The same claim (same UID) with another allocation, as the API now has it."""
    body = {
        "metadata": dict(old.body["metadata"]),
        "status": {"allocation": {"devices": {"results": list(results)}}},
    }
    return parse_claim(body, ClaimRef(namespace=old.ref.namespace, name=old.ref.name, uid=old.uid))


def redone() -> float:
    return (
        REGISTRY.get_sample_value("fractional_plugin_prepares_redone_total", {"reason": "reallocated"}) or 0.0
    )


def spec_env(env: Env, uid: str) -> list[str]:
    spec = json.loads(cdi.claim_spec_path(env.cdi_root, "gpu", uid).read_text())
    return [value for device in spec["devices"] for value in device["containerEdits"]["env"]]


def test_reallocated_claim_gets_its_new_devices_and_frees_the_old(env: Env) -> None:
    state = env.state()
    old_share = new_share_id()
    first = claim([result("gpu-0", share_id=old_share, memory="4Gi"), result("nic-0", request="net")])
    state.prepare(first)
    new_share = new_share_id()
    again = reallocated(first, result("gpu-1", share_id=new_share, memory="8Gi"))
    before = redone()
    devices = state.prepare(again)
    assert [(d.device, d.share_id) for d in devices] == [("gpu-1", new_share)]
    assert devices[0].cdi_device_ids == (f"k8s.fractional.dev/gpu={first.uid}-gpu-1-{new_share[:8]}",)
    assert env.spec_files() == [f"k8s.fractional.dev-gpu_{first.uid}.json"]  # the NIC's spec went
    assert f"FRACTIONAL_GPU_MEMORY_LIMIT={8 * 1024**3}" in spec_env(env, first.uid)
    assert env.held() == {(first.uid, "gpu-1", new_share)}  # the old share was released
    assert state.prepared_claims()[first.uid].devices == devices
    assert redone() == before + 1
    assert state.prepare(again) == devices  # and now it is answered from the record
    assert redone() == before + 1


def test_the_claim_put_on_the_old_gpu_is_prepared(env: Env) -> None:
    state = env.state()
    moved = claim([result("gpu-0")])
    state.prepare(moved)
    newcomer = claim([result("gpu-0")])  # the API gave gpu-0 to another claim once moved left it
    outcomes = state.prepare_many([newcomer, reallocated(moved, result("gpu-1"))])
    assert [d.device for d in outcomes[moved.uid]] == ["gpu-1"]  # type: ignore[union-attr]
    assert [d.device for d in outcomes[newcomer.uid]] == ["gpu-0"]  # type: ignore[union-attr]


def test_new_limits_on_the_same_share_are_applied(env: Env) -> None:
    state = env.state()
    share_id = new_share_id()
    first = claim([result("gpu-0", share_id=share_id, memory="4Gi", compute="10")])
    state.prepare(first)
    devices = state.prepare(
        reallocated(first, result("gpu-0", share_id=share_id, memory="6Gi", compute="20"))
    )
    assert devices[0].share is not None
    assert (devices[0].share.memory_bytes, devices[0].share.compute_percent) == (6 * 1024**3, 20)
    assert "FRACTIONAL_GPU_COMPUTE_PERCENT=20" in spec_env(env, first.uid)
    assert env.backends["none"].count("release", first.uid) == 1
    assert env.backends["none"].count("acquire", first.uid) == 2
    # What an agent upgrade renders differently (container edits) is no re-allocation: not redone.
    entry = state.prepared_claims()[first.uid]
    upgraded = replace(entry, devices=(replace(entry.devices[0], edits=ContainerEdits(env=("OLD=1",))),))
    path = env.plugin_dir / "checkpoint.json"
    path.write_bytes(render_checkpoint(Checkpoint(claims={first.uid: upgraded}), "boot-1"))
    assert env.state().prepare(
        reallocated(first, result("gpu-0", share_id=share_id, memory="6Gi", compute="20"))
    )[0].edits == ContainerEdits(env=("OLD=1",))
    assert env.backends["none"].count("acquire", first.uid) == 2


def test_a_started_prepare_is_not_redone_with_its_old_devices(env: Env) -> None:
    first = claim([result("gpu-0", share_id=new_share_id(), memory="4Gi")])

    def crash(effect: str, uid: str) -> None:
        if effect == "shares-acquired":
            raise SimulatedCrash(effect)

    with pytest.raises(SimulatedCrash):
        env.state(on_effect=crash).prepare(first)
    assert env.state().prepared_claims()[first.uid].phase is ClaimPhase.STARTED
    new_share = new_share_id()
    devices = env.state().prepare(reallocated(first, result("gpu-1", share_id=new_share, memory="4Gi")))
    assert [(d.device, d.share_id) for d in devices] == [("gpu-1", new_share)]
    assert env.held() == {(first.uid, "gpu-1", new_share)}


def test_a_recovered_claim_reallocated_elsewhere_frees_its_gpu(env: Env) -> None:
    moved = claim([result("gpu-0"), result("nic-0", request="net")])
    env.state().prepare(moved)
    (env.plugin_dir / "checkpoint.json").write_bytes(b"\0")  # lost: rebuilt from the CDI spec
    restarted = env.state()
    restarted.restore()
    assert restarted.prepared_claims()[moved.uid].phase is ClaimPhase.RECOVERED
    assert [d.device for d in restarted.prepare(reallocated(moved, result("gpu-1")))] == ["gpu-1"]
    assert env.spec_files() == [f"k8s.fractional.dev-gpu_{moved.uid}.json"]  # the NIC's spec went
    restarted.prepare(claim([result("gpu-0")]))

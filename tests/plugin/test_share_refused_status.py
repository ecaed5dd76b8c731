"""A share the node refuses at prepare is recorded on the claim (``status.devices``, ``Ready=False``,
reason ``ShareRefused``) so that the allocation controller can replace the pod: once per refusal,
not on every kubelet retry, and cleared by a later prepare that succeeds.

Through the real protocols: the kubelet simulator calls the agent over gRPC on a unix socket, the
agent writes the claim in the API emulator, which validates every entry against the allocation.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from driver.cluster.kubelet import KubeletSimulator
from driver.inventory.model import NodeInventory
from driver.plugin.agent import NodeAgent
from driver.plugin.state import CapacityExceededError, ShareRefusedError
from driver.plugin.status import REFUSED_REASON, ShareRefusal, build_refused_statuses
from tests.plugin.conftest import NODE, Claims, new_share_id, result, wait_for
from tests.plugin.test_device_status import our_entries, read_claim
from tests.plugin.test_state import Env, claim, mps_config

StartAgent = Callable[..., NodeAgent]
MakeKubelet = Callable[..., KubeletSimulator]
NOW = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)
LATER = datetime(2025, 6, 1, 13, 0, 0, tzinfo=UTC)


def refusals(entries: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    """(device, shareID, condition status, reason) of each of our entries."""
    return [
        (e["device"], e.get("shareID", ""), e["conditions"][0]["status"], e["conditions"][0]["reason"])
        for e in entries
    ]


def refuse_writes() -> float:
    """Refusal intents the status writer handled, whatever their outcome."""
    return sum(
        REGISTRY.get_sample_value(
            "fractional_plugin_claim_status_writes_total", {"operation": "refuse", "result": result}
        )
        or 0.0
        for result in ("ok", "unchanged", "gone", "failed")
    )


@pytest.fixture
def env(tmp_path: Path, inventory: NodeInventory) -> Env:
    return Env(tmp_path, inventory)


# -- pure ----------------------------------------------------------------------------------------


def test_build_refused_statuses_one_entry_per_refused_share_and_a_stable_time() -> None:
    first_id, second_id = new_share_id(), new_share_id()
    refusal = ShareRefusal(pool=NODE, device="gpu-0", share_ids=(first_id, second_id), message="over")
    built = build_refused_statuses(refusal, now=NOW, generation=2)
    assert built[0] == {
        "driver": "fractional.dev",
        "pool": NODE,
        "device": "gpu-0",
        "shareID": first_id,
        "conditions": [
            {
                "type": "Ready",
                "status": "False",
                "reason": "ShareRefused",
                "message": "over",
                "lastTransitionTime": "2025-06-01T12:00:00Z",
                "observedGeneration": 2,
            }
        ],
    }
    assert [entry["shareID"] for entry in built] == [first_id, second_id]
    again = build_refused_statuses(refusal, now=LATER, generation=2, previous=built)
    assert again == built  # the same refusal: the same entries, no write
    whole = ShareRefusal(pool=NODE, device="gpu-1", share_ids=(None,), message="x")
    assert "shareID" not in build_refused_statuses(whole, now=NOW)[0]
    long = ShareRefusal(pool=NODE, device="gpu-0", share_ids=(first_id,), message="m" * 5000)
    assert len(build_refused_statuses(long, now=NOW)[0]["conditions"][0]["message"]) == 1024


def test_both_refusals_name_the_refused_device(env: Env) -> None:
    state = env.state()
    state.prepare(claim([result("gpu-0", share_id=new_share_id(), memory="20Gi")]))
    with pytest.raises(CapacityExceededError) as over:
        state.prepare(claim([result("gpu-0", share_id=new_share_id(), memory="4Gi")]))
    assert (over.value.pool, over.value.device_name) == (NODE, "gpu-0")
    with pytest.raises(ShareRefusedError, match="EXCLUSIVE_PROCESS") as mixed:
        state.prepare(claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")], config=mps_config()))
    assert (mixed.value.pool, mixed.value.device_name) == (NODE, "gpu-0")
    assert mixed.value.field == "sharing.backend"


# -- through the kubelet and the API --------------------------------------------------------------


def test_an_overcommit_refusal_is_written_once_and_cleared_by_a_later_prepare(
    start_agent: StartAgent, make_kubelet: MakeKubelet, claims: Claims, api_server: Any
) -> None:
    start_agent(write_claim_status=True)
    kubelet = make_kubelet()
    share_ids = [new_share_id() for _ in range(3)]
    refs = [
        claims.create(f"share-{i}", [result("gpu-0", share_id=share_ids[i], memory="10Gi", compute="30")])
        for i in range(3)
    ]
    answer = kubelet.prepare(refs)
    error = answer[refs[2]["uid"]]["error"]
    assert "over the capacity of 22Gi" in error
    entries = wait_for(lambda: our_entries(claims, "share-2"), what="the refusal written")
    assert refusals(entries) == [("gpu-0", share_ids[2], "False", REFUSED_REASON)]
    assert entries[0]["pool"] == NODE
    assert entries[0]["conditions"][0]["message"] == error
    written = read_claim(claims, "share-2")
    refused_once = refuse_writes()

    # The kubelet retries the pod: the same refusal, nothing queued, nothing written.
    api_server.reset_counts()
    for _ in range(3):
        assert kubelet.prepare([refs[2]])[refs[2]["uid"]]["error"] == error
    # An unprepare queued after the retries: once its removal shows, every earlier intent is done.
    assert kubelet.unprepare([refs[0]]) == {refs[0]["uid"]: {"error": ""}}
    wait_for(lambda: not our_entries(claims, "share-0"), what="share-0's entries removed")
    assert api_server.request_count(verb="update", resource="resourceclaims/status") == 0
    assert refuse_writes() == refused_once  # not even a GET: the retries were never queued
    assert (
        read_claim(claims, "share-2")["metadata"]["resourceVersion"] == written["metadata"]["resourceVersion"]
    )

    # Room again: the retry succeeds, and its Ready entry replaces the refusal.
    assert kubelet.prepare([refs[2]])[refs[2]["uid"]]["error"] == ""
    wait_for(
        lambda: refusals(our_entries(claims, "share-2")) == [("gpu-0", share_ids[2], "True", "Prepared")],
        what="the refusal cleared",
    )

    # Refused again later, with the very same error: written again (the success ended the first).
    assert kubelet.unprepare([refs[2]]) == {refs[2]["uid"]: {"error": ""}}
    wait_for(lambda: not our_entries(claims, "share-2"), what="share-2's entries removed")
    assert kubelet.prepare([refs[0]])[refs[0]["uid"]]["error"] == ""
    assert kubelet.prepare([refs[2]])[refs[2]["uid"]]["error"] == error
    wait_for(
        lambda: (
            refusals(our_entries(claims, "share-2")) == [("gpu-0", share_ids[2], "False", REFUSED_REASON)]
        ),
        what="the second refusal written",
    )


def test_a_backend_refusal_is_written_beside_the_prepared_share(
    start_agent: StartAgent, make_kubelet: MakeKubelet, claims: Claims
) -> None:
    start_agent(write_claim_status=True)
    kubelet = make_kubelet()
    plain_id, mps_id = new_share_id(), new_share_id()
    plain = claims.create("plain", [result("gpu-1", share_id=plain_id, memory="1Gi")])
    mps = claims.create("mps", [result("gpu-1", share_id=mps_id, memory="1Gi")], config=mps_config())
    assert kubelet.prepare([plain])[plain["uid"]]["error"] == ""
    error = kubelet.prepare([mps])[mps["uid"]]["error"]
    assert "cannot join it" in error
    entries = wait_for(lambda: our_entries(claims, "mps"), what="the backend refusal written")
    assert refusals(entries) == [("gpu-1", mps_id, "False", REFUSED_REASON)]
    assert entries[0]["conditions"][0]["message"] == error
    prepared = wait_for(lambda: our_entries(claims, "plain"), what="the prepared share's status")
    assert refusals(prepared) == [("gpu-1", plain_id, "True", "Prepared")]

"""``status.devices`` after prepare: pure building and merging, then written through the emulator.

The emulator validates every status write with the official schema (metav1.Condition's required
fields, ``data`` as an object, ``networkData``) and the server rule that each entry matches an
allocated result, so a malformed entry fails here as it would on a cluster.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from prometheus_client import REGISTRY

from driver.cluster.kubelet import KubeletSimulator
from driver.inventory.model import NodeInventory
from driver.plugin.agent import NodeAgent
from driver.plugin.claims import ClaimRef, ClaimUID
from driver.plugin.devices import DeviceKind, PreparedDevice
from driver.plugin.sharing.base import ContainerEdits, ShareSpec
from driver.plugin.status import (
    ClaimStatusWriter,
    build_device_statuses,
    merge_device_statuses,
    without_driver_statuses,
)
from tests.plugin.conftest import GIB, NODE, Claims, NodeDirs, new_share_id, result, wait_for

StartAgent = Callable[..., NodeAgent]
MakeKubelet = Callable[..., KubeletSimulator]
NOW = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)
LATER = datetime(2025, 6, 1, 13, 0, 0, tzinfo=UTC)
OTHER_DRIVER = "net.example.com"


def gpu_device(
    share_id: str | None, *, memory: int, compute: int, whole: bool, backend: str
) -> PreparedDevice:
    share = ShareSpec(
        claim_uid="c-1",
        device="gpu-0",
        gpu_uuid="GPU-0000",
        ordinal=0,
        share_id=share_id,
        memory_bytes=memory,
        compute_percent=compute,
        whole_gpu=whole,
    )
    return PreparedDevice(
        kind=DeviceKind.GPU,
        request_names=("gpu",),
        pool=NODE,
        device="gpu-0",
        share_id=share_id,
        cdi_name="c-1-gpu-0",
        cdi_device_ids=("k8s.fractional.dev/gpu=c-1-gpu-0",),
        edits=ContainerEdits(env=("A=1",)),
        share=share,
        backend=backend,
    )


def nic_device() -> PreparedDevice:
    return PreparedDevice(
        kind=DeviceKind.NIC,
        request_names=("net",),
        pool=NODE,
        device="nic-0",
        share_id=None,
        cdi_name="c-1-nic-0",
        cdi_device_ids=("k8s.fractional.dev/nic=c-1-nic-0",),
        edits=ContainerEdits(env=("B=1",)),
    )


# -- pure ----------------------------------------------------------------------------------------


def test_build_gpu_share_and_nic(inventory: NodeInventory) -> None:
    share_id = new_share_id()
    devices = [gpu_device(share_id, memory=10 * GIB, compute=25, whole=False, backend="mps"), nic_device()]
    nic = inventory.nic("nic-0")
    assert nic is not None
    statuses = build_device_statuses(devices, node=NODE, now=NOW, generation=3, nics={"nic-0": nic})
    gpu, network = statuses
    assert gpu == {
        "driver": "fractional.dev",
        "pool": NODE,
        "device": "gpu-0",
        "shareID": share_id,
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Prepared",
                "message": "prepared on node node-a: 10240 MiB and 25% compute of GPU-0000, enforced by mps",
                "lastTransitionTime": "2025-06-01T12:00:00Z",
                "observedGeneration": 3,
            }
        ],
        "data": {
            "uuid": "GPU-0000",
            "memoryLimitBytes": 10 * GIB,
            "computePercent": 25,
            "wholeGPU": False,
            "backend": "mps",
        },
    }
    assert "shareID" not in network and network["device"] == "nic-0"
    assert network["networkData"]["interfaceName"] == nic.if_name
    if nic.mac_address:
        assert network["networkData"]["hardwareAddress"] == nic.mac_address
    if nic.rdma_device:
        assert network["data"] == {"rdmaDevice": nic.rdma_device}


def test_whole_gpu_without_share_id_and_without_generation() -> None:
    (entry,) = build_device_statuses(
        [gpu_device(None, memory=22 * GIB, compute=100, whole=True, backend="none")], node=NODE, now=NOW
    )
    assert "shareID" not in entry
    assert "observedGeneration" not in entry["conditions"][0]
    assert entry["data"]["wholeGPU"] is True
    assert entry["conditions"][0]["message"] == "prepared on node node-a: whole GPU GPU-0000"


def test_repeated_build_keeps_the_transition_time() -> None:
    devices = [gpu_device("s", memory=GIB, compute=0, whole=False, backend="hami")]
    first = build_device_statuses(devices, node=NODE, now=NOW)
    again = build_device_statuses(devices, node=NODE, now=LATER, previous=first)
    assert again == first
    not_ready = [{**first[0], "conditions": [{**first[0]["conditions"][0], "status": "False"}]}]
    changed = build_device_statuses(devices, node=NODE, now=LATER, previous=not_ready)
    assert changed[0]["conditions"][0]["lastTransitionTime"] == "2025-06-01T13:00:00Z"


def test_merge_keeps_other_drivers_and_replaces_ours() -> None:
    other = {"driver": OTHER_DRIVER, "pool": "p", "device": "eth0", "data": {"x": 1}}
    stale = {"driver": "fractional.dev", "pool": NODE, "device": "gpu-1"}
    ours = build_device_statuses(
        [gpu_device("s", memory=GIB, compute=0, whole=False, backend="none")], node=NODE, now=NOW
    )
    merged = merge_device_statuses([other, stale], ours)
    assert merged == [other, *ours]
    assert without_driver_statuses(merged) == [other]
    assert without_driver_statuses([]) == []


# -- through the API -----------------------------------------------------------------------------


def read_claim(claims: Claims, name: str) -> dict[str, Any]:
    response = claims.api.read_namespaced_resource_claim(name, "default", _preload_content=False)
    body: dict[str, Any] = json.loads(response.data)
    return body


def our_entries(claims: Claims, name: str) -> list[dict[str, Any]]:
    devices = (read_claim(claims, name).get("status") or {}).get("devices") or []
    return [entry for entry in devices if entry["driver"] == "fractional.dev"]


def add_foreign_status(claims: Claims, name: str) -> dict[str, Any]:
    """What another driver wrote for its own result of the claim."""
    body = read_claim(claims, name)
    entry = {
        "driver": OTHER_DRIVER,
        "pool": NODE,
        "device": "eth9",
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Up",
                "message": "",
                "lastTransitionTime": "2025-01-01T00:00:00Z",
            }
        ],
        "networkData": {"interfaceName": "eth9"},
    }
    body["status"]["devices"] = [entry]
    claims.api.replace_namespaced_resource_claim_status(name, "default", body)
    (stored,) = read_claim(claims, name)["status"]["devices"]
    return stored  # as the server returns it


def writes(operation: str, result: str) -> float:
    value = REGISTRY.get_sample_value(
        "fractional_plugin_claim_status_writes_total", {"operation": operation, "result": result}
    )
    return value or 0.0


def test_written_after_prepare_kept_beside_others_and_removed_after_unprepare(
    start_agent: StartAgent,
    make_kubelet: MakeKubelet,
    claims: Claims,
    api_server: Any,
    inventory: NodeInventory,
) -> None:
    start_agent(config={"sharing": "hami"}, write_claim_status=True)
    kubelet = make_kubelet()
    share_id = new_share_id()
    ref = claims.create(
        "mixed",
        [
            result("gpu-0", share_id=share_id, memory="10Gi", compute="25"),
            result("nic-0", request="net"),
            result("eth9", request="net", driver=OTHER_DRIVER),
        ],
        requests=("gpu", "net"),
    )
    foreign = add_foreign_status(claims, "mixed")
    answer = kubelet.prepare([ref])
    assert answer[ref["uid"]]["error"] == ""
    ours = wait_for(lambda: our_entries(claims, "mixed"), what="status.devices written")
    gpu, nic = ours
    assert (gpu["device"], gpu["shareID"], gpu["pool"]) == ("gpu-0", share_id, NODE)
    (ready,) = gpu["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "True", "Prepared")
    # A ResourceClaim has no metadata.generation on kube-apiserver 1.37 (nor now on the emulator):
    # the condition then carries no observedGeneration either.
    assert ready.get("observedGeneration") == read_claim(claims, "mixed")["metadata"].get("generation")
    assert datetime.fromisoformat(ready["lastTransitionTime"]).tzinfo is not None
    gpu0 = inventory.gpu("gpu-0")
    assert gpu0 is not None
    assert gpu["data"] == {
        "uuid": gpu0.uuid,
        "memoryLimitBytes": 10 * GIB,
        "computePercent": 25,
        "wholeGPU": False,
        "backend": "hami",
    }
    assert nic["device"] == "nic-0" and nic["networkData"]["interfaceName"] == inventory.nics[0].if_name
    assert read_claim(claims, "mixed")["status"]["devices"][0] == foreign  # other driver's entry kept

    # A repeated prepare (the kubelet retries after a restart) writes nothing new.
    updates = api_server.request_count(verb="update", resource="resourceclaims/status")
    unchanged = writes("write", "unchanged")
    assert kubelet.prepare([ref]) == answer
    wait_for(lambda: writes("write", "unchanged") > unchanged, what="the repeated write seen as unchanged")
    assert api_server.request_count(verb="update", resource="resourceclaims/status") == updates

    assert kubelet.unprepare([ref]) == {ref["uid"]: {"error": ""}}
    wait_for(lambda: not our_entries(claims, "mixed"), what="our entries removed")
    assert read_claim(claims, "mixed")["status"]["devices"] == [foreign]


def test_conflicts_are_retried(
    start_agent: StartAgent, make_kubelet: MakeKubelet, claims: Claims, api_server: Any
) -> None:
    start_agent(write_claim_status=True)
    kubelet = make_kubelet()
    ref = claims.create("c", [result("gpu-1", share_id=new_share_id(), memory="1Gi")])
    api_server.inject_fault(verb="update", resource="resourceclaims/status", status=409, times=2)
    assert kubelet.prepare([ref])[ref["uid"]]["error"] == ""
    (entry,) = wait_for(lambda: our_entries(claims, "c"), what="status written after two conflicts")
    assert entry["data"]["backend"] == "none"
    assert api_server.request_count(verb="update", resource="resourceclaims/status") >= 3


def test_a_refused_write_does_not_fail_the_prepare(
    start_agent: StartAgent, make_kubelet: MakeKubelet, claims: Claims, api_server: Any, node_dirs: NodeDirs
) -> None:
    """E.g. RBAC without ``resourceclaims/driver`` on 1.36+: 403. Logged and counted, not retried."""
    start_agent(write_claim_status=True)
    kubelet = make_kubelet()
    ref = claims.create("c", [result("gpu-0")])
    failed = writes("write", "failed")
    api_server.inject_fault(verb="update", resource="resourceclaims/status", status=403, times=1)
    answer = kubelet.prepare([ref])[ref["uid"]]
    assert answer["error"] == "" and [d["device_name"] for d in answer["devices"]] == ["gpu-0"]
    assert len(list(node_dirs.cdi.glob("*.json"))) == 1
    wait_for(lambda: writes("write", "failed") > failed, what="the failure counted")
    assert our_entries(claims, "c") == []


def test_unprepare_of_a_deleted_claim_is_fine(
    start_agent: StartAgent, make_kubelet: MakeKubelet, claims: Claims
) -> None:
    agent = start_agent(write_claim_status=True)
    kubelet = make_kubelet()
    ref = claims.create("c", [result("gpu-0")])
    kubelet.prepare([ref])
    wait_for(lambda: our_entries(claims, "c"), what="status written")
    claims.api.delete_namespaced_resource_claim("c", "default")
    gone = writes("remove", "gone")
    assert kubelet.unprepare([ref]) == {ref["uid"]: {"error": ""}}
    wait_for(lambda: writes("remove", "gone") > gone, what="the 404 seen as gone")
    assert agent.state is not None and agent.state.prepared_claims() == {}


@pytest.mark.parametrize("status", [503, 409])
def test_writer_retries_transient_errors(
    claims: Claims, api_server: Any, kube_configuration: Any, status: int
) -> None:
    writer = ClaimStatusWriter(node=NODE, configuration=kube_configuration, retry_seconds=0.01)
    writer.start()
    try:
        share_id = new_share_id()
        ref = claims.create("c", [result("gpu-0", share_id=share_id, memory="1Gi")])
        api_server.inject_fault(verb="update", resource="resourceclaims/status", status=status, times=2)
        device = gpu_device(share_id, memory=GIB, compute=0, whole=False, backend="none")
        writer.prepared(ClaimRef(namespace="default", name="c", uid=ClaimUID(ref["uid"])), (device,))
        assert writer.wait_idle(30)
        (entry,) = our_entries(claims, "c")
        assert entry["shareID"] == share_id
    finally:
        writer.close(timeout=10)


def test_writer_skips_a_replaced_claim(claims: Claims, api_server: Any, kube_configuration: Any) -> None:
    writer = ClaimStatusWriter(node=NODE, configuration=kube_configuration)
    writer.start()
    try:
        claims.create("c", [result("gpu-0")])
        old = ClaimRef(namespace="default", name="c", uid=ClaimUID("11111111-2222-4333-8444-555555555555"))
        api_server.reset_counts()
        writer.prepared(old, (gpu_device(None, memory=GIB, compute=0, whole=True, backend="none"),))
        assert writer.wait_idle(30)
        assert api_server.request_count(verb="update") == 0 and our_entries(claims, "c") == []
    finally:
        writer.close(timeout=10)

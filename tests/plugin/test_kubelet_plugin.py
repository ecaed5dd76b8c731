"""The agent as a kubelet sees it: real unix sockets, the kubelet simulator, the embedded API."""

from __future__ import annotations

import json
import os
import socket
import stat
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from driver.cluster.kubelet import KubeletSimulator, RegistrationRefused, choose_service
from driver.plugin.agent import NodeAgent
from driver.plugin.proto_gen import pluginregistration_pb2, pluginregistration_pb2_grpc
from driver.plugin.registration import SUPPORTED_VERSIONS
from tests.plugin.conftest import Claims, NodeDirs, new_share_id, result, wait_for

StartAgent = Callable[..., NodeAgent]
MakeKubelet = Callable[..., KubeletSimulator]


def spec_files(dirs: NodeDirs) -> list[Path]:
    return sorted(dirs.cdi.glob("*.json"))


def test_registration(start_agent: StartAgent, node_dirs: NodeDirs, make_kubelet: MakeKubelet) -> None:
    started = time.perf_counter()
    agent = start_agent()
    kubelet = make_kubelet("1.35")
    registration = kubelet.registration
    assert registration is not None
    # Measured, not asserted tightly (noisy machine): the kubelet's own GetInfo timeout is 1 s.
    assert time.perf_counter() - started < 30
    assert registration.socket == node_dirs.registry / "fractional.dev-reg.sock"
    assert registration.driver_name == "fractional.dev"
    assert registration.endpoint == node_dirs.plugin / "dra.sock" and registration.endpoint.is_absolute()
    assert registration.supported_versions == SUPPORTED_VERSIONS
    assert registration.service == "v1.DRAPlugin"
    assert agent.registration.registered.wait(5)
    assert REGISTRY.get_sample_value("fractional_plugin_registered") == 1
    assert stat.S_IMODE(registration.socket.stat().st_mode) == 0o600
    assert stat.S_IMODE(registration.endpoint.stat().st_mode) == 0o600
    assert stat.S_IMODE(node_dirs.plugin.stat().st_mode) == 0o750


@pytest.mark.parametrize(
    ("version", "offered", "chosen"),
    [
        ("1.35", ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"], "v1.DRAPlugin"),
        ("1.34", ["v1alpha1.DRAResourceHealth", "v1beta1.DRAPlugin", "v1.DRAPlugin"], "v1beta1.DRAPlugin"),
        ("1.32", ["v1.DRAPlugin", "v1beta1.DRAPlugin"], "v1beta1.DRAPlugin"),
        ("1.33", ["v1.DRAPlugin"], None),
        ("1.36", ["v1alpha1.DRAResourceHealth"], None),
    ],
)
def test_version_choice(version: str, offered: list[str], chosen: str | None) -> None:
    if chosen is None:
        with pytest.raises(RegistrationRefused):
            choose_service(version, offered)
    else:
        assert choose_service(version, offered) == chosen


def test_refused_registration_is_not_fatal(start_agent: StartAgent, node_dirs: NodeDirs) -> None:
    agent = start_agent()
    with grpc.insecure_channel(f"unix://{agent.paths.registration}") as channel:
        stub = pluginregistration_pb2_grpc.RegistrationStub(channel)
        stub.NotifyRegistrationStatus(
            pluginregistration_pb2.RegistrationStatus(plugin_registered=False, error="no handler"), timeout=5
        )
    assert agent.registration.notified.is_set() and not agent.registration.registered.is_set()
    assert agent.registration.error == "no handler"
    assert REGISTRY.get_sample_value("fractional_plugin_registered") == 0
    kubelet = KubeletSimulator(node_dirs.registry, kubelet_version="1.35")
    try:
        kubelet.register()  # the kubelet retries; the agent still answers
        assert agent.registration.registered.is_set()
    finally:
        kubelet.close()


def test_v1_and_v1beta1_give_the_same_answer(
    start_agent: StartAgent, node_dirs: NodeDirs, claims: Claims, check_cdi: Callable[[Path], dict[str, Any]]
) -> None:
    start_agent()
    new = KubeletSimulator(node_dirs.registry, kubelet_version="1.35")
    old = KubeletSimulator(node_dirs.registry, kubelet_version="1.32")
    try:
        new.register()
        old.register()
        assert (
            new.registration and new.registration.service,
            old.registration and old.registration.service,
        ) == (
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
        )
        share = new_share_id()
        ref = claims.create(
            "shared",
            [
                result("gpu-0", request="gpu/small", share_id=share, memory="2Gi", compute="20"),
                result("gpu-1"),
            ],
        )
        first = new.prepare([ref])
        second = old.prepare([ref])
        assert first[ref["uid"]]["error"] == ""
        devices = first[ref["uid"]]["devices"]
        assert [d["share_id"] for d in devices] == [share, None]
        assert [d["request_names"] for d in devices] == [["gpu"], ["gpu"]]
        assert [d["device_name"] for d in devices] == ["gpu-0", "gpu-1"]
        assert {d["pool_name"] for d in devices} == {"node-a"}
        # v1beta1 has no share_id; everything else is identical.
        assert second == {ref["uid"]: {"error": "", "devices": [{**d, "share_id": None} for d in devices]}}
        (spec_path,) = spec_files(node_dirs)
        spec = check_cdi(spec_path)
        names = {f"k8s.fractional.dev/gpu={d['name']}" for d in spec["devices"]}
        assert names == {i for d in devices for i in d["cdi_device_ids"]}
        assert old.unprepare([ref]) == {ref["uid"]: {"error": ""}}
        assert new.unprepare([ref]) == {ref["uid"]: {"error": ""}}
        assert spec_files(node_dirs) == []
    finally:
        new.close()
        old.close()


def test_bad_claims_get_per_claim_errors_and_no_cdi_file(
    start_agent: StartAgent, make_kubelet: MakeKubelet, node_dirs: NodeDirs, claims: Claims
) -> None:
    start_agent()
    kubelet = make_kubelet()
    good = claims.create("good", [result("gpu-0", share_id=new_share_id(), memory="1Gi")])
    unallocated = claims.create("unallocated", None)
    replaced = {**claims.create("replaced", [result("gpu-1")]), "uid": "11111111-2222-4333-8444-555555555555"}
    foreign = claims.create("foreign", [result("gpu-1", driver="gpu.nvidia.com")])
    missing = {"namespace": "default", "name": "missing", "uid": "99999999-2222-4333-8444-555555555555"}
    traversal = {"namespace": "default", "name": "../../../etc", "uid": "../../x"}
    refs = [good, unallocated, replaced, foreign, missing, traversal]
    answer = kubelet.prepare(refs)
    assert sorted(answer) == sorted(ref["uid"] for ref in refs)  # an entry for every requested UID
    assert answer[good["uid"]]["error"] == "" and answer[good["uid"]]["devices"]
    expected = {
        unallocated["uid"]: "status.allocation: the claim is not allocated",
        replaced["uid"]: "metadata.uid: expected 11111111",
        foreign["uid"]: "no device of driver fractional.dev",
        missing["uid"]: "default/missing: metadata.name: not found",
        traversal["uid"]: "metadata.name: '../../../etc' is not a DNS subdomain",
    }
    for uid, message in expected.items():
        assert message in answer[uid]["error"], answer[uid]
        assert answer[uid]["devices"] == []
    assert [p.name for p in spec_files(node_dirs)] == [f"k8s.fractional.dev-gpu_{good['uid']}.json"]
    assert list(node_dirs.cdi.parent.rglob("x*")) == []


def test_empty_request_answers_at_once(
    start_agent: StartAgent, make_kubelet: MakeKubelet, api_server: Any
) -> None:
    start_agent()
    kubelet = make_kubelet()
    api_server.reset_counts()
    assert kubelet.prepare([]) == {}
    assert kubelet.unprepare([]) == {}
    assert api_server.request_count() == 0


def test_unprepare_never_reads_the_claim(
    start_agent: StartAgent, make_kubelet: MakeKubelet, claims: Claims, api_server: Any, node_dirs: NodeDirs
) -> None:
    start_agent()
    kubelet = make_kubelet()
    ref = claims.create("c", [result("gpu-0")])
    kubelet.prepare([ref])
    claims.api.delete_namespaced_resource_claim("c", "default")
    api_server.reset_counts()
    unknown = {"namespace": "default", "name": "gone", "uid": "aaaaaaaa-2222-4333-8444-555555555555"}
    assert kubelet.unprepare([ref, unknown]) == {ref["uid"]: {"error": ""}, unknown["uid"]: {"error": ""}}
    assert kubelet.unprepare([ref]) == {ref["uid"]: {"error": ""}}
    assert api_server.request_count() == 0
    assert spec_files(node_dirs) == []


def test_transient_api_error_fails_only_that_claim(
    start_agent: StartAgent, make_kubelet: MakeKubelet, claims: Claims, api_server: Any
) -> None:
    start_agent()
    kubelet = make_kubelet()
    ref = claims.create("c", [result("gpu-0")])
    api_server.inject_fault(verb="get", resource="resourceclaims", status=503, times=1)
    answer = kubelet.prepare([ref])
    assert "HTTP 503" in answer[ref["uid"]]["error"] and "temporary" in answer[ref["uid"]]["error"]
    assert kubelet.prepare([ref])[ref["uid"]]["error"] == ""  # the kubelet's retry succeeds


def test_64_claims_concurrently(
    start_agent: StartAgent, make_kubelet: MakeKubelet, claims: Claims, node_dirs: NodeDirs
) -> None:
    start_agent()
    kubelet = make_kubelet()
    refs = [
        claims.create(f"c{i}", [result(f"gpu-{i % 2}", share_id=new_share_id(), memory="256Mi")])
        for i in range(64)
    ]
    with ThreadPoolExecutor(max_workers=64) as pool:
        answers = list(pool.map(lambda ref: kubelet.prepare([ref]), refs))
    for ref, answer in zip(refs, answers, strict=True):
        assert answer[ref["uid"]]["error"] == ""
    assert len(spec_files(node_dirs)) == 64
    with ThreadPoolExecutor(max_workers=64) as pool:
        undone = list(pool.map(kubelet.unprepare, [[ref] for ref in refs]))
    assert all(answer[ref["uid"]]["error"] == "" for ref, answer in zip(refs, undone, strict=True))
    assert spec_files(node_dirs) == []


def test_deleted_cdi_file_is_recreated(
    start_agent: StartAgent, make_kubelet: MakeKubelet, claims: Claims, node_dirs: NodeDirs
) -> None:
    start_agent()
    kubelet = make_kubelet()
    ref = claims.create(
        "c", [result("gpu-0", share_id=new_share_id(), memory="1Gi"), result("nic-0", request="net")]
    )
    first = kubelet.prepare([ref])
    contents = {p: p.read_bytes() for p in spec_files(node_dirs)}
    assert len(contents) == 2  # one spec per class: gpu and nic
    for path in contents:
        path.unlink()
    assert kubelet.prepare([ref]) == first
    assert {p: p.read_bytes() for p in spec_files(node_dirs)} == contents


def test_corrupt_checkpoint_is_survived(
    start_agent: StartAgent, make_kubelet: MakeKubelet, claims: Claims, node_dirs: NodeDirs
) -> None:
    node_dirs.plugin.mkdir(parents=True)
    (node_dirs.plugin / "checkpoint.json").write_bytes(b"\x00garbage{")
    start_agent()
    kubelet = make_kubelet()
    ref = claims.create("c", [result("gpu-0")])
    assert kubelet.prepare([ref])[ref["uid"]]["error"] == ""
    assert len(list(node_dirs.plugin.glob("checkpoint.json.corrupt-*"))) == 1
    assert ref["uid"] in json.loads((node_dirs.plugin / "checkpoint.json").read_text())["preparedClaims"]


def test_stale_sockets_are_removed_at_start(start_agent: StartAgent, node_dirs: NodeDirs) -> None:
    node_dirs.plugin.mkdir(parents=True)
    for path in (node_dirs.registry / "fractional.dev-reg.sock", node_dirs.plugin / "dra.sock"):
        with socket.socket(socket.AF_UNIX) as stale:
            stale.bind(str(path))  # the file stays after the close: what a killed agent leaves behind
    start_agent()
    kubelet = KubeletSimulator(node_dirs.registry)
    try:
        assert kubelet.register().service == "v1.DRAPlugin"
        assert kubelet.prepare([]) == {}
    finally:
        kubelet.close()


def test_rolling_update_socket_names_and_lock(
    start_agent: StartAgent, node_dirs: NodeDirs, claims: Claims, make_kubelet: MakeKubelet
) -> None:
    pod_uid = "0f0e0d0c-0b0a-4909-8807-060504030201"
    agent = start_agent(config={"pod_uid": pod_uid, "socket_group": os.getgid()})
    assert agent.paths.registration == node_dirs.registry / f"fractional.dev-{pod_uid}-reg.sock"
    assert agent.paths.dra == node_dirs.plugin / f"dra-{pod_uid}.sock"
    assert stat.S_IMODE(agent.paths.dra.stat().st_mode) == 0o660
    kubelet = make_kubelet()
    assert kubelet.registration is not None and kubelet.registration.endpoint == agent.paths.dra
    ref = claims.create("c", [result("gpu-0")])
    assert kubelet.prepare([ref])[ref["uid"]]["error"] == ""
    assert (node_dirs.plugin / "serialize.lock").exists()


def test_stop_removes_sockets(start_agent: StartAgent, node_dirs: NodeDirs) -> None:
    agent = start_agent()
    assert agent.paths.registration.exists() and agent.paths.dra.exists()
    agent.stop()
    assert not agent.paths.registration.exists() and not agent.paths.dra.exists()
    agent.stop()  # idempotent


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_probes_and_metrics(
    start_agent: StartAgent, node_dirs: NodeDirs, make_kubelet: MakeKubelet, claims: Claims
) -> None:
    agent = start_agent(
        config={"metrics_port": _free_port(), "metrics_host": "127.0.0.1"}, publish_slices=True
    )
    base = f"http://127.0.0.1:{agent.http_port}"
    assert _get(base + "/healthz")[0] == 200
    wait_for(lambda: _get(base + "/readyz")[0] == 200, what="ready after the first slice publish")
    kubelet = make_kubelet()
    assert "registered with the kubelet" in _get(base + "/readyz")[1]
    ref = claims.create("c", [result("gpu-0")])
    assert kubelet.prepare([ref])[ref["uid"]]["error"] == ""
    status, metrics = _get(base + "/metrics")
    assert status == 200
    assert 'fractional_plugin_rpc_seconds_count{method="NodePrepareResources",service="v1"}' in metrics
    assert 'fractional_plugin_claim_operations_total{operation="prepare",result="ok"}' in metrics
    assert _get(base + "/nope")[0] == 404
    agent.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(base + "/healthz", timeout=2)


def test_health_stream(start_agent: StartAgent, node_dirs: NodeDirs, make_kubelet: MakeKubelet) -> None:
    health_file = node_dirs.plugin.parent / "health.json"
    agent = start_agent(config={"health_file": str(health_file), "health_resend_seconds": 30.0})
    kubelet = make_kubelet()
    stream = kubelet.watch_health(timeout=60)
    first = next(stream)
    assert [(d["pool_name"], d["device_name"], d["health"]) for d in first] == [
        ("node-a", "gpu-0", "HEALTHY"),
        ("node-a", "gpu-1", "HEALTHY"),
    ]
    assert {d["health_check_timeout_seconds"] for d in first} == {90}
    health_file.write_text(json.dumps({"gpu-1": {"xid": 79, "message": "GPU has fallen off the bus"}}))
    second = next(stream)  # sent on the change, long before the 30 s resend
    assert [(d["device_name"], d["health"]) for d in second] == [("gpu-0", "HEALTHY"), ("gpu-1", "UNHEALTHY")]
    assert second[1]["message"] == "GPU has fallen off the bus"
    agent.stop()
    assert list(stream) == []  # the stream ends with the agent


def test_refused_first_slice_publish_is_retried(
    start_agent: StartAgent, api_server: Any, kube_configuration: Any
) -> None:
    """A 403 on the first publish (RBAC not bound yet at install time) must not end the publisher
    thread: its loop retries and the slices appear."""
    from kubernetes import client

    api_server.inject_fault(verb="list", resource="resourceslices", status=403, times=1)
    agent = start_agent(publish_slices=True)
    with client.ApiClient(kube_configuration) as api_client:
        api = client.ResourceV1Api(api_client)

        def published() -> list[Any]:
            response = api.list_resource_slice(field_selector="spec.nodeName=node-a", _preload_content=False)
            items: list[Any] = json.loads(response.data)["items"]
            return items

        def retried_and_published() -> bool:  # our own list waits until the agent has met the fault
            return api_server.request_count(verb="list", resource="resourceslices") >= 2 and bool(published())

        assert wait_for(retried_and_published, timeout=20, what="the slices after a refused first publish")
        assert agent.slices_published.wait(20), "readiness must follow the first publish that succeeds"


class _SloppyDRA:
    """A DRA service that answers for the first claim only, plus one it was not asked about."""

    def NodePrepareResources(self, request: Any, context: Any) -> Any:
        from driver.plugin.proto_gen import dra_v1_pb2

        answered = {request.claims[0].uid: dra_v1_pb2.NodePrepareResourceResponse()}
        if len(request.claims) == 1:
            answered["not-asked"] = dra_v1_pb2.NodePrepareResourceResponse()
        return dra_v1_pb2.NodePrepareResourcesResponse(claims=answered)

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        from driver.plugin.proto_gen import dra_v1_pb2

        return dra_v1_pb2.NodeUnprepareResourcesResponse(
            claims={request.claims[0].uid: dra_v1_pb2.NodeUnprepareResourceResponse()}
        )


def test_simulator_rejects_answers_the_kubelet_rejects(node_dirs: NodeDirs) -> None:
    """The simulated kubelet, like the real one, fails a call whose answer skips a requested claim
    or names one it did not ask about (so every test checks that the agent answers for every UID)."""
    from driver.errors import FractionalError
    from driver.plugin.proto_gen import dra_v1_pb2_grpc
    from driver.plugin.registration import RegistrationServicer, RegistrationStatus
    from driver.plugin.server import build_grpc_server, listen_unix

    dra_socket, reg_socket = node_dirs.registry.parent / "dra.sock", node_dirs.registry / "x-reg.sock"
    server = build_grpc_server(max_workers=2)
    dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(_SloppyDRA(), server)  # type: ignore[no-untyped-call]
    pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(  # type: ignore[no-untyped-call]
        RegistrationServicer(endpoint=dra_socket, status=RegistrationStatus()), server
    )
    listen_unix(server, dra_socket, flag="test")
    listen_unix(server, reg_socket, flag="test")
    server.start()
    kubelet = KubeletSimulator(node_dirs.registry)
    try:
        kubelet.register(reg_socket)
        one, two = ({"namespace": "default", "name": n, "uid": f"uid-{n}"} for n in ("one", "two"))
        with pytest.raises(FractionalError, match="NodePrepareResources skipped 1 ResourceClaims"):
            kubelet.prepare([one, two])
        with pytest.raises(FractionalError, match="returned result for unknown claim UID not-asked"):
            kubelet.prepare([one])
        with pytest.raises(FractionalError, match="NodeUnprepareResources skipped 1 ResourceClaims"):
            kubelet.unprepare([one, two])
        assert kubelet.unprepare([one]) == {"uid-one": {"error": ""}}
    finally:
        kubelet.close()
        server.stop(0).wait()

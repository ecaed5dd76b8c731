"""Hostile claims: one tenant's claim never stops the others in the same call.

Everything goes the real way: claims stored in the API emulator (deep ones written as raw JSON, as
kube-apiserver accepts up to 10,000 levels), read by the agent over HTTP, prepared through the
kubelet simulator over gRPC on a unix socket.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import urllib3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes import client

from driver import DRIVER_NAME
from driver.cluster.kubelet import KubeletSimulator
from driver.errors import ConfigError
from driver.plugin.agent import NodeAgent
from driver.plugin.claims import Claim, ClaimReader, ClaimRef
from driver.plugin.dra_service import MAX_ERROR_CHARS
from tests.plugin.conftest import NAMESPACE, NODE, NodeDirs, new_share_id, result

StartAgent = Callable[..., NodeAgent]
MakeKubelet = Callable[..., KubeletSimulator]

_names = itertools.count()
OTHER_NODE = "node-b"
ERROR_LIMIT = MAX_ERROR_CHARS + 100  # an error string the kubelet gets, however big the input


def _selector(node: str) -> dict[str, Any]:
    return {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
    }


class RawClaims:
    """Writes claims as JSON text (the typed client would recurse into a deep body and fail)."""

    def __init__(self, configuration: client.Configuration) -> None:
        self.host = configuration.host
        self.http = urllib3.PoolManager()
        self.api_client = client.ApiClient(configuration)
        self.api = client.ResourceV1Api(self.api_client)

    def close(self) -> None:
        """Close both clients' connections (at the fixture's teardown, not whenever GC runs)."""
        self.http.clear()
        self.api_client.close()

    def create(
        self,
        results: list[dict[str, Any]],
        *,
        parameters_json: str | None = None,
        parameters_driver: str = DRIVER_NAME,
        node: str = NODE,
    ) -> dict[str, str]:
        name = f"h{next(_names)}"
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {
                "devices": {
                    "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.fractional.dev"}}]
                }
            },
        }
        created = self.api.create_namespaced_resource_claim(NAMESPACE, body, _request_timeout=30)
        raw = self.api_client.sanitize_for_serialization(created)
        devices: dict[str, Any] = {"results": results}
        if parameters_json is not None:
            devices["config"] = [
                {
                    "source": "FromClaim",
                    "opaque": {"driver": parameters_driver, "parameters": "__PARAMETERS__"},
                }
            ]
        raw["status"] = {"allocation": {"devices": devices, "nodeSelector": _selector(node)}}
        text = json.dumps(raw)
        if parameters_json is not None:
            text = text.replace('"__PARAMETERS__"', parameters_json)
        answer = self.http.request(
            "PUT",
            f"{self.host}/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/{name}/status",
            body=text.encode(),
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert answer.status == 200, answer.data[:300]
        return {"namespace": NAMESPACE, "name": name, "uid": created.metadata.uid}


@pytest.fixture
def raw_claims(kube_configuration: client.Configuration) -> Iterator[RawClaims]:
    with contextlib.closing(RawClaims(kube_configuration)) as made:
        yield made


@pytest.fixture(scope="module")
def deep_json_stored() -> bool:
    """Whether the API emulator stores JSON nested thousands deep, as kube-apiserver does (up to
    10,000 levels). Probed on an emulator of its own: one that cannot drops the connection."""
    from driver.cluster.apiserver import APIServer

    server = APIServer(host="127.0.0.1", port=0)
    server.start()
    probe = RawClaims(server.configuration())
    try:
        probe.create([result("gpu-0")], parameters_json=deep(3_000))
    except (AssertionError, urllib3.exceptions.HTTPError):
        return False
    finally:
        probe.close()
        server.stop()
    return True


def needs_deep_json(stored: bool) -> None:
    if not stored:
        pytest.skip("the API emulator at this commit cannot store JSON nested 3,000 deep")


def good(raw_claims: RawClaims, device: str = "gpu-0") -> dict[str, str]:
    return raw_claims.create([result(device, share_id=new_share_id(), memory="256Mi")])


def deep(depth: int) -> str:
    return '{"apiVersion":"fractional.dev/v1alpha1","kind":"GpuConfig","x":' + "[" * depth + "]" * depth + "}"


def check_batch(
    kubelet: KubeletSimulator, node_dirs: NodeDirs, goods: list[dict[str, str]], bads: list[dict[str, str]]
) -> dict[str, Any]:
    """One call with every claim: the good ones prepared, each bad one its own bounded error."""
    answer = kubelet.prepare(goods + bads, timeout=60)
    for ref in goods:
        assert answer[ref["uid"]]["error"] == "", answer[ref["uid"]]["error"]
        assert answer[ref["uid"]]["devices"]
    for ref in bads:
        error = answer[ref["uid"]]["error"]
        assert error, f"hostile claim {ref['name'][:40]!r} was prepared"
        assert len(error) <= ERROR_LIMIT
    assert {path.name.rsplit("_", 1)[1][:-5] for path in node_dirs.cdi.glob("*.json")} == {
        ref["uid"] for ref in goods
    }
    return answer


@pytest.mark.parametrize("depth", [100, 2_000, 4_000])
def test_deep_opaque_parameters_fail_only_their_claim(
    start_agent: StartAgent,
    make_kubelet: MakeKubelet,
    raw_claims: RawClaims,
    node_dirs: NodeDirs,
    depth: int,
    deep_json_stored: bool,
) -> None:
    needs_deep_json(deep_json_stored)
    start_agent()
    kubelet = make_kubelet()
    ours = raw_claims.create([result("gpu-1")], parameters_json=deep(depth))
    theirs = raw_claims.create([result("gpu-1")], parameters_json=deep(depth), parameters_driver="other.dev")
    goods = [good(raw_claims), good(raw_claims, "gpu-1")]
    answer = check_batch(kubelet, node_dirs, goods, [ours, theirs])
    assert "nested more than 64 levels deep" in answer[ours["uid"]]["error"]


def test_claim_allocated_for_another_node_is_refused(
    start_agent: StartAgent, make_kubelet: MakeKubelet, raw_claims: RawClaims, node_dirs: NodeDirs
) -> None:
    start_agent()
    kubelet = make_kubelet()
    elsewhere = raw_claims.create([result("gpu-1")], node=OTHER_NODE)  # names this node's pool
    answer = check_batch(kubelet, node_dirs, [good(raw_claims)], [elsewhere])
    assert (
        f"status.allocation.nodeSelector: allocated for another node ({OTHER_NODE}), not {NODE}"
        in (answer[elsewhere["uid"]]["error"])
    )


@pytest.mark.parametrize("size", [300, 1_000_000])
def test_oversized_names_are_not_echoed_whole(
    start_agent: StartAgent,
    make_kubelet: MakeKubelet,
    raw_claims: RawClaims,
    node_dirs: NodeDirs,
    caplog: pytest.LogCaptureFixture,
    size: int,
) -> None:
    start_agent()
    kubelet = make_kubelet()
    huge = [
        {"namespace": NAMESPACE, "name": "n" * size, "uid": "aaaaaaaa-0000-4000-8000-000000000001"},
        {"namespace": "x" * size, "name": "c", "uid": "aaaaaaaa-0000-4000-8000-000000000002"},
        {"namespace": NAMESPACE, "name": "c", "uid": "u" * size},
    ]
    with caplog.at_level(logging.DEBUG):
        check_batch(kubelet, node_dirs, [good(raw_claims)], huge)
    assert max(len(record.getMessage()) + len(str(record.__dict__)) for record in caplog.records) < 10_000


def test_checkpoint_that_is_a_directory_is_a_clear_start_error(
    start_agent: StartAgent, node_dirs: NodeDirs
) -> None:
    (node_dirs.plugin / "checkpoint.json").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"checkpoint.json is a directory, not the checkpoint file"):
        start_agent()


class GatedReader:
    """The real API read, made to wait: every read blocks until ``reads`` have begun (a barrier),
    or until ``release`` is set; ``started`` counts reads that began."""

    def __init__(self, reader: ClaimReader, *, reads: int | None = None) -> None:
        self._reader = reader
        self._barrier = threading.Barrier(reads) if reads else None
        self.release = threading.Event()
        self.started = 0
        self._lock = threading.Lock()

    def read(self, ref: ClaimRef) -> Claim:
        with self._lock:
            self.started += 1
        if self._barrier is not None:
            self._barrier.wait(timeout=20)  # serial reads would break it: the call then fails
        else:
            self.release.wait(timeout=30)
        return self._reader.read(ref)


def test_claims_are_read_concurrently(
    start_agent: StartAgent,
    make_kubelet: MakeKubelet,
    raw_claims: RawClaims,
    kube_configuration: client.Configuration,
) -> None:
    gated = GatedReader(ClaimReader(kube_configuration), reads=4)
    start_agent(claims=gated)
    kubelet = make_kubelet()
    refs = [good(raw_claims) for _ in range(4)]
    answer = kubelet.prepare(refs, timeout=60)
    assert all(answer[ref["uid"]]["error"] == "" for ref in refs)


def test_the_kubelets_deadline_is_honoured(
    start_agent: StartAgent,
    make_kubelet: MakeKubelet,
    raw_claims: RawClaims,
    kube_configuration: client.Configuration,
    node_dirs: NodeDirs,
) -> None:
    gated = GatedReader(ClaimReader(kube_configuration))
    agent = start_agent(claims=gated)
    kubelet = make_kubelet()
    refs = [good(raw_claims) for _ in range(12)]
    with pytest.raises(grpc.RpcError) as raised:
        kubelet.prepare(refs, timeout=3)
    # The agent answered itself, before the kubelet's own deadline, and prepared nothing.
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    assert "deadline passed: read 0 of 12 claims" in raised.value.details()  # type: ignore[attr-defined]
    assert gated.started <= 8  # reads beyond the bounded pool were never started
    gated.release.set()
    answer = kubelet.prepare(refs, timeout=60)  # the retry (reads no longer wait) prepares them all
    assert all(answer[ref["uid"]]["error"] == "" for ref in refs)
    assert agent.state is not None and len(agent.state.prepared_claims()) == 12
    assert len(list(node_dirs.cdi.glob("*.json"))) == 12


# -- the property: hostile claims never cost the good ones -------------------------------------------

HOSTILE_KINDS = (
    "deep ours",
    "deep other driver",
    "huge unicode parameters",
    "unknown parameter key",
    "other node",
    "foreign pool",
    "unknown device",
    "not found",
    "replaced uid",
    "huge name",
    "bad uid",
)

unicode_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40
)  # no lone surrogates: JSON text must be valid UTF-8


def _hostile(raw_claims: RawClaims, kind: str, depth: int, text: str, size: int) -> dict[str, str]:
    gpu = [result("gpu-1", share_id=new_share_id(), memory="256Mi")]
    if kind == "deep ours":
        return raw_claims.create(gpu, parameters_json=deep(depth))
    if kind == "deep other driver":
        return raw_claims.create(gpu, parameters_json=deep(depth), parameters_driver="other.dev")
    if kind == "huge unicode parameters":
        parameters = {"apiVersion": text * (1500 // len(text))}  # the API keeps parameters under 10 KiB
        return raw_claims.create(gpu, parameters_json=json.dumps(parameters, ensure_ascii=False))
    if kind == "unknown parameter key":
        parameters = {"apiVersion": "fractional.dev/v1alpha1", "kind": "GpuConfig", text * 50: 1}
        return raw_claims.create(gpu, parameters_json=json.dumps(parameters, ensure_ascii=False))
    if kind == "other node":
        return raw_claims.create(gpu, node=OTHER_NODE)
    if kind == "foreign pool":
        return raw_claims.create([{**gpu[0], "pool": OTHER_NODE}])
    if kind == "unknown device":
        return raw_claims.create([result("gpu-7", share_id=new_share_id(), memory="256Mi")])
    if kind == "not found":
        return {"namespace": NAMESPACE, "name": f"missing{next(_names)}", "uid": new_share_id()}
    if kind == "replaced uid":
        return {**raw_claims.create(gpu), "uid": new_share_id()}
    if kind == "huge name":
        return {"namespace": NAMESPACE, "name": text * (size // len(text)), "uid": new_share_id()}
    assert kind == "bad uid"
    return {"namespace": NAMESPACE, "name": "c", "uid": text + "\n"}


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    kinds=st.lists(st.sampled_from(HOSTILE_KINDS), min_size=1, max_size=12),
    good_count=st.integers(min_value=1, max_value=12),
    depth=st.integers(min_value=65, max_value=4_500),
    text=unicode_text,
    size=st.sampled_from([100, 5_000, 50_000]),  # up to 12 of them stay under gRPC's 4 MiB
)
def test_hostile_claims_never_stop_the_good_ones(
    start_agent: StartAgent,
    make_kubelet: MakeKubelet,
    raw_claims: RawClaims,
    node_dirs: NodeDirs,
    deep_json_stored: bool,
    kinds: list[str],
    good_count: int,
    depth: int,
    text: str,
    size: int,
) -> None:
    if not deep_json_stored:  # see deep_json_stored: these two kinds need it
        kinds = [kind for kind in kinds if not kind.startswith("deep")] or ["huge name"]
    kubelet = _kubelet(start_agent, make_kubelet)
    goods = [good(raw_claims, f"gpu-{index % 2}") for index in range(good_count)]
    bads = [_hostile(raw_claims, kind, depth, text, size) for kind in kinds]
    bads = list({ref["uid"]: ref for ref in bads}.values())  # "bad uid" may repeat
    check_batch(kubelet, node_dirs, goods, bads)
    answer = kubelet.unprepare(goods + bads, timeout=60)
    assert all(answer[ref["uid"]]["error"] == "" for ref in goods)
    assert list(node_dirs.cdi.glob("*.json")) == []


_current: list[tuple[StartAgent, KubeletSimulator]] = []


def _kubelet(start_agent: StartAgent, make_kubelet: MakeKubelet) -> KubeletSimulator:
    """One agent and kubelet for all the examples of one test run (the fixtures are per test)."""
    if not _current or _current[0][0] is not start_agent:
        _current[:] = [(start_agent, (start_agent(), make_kubelet())[1])]
    return _current[0][1]

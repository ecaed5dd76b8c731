"""The allocation guard's decision on one AdmissionReview (driver/controller/guard/review.py), on a
cache filled as the watchers fill it, and its HTTPS endpoint spoken to as kube-apiserver does."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from driver.controller.guard import GUARD_PATH, AllocationGuard, GuardServer, GuardSettings, ReviewError
from driver.controller.metrics import ControllerMetrics
from driver.controller.model.objects import GangKey
from driver.controller.preemption.preemptor import Nomination, Preemptor
from driver.controller.view.cache import ClusterCache, Kind
from driver.inventory.fake import load_profile, resolve_profile
from driver.slices import build_resource_slices
from tests.controller.conftest import Cluster, gated_pod, gpu_claim, wait_for

NODE = "node-a"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def a_claim(name: str, *, rv: str = "1") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}", "resourceVersion": rv},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": "gpu.fractional.dev"}}]}},
    }  # fmt: skip


def allocated(claim: dict[str, Any], device: str, memory: str, compute: str = "10") -> dict[str, Any]:
    result = {"request": "gpu", "driver": "fractional.dev", "pool": NODE, "device": device,
              "shareID": str(uuid.uuid4()),
              "consumedCapacity": {"memory": memory, "compute": compute}}  # fmt: skip
    return {**claim, "status": {"allocation": {"devices": {"results": [result]}}}}


def review(new: dict[str, Any], old: dict[str, Any] | None = None) -> dict[str, Any]:
    old = old if old is not None else {k: v for k, v in new.items() if k != "status"}
    return {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()), "operation": "UPDATE", "subResource": "status",
            "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
            "userInfo": {"username": "system:kube-scheduler"}, "object": new, "oldObject": old,
        },
    }  # fmt: skip


def answer(body: dict[str, Any]) -> dict[str, Any]:
    response: dict[str, Any] = body["response"]
    return response


@pytest.fixture
def cache() -> ClusterCache:
    cache = ClusterCache(topology_label="topology.kubernetes.io/zone")
    inventory = load_profile(resolve_profile("l4-2x"), node_name=NODE)  # two L4s, 22Gi usable each
    for resource_slice in build_resource_slices(inventory):
        cache.apply(Kind.SLICE, "ADDED", resource_slice)
    for name in "abcx":  # claims that exist, unallocated: the ones reviews are about
        cache.apply(Kind.CLAIM, "ADDED", a_claim(name))
    return cache


def make_guard(cache: ClusterCache, clock: Clock, reads: dict[str, dict[str, Any] | None] | None = None,
               seen: list[str] | None = None) -> AllocationGuard:  # fmt: skip
    def read_claim(namespace: str, name: str) -> dict[str, Any] | None:
        (seen if seen is not None else []).append(f"{namespace}/{name}")
        if reads is None or f"{namespace}/{name}" not in reads:
            raise ConnectionError("no answer")
        return reads[f"{namespace}/{name}"]

    guard = AllocationGuard(cache=cache, metrics=ControllerMetrics(), read_claim=read_claim, clock=clock)
    guard.mark_synced()
    return guard


def test_a_fitting_allocation_is_allowed_and_counted_at_once(cache: ClusterCache) -> None:
    guard = make_guard(cache, Clock())
    first = allocated(a_claim("a"), "gpu-0", "16Gi")
    response = answer(guard.review(review(first)))
    assert response["allowed"] is True
    assert guard.in_flight() == 1  # counted before the apiserver stores it
    second = allocated(a_claim("b"), "gpu-0", "16Gi")
    refused = answer(guard.review(review(second)))
    assert refused["allowed"] is False
    assert refused["status"]["code"] == 403 and refused["status"]["reason"] == "Forbidden"
    assert (
        "ResourceClaim team/b: device fractional.dev/node-a/gpu-0: memory 16Gi asked"
        in refused["status"]["message"]
    )
    assert answer(guard.review(review(allocated(a_claim("c"), "gpu-1", "16Gi"))))["allowed"] is True


def test_the_answer_carries_the_request_uid_and_is_an_admission_review(cache: ClusterCache) -> None:
    guard = make_guard(cache, Clock())
    body = review(allocated(a_claim("a"), "gpu-0", "1Gi"))
    out = guard.review(body)
    assert out["apiVersion"] == "admission.k8s.io/v1" and out["kind"] == "AdmissionReview"
    assert out["response"]["uid"] == body["request"]["uid"]


@pytest.mark.parametrize(
    "body",
    [{}, {"request": "x"}, {"request": {"object": {}}}, [], None],
)
def test_what_is_no_admission_review_is_an_error(cache: ClusterCache, body: Any) -> None:
    with pytest.raises(ReviewError):
        make_guard(cache, Clock()).review(body)


def test_only_a_claim_that_exists_unallocated_is_counted(cache: ClusterCache) -> None:
    """The guard cannot tell kube-apiserver from anyone else who reaches its port: a review about a
    claim that does not exist (or exists under another UID, or is allocated already) is answered
    allowed and counted nowhere; a claim the cache does not know yet is read once."""
    seen: list[str] = []
    guard = make_guard(cache, Clock(), reads={"team/new": a_claim("new"), "team/gone": None}, seen=seen)
    for name in ("gone", "ghost"):  # ghost: the read fails, so kube-apiserver is asked to try again
        out = answer(guard.review(review(allocated(a_claim(name), "gpu-0", "22Gi"))))
        assert out["allowed"] is (name == "gone"), out
    assert seen == ["team/gone", "team/ghost"] and guard.in_flight() == 0
    other_uid = allocated(a_claim("a"), "gpu-0", "22Gi")
    other_uid["metadata"] = {**other_uid["metadata"], "uid": "someone-else"}
    reads = {"team/a": a_claim("a")}
    assert answer(make_guard(cache, Clock(), reads=reads).review(review(other_uid)))["allowed"] is True
    assert answer(guard.review(review(allocated(a_claim("new"), "gpu-0", "22Gi"))))["allowed"] is True
    assert guard.in_flight() == 1  # the claim the cache did not know yet, read and found: counted
    assert answer(guard.review(review(allocated(a_claim("b"), "gpu-0", "1Gi"))))["allowed"] is False


def test_writes_that_set_no_new_allocation_pass_untouched(cache: ClusterCache) -> None:
    guard = make_guard(cache, Clock())
    stored = allocated(a_claim("a", rv="2"), "gpu-0", "22Gi")
    cache.apply(Kind.CLAIM, "MODIFIED", stored)
    reserved = {
        **stored,
        "status": {**stored["status"], "reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]},
    }
    assert answer(guard.review(review(reserved, stored)))["allowed"] is True  # allocation kept as it was
    assert answer(guard.review(review(a_claim("b"))))["allowed"] is True  # no allocation at all
    assert guard.in_flight() == 0


def test_our_own_decision_in_flight_is_allowed_as_it_is(cache: ClusterCache) -> None:
    """Without the chart's matchCondition that leaves our own writes out, they still pass."""
    guard = make_guard(cache, Clock())
    ours = allocated(a_claim("a"), "gpu-0", "22Gi")
    cache.assume_allocations([(a_claim("a"), ours["status"]["allocation"])])
    assert answer(guard.review(review(ours)))["allowed"] is True
    assert guard.in_flight() == 0
    other = answer(guard.review(review(allocated(a_claim("b"), "gpu-0", "1Gi"))))
    assert other["allowed"] is False


def test_before_the_cache_is_synced_every_allocation_waits(cache: ClusterCache) -> None:
    guard = AllocationGuard(cache=cache, metrics=ControllerMetrics())
    out = answer(guard.review(review(allocated(a_claim("a"), "gpu-0", "1Gi"))))
    assert out["allowed"] is False and out["status"]["code"] == 503
    assert "starting" in out["status"]["message"]


def test_a_claim_the_api_shows_gone_does_not_block_the_room_it_freed(cache: ClusterCache) -> None:
    """kube-scheduler saw the deletion before our watch did: the guard reads the claims in the
    way once before it refuses, and counts them as the API has them."""
    stored = allocated(a_claim("a", rv="2"), "gpu-0", "22Gi")
    cache.apply(Kind.CLAIM, "MODIFIED", stored)
    seen: list[str] = []
    guard = make_guard(cache, Clock(), reads={"team/a": None}, seen=seen)
    assert answer(guard.review(review(allocated(a_claim("b"), "gpu-0", "10Gi"))))["allowed"] is True
    assert seen == ["team/a"]
    unallocated = make_guard(cache, Clock(), reads={"team/a": a_claim("a", rv="3")})
    assert answer(unallocated.review(review(allocated(a_claim("c"), "gpu-0", "10Gi"))))["allowed"] is True


def test_a_claim_the_api_still_holds_keeps_its_room_and_a_failed_read_proves_nothing(
    cache: ClusterCache,
) -> None:
    stored = allocated(a_claim("a", rv="2"), "gpu-0", "22Gi")
    cache.apply(Kind.CLAIM, "MODIFIED", stored)
    still = make_guard(cache, Clock(), reads={"team/a": stored})
    assert answer(still.review(review(allocated(a_claim("b"), "gpu-0", "10Gi"))))["allowed"] is False
    unread = make_guard(cache, Clock(), reads={})
    assert answer(unread.review(review(allocated(a_claim("b"), "gpu-0", "10Gi"))))["allowed"] is False


def test_an_admitted_write_never_stored_stops_counting(cache: ClusterCache) -> None:
    clock = Clock()
    guard = make_guard(cache, clock, reads={"team/a": a_claim("a")})  # the API: a has no allocation
    assert answer(guard.review(review(allocated(a_claim("a"), "gpu-0", "20Gi"))))["allowed"] is True
    late = review(allocated(a_claim("b"), "gpu-0", "10Gi"))
    assert answer(guard.review(late))["allowed"] is False  # a moment ago: its write may be on its way
    clock.now += GuardSettings().confirm_after_seconds
    assert answer(guard.review(late))["allowed"] is True  # read once more: never stored, forgotten
    assert guard.in_flight() == 1  # b's


def test_admitted_writes_are_dropped_once_stored_and_forgotten_when_never_stored(cache: ClusterCache) -> None:
    clock = Clock()
    guard = make_guard(cache, clock)
    a = allocated(a_claim("a"), "gpu-0", "20Gi")
    b = allocated(a_claim("b"), "gpu-1", "20Gi")
    assert answer(guard.review(review(a)))["allowed"] and answer(guard.review(review(b)))["allowed"]
    cache.apply(Kind.CLAIM, "MODIFIED", {**a, "metadata": {**a["metadata"], "resourceVersion": "5"}})
    guard.sweep()
    assert guard.in_flight() == 1  # a is stored now; b not yet
    clock.now += GuardSettings().forget_after_seconds + 1
    guard.sweep()
    assert guard.in_flight() == 0
    assert answer(guard.review(review(allocated(a_claim("c"), "gpu-1", "22Gi"))))["allowed"] is True


def test_reviews_are_counted_by_outcome(cache: ClusterCache) -> None:
    guard = make_guard(cache, Clock())
    guard.review(review(allocated(a_claim("a"), "gpu-0", "22Gi")))
    guard.review(review(allocated(a_claim("b"), "gpu-0", "1Gi")))
    registry = guard.metrics.registry
    name = "fractional_controller_allocation_guard_reviews_total"
    assert registry.get_sample_value(name, {"outcome": "allowed"}) == 1
    assert registry.get_sample_value(name, {"outcome": "refused"}) == 1


# -- the HTTPS endpoint -------------------------------------------------------------------------------


def make_certificate(directory: Path) -> Path:
    """A CA and a serving certificate for 127.0.0.1, made with the openssl command; returns the CA."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
            "-days", "1", "-subj", "/CN=guard-test-ca")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr",
            "-subj", "/CN=guard")  # fmt: skip
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:guard.fractional-system.svc\n")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "tls.crt", "-days", "1", "-extfile", "san.ext")  # fmt: skip
    return directory / "ca.crt"


@pytest.fixture
def served(tmp_path: Path, cache: ClusterCache) -> Any:
    ca = make_certificate(tmp_path)
    guard = make_guard(cache, Clock())
    server = GuardServer(host="127.0.0.1", port=0, cert_file=str(tmp_path / "tls.crt"),
                         key_file=str(tmp_path / "tls.key"), review=guard.review)  # fmt: skip
    server.start()
    context = ssl.create_default_context(cafile=str(ca))
    connection = http.client.HTTPSConnection("127.0.0.1", server.port, context=context, timeout=10)
    try:
        yield connection
    finally:
        connection.close()
        server.close()


def post(connection: http.client.HTTPSConnection, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def test_the_endpoint_answers_reviews_over_one_kept_connection(served: http.client.HTTPSConnection) -> None:
    first = review(allocated(a_claim("a"), "gpu-0", "22Gi"))
    status, body = post(served, GUARD_PATH, json.dumps(first).encode())
    assert status == 200 and body["response"] == {"uid": first["request"]["uid"], "allowed": True}
    sock = served.sock
    status, body = post(
        served, GUARD_PATH, json.dumps(review(allocated(a_claim("b"), "gpu-0", "1Gi"))).encode()
    )
    assert status == 200 and body["response"]["allowed"] is False
    assert served.sock is sock  # kept alive, as kube-apiserver's client keeps it


def test_the_endpoint_refuses_what_is_no_review(served: http.client.HTTPSConnection) -> None:
    assert post(served, GUARD_PATH, b"{not json")[0] == 400
    assert post(served, GUARD_PATH, b'{"kind": "AdmissionReview"}')[0] == 400
    assert post(served, "/elsewhere", b"{}")[0] == 404
    deep = b'{"request": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert post(served, GUARD_PATH, deep)[0] == 400  # cut, not a RecursionError


def test_a_client_that_does_not_trust_the_certificate_gets_nothing(
    tmp_path: Path, served: http.client.HTTPSConnection
) -> None:
    port = served.port
    stranger = http.client.HTTPSConnection(
        "127.0.0.1", port, context=ssl.create_default_context(), timeout=10
    )
    try:
        with pytest.raises(ssl.SSLError):
            stranger.request("POST", GUARD_PATH, body=b"{}")
    finally:
        stranger.close()
    assert post(served, GUARD_PATH, json.dumps(review(a_claim("x"))).encode())[0] == 200  # still serving


# -- the controller process serving it ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_controller_serves_the_guard_from_its_own_view(
    cluster: Cluster, controller: Any, tmp_path: Path
) -> None:
    """``fractional controller --allocation-guard-port``: the guard answers from the controller's
    cache once synced; an allocation past a device the controller itself filled is refused."""
    ca = make_certificate(tmp_path)
    cluster.add_node(NODE, "l4-2x")
    cluster.create_claim(gpu_claim("ours", memory="22Gi", compute=None))
    cluster.create_pod(gated_pod("p", ["ours"]))
    port = free_port()
    running = controller(metrics_host="127.0.0.1", allocation_guard_port=port,
                         allocation_guard_cert_dir=str(tmp_path))  # fmt: skip
    wait_for(lambda: cluster.allocated("ours") and cluster.ungated("p"), what="our own placement")
    (result,) = cluster.claim("ours")["status"]["allocation"]["devices"]["results"]
    connection = http.client.HTTPSConnection(
        "127.0.0.1", port, context=ssl.create_default_context(cafile=str(ca)), timeout=10
    )
    try:
        other = cluster.create_claim(gpu_claim("theirs", memory="1Gi", compute=None))
        same_device = allocated(other, result["device"], "1Gi")
        status, body = post(connection, GUARD_PATH, json.dumps(review(same_device)).encode())
        assert status == 200 and body["response"]["allowed"] is False, body
        assert (
            f"device fractional.dev/{NODE}/{result['device']}: memory 1Gi asked"
            in body["response"]["status"]["message"]
        )
        free = "gpu-1" if result["device"] == "gpu-0" else "gpu-0"
        status, body = post(
            connection, GUARD_PATH, json.dumps(review(allocated(other, free, "1Gi"))).encode()
        )
        assert body["response"]["allowed"] is True
    finally:
        connection.close()
    assert running.shutdown() == 0


def test_room_nominated_for_a_preemptor_is_kept_from_lower_priority_pods(cache: ClusterCache) -> None:
    """Our preemptor evicted pods to free a GPU for a gang of priority 1000; kube-scheduler's pod
    (ungated, of lower priority) must not take that room first: nominated devices are held against
    pods of lower or equal priority, as kube-scheduler holds them for its own nominated pods."""
    preemptor = Preemptor(cache=cache, configuration=client.Configuration())
    whole_gpu = allocated(a_claim("urgent"), "gpu-0", "22Gi")["status"]["allocation"]
    preemptor.nominations[GangKey("team/urgent")] = Nomination(
        priority=1000, pod_nodes={"team/urgent-0": NODE}, allocations=((a_claim("urgent"), whole_gpu),),
        victim_pods=frozenset(), victim_claims=(), deadline=float("inf"),
    )  # fmt: skip
    guard = make_guard(cache, Clock())
    guard.holds = preemptor.holding_against
    for name, priority in (("low", 10), ("high", 5000)):
        cache.apply(Kind.POD, "ADDED", {"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": name, "namespace": "team", "uid": f"pod-{name}"},
                    "spec": {"priority": priority, "containers": [{"name": "c", "image": "i"}]}})  # fmt: skip

    def write_for(pod: str, claim: str) -> dict[str, Any]:
        new = allocated(a_claim(claim), "gpu-0", "1Gi")
        new["status"]["reservedFor"] = [{"resource": "pods", "name": pod, "uid": f"pod-{pod}"}]
        return review(new)

    refused = answer(guard.review(write_for("low", "a")))
    assert refused["allowed"] is False and "22Gi of 22Gi already allocated" in refused["status"]["message"]
    assert answer(guard.review(write_for("high", "b")))["allowed"] is True
    assert answer(guard.review(review(allocated(a_claim("c"), "gpu-1", "1Gi"))))["allowed"] is True
    assert cache.state.committed_consumed(("fractional.dev", NODE, "gpu-0")) == {
        "memory": 1 << 30,
        "compute": 10,
    }

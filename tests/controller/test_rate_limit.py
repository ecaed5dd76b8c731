"""driver/kube/ratelimit.py: client-go's token bucket (burst, then qps), one per process, taken by
every request of every client made from the controller's Configuration and by the writers' lean
connection; --kube-api-qps 0 adds nothing. The bucket's arithmetic on a fake clock; its sharing
between threads by the waits it hands out; the clients against the embedded API; the controller
process through its /metrics."""

from __future__ import annotations

import copy
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, watch

from driver.config import ControllerConfig
from driver.controller.loop.run import run_controller
from driver.kube.client import get_json, new_api_client
from driver.kube.ratelimit import RateLimitedApiClient, TokenBucket, attach_rate_limiter, rate_limiter_of
from driver.kube.transport import JsonSender
from tests.controller.conftest import Cluster, T, gated_pod, gpu_claim, wait_for

METRIC = "fractional_controller_kube_api_rate_limiter_duration_seconds"


class FakeClock:
    """A monotonic clock that moves only when told to, or by the bucket's own sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def bucket(qps: float, burst: int, clock: FakeClock, **kwargs: Any) -> TokenBucket:
    return TokenBucket(qps=qps, burst=burst, clock=clock, sleep=clock.sleep, **kwargs)


# -- the bucket ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("qps", "burst"), [(10.0, 5), (50.0, 100), (0.5, 1), (1000.0, 3)])
def test_burst_goes_at_once_then_one_token_per_interval(qps: float, burst: int) -> None:
    clock = FakeClock()
    limiter = bucket(qps, burst, clock)
    assert [limiter.reserve() for _ in range(burst)] == [0.0] * burst
    # Nothing refilled (the clock stands still): each further caller waits one interval more.
    waits = [limiter.reserve() for _ in range(4)]
    assert waits == pytest.approx([(i + 1) / qps for i in range(4)])


def test_refills_at_qps_and_never_beyond_burst() -> None:
    clock = FakeClock()
    limiter = bucket(10.0, 5, clock)
    for _ in range(5):
        limiter.reserve()
    clock.now += 0.3  # three tokens back
    assert [limiter.reserve() for _ in range(4)] == pytest.approx([0.0, 0.0, 0.0, 0.1])
    clock.now += 3600  # an idle hour refills only up to burst
    assert [limiter.reserve() for _ in range(6)] == pytest.approx([0.0] * 5 + [0.1])


def test_wait_sleeps_until_its_token_is_due_and_reports_every_wait() -> None:
    clock = FakeClock()
    observed: list[float] = []
    limiter = bucket(4.0, 2, clock, observe=observed.append)
    assert [limiter.wait() for _ in range(5)] == pytest.approx([0.0, 0.0, 0.25, 0.25, 0.25])
    assert clock.slept == pytest.approx([0.25, 0.25, 0.25])  # one sleep each, no polling
    assert observed == pytest.approx([0.0, 0.0, 0.25, 0.25, 0.25])


@pytest.mark.parametrize(("qps", "burst"), [(0.0, 10), (-1.0, 10), (5.0, 0)])
def test_a_bucket_that_could_not_work_is_refused(qps: float, burst: int) -> None:
    with pytest.raises(ValueError):
        TokenBucket(qps=qps, burst=burst)


def test_threads_share_one_bucket_and_lose_no_token() -> None:
    """Eight threads take 25 tokens each from one bucket on a clock that stands still: every
    token is handed out once, so the waits are exactly 0 (burst times), then 1/qps, 2/qps, ..."""
    clock = FakeClock()
    waits: list[float] = []
    lock = threading.Lock()
    limiter = TokenBucket(qps=20.0, burst=10, clock=clock, sleep=lambda _seconds: None)
    start = threading.Barrier(8)

    def take() -> None:
        start.wait()
        for _ in range(25):
            delay = limiter.wait()
            with lock:
                waits.append(delay)

    threads = [threading.Thread(target=take, name=f"taker-{i}") for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(T)
    assert sorted(waits) == pytest.approx([0.0] * 10 + [(i + 1) / 20.0 for i in range(190)])


def test_threads_together_stay_within_qps_on_the_real_clock() -> None:
    """Lower bound only (a loaded machine is slower, never faster): 4 threads x 15 requests with
    burst 10 at 100 qps cannot all be through in less than 50 / 100 s."""
    limiter = TokenBucket(qps=100.0, burst=10)
    began = time.monotonic()
    threads = [
        threading.Thread(target=lambda: [limiter.wait() for _ in range(15)], name=f"sender-{i}")
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(T)
    assert time.monotonic() - began >= 0.5 - 0.02  # the clock's own granularity


def test_a_copied_configuration_shares_the_bucket() -> None:
    configuration = client.Configuration()
    limiter = TokenBucket(qps=5.0, burst=1)
    attach_rate_limiter(configuration, limiter)
    assert rate_limiter_of(copy.deepcopy(configuration)) is limiter
    assert rate_limiter_of(copy.copy(configuration)) is limiter


# -- the clients, against the embedded API ------------------------------------------------------


@pytest.fixture
def counted(kube_configuration: client.Configuration) -> Iterator[tuple[client.Configuration, list[float]]]:
    """The emulator's Configuration with a bucket that never makes anyone wait; the list gets one
    entry per token taken."""
    taken: list[float] = []
    attach_rate_limiter(kube_configuration, TokenBucket(qps=1.0, burst=10_000, observe=taken.append))
    yield kube_configuration, taken


def test_without_a_limit_the_plain_client_is_used(kube_configuration: client.Configuration) -> None:
    """qps 0: run_controller attaches nothing, and nothing is added to a request."""
    with new_api_client(kube_configuration) as api_client:
        assert type(api_client) is client.ApiClient
        sender = JsonSender(api_client)
        assert sender._limiter is None
        sender.close()


def test_every_request_of_new_api_client_takes_a_token(
    counted: tuple[client.Configuration, list[float]],
) -> None:
    configuration, taken = counted
    with new_api_client(configuration) as api_client:
        assert isinstance(api_client, RateLimitedApiClient)
        core = client.CoreV1Api(api_client)
        core.list_namespace(_request_timeout=10)
        assert len(taken) == 1
        core.create_namespaced_config_map("default", {"metadata": {"name": "typed"}}, _request_timeout=10)
        get_json(api_client, "/api/v1/namespaces/default/configmaps/typed", what="get configmap")
        core.read_namespaced_config_map(
            "typed", "default", _preload_content=False, _request_timeout=10
        ).read()
        assert len(taken) == 4


def test_a_watch_takes_a_token_to_start_not_per_event(
    counted: tuple[client.Configuration, list[float]],
) -> None:
    configuration, taken = counted
    with new_api_client(configuration) as api_client:
        core = client.CoreV1Api(api_client)
        for name in ("w-1", "w-2", "w-3"):
            core.create_namespaced_config_map("default", {"metadata": {"name": name}}, _request_timeout=10)
        before = len(taken)
        stream = watch.Watch()
        events = []
        for event in stream.stream(core.list_namespaced_config_map, "default", timeout_seconds=5):
            events.append(event)
            if len(events) == 3:
                stream.stop()
        assert len(events) == 3
        assert len(taken) == before + 1


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "rest-layer"])
def test_json_sender_takes_one_token_per_write_on_either_path(
    counted: tuple[client.Configuration, list[float]], lean: bool
) -> None:
    configuration, taken = counted
    if not lean:
        configuration.socket_options = []  # a setting the lean connection does not reproduce
    path = "/api/v1/namespaces/{namespace}/configmaps"
    # From new_api_client (the controller's way) and from a plain client: one token either way,
    # never two (the client's call_api and the sender would both take one).
    for index, api_client in enumerate((new_api_client(configuration), client.ApiClient(configuration))):
        with api_client:
            sender = JsonSender(api_client)
            assert sender._lean is lean
            before = len(taken)
            body = {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": f"sent-{int(lean)}-{index}"},
            }
            sender.send_json("POST", path, {"namespace": "default"}, body, what="create configmap")
            sender.close()
            assert len(taken) == before + 1


# -- the controller process ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _metric(port: int, name: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


@pytest.mark.parametrize(("qps", "burst"), [(5.0, 2), (0.0, 100)], ids=["limited", "unlimited"])
def test_the_controller_paces_its_requests_and_reports_the_waits(
    cluster: Cluster, qps: float, burst: int
) -> None:
    """``fractional controller --kube-api-qps 5 --kube-api-burst 2``: its start (a list and a watch
    per kind) already waits for tokens, it still places a pod, and /metrics shows the waits; with
    --kube-api-qps 0 nothing is counted at all."""
    cluster.add_node("node-a", "l4-2x")
    cluster.create_claim(gpu_claim("paced", memory="6Gi", compute=20))
    cluster.create_pod(gated_pod("paced", ["paced"]))
    port = _free_port()
    config = ControllerConfig(
        kubeconfig=str(cluster.kubeconfig), metrics_port=port, metrics_host="127.0.0.1",
        kube_api_qps=qps, kube_api_burst=burst,
    )  # fmt: skip
    stop, started, result = threading.Event(), threading.Event(), []
    thread = threading.Thread(
        target=lambda: result.append(run_controller(config, stop, started=started)),
        name="test-controller-paced", daemon=True,
    )  # fmt: skip
    thread.start()
    try:
        wait_for(lambda: cluster.ungated("paced"), timeout=2 * T, what="the pod placed")
        count = _metric(port, METRIC + "_count")
        waited = _metric(port, METRIC + "_sum")
        assert count is not None and waited is not None
        if qps:
            assert count > burst and waited > 0
        else:
            assert count == 0 and waited == 0
    finally:
        stop.set()
        thread.join(T)
    assert not thread.is_alive() and result == [0]

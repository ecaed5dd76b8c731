"""The Lease elector, step by step with a fake clock, against the API emulator."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from kubernetes import client

from driver.cluster.apiserver import APIServer
from driver.config import ControllerConfig
from driver.controller.loop.elector import LeaderElector
from driver.controller.loop.run import run_controller
from driver.controller.model.objects import GATE
from driver.controller.writes.writer import ApiWriter, HaltWrites
from driver.errors import ConfigError

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)

LEASE = ControllerConfig().lease_name


class FakeClock:
    def __init__(self) -> None:
        self.seconds = 1000.0

    def monotonic(self) -> float:
        return self.seconds

    def now(self) -> datetime:
        return datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=self.seconds)


@pytest.fixture
def api_client(api_server: APIServer) -> Iterator[client.ApiClient]:
    with client.ApiClient(api_server.configuration()) as api_client:
        yield api_client


def _elector(
    api_client: client.ApiClient, identity: str, clock: FakeClock, name: str = "lease"
) -> LeaderElector:
    return LeaderElector(
        api_client=api_client, name=name, namespace="default", identity=identity,
        lease_duration_seconds=15, renew_deadline_seconds=10, retry_period_seconds=2, clock=clock,
    )  # fmt: skip


def test_one_leader_takeover_only_after_expiry_and_release(api_client: client.ApiClient) -> None:
    clock_a, clock_b = FakeClock(), FakeClock()
    a, b = _elector(api_client, "a", clock_a), _elector(api_client, "b", clock_b)
    assert a.step() is True  # creates the lease
    assert b.step() is False  # held by a
    clock_a.seconds += 10
    clock_b.seconds += 10
    assert a.step() is True  # a renews
    assert b.step() is False  # b saw a new record: its timer restarts
    clock_b.seconds += 14
    assert b.step() is False  # 14 s < 15 s since b last saw the record change
    clock_b.seconds += 2
    assert b.step() is True  # a stopped renewing for longer than the lease: b takes over
    lease = client.CoordinationV1Api(api_client).read_namespaced_lease("lease", "default")
    assert lease.spec.holder_identity == "b"
    assert lease.spec.lease_transitions == 1
    # a notices it can no longer renew; after the renew deadline it counts as lost
    a.leading.set()
    assert a.step() is False
    clock_a.seconds += 11
    assert a.renew_overdue()
    # b releases on a clean stop: a takes over at once, without waiting for expiry
    b.leading.set()
    b.release()
    assert a.step() is True


def test_the_leader_publishes_with_its_renewals_and_a_successor_reads_what_it_took_over(
    api_client: client.ApiClient,
) -> None:
    """The controller's holds ride on the Lease: written by the holder's renewals only, kept as they
    are through a takeover, read by the successor, and written once more on a clean release."""
    clock_a, clock_b = FakeClock(), FakeClock()
    a, b = _elector(api_client, "a", clock_a), _elector(api_client, "b", clock_b)
    key = "fractional.dev/holds"
    published: dict[str, str | None] = {key: "held by a"}
    a.publish = lambda: published
    assert a.step() is True  # created: nothing published yet (a created it, renewals publish)
    assert a.annotation(key) == ""
    assert a.step() is True
    assert a.annotation(key) == "held by a"
    published[key] = None  # None: left as it is
    assert a.step() is True
    assert a.annotation(key) == "held by a"
    b.publish = lambda: {key: "b has nothing yet"}
    assert b.step() is False
    clock_b.seconds += 16
    assert b.step() is True  # a stopped renewing: b takes over, and keeps what a published
    assert b.annotation(key) == "held by a"
    b.publish = lambda: {key: "held by b"}
    assert b.step() is True
    assert b.annotation(key) == "held by b"
    b.publish = lambda: {key: "b's last word"}
    b.leading.set()
    b.release()
    leases = client.CoordinationV1Api(api_client)
    lease = json.loads(leases.read_namespaced_lease("lease", "default", _preload_content=False).data)
    assert lease["metadata"]["annotations"][key] == "b's last word"
    assert a.step() is True  # released: a takes it over at once, and reads b's last word
    assert a.annotation(key) == "b's last word"
    a.publish = lambda: {key: ""}  # "": removed
    assert a.step() is True
    assert a.annotation(key) == ""


def test_writer_behind_a_set_fence_sends_nothing(api_server: APIServer, api_client: client.ApiClient) -> None:
    fence = threading.Event()
    writer = ApiWriter(api_client, fence=fence)
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "x"}}]}},
    }
    stored = json.loads(
        client.ResourceV1Api(api_client)
        .create_namespaced_resource_claim("default", claim, _preload_content=False)
        .data
    )
    fence.set()
    api_server.reset_counts()
    try:
        with pytest.raises(HaltWrites):
            writer.write_allocation(stored, {"devices": {"results": []}})
        with pytest.raises(HaltWrites):
            writer.ungate_pod({"metadata": {"name": "p", "namespace": "default"},
                               "spec": {"schedulingGates": [{"name": GATE}]}})  # fmt: skip
    finally:
        writer.close()
    assert api_server.request_count("update") == 0
    assert api_server.request_count("patch") == 0


@dataclass
class _Replica:
    started: threading.Event  # set each time it leads and its controller runs
    result: list[int]  # run_controller's return value, once it has returned
    thread: threading.Thread


@contextlib.contextmanager
def _replica_a(kubeconfig_file: Path, clock: FakeClock, **timings: float) -> Iterator[_Replica]:
    """``run_controller`` as replica "a" with leader election and these lease timings, in a thread;
    told to stop (and joined) on the way out."""
    config = ControllerConfig(
        kubeconfig=str(kubeconfig_file), metrics_port=0, leader_elect=True, identity="a", **timings
    )  # type: ignore[arg-type]
    stop, started, result = threading.Event(), threading.Event(), []
    thread = threading.Thread(
        target=lambda: result.append(run_controller(config, stop, clock=clock, started=started)),
        name="test-controller",
        daemon=True,
    )
    thread.start()
    try:
        yield _Replica(started, result, thread)
    finally:
        stop.set()
        thread.join(20)


def test_a_leader_past_its_renew_deadline_stands_down_in_place_and_leads_again_when_the_lease_is_still_its(
    api_client: client.ApiClient, kubeconfig_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The elector's next round is 20 s away (as if it were blocked on a slow API); its clock says the
    # last renewal is older than the renew deadline, so a successor may soon take over: the replica
    # stops its term at once, without waiting for the elector, and does not exit. Nobody else took
    # the lease (as when kube-apiserver itself was away), so it renews it and leads again.
    clock = FakeClock()
    timings = {"lease_duration_seconds": 30, "renew_deadline_seconds": 25, "retry_period_seconds": 20}
    with _replica_a(kubeconfig_file, clock, **timings) as a:
        assert a.started.wait(20), "never became leader"
        a.started.clear()
        with caplog.at_level("WARNING", logger="driver.controller.loop.run"):
            clock.seconds += 26
            assert a.started.wait(20), "did not lead again"
        assert any("standing down" in r.getMessage() for r in caplog.records)
        assert a.thread.is_alive() and a.result == [], "the process ended instead of standing down"
        lease = client.CoordinationV1Api(api_client).read_namespaced_lease(LEASE, "default")
        assert lease.spec.holder_identity == "a"
        assert lease.spec.lease_transitions == 0
    assert a.result == [0]


def test_a_replica_that_lost_its_lease_to_another_waits_as_a_candidate_and_takes_over_on_release(
    api_client: client.ApiClient, kubeconfig_file: Path
) -> None:
    clock = FakeClock()
    timings = {"lease_duration_seconds": 3, "renew_deadline_seconds": 2, "retry_period_seconds": 0.5}
    b = _elector(api_client, "b", FakeClock(), name=LEASE)
    with _replica_a(kubeconfig_file, clock, **timings) as a:
        assert a.started.wait(20), "never became leader"
        a.started.clear()
        # b takes the lease over (as if b's clock had seen a's lease run out), then a's clock passes
        # its renew deadline: a stands down and, b's lease being fresh, waits as a candidate.
        client.CoordinationV1Api(api_client).patch_namespaced_lease(
            LEASE, "default", {"spec": {"holderIdentity": "b", "leaseDurationSeconds": 3600}}
        )
        clock.seconds += 5
        assert not a.started.wait(3), "led again while b holds a fresh lease"
        assert a.thread.is_alive() and a.result == []
        b.leading.set()
        b.step()  # b renews, then releases on a clean stop: a takes over at once
        b.release()
        assert a.started.wait(20), "did not take over after b released the lease"
    assert a.result == [0]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"renew_deadline_seconds": 15.0}, "renew_deadline_seconds"),
        ({"retry_period_seconds": 10.0}, "retry_period_seconds"),
        ({"lease_duration_seconds": 0.0}, "lease_duration_seconds"),
    ],
)
def test_lease_timings_that_allow_two_leaders_are_rejected(overrides: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ControllerConfig(**overrides)  # type: ignore[arg-type]


def test_an_unexpected_error_in_a_lease_round_does_not_end_the_elector(api_client: client.ApiClient) -> None:
    """A bug in one round (not a FractionalError) is logged and the next round runs: a replica must
    never be left waiting forever for a leadership its elector thread stopped trying to get."""
    elector = LeaderElector(
        api_client=api_client, name="lease", namespace="default", identity="a",
        lease_duration_seconds=15, renew_deadline_seconds=10, retry_period_seconds=0.01,
    )  # fmt: skip
    real_step = elector.step
    calls = {"n": 0}

    def flaky_step() -> bool:
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyError("spec")  # e.g. an unexpected Lease body
        return real_step()

    elector.step = flaky_step  # type: ignore[method-assign]
    stop = threading.Event()
    thread = threading.Thread(target=elector.run, args=(stop,), daemon=True)
    thread.start()
    try:
        assert elector.leading.wait(10), "the elector gave up after one failed round"
    finally:
        stop.set()
        thread.join(5)
    assert calls["n"] >= 2

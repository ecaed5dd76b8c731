"""The Lease elector, step by step with a fake clock, against the API emulator."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from kubernetes import client

from driver.controller.elector import LeaderElector
from driver.kube.emulator import APIServer


class FakeClock:
    def __init__(self) -> None:
        self.seconds = 1000.0

    def monotonic(self) -> float:
        return self.seconds

    def now(self) -> datetime:
        return datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=self.seconds)


def _elector(api_client: client.ApiClient, identity: str, clock: FakeClock) -> LeaderElector:
    return LeaderElector(
        api_client=api_client, name="lease", namespace="default", identity=identity,
        lease_duration_seconds=15, renew_deadline_seconds=10, retry_period_seconds=2, clock=clock,
    )  # fmt: skip


def test_one_leader_takeover_only_after_expiry_and_release(api_server: APIServer) -> None:
    api_client = client.ApiClient(api_server.configuration())
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
    api_client.close()

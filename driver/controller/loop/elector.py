"""Leader election on a ``coordination.k8s.io/v1`` Lease: small, stoppable, with an injected clock.

Semantics follow client-go's resourcelock: a candidate takes the lease when it has no holder or
when the record it observed has not changed for ``leaseDurationSeconds`` *by the candidate's own
monotonic clock* (no trust in other machines' wall clocks); the leader renews every
``retry_period`` and gives up when no renewal succeeded within ``renew_deadline``. Every write
carries the lease's resourceVersion, so two candidates never both win one round. On a clean stop
the leader releases the lease (holder cleared, duration 1 s) so a successor starts at once.

The leader may publish text in an annotation of the Lease with each renewal (``publish``: the
controller's holds, ``driver/controller/preemption/holds.py``); a successor reads it as it takes the
Lease over (``annotation``). Taking over never changes it: only a renewal by the new holder does, once
its ``publish`` gives text.

A replica that loses the lease does not exit (client-go's callers do): ``lost`` is set, the owner
fences its writes and stops what it ran, then calls ``rejoin()`` and the replica is a candidate
again. When the whole API was away (a kube-apiserver restart), nobody else could take the lease
meanwhile, so the same replica renews it as soon as the API answers, with a fresh view; a process
restart would only have added its start-up time.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

from kubernetes import client

from driver.errors import ConflictError, FractionalError, NotFoundError
from driver.kube import REQUEST_TIMEOUT_SECONDS, api_errors
from driver.kube.transport import JsonSender

__all__ = ["Clock", "LeaderElector", "SystemClock"]

log = logging.getLogger(__name__)


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def now(self) -> datetime: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return datetime.now(UTC)


_LEASES = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
_LEASE = _LEASES + "/{name}"


def _micro_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _record(lease: dict[str, Any]) -> tuple[Any, ...]:
    """What a candidate watches for change: any write (a renewal too) bumps the resourceVersion."""
    spec = lease.get("spec") or {}
    version = (lease.get("metadata") or {}).get("resourceVersion")
    return (spec.get("holderIdentity"), spec.get("renewTime"), version)


class LeaderElector:
    """``step()`` is one acquire-or-renew round (tests drive it with a fake clock); ``run()`` loops it
    on the calling thread until ``stop`` or until leadership is lost."""

    def __init__(
        self,
        *,
        api_client: client.ApiClient,
        name: str,
        namespace: str,
        identity: str,
        lease_duration_seconds: float,
        renew_deadline_seconds: float,
        retry_period_seconds: float,
        clock: Clock | None = None,
    ) -> None:
        self._api: Any = client.CoordinationV1Api(api_client)  # Any: raw JSON reads (_preload_content=False)
        # Writes go as JSON, as written: the typed client methods coerce a dict body into their
        # model and write times back with isoformat(), which drops a zero microsecond part, and
        # kube-apiserver refuses a MicroTime without one (seen on the real apiserver).
        self._sender = JsonSender(api_client)
        self.name = name
        self._path_params = {"namespace": namespace, "name": name}
        self.namespace = namespace
        self.identity = identity
        self._lease_duration_seconds = lease_duration_seconds
        self._renew_deadline_seconds = renew_deadline_seconds
        self._retry_period_seconds = retry_period_seconds
        self._clock: Clock = clock or SystemClock()
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self._last_renew: float | None = None
        self._lease: dict[str, Any] | None = None
        # Called on each renewal: the text for each annotation it names, "" to remove one, or None
        # for one to leave as it is. Set by the term that leads, cleared when it stands down.
        self.publish: Callable[[], Mapping[str, str | None]] | None = None
        self.leading = threading.Event()
        self.lost = threading.Event()  # set on a loss; no round runs until the owner calls rejoin()
        self._wake = threading.Event()  # ends the wait between two rounds early (rejoin, stop)

    # -- one round ------------------------------------------------------------------------------------

    def _read(self) -> dict[str, Any] | None:
        try:
            with api_errors(f"get Lease {self.namespace}/{self.name}"):
                response = self._api.read_namespaced_lease(
                    self.name,
                    self.namespace,
                    _preload_content=False,
                    _request_timeout=REQUEST_TIMEOUT_SECONDS,
                )
        except NotFoundError:
            return None
        lease: dict[str, Any] = json.loads(response.data)
        return lease

    def _spec(self, previous: dict[str, Any]) -> dict[str, Any]:
        now = _micro_time(self._clock.now())
        ours = previous.get("holderIdentity") == self.identity
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, math.ceil(self._lease_duration_seconds)),
            "acquireTime": previous.get("acquireTime") if ours and previous.get("acquireTime") else now,
            "renewTime": now,
            "leaseTransitions": int(previous.get("leaseTransitions") or 0) + (0 if ours else 1),
        }

    def step(self) -> bool:
        """Try to acquire or renew once; True when we hold the lease afterwards."""
        now = self._clock.monotonic()
        lease = self._read()
        what = f"Lease {self.namespace}/{self.name}"
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {**self._spec({}), "leaseTransitions": 0},
            }
            try:
                data = self._sender.send_json(
                    "POST", _LEASES, {"namespace": self.namespace}, body, what=f"create {what}"
                )
            except ConflictError:
                return False  # another candidate created it first
            return self._won(json.loads(data), now)
        spec = lease.get("spec") or {}
        record = _record(lease)
        if record != self._observed:
            self._observed, self._observed_at = record, now
        holder = spec.get("holderIdentity")
        duration = float(spec.get("leaseDurationSeconds") or self._lease_duration_seconds)
        if holder and holder != self.identity and self._observed_at + duration > now:
            return False
        body = copy.deepcopy(lease)
        body["spec"] = self._spec(spec)
        if holder == self.identity:  # a renewal: a takeover keeps what the last holder published
            self._published(body)
        try:
            data = self._sender.send_json("PUT", _LEASE, self._path_params, body, what=f"update {what}")
        except ConflictError:
            return False
        return self._won(json.loads(data), now)

    def _won(self, lease: dict[str, Any], now: float) -> bool:
        self._lease = lease
        self._observed = _record(lease)
        self._observed_at = now
        self._last_renew = now
        return True

    def _published(self, body: dict[str, Any]) -> None:
        publish = self.publish
        if publish is None:
            return
        try:
            texts = publish()
        except Exception:  # the renewal matters more than what rides on it
            log.exception("nothing published with the lease", extra={"lease": self.name})
            return
        metadata = body.setdefault("metadata", {})
        annotations = dict(metadata.get("annotations") or {})
        for key, text in texts.items():
            if text:
                annotations[key] = text
            elif text is not None:
                annotations.pop(key, None)
        metadata["annotations"] = annotations

    def annotation(self, key: str) -> str:
        """The annotation as the lease was when this replica last wrote it ("" when absent); read as
        the lease is taken over, it is what the last holder published."""
        lease = self._lease or {}
        return str(((lease.get("metadata") or {}).get("annotations") or {}).get(key) or "")

    def renew_overdue(self) -> bool:
        """True when we led and no renewal has succeeded within the renew deadline."""
        return (
            self._last_renew is not None
            and self._clock.monotonic() - self._last_renew > self._renew_deadline_seconds
        )

    # -- the loop -------------------------------------------------------------------------------------

    def run(self, stop: threading.Event, on_lost: Callable[[], None] | None = None) -> None:
        """Acquire, then renew every retry period, until ``stop``. On a missed renew deadline:
        ``step_down()`` (``lost`` set, ``on_lost`` called), then no round until ``rejoin()``."""
        while not stop.is_set():
            if self.lost.is_set():
                self._pause()
                continue
            try:
                held = self.step()
            except FractionalError as error:  # 5xx, refused, or rejected: keep trying until the deadline
                log.warning("lease round failed", extra={"lease": self.name, "error": str(error)})
                held = False
            except Exception:  # the loop's one catch-all: a bug must not leave a replica waiting forever
                log.exception("lease round failed unexpectedly", extra={"lease": self.name})
                held = False
            if held and not self.leading.is_set() and not self.lost.is_set():
                log.info("became leader", extra={"lease": self.name, "identity": self.identity})
                self.leading.set()
            if self.leading.is_set() and not held and self.renew_overdue():
                self.step_down("no renewal within the renew deadline")
                if on_lost is not None:
                    on_lost()
            self._pause()

    def _pause(self) -> None:
        self._wake.wait(self._retry_period_seconds)
        self._wake.clear()

    def step_down(self, why: str) -> None:
        """Leadership is lost (the owner or the elector saw the deadline pass): stop leading, run no
        round until ``rejoin()``. Idempotent."""
        if self.lost.is_set():
            return
        log.error("leadership lost", extra={"lease": self.name, "identity": self.identity, "reason": why})
        self.leading.clear()
        self._last_renew = None
        self.lost.set()

    def rejoin(self) -> None:
        """The owner has stopped all it ran as leader: be a candidate again, at once."""
        self.lost.clear()
        self._wake.set()

    def wake(self) -> None:
        """End the current wait between two rounds (after ``stop`` is set: return promptly)."""
        self._wake.set()

    def release(self) -> None:
        """Give the lease up if we hold it (clean stop)."""
        if not self.leading.is_set() or self._lease is None:
            return
        self.leading.clear()
        try:
            lease = self._read()
        except FractionalError as error:  # the API is away: the lease expires on its own
            log.warning("lease not released", extra={"lease": self.name, "error": str(error)})
            return
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
            return
        body = copy.deepcopy(lease)
        self._published(body)  # the last word, for the successor
        now = _micro_time(self._clock.now())
        body["spec"] = {
            "leaseDurationSeconds": 1,
            "acquireTime": now,
            "renewTime": now,
            "leaseTransitions": int((lease.get("spec") or {}).get("leaseTransitions") or 0),
        }
        try:
            self._sender.send_json(
                "PUT", _LEASE, self._path_params, body, what=f"release Lease {self.namespace}/{self.name}"
            )
            log.info("lease released", extra={"lease": self.name, "identity": self.identity})
        except FractionalError as error:  # a conflict, or the API away: it expires on its own
            log.warning("lease not released", extra={"lease": self.name, "error": str(error)})

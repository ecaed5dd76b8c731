"""The allocation guard's decision: one admission review of an allocation another allocator wrote.

kube-scheduler allocates the claims of pods that do not carry our scheduling gate, from the same
devices, at the same time as we do; each decides on its own view, and nothing in the API orders
two writes to two different claims. The apiserver calls this guard (a validating webhook on
``resourceclaims/status``) before it stores such an allocation, and the guard answers under the
controller's ``cache.lock``, the lock our own decider holds while it decides and assumes. So every
allocation of our devices is checked against every other one admitted or decided before it:

- a write that fits (``check_booking`` against what the cache counts: stored allocations, ours
  in flight, and the others admitted here and not yet seen stored) is allowed and assumed into the
  cache at once, so that our next decision counts it;
- a write that would book a device past its capacity is refused (HTTP 403, the devices and figures
  in the message); kube-scheduler then un-reserves the pod and tries it again after its backoff,
  from a view that holds the allocation that came first.

Before refusing, the guard reads the claims that stand in the way once (a claim deleted or
deallocated a moment ago, which kube-scheduler saw before our watch did, must not block the room it
freed), and counts those as the API has them.

An admitted write that never shows up stored (refused later by another admission step, or the
request failed) would hold its room: it is not counted against another write once it is
``confirm_after_seconds`` old and the API shows no such allocation, and it is forgotten after
``forget_after_seconds`` in any case.

The guard cannot tell kube-apiserver from anyone else who reaches its port, so what a review can
make it count is bounded: only a claim that exists, unallocated, with the review's UID (the cache,
else one read of the API) is counted, one allocation per claim, for at most
``forget_after_seconds``. A review about any other claim is answered "allowed" and counted nowhere
(the apiserver would store nothing for it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from driver.allocator import Overbooking, check_booking
from driver.controller.metrics import ControllerMetrics
from driver.controller.model.decode import bounded
from driver.controller.model.objects import object_key
from driver.controller.view.cache import ClusterCache, Kind

__all__ = ["AllocationGuard", "GuardSettings", "ReviewError"]

log = logging.getLogger(__name__)

ClaimReader = Callable[[str, str], "dict[str, Any] | None"]  # (namespace, name) -> the claim, None: gone
# The devices held for preemptors of at least this priority, counted as taken inside the block.
Holds = Callable[[int], AbstractContextManager[None]]
SLOW_REVIEW_SECONDS = 1.0  # said in the log (the chart's webhook waits 10 s at most)
MAX_CONFIRM_READS = 16  # claims read before a refusal (each a GET; the apiserver waits for us)


class ReviewError(ValueError):
    """The request is no AdmissionReview this guard can answer (the server answers 400)."""


@dataclass(frozen=True, slots=True)
class GuardSettings:
    confirm_after_seconds: float = 2.0
    forget_after_seconds: float = 10.0
    confirm_budget_seconds: float = 0.5  # the reads before a refusal, side by side, all within this


@dataclass
class _Admitted:
    version: dict[str, Any]  # what the cache assumed (identity matters: see forget_assumed_version)
    at: float


def _results(allocation: Mapping[str, Any] | None) -> set[tuple[str, str, str, str]]:
    """(driver, pool, device, shareID) of each result: two allocations are the same when these are."""
    devices = (allocation or {}).get("devices") or {}
    return {
        tuple(str(r.get(name, "")) for name in ("driver", "pool", "device", "shareID"))  # type: ignore[misc]
        for r in devices.get("results") or ()
        if isinstance(r, Mapping)
    }


def _devices(version: Mapping[str, Any] | None) -> set[tuple[str, str, str]]:
    return {r[:3] for r in _results(_allocation(version))}


def _allocation(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, Mapping):
        return None
    status = obj.get("status")
    allocation = status.get("allocation") if isinstance(status, Mapping) else None
    return dict(allocation) if isinstance(allocation, Mapping) and allocation else None


def _response(
    uid: str, allowed: bool, *, code: int = 200, reason: str = "", message: str = ""
) -> dict[str, Any]:
    answer: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if not allowed:
        answer["status"] = {"code": code, "reason": reason, "message": message}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": answer}


def _unallocated(claim: Mapping[str, Any] | None, uid: str) -> bool:
    """``claim`` exists with this UID and holds no allocation."""
    if claim is None or not uid:
        return False
    return str((claim.get("metadata") or {}).get("uid") or "") == uid and _allocation(claim) is None


def _stands(current: Mapping[str, Any] | None, counted: Mapping[str, Any]) -> bool:
    """Does the claim as the API holds it (``current``; None: gone) still hold what we count?"""
    if current is None:
        return False
    if _results(_allocation(current)) == _results(_allocation(counted)):
        return True  # as counted
    same_claim = (current.get("metadata") or {}).get("uid") == (counted.get("metadata") or {}).get("uid")
    return not same_claim and _allocation(current) is not None  # a new claim of that name, allocated


@dataclass
class AllocationGuard:
    cache: ClusterCache
    metrics: ControllerMetrics
    read_claim: ClaimReader | None = None  # None: refuse on the cache's view alone
    holds: Holds | None = None  # None: no preemptor, nothing held
    settings: GuardSettings = field(default_factory=GuardSettings)
    clock: Callable[[], float] = time.monotonic
    _synced: bool = False
    _lock_waited: float = 0.0  # the last review's waits for cache.lock (for the slow-review log line)
    _read_seconds: float = 0.0  # and its reads of claims in the way
    _admitted: dict[str, _Admitted] = field(default_factory=dict)  # under cache.lock
    _readers: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(
            max_workers=MAX_CONFIRM_READS, thread_name_prefix="guard-read"
        )
    )

    def close(self) -> None:
        self._readers.shutdown(wait=False, cancel_futures=True)

    def mark_synced(self) -> None:
        """The cache holds a complete view: from now on reviews are answered, not deferred."""
        with self.cache.lock:
            self._synced = True

    def in_flight(self) -> int:
        """Allocations admitted here and not yet seen stored."""
        with self.cache.lock:
            return len(self._admitted)

    def review(self, body: Any) -> dict[str, Any]:
        """Answer one ``admission.k8s.io/v1`` AdmissionReview (a decoded JSON body)."""
        started = self.clock()
        request = body.get("request") if isinstance(body, Mapping) else None
        if not isinstance(request, Mapping) or not isinstance(request.get("uid"), str):
            raise ReviewError("not an admission.k8s.io/v1 AdmissionReview with a request and its uid")
        request_uid = str(request["uid"])
        claim, old = request.get("object"), request.get("oldObject")
        allocation = _allocation(claim)
        if allocation is None or _allocation(old) is not None or not isinstance(claim, Mapping):
            return self._answer("not_an_allocation", started, _response(request_uid, True))
        claim = dict(claim)
        key = str(object_key(claim))
        uid = str((claim.get("metadata") or {}).get("uid") or "")
        known = _unallocated(self.cache.get(Kind.CLAIM, key), uid)
        if self._synced and not known:
            exists = self._exists_unallocated(key, uid)
            if exists is None:
                message = (
                    f"the fractional.dev allocation guard could not read ResourceClaim {bounded(key)}; "
                    "try again"
                )
                return self._answer("starting", started, _response(
                    request_uid, False, code=503, reason="ServiceUnavailable", message=message))  # fmt: skip
            if not exists:  # no such claim to store it in: nothing to count
                return self._answer("unknown_claim", started, _response(request_uid, True))
        waited = self.clock()
        with self.cache.lock:
            self._lock_waited, self._read_seconds = self.clock() - waited, 0.0
            if not self._synced:
                message = (
                    "the fractional.dev allocation guard is starting: its view of the cluster is not "
                    "synced yet; try again"
                )
                return self._answer("starting", started, _response(
                    request_uid, False, code=503, reason="ServiceUnavailable", message=message))  # fmt: skip
            self.sweep()
            if _results(allocation) == _results(_allocation(self.cache.assumed(key))):
                return self._answer("allowed", started, _response(request_uid, True))  # our own write
            with self._held(claim):
                found = check_booking(self.cache.state, claim)
            if not found:
                self._admit(key, claim, allocation)
                return self._answer("allowed", started, _response(request_uid, True))
            standing = self._standing_in_the_way(found, key)
        if self.read_claim is not None and standing:
            found = self._check_again(claim, key, allocation, standing)
            if not found:
                return self._answer("allowed", started, _response(request_uid, True))
        message = f"ResourceClaim {bounded(key)}: " + "; ".join(o.describe() for o in found[:4])
        if len(found) > 4:
            message += f"; and {len(found) - 4} more"
        message += (
            " (another allocation of the same room came first; the fractional.dev allocation guard "
            "keeps two allocators from booking a device twice)"
        )
        log.info("allocation refused", extra={"claim": bounded(key), "devices": len(found),
                 "first": bounded(found[0].describe())})  # fmt: skip
        return self._answer("refused", started, _response(request_uid, False, code=403, reason="Forbidden",
                            message=message))  # fmt: skip

    def sweep(self) -> None:
        """Drop what was seen stored (or replaced); forget what was admitted too long ago and never
        stored. Called with or without ``cache.lock``."""
        now = self.clock()
        with self.cache.lock:
            for key, admitted in list(self._admitted.items()):
                if self.cache.assumed(key) is not admitted.version:
                    del self._admitted[key]  # stored (the server's version won) or replaced
                elif now - admitted.at > self.settings.forget_after_seconds:
                    self.cache.forget_assumed_version(key, admitted.version)
                    del self._admitted[key]
                    log.warning("admitted allocation never stored, forgotten", extra={"claim": bounded(key)})

    # -- helpers (cache.lock held where said) ------------------------------------------------------

    def _held(self, claim: Mapping[str, Any]) -> AbstractContextManager[None]:
        """The devices nominated to preemptors of at least the priority of the pods the claim is
        reserved for (kube-scheduler writes the reservation with the allocation); under cache.lock."""
        if self.holds is None:
            return contextlib.nullcontext()
        namespace = (claim.get("metadata") or {}).get("namespace")
        priorities = []
        for reserved in ((claim.get("status") or {}).get("reservedFor")) or ():
            if isinstance(reserved, Mapping) and reserved.get("resource") == "pods":
                pod = self.cache.get(Kind.POD, f"{namespace}/{reserved.get('name')}")
                value = ((pod or {}).get("spec") or {}).get("priority")
                priorities.append(value if isinstance(value, int) else 0)
        return self.holds(max(priorities, default=0))

    def _exists_unallocated(self, key: str, uid: str) -> bool | None:
        """Is there, per the API, a claim ``key`` with this UID and no allocation? None: the API did
        not say (no lock held)."""
        if self.read_claim is None or not uid:
            return False
        namespace, _, name = key.partition("/")
        try:
            return _unallocated(self.read_claim(namespace, name), uid)
        except Exception as error:  # not read: the caller asks kube-apiserver to try again
            log.info("claim read failed", extra={"claim": bounded(key), "error": bounded(error)})
            return None

    def _answer(self, outcome: str, started: float, answer: dict[str, Any]) -> dict[str, Any]:
        if outcome != "not_an_allocation":
            took = self.clock() - started
            self.metrics.guard_reviews.labels(outcome=outcome).inc()
            self.metrics.guard_review_seconds.observe(took)
            if took > SLOW_REVIEW_SECONDS:  # kube-apiserver gives up at the webhook's timeoutSeconds
                log.warning("slow allocation review", extra={"outcome": outcome, "seconds": round(took, 3),
                            "lock_wait_seconds": round(self._lock_waited, 3),
                            "read_seconds": round(self._read_seconds, 3)})  # fmt: skip
        return answer

    def _admit(self, key: str, claim: dict[str, Any], allocation: dict[str, Any]) -> None:
        (version,) = self.cache.assume_allocations([(claim, allocation)])
        self._admitted[key] = _Admitted(version, self.clock())

    def _standing_in_the_way(self, found: tuple[Overbooking, ...], key: str) -> list[str]:
        """Keys of the claims counted on the devices ``found`` names, but ours in flight (under
        ``cache.lock``): stored ones, and ones admitted here that may never be stored."""
        devices = {o.device for o in found}
        pools = {(driver, pool) for driver, pool, _ in devices}
        keys: set[str] = set()
        for stored in self.cache.in_pools(Kind.CLAIM, pools):
            if _devices(self.cache.claim_as_counted(str(object_key(stored)))) & devices:
                keys.add(str(object_key(stored)))
        now = self.clock()
        for other, admitted in self._admitted.items():
            old_enough = now - admitted.at >= self.settings.confirm_after_seconds
            if old_enough and _devices(admitted.version) & devices:
                keys.add(other)
        keys.discard(key)
        for other in list(keys):  # our own decisions in flight are real: never read them away
            assumed = self.cache.assumed(other)
            if assumed is not None and other not in self._admitted:
                keys.discard(other)
        return sorted(keys)[:MAX_CONFIRM_READS]

    def _read_all(self, keys: list[str]) -> dict[str, dict[str, Any] | None]:
        """The claims as the API has them, read side by side within ``confirm_budget_seconds`` in
        all (kube-apiserver waits for the answer); one not read in time proves nothing and is left
        out (it stays counted)."""
        assert self.read_claim is not None
        read_claim = self.read_claim
        futures = {key: self._readers.submit(read_claim, *key.partition("/")[::2]) for key in keys}
        done, _ = concurrent.futures.wait(futures.values(), timeout=self.settings.confirm_budget_seconds)
        seen: dict[str, dict[str, Any] | None] = {}
        for key, future in futures.items():
            if future not in done:
                future.cancel()
                continue
            try:
                seen[key] = future.result()
            except Exception as error:  # a read that fails proves nothing: that claim stays counted
                log.debug("claim read failed", extra={"claim": bounded(key), "error": bounded(error)})
        return seen

    def _check_again(
        self, claim: dict[str, Any], key: str, allocation: dict[str, Any], standing: list[str]
    ) -> tuple[Overbooking, ...]:
        """Read the claims in the way (no lock held), then check again under ``cache.lock`` with
        those the API shows gone or unallocated left out of the count; admit when it fits."""
        reading = self.clock()
        seen = self._read_all(standing)
        waited = self.clock()
        self._read_seconds = waited - reading
        with self.cache.lock:
            now = self.clock()
            self._lock_waited += now - waited
            set_aside: list[dict[str, Any]] = []
            try:
                for other, current in seen.items():
                    counted = self.cache.claim_as_counted(other)
                    if counted is None or not _allocation(counted) or _stands(current, counted):
                        continue
                    admitted = self._admitted.get(other)
                    if admitted is not None and admitted.version is counted:
                        if now - admitted.at < self.settings.confirm_after_seconds:
                            continue  # admitted a moment ago: its write may still be on its way
                        self.cache.forget_assumed_version(other, admitted.version)
                        del self._admitted[other]
                        continue  # never stored: forgotten for good
                    uid = str((counted.get("metadata") or {}).get("uid") or other)
                    self.cache.state.remove_claim(uid)  # gone or deallocated in the API already
                    set_aside.append(counted)
                with self._held(claim):
                    found = check_booking(self.cache.state, claim)
                if not found:
                    self._admit(key, claim, allocation)
            finally:
                for counted in set_aside:  # the watch brings the change; until then count as before
                    self.cache.state.upsert_claim(counted)
            return found

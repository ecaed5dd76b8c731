"""The ProvisioningRequests of gangs that fit nowhere, through their life (``--provisioning-requests``).

For an unfit gang with a scale-up hint, on the writer thread of its explanation:

- none alive: create them (``sizing.provisioning.build_requests``: the PodTemplates, then the
  request; a gang above 32 distinct pods in parts), then name each pod's request in its annotations;
- alive and not ended (cluster-autoscaler has not answered, or wrote ``Provisioned=True`` and the
  nodes are coming): wait, writing nothing; the watch on our requests queues the gang when a
  condition changes, and new nodes and their slices queue it as capacity does;
- one part ended (``Failed``, ``BookingExpired``, ``CapacityRevoked``): delete every part and its
  templates, and ask again after a backoff (doubling, at most ``max_backoff``), as a new attempt.

When the gang is placed its requests are deleted (``placed``); when its pods go, the garbage
collector removes them (the pods own them). The per-gang memory (attempt, ended requests, when to
ask again) is this replica's: a new leader starts from the requests it watches.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from driver.controller.metrics import ControllerMetrics
from driver.controller.model.objects import GangKey
from driver.controller.sizing.provisioning import (
    GANG_ANNOTATION,
    GANG_HASH_LABEL,
    Action,
    Unresolved,
    attempt_of,
    build_requests,
    gang_hash,
    plan_provisioning,
)
from driver.controller.view.cache import ClusterCache, Kind
from driver.controller.writes.events import EventRecorder

__all__ = ["PROVISIONING_REQUESTS", "Provisioner", "ProvisioningAnswer", "gang_of_request"]

log = logging.getLogger(__name__)

PROVISIONING_REQUESTS = ("autoscaling.x-k8s.io", "v1", "provisioningrequests")  # group, version, plural


@dataclass
class _Memory:
    next_attempt: int = 0
    failures: int = 0  # requests of this gang that ended (reset when it is placed)
    retry_at: float = 0.0  # monotonic
    retry_pending: bool = False  # ended, not asked again yet


@dataclass(frozen=True, slots=True)
class ProvisioningAnswer:
    """Per pod (namespace/name), the request that asks for it; and what to tell people."""

    requests: dict[str, str]
    said: str


def gang_of_request(request: dict[str, Any]) -> GangKey | None:
    """The gang a request of ours is for (None: not ours)."""
    meta = request.get("metadata") or {}
    if not (meta.get("labels") or {}).get(GANG_HASH_LABEL):
        return None
    gang = (meta.get("annotations") or {}).get(GANG_ANNOTATION)
    return GangKey(str(gang)) if gang else None


def _template_names(request: dict[str, Any]) -> list[str]:
    sets = (request.get("spec") or {}).get("podSets") or ()
    return [str((s.get("podTemplateRef") or {}).get("name")) for s in sets if (s.get("podTemplateRef") or {})]


def _owners(request: dict[str, Any]) -> list[str]:
    meta = request.get("metadata") or {}
    return [
        f"{meta.get('namespace')}/{o.get('name')}"
        for o in meta.get("ownerReferences") or ()
        if o.get("kind") == "Pod"
    ]


class Provisioner:
    def __init__(
        self,
        *,
        cache: ClusterCache,
        metrics: ControllerMetrics,
        provisioning_class: str,
        requeue_after: Callable[[str, float], None],
        initial_backoff: float = 30.0,
        max_backoff: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cache = cache
        self._metrics = metrics
        self._class = provisioning_class
        self._requeue_after = requeue_after
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._clock = clock
        self._lock = threading.Lock()
        self._memory: dict[GangKey, _Memory] = {}

    def _alive(self, gang: GangKey, namespace: str) -> list[dict[str, Any]]:
        digest = gang_hash(gang)
        with self._cache.lock:
            return [
                r
                for r in self._cache.objects(Kind.PROVISIONING_REQUEST)
                if (r.get("metadata") or {}).get("namespace") == namespace
                and ((r.get("metadata") or {}).get("labels") or {}).get(GANG_HASH_LABEL) == digest
                and gang_of_request(r) == gang
            ]

    def for_unfit(
        self,
        recorder: EventRecorder,
        gang: GangKey,
        pods: list[dict[str, Any]],
        *,
        wanted: bool,
        requeue_key: str,
    ) -> ProvisioningAnswer:
        """Run one step of the gang's requests (``wanted``: a node shape is known to fit it; without
        one no request is created, those alive stay)."""
        namespace = str(pods[0]["metadata"]["namespace"])
        alive = self._alive(gang, namespace)
        with self._lock:
            memory = self._memory.setdefault(gang, _Memory())
            if alive:
                memory.next_attempt = max(memory.next_attempt, max(attempt_of(r) for r in alive) + 1)
            step = plan_provisioning(
                alive, next_attempt=memory.next_attempt, failures=memory.failures, retry_at=memory.retry_at,
                now=self._clock(), initial_backoff=self._initial_backoff, max_backoff=self._max_backoff,
            )  # fmt: skip
        if step.action is Action.RETIRE:
            self._delete(recorder, namespace, alive)
            self._metrics.provisioning_requests.labels(event="ended").inc(len(alive))
            with self._lock:
                memory.failures += 1
                memory.retry_at = self._clock() + step.delay
                memory.retry_pending = True
            self._requeue_after(requeue_key, step.delay + 0.1)
            log.info("provisioning request ended", extra={"gang": gang, "reason": step.reason,
                     "retry_seconds": round(step.delay, 1)})  # fmt: skip
            return ProvisioningAnswer({}, f"{step.reason}; asking again in {step.delay:.0f} s")
        if step.action is Action.WAIT:
            if step.delay > 0:
                self._requeue_after(requeue_key, step.delay + 0.1)
            current = [r for r in alive if attempt_of(r) == step.attempt]
            requests = {pod: r["metadata"]["name"] for r in current for pod in _owners(r)}
            return ProvisioningAnswer(requests, step.reason)
        if not wanted:
            return ProvisioningAnswer({}, "")
        try:
            parts = build_requests(
                gang, pods, provisioning_class=self._class, attempt=step.attempt,
                claims_of=self._cache.claim_refs,
            )  # fmt: skip
        except Unresolved as error:
            return ProvisioningAnswer({}, f"no ProvisioningRequest yet: {error}")
        created = 0
        for part in parts:
            stored = recorder.create_provisioning_part(part.request, list(part.templates))
            if stored is not None:  # seen at once: the next pass must not ask a second time
                self._cache.apply(Kind.PROVISIONING_REQUEST, "ADDED", stored)
                created += 1
        with self._lock:
            memory.next_attempt = max(memory.next_attempt, step.attempt + 1)
            memory.retry_pending = False
        self._metrics.provisioning_requests.labels(event="created").inc(created)
        names = ", ".join(part.name for part in parts)
        noun = "ProvisioningRequest" if len(parts) == 1 else f"{len(parts)} ProvisioningRequests (parts)"
        return ProvisioningAnswer(
            {pod: part.name for part in parts for pod in part.pods},
            f"asked cluster-autoscaler for nodes: {noun} {names}",
        )

    def placed(self, recorder: EventRecorder, gang: GangKey, namespace: str) -> None:
        """The gang is placed: its requests have done their work (or were not needed)."""
        with self._lock:
            self._memory.pop(gang, None)
        alive = self._alive(gang, namespace)
        if alive:
            self._delete(recorder, namespace, alive)
            self._metrics.provisioning_requests.labels(event="placed").inc(len(alive))

    def retry_due(self, gang: GangKey) -> bool:
        """The gang's backoff after an ended request is over: it asks again though nothing changed."""
        with self._lock:
            memory = self._memory.get(gang)
            return memory is not None and memory.retry_pending and self._clock() >= memory.retry_at

    def forget(self, gang: GangKey) -> None:
        with self._lock:
            self._memory.pop(gang, None)

    def _delete(self, recorder: EventRecorder, namespace: str, requests: list[dict[str, Any]]) -> None:
        names = [str(r["metadata"]["name"]) for r in requests]
        recorder.delete_provisioning(namespace, names, [t for r in requests for t in _template_names(r)])
        for request in requests:  # gone at once: the next pass must not end them a second time
            self._cache.apply(Kind.PROVISIONING_REQUEST, "DELETED", request)

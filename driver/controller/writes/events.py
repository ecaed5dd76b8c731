"""What the controller tells people and autoscalers about a gang that does not fit: a core/v1
Event on its first pod (and its PodGroup or Workload), the scale-up hint annotation on each pod, and
optionally the ProvisioningRequests and PodTemplates that ``sizing.provisioning`` shapes.

Events follow client-go's core/v1 recorder (``tools/record``, its ``EventCorrelator``): an Event
is one series per involved object (kind, namespace, name, UID), reason and message. A repeat
updates the same Event (``count`` + 1, ``lastTimestamp``) with a merge patch; the first time, a
different involved UID (a pod re-created under the same name), or once the Event may have expired
(its last write is older than the apiserver's ``--event-ttl``, 1 h by default, or the patch finds
it gone), a new Event is created. A series still observed is written again at least every
``refresh_seconds`` (``keep_alive``), so a gang stuck for hours keeps its Event. Every write checks
the leadership fence first, as ``ApiWriter``'s do: a replica that lost its lease says nothing more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from typing import Any

from kubernetes import client

from driver.controller.model.decode import MAX_OBJECT_DEPTH, bounded, decode_json
from driver.controller.model.objects import (
    HINT_ANNOTATION,
    PROVISIONING_ANNOTATION,
    PROVISIONING_CLASS_ANNOTATION,
    PROVISIONING_OURS_ANNOTATION,
    GangKey,
)
from driver.controller.writes.writer import HaltWrites, format_time
from driver.errors import ConflictError, NamespaceTerminatingError, NotFoundError
from driver.kube import REQUEST_TIMEOUT_SECONDS, api_errors

__all__ = [
    "COMPONENT",
    "REASON_FAILED",
    "REASON_HANDED_OVER",
    "REASON_REJECTED",
    "REASON_SHARE_REFUSED",
    "REASON_UNSCHEDULABLE",
    "EVENT_TTL_SECONDS",
    "EventMemory",
    "EventRecorder",
    "EventSeries",
]

log = logging.getLogger(__name__)

COMPONENT = "fractional-dra-controller"
REPORTING_COMPONENT = "fractional.dev/controller"  # events.k8s.io reportingController
REASON_UNSCHEDULABLE = "GangUnschedulable"
REASON_FAILED = "AllocationFailed"
REASON_HANDED_OVER = "HandedToKubeScheduler"  # a gang's pod beyond minCount left to kube-scheduler
REASON_REJECTED = "ObjectRejected"
REASON_SHARE_REFUSED = "ShareRefused"  # a node refused a pod's share: the pod is replaced (or should be)
MAX_EVENT_MESSAGE_CHARS = 1024  # kube-apiserver truncates longer Event messages the same way
MERGE_PATCH = "application/merge-patch+json"
EVENT_TTL_SECONDS = 3600.0  # kube-apiserver --event-ttl default: an Event not written for this long is gone
REFRESH_SECONDS = 1800.0  # a series still observed is written again this often (client-go events: 30 min)
MAX_SERIES = 4096  # series remembered, least recently used dropped first (client-go's LRU cache size)
_NAME_LIMIT = 253
_INVOLVED_API_VERSIONS = {"Pod": "v1", "ResourceClaim": "resource.k8s.io/v1"}

SeriesKey = tuple[str, str, str, str, str, str, str]
"""(scope, involved kind, namespace, name, UID, reason, message); scope: ``gang:<key>`` or ``uid:<uid>``."""


def _series_key(scope: str, obj: dict[str, Any], kind: str, reason: str, message: str) -> SeriesKey:
    meta = obj.get("metadata") or {}
    return (scope, kind, str(meta.get("namespace") or ""), str(meta.get("name") or ""),
            str(meta.get("uid") or ""), reason, message)  # fmt: skip


@dataclass(frozen=True, slots=True)
class EventSeries:
    """One Event as last written: where, how often it was observed, and when (``written_at``: the
    memory's monotonic clock). ``dropped``: its namespace was being deleted, nothing was created."""

    namespace: str
    name: str
    count: int
    first_timestamp: str
    written_at: float
    api_version: str = ""  # the involved object's
    dropped: bool = False


class EventMemory:
    """The Event series said, shared by every writer thread's recorder (owns its lock; never held
    across an API call). A gang's jobs run one at a time, so one series is written by one thread."""

    def __init__(
        self,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        ttl_seconds: float = EVENT_TTL_SECONDS,
        refresh_seconds: float = REFRESH_SECONDS,
        max_series: int = MAX_SERIES,
    ) -> None:
        self._lock = threading.Lock()
        self._series: OrderedDict[SeriesKey, EventSeries] = OrderedDict()
        self._last: dict[str, tuple[SeriesKey, ...]] = {}  # scope -> the series its last call wrote
        self.monotonic = monotonic
        self.ttl_seconds = ttl_seconds
        self.refresh_seconds = refresh_seconds
        self._max_series = max_series

    def live(self, key: SeriesKey) -> EventSeries | None:
        """The series if its Event may still exist (written within the TTL), else None (forgotten)."""
        with self._lock:
            series = self._series.get(key)
            if series is None:
                return None
            if self.monotonic() - series.written_at >= self.ttl_seconds:
                del self._series[key]
                return None
            self._series.move_to_end(key)
            return series

    def record(self, key: SeriesKey, series: EventSeries) -> None:
        with self._lock:
            self._series[key] = series
            self._series.move_to_end(key)
            while len(self._series) > self._max_series:
                self._series.popitem(last=False)

    def said(self, scope: str, keys: tuple[SeriesKey, ...]) -> None:
        """``keys``: the series the scope's latest call wrote (``keep_alive`` renews those)."""
        with self._lock:
            self._last[scope] = keys
            while len(self._last) > self._max_series:
                self._last.pop(next(iter(self._last)))

    def due(self, scope: str) -> list[SeriesKey]:
        """The scope's latest series whose last write is ``refresh_seconds`` old or more."""
        with self._lock:
            now = self.monotonic()
            return [
                key
                for key in self._last.get(scope, ())
                if key in self._series and now - self._series[key].written_at >= self.refresh_seconds
            ]

    def forget(self, scope: str) -> None:
        """End every series of ``scope`` (the gang was placed): the next Event starts a new one."""
        with self._lock:
            self._last.pop(scope, None)
            for key in [k for k in self._series if k[0] == scope]:
                del self._series[key]


class EventRecorder:
    """Runs on a writer thread with that thread's ``ApiClient``; ``memory`` is shared by all.
    ``fence``: the controller's leadership fence; once set, no Event goes out (``HaltWrites``)."""

    def __init__(
        self,
        api_client: client.ApiClient,
        *,
        identity: str,
        memory: EventMemory | None = None,
        fence: threading.Event | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._core: Any = client.CoreV1Api(
            api_client
        )  # Any: we send dicts and read raw JSON (_preload_content=False)
        self._custom: Any = client.CustomObjectsApi(api_client)
        self._identity = identity or COMPONENT
        self._memory = memory or EventMemory()
        self._fence = fence
        self._now = now
        self.emitted = 0  # Events created
        self.updated = 0  # repeats written to an existing Event

    def forget(self, gang: GangKey) -> None:
        self._memory.forget(f"gang:{gang}")

    def gang_unschedulable(
        self,
        gang: GangKey,
        pod: dict[str, Any],
        message: str,
        *,
        reason: str = REASON_UNSCHEDULABLE,
        also: dict[str, Any] | None = None,
    ) -> bool:
        """Say ``message`` about the gang on ``pod`` (a repeat updates the same Event); True when
        written. ``also``: the gang's PodGroup (or Workload) as an object reference; it gets the
        Event too."""
        scope = f"gang:{gang}"
        targets = [(pod, "Pod", "")]
        if also is not None and also.get("name") and also.get("kind"):
            target = {"metadata": {"name": also["name"], "namespace": also.get("namespace") or
                                   pod["metadata"]["namespace"], "uid": also.get("uid")}}  # fmt: skip
            targets.append((target, str(also["kind"]), str(also.get("apiVersion") or "")))
        keys = tuple(_series_key(scope, obj, kind, reason, message) for obj, kind, _ in targets)
        written = False
        for (obj, kind, api_version), key in zip(targets, keys, strict=True):
            if not self._observe(
                key, obj, reason=reason, message=message, kind=kind, api_version=api_version
            ):
                break  # dropped (namespace terminating): the other object lives there too
            written = True
        self._memory.said(scope, keys)
        if written:
            log.info(
                "gang event emitted",
                extra={"gang": gang, "reason": reason, "event_message": bounded(message)},
            )
        return written

    def keep_alive(self, gang: GangKey) -> int:
        """The gang is still as last said: write its Events again where their last write is
        ``refresh_seconds`` old, so they outlive the apiserver's Event TTL. Returns the writes made."""
        writes = 0
        for key in self._memory.due(f"gang:{gang}"):
            series = self._memory.live(key)
            if series is None:
                continue  # expired meanwhile: the next real observation creates it anew
            _, kind, namespace, name, uid, reason, message = key
            target = {"metadata": {"name": name, "namespace": namespace, "uid": uid or None}}
            written = self._observe(
                key, target, reason=reason, message=message, kind=kind, api_version=series.api_version
            )
            writes += int(written)
        return writes

    def object_rejected(self, resource: str, obj: dict[str, Any], problem: str) -> bool:
        """A Warning Event on an object the controller will not act on (``problem`` names the field);
        one series per object UID and message. True when written."""
        meta = obj.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        what = "ResourceClaim" if resource == "resourceclaims" else "Pod"
        message = (
            f"{what} {meta.get('namespace')}/{meta.get('name')}: {problem}; the controller leaves it alone"
        )
        key = _series_key(f"uid:{uid}", obj, what, REASON_REJECTED, message)
        if not self._observe(key, obj, reason=REASON_REJECTED, message=message, kind=what):
            return False
        log.warning("object rejected", extra={"resource": resource, "object": f"{meta.get('namespace')}/"
                    f"{meta.get('name')}", "reason": bounded(problem)})  # fmt: skip
        return True

    def object_warning(
        self, scope: str, obj: dict[str, Any], *, kind: str, reason: str, message: str
    ) -> bool:
        """A Warning Event on any object (``kind`` its API kind, e.g. "ResourceClaim"), one series per
        ``scope``, object, reason and message; a repeat updates it. True when written."""
        key = _series_key(scope, obj, kind, reason, message)
        return self._observe(key, obj, reason=reason, message=message, kind=kind)

    def _observe(
        self, key: SeriesKey, obj: dict[str, Any], *, reason: str, message: str, kind: str = "Pod",
        api_version: str = "",
    ) -> bool:  # fmt: skip
        """One more observation of the series ``key``: update its Event, or create one. True when
        written; False when dropped (its namespace is being deleted: said once, not retried)."""
        series = self._memory.live(key)
        if series is not None and series.dropped:
            return False  # its namespace is being deleted: not tried again
        now = format_time(self._now())
        if series is not None:
            self._check_fence()
            count = series.count + 1
            if self._update(series, count=count, last_timestamp=now, message=message):
                self._memory.record(key, replace(series, count=count, written_at=self._memory.monotonic()))
                return True
        meta = obj["metadata"]
        self._check_fence()
        name = self._create(obj, reason=reason, message=message, kind=kind, api_version=api_version, now=now)
        self._memory.record(key, EventSeries(
            namespace=meta["namespace"], name=name or "", count=1, first_timestamp=now,
            written_at=self._memory.monotonic(), api_version=api_version, dropped=name is None,
        ))  # fmt: skip
        return name is not None

    def _check_fence(self) -> None:
        """Once the fence is set (leadership lost) no Event may go out, as no other write may."""
        if self._fence is not None and self._fence.is_set():
            raise HaltWrites()

    def _update(self, series: EventSeries, *, count: int, last_timestamp: str, message: str) -> bool:
        """Patch the series' Event; False when it is gone (expired or deleted): a new one is due."""
        body = {"count": count, "lastTimestamp": last_timestamp,
                "message": bounded(message, MAX_EVENT_MESSAGE_CHARS - 40)}  # fmt: skip
        try:
            with api_errors(f"update Event {series.namespace}/{series.name}"):
                self._core.patch_namespaced_event(
                    series.name, series.namespace, body, _content_type=MERGE_PATCH, _preload_content=False,
                    _request_timeout=REQUEST_TIMEOUT_SECONDS,
                )  # fmt: skip
        except NotFoundError:
            log.info("event gone, creating a new one", extra={"event": f"{series.namespace}/{series.name}"})
            return False
        self.updated += 1
        return True

    def _create(
        self, obj: dict[str, Any], *, reason: str, message: str, kind: str, api_version: str, now: str
    ) -> str | None:
        """Create the Event; its name, or None when its namespace is being deleted (nothing to tell)."""
        meta = obj["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name'][:200]}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": api_version or _INVOLVED_API_VERSIONS[kind],
                "kind": kind,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "reason": reason,
            "message": bounded(message, MAX_EVENT_MESSAGE_CHARS - 40),
            "type": "Warning",
            "source": {"component": COMPONENT},
            "reportingComponent": REPORTING_COMPONENT,
            "reportingInstance": self._identity,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            with api_errors(f"create Event for {kind} {meta['namespace']}/{meta['name']}"):
                response = self._core.create_namespaced_event(
                    meta["namespace"], body, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS
                )
        except NamespaceTerminatingError:
            # Nothing can be created there any more, and its pods are going: the Event is moot. Seen
            # on kube-apiserver 1.37.2: retrying it kept a gang's key in the queue at ~5 passes/s.
            log.info("event dropped: namespace terminating", extra={"namespace": meta["namespace"]})
            return None
        self.emitted += 1
        created = decode_json(response.data, max_depth=MAX_OBJECT_DEPTH).value
        return str(((created if isinstance(created, dict) else {}).get("metadata") or {}).get("name") or "")

    def create_provisioning_part(
        self, request: dict[str, Any], templates: Iterable[dict[str, Any]]
    ) -> dict[str, Any] | None:
        """Create the PodTemplates, then the ProvisioningRequest (cluster-autoscaler fails a request
        whose template is missing for good). Existing ones stand (409: made by an earlier pass; a
        request's spec is immutable). Returns the request as created, None when it existed."""
        namespace, name = request["metadata"]["namespace"], request["metadata"]["name"]
        for template in templates:
            self._check_fence()
            try:
                with api_errors(f"create PodTemplate {namespace}/{template['metadata']['name']}"):
                    self._core.create_namespaced_pod_template(
                        namespace, template, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS
                    )
            except ConflictError:
                pass
        self._check_fence()
        try:
            with api_errors(f"create ProvisioningRequest {namespace}/{name}"):
                response = self._custom.create_namespaced_custom_object(
                    "autoscaling.x-k8s.io", "v1", namespace, "provisioningrequests", request,
                    _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS,
                )  # fmt: skip
        except ConflictError:
            return None
        log.info("provisioning request created", extra={"namespace": namespace, "request": name})
        created = decode_json(response.data, max_depth=MAX_OBJECT_DEPTH).value
        return created if isinstance(created, dict) else dict(request)

    def delete_provisioning(self, namespace: str, requests: Iterable[str], templates: Iterable[str]) -> None:
        """Delete the named ProvisioningRequests, then their PodTemplates (gone already: fine)."""
        deletes = [
            *((f"ProvisioningRequest {namespace}/{name}", partial(
                self._custom.delete_namespaced_custom_object, "autoscaling.x-k8s.io", "v1", namespace,
                "provisioningrequests", name)) for name in requests),
            *((f"PodTemplate {namespace}/{name}", partial(
                self._core.delete_namespaced_pod_template, name, namespace)) for name in templates),
        ]  # fmt: skip
        for what, delete in deletes:
            self._check_fence()
            try:
                with api_errors(f"delete {what}"):
                    delete(_preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS)
            except NotFoundError:
                pass
        log.info("provisioning requests deleted", extra={"namespace": namespace, "deleted": len(deletes)})

    @staticmethod
    def hint_annotations(
        hint_json: str | None, provisioning: tuple[str, str] | None
    ) -> dict[str, str | None]:
        """The hint, and (request name, class) for the request that asks for this pod: the
        annotations cluster-autoscaler reads, and ours naming the same request."""
        annotations: dict[str, str | None] = {HINT_ANNOTATION: hint_json}
        if provisioning is not None:
            annotations[PROVISIONING_ANNOTATION] = provisioning[0]
            annotations[PROVISIONING_CLASS_ANNOTATION] = provisioning[1]
            annotations[PROVISIONING_OURS_ANNOTATION] = provisioning[0]
        return annotations

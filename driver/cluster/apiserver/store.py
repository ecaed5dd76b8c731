"""Object store of the embedded API emulator (a test double): objects, resource versions, watch history.

One lock guards everything here and is never held while a socket is written or an object is
validated: writers compute the new object outside the lock and commit it with a compare-and-swap
on the stored reference. Committed objects are never mutated (readers share them), so every write
builds a fresh dict. Watchers get events through their own queue.
"""

from __future__ import annotations

import datetime
import queue
import re
import secrets
import threading
import uuid
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "HISTORY_LIMIT",
    "ResourceType",
    "StatusError",
    "Store",
    "WatchEvent",
    "Watcher",
    "conflict_error",
    "new_timestamp",
    "utc_timestamps",
    "not_found_error",
]

HISTORY_LIMIT = 1000
_GENERATE_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # the apiserver's utilrand alphabet
_CONFLICT_MESSAGE = (
    "the object has been modified; please apply your changes to the latest version and try again"
)
_COMMIT_ATTEMPTS = 50

Obj = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ResourceType:
    """Endpoint facts for one served resource."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    status_subresource: bool = False
    returns_object_on_delete: bool = False
    field_labels: frozenset[str] = frozenset()
    create_only: bool = False  # a review: answered on create, never stored

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """``plural.group`` as the apiserver names it in messages (``resourceslices.resource.k8s.io``)."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


def qualified_kind(rtype: ResourceType) -> str:
    """The kind as apimachinery's GroupKind prints it: ``Pod``, ``ResourceSlice.resource.k8s.io``."""
    return f"{rtype.kind}.{rtype.group}" if rtype.group else rtype.kind


class StatusError(Exception):
    """An API failure, rendered as a ``kind: Status`` object."""

    def __init__(
        self,
        *,
        code: int,
        reason: str,
        message: str,
        details: dict[str, Any] | None = None,
        empty_details: bool = False,  # "details": {} sent, as kube-apiserver's generic errors have it
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details or {}
        self.empty_details = empty_details
        self.warnings: list[str] = []  # sent in Warning headers with the Status (see server.handle)

    def to_status(self) -> Obj:
        status: Obj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if not self.reason:  # Go's omitempty (a webhook's refusal may name no reason)
            del status["reason"]
        if self.empty_details and not self.details:
            status["details"] = {}
        if self.details:
            # Go's omitempty: an empty group (the core API) is left out, as kube-apiserver does
            status["details"] = {k: v for k, v in self.details.items() if not (k == "group" and v == "")}
        return status


def _details(rtype: ResourceType, name: str) -> dict[str, Any]:
    """As apimachinery's NewNotFound and kin: the kind is the resource's plural, an empty group left out."""
    details: dict[str, Any] = {"name": name, "group": rtype.group, "kind": rtype.plural}
    if not rtype.group:
        del details["group"]
    return details


def not_found_error(rtype: ResourceType, name: str) -> StatusError:
    return StatusError(
        code=404,
        reason="NotFound",
        message=f'{rtype.qualified} "{name}" not found',
        details=_details(rtype, name),
    )


def conflict_error(rtype: ResourceType, name: str) -> StatusError:
    return StatusError(
        code=409,
        reason="Conflict",
        message=f'Operation cannot be fulfilled on {rtype.qualified} "{name}": {_CONFLICT_MESSAGE}',
        details=_details(rtype, name),
    )


def already_exists_error(rtype: ResourceType, name: str) -> StatusError:
    return StatusError(
        code=409,
        reason="AlreadyExists",
        message=f'{rtype.qualified} "{name}" already exists',
        details=_details(rtype, name),
    )


_OFFSET_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)([+-]\d\d:\d\d)$")


def utc_timestamps(obj: Any) -> Any:
    """``obj`` with every RFC 3339 time written with an offset (``+00:00``, as Python clients send
    them) in UTC with ``Z``, as kube-apiserver stores and serves every ``Time`` and ``MicroTime``."""
    if isinstance(obj, dict):
        return {key: utc_timestamps(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [utc_timestamps(item) for item in obj]
    if isinstance(obj, str) and (match := _OFFSET_TIME.match(obj)):
        moment = datetime.datetime.fromisoformat(obj).astimezone(datetime.UTC)
        fraction = match.group(1).partition(".")[2]
        text = moment.strftime("%Y-%m-%dT%H:%M:%S")
        return f"{text}.{fraction}Z" if fraction else f"{text}Z"
    return obj


def new_timestamp() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One committed change; ``previous`` is the object before a MODIFIED."""

    resource_version: int
    type: str
    obj: Obj
    previous: Obj | None = None


@dataclass(eq=False, slots=True)
class Watcher:
    """One open watch: filters events for its stream, fed through its own queue (``None`` ends it)."""

    rtype: ResourceType
    namespace: str | None
    matches: Callable[[Obj], bool]
    events: queue.SimpleQueue[WatchEvent | None] = field(default_factory=queue.SimpleQueue)
    convert: Callable[[Obj], Obj] | None = None  # the stored form to the one this watch serves

    def _in_scope(self, obj: Obj) -> bool:
        if self.namespace is not None and obj["metadata"].get("namespace") != self.namespace:
            return False
        return self.matches(obj)

    def translate(self, event: WatchEvent) -> tuple[str, Obj] | None:
        """The event this watcher's client sees, as a selector-filtered apiserver sends it."""
        translated = self._translate(event)
        if translated is None or self.convert is None:
            return translated
        return translated[0], self.convert(translated[1])

    def _translate(self, event: WatchEvent) -> tuple[str, Obj] | None:
        now = self._in_scope(event.obj)
        if event.type != "MODIFIED" or event.previous is None:
            return (event.type, event.obj) if now else None
        before = self._in_scope(event.previous)
        if now and before:
            return "MODIFIED", event.obj
        if now:
            return "ADDED", event.obj
        if before:  # as the watch cache: the last content that matched, at the event's resourceVersion
            version = (event.obj.get("metadata") or {}).get("resourceVersion")
            return "DELETED", {
                **event.previous,
                "metadata": {**event.previous["metadata"], "resourceVersion": version},
            }
        return None


def _finalizers(rtype: ResourceType, obj: Obj) -> list[str]:
    """What still holds a deleting object: its finalizers (and a namespace's ``spec.finalizers``)."""
    finalizers = list(obj["metadata"].get("finalizers") or [])
    if rtype.plural == "namespaces" and not rtype.group:
        finalizers += (obj.get("spec") or {}).get("finalizers") or []
    return finalizers


def _key(obj: Obj) -> tuple[str, str]:
    metadata = obj["metadata"]
    return metadata.get("namespace", ""), metadata["name"]


def _with_metadata(obj: Obj, **changes: Any) -> Obj:
    return {**obj, "metadata": {**obj["metadata"], **changes}}


class Store:
    """All objects of all resources, one global resource version, a bounded event history."""

    def __init__(self, *, history_limit: int = HISTORY_LIMIT) -> None:
        self._lock = threading.Lock()
        self._objects: dict[str, dict[tuple[str, str], Obj]] = {}
        self._history: dict[str, deque[WatchEvent]] = {}
        self._evicted: dict[str, int] = {}  # resource -> version of the newest evicted event
        self._watchers: dict[str, set[Watcher]] = {}
        self._resource_version = 0
        self._history_limit = history_limit

    # reads -------------------------------------------------------------------------------------

    def get(self, rtype: ResourceType, namespace: str, name: str) -> Obj:
        with self._lock:
            obj = self._objects.get(rtype.qualified, {}).get((namespace, name))
        if obj is None:
            raise not_found_error(rtype, name)
        return obj

    def list_objects(self, rtype: ResourceType, namespace: str | None) -> tuple[list[Obj], str]:
        with self._lock:
            objects = list(self._objects.get(rtype.qualified, {}).values())
            resource_version = str(self._resource_version)
        if namespace is not None:
            objects = [obj for obj in objects if obj["metadata"].get("namespace") == namespace]
        objects.sort(key=_key)
        return objects, resource_version

    # writes ------------------------------------------------------------------------------------

    def create(
        self,
        rtype: ResourceType,
        obj: Obj,
        prepare: Callable[[Obj], Obj],
        *,
        ensure_namespace: Callable[[str], Obj] | None = None,
        dry_run: bool = False,
    ) -> Obj:
        """Name (``generateName``), stamp and ``prepare`` (validate) ``obj``, then store it
        (``dry_run``: answer what would be stored, without a resource version, and store nothing)."""
        metadata = obj.get("metadata") or {}
        for _ in range(_COMMIT_ATTEMPTS):
            name = metadata.get("name") or ""
            if not name and metadata.get("generateName"):
                name = metadata["generateName"] + "".join(
                    secrets.choice(_GENERATE_NAME_ALPHABET) for _ in range(5)
                )
            stamped = {
                **obj,
                "metadata": {
                    **metadata,
                    "name": name,
                    "uid": str(uuid.uuid4()),
                    "creationTimestamp": new_timestamp(),
                    "resourceVersion": "0",
                    "generation": 1,
                },
            }
            for transient in ("deletionTimestamp", "deletionGracePeriodSeconds"):
                stamped["metadata"].pop(transient, None)
            prepared = utc_timestamps(prepare(stamped))
            key = _key(prepared)
            with self._lock:
                objects = self._objects.setdefault(rtype.qualified, {})
                if key in objects:
                    if metadata.get("name"):
                        raise already_exists_error(rtype, name)
                    continue  # generateName collision: draw another suffix
                if dry_run:
                    return {**prepared, "metadata": {
                        k: v for k, v in prepared["metadata"].items() if k != "resourceVersion"}}  # fmt: skip
                if rtype.namespaced and ensure_namespace is not None:
                    self._ensure_namespace_locked(key[0], ensure_namespace)
                return self._commit_locked(rtype, key, prepared, "ADDED", None)
        raise already_exists_error(rtype, metadata.get("generateName", ""))

    def update(
        self,
        rtype: ResourceType,
        namespace: str,
        name: str,
        compute: Callable[[Obj], Obj],
        *,
        dry_run: bool = False,
    ) -> Obj:
        """Replace the stored object by ``compute(current)``, retried if a concurrent write won
        (``dry_run``: answer what would be stored, and store nothing).

        ``compute`` raises ``StatusError`` (conflict, invalid) and must not mutate ``current``. A
        deleting object whose finalizers become empty is removed (DELETED).
        """
        key = (namespace, name)
        for _ in range(_COMMIT_ATTEMPTS):
            with self._lock:
                current = self._objects.get(rtype.qualified, {}).get(key)
            if current is None:
                raise not_found_error(rtype, name)
            new = utc_timestamps(compute(current))
            with self._lock:
                objects = self._objects.get(rtype.qualified, {})
                if objects.get(key) is not current:
                    continue
                new = _with_metadata(new, resourceVersion=current["metadata"]["resourceVersion"])
                if new == current or dry_run:
                    return current if new == current else new  # a no-op write keeps the resource version
                if new["metadata"].get("deletionTimestamp") and not _finalizers(rtype, new):
                    del objects[key]
                    return self._commit_locked(rtype, key, new, "DELETED", current)
                return self._commit_locked(rtype, key, new, "MODIFIED", current)
        raise conflict_error(rtype, name)

    def delete(
        self,
        rtype: ResourceType,
        namespace: str,
        name: str,
        check: Callable[[Obj], None] | None = None,
        *,
        dry_run: bool = False,
    ) -> tuple[Obj, bool]:
        """Delete, or mark deleting while finalizers remain. Returns (object, removed); ``dry_run``
        answers the same and changes nothing."""
        key = (namespace, name)
        with self._lock:
            objects = self._objects.get(rtype.qualified, {})
            current = objects.get(key)
            if current is None:
                raise not_found_error(rtype, name)
            if check is not None:
                check(current)
            if current["metadata"].get("finalizers"):
                if current["metadata"].get("deletionTimestamp"):
                    return current, False
                marked = _with_metadata(
                    current, deletionTimestamp=new_timestamp(), deletionGracePeriodSeconds=0
                )
                if dry_run:
                    return marked, False
                return self._commit_locked(rtype, key, marked, "MODIFIED", current), False
            if dry_run:
                return current, True
            del objects[key]
            return self._commit_locked(rtype, key, current, "DELETED", current), True

    def _ensure_namespace_locked(self, namespace: str, build: Callable[[str], Obj]) -> None:
        namespaces = self._objects.setdefault("namespaces", {})
        key = ("", namespace)
        if key not in namespaces:
            namespace_type = ResourceType("", "v1", "namespaces", "Namespace", namespaced=False)
            self._commit_locked(namespace_type, key, build(namespace), "ADDED", None)

    def _commit_locked(
        self, rtype: ResourceType, key: tuple[str, str], obj: Obj, event_type: str, previous: Obj | None
    ) -> Obj:
        self._resource_version += 1
        obj = _with_metadata(obj, resourceVersion=str(self._resource_version))
        if event_type != "DELETED":
            self._objects.setdefault(rtype.qualified, {})[key] = obj
        event = WatchEvent(self._resource_version, event_type, obj, previous)
        history = self._history.setdefault(rtype.qualified, deque())
        if len(history) >= self._history_limit:
            self._evicted[rtype.qualified] = history.popleft().resource_version
        history.append(event)
        for watcher in self._watchers.get(rtype.qualified, ()):
            watcher.events.put(event)
        return obj

    # watches -----------------------------------------------------------------------------------

    def watch(self, watcher: Watcher, resource_version: str | None) -> list[WatchEvent]:
        """Register ``watcher``; return the events it must see first (replayed or synthetic ADDED).

        An unset or ``"0"`` version starts with the current objects; a version older than the
        kept history raises 410 Gone as an ERROR event would report it.
        """
        resource = watcher.rtype.qualified
        with self._lock:
            if resource_version in (None, "", "0"):
                initial = [
                    WatchEvent(int(obj["metadata"]["resourceVersion"]), "ADDED", obj)
                    for obj in self._objects.get(resource, {}).values()
                ]
            else:
                since = _parse_resource_version(resource_version)
                if since < self._evicted.get(resource, 0):
                    raise StatusError(
                        code=410,
                        reason="Expired",
                        message=f"too old resource version: {since} ({self._evicted[resource] + 1})",
                    )
                initial = [
                    event for event in self._history.get(resource, ()) if event.resource_version > since
                ]
            self._watchers.setdefault(resource, set()).add(watcher)
        return initial

    def drain(self, watcher: Watcher) -> tuple[list[WatchEvent], int]:
        """The watcher's pending events and the resource version they bring it to (for a BOOKMARK):
        taken under the lock, so no event at or below that version is still on its way."""
        pending: list[WatchEvent] = []
        with self._lock:
            while True:
                try:
                    event = watcher.events.get_nowait()
                except queue.Empty:
                    break
                if event is not None:
                    pending.append(event)
            return pending, self._resource_version

    def unwatch(self, watcher: Watcher) -> None:
        with self._lock:
            self._watchers.get(watcher.rtype.qualified, set()).discard(watcher)

    def close_watchers(self) -> None:
        """End every open watch stream (server stop)."""
        with self._lock:
            watchers = [w for group in self._watchers.values() for w in group]
            self._watchers.clear()
        for watcher in watchers:
            watcher.events.put(None)

    def objects(self, plurals: Collection[str]) -> int:
        """How many objects the given resources (``plural`` or ``plural.group``) hold."""
        with self._lock:
            return sum(
                len(objects)
                for key, objects in self._objects.items()
                if key in plurals or key.split(".", 1)[0] in plurals
            )


def _parse_resource_version(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise StatusError(code=400, reason="BadRequest", message=f'invalid resource version "{text}"')
    return value

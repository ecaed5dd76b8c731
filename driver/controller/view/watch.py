"""List + watch one kind into the cache: resume from the last resourceVersion, re-list on 410 Gone.

Each watcher is a named thread with its own ``ApiClient``. It reads raw JSON
(``_preload_content=False``): the controller works on API-shaped dicts, and skipping the client's
model classes keeps a busy watch cheap.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import urllib3.exceptions
from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

from driver.controller.model.decode import MAX_OBJECT_DEPTH, bounded, decode_json, format_field_path
from driver.controller.view.cache import ClusterCache, Kind, trim
from driver.errors import FractionalError, TransientError
from driver.kube import REQUEST_TIMEOUT_SECONDS, api_errors, new_api_client

__all__ = ["EventHandler", "Watcher"]

log = logging.getLogger(__name__)

EventHandler = Callable[[Kind, str, dict[str, Any], "dict[str, Any] | None"], None]
LIST_PAGE_SIZE = 500


_LIST_ITEM_DEPTH = 2  # {"items": [ <object> ]}
_EVENT_OBJECT_DEPTH = 1  # {"type": ..., "object": <object>}


def _too_deep(path: tuple[str | int, ...]) -> str:
    return f"{format_field_path(path)}: nested deeper than {MAX_OBJECT_DEPTH} levels"


class _Gone(Exception):
    """The watch's resourceVersion is too old (410): re-list."""


def _list_function(
    kind: Kind, api_client: client.ApiClient, resource: tuple[str, str, str] | None = None
) -> Callable[..., Any]:
    if resource is not None:  # (group, version, plural): workloads and podgroups, at the version discovered
        return partial(client.CustomObjectsApi(api_client).list_cluster_custom_object, *resource)
    resource_api = client.ResourceV1Api(api_client)
    core = client.CoreV1Api(api_client)
    functions: dict[Kind, Callable[..., Any]] = {
        Kind.SLICE: resource_api.list_resource_slice,
        Kind.CLASS: resource_api.list_device_class,
        Kind.CLAIM: resource_api.list_resource_claim_for_all_namespaces,
        Kind.POD: core.list_pod_for_all_namespaces,
        Kind.NODE: core.list_node,
    }
    return functions[kind]


class Watcher(threading.Thread):
    def __init__(
        self,
        *,
        kind: Kind,
        configuration: client.Configuration,
        cache: ClusterCache,
        on_event: EventHandler,
        stop: threading.Event,
        watch_timeout_seconds: int = 60,
        backoff_seconds: float = 0.5,
        resource: tuple[str, str, str] | None = None,
    ) -> None:
        super().__init__(name=f"watch-{kind.value}", daemon=True)
        self.kind = kind
        self.synced = threading.Event()
        self._configuration = configuration
        self._cache = cache
        self._on_event = on_event
        self._stop_event = stop
        self._watch_timeout_seconds = watch_timeout_seconds
        self._backoff_seconds = backoff_seconds
        self._response_lock = threading.Lock()
        self._response: Any = None
        self.relists = 0
        self.resource = resource  # (group, version, plural) when not the kind's built-in endpoint

    def interrupt(self) -> None:
        """Unblock a watch read so the thread sees ``stop`` (called after ``stop`` is set)."""
        with self._response_lock:
            response = self._response
        if response is not None:
            with contextlib.suppress(OSError):  # already closed by the server: nothing to unblock
                response.shutdown()

    def run(self) -> None:
        api_client = new_api_client(self._configuration)
        list_function = _list_function(self.kind, api_client, self.resource)
        resource_version: str | None = None
        try:
            while not self._stop_event.is_set():
                try:
                    if resource_version is None:
                        resource_version = self._relist(list_function)
                        self.synced.set()
                    resource_version = self._watch(list_function, resource_version)
                except _Gone:
                    log.info("watch expired, re-listing", extra={"kind": self.kind.value})
                    resource_version = None
                except (TransientError, FractionalError, OSError, ValueError) as error:
                    if self._stop_event.is_set():
                        break
                    log.warning(
                        "watch failed, retrying", extra={"kind": self.kind.value, "error": bounded(error)}
                    )
                    self._stop_event.wait(self._backoff_seconds)
                except (
                    Exception
                ):  # a bug (here or in a handler): log it once, back off, re-list, keep watching
                    if self._stop_event.is_set():
                        break
                    log.exception("watch handler failed, re-listing", extra={"kind": self.kind.value})
                    resource_version = None
                    self._stop_event.wait(self._backoff_seconds)
        finally:
            api_client.close()  # type: ignore[no-untyped-call]

    def _relist(self, list_function: Callable[..., Any]) -> str:
        items: list[dict[str, Any]] = []
        rejected: dict[int, str] = {}
        continue_token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"limit": LIST_PAGE_SIZE, "_preload_content": False}
            if continue_token:
                kwargs["_continue"] = continue_token
            with api_errors(f"list {self.kind.value}"):
                response = list_function(_request_timeout=REQUEST_TIMEOUT_SECONDS, **kwargs)
            decoded = decode_json(response.data, max_depth=MAX_OBJECT_DEPTH + _LIST_ITEM_DEPTH)
            body = decoded.value
            for path in decoded.too_deep:
                index = path[1] if len(path) > 2 and path[0] == "items" else None
                if not isinstance(index, int):
                    raise TransientError(
                        f"list {self.kind.value}: {format_field_path(path)}: nested too deep"
                    )
                rejected[len(items) + index] = _too_deep(path[2:])
            for item in _typed_items(body):
                trim(self.kind, item)
                items.append(item)
            metadata = body.get("metadata") or {}
            continue_token = metadata.get("continue")
            if not continue_token:
                break
        self.relists += 1
        if rejected:
            log.warning("objects rejected", extra={"kind": self.kind.value, "count": len(rejected)})
        for event_type, obj in self._cache.replace(self.kind, items, rejected, trimmed=True):
            self._on_event(self.kind, event_type, obj, None)
        return str(metadata.get("resourceVersion") or "")

    def _lines(self, response: Any) -> Iterator[str]:
        try:
            for line in iter_resp_lines(response):  # type: ignore[no-untyped-call]
                if line:
                    yield line
        except urllib3.exceptions.HTTPError as error:
            if not self._stop_event.is_set():
                raise TransientError(f"watch {self.kind.value}: {error}") from error

    def _watch(self, list_function: Callable[..., Any], resource_version: str) -> str:
        try:
            with api_errors(f"watch {self.kind.value}"):
                response = list_function(
                    watch=True,
                    resource_version=resource_version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=self._watch_timeout_seconds,
                    _preload_content=False,
                    _request_timeout=(REQUEST_TIMEOUT_SECONDS, self._watch_timeout_seconds + 30),
                )
        except FractionalError as error:
            if getattr(error.__cause__, "status", None) == 410:  # the client's exception, read duck-typed
                raise _Gone() from error
            raise
        with self._response_lock:
            self._response = response
        try:
            if self._stop_event.is_set():
                return resource_version
            for line in self._lines(response):
                decoded = decode_json(line, max_depth=MAX_OBJECT_DEPTH + _EVENT_OBJECT_DEPTH)
                event = decoded.value
                event_type = event.get("type")
                obj = event.get("object") or {}
                rejected = None
                if decoded.too_deep:
                    path = decoded.too_deep[0]
                    if path[0] != "object":
                        raise TransientError(
                            f"watch {self.kind.value}: {format_field_path(path)}: nested too deep"
                        )
                    rejected = _too_deep(path[1:])
                if event_type == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone()
                    raise TransientError(f"watch {self.kind.value}: {bounded(obj.get('message'))}")
                new_version = (obj.get("metadata") or {}).get("resourceVersion")
                if new_version:
                    resource_version = str(new_version)
                if event_type == "BOOKMARK":
                    continue
                applied, old = self._cache.apply(self.kind, str(event_type), obj, rejected=rejected)
                if applied:
                    self._on_event(self.kind, str(event_type), obj, old)
        finally:
            with self._response_lock:
                self._response = None
            response.release_conn()
        return resource_version


def _typed_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The list's items, each with its apiVersion and kind. kube-apiserver leaves both out of a
    built-in kind's list items (only a watch event's object carries them), and Events name their
    object by them (seen on a real apiserver: a PodGroup's Event went to a pod instead)."""
    api_version, list_kind = body.get("apiVersion"), str(body.get("kind") or "")
    kind = list_kind[: -len("List")] if list_kind.endswith("List") else None
    items = []
    for item in body.get("items") or ():
        if isinstance(item, dict) and kind and api_version:
            item = {"apiVersion": api_version, "kind": kind, **item}
        items.append(item)
    return items

"""HTTP layer of the embedded API emulator (a test double): URL routing, discovery documents,
JSON responses and chunked watch streams. One named thread per connection; no lock is held while
a socket is written."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import itertools
import logging
import queue
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

import yaml

from driver.cluster.apiserver import bodies
from driver.cluster.apiserver.openapi import openapi_document
from driver.cluster.apiserver.protobuf import PROTOBUF, decode_protobuf
from driver.cluster.apiserver.store import ResourceType, StatusError, Watcher, WatchEvent
from driver.cluster.apiserver.strategy import RESOURCE_TYPES
from driver.cluster.apiserver.strategy import find_resource_type as find_builtin_type
from driver.cluster.apiserver.tables import table_version, to_table

__all__ = ["Backend", "PlainText", "Route", "ThreadedHTTPServer", "discovery_document", "parse_route"]

log = logging.getLogger(__name__)

Obj = dict[str, Any]
_JOIN_SECONDS = 5.0
_VERSION = {
    "major": "1",
    "minor": "37",
    "emulationMajor": "1",
    "emulationMinor": "37",
    "minCompatibilityMajor": "1",
    "minCompatibilityMinor": "36",
    "gitVersion": "v1.37.0-fractional-emulator",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "none (Python test double)",
    "compiler": "cpython",
    "platform": "linux/amd64",
}
_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
# Discovery facts of the served resources, as kube-apiserver publishes them (each registry's
# ShortNames() and Categories()).
_SHORT_NAMES = {
    ("", "pods"): ["po"], ("", "nodes"): ["no"], ("", "namespaces"): ["ns"], ("", "events"): ["ev"],
    ("", "configmaps"): ["cm"], ("events.k8s.io", "events"): ["ev"], ("apps", "deployments"): ["deploy"],
    ("apps", "replicasets"): ["rs"], ("autoscaling", "horizontalpodautoscalers"): ["hpa"],
}  # fmt: skip
_CATEGORIES = {
    ("", "pods"): ["all"], ("apps", "deployments"): ["all"], ("apps", "replicasets"): ["all"],
    ("batch", "jobs"): ["all"],
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations"): ["api-extensions"],
}  # fmt: skip
_HEALTH_PATHS = frozenset({"/healthz", "/readyz", "/livez"})


@dataclass(frozen=True, slots=True)
class Route:
    """What a resource URL names."""

    rtype: ResourceType
    namespace: str | None
    name: str | None
    subresource: str | None

    @property
    def resource(self) -> str:
        return f"{self.rtype.plural}/{self.subresource}" if self.subresource else self.rtype.plural


class CustomLookup(Protocol):
    """The kinds CustomResourceDefinitions add (``crd.CustomResources``)."""

    def find(self, group: str, version: str, plural: str) -> ResourceType | None: ...

    def types(self) -> tuple[ResourceType, ...]: ...


class Backend(Protocol):
    @property
    def stopping(self) -> bool: ...

    def handle(
        self, method: str, route: Route, query: dict[str, str], body: Any, headers: Any
    ) -> tuple[int, Obj | PlainText, list[str]]: ...

    def open_watch(self, route: Route, query: dict[str, str]) -> tuple[Watcher, list[WatchEvent], float]: ...

    def bookmark(self, watcher: Watcher) -> tuple[list[WatchEvent], Obj]: ...

    def close_watch(self, watcher: Watcher) -> None: ...


def _not_found_path() -> StatusError:
    return StatusError(
        code=404,
        reason="NotFound",
        message="the server could not find the requested resource",
        empty_details=True,
    )


def parse_route(path: str, custom: CustomLookup | None = None) -> Route | None:
    """``/api/v1/...`` or ``/apis/<group>/<version>/...`` into a route; None for anything else.
    ``custom``: the kinds served through CustomResourceDefinitions, besides the built-in ones."""

    def find_resource_type(group: str, version: str, plural: str) -> ResourceType | None:
        found = find_builtin_type(group, version, plural)
        return found if found is not None or custom is None else custom.find(group, version, plural)

    parts = [urllib.parse.unquote(part) for part in path.split("/") if part]
    if len(parts) >= 3 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespaced = find_resource_type(group, version, rest[2])
        if namespaced is not None and namespaced.namespaced:
            namespace, rest = rest[1], rest[2:]
    rtype = find_resource_type(group, version, rest[0])
    if rtype is None or len(rest) > 3:
        return None
    if rtype.namespaced is False and namespace is not None:
        return None
    name = rest[1] if len(rest) > 1 else None
    subresource = rest[2] if len(rest) > 2 else None
    if (subresource, rtype.plural) in (
        ("binding", "pods"),
        ("eviction", "pods"),
        ("log", "pods"),
        ("finalize", "namespaces"),
    ):
        return Route(rtype, namespace, name, subresource)
    if subresource is not None and (subresource != "status" or not rtype.status_subresource):
        return None
    return Route(rtype, namespace, name, subresource)


APPLY_YAML = "application/apply-patch+yaml"


def _apply_yaml(raw: bytes) -> Any:
    """A server-side apply body in YAML (kubectl sends JSON, other clients YAML, as the type says)."""
    try:
        loaded = yaml.safe_load(raw.decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError):
        return None
    return loaded if isinstance(loaded, dict) else None


@dataclass(frozen=True, slots=True)
class PlainText:
    """An answer that is no JSON (``pods/log``): sent as ``text/plain``."""

    text: str


_SUBRESOURCE_BODY_KINDS = {"eviction": "Eviction", "binding": "Binding"}
_SNIPPET_BYTES = 30  # what kube-apiserver quotes of a body it cannot decode


def _undecodable(method: str, path: str, raw: bytes, error: ValueError, backend: Any) -> StatusError:
    """400 for a body that is no JSON, worded as kube-apiserver words it: a patch is "invalid JSON
    patch"; a created or replaced object names the kind it had to be, Go's parse error (Python's
    where Go's is not known) and the start of the body."""
    if method == "PATCH":
        return StatusError(code=400, reason="BadRequest", message="invalid JSON patch")
    route = parse_route(urllib.parse.urlsplit(path).path, getattr(backend, "custom_resources", None))
    if route is None or method not in ("POST", "PUT"):
        return StatusError(code=400, reason="BadRequest", message=f"invalid JSON: {error}")
    kind = _SUBRESOURCE_BODY_KINDS.get(route.subresource or "", route.rtype.kind)
    text = raw.decode("utf-8", errors="replace")
    snippet = text if len(text) <= _SNIPPET_BYTES else text[:_SNIPPET_BYTES] + " ..."
    return StatusError(
        code=400,
        reason="BadRequest",
        message=f"the object provided is unrecognized (must be of type {kind}): couldn't get version/kind; "
        f"json parse error: {error} ({snippet})",
    )


def _resource_list(group: str, version: str, served: tuple[ResourceType, ...] = RESOURCE_TYPES) -> Obj | None:
    types = [rtype for rtype in served if rtype.group == group and rtype.version == version]
    if not types:
        return None
    resources: list[Obj] = []
    for rtype in types:
        entry: Obj = {
            "name": rtype.plural, "singularName": rtype.kind.lower(), "namespaced": rtype.namespaced,
            "kind": rtype.kind, "verbs": ["create"] if rtype.create_only else _VERBS,
        }  # fmt: skip
        short_names = _SHORT_NAMES.get((rtype.group, rtype.plural), list(getattr(rtype, "short_names", ())))
        if short_names:
            entry["shortNames"] = short_names
        categories = _CATEGORIES.get((rtype.group, rtype.plural), list(getattr(rtype, "categories", ())))
        if categories:
            entry["categories"] = categories
        if getattr(rtype, "singular", ""):  # a custom kind: the singular its CRD names
            entry["singularName"] = rtype.singular  # type: ignore[attr-defined]
        elif not rtype.create_only:
            entry["storageVersionHash"] = _storage_version_hash(rtype)
        resources.append(entry)
        if rtype.plural == "pods" and not rtype.group:
            for sub, sub_kind, sub_group, sub_version in (
                ("binding", "Binding", "", "v1"),
                ("eviction", "Eviction", "policy", "v1"),
            ):
                resources.append(
                    {
                        "name": f"pods/{sub}",
                        "singularName": "",
                        "namespaced": True,
                        "kind": sub_kind,
                        "group": sub_group,
                        "version": sub_version,
                        "verbs": ["create"],
                    }
                )
            resources.append(
                {"name": "pods/log", "singularName": "", "namespaced": True, "kind": "Pod", "verbs": ["get"]}
            )
        if rtype.status_subresource:
            status = {key: value for key, value in entry.items()
                      if key not in ("shortNames", "categories", "storageVersionHash")}  # fmt: skip
            resources.append(
                {
                    **status,
                    "name": f"{rtype.plural}/status",
                    "singularName": "",
                    "verbs": ["get", "patch", "update"],
                }
            )
    resources.sort(key=lambda entry: str(entry["name"]))  # kube-apiserver lists them by name
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{group}/{version}".lstrip("/"),
            "resources": resources}  # fmt: skip


# The version each built-in kind is stored in, where it is not the one served (kube-apiserver 1.37).
_STORAGE_VERSIONS = {("resource.k8s.io", "devicetaintrules"): "v1beta2"}


def _storage_version_hash(rtype: ResourceType) -> str:
    """As kube-apiserver's discovery: the first 8 bytes of sha256("group/storageVersion/Kind"), base64."""
    version = _STORAGE_VERSIONS.get((rtype.group, rtype.plural), rtype.version)
    digest = hashlib.sha256(f"{rtype.group}/{version}/{rtype.kind}".encode()).digest()
    return base64.b64encode(digest[:8]).decode()


def _group(group: str, served: tuple[ResourceType, ...] = RESOURCE_TYPES) -> Obj:
    versions = sorted({rtype.version for rtype in served if rtype.group == group})
    entries = [{"groupVersion": f"{group}/{version}", "version": version} for version in versions]
    return {"kind": "APIGroup", "apiVersion": "v1", "name": group, "versions": entries,
            "preferredVersion": entries[0]}  # fmt: skip


def discovery_document(path: str, custom: tuple[ResourceType, ...] = ()) -> Obj | None:
    """``/version``, ``/api``, ``/apis`` and the per-version resource lists; None for other paths.
    ``custom``: the kinds served through CustomResourceDefinitions."""
    parts = [part for part in path.split("/") if part]
    served = (*RESOURCE_TYPES, *custom)
    if parts == ["version"]:
        return dict(_VERSION)
    if parts == ["api"]:
        return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
    if parts == ["apis"]:
        groups = sorted({rtype.group for rtype in served if rtype.group})
        listed = [_group(group, served) for group in groups]
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": listed}
    if len(parts) == 2 and parts[0] == "api":
        return _resource_list("", parts[1])
    if len(parts) == 2 and parts[0] == "apis" and any(rtype.group == parts[1] for rtype in served):
        return _group(parts[1], served)
    if len(parts) == 3 and parts[0] == "apis":
        return _resource_list(parts[1], parts[2], served)
    return None


def _served_type(stored: ResourceType, obj: Obj) -> ResourceType:
    """The type a converted watch serves (events.k8s.io Events are stored as core ones)."""
    group, _, version = str(obj.get("apiVersion", "")).rpartition("/")
    served = (group, version, obj.get("kind"))
    return next((t for t in RESOURCE_TYPES if (t.group, t.version, t.kind) == served), stored)


def _encode(obj: Any) -> bytes:
    return bodies.dumps(obj).encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two sends: avoid the 40 ms delayed-ACK stall
    server: ThreadedHTTPServer

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def log_message(self, format: str, *args: Any) -> None:
        """Requests are counted, not logged (thousands per test run)."""

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _serve(self, method: str) -> None:
        raw = self._read_body()  # always consume the body first: the connection is reused
        decoded: Any = None
        if raw and self.headers.get("Content-Type", "").startswith(PROTOBUF):
            try:
                decoded = decode_protobuf(raw)
            except StatusError as error:
                self._send_json(error.code, error.to_status())
                return
            raw = b""
        try:
            body = bodies.loads(raw) if raw else None  # as deep as kube-apiserver allows
        except ValueError as error:
            body = _apply_yaml(raw) if self.headers.get("Content-Type", "").startswith(APPLY_YAML) else None
            if body is None:
                self._send_json(
                    400, _undecodable(method, self.path, raw, error, self.server.backend).to_status()
                )
                return
        if decoded is not None:
            body = decoded
        url = urllib.parse.urlsplit(self.path)
        query = {
            key: values[-1]
            for key, values in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()
        }
        backend = self.server.backend
        try:
            if method == "GET" and url.path.rstrip("/") in _HEALTH_PATHS:
                self._send_bytes(200, b"ok", content_type="text/plain; charset=utf-8")
                return
            custom: CustomLookup | None = getattr(backend, "custom_resources", None)
            if method == "GET" and (encoded := openapi_document(url.path, custom.types() if custom else ())):
                self._send_bytes(200, encoded)
                return
            served = custom.types() if custom else ()
            document = discovery_document(url.path, served) if method == "GET" else None
            if document is not None:
                self._send_json(200, document)
                return
            route = parse_route(url.path, custom)
            if route is None:
                raise _not_found_path()
            if method == "GET" and route.name is None and query.get("watch") in ("true", "1"):
                self._watch(backend, route, query)
                return
            if method != "GET" and self.server.write_delay_seconds > 0:
                # What etcd adds to every write (--write-delay-ms): a bounded, deliberate wait on this
                # connection's thread only, so writes from many clients overlap as they would.
                time.sleep(self.server.write_delay_seconds)
            code, obj, warnings = backend.handle(method, route, query, body, self.headers)
        except StatusError as error:
            self._send_json(error.code, error.to_status(), error.warnings)
            return
        if isinstance(obj, PlainText):
            self._send_bytes(code, obj.text.encode(), warnings, content_type="text/plain")
            return
        self._send_json(code, obj, warnings)

    def _send_json(self, code: int, obj: Any, warnings: list[str] | None = None) -> None:
        self._send_bytes(code, _encode(obj), warnings)

    def _send_bytes(
        self,
        code: int,
        data: bytes,
        warnings: list[str] | None = None,
        content_type: str = "application/json",
    ) -> None:
        self.send_response(code)
        for warning in warnings or ():  # RFC 7234 warn-code 299, as the apiserver sends them
            escaped = warning.replace("\\", "\\\\").replace('"', '\\"')
            self.send_header("Warning", f'299 - "{escaped}"')
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _watch(self, backend: Backend, route: Route, query: dict[str, str]) -> None:
        try:
            watcher, initial, timeout_seconds = backend.open_watch(route, query)
        except StatusError as error:
            if error.code != 410:
                raise
            self._start_stream()  # an expired version is reported in the stream, as the apiserver does
            self._write_chunk(_encode({"type": "ERROR", "object": error.to_status()}) + b"\n")
            self._write_chunk(b"")
            return
        self._watch_as_table(watcher, query)
        deadline = time.monotonic() + timeout_seconds
        try:
            self._start_stream()
            for event in initial:
                self._send_event(watcher, event)
            if query.get("sendInitialEvents") == "true" and query.get("allowWatchBookmarks") in ("true", "1"):
                pending, marker = backend.bookmark(watcher)  # the end of the initial events, marked
                for event in pending:
                    self._send_event(watcher, event)
                marker["metadata"]["annotations"] = {"k8s.io/initial-events-end": "true"}
                self._write_chunk(_encode({"type": "BOOKMARK", "object": marker}) + b"\n")
            stopping = False
            while (remaining := deadline - time.monotonic()) > 0:
                try:
                    next_event = watcher.events.get(timeout=remaining)
                except queue.Empty:
                    break
                if next_event is None:  # server stopping
                    self.close_connection = stopping = True
                    break
                self._send_event(watcher, next_event)
            if not stopping and query.get("allowWatchBookmarks") in ("true", "1"):
                pending, marker = backend.bookmark(watcher)  # timed out: tell the client where to resume
                for event in pending:
                    self._send_event(watcher, event)
                self._write_chunk(_encode({"type": "BOOKMARK", "object": marker}) + b"\n")
            self._write_chunk(b"")
        except OSError:  # the client went away
            self.close_connection = True
        finally:
            backend.close_watch(watcher)

    def _watch_as_table(self, watcher: Watcher, query: dict[str, str]) -> None:
        """``kubectl get -w`` asks for Tables: each event's object is a one-row Table, the column
        definitions in the first one only, as kube-apiserver sends them."""
        version = table_version(self.headers.get("Accept", ""))
        if version is None:
            return
        convert = watcher.convert
        first = [True]

        def as_table(obj: Obj) -> Obj:
            obj = convert(obj) if convert is not None else obj
            table = to_table(
                watcher.rtype if convert is None else _served_type(watcher.rtype, obj),
                [obj],
                str(obj["metadata"].get("resourceVersion", "")),
                version=version,
                include_object=query.get("includeObject") or "Metadata",
            )
            if not first[0]:
                table["columnDefinitions"] = []
            first[0] = False
            return table

        watcher.convert = as_table

    def _send_event(self, watcher: Watcher, event: WatchEvent) -> None:
        translated = watcher.translate(event)
        if translated is not None:
            event_type, obj = translated
            self._write_chunk(_encode({"type": event_type, "object": obj}) + b"\n")


class ThreadedHTTPServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` whose connection threads are named, tracked and joined on close."""

    daemon_threads = True
    block_on_close = False  # close_connections() joins instead
    request_queue_size = 128  # listen backlog (socketserver's 5 drops a controller's 40 connections at start)

    def __init__(
        self, address: tuple[str, int], backend: Backend, *, write_delay_seconds: float = 0.0
    ) -> None:
        self.backend = backend
        self.write_delay_seconds = write_delay_seconds
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._connections_lock = threading.Lock()
        self._connection_ids = itertools.count(1)
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name=f"apiserver-conn-{next(self._connection_ids)}",
            daemon=True,
        )
        with self._connections_lock:
            self._connections[request] = thread
        thread.start()

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("API emulator connection failed", exc_info=True, extra={"client": str(client_address)})

    def close_connections(self) -> None:
        """Shut every open connection (idle keep-alives included) and join its thread."""
        with self._connections_lock:
            connections = list(self._connections.items())
        for sock, _ in connections:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for _, thread in connections:
            thread.join(_JOIN_SECONDS)

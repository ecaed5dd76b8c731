"""Embedded Kubernetes API emulator: a small, honest TEST DOUBLE, not a kube-apiserver.

Serves, over plain HTTP on loopback, the resources this project uses (resource.k8s.io/v1 slices,
classes, claims (+status), claim templates and taint rules; core v1 nodes, pods, events,
namespaces, configmaps; coordination leases; events.k8s.io events; autoscaling.x-k8s.io
provisioning requests) so that every code path runs through the real ``kubernetes`` client:
create (``generateName``), get, list and watch with label and field selectors, replace, merge,
strategic-merge and JSON patches, the status subresource, delete with finalizers, and optimistic
concurrency (a stale ``resourceVersion`` gets 409). Written objects are validated against the
official JSON schemas (strict) plus the DRA server-side rules we depend on.

Also, as kube-apiserver: OpenAPI v2/v3 documents (``openapi``), Table answers
(``tables``, watches too), dry runs, ``fieldValidation``, server-side apply with managed fields
(``apply``), protobuf request bodies (``protobuf``), namespace lifecycle
(NamespaceLifecycle admission, ``Terminating``, ``/finalize``), pod update rules
(``core_rules``), self-reviews and evictions. The controllers that act on objects
(garbage collection, namespaces, claims from templates, Deployments, Jobs) are stand-ins beside it
(``driver.cluster.controllers``), run by the demo.

Validating admission webhooks (``webhooks``): every write is sent to the webhooks of the
ValidatingWebhookConfigurations that select it, over HTTPS to ``clientConfig.url`` (the emulator
serves no Services, so ``clientConfig.service`` resolves to nothing and fails as a missing Service).

Not emulated: authentication and authorization (every request is the loopback admin, and webhooks
see that user), mutating webhooks and admission policies, pagination (``limit`` is ignored),
graceful pod deletion, protobuf answers (clients that send protobuf accept JSON back).

Threads: one named ``apiserver`` accept thread and one named thread per connection; a watch holds
its connection's thread until it times out, its client goes away or ``stop()`` ends it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import yaml
from kubernetes import client

from driver.cluster.apiserver.apply import APPLY_PATCH, apply_configuration, parse_apply_body, record_update
from driver.cluster.apiserver.crd import CRD_RESOURCE, CustomResourceType
from driver.cluster.apiserver.events import core_event, events_v1_event, events_v1_field_selector
from driver.cluster.apiserver.logs import pod_log
from driver.cluster.apiserver.patch import apply_patch
from driver.cluster.apiserver.policy import admit_pod_priority, check_eviction_budgets
from driver.cluster.apiserver.request import RequestOptions, parse_options
from driver.cluster.apiserver.scheduling import DEFAULT_KUBERNETES_VERSION, ServedResources
from driver.cluster.apiserver.selectors import build_matcher
from driver.cluster.apiserver.serving import PlainText, Route, ThreadedHTTPServer
from driver.cluster.apiserver.store import (
    ResourceType,
    StatusError,
    Store,
    Watcher,
    WatchEvent,
    conflict_error,
    new_timestamp,
    qualified_kind,
)
from driver.cluster.apiserver.strategy import (
    RESOURCE_TYPES,
    build_namespace,
    prepare_create,
    prepare_status_update,
    prepare_update,
)
from driver.cluster.apiserver.tables import table_version, to_table
from driver.cluster.apiserver.validation import ObjectValidator
from driver.cluster.apiserver.webhooks import Attributes, Operation, ValidatingWebhooks

__all__ = ["APIServer"]

log = logging.getLogger(__name__)

Obj = dict[str, Any]
DEFAULT_WATCH_TIMEOUT_SECONDS = 1800
_THREAD_JOIN_SECONDS = 5.0


@dataclass(slots=True)
class _Fault:
    verb: str
    resource: str
    status: int
    remaining: int
    name: str | None


INITIAL_NAMESPACES = ("default", "kube-node-lease", "kube-public", "kube-system")
_IMMORTAL_NAMESPACES = frozenset({"default", "kube-public", "kube-system"})
_NAMESPACES = ResourceType("", "v1", "namespaces", "Namespace", namespaced=False, status_subresource=True)
_PRIORITY_CLASSES = ResourceType(
    "scheduling.k8s.io", "v1", "priorityclasses", "PriorityClass", namespaced=False
)
_BUDGETS = ResourceType("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", namespaced=True)
_CORE_EVENTS = next(t for t in RESOURCE_TYPES if t.group == "" and t.plural == "events")
_WEBHOOK_CONFIGURATIONS = next(t for t in RESOURCE_TYPES if t.kind == "ValidatingWebhookConfiguration")
_OPTIONS_KINDS = {Operation.CREATE: "CreateOptions", Operation.UPDATE: "UpdateOptions",
                  Operation.DELETE: "DeleteOptions"}  # fmt: skip
_REASONS = {
    400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 409: "Conflict", 410: "Gone",
    422: "Invalid", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout",
}  # fmt: skip


class APIServer:
    """The emulator. ``start()`` binds ``host:port`` (0 picks a free port); ``stop()`` ends every
    stream and joins every thread.

    ``disabled_features``: DRA feature gates to emulate as off; their fields are silently dropped
    on write (e.g. ``{"DRAConsumableCapacity"}`` drops ``allowMultipleAllocations`` and
    ``requestPolicy``), as a real apiserver with the gate off does.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        disabled_features: frozenset[str] | set[str] = frozenset(),
        history_limit: int = 1000,
        write_delay_ms: int = 0,
        kubernetes_version: str = DEFAULT_KUBERNETES_VERSION,
    ) -> None:
        self._address = (host, port)
        self.kubernetes_version = kubernetes_version  # the release emulated: its gang API and pod schema
        self._write_delay_seconds = write_delay_ms / 1000  # added to every write, as etcd would
        self._store = Store(history_limit=history_limit)
        self._validator = ObjectValidator(
            disabled_features=frozenset(disabled_features), schema_version=kubernetes_version
        )
        # kinds served through CRDs, and the release's scheduling.k8s.io Workload/PodGroup
        self.custom_resources = ServedResources(self._store, kubernetes_version)
        self._webhooks = ValidatingWebhooks(
            configurations=self._webhook_configurations,
            namespace=lambda name: self._store.get(_NAMESPACES, "", name),
        )
        self._counts: Counter[tuple[str, str]] = Counter()
        self._faults: list[_Fault] = []
        self._hooks_lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd: ThreadedHTTPServer | None = None
        self._serve_thread: threading.Thread | None = None
        for namespace in INITIAL_NAMESPACES:  # what kube-apiserver's system namespaces controller creates
            self._store.create(
                _NAMESPACES,
                build_namespace(namespace),
                lambda obj: prepare_create(_NAMESPACES, obj, self._validator.validate),
            )

    # lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        if self._httpd is not None:
            raise RuntimeError("APIServer already started")
        self._httpd = ThreadedHTTPServer(self._address, self, write_delay_seconds=self._write_delay_seconds)
        self._address = (self._address[0], int(self._httpd.server_address[1]))
        self._serve_thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="apiserver", daemon=True
        )
        self._serve_thread.start()
        log.info("API emulator serving", extra={"url": self.url})

    def stop(self) -> None:
        """End watches, stop accepting, close every connection and join all threads."""
        httpd = self._httpd
        if httpd is None:
            return
        self._stopping.set()
        self._store.close_watchers()
        httpd.shutdown()
        httpd.close_connections()
        httpd.server_close()
        if self._serve_thread is not None:
            self._serve_thread.join(_THREAD_JOIN_SECONDS)
        self._httpd = None
        log.info("API emulator stopped", extra={"url": self.url})

    def __enter__(self) -> APIServer:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """``http://host:port`` with the bound port (kept after ``stop()``)."""
        return f"http://{self._address[0]}:{self._address[1]}"

    def configuration(self) -> client.Configuration:
        """A fresh client ``Configuration`` for this server (never the global default)."""
        configuration = client.Configuration()
        configuration.host = self.url
        return configuration

    def write_kubeconfig(self, path: str) -> None:
        document = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator"}}],
            "current-context": "emulator",
        }
        with open(path, "w", encoding="utf-8") as handle:
            yaml.safe_dump(document, handle)

    # test hooks --------------------------------------------------------------------------------

    def request_count(self, verb: str | None = None, resource: str | None = None) -> int:
        """Requests served so far, by verb (create, update, patch, delete, deletecollection, get,
        list, watch) and resource (``resourceslices``, ``resourceclaims/status``); None matches all."""
        with self._hooks_lock:
            return sum(
                count
                for (v, r), count in self._counts.items()
                if (verb is None or v == verb) and (resource is None or r == resource)
            )

    def reset_counts(self) -> None:
        with self._hooks_lock:
            self._counts.clear()

    def inject_fault(
        self, verb: str, resource: str, status: int, times: int = 1, name: str | None = None
    ) -> None:
        """Fail the next ``times`` matching requests with ``status`` (a Status object, nothing stored)."""
        with self._hooks_lock:
            self._faults.append(_Fault(verb, resource, status, times, name))

    def object_count(self, *plurals: str) -> int:
        """How many objects the given resources hold."""
        return self._store.objects(plurals)

    # request handling (called on connection threads) -------------------------------------------

    def _record(self, verb: str, route: Route) -> None:
        with self._hooks_lock:
            self._counts[(verb, route.resource)] += 1
            for fault in self._faults:
                if (
                    fault.verb == verb
                    and fault.resource == route.resource
                    and fault.name in (None, route.name)
                ):
                    fault.remaining -= 1
                    if fault.remaining <= 0:
                        self._faults.remove(fault)
                    break
            else:
                return
        reason = _REASONS.get(fault.status, "InternalError")
        if fault.status == 409:
            raise conflict_error(route.rtype, route.name or "")
        raise StatusError(code=fault.status, reason=reason, message=f"injected fault: {reason}")

    def handle(
        self, method: str, route: Route, query: dict[str, str], body: Any, headers: Any
    ) -> tuple[int, Obj | PlainText, list[str]]:
        """Serve one request: (status code, body, warnings for ``Warning`` headers)."""
        if route.subresource == "log":  # the one answer that is text, not an object
            if method != "GET":
                raise _method_not_allowed(method)
            self._record("get", route)
            code, text = pod_log(self._store.get(route.rtype, route.namespace or "", route.name or ""), query)
            return code, PlainText(text), []
        options = parse_options(query, headers.get("User-Agent") if headers is not None else None)
        try:
            code, obj = self._dispatch(method, route, query, body, headers, options)
        except StatusError as error:
            error.warnings = list(options.warnings)  # sent with a refusal too, as kube-apiserver does
            raise
        if route.rtype == CRD_RESOURCE and method != "GET":
            self.custom_resources.sync()  # a CRD written: its kind served (or gone) before the answer
        return code, obj, options.warnings

    def _dispatch(
        self,
        method: str,
        route: Route,
        query: dict[str, str],
        body: Any,
        headers: Any,
        options: RequestOptions,
    ) -> tuple[int, Obj]:
        rtype = route.rtype
        if rtype.group == "events.k8s.io" and route.subresource is None:
            return self._events_v1(method, route, query, body, headers, options)
        if rtype.create_only:
            if method != "POST" or route.name is not None:
                raise _method_not_allowed(method)
            self._record("create", route)
            return 201, _review(rtype, _require_object(body))
        if route.name is None:
            if method == "GET":
                self._record("list", route)
                listed = self._list(route, query)
                return 200, self._as_table(
                    route, listed["items"], listed["metadata"], query, headers
                ) or _typed_list(route.rtype, listed)
            if method == "POST":
                self._record("create", route)
                return 201, self._create(route, body, options)
            if method == "DELETE":
                self._record("deletecollection", route)
                return 200, self._delete_collection(route, query, options)
            raise _method_not_allowed(method)
        namespace = route.namespace or ""
        if route.subresource == "finalize":
            if method != "PUT":
                raise _method_not_allowed(method)
            self._record("update", route)
            return 200, self._finalize(route, _require_object(body), options)
        if route.subresource == "eviction":
            if method != "POST":
                raise _method_not_allowed(method)
            self._record("create", route)
            return 201, self._evict(route, _require_object(body), options)
        if route.subresource == "binding":
            if method != "POST":
                raise _method_not_allowed(method)
            self._record("create", route)
            return 201, self._bind(route, _require_object(body), options)
        if method == "GET":
            self._record("get", route)
            obj = self._store.get(rtype, namespace, route.name)
            return 200, self._as_table(route, [obj], obj["metadata"], query, headers) or obj
        if method == "PUT":
            self._record("update", route)
            return 200, self._update(route, _require_object(body), options)
        if method == "PATCH":
            self._record("patch", route)
            content_type = headers.get("Content-Type", "")
            if content_type.startswith(APPLY_PATCH):
                return self._apply(route, body, options)
            if options.force:
                raise _patch_options_invalid("force: Forbidden: may not be specified for non-apply patch")
            return 200, self._patch(route, body, content_type, options)
        if method == "DELETE":
            self._record("delete", route)
            return 200, self._delete(route, body, options)
        raise _method_not_allowed(method)

    @staticmethod
    def _as_table(
        route: Route, items: list[Obj], metadata: Obj, query: dict[str, str], headers: Any
    ) -> Obj | None:
        """The Table a ``kubectl get`` asks for with ``Accept: ...;as=Table``; None for plain objects."""
        version = table_version(headers.get("Accept", "") if headers is not None else "")
        if version is None:
            return None
        return to_table(
            route.rtype,
            items,
            str(metadata.get("resourceVersion", "")),
            version=version,
            include_object=query.get("includeObject") or "Metadata",
        )

    def _list(self, route: Route, query: dict[str, str]) -> Obj:
        rtype = route.rtype
        matches = build_matcher(
            query.get("labelSelector"), query.get("fieldSelector"), rtype.field_labels, rtype.kind
        )
        items, resource_version = self._store.list_objects(rtype, route.namespace)
        return {
            "kind": f"{rtype.kind}List",
            "apiVersion": rtype.api_version,
            "metadata": {"resourceVersion": resource_version},
            "items": [item for item in items if matches(item)],
        }

    def _validate_for(self, options: RequestOptions) -> Any:
        """The validate callable of one request: unknown fields as its ``fieldValidation`` says."""
        return functools.partial(
            self._validator.validate, field_validation=options.field_validation, warnings=options.warnings
        )

    def _webhook_configurations(self) -> list[Obj]:
        return self._store.list_objects(_WEBHOOK_CONFIGURATIONS, None)[0]

    def _admit(
        self,
        route: Route,
        operation: Operation,
        new: Obj | None,
        old: Obj | None,
        options: RequestOptions,
        *,
        delete_options: Any = None,
        kind: tuple[str, str, str] | None = None,
    ) -> None:
        """Validating admission (``webhooks``) of one write, after defaulting and validation and
        before it is stored; raises the refusal as a ``StatusError``."""
        rtype = route.rtype
        name = route.name or str(((new or old or {}).get("metadata") or {}).get("name") or "")
        namespace = name if rtype.group == "" and rtype.plural == "namespaces" else route.namespace or ""
        if operation is Operation.CREATE and new is not None:  # not stored yet: no resourceVersion
            new = {**new, "metadata": {k: v for k, v in new["metadata"].items() if k != "resourceVersion"}}
        operation_options: Obj = {"kind": _OPTIONS_KINDS[operation], "apiVersion": "meta.k8s.io/v1"}
        if operation is Operation.DELETE and isinstance(delete_options, dict):
            operation_options |= {k: v for k, v in delete_options.items() if k not in ("kind", "apiVersion")}
        if options.dry_run:
            operation_options["dryRun"] = ["All"]
        if operation is not Operation.DELETE:
            if options.field_manager:
                operation_options["fieldManager"] = options.field_manager
            if options.field_validation_sent:
                operation_options["fieldValidation"] = options.field_validation.value
        attributes = Attributes(
            rtype=rtype, subresource=route.subresource or "", operation=operation, namespace=namespace,
            name=name, obj=new, old=old, options=operation_options, dry_run=options.dry_run,
            user=dict(LOOPBACK_USER), kind=kind or (rtype.group, rtype.version, rtype.kind),
        )  # fmt: skip
        self._webhooks.admit(attributes, options.warnings)

    def _create(
        self,
        route: Route,
        body: Any,
        options: RequestOptions,
        *,
        admission_options: RequestOptions | None = None,
    ) -> Obj:
        """``admission_options``: the options webhooks are told of, where they are not ``options``
        (an apply that creates)."""
        rtype = route.rtype
        if route.subresource or (rtype.namespaced and route.namespace is None):
            raise _method_not_allowed("POST")
        obj = _require_object(body)
        _check_type(rtype, obj)
        metadata = dict(obj.get("metadata") or {})
        if not metadata.get("name") and not metadata.get("generateName"):
            raise _invalid_name(rtype)
        if rtype.namespaced:
            if metadata.get("namespace", route.namespace) != route.namespace:
                raise StatusError(
                    code=400,
                    reason="BadRequest",
                    message="the namespace of the provided object does not match the namespace sent on the "
                    "request",
                )
            metadata["namespace"] = route.namespace
        else:
            metadata.pop("namespace", None)
        obj = {**obj, "metadata": metadata}
        if rtype.namespaced:
            self._check_namespace_open(rtype, route.namespace or "", metadata.get("name") or "")
        if rtype.plural == "pods":  # the Priority admission plugin
            obj = admit_pod_priority(obj, lambda: self._store.list_objects(_PRIORITY_CLASSES, None)[0])

        def prepare(stamped: Obj) -> Obj:
            new = self._managed(
                rtype, None, prepare_create(rtype, stamped, self._validate_for(options)), options
            )
            self._admit(route, Operation.CREATE, new, None, admission_options or options)
            return new

        return self._store.create(rtype, obj, prepare, dry_run=options.dry_run)

    @staticmethod
    def _managed(
        rtype: ResourceType,
        old: Obj | None,
        new: Obj,
        options: RequestOptions,
        subresource: str | None = None,
    ) -> Obj:
        """A write records the fields it changed under its manager: ``fieldManager``, else the
        user agent's first word, as kube-apiserver does."""
        if rtype.plural == "provisioningrequests":
            return new
        manager = options.field_manager or options.default_manager
        return record_update(rtype, old, new, manager=manager, subresource=subresource)

    def _apply(self, route: Route, body: Any, options: RequestOptions) -> tuple[int, Obj]:
        """Server-side apply: create when missing (201), else merge under the manager's ownership."""
        rtype = route.rtype
        if options.field_manager is None:
            raise _patch_options_invalid("fieldManager: Required value: is required for apply patch")
        if route.subresource or rtype.plural == "provisioningrequests":
            raise StatusError(
                code=415,
                reason="UnsupportedMediaType",
                message="the body of the request was in an unknown format - accepted media types include: "
                "application/json-patch+json, application/merge-patch+json",
            )
        applied = parse_apply_body(body)
        _check_type(rtype, applied)
        manager, force = options.field_manager, options.force
        try:
            self._store.get(rtype, route.namespace or "", route.name or "")
        except StatusError as error:
            if error.code != 404:
                raise
            created = apply_configuration(rtype, None, applied, manager=manager, force=force)
            created["metadata"] = {**created["metadata"], "name": route.name}
            managed_fields = created["metadata"]["managedFields"]
            tracked = RequestOptions(
                dry_run=options.dry_run, field_validation=options.field_validation, warnings=options.warnings
            )
            obj = self._create(
                Route(rtype, route.namespace, None, None), created, tracked, admission_options=options
            )
            if obj["metadata"].get("managedFields") != managed_fields and not options.dry_run:
                obj = self._store.update(rtype, route.namespace or "", route.name or "",
                                         lambda current: {**current, "metadata": {**current["metadata"],
                                                          "managedFields": managed_fields}})  # fmt: skip
            return 201, obj

        def compute(current: Obj) -> Obj:
            merged = apply_configuration(rtype, current, applied, manager=manager, force=force)
            new = prepare_update(rtype, merged, current, self._validate_for(options))
            self._admit(route, Operation.UPDATE, new, current, options)
            return new

        return 200, self._store.update(
            rtype, route.namespace or "", route.name or "", compute, dry_run=options.dry_run
        )

    def _check_namespace_open(self, rtype: ResourceType, namespace: str, name: str) -> None:
        """NamespaceLifecycle admission: no new objects in a namespace that is missing or terminating."""
        try:
            current = self._store.get(_NAMESPACES, "", namespace)
        except StatusError:
            raise StatusError(
                code=404, reason="NotFound", message=f'namespaces "{namespace}" not found',
                details={"name": namespace, "kind": "namespaces"},
            ) from None  # fmt: skip
        if current["metadata"].get("deletionTimestamp"):
            raise StatusError(
                code=403, reason="Forbidden",
                message=f'{rtype.qualified} "{name}" is forbidden: unable to create new content in namespace '
                f"{namespace} because it is being terminated",
                details={"name": name, "group": rtype.group, "kind": rtype.plural,
                         "causes": [{"reason": "NamespaceTerminating", "field": "metadata.namespace",
                                     "message": f"namespace {namespace} is being terminated"}]},
            )  # fmt: skip

    def _update(self, route: Route, body: Obj, options: RequestOptions) -> Obj:
        rtype = route.rtype
        _check_type(rtype, body)
        prepare = prepare_status_update if route.subresource == "status" else prepare_update

        def compute(current: Obj) -> Obj:
            new = self._managed(
                rtype,
                current,
                prepare(rtype, body, current, self._validate_for(options)),
                options,
                route.subresource,
            )
            self._admit(route, Operation.UPDATE, new, current, options)
            return new

        return self._store.update(
            rtype, route.namespace or "", route.name or "", compute, dry_run=options.dry_run
        )

    def _patch(self, route: Route, body: Any, content_type: str, options: RequestOptions) -> Obj:
        rtype = route.rtype
        prepare = prepare_status_update if route.subresource == "status" else prepare_update
        strategic_allowed = rtype.group != "autoscaling.x-k8s.io" and not isinstance(
            rtype, CustomResourceType
        )  # custom resources take no strategic patch

        def compute(current: Obj) -> Obj:
            patched = apply_patch(content_type, current, body, strategic_allowed=strategic_allowed)
            if not isinstance(patched, dict) or not isinstance(patched.get("metadata", {}), dict):
                raise StatusError(code=422, reason="Invalid", message="patch did not produce an object")
            new = self._managed(
                rtype,
                current,
                prepare(rtype, patched, current, self._validate_for(options)),
                options,
                route.subresource,
            )
            self._admit(route, Operation.UPDATE, new, current, options)
            return new

        return self._store.update(
            rtype, route.namespace or "", route.name or "", compute, dry_run=options.dry_run
        )

    def _bind(self, route: Route, binding: Obj, options: RequestOptions) -> Obj:
        """``pods/binding``: set ``spec.nodeName`` once and mark the pod scheduled, as a scheduler's bind
        does. Answers a Status, like the apiserver (the client's ``V1Binding`` parsing of it fails: pass
        ``_preload_content=False``)."""
        target = binding.get("target") or {}
        node = target.get("name")
        if not node or target.get("kind", "Node") != "Node":
            raise StatusError(code=400, reason="BadRequest", message="binding target must name a Node")
        self._admit(route, Operation.CREATE, {"apiVersion": "v1", "kind": "Binding", **binding}, None,
                    options, kind=("", "v1", "Binding"))  # fmt: skip

        def compute(current: Obj) -> Obj:
            spec = current.get("spec") or {}
            if spec.get("nodeName"):
                raise StatusError(
                    code=409,
                    reason="Conflict",
                    message=f'Operation cannot be fulfilled on pods/binding "{route.name}": pod {route.name} '
                    f'is already assigned to node "{spec["nodeName"]}"',
                )
            if spec.get("schedulingGates"):
                raise StatusError(
                    code=409,
                    reason="Conflict",
                    message=f'Operation cannot be fulfilled on pods/binding "{route.name}": pod {route.name} '
                    "has non-empty .spec.schedulingGates",
                    details={"name": route.name, "kind": "pods/binding"},
                )
            status = dict(current.get("status") or {})
            conditions = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"]
            status["conditions"] = [
                *conditions,
                {"type": "PodScheduled", "status": "True", "lastProbeTime": None,
                 "lastTransitionTime": new_timestamp()},
            ]  # fmt: skip
            bound = {**current, "spec": {**spec, "nodeName": node}, "status": status}
            return self._validator.validate(route.rtype, bound, current, update_rules=False)

        self._store.update(route.rtype, route.namespace or "", route.name or "", compute)
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    def _delete(self, route: Route, body: Any, options: RequestOptions, *, admit: bool = True) -> Obj:
        """``admit=False``: a delete the server makes itself (an eviction's), which webhooks never see."""
        rtype = route.rtype
        preconditions = (body or {}).get("preconditions") or {} if isinstance(body, dict) else {}

        def check(current: Obj) -> None:
            for field in ("uid", "resourceVersion"):
                wanted = preconditions.get(field)
                if wanted and wanted != current["metadata"].get(field):
                    raise conflict_error(rtype, route.name or "")

        if isinstance(body, dict) and body.get("dryRun") == ["All"]:  # DeleteOptions may carry it too
            options.dry_run = True
        if rtype.plural == "namespaces":
            return self._delete_namespace(route, options, body)
        if admit:
            current = self._store.get(rtype, route.namespace or "", route.name or "")
            check(current)  # preconditions first, as the storage checks them before admission
            self._admit(route, Operation.DELETE, None, current, options, delete_options=body)
        obj, removed = self._store.delete(
            rtype, route.namespace or "", route.name or "", check, dry_run=options.dry_run
        )
        if not removed or rtype.returns_object_on_delete:
            return obj
        return _success_status(rtype, obj)

    def _evict(self, route: Route, eviction: Obj, options: RequestOptions) -> Obj:
        """``pods/eviction`` (policy/v1 Eviction): the pod is deleted unless a PodDisruptionBudget
        covering it allows no disruption now (429, ``policy``)."""
        delete_options = eviction.get("deleteOptions")
        if delete_options is not None and not isinstance(delete_options, dict):
            version = str(eviction.get("apiVersion") or "policy/v1").rpartition("/")[2]
            raise StatusError(
                code=400,
                reason="BadRequest",
                message=f'Eviction in version "{version}" cannot be handled as a Eviction: json: cannot '
                f"unmarshal {_go_json_type(delete_options)} into Go struct field Eviction.deleteOptions of "
                "type v1.DeleteOptions",
            )
        delete_options = delete_options or {}
        if delete_options.get("dryRun") == ["All"]:
            options.dry_run = True
        namespace = route.namespace or ""
        pod = self._store.get(route.rtype, namespace, route.name or "")
        eviction = {"apiVersion": "policy/v1", "kind": "Eviction", **eviction}
        self._admit(route, Operation.CREATE, eviction, None, options, kind=("policy", "v1", "Eviction"))
        check_eviction_budgets(
            pod,
            self._store.list_objects(_BUDGETS, namespace)[0],
            self._store.list_objects(route.rtype, namespace)[0],
        )
        if not options.dry_run:
            self._mark_evicted(route)
        self._delete(route, delete_options, options, admit=False)
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    def _mark_evicted(self, route: Route) -> None:
        """As kube-apiserver's eviction storage: a pod not yet terminal gets the DisruptionTarget
        condition of the Eviction API before it is deleted, in place of any the client wrote."""

        def mark(current: Obj) -> Obj:
            status = dict(current.get("status") or {})
            if status.get("phase") in ("Succeeded", "Failed"):
                return current
            conditions = list(status.get("conditions") or [])
            previous = next((c for c in conditions if c.get("type") == "DisruptionTarget"), None)
            condition = {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
                         "message": "Eviction API: evicting"}  # fmt: skip
            if previous is not None and previous.get("status") == "True":
                condition["lastTransitionTime"] = previous.get("lastTransitionTime") or new_timestamp()
            else:
                condition["lastTransitionTime"] = new_timestamp()
            conditions = [c for c in conditions if c.get("type") != "DisruptionTarget"] + [condition]
            return {**current, "status": {**status, "conditions": conditions}}

        self._store.update(route.rtype, route.namespace or "", route.name or "", mark)

    def _delete_namespace(self, route: Route, options: RequestOptions, body: Any = None) -> Obj:
        """A namespace with ``spec.finalizers`` turns ``Terminating``: the namespace controller deletes
        its content, then calls ``/finalize``, after which the server removes it."""
        name = route.name or ""
        if name in _IMMORTAL_NAMESPACES:  # the NamespaceLifecycle admission plugin's
            raise StatusError(
                code=403,
                reason="Forbidden",
                message=f'namespaces "{name}" is forbidden: this namespace may not be deleted',
                details={"name": name, "kind": "namespaces"},
            )

        def terminate(current: Obj) -> Obj:
            if current["metadata"].get("deletionTimestamp"):
                return current
            metadata = {**current["metadata"], "deletionTimestamp": new_timestamp()}
            return {
                **current,
                "metadata": metadata,
                "status": {**(current.get("status") or {}), "phase": "Terminating"},
            }

        current = self._store.get(route.rtype, "", name)
        self._admit(route, Operation.DELETE, None, current, options, delete_options=body)
        if not (current.get("spec") or {}).get("finalizers") and not current["metadata"].get("finalizers"):
            obj, _ = self._store.delete(route.rtype, "", name, dry_run=options.dry_run)
            return obj
        return self._store.update(route.rtype, "", name, terminate, dry_run=options.dry_run)

    def _finalize(self, route: Route, body: Obj, options: RequestOptions) -> Obj:
        """``namespaces/<name>/finalize``: only ``spec.finalizers`` changes."""
        _check_type(route.rtype, body)
        finalizers = (body.get("spec") or {}).get("finalizers") or []

        def compute(current: Obj) -> Obj:
            new = {**current, "spec": {**(current.get("spec") or {}), "finalizers": list(finalizers)}}
            self._admit(route, Operation.UPDATE, new, current, options)
            return new

        return self._store.update(route.rtype, "", route.name or "", compute, dry_run=options.dry_run)

    def _delete_collection(self, route: Route, query: dict[str, str], options: RequestOptions) -> Obj:
        rtype = route.rtype
        matches = build_matcher(
            query.get("labelSelector"), query.get("fieldSelector"), rtype.field_labels, rtype.kind
        )
        items, _ = self._store.list_objects(rtype, route.namespace)
        refused: StatusError | None = None
        for item in items:
            if not matches(item):
                continue
            item_route = Route(
                rtype, item["metadata"].get("namespace") or None, item["metadata"]["name"], None
            )
            try:
                self._admit(item_route, Operation.DELETE, None, item, options)
            except StatusError as error:  # the others are still deleted; the first refusal answers
                refused = refused or error
                continue
            if not options.dry_run:
                with contextlib.suppress(StatusError):  # deleted concurrently
                    self._store.delete(rtype, item["metadata"].get("namespace", ""), item["metadata"]["name"])
        if refused is not None:
            raise refused
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}

    def _events_v1(
        self,
        method: str,
        route: Route,
        query: dict[str, str],
        body: Any,
        headers: Any,
        options: RequestOptions,
    ) -> tuple[int, Obj]:
        """events.k8s.io/v1 serves the core/v1 Events, converted (``events``)."""
        core = Route(_CORE_EVENTS, route.namespace, route.name, None)
        query = {**query, "fieldSelector": events_v1_field_selector(query.get("fieldSelector")) or ""}
        if method == "GET" and route.name is None:
            self._record("list", route)
            listed = self._list(core, query)
            items = [events_v1_event(item) for item in listed["items"]]
            table = self._as_table(route, items, listed["metadata"], query, headers)
            return 200, table or _typed_list(
                route.rtype, {**listed, "apiVersion": "events.k8s.io/v1", "items": items}
            )
        if method == "GET":
            self._record("get", route)
            obj = events_v1_event(self._store.get(_CORE_EVENTS, route.namespace or "", route.name or ""))
            return 200, self._as_table(route, [obj], obj["metadata"], query, headers) or obj
        if method == "PATCH" and route.name is not None:
            self._record("patch", route)
            content_type = headers.get("Content-Type", "")

            def compute(current: Obj) -> Obj:
                patched = apply_patch(content_type, events_v1_event(current), body, strategic_allowed=True)
                new = prepare_update(_CORE_EVENTS, core_event(patched), current, self._validate_for(options))
                self._admit(route, Operation.UPDATE, events_v1_event(new), events_v1_event(current), options)
                return new

            stored = self._store.update(
                _CORE_EVENTS, route.namespace or "", route.name, compute, dry_run=options.dry_run
            )
            return 200, events_v1_event(stored)
        converted = core_event(body) if isinstance(body, dict) and body.get("kind") == "Event" else body
        code, obj = self._dispatch(method, core, query, converted, headers, options)
        return code, events_v1_event(obj) if obj.get("kind") == "Event" else obj

    def open_watch(self, route: Route, query: dict[str, str]) -> tuple[Watcher, list[Any], float]:
        rtype = route.rtype
        self._record("watch", route)
        convert = None
        if rtype.group == "events.k8s.io":  # the core/v1 Events, converted
            rtype, convert = _CORE_EVENTS, events_v1_event
            query = {**query, "fieldSelector": events_v1_field_selector(query.get("fieldSelector")) or ""}
        matches = build_matcher(
            query.get("labelSelector"), query.get("fieldSelector"), rtype.field_labels, rtype.kind
        )
        watcher = Watcher(rtype, route.namespace, matches, convert=convert)
        # sendInitialEvents (a WatchList, kubectl 1.37's default): the current objects first
        since = None if query.get("sendInitialEvents") == "true" else query.get("resourceVersion")
        initial = self._store.watch(watcher, since)
        timeout = float(query.get("timeoutSeconds") or DEFAULT_WATCH_TIMEOUT_SECONDS)
        return watcher, initial, timeout

    def bookmark(self, watcher: Watcher) -> tuple[list[WatchEvent], Obj]:
        """Pending events, then the BOOKMARK object carrying the version they reach."""
        pending, resource_version = self._store.drain(watcher)
        rtype = watcher.rtype
        marker = {
            "kind": rtype.kind,
            "apiVersion": rtype.api_version,
            "metadata": {"resourceVersion": str(resource_version)},
        }
        return pending, marker

    def close_watch(self, watcher: Watcher) -> None:
        self._store.unwatch(watcher)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()


LOOPBACK_USER = {"username": "system:admin", "groups": ["system:masters", "system:authenticated"]}


def _review(rtype: ResourceType, review: Obj) -> Obj:
    """A self-review answered as kube-apiserver answers its unauthenticated loopback admin (there
    is no authentication or authorization here): everything is allowed."""
    _check_type(rtype, review)
    answer = {**review, "apiVersion": rtype.api_version, "kind": rtype.kind,
              "metadata": {**(review.get("metadata") or {}), "creationTimestamp": None}}  # fmt: skip
    if rtype.plural == "selfsubjectreviews":
        answer["status"] = {"userInfo": dict(LOOPBACK_USER)}
    else:
        answer["status"] = {
            "allowed": True,
            "reason": "the emulator authorizes every request (loopback admin)",
        }
    return answer


def _patch_options_invalid(cause: str) -> StatusError:
    field, _, problem = cause.partition(": ")
    reason = "FieldValueRequired" if problem.startswith("Required value") else "FieldValueInvalid"
    return StatusError(
        code=422,
        reason="Invalid",
        message=f'PatchOptions.meta.k8s.io "" is invalid: {cause}',
        details={"group": "meta.k8s.io", "kind": "PatchOptions",
                 "causes": [{"reason": reason, "message": problem, "field": field}]},
    )  # fmt: skip


def _method_not_allowed(method: str) -> StatusError:
    return StatusError(
        code=405, reason="MethodNotAllowed", message=f"the server does not allow this method ({method})"
    )


def _go_json_type(value: Any) -> str:
    """The JSON type as Go's encoding/json names it in an UnmarshalTypeError."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return "array" if isinstance(value, list) else "string"


def _require_object(body: Any) -> Obj:
    if not isinstance(body, dict):
        raise StatusError(code=400, reason="BadRequest", message="the request body must be a JSON object")
    return body


def _check_type(rtype: ResourceType, obj: Obj) -> None:
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    if api_version == rtype.api_version and kind and kind != rtype.kind and _served_kind(rtype.group, kind):
        # another kind of the same group and version: the decoder's conversion fails
        raise StatusError(
            code=400,
            reason="BadRequest",
            message=f'{kind} in version "{rtype.version}" cannot be handled as a {rtype.kind}: converting '
            f"({rtype.version}.{kind}) to ({rtype.group.split('.')[0] or 'core'}.{rtype.kind}): "
            "unknown conversion",
        )
    if (api_version and api_version != rtype.api_version) or (kind and kind != rtype.kind):
        raise StatusError(
            code=400,
            reason="BadRequest",
            message=f"the API version in the data ({api_version}) or kind ({kind}) does not match the "
            f"expected {rtype.api_version} {rtype.kind}",
        )


def _served_kind(group: str, kind: str) -> bool:
    return any(t.group == group and t.kind == kind for t in RESOURCE_TYPES)


def _invalid_name(rtype: ResourceType) -> StatusError:
    return StatusError(
        code=422,
        reason="Invalid",
        message=f'{qualified_kind(rtype)} "" is invalid: metadata.name: Required value: '
        "name or generateName is required",
    )


def _success_status(rtype: ResourceType, obj: Obj) -> Obj:
    metadata = obj["metadata"]
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "details": {
            "name": metadata["name"],
            "group": rtype.group,
            "kind": rtype.plural,
            "uid": metadata.get("uid"),
        },
    }


def _typed_list(rtype: ResourceType, listed: Obj) -> Obj:
    """A list as kube-apiserver encodes a built-in kind's: the items carry no apiVersion and kind
    (a custom resource's list is unstructured, and its items keep both)."""
    if isinstance(rtype, CustomResourceType):
        return listed
    items = [{k: v for k, v in item.items() if k not in ("apiVersion", "kind")} for item in listed["items"]]
    return {**listed, "items": items}

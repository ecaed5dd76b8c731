"""CustomResourceDefinitions in the embedded API emulator (a test double).

Creating an ``apiextensions.k8s.io/v1`` CustomResourceDefinition makes its kind served at once (the
real server takes a moment and reports ``Established``; here the CRD is established when the create
returns): create/get/list/watch/update/patch/delete, the ``status`` subresource when declared,
validation, pruning and defaults of its structural schema (``crd_schema``), its
``additionalPrinterColumns`` in Table responses, and discovery with short names and categories.
Deleting the CRD deletes its objects. Only the storage version is served (no conversion webhook
runs here); JSON merge and JSON patches only, as for every custom resource.
"""

from __future__ import annotations

import datetime
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from driver.cluster.apiserver.crd_schema import SchemaError, StructuralSchema
from driver.cluster.apiserver.request import FieldValidation
from driver.cluster.apiserver.store import ResourceType, StatusError, Store, new_timestamp

__all__ = ["CRD_RESOURCE", "CustomResourceType", "CustomResources", "evaluate_json_path"]

Obj = dict[str, Any]
Column = tuple[str, str, int, str]
Printer = Callable[[Obj, datetime.datetime], list[Any]]

CRD_RESOURCE = ResourceType(
    "apiextensions.k8s.io",
    "v1",
    "customresourcedefinitions",
    "CustomResourceDefinition",
    namespaced=False,
    status_subresource=True,
    returns_object_on_delete=True,
)
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_JSON_PATH_STEP = re.compile(
    r"\.([A-Za-z0-9_\-]+)|\[(\d+)\]|\[\?\(@\.([A-Za-z0-9_\-]+)\s*==\s*['\"]([^'\"]*)['\"]\)\]"
)


def evaluate_json_path(obj: Any, path: str) -> Any:
    """The value a printer column's ``jsonPath`` names (``.status.conditions[?(@.type=="Ready")].status``);
    None when absent. Only the steps CRDs use: fields, indexes, equality filters."""
    values = [obj]
    position = 0
    while position < len(path):
        match = _JSON_PATH_STEP.match(path, position)
        if match is None:
            return None
        position = match.end()
        name, index, filter_key, filter_value = match.groups()
        found: list[Any] = []
        for value in values:
            if name is not None and isinstance(value, dict) and name in value:
                found.append(value[name])
            elif index is not None and isinstance(value, list) and int(index) < len(value):
                found.append(value[int(index)])
            elif filter_key is not None and isinstance(value, list):
                found.extend(
                    v for v in value if isinstance(v, dict) and str(v.get(filter_key)) == filter_value
                )
        values = found
    return values[0] if len(values) == 1 else (values or None)


@dataclass(frozen=True, slots=True)
class CustomResourceType(ResourceType):
    """A served custom kind: endpoint facts plus its CRD's schema, columns and names."""

    crd_name: str = ""
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    singular: str = ""
    columns: tuple[tuple[str, str, str, int, str], ...] = ()  # name, type, jsonPath, priority, description
    schema: StructuralSchema | None = field(default=None, compare=False, hash=False)
    openapi_schema: Obj | None = field(default=None, compare=False, hash=False)  # as the CRD wrote it
    status_reset_on_create: bool = True  # the status subresource's strategy drops status on create

    def validate_custom(
        self,
        obj: Obj,
        old: Obj | None,
        *,
        field_validation: FieldValidation | None = None,
        warnings: list[str] | None = None,
    ) -> Obj:
        """Prune, default and validate ``obj`` as the apiserver's custom-resource strategy does."""
        name = str((obj.get("metadata") or {}).get("name", ""))
        if not _DNS_SUBDOMAIN.fullmatch(name) or len(name) > 253:
            raise _invalid(
                self,
                name,
                "metadata.name",
                f'Invalid value: "{name}": a lowercase RFC 1123 '
                "subdomain must consist of lower case alphanumeric characters, '-' or '.'",
            )
        if self.schema is None:
            return obj
        pruned, unknown = self.schema.prune(obj)
        if unknown and field_validation is FieldValidation.STRICT:
            fields = ", ".join(f'unknown field "{_dotted(p)}"' for p in unknown)
            raise StatusError(code=400, reason="BadRequest", message=f"strict decoding error: {fields}")
        if unknown and warnings is not None and field_validation is not FieldValidation.IGNORE:
            warnings.extend(f'unknown field "{_dotted(p)}"' for p in unknown)
        defaulted = self.schema.apply_defaults(pruned)
        try:
            self.schema.validate(defaulted, old)
        except SchemaError as error:
            raise _invalid(self, name, _dotted(error.path), error.problem) from None
        return defaulted

    def table_printer(self) -> tuple[list[Column], Printer]:
        """Name, the CRD's printer columns (priority kept), Age when none is a date of its own."""
        columns: list[Column] = [("Name", "string", 0, "Name must be unique within a namespace.")]
        columns += [
            (name, kind, priority, description) for name, kind, _, priority, description in self.columns
        ]
        paths = [(kind, path) for _, kind, path, _, _ in self.columns]
        if not self.columns:
            columns.append(("Age", "date", 0, "CreationTimestamp of the object."))
            paths = [("date", ".metadata.creationTimestamp")]

        def cells(obj: Obj, now: datetime.datetime) -> list[Any]:
            row: list[Any] = [obj["metadata"]["name"]]
            for kind, path in paths:
                value = evaluate_json_path(obj, path)
                if kind == "date" and isinstance(value, str):
                    value = _age(value, now)
                row.append(value)
            return row

        return columns, cells


def _age(timestamp: str, now: datetime.datetime) -> str:
    from driver.cluster.apiserver.tables import human_duration  # the tables module imports no CRD code

    try:
        when = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return "<unknown>"
    return human_duration((now - when).total_seconds())


def _dotted(path: tuple[str | int, ...]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "<root>"


def _invalid(rtype: ResourceType, name: str, field_path: str, problem: str) -> StatusError:
    return StatusError(
        code=422,
        reason="Invalid",
        message=f'{rtype.kind}.{rtype.group} "{name}" is invalid: {field_path}: {problem}',
        details={
            "name": name,
            "group": rtype.group,
            "kind": rtype.kind,
            "causes": [{"reason": "FieldValueInvalid", "message": problem, "field": field_path}],
        },
    )


def _storage_version(spec: Obj) -> Obj | None:
    versions = spec.get("versions") or ()
    return next((v for v in versions if v.get("storage")), None) or (versions[0] if versions else None)


def build_custom_type(crd: Obj) -> CustomResourceType | None:
    """The served kind of a CRD (its storage version), None when it serves none."""
    spec = crd.get("spec") or {}
    version = _storage_version(spec)
    if version is None or not version.get("served", True):
        return None
    names = spec.get("names") or {}
    schema = ((version.get("schema") or {}).get("openAPIV3Schema")) or None
    columns = tuple(
        (
            str(c["name"]),
            str(c.get("type", "string")),
            str(c.get("jsonPath", "")),
            int(c.get("priority", 0)),
            str(c.get("description", "")),
        )
        for c in version.get("additionalPrinterColumns") or ()
    )
    has_status = "status" in (version.get("subresources") or {})
    return CustomResourceType(
        str(spec["group"]),
        str(version["name"]),
        str(names["plural"]),
        str(names["kind"]),
        namespaced=spec.get("scope") == "Namespaced",
        status_subresource=has_status,
        returns_object_on_delete=True,
        crd_name=str(crd["metadata"]["name"]),
        short_names=tuple(names.get("shortNames") or ()),
        categories=tuple(names.get("categories") or ()),
        singular=str(names.get("singular") or str(names["kind"]).lower()),
        columns=columns,
        schema=StructuralSchema(schema) if schema else None,
        openapi_schema=schema,
        status_reset_on_create=has_status,
    )


class CustomResources:
    """The kinds the stored CRDs define, for one emulator; refreshed after every CRD write."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._types: dict[tuple[str, str, str], CustomResourceType] = {}
        self._built: dict[tuple[str, int], CustomResourceType | None] = {}  # (crd, generation)

    def find(self, group: str, version: str, plural: str) -> ResourceType | None:
        if (group, version, plural) == (CRD_RESOURCE.group, CRD_RESOURCE.version, CRD_RESOURCE.plural):
            return CRD_RESOURCE
        with self._lock:
            return self._types.get((group, version, plural))

    def types(self) -> tuple[ResourceType, ...]:
        with self._lock:
            return (CRD_RESOURCE, *self._types.values())

    def sync(self) -> None:
        """Serve what the stored CRDs define; establish new ones; a removed CRD takes its objects."""
        crds, _ = self._store.list_objects(CRD_RESOURCE, None)
        served: dict[tuple[str, str, str], CustomResourceType] = {}
        for crd in crds:
            if crd["metadata"].get("deletionTimestamp"):
                continue
            key = (str(crd["metadata"]["name"]), int(crd["metadata"].get("generation", 1)))
            if key not in self._built:
                self._built[key] = build_custom_type(crd)
            built = self._built[key]
            if built is not None:
                served[(built.group, built.version, built.plural)] = built
            if not _established(crd):
                self._store.update(CRD_RESOURCE, "", key[0], _establish)
        with self._lock:
            removed = [t for k, t in self._types.items() if k not in served]
            self._types = served
        for rtype in removed:
            items, _ = self._store.list_objects(rtype, None)
            for item in items:
                try:
                    self._store.delete(rtype, item["metadata"].get("namespace", ""), item["metadata"]["name"])
                except StatusError:
                    continue  # deleted meanwhile


def _established(crd: Obj) -> bool:
    conditions = (crd.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


def _establish(current: Obj) -> Obj:
    spec = current.get("spec") or {}
    now = new_timestamp()
    version = _storage_version(spec)
    conditions = [
        {
            "type": "NamesAccepted",
            "status": "True",
            "reason": "NoConflicts",
            "message": "no conflicts found",
            "lastTransitionTime": now,
        },
        {
            "type": "Established",
            "status": "True",
            "reason": "InitialNamesAccepted",
            "message": "the initial names have been accepted",
            "lastTransitionTime": now,
        },
    ]
    status = {
        "conditions": conditions,
        "acceptedNames": spec.get("names") or {},
        "storedVersions": [version["name"]] if version else [],
    }
    return {**current, "status": status}

"""OpenAPI documents of the embedded API emulator (a test double): ``/openapi/v2`` and
``/openapi/v3`` (the index, then one document per group/version served), as kube-apiserver
publishes them, so that kubectl validates ``apply``/``create -f``/``edit`` and ``explain`` prints
the real field docs.

Built from the same official schemas the emulator validates with (the ``kubernetes-validate``
package's non-strict files, which keep the ``x-kubernetes-*`` extensions), turned back into
OpenAPI: ``["string", "null"]`` types become ``string``, ``$ref`` points into ``definitions`` (v2)
or ``components/schemas`` (v3, wrapped in ``allOf`` when it carries a description, as the real
v3 does), and int-or-string and quantity get their OpenAPI spellings. The paths carry one
operation per verb with ``x-kubernetes-action``, ``x-kubernetes-group-version-kind`` and the
write parameters (``dryRun``, ``fieldManager``, ``fieldValidation``), which kubectl reads to learn
that the server validates fields itself.

Documents are built on first request and kept (encoded), since they are large and never change:
start-up pays nothing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from collections.abc import Iterable
from typing import Any

from driver.cluster.apiserver.schema import SCHEMA_VERSION, schema_document
from driver.cluster.apiserver.store import ResourceType
from driver.cluster.apiserver.strategy import RESOURCE_TYPES

__all__ = ["OPENAPI_V2_PATH", "OPENAPI_V3_PREFIX", "openapi_document"]

Obj = dict[str, Any]
OPENAPI_V2_PATH = "/openapi/v2"
OPENAPI_V3_PREFIX = "/openapi/v3"
_META = "io.k8s.apimachinery.pkg.apis.meta.v1"
_INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
_QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
_ALWAYS = (
    f"{_META}.DeleteOptions",
    f"{_META}.Status",
    f"{_META}.WatchEvent",
    f"{_META}.Patch",
    f"{_META}.APIResourceList",
)
_WRITE_PARAMETERS = (
    (
        "dryRun",
        "When present, indicates that modifications should not be persisted. An invalid or "
        "unrecognized dryRun directive will result in an error response and no further processing "
        "of the request. Valid values are: - All: all dry run stages will be processed",
    ),
    (
        "fieldManager",
        "fieldManager is a name associated with the actor or entity that is making these "
        "changes. The value must be less than or 128 characters long, and only contain "
        "printable characters, as defined by https://golang.org/pkg/unicode/#IsPrint.",
    ),
    (
        "fieldValidation",
        "fieldValidation instructs the server on how to handle objects in the request "
        "(POST/PUT/PATCH) containing unknown or duplicate fields. Valid values are: - Ignore: "
        "This will ignore any unknown fields that are silently dropped from the object, and "
        "will ignore all but the last duplicate field that the decoder encounters. - Warn: "
        "This will send a warning via the standard warning response header for each unknown "
        "field that is dropped from the object, and for each duplicate field that is "
        "encountered. The request will still succeed if there are no other errors, and will "
        "only persist the last of any duplicate fields. This is the default in v1.23+ - "
        "Strict: This will fail the request with a BadRequest error if any unknown fields "
        "would be dropped from the object, or if any duplicate fields are present. The error "
        "returned from the server will contain all unknown and duplicate fields encountered.",
    ),
)
_FORCE = (
    "force",
    'Force is going to "force" Apply requests. It means user will re-acquire conflicting '
    "fields owned by other people. Force flag must be unset for non-apply patch requests.",
)
_PATCH_TYPES = (
    "application/apply-patch+yaml",
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
)


@functools.cache
def _definitions() -> dict[str, Obj]:
    """The non-strict schema definitions (the strict ones add ``additionalProperties: false``)."""
    document = schema_document("_definitions.json", strict=False)
    definitions: dict[str, Obj] = document["$defs"]
    return definitions


def _gvk(rtype: ResourceType, kind: str | None = None) -> Obj:
    return {"group": rtype.group, "version": rtype.version, "kind": kind or rtype.kind}


def _definition_name(rtype: ResourceType) -> str | None:
    """The definition whose ``x-kubernetes-group-version-kind`` names this kind, if the schemas have one."""
    wanted = _gvk(rtype)
    for name, definition in _definitions().items():
        if wanted in (definition.get("x-kubernetes-group-version-kind") or ()):
            return name
    return None


def _convert(node: Any, *, v3: bool) -> Any:
    """One schema node from JSON-schema spelling back to OpenAPI."""
    if isinstance(node, list):
        return [_convert(item, v3=v3) for item in node]
    if not isinstance(node, dict):
        return node
    out: Obj = {}
    for key, value in node.items():
        if key == "$ref":
            continue
        if key == "type" and isinstance(value, list):
            types = [item for item in value if item != "null"]
            out["type"] = types[0] if len(types) == 1 else types
        elif key == "properties":
            out[key] = {name: _convert(sub, v3=v3) for name, sub in value.items()}
        elif key == "oneOf":
            continue  # only int-or-string and quantity use it: spelled below
        else:
            out[key] = _convert(value, v3=v3)
    ref = node.get("$ref")
    if ref is not None:
        target = ("#/components/schemas/" if v3 else "#/definitions/") + ref.rsplit("/", 1)[1]
        out = {"allOf": [{"$ref": target}], **out} if v3 and out else {"$ref": target, **out}
    return out


def _definition(name: str, *, v3: bool) -> Obj:
    source = _definitions()[name]
    if name == _INT_OR_STRING:
        if v3:
            return {"oneOf": [{"type": "integer"}, {"type": "string"}], "format": "int-or-string"}
        return {"type": "string", "format": "int-or-string"}
    if name == _QUANTITY:
        converted: Obj = {"description": source.get("description", "")}
        if v3:
            converted["oneOf"] = [{"type": "string"}, {"type": "number"}]
        else:
            converted["type"] = "string"
        return converted
    converted = _convert(source, v3=v3)
    if "x-kubernetes-group-version-kind" in converted:
        for field in ("apiVersion", "kind"):  # kubernetes-validate pins these with an enum: the API does not
            (converted.get("properties") or {}).get(field, {}).pop("enum", None)
    return converted


def _references(node: Any, found: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            name = ref.rsplit("/", 1)[1]
            if name not in found:
                found.add(name)
                _references(_definitions().get(name), found)
        for value in node.values():
            _references(value, found)
    elif isinstance(node, list):
        for item in node:
            _references(item, found)


def _closure(names: Iterable[str]) -> list[str]:
    found: set[str] = set()
    for name in names:
        if name in _definitions() and name not in found:
            found.add(name)
            _references(_definitions()[name], found)
    return sorted(found)


def _custom_definition(rtype: ResourceType) -> Obj:
    """A served custom resource without an official schema: published as a CRD that keeps unknown
    fields is."""
    return {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "x-kubernetes-group-version-kind": [_gvk(rtype)],
    }


def _parameter(name: str, description: str, *, v3: bool) -> Obj:
    if v3:
        return {
            "name": name,
            "in": "query",
            "description": description,
            "schema": {"type": "boolean" if name == "force" else "string", "uniqueItems": True},
        }
    return {
        "name": name,
        "in": "query",
        "description": description,
        "type": "boolean" if name == "force" else "string",
        "uniqueItems": True,
    }


def _operation(rtype: ResourceType, action: str, schema_ref: str, *, v3: bool) -> Obj:
    operation: Obj = {
        "description": f"{action} {rtype.kind}",
        "operationId": f"{action}{rtype.api_version.replace('/', '').replace('.', '')}{rtype.kind}",
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": _gvk(rtype),
    }
    parameters: list[Obj] = []
    if action in ("post", "put", "patch"):
        parameters = [_parameter(name, text, v3=v3) for name, text in _WRITE_PARAMETERS]
        if action == "patch":
            parameters.append(_parameter(*_FORCE, v3=v3))
    elif action in ("delete", "deletecollection"):
        parameters = [_parameter(*_WRITE_PARAMETERS[0], v3=v3)]
    operation["parameters"] = parameters
    target = ("#/components/schemas/" if v3 else "#/definitions/") + schema_ref
    if v3:
        operation["responses"] = {
            "200": {"description": "OK", "content": {"application/json": {"schema": {"$ref": target}}}}
        }
        if action == "patch":
            operation["requestBody"] = {
                "content": {
                    kind: {"schema": {"$ref": f"#/components/schemas/{_META}.Patch"}} for kind in _PATCH_TYPES
                },
                "required": True,
            }
        elif action in ("post", "put"):
            operation["requestBody"] = {"content": {"*/*": {"schema": {"$ref": target}}}, "required": True}
    else:
        operation["responses"] = {"200": {"description": "OK", "schema": {"$ref": target}}}
        operation["consumes"] = list(_PATCH_TYPES) if action == "patch" else ["*/*"]
        operation["produces"] = [
            "application/json",
            "application/yaml",
            "application/vnd.kubernetes.protobuf",
        ]
        if action in ("post", "put", "patch"):
            body = f"{_META}.Patch" if action == "patch" else schema_ref
            parameters.insert(
                0,
                {"name": "body", "in": "body", "required": True, "schema": {"$ref": f"#/definitions/{body}"}},
            )
    return operation


def _paths(rtype: ResourceType, name: str, *, v3: bool) -> dict[str, Obj]:
    base = f"/apis/{rtype.group}/{rtype.version}" if rtype.group else f"/api/{rtype.version}"
    scope = "/namespaces/{namespace}" if rtype.namespaced else ""
    collection = f"{base}{scope}/{rtype.plural}"
    item = collection + "/{name}"
    list_name = f"{name}List" if name in _definitions() and f"{name}List" in _definitions() else name
    paths: dict[str, Obj] = {
        collection: {
            "get": _operation(rtype, "list", list_name, v3=v3),
            "post": _operation(rtype, "post", name, v3=v3),
            "delete": _operation(rtype, "deletecollection", f"{_META}.Status", v3=v3),
        },
        item: {
            "get": _operation(rtype, "get", name, v3=v3),
            "put": _operation(rtype, "put", name, v3=v3),
            "patch": _operation(rtype, "patch", name, v3=v3),
            "delete": _operation(rtype, "delete", name, v3=v3),
        },
    }
    if rtype.status_subresource:
        paths[f"{item}/status"] = {
            "get": _operation(rtype, "get", name, v3=v3),
            "put": _operation(rtype, "put", name, v3=v3),
            "patch": _operation(rtype, "patch", name, v3=v3),
        }
    return paths


def _document(types: Iterable[ResourceType], *, v3: bool) -> Obj:
    schemas: dict[str, Obj] = {}
    paths: dict[str, Obj] = {}
    roots: list[str] = list(_ALWAYS)
    for rtype in types:
        name = _definition_name(rtype)
        if name is None:
            name = f"io.x-k8s.{rtype.group.split('.', 1)[0]}.{rtype.version}.{rtype.kind}"
            schemas[name] = _custom_definition(rtype)
        else:
            roots += [name, f"{name}List"]
        paths.update(_paths(rtype, name, v3=v3))
    for definition in _closure(roots):
        schemas[definition] = _definition(definition, v3=v3)
    info = {"title": "Kubernetes", "version": f"v{SCHEMA_VERSION}"}
    if v3:
        return {"openapi": "3.0.0", "info": info, "paths": paths, "components": {"schemas": schemas}}
    return {"swagger": "2.0", "info": info, "paths": paths, "definitions": schemas}


def _group_version_path(rtype: ResourceType) -> str:
    return f"apis/{rtype.group}/{rtype.version}" if rtype.group else f"api/{rtype.version}"


_lock = threading.Lock()
_encoded: dict[str, bytes] = {}


def _build(path: str) -> bytes | None:
    if path == OPENAPI_V2_PATH:
        return json.dumps(_document(RESOURCE_TYPES, v3=False), separators=(",", ":")).encode()
    group_versions: dict[str, list[ResourceType]] = {}
    for rtype in RESOURCE_TYPES:
        group_versions.setdefault(_group_version_path(rtype), []).append(rtype)
    if path == OPENAPI_V3_PREFIX:
        index = {}
        for group_version in group_versions:
            document = _cached(f"{OPENAPI_V3_PREFIX}/{group_version}")
            assert document is not None
            digest = hashlib.sha512(document).hexdigest().upper()
            index[group_version] = {"serverRelativeURL": f"{OPENAPI_V3_PREFIX}/{group_version}?hash={digest}"}
        return json.dumps({"paths": index}, separators=(",", ":")).encode()
    group_version = path.removeprefix(OPENAPI_V3_PREFIX + "/")
    types = group_versions.get(group_version)
    if types is None:
        return None
    return json.dumps(_document(types, v3=True), separators=(",", ":")).encode()


def _cached(path: str) -> bytes | None:
    with _lock:
        document = _encoded.get(path)
    if document is None:
        document = _build(path)
        if document is not None:
            with _lock:
                _encoded[path] = document
    return document


def openapi_document(path: str, custom: Iterable[ResourceType] = ()) -> bytes | None:
    """The encoded JSON document served at ``path`` (``/openapi/v2``, ``/openapi/v3``,
    ``/openapi/v3/apis/resource.k8s.io/v1``), or None when nothing is served there. ``custom``:
    kinds served through CustomResourceDefinitions; their v3 documents carry the CRD's schema."""
    path = path.rstrip("/")
    if path != OPENAPI_V2_PATH and path != OPENAPI_V3_PREFIX and not path.startswith(OPENAPI_V3_PREFIX + "/"):
        return None
    defined = [t for t in custom if getattr(t, "openapi_schema", None) is not None]
    if defined and path.startswith(OPENAPI_V3_PREFIX):
        return _custom_v3(path, defined)
    return _cached(path)


def _crd_definition_name(rtype: ResourceType) -> str:
    """``io.x-k8s.kueue.v1beta2.ClusterQueue``: the group reversed, as the apiserver names CRD schemas."""
    return ".".join([*reversed(rtype.group.split(".")), rtype.version, rtype.kind])


def _custom_v3(path: str, types: list[ResourceType]) -> bytes | None:
    """The v3 index with the CRDs' group-versions added, or one CRD group-version's document (built
    on each request: CRDs come and go; the built-in documents stay cached)."""
    by_group_version: dict[str, list[ResourceType]] = {}
    for rtype in types:
        by_group_version.setdefault(_group_version_path(rtype), []).append(rtype)
    if path == OPENAPI_V3_PREFIX:
        index = json.loads(_cached(path) or b"{}")
        for group_version in by_group_version:
            document = _custom_v3(f"{OPENAPI_V3_PREFIX}/{group_version}", types) or b""
            digest = hashlib.sha512(document).hexdigest().upper()
            url = f"{OPENAPI_V3_PREFIX}/{group_version}?hash={digest}"
            index["paths"][group_version] = {"serverRelativeURL": url}
        return json.dumps(index, separators=(",", ":")).encode()
    served = by_group_version.get(path.removeprefix(OPENAPI_V3_PREFIX + "/"))
    if served is None:
        return _cached(path)
    schemas: dict[str, Obj] = {}
    paths: dict[str, Obj] = {}
    for rtype in served:
        name = _crd_definition_name(rtype)
        schema = dict(getattr(rtype, "openapi_schema", None) or {})
        meta = {"$ref": f"#/components/schemas/{_META}.ObjectMeta"}
        properties = {**(schema.get("properties") or {}), "metadata": meta}
        schemas[name] = {**schema, "properties": properties, "x-kubernetes-group-version-kind": [_gvk(rtype)]}
        paths.update(_paths(rtype, name, v3=True))
    for definition in _closure([*_ALWAYS, f"{_META}.ObjectMeta"]):
        schemas[definition] = _definition(definition, v3=True)
    info = {"title": "Kubernetes CRD Swagger", "version": "v0.1.0"}
    built = {"openapi": "3.0.0", "info": info, "paths": paths, "components": {"schemas": schemas}}
    return json.dumps(built, separators=(",", ":")).encode()

"""Patch formats of the embedded API emulator (a test double): JSON merge patch (RFC 7386), a
strategic merge patch covering the list strategies of the fields this project writes, and JSON
patch (RFC 6902). All functions return new objects and never mutate their inputs.
"""

from __future__ import annotations

import copy
from typing import Any

from driver.cluster.apiserver.store import StatusError

__all__ = [
    "MERGE_PATCH",
    "JSON_PATCH",
    "STRATEGIC_MERGE_PATCH",
    "apply_json_patch",
    "apply_merge_patch",
    "apply_patch",
    "apply_strategic_merge_patch",
]

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"

# Fields whose Go types carry `patchStrategy:"merge"`: list field name -> merge key (None: a list
# of primitives merged as a set). Every other list is replaced whole, as the apiserver does.
_MERGE_KEYS: dict[str, str | None] = {
    "finalizers": None,
    "ownerReferences": "uid",
    "conditions": "type",
    "addresses": "type",
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "volumeMounts": "name",
    "env": "name",
    "imagePullSecrets": "name",
    "schedulingGates": "name",
    "resourceClaims": "name",
    "resourceClaimStatuses": "name",
    "ports": "containerPort",
    "reservedFor": "uid",
}


def _bad_patch(message: str) -> StatusError:
    return StatusError(code=422, reason="Invalid", message=message, empty_details=True)


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result


def apply_strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Strategic merge: a merge patch whose listed fields merge by key; honours ``$patch``,
    ``$retainKeys`` and ``$deleteFromPrimitiveList/<field>`` directives."""
    merged = _merge_map(target if isinstance(target, dict) else {}, patch)
    return {} if merged is None else merged


def _merge_map(original: dict[str, Any], patch: Any) -> dict[str, Any] | None:
    if not isinstance(patch, dict):
        raise _bad_patch("strategic merge patch: expected an object")
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    result = dict(original)
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys") or key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            result[field] = [item for item in result.get(field) or [] if item not in value]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            merged = _merge_map(result[key], value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list) and key in _MERGE_KEYS and isinstance(result.get(key), list):
            result[key] = _merge_list(result[key], value, _MERGE_KEYS[key])
        elif isinstance(value, dict):
            merged = _merge_map({}, value)
            if merged is not None:
                result[key] = merged
        else:
            result[key] = _strip_directives(value)
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _merge_list(original: list[Any], patch: list[Any], merge_key: str | None) -> list[Any]:
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [
            _strip_directives(item) for item in patch if not (isinstance(item, dict) and "$patch" in item)
        ]
    if merge_key is None:
        return list(original) + [item for item in patch if item not in original]
    result = [copy.deepcopy(item) for item in original]
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            raise _bad_patch(f"strategic merge patch: list item lacks merge key {merge_key!r}")
        index = next((i for i, old in enumerate(result) if old.get(merge_key) == item[merge_key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append(_strip_directives(item))
        else:
            merged = _merge_map(result[index], item)
            if merged is not None:
                result[index] = merged
    return result


def _strip_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_directives(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_strip_directives(item) for item in value]
    return value


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise _bad_patch(f"json patch: path {path!r} must start with '/'")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _parent(document: Any, parts: list[str], path: str) -> tuple[Any, str]:
    node = document
    for part in parts[:-1]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise _bad_patch(f"json patch: doc is missing path: {path}")
    return node, parts[-1]


def _get(document: Any, path: str) -> Any:
    parts = _pointer(path)
    if not parts:
        return document
    node, last = _parent(document, parts, path)
    if isinstance(node, dict) and last in node:
        return node[last]
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        return node[int(last)]
    raise _bad_patch(f"json patch: doc is missing path: {path}")


def _remove(document: Any, path: str) -> Any:
    parts = _pointer(path)
    if not parts:
        raise _bad_patch("json patch: cannot remove the whole document")
    node, last = _parent(document, parts, path)
    if isinstance(node, dict) and last in node:
        return node.pop(last)
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        return node.pop(int(last))
    raise _bad_patch(f"json patch: doc is missing path: {path}")


def _add(document: Any, path: str, value: Any) -> Any:
    parts = _pointer(path)
    if not parts:
        return value
    node, last = _parent(document, parts, path)
    if isinstance(node, dict):
        node[last] = value
    elif isinstance(node, list):
        if last == "-":
            node.append(value)
        elif last.isdigit() and int(last) <= len(node):
            node.insert(int(last), value)
        else:
            raise _bad_patch(f"json patch: index out of range: {path}")
    else:
        raise _bad_patch(f"json patch: doc is missing path: {path}")
    return document


def apply_json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902: add, remove, replace, move, copy and test, all or nothing."""
    if not isinstance(operations, list):
        raise StatusError(code=400, reason="BadRequest", message="json patch: expected a list of operations")
    document = copy.deepcopy(target)
    for operation in operations:
        if not isinstance(operation, dict) or "op" not in operation or "path" not in operation:
            raise _bad_patch(f"json patch: malformed operation {operation!r}")
        op, path = operation["op"], operation["path"]
        if op in ("add", "replace", "test") and "value" not in operation:
            raise _bad_patch(f"json patch: operation {op} at {path} lacks a value")
        if op == "add":
            document = _add(document, path, copy.deepcopy(operation["value"]))
        elif op == "remove":
            _remove(document, path)
        elif op == "replace":
            _get(document, path)
            if _pointer(path):
                _remove(document, path)
            document = _add(document, path, copy.deepcopy(operation["value"]))
        elif op in ("move", "copy"):
            source = operation.get("from")
            if not isinstance(source, str):
                raise _bad_patch(f"json patch: operation {op} at {path} lacks 'from'")
            value = _remove(document, source) if op == "move" else copy.deepcopy(_get(document, source))
            document = _add(document, path, value)
        elif op == "test":
            if _get(document, path) != operation["value"]:
                # kube-apiserver's answer to a failed test: the generic 422, naming nothing
                raise _bad_patch("the server rejected our request due to an error in our request")
        else:
            raise _bad_patch(f"json patch: unsupported operation {op!r}")
    return document


def apply_patch(content_type: str, target: Any, patch: Any, *, strategic_allowed: bool = True) -> Any:
    """Dispatch on the request's ``Content-Type`` (parameters after ``;`` ignored)."""
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type == MERGE_PATCH:
        return apply_merge_patch(target, patch)
    if media_type == STRATEGIC_MERGE_PATCH and strategic_allowed:
        return apply_strategic_merge_patch(target, patch)
    if media_type == JSON_PATCH:
        return apply_json_patch(target, patch)
    raise StatusError(
        code=415,
        reason="UnsupportedMediaType",
        message=f"the body of the request was in an unknown format - accepted media types include: "
        f"{JSON_PATCH}, {MERGE_PATCH}" + ("" if not strategic_allowed else f", {STRATEGIC_MERGE_PATCH}"),
    )

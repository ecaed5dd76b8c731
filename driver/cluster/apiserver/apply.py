"""Server-side apply for the embedded API emulator (a test double): ``PATCH`` with
``Content-Type: application/apply-patch+yaml`` (``kubectl apply --server-side``), after
structured-merge-diff, the library kube-apiserver uses, cut to what the served kinds need:

- every manager's fields are a ``FieldsV1`` set in ``metadata.managedFields``
  (``f:<field>``, ``k:<list-map keys>``, ``v:<set value>``, ``.`` for a list item itself);
- lists merge as the schema says (``x-kubernetes-list-type``: ``map`` by
  ``x-kubernetes-list-map-keys``, ``set``, else ``atomic``), maps unless
  ``x-kubernetes-map-type: atomic``;
- applying a value another manager owns with a different value is a 409 conflict naming the field
  and the manager, unless ``force=true``, which takes the field over;
- fields a manager applied before and no longer applies are removed, unless someone else owns them;
- writes other than apply that name a ``fieldManager`` record that manager's changed fields
  (operation ``Update``) and take them from the others.

The schemas are the same official ones the emulator validates with.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

from driver.cluster.apiserver.schema import schema_document
from driver.cluster.apiserver.store import ResourceType, StatusError, new_timestamp
from driver.cluster.apiserver.validation import schema_file

__all__ = ["APPLY_PATCH", "apply_configuration", "parse_apply_body", "record_update"]

APPLY_PATCH = "application/apply-patch+yaml"
Obj = dict[str, Any]
Fields = dict[str, Any]  # a FieldsV1 tree
Path = tuple[str, ...]
# Set by the server, never owned by a manager (structured-merge-diff strips them).
_IGNORED_TOP = frozenset({"apiVersion", "kind", "status"})
_IGNORED_METADATA = frozenset(
    {
        "name",
        "namespace",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "managedFields",
        "selfLink",
        "generateName",
    }
)


@functools.cache
def _definitions() -> dict[str, Obj]:
    definitions: dict[str, Obj] = schema_document("_definitions.json", strict=False)["$defs"]
    return definitions


# Each schema node's resolution, by identity: the schemas are read once and never change, and
# resolving a ``$ref`` copies its definition, which every write's managedFields walk did per key
# (half the emulator's time under a backlog of pod and claim writes: py-spy, bench_controller.py).
# The node itself is kept beside its resolution so that its id is not reused.
_RESOLVED: dict[int, tuple[Any, Obj]] = {}


def _resolve(schema: Any) -> Obj:
    cached = _RESOLVED.get(id(schema))
    if cached is not None and cached[0] is schema:
        return cached[1]
    resolved = schema
    while isinstance(resolved, dict) and "$ref" in resolved:
        extensions = {key: value for key, value in resolved.items() if key.startswith("x-kubernetes")}
        resolved = {**_definitions().get(resolved["$ref"].rsplit("/", 1)[1], {}), **extensions}
    result = resolved if isinstance(resolved, dict) else {}
    _RESOLVED[id(schema)] = (schema, result)
    return result


def _root_schema(rtype: ResourceType) -> Obj:
    return _schema_of_file(schema_file(rtype))


@functools.cache
def _schema_of_file(name: str) -> Obj:
    """Read once per schema file: every write's managedFields walk its type's schema, and parsing
    the file again each time was a third of the emulator's time under a backlog of claim writes
    (py-spy, bench/bench_controller.py)."""
    try:
        return _resolve(schema_document(name, strict=False))
    except FileNotFoundError:
        return {}


def _child(schema: Obj, key: str) -> Obj:
    properties = schema.get("properties") or {}
    if key in properties:
        return _resolve(properties[key])
    additional = schema.get("additionalProperties")
    return _resolve(additional) if isinstance(additional, dict) else {}


def _item_key(item: Any, keys: list[str]) -> str:
    return "k:" + json.dumps({key: item.get(key) for key in keys if key in item}, separators=(",", ":"))


def _atomic(schema: Obj) -> bool:
    return schema.get("x-kubernetes-map-type") == "atomic" or (
        "properties" not in schema and "additionalProperties" not in schema
    )


def fields_of(value: Any, schema: Obj, *, top: bool = False, status: bool = False) -> Fields:
    """The FieldsV1 tree of everything ``value`` sets (``status`` too, for a status write)."""
    if isinstance(value, dict) and not _atomic(schema):
        tree: Fields = {}
        for key, item in value.items():
            if top and key in _IGNORED_TOP and not (status and key == "status"):
                continue
            child = _child(schema, key)
            if top and key == "metadata" and isinstance(item, dict):
                item = {k: v for k, v in item.items() if k not in _IGNORED_METADATA}
                if not item:
                    continue
            tree[f"f:{key}"] = fields_of(item, child)
        return tree
    if isinstance(value, list):
        list_type = schema.get("x-kubernetes-list-type", "atomic")
        item_schema = _resolve(schema.get("items"))
        if list_type == "map":
            keys = list(schema.get("x-kubernetes-list-map-keys") or [])
            return {_item_key(item, keys): {".": {}, **fields_of(item, item_schema)} for item in value}
        if list_type == "set":
            return {"v:" + json.dumps(item, separators=(",", ":")): {} for item in value}
    return {}


def _fields_pair(
    old: Any, new: Any, schema: Obj, *, top: bool = False, status: bool = False
) -> tuple[Fields, Fields]:
    """``fields_of`` of both sides of a write, walked together: a field whose value is the same on
    both sides (most of a pod's spec on each status write) is walked once, and its tree shared."""
    if old is new or old == new:
        tree = fields_of(new, schema, top=top, status=status)
        return tree, tree
    if not (isinstance(old, dict) and isinstance(new, dict)) or _atomic(schema):
        return fields_of(old, schema, top=top, status=status), fields_of(new, schema, top=top, status=status)
    old_tree: Fields = {}
    new_tree: Fields = {}
    for key in {**old, **new}:
        if top and key in _IGNORED_TOP and not (status and key == "status"):
            continue
        child = _child(schema, key)
        sides = [old.get(key, _ABSENT), new.get(key, _ABSENT)]
        if top and key == "metadata":
            sides = [
                {k: v for k, v in side.items() if k not in _IGNORED_METADATA} or _ABSENT
                if isinstance(side, dict) else side
                for side in sides
            ]  # fmt: skip
        old_item, new_item = sides
        if old_item is _ABSENT and new_item is not _ABSENT:
            new_tree[f"f:{key}"] = fields_of(new_item, child)
        elif new_item is _ABSENT and old_item is not _ABSENT:
            old_tree[f"f:{key}"] = fields_of(old_item, child)
        elif old_item is not _ABSENT:
            old_tree[f"f:{key}"], new_tree[f"f:{key}"] = _fields_pair(old_item, new_item, child)
    return old_tree, new_tree


_ABSENT: Any = object()


def _flatten(tree: Fields, prefix: Path = (), memo: dict[int, set[Path]] | None = None) -> set[Path]:
    """The leaf paths of ``tree``; ``memo`` shares the paths of a subtree met again at the same
    place (the shared trees of ``_fields_pair``)."""
    if memo is not None and id(tree) in memo:
        return memo[id(tree)]
    paths: set[Path] = set()
    for key, child in tree.items():
        path = (*prefix, key)
        if child:
            paths |= _flatten(child, path, memo)
        else:
            paths.add(path)
    if memo is not None:
        memo[id(tree)] = paths
    return paths


def _unflatten(paths: set[Path]) -> Fields:
    tree: Fields = {}
    for path in paths:
        node = tree
        for key in path:
            node = node.setdefault(key, {})
    return tree


def _step(obj: Any, key: str) -> tuple[bool, Any, bool]:
    """One key of a FieldsV1 path from ``obj``: (present, value, final); ``final``: the path ends
    there whatever follows (``.`` and a set's ``v:`` value)."""
    if key == ".":
        return True, obj, True
    kind, _, rest = key.partition(":")
    if kind == "f" and isinstance(obj, dict) and rest in obj:
        return True, obj[rest], False
    if kind == "k" and isinstance(obj, list):
        wanted = json.loads(rest)
        found = next(
            (i for i in obj if isinstance(i, dict) and all(i.get(k) == v for k, v in wanted.items())),
            None,
        )
        return found is not None, found, found is None
    if kind == "v" and isinstance(obj, list):
        value = json.loads(rest)
        return (value in obj), value, True
    return False, None, True


def _lookup(obj: Any, path: Path) -> tuple[bool, Any]:
    """(present, value) at a FieldsV1 path."""
    for key in path:
        present, obj, final = _step(obj, key)
        if final:
            return present, obj
    return True, obj


def _changed(
    tree: Fields,
    old: tuple[bool, Any],
    new: Any,
    old_paths: set[Path],
    prefix: Path = (),
    keyed: bool = False,
) -> set[Path]:
    """The leaf paths of ``tree`` (``new``'s FieldsV1) that ``old`` lacks or holds another value at:
    the paths whose ``_lookup`` differs. Walked beside both objects, one step per key instead of a
    lookup from the root per path; a field equal in both is skipped whole while no list item key
    (``k:``) lies on its path (there, a lookup takes the first item of a key and the tree the last,
    and an item that lost its key fields is looked up as another: only each leaf tells)."""
    changed: set[Path] = set()
    for key, child in tree.items():
        path = (*prefix, key)
        new_present, new_value, new_final = _step(new, key)
        old_present, old_value, old_final = _step(old[1], key) if old[0] else (False, None, True)
        if not child or new_final:
            if path not in old_paths or (old_present, old_value) != (new_present, new_value):
                changed.add(path)
        elif not keyed and key.startswith("f:") and old_present and old_value == new_value:
            continue  # the same field value under the same schema at the same path: nothing below changed
        else:
            below = (old_present and not old_final, old_value)
            changed |= _changed(child, below, new_value, old_paths, path, keyed or key.startswith("k:"))
    return changed


def _remove(obj: Any, path: Path) -> None:
    """Remove the field, list item or set value at ``path`` from ``obj`` (in place)."""
    if path and path[-1] == ".":
        path = path[:-1]
    if not path:
        return
    present, parent = _lookup(obj, path[:-1])
    if not present:
        return
    kind, _, rest = path[-1].partition(":")
    if kind == "f" and isinstance(parent, dict):
        parent.pop(rest, None)
    elif kind == "k" and isinstance(parent, list):
        wanted = json.loads(rest)
        parent[:] = [
            i for i in parent if not (isinstance(i, dict) and all(i.get(k) == v for k, v in wanted.items()))
        ]
    elif kind == "v" and isinstance(parent, list):
        value = json.loads(rest)
        parent[:] = [i for i in parent if i != value]


def _merge(live: Any, applied: Any, schema: Obj) -> Any:
    if isinstance(applied, dict) and isinstance(live, dict) and not _atomic(schema):
        merged = dict(live)
        for key, value in applied.items():
            merged[key] = (
                _merge(live.get(key), value, _child(schema, key)) if key in live else copy.deepcopy(value)
            )
        return merged
    if isinstance(applied, list) and isinstance(live, list):
        list_type = schema.get("x-kubernetes-list-type", "atomic")
        item_schema = _resolve(schema.get("items"))
        if list_type == "map":
            keys = list(schema.get("x-kubernetes-list-map-keys") or [])
            result = list(live)
            for item in applied:
                key = _item_key(item, keys)
                index = next((n for n, old in enumerate(result) if _item_key(old, keys) == key), None)
                if index is None:
                    result.append(copy.deepcopy(item))
                else:
                    result[index] = _merge(result[index], item, item_schema)
            return result
        if list_type == "set":
            return list(live) + [copy.deepcopy(item) for item in applied if item not in live]
    return copy.deepcopy(applied)


def _path_text(path: Path) -> str:
    """A field path as structured-merge-diff prints it: ``.spec.containers[name="c"].image``."""
    text = ""
    for key in path:
        kind, _, rest = key.partition(":")
        if kind == "f":
            text += f".{rest}"
        elif kind == "k":
            text += "[" + ",".join(f"{k}={json.dumps(v)}" for k, v in json.loads(rest).items()) + "]"
        elif kind == "v":
            text += f"[={rest}]"
    return text


def _manager_text(entry: Obj) -> str:
    if entry.get("operation") == "Update":
        return f'"{entry.get("manager", "")}" using {entry.get("apiVersion", "")}'
    return f'"{entry.get("manager", "")}"'


def _conflict_error(conflicts: list[tuple[Obj, Path]]) -> StatusError:
    causes = [
        {
            "reason": "FieldManagerConflict",
            "message": f"conflict with {_manager_text(entry)}",
            "field": _path_text(path),
        }
        for entry, path in conflicts
    ]
    if len(conflicts) == 1:
        entry, path = conflicts[0]
        message = f"Apply failed with 1 conflict: conflict with {_manager_text(entry)}: {_path_text(path)}"
    else:
        lines: list[str] = []
        for manager in sorted({_manager_text(entry) for entry, _ in conflicts}):
            lines.append(f"conflicts with {manager}:")
            lines += [f"- {_path_text(path)}" for entry, path in conflicts if _manager_text(entry) == manager]
        message = f"Apply failed with {len(conflicts)} conflicts: " + "\n".join(lines)
    return StatusError(code=409, reason="Conflict", message=message, details={"causes": causes})


def parse_apply_body(body: Any) -> Obj:
    """The applied configuration (YAML or JSON; the HTTP layer hands undecodable bodies as text)."""
    if isinstance(body, dict):
        return body
    raise StatusError(code=400, reason="BadRequest", message="the apply patch must be a YAML or JSON object")


def _entry(manager: str, operation: str, api_version: str, fields: Fields) -> Obj:
    return {
        "manager": manager,
        "operation": operation,
        "apiVersion": api_version,
        "time": new_timestamp(),
        "fieldsType": "FieldsV1",
        "fieldsV1": fields,
    }


def apply_configuration(
    rtype: ResourceType, live: Obj | None, applied: Obj, *, manager: str, force: bool
) -> Obj:
    """The object after ``manager`` applies ``applied`` to ``live`` (None: it does not exist yet),
    with its ``managedFields``; raises 409 on conflicts unless ``force``."""
    schema = _root_schema(rtype)
    applied_fields = fields_of(applied, schema, top=True)
    applied_paths = _flatten(applied_fields)
    base: Obj = copy.deepcopy(live) if live is not None else {}
    entries = list((base.get("metadata") or {}).get("managedFields") or [])
    mine = next((e for e in entries if e.get("manager") == manager and e.get("operation") == "Apply"), None)
    others = [e for e in entries if e is not mine]
    conflicts: list[tuple[Obj, Path]] = []
    kept: list[Obj] = []
    for entry in others:
        owned = _flatten(entry.get("fieldsV1") or {})
        clashing = sorted(
            path
            for path in owned & applied_paths
            if path[-1] != "." and _lookup(base, path) != _lookup(applied, path)
        )
        if clashing and not force:
            conflicts += [(entry, path) for path in clashing]
        remaining = owned - set(clashing) if force else owned
        if remaining:
            kept.append({**entry, "fieldsV1": _unflatten(remaining)})
    if conflicts:
        raise _conflict_error(conflicts)
    if mine is not None:
        others_paths: set[Path] = set().union(*(_flatten(e.get("fieldsV1") or {}) for e in kept))
        gone = _flatten(mine.get("fieldsV1") or {}) - applied_paths - others_paths
        # whole list items first (their "." path), then fields, deepest first
        for path in sorted(gone, key=lambda p: (p[-1] != ".", -len(p))):
            _remove(base, path)
    content = {key: value for key, value in applied.items() if key not in ("apiVersion", "kind", "status")}
    metadata = {k: v for k, v in (content.pop("metadata", None) or {}).items() if k != "managedFields"}
    merged: Obj = _merge(base, content, schema)
    merged["metadata"] = _merge(base.get("metadata") or {}, metadata, _child(schema, "metadata"))
    entry = _entry(manager, "Apply", rtype.api_version, applied_fields)
    if (
        mine is not None
        and mine.get("fieldsV1") == applied_fields
        and _without_managed(merged) == _without_managed(live or {})
    ):
        entry["time"] = mine.get("time")  # a no-op apply changes nothing, its timestamp included
    merged["metadata"]["managedFields"] = [*kept, entry]
    return merged


def _without_managed(obj: Obj) -> Obj:
    return {**obj, "metadata": {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}}


def record_update(
    rtype: ResourceType, old: Obj | None, new: Obj, *, manager: str, subresource: str | None = None
) -> Obj:
    """``new`` with ``manager`` (operation ``Update``) owning the fields this write changed, taken
    from the other managers."""
    schema = _root_schema(rtype)
    status = subresource == "status"
    if old is None:
        new_fields = fields_of(new, schema, top=True, status=status)
        new_paths, old_paths = _flatten(new_fields), set()
    else:
        old_fields, new_fields = _fields_pair(old, new, schema, top=True, status=status)
        memo: dict[int, set[Path]] = {}
        new_paths, old_paths = _flatten(new_fields, memo=memo), _flatten(old_fields, memo=memo)
    changed = _changed(new_fields, (old is not None, old), new, old_paths)
    previous = (((old or {}).get("metadata") or {}).get("managedFields")) or []
    sent = (new.get("metadata") or {}).get("managedFields")
    # As kube-apiserver's field manager: managed fields a client writes (on create, or changed
    # from the live ones) are taken as they are; otherwise the live ones carry on.
    base = sent if sent and sent != previous else previous
    if not changed and old is not None:  # nothing of this write's own: the entries stay as they were
        return {**new, "metadata": {**new["metadata"], "managedFields": base}} if base else new
    entries = list(base)
    mine = next(
        (e for e in entries if e.get("manager") == manager and e.get("operation") == "Update"
         and e.get("subresource") == subresource),
        None,
    )  # fmt: skip
    kept = []
    for entry in entries:
        if entry is mine:
            continue
        try:
            remaining = (_flatten(entry.get("fieldsV1") or {}) - changed) & new_paths
        except (RecursionError, AttributeError, TypeError):  # a client's entry we cannot read: kept as sent
            kept.append(entry)
            continue
        if remaining:
            kept.append({**entry, "fieldsV1": _unflatten(remaining)})
    owned = ((_flatten(mine.get("fieldsV1") or {}) if mine else set()) | changed) & new_paths
    if owned:
        entry = _entry(manager, "Update", rtype.api_version, _unflatten(owned))
        if subresource:
            entry["subresource"] = subresource
        kept.append(entry)
    return {**new, "metadata": {**new["metadata"], "managedFields": kept}} if kept else new

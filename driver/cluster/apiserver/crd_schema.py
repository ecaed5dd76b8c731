"""Structural schemas of CustomResourceDefinitions for the embedded API emulator (a test double).

What kube-apiserver's apiextensions does with a version's ``openAPIV3Schema`` when a custom object
is written, in its order: prune unknown fields (kept under ``x-kubernetes-preserve-unknown-fields``,
``x-kubernetes-embedded-resource`` keeps ``apiVersion``/``kind``/``metadata``), apply ``default``\\s,
then validate: types (``nullable``, ``x-kubernetes-int-or-string``), ``enum``, ``pattern``, lengths,
item and property counts, bounds, ``allOf``/``anyOf``/``oneOf``/``not``, ``x-kubernetes-list-type``
``set`` and ``map`` (keys unique), and the CEL rules of ``x-kubernetes-validations``.

Departures, said where they apply: ``format`` is not checked; a CEL rule our CEL library cannot
compile or run (Kubernetes' own library functions such as ``isSorted``, ``quantity``) is skipped,
not failed; transition rules (``oldSelf``) run only where the old value is found by property names.
Go (RE2) patterns are rewritten for Python's ``re`` (inline flags moved to the front, ``\\z``, POSIX
classes).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import cel

__all__ = ["SchemaError", "StructuralSchema", "python_pattern"]

Path = tuple[str | int, ...]
Obj = dict[str, Any]

_POSIX = {
    "[:alpha:]": "a-zA-Z",
    "[:digit:]": "0-9",
    "[:alnum:]": "a-zA-Z0-9",
    "[:upper:]": "A-Z",
    "[:lower:]": "a-z",
    "[:space:]": r"\s",
    "[:xdigit:]": "0-9A-Fa-f",
    "[:punct:]": r"!-/:-@\[-`{-~",
}
_LEADING_FLAGS = re.compile(r"^(\^?)\(\?([imsU]+)\)")
_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


class SchemaError(Exception):
    """The first place where a value breaks the schema, in the apiserver's field-path words."""

    def __init__(self, *, path: Path, problem: str) -> None:
        super().__init__(problem)
        self.path, self.problem = path, problem


def python_pattern(pattern: str) -> re.Pattern[str]:
    """A Go RE2 pattern as a Python regex: ``^(?i)x`` -> ``(?i)^x`` (Python wants global flags
    first), ``\\z`` -> ``\\Z``, POSIX classes spelled out."""
    text = pattern
    match = _LEADING_FLAGS.match(text)
    if match:
        flags = match.group(2).replace("U", "")
        text = (f"(?{flags})" if flags else "") + match.group(1) + text[match.end() :]
    text = text.replace(r"\z", r"\Z")
    for posix, spelled in _POSIX.items():
        text = text.replace(posix, spelled)
    return re.compile(text)


def _type_name(value: Any) -> str:
    for name, test in _TYPES.items():
        if name != "number" and test(value):
            return name
    return "number" if _TYPES["number"](value) else "null"


def _message(rule: Obj) -> str:
    if rule.get("message"):
        return str(rule["message"])
    return f"failed rule: {rule.get('rule')}"


def _cel_value(value: Any) -> Any:
    return value


@dataclass(slots=True)
class _Rule:
    rule: Obj
    program: Any
    transition: bool


@dataclass(slots=True)
class _Node:
    """One compiled schema node."""

    schema: Obj
    properties: dict[str, _Node] = field(default_factory=dict)
    additional: _Node | None = None
    additional_allowed: bool = False
    items: _Node | None = None
    pattern: re.Pattern[str] | None = None
    rules: list[_Rule] = field(default_factory=list)
    sub_schemas: dict[str, list[_Node]] = field(default_factory=dict)


def _compile(schema: Obj) -> _Node:
    node = _Node(schema=schema)
    for name, sub in (schema.get("properties") or {}).items():
        node.properties[name] = _compile(sub)
    additional = schema.get("additionalProperties")
    if isinstance(additional, dict):
        node.additional = _compile(additional)
    node.additional_allowed = additional is True or bool(schema.get("x-kubernetes-preserve-unknown-fields"))
    if isinstance(schema.get("items"), dict):
        node.items = _compile(schema["items"])
    if "pattern" in schema:
        node.pattern = python_pattern(str(schema["pattern"]))
    for rule in schema.get("x-kubernetes-validations") or ():
        try:
            program = cel.compile(str(rule.get("rule", "")))
        except Exception:  # syntax our CEL library lacks: the rule is skipped (module doc)
            continue
        node.rules.append(_Rule(rule, program, "oldSelf" in str(rule.get("rule", ""))))
    for key in ("allOf", "anyOf", "oneOf"):
        if schema.get(key):
            node.sub_schemas[key] = [_compile(sub) for sub in schema[key]]
    if isinstance(schema.get("not"), dict):
        node.sub_schemas["not"] = [_compile(schema["not"])]
    return node


class StructuralSchema:
    """One version's ``openAPIV3Schema``, compiled once."""

    def __init__(self, schema: Obj) -> None:
        self._root = _compile(schema)

    # pruning and defaults ----------------------------------------------------------------------

    def prune(self, obj: Obj) -> tuple[Obj, list[Path]]:
        """``obj`` without the fields the schema does not know, and their paths."""
        unknown: list[Path] = []
        pruned = self._prune(self._root, obj, (), unknown, top=True)
        return pruned, unknown

    def _prune(self, node: _Node, value: Any, path: Path, unknown: list[Path], *, top: bool = False) -> Any:
        if isinstance(value, dict) and (node.properties or node.additional or not node.additional_allowed):
            if node.schema.get("type") not in (None, "object") and not node.properties:
                return value
            kept: Obj = {}
            embedded = top or bool(node.schema.get("x-kubernetes-embedded-resource"))
            for name, item in value.items():
                if embedded and name in ("apiVersion", "kind", "metadata"):
                    kept[name] = item
                elif name in node.properties:
                    kept[name] = self._prune(node.properties[name], item, (*path, name), unknown)
                elif node.additional is not None:
                    kept[name] = self._prune(node.additional, item, (*path, name), unknown)
                elif node.additional_allowed or (node.schema.get("type") is None and not node.properties):
                    kept[name] = item
                else:
                    unknown.append((*path, name))
            return kept
        if isinstance(value, list) and node.items is not None:
            return [
                self._prune(node.items, item, (*path, index), unknown) for index, item in enumerate(value)
            ]
        return value

    def apply_defaults(self, obj: Obj) -> Obj:
        result = self._default(self._root, obj)
        return result if isinstance(result, dict) else obj

    def _default(self, node: _Node, value: Any) -> Any:
        if isinstance(value, dict):
            out = dict(value)
            for name, sub in node.properties.items():
                if name not in out and "default" in sub.schema:
                    out[name] = _copy(sub.schema["default"])
                if name in out:
                    out[name] = self._default(sub, out[name])
            if node.additional is not None:
                for name in out:
                    if name not in node.properties:
                        out[name] = self._default(node.additional, out[name])
            return out
        if isinstance(value, list) and node.items is not None:
            return [self._default(node.items, item) for item in value]
        return value

    # validation --------------------------------------------------------------------------------

    def validate(self, obj: Obj, old: Obj | None) -> None:
        """Raise SchemaError at the first violation (metadata is the server's, not the schema's)."""
        body = {k: v for k, v in obj.items() if k != "metadata"}
        old_body = None if old is None else {k: v for k, v in old.items() if k != "metadata"}
        self._check(self._root, body, old_body, ())

    def _check(self, node: _Node, value: Any, old: Any, path: Path) -> None:
        schema = node.schema
        if value is None:
            if schema.get("nullable"):
                return
            if schema.get("type"):
                raise SchemaError(
                    path=path,
                    problem=f'Invalid value: "null": {path_end(path)} in body must '
                    f'be of type {schema["type"]}: "null"',
                )
            return
        declared = schema.get("type")
        if schema.get("x-kubernetes-int-or-string"):
            if not (isinstance(value, str) or _TYPES["integer"](value)):
                raise SchemaError(
                    path=path,
                    problem=f'Invalid value: "{_type_name(value)}": {path_end(path)} '
                    "in body must be of type integer,string",
                )
        elif declared and not _TYPES.get(str(declared), lambda _v: True)(value):
            raise SchemaError(
                path=path,
                problem=f'Invalid value: "{_type_name(value)}": {path_end(path)} in body must be of type '
                f'{declared}: "{_type_name(value)}"',
            )
        self._check_value(node, value, path)
        if isinstance(value, dict):
            for name in schema.get("required") or ():
                if name not in value:
                    raise SchemaError(path=(*path, name), problem="Required value")
            for name, item in value.items():
                sub = node.properties.get(name) or node.additional
                if sub is not None:
                    old_item = old.get(name) if isinstance(old, dict) else None
                    self._check(sub, item, old_item, (*path, name))
        elif isinstance(value, list) and node.items is not None:
            for index, item in enumerate(value):
                self._check(node.items, item, None, (*path, index))
        self._check_rules(node, value, old, path)

    def _check_value(self, node: _Node, value: Any, path: Path) -> None:
        schema = node.schema
        if "enum" in schema and value not in schema["enum"]:
            allowed = ", ".join(f'"{item}"' for item in schema["enum"])
            raise SchemaError(path=path, problem=f'Unsupported value: "{value}": supported values: {allowed}')
        if isinstance(value, str):
            if node.pattern is not None and not node.pattern.search(value):
                raise SchemaError(
                    path=path,
                    problem=f'Invalid value: "{value}": {path_end(path)} in body '
                    f"should match '{schema['pattern']}'",
                )
            if "maxLength" in schema and len(value) > int(schema["maxLength"]):
                raise SchemaError(
                    path=path, problem=f"Too long: may not be more than {schema['maxLength']} bytes"
                )
            if "minLength" in schema and len(value) < int(schema["minLength"]):
                raise SchemaError(
                    path=path,
                    problem=f"Invalid value: {path_end(path)} in body should be at "
                    f"least {schema['minLength']} chars long",
                )
        if _TYPES["number"](value):
            number = Decimal(str(value))
            if "maximum" in schema and (
                number > Decimal(str(schema["maximum"]))
                or (schema.get("exclusiveMaximum") and number == Decimal(str(schema["maximum"])))
            ):
                raise SchemaError(
                    path=path,
                    problem=f"Invalid value: {value}: {path_end(path)} in body should "
                    f"be less than or equal to {schema['maximum']}",
                )
            if "minimum" in schema and (
                number < Decimal(str(schema["minimum"]))
                or (schema.get("exclusiveMinimum") and number == Decimal(str(schema["minimum"])))
            ):
                raise SchemaError(
                    path=path,
                    problem=f"Invalid value: {value}: {path_end(path)} in body should "
                    f"be greater than or equal to {schema['minimum']}",
                )
        if isinstance(value, list):
            if "maxItems" in schema and len(value) > int(schema["maxItems"]):
                raise SchemaError(
                    path=path, problem=f"Too many: {len(value)}: must have at most {schema['maxItems']} items"
                )
            if "minItems" in schema and len(value) < int(schema["minItems"]):
                raise SchemaError(
                    path=path,
                    problem=f"Invalid value: {path_end(path)} in body should have at "
                    f"least {schema['minItems']} items",
                )
            self._check_list_type(schema, value, path)
        if isinstance(value, dict):
            if "maxProperties" in schema and len(value) > int(schema["maxProperties"]):
                raise SchemaError(
                    path=path,
                    problem=f"Too many: {len(value)}: must have at most {schema['maxProperties']} items",
                )
            if "minProperties" in schema and len(value) < int(schema["minProperties"]):
                raise SchemaError(
                    path=path,
                    problem=f"Invalid value: {path_end(path)} in body should have at "
                    f"least {schema['minProperties']} properties",
                )
        for sub in node.sub_schemas.get("allOf", ()):
            self._check_value(sub, value, path)
        any_of = node.sub_schemas.get("anyOf")
        if any_of and not any(self._passes(sub, value, path) for sub in any_of):
            raise SchemaError(path=path, problem="Invalid value: must validate at least one schema (anyOf)")
        one_of = node.sub_schemas.get("oneOf")
        if one_of and sum(self._passes(sub, value, path) for sub in one_of) != 1:
            raise SchemaError(
                path=path, problem="Invalid value: must validate one and only one schema (oneOf)"
            )
        for sub in node.sub_schemas.get("not", ()):
            if self._passes(sub, value, path):
                raise SchemaError(path=path, problem="Invalid value: must not validate the schema (not)")

    def _passes(self, node: _Node, value: Any, path: Path) -> bool:
        try:
            self._check_value(node, value, path)
            if isinstance(value, dict):
                for name in node.schema.get("required") or ():
                    if name not in value:
                        return False
        except SchemaError:
            return False
        return True

    @staticmethod
    def _check_list_type(schema: Obj, value: list[Any], path: Path) -> None:
        list_type = schema.get("x-kubernetes-list-type")
        if list_type == "set":
            seen: list[Any] = []
            for index, item in enumerate(value):
                if item in seen:
                    raise SchemaError(path=(*path, index), problem=f"Duplicate value: {item!r}")
                seen.append(item)
        elif list_type == "map":
            keys = tuple(schema.get("x-kubernetes-list-map-keys") or ())
            found: set[tuple[Any, ...]] = set()
            for index, item in enumerate(value):
                if not isinstance(item, dict):
                    continue
                key = tuple(repr(item.get(k)) for k in keys)
                if key in found:
                    named = ", ".join(f"{k}: {item.get(k)!r}" for k in keys)
                    raise SchemaError(path=(*path, index), problem=f"Duplicate value: map[{named}]")
                found.add(key)

    @staticmethod
    def _check_rules(node: _Node, value: Any, old: Any, path: Path) -> None:
        for rule in node.rules:
            if rule.transition and old is None:
                continue  # transition rules run on updates only
            variables = {"self": _cel_value(value)}
            if rule.transition:
                variables["oldSelf"] = _cel_value(old)
            try:
                result = rule.program.execute(cel.Context(variables=variables))
            except Exception:  # a function our CEL library lacks: skipped (module doc)
                continue
            if result is False:
                where = path
                if rule.rule.get("fieldPath"):
                    where = (*path, *[p for p in str(rule.rule["fieldPath"]).split(".") if p])
                raise SchemaError(path=where, problem=f"Invalid value: {_message(rule.rule)}")


def path_end(path: Path) -> str:
    """The dotted path the apiserver names in schema messages (``spec.queueName``)."""
    return ".".join(str(part) for part in path) or "<root>"


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value

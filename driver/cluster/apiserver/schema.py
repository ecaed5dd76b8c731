"""Compiled checks for the official Kubernetes JSON schemas, for the embedded API emulator (a test double).

The schemas come from the ``kubernetes-validate`` package (strict variant: every object schema has
``additionalProperties: false``). They use only ``type``, ``properties``, ``additionalProperties``,
``required``, ``items``, ``enum``, ``oneOf`` and ``$ref`` into one ``_definitions.json``
(``format`` is informational: jsonschema does not check it by default either). Each schema is
compiled once into nested closures, about 50 times faster than walking it with ``jsonschema``; a
test checks that both agree.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Callable
from importlib import resources
from typing import Any

__all__ = ["SCHEMA_VERSION", "SchemaViolation", "schema_check", "schema_document"]

Path = tuple[str | int, ...]
Check = Callable[[Any, Path], None]

_SCHEMA_ROOT = resources.files("kubernetes_validate").joinpath("kubernetes-json-schema")
_STRICT_DIR = re.compile(r"^v(\d+)\.(\d+)\.(\d+)-local-strict$")
_SUPPORTED = frozenset(
    {"type", "properties", "additionalProperties", "required", "items", "enum", "oneOf", "$ref"}
)


def _newest_strict_dir() -> str:
    versions = []
    for entry in _SCHEMA_ROOT.iterdir():
        match = _STRICT_DIR.fullmatch(entry.name)
        if match:
            versions.append((tuple(int(part) for part in match.groups()), entry.name))
    return max(versions)[1]


_SCHEMA_DIR = _newest_strict_dir()
SCHEMA_VERSION = _SCHEMA_DIR.removeprefix("v").removesuffix("-local-strict")
"""The Kubernetes version whose schemas are used: the newest the package ships."""


class SchemaViolation(Exception):
    """The first place where a value breaks its schema: (path, problem)."""

    def __init__(self, *, path: Path, problem: str, kind: str) -> None:
        super().__init__(problem)
        self.path, self.problem, self.kind = path, problem, kind


def schema_document(name: str, *, strict: bool = True, version: str | None = None) -> Any:
    """One JSON file of the schema directory (``resourceslice-resource-v1.json``); ``strict=False``
    reads the same version's non-strict files (no added ``additionalProperties: false``);
    ``version`` ("1.35"): that release's schemas instead of the newest."""
    directory = _SCHEMA_DIR if version is None else f"v{version}.0-local-strict"
    directory = directory if strict else directory.removesuffix("-strict")
    return json.loads(_SCHEMA_ROOT.joinpath(directory, name).read_text(encoding="utf-8"))


def _is_integer(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer()
    )


_TYPE_TESTS: dict[str, Callable[[Any], bool]] = {
    "string": lambda value: isinstance(value, str),
    "integer": _is_integer,
    "number": lambda value: isinstance(value, (int, float)) and not isinstance(value, bool),
    "boolean": lambda value: isinstance(value, bool),
    "object": lambda value: isinstance(value, dict),
    "array": lambda value: isinstance(value, list),
    "null": lambda value: value is None,
}


class _Compiler:
    def __init__(self, definitions: dict[str, Any]) -> None:
        self._definitions = definitions
        self._compiled: dict[str, Check] = {}

    def reference(self, ref: str) -> Check:
        name = ref.rsplit("/", 1)[1]
        if name not in self._compiled:
            cell: list[Check] = []
            self._compiled[name] = lambda value, path: cell[0](
                value, path
            )  # recursion-safe forward reference
            cell.append(self.compile(self._definitions[name]))
        return self._compiled[name]

    def compile(self, schema: dict[str, Any]) -> Check:
        unknown = {key for key in schema if not key.startswith("x-")} - _SUPPORTED - {
            "description", "format", "$schema", "$id", "default",
        }  # fmt: skip
        if unknown:
            raise ValueError(f"schema keyword(s) not supported by the emulator: {sorted(unknown)}")
        if "$ref" in schema:
            return self.reference(schema["$ref"])
        checks: list[Check] = []
        if "oneOf" in schema:
            checks.append(self._one_of([self.compile(option) for option in schema["oneOf"]]))
        if "type" in schema:
            checks.append(self._type(schema["type"]))
        if "enum" in schema:
            checks.append(self._enum(schema["enum"]))
        if "properties" in schema or "required" in schema or "additionalProperties" in schema:
            checks.append(self._object(schema))
        if "items" in schema:
            checks.append(self._items(self.compile(schema["items"])))
        if len(checks) == 1:
            return checks[0]

        def check_all(value: Any, path: Path) -> None:
            for check in checks:
                check(value, path)

        return check_all

    @staticmethod
    def _type(declared: str | list[str]) -> Check:
        names = [declared] if isinstance(declared, str) else list(declared)
        tests = [_TYPE_TESTS[name] for name in names]
        wanted = " or ".join(names)

        def check_type(value: Any, path: Path) -> None:
            if not any(test(value) for test in tests):
                raise SchemaViolation(
                    path=path, problem=f"Invalid value: {value!r}: must be {wanted}", kind="type"
                )

        return check_type

    @staticmethod
    def _enum(allowed: list[Any]) -> Check:
        def check_enum(value: Any, path: Path) -> None:
            if value not in allowed:
                supported = ", ".join(repr(item) for item in allowed if item is not None)
                raise SchemaViolation(
                    path=path,
                    problem=f"Unsupported value: {value!r}: supported values: {supported}",
                    kind="enum",
                )

        return check_enum

    @staticmethod
    def _one_of(options: list[Check]) -> Check:
        def check_one_of(value: Any, path: Path) -> None:
            matched = 0
            for option in options:
                try:
                    option(value, path)
                except SchemaViolation:
                    continue
                matched += 1
            if matched != 1:
                raise SchemaViolation(
                    path=path, problem=f"Invalid value: {value!r}: wrong type", kind="oneOf"
                )

        return check_one_of

    def _object(self, schema: dict[str, Any]) -> Check:
        properties = {name: self.compile(sub) for name, sub in (schema.get("properties") or {}).items()}
        required = tuple(schema.get("required") or ())
        additional = schema.get("additionalProperties", True)
        values_check = self.compile(additional) if isinstance(additional, dict) else None
        closed = additional is False

        def check_object(value: Any, path: Path) -> None:
            if not isinstance(value, dict):
                return  # "type" reports it
            for name in required:
                if name not in value:
                    raise SchemaViolation(path=(*path, name), problem="Required value", kind="required")
            for name, item in value.items():
                check = properties.get(name)
                if check is not None:
                    check(item, (*path, name))
                elif values_check is not None:
                    values_check(item, (*path, name))
                elif closed:
                    raise SchemaViolation(path=(*path, name), problem="unknown field", kind="unknown")

        return check_object

    @staticmethod
    def _items(item_check: Check) -> Check:
        def check_items(value: Any, path: Path) -> None:
            if isinstance(value, list):
                for index, item in enumerate(value):
                    item_check(item, (*path, index))

        return check_items


_compile_lock = threading.Lock()
_checks: dict[tuple[str | None, str], Check] = {}


@functools.cache
def _compiler(version: str | None = None) -> _Compiler:
    return _Compiler(schema_document("_definitions.json", version=version)["$defs"])


def schema_check(schema_file: str, version: str | None = None) -> Check:
    """The compiled check of one kind's schema file (built once); raises ``SchemaViolation``.
    ``version`` ("1.35"): that release's schema (an emulated older server), else the newest."""
    check = _checks.get((version, schema_file))
    if check is None:
        with _compile_lock:  # compiling fills shared forward references: one thread at a time
            check = _checks.get((version, schema_file))
            if check is None:
                check = _compiler(version).compile(schema_document(schema_file, version=version))
                _checks[(version, schema_file)] = check
    return check

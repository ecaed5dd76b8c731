"""Validation of written objects for the embedded API emulator (a test double).

Each object is checked against the official Kubernetes JSON schema of its kind, taken from the
``kubernetes-validate`` package (strict variant: unknown fields are rejected), then against the DRA
server-side rules of ``emulator_rules``. The package's own ``validate()`` re-reads the schema
files on every call (about 17 ms); here each kind's validator is built once and cached.
"""

from __future__ import annotations

import functools
import json
import re
from importlib import resources
from typing import Any

import jsonschema
from referencing import Registry, Resource

from driver.kube.emulator_rules import check_rules, drop_disabled_fields
from driver.kube.emulator_store import ResourceType, StatusError

__all__ = ["SCHEMA_VERSION", "ObjectValidator", "format_path", "invalid_error"]

Obj = dict[str, Any]
_SCHEMA_ROOT = resources.files("kubernetes_validate").joinpath("kubernetes-json-schema")
_STRICT_DIR = re.compile(r"^v(\d+)\.(\d+)\.(\d+)-local-strict$")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Fields whose values are maps: their keys are data, written in brackets.
_MAP_FIELDS = frozenset(
    {"attributes", "capacity", "counters", "consumedCapacity", "requests", "labels", "annotations", "data",
     "nodeSelector", "parameters", "allocatable"}
)  # fmt: skip


def _newest_strict_dir() -> str:
    versions = []
    for entry in _SCHEMA_ROOT.iterdir():
        match = _STRICT_DIR.match(entry.name)
        if match:
            versions.append((tuple(int(part) for part in match.groups()), entry.name))
    return max(versions)[1]


_SCHEMA_DIR = _newest_strict_dir()
SCHEMA_VERSION = _SCHEMA_DIR.removeprefix("v").removesuffix("-local-strict")
"""The Kubernetes version whose schemas are used: the newest the package ships (1.37 for 37.x)."""


def _read(name: str) -> Any:
    return json.loads(_SCHEMA_ROOT.joinpath(_SCHEMA_DIR, name).read_text(encoding="utf-8"))


@functools.cache
def _definitions() -> Resource[Any]:
    return Resource.from_contents(_read("_definitions.json"))


def _schema_file(rtype: ResourceType) -> str:
    prefix = rtype.group.split(".", 1)[0]
    if not rtype.group:
        return f"{rtype.kind.lower()}-{rtype.version}.json"
    return f"{rtype.kind.lower()}-{prefix}-{rtype.version}.json"


@functools.cache
def _validator(schema_file: str) -> jsonschema.protocols.Validator:
    schema = _read(schema_file)
    registry: Registry[Any] = Resource.from_contents(schema) @ Registry()
    registry = _definitions() @ registry
    return jsonschema.Draft202012Validator(schema, registry=registry)


def format_path(parts: Any) -> str:
    """``spec.devices[0].attributes[gpu.example.com/numa]``: the field-path style of apiserver messages
    (list indexes and map keys in brackets)."""
    text, previous = "", None
    for part in parts:
        if isinstance(part, int) or previous in _MAP_FIELDS or not _IDENTIFIER.match(str(part)):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
        previous = part
    return text


def invalid_error(rtype: ResourceType, name: str, causes: list[tuple[str, str]]) -> StatusError:
    """422 Invalid naming each (field, problem), in the apiserver's wording."""
    summary = ", ".join(f"{field}: {problem}" for field, problem in causes)
    return StatusError(
        code=422,
        reason="Invalid",
        message=f'{rtype.kind}.{rtype.group or "core"} "{name}" is invalid: {summary}',
        details={
            "name": name,
            "group": rtype.group,
            "kind": rtype.kind,
            "causes": [
                {"reason": "FieldValueInvalid", "message": problem, "field": field}
                for field, problem in causes
            ],
        },
    )


def _schema_causes(error: jsonschema.ValidationError) -> list[tuple[str, str]]:
    path = list(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = set(error.schema.get("properties", {}))
        extra = sorted(key for key in error.instance if key not in known)
        return [
            (format_path([*path, key]), f'Invalid value: unknown field "{format_path([*path, key])}"')
            for key in extra
        ]
    if error.validator == "required" and isinstance(error.instance, dict):
        missing = [key for key in error.validator_value if key not in error.instance]
        return [(format_path([*path, key]), "Required value") for key in missing]
    return [(format_path(path) or "<root>", f"Invalid value: {error.message}")]


def _check_provisioning_request(rtype: ResourceType, obj: Obj) -> None:
    """No official schema exists for this custom resource: the shape only."""
    name = obj["metadata"].get("name", "")
    for field in ("apiVersion", "kind", "metadata", "spec"):
        if field not in obj:
            raise invalid_error(rtype, name, [(field, "Required value")])
    if not isinstance(obj["spec"], dict):
        raise invalid_error(rtype, name, [("spec", "Invalid value: must be an object")])


class ObjectValidator:
    """Drops the fields of disabled DRA gates, then validates (schema, then DRA rules)."""

    def __init__(self, *, disabled_features: frozenset[str] = frozenset()) -> None:
        self._disabled_features = disabled_features

    def validate(self, rtype: ResourceType, obj: Obj, old: Obj | None) -> Obj:
        """Return the object to store, or raise 422 naming the field."""
        obj = drop_disabled_fields(rtype, obj, self._disabled_features)
        name = obj["metadata"].get("name", "")
        if rtype.plural == "provisioningrequests":
            _check_provisioning_request(rtype, obj)
            return obj
        error = jsonschema.exceptions.best_match(_validator(_schema_file(rtype)).iter_errors(obj))
        if error is not None:
            raise invalid_error(rtype, name, _schema_causes(error))
        causes = check_rules(rtype, obj, old)
        if causes:
            raise invalid_error(rtype, name, causes)
        return obj

"""Validation of written objects for the embedded API emulator (a test double).

Each object is checked against the official Kubernetes JSON schema of its kind from the
``kubernetes-validate`` package (strict: unknown fields are rejected), compiled once per kind by
``schema`` (the package's own ``validate()`` re-reads the files on every call, about
17 ms), then against the DRA server-side rules of ``rules``.
"""

from __future__ import annotations

import re
from typing import Any

from driver.cluster.apiserver.core_rules import check_core_rules
from driver.cluster.apiserver.request import FieldValidation
from driver.cluster.apiserver.rules import check_rules, drop_disabled_fields
from driver.cluster.apiserver.schema import SCHEMA_VERSION, SchemaViolation, schema_check
from driver.cluster.apiserver.store import ResourceType, StatusError, qualified_kind
from driver.cluster.apiserver.webhook_rules import required_field_causes

__all__ = ["SCHEMA_VERSION", "ObjectValidator", "format_path", "invalid_error", "schema_file"]

Obj = dict[str, Any]
_MAX_UNKNOWN_FIELDS = 100  # past this many, the rest are reported as one
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Fields whose values are maps: their keys are data, written in brackets.
_MAP_FIELDS = frozenset(
    {"attributes", "capacity", "counters", "consumedCapacity", "requests", "labels", "annotations", "data",
     "nodeSelector", "parameters", "allocatable"}
)  # fmt: skip


def schema_file(rtype: ResourceType) -> str:
    """The schema file of a kind: ``pod-v1.json``, ``resourceslice-resource-v1.json``."""
    if not rtype.group:
        return f"{rtype.kind.lower()}-{rtype.version}.json"
    return f"{rtype.kind.lower()}-{rtype.group.split('.', 1)[0]}-{rtype.version}.json"


def format_path(parts: Any) -> str:
    """``spec.devices[0].attributes[gpu.example.com/numa]``: the field-path style of apiserver messages
    (list indexes and map keys in brackets)."""
    text, previous = "", None
    for part in parts:
        if isinstance(part, int) or previous in _MAP_FIELDS or not _IDENTIFIER.fullmatch(str(part)):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
        previous = part
    return text


# The cause reason of a field error, from the start of its text (k8s.io/apimachinery/pkg/util/validation/field
# errors.go: ErrorType.String() begins each message).
_CAUSE_REASONS = (
    ("Required value", "FieldValueRequired"),
    ("Forbidden", "FieldValueForbidden"),
    ("Unsupported value", "FieldValueNotSupported"),
    ("Duplicate value", "FieldValueDuplicate"),
    ("Too long", "FieldValueTooLong"),
    ("Too many", "FieldValueTooMany"),
)


def cause_reason(problem: str) -> str:
    """``FieldValueRequired`` for "Required value...", and so on; ``FieldValueInvalid`` otherwise."""
    for prefix, reason in _CAUSE_REASONS:
        if problem.startswith(prefix):
            return reason
    return "FieldValueInvalid"


def invalid_error(rtype: ResourceType, name: str, causes: list[tuple[str, str]]) -> StatusError:
    """422 Invalid naming each (field, problem), in the apiserver's wording."""
    summary = ", ".join(f"{field}: {problem}" for field, problem in causes)
    if len(causes) > 1:  # apimachinery's aggregate of several causes prints as a list
        summary = f"[{summary}]"
    return StatusError(
        code=422,
        reason="Invalid",
        message=f'{qualified_kind(rtype)} "{name}" is invalid: {summary}',
        details={
            "name": name,
            "group": rtype.group,
            "kind": rtype.kind,
            "causes": [
                {"reason": cause_reason(problem), "message": problem, "field": field}
                for field, problem in causes
            ],
        },
    )


def _schema_causes(violation: SchemaViolation) -> list[tuple[str, str]]:
    field = format_path(violation.path) or "<root>"
    if violation.kind == "unknown":
        return [(field, f'Invalid value: unknown field "{field}"')]
    return [(field, violation.problem)]


def _check_provisioning_request(rtype: ResourceType, obj: Obj) -> None:
    """No official schema exists for this custom resource: the shape only."""
    name = obj["metadata"].get("name", "")
    for field in ("apiVersion", "kind", "metadata", "spec"):
        if field not in obj:
            raise invalid_error(rtype, name, [(field, "Required value")])
    if not isinstance(obj["spec"], dict):
        raise invalid_error(rtype, name, [("spec", "Invalid value: must be an object")])


def _without(obj: Any, path: tuple[str | int, ...]) -> Any:
    """``obj`` with the value at ``path`` removed (copies along the path only)."""
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        if not rest:
            return {key: value for key, value in obj.items() if key != head}
        return {**obj, head: _without(obj[head], rest)}
    if isinstance(obj, list) and isinstance(head, int):
        return [*obj[:head], _without(obj[head], rest), *obj[head + 1 :]]
    return obj


def _strict_decoding_error(rtype: ResourceType, unknown: list[str]) -> StatusError:
    fields = ", ".join(f'unknown field "{field}"' for field in unknown)
    return StatusError(
        code=400,
        reason="BadRequest",
        message=f'{rtype.kind} in version "{rtype.version}" cannot be handled as a {rtype.kind}: '
        f"strict decoding error: {fields}",
    )


class ObjectValidator:
    """Drops the fields of disabled DRA gates, then validates (schema, then DRA rules)."""

    def __init__(
        self, *, disabled_features: frozenset[str] = frozenset(), schema_version: str | None = None
    ) -> None:
        self._disabled_features = disabled_features
        self._schema_version = schema_version  # an emulated release ("1.35"): its schemas; None: newest

    def validate(
        self,
        rtype: ResourceType,
        obj: Obj,
        old: Obj | None,
        *,
        field_validation: FieldValidation | None = None,
        warnings: list[str] | None = None,
        update_rules: bool = True,
    ) -> Obj:
        """Return the object to store, or raise 422 naming the field.

        Unknown fields, as the apiserver's decoder treats them under ``field_validation``: dropped
        (``Ignore``), dropped with a warning appended to ``warnings`` (``Warn``) or refused with 400
        (``Strict``). None keeps the emulator's own strictness for internal writes: 422 naming it.
        ``update_rules=False``: a subresource with its own rules (``pods/binding``) changes the object.
        """
        obj = drop_disabled_fields(rtype, obj, self._disabled_features)
        name = obj["metadata"].get("name", "")
        custom = getattr(rtype, "validate_custom", None)  # a kind a CustomResourceDefinition serves
        if custom is not None:
            validated: Obj = custom(obj, old, field_validation=field_validation, warnings=warnings)
            return validated
        if rtype.plural == "provisioningrequests":
            _check_provisioning_request(rtype, obj)
            return obj
        if rtype.group == "admissionregistration.k8s.io" and (missing := required_field_causes(obj)):
            raise invalid_error(rtype, name, missing)  # worded by the kind's rules, not by the schema
        check = schema_check(schema_file(rtype), self._schema_version)
        unknown: list[str] = []
        while True:
            try:
                check(obj, ())
                break
            except SchemaViolation as violation:
                droppable = violation.kind == "unknown" and len(unknown) <= _MAX_UNKNOWN_FIELDS
                if field_validation is None or not droppable:
                    raise invalid_error(rtype, name, _schema_causes(violation)) from None
                unknown.append(format_path(violation.path))
                obj = _without(obj, violation.path)
        if unknown and field_validation is FieldValidation.STRICT:
            raise _strict_decoding_error(rtype, unknown)
        if unknown and field_validation is FieldValidation.WARN and warnings is not None:
            warnings.extend(f'unknown field "{field}"' for field in unknown)
        causes = check_rules(rtype, obj, old) + check_core_rules(rtype, obj, old if update_rules else None)
        if causes:
            raise invalid_error(rtype, name, causes)
        return obj

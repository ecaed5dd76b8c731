"""Name, label and quantity formats of the embedded API emulator (a test double), as the
apiserver's validation helpers check them. Problems are (field, message) causes."""

from __future__ import annotations

import datetime
import json
import re
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from driver.cluster.apiserver.store import ResourceType

__all__ = [
    "canonical_time",
    "Causes",
    "c_identifier",
    "check_metadata",
    "dns_label",
    "dns_label_problems",
    "dns_subdomain",
    "dns_subdomain_problems",
    "driver_name",
    "go_json",
    "binary_quantity",
    "format_quantity",
    "go_quantity",
    "go_quote",
    "go_value",
    "label_key",
    "label_name",
    "label_value",
    "label_value_problems",
    "quantity",
    "qualified_name",
    "too_many",
    "unsupported",
]

Obj = dict[str, Any]
Causes = list[tuple[str, str]]

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def canonical_time(value: Any) -> Any:
    """A ``metav1.Time`` as kube-apiserver stores it whatever the client sent: RFC 3339 in UTC,
    whole seconds (``2026-12-01T16:40:00+00:00`` and ``...16:40:00.5Z`` are both
    ``2026-12-01T16:40:00Z``). A value that is no time is returned as it is, for the schema to judge."""
    if not isinstance(value, str):
        return value
    try:
        moment = datetime.datetime.fromisoformat(value)
    except ValueError:
        return value
    if moment.tzinfo is None:
        return value
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def go_quote(value: str) -> str:
    """A string as Go's ``%q`` prints it in apiserver messages (double quotes, escapes)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


_SUBDOMAIN_MESSAGE = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
_LABEL_MESSAGE = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start "
    "and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
_DRIVER_MESSAGE = (
    "an RFC 1123 subdomain must consist of alphanumeric characters, '-' or '.', and must start and end "
    "with an alphanumeric character (e.g. 'Example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
_C_IDENTIFIER_MESSAGE = (
    "a valid C identifier must start with alphabetic character or '_', followed by a string of alphanumeric "
    "characters or '_' (e.g. 'my_name',  or 'MY_NAME',  or 'MyName', regex used for validation is "
    "'[A-Za-z_][A-Za-z0-9_]*')"
)
_QUALIFIED_NAME_PART = (
    "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric "
    "character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
    "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)
_LABEL_VALUE_MESSAGE = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used "
    "for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)


def dns_subdomain_problems(value: Any, max_length: int = 253) -> list[str]:
    """apimachinery's ``IsDNS1123Subdomain`` as ``field.Invalid`` messages (Required when empty)."""
    if not isinstance(value, str) or not value:
        return ["Required value"]
    problems = []
    if len(value) > max_length:
        problems.append(f"Invalid value: {go_quote(value)}: must be no more than {max_length} characters")
    if not _DNS_SUBDOMAIN.fullmatch(value):
        problems.append(f"Invalid value: {go_quote(value)}: {_SUBDOMAIN_MESSAGE}")
    return problems


def dns_subdomain(value: Any, max_length: int = 253) -> str | None:
    """The first of :func:`dns_subdomain_problems`, or None."""
    problems = dns_subdomain_problems(value, max_length)
    return problems[0] if problems else None


def dns_label_problems(value: Any) -> list[str]:
    """apimachinery's ``IsDNS1123Label`` as ``field.Invalid`` messages (Required when empty)."""
    if not isinstance(value, str) or not value:
        return ["Required value"]
    return _label_shaped(value, _DNS_LABEL, _LABEL_MESSAGE)


def _label_shaped(value: str, pattern: re.Pattern[str], message: str) -> list[str]:
    """At most 63 characters and matching ``pattern``: apimachinery's label-sized checks."""
    problems = []
    if len(value) > 63:
        problems.append(f"Invalid value: {go_quote(value)}: must be no more than 63 characters")
    if not pattern.fullmatch(value):
        problems.append(f"Invalid value: {go_quote(value)}: {message}")
    return problems


def dns_label(value: Any) -> str | None:
    problems = dns_label_problems(value)
    return problems[0] if problems else None


def driver_name(value: Any) -> list[str]:
    """A DRA driver name (kubernetes ``ValidateCSIDriverName`` as 1.37 words it): at most 63 characters, a
    DNS subdomain whatever the case."""
    if not isinstance(value, str) or not value:
        return ["Required value"]
    problems = []
    if len(value) > 63:
        problems.append("Too long: may not be more than 63 bytes")
    if not _DNS_SUBDOMAIN.fullmatch(value.lower()):
        problems.append(f"Invalid value: {go_quote(value)}: {_DRIVER_MESSAGE}")
    return problems


def c_identifier(value: str, max_length: int = 32) -> list[str]:
    problems = []
    if len(value) > max_length:
        problems.append(f"Too long: may not be more than {max_length} bytes")
    if not _C_IDENTIFIER.fullmatch(value):
        problems.append(f"Invalid value: {go_quote(value)}: {_C_IDENTIFIER_MESSAGE}")
    return problems


def label_name(value: str) -> list[str]:
    """apimachinery's ``IsQualifiedName`` (label keys, taint keys) as ``field.Invalid`` messages."""
    parts = value.split("/")
    quoted = go_quote(value)
    if len(parts) > 2:
        return [
            f"Invalid value: {quoted}: a qualified name {_QUALIFIED_NAME_PART} with an optional DNS "
            "subdomain prefix and '/' (e.g. 'example.com/MyName')"
        ]
    problems = []
    name = parts[-1]
    if len(parts) == 2:
        if not parts[0]:
            problems.append(f"Invalid value: {quoted}: prefix part must be non-empty")
        else:
            for problem in dns_subdomain_problems(parts[0]):
                text = problem.split(": ", 2)[-1]
                problems.append(f"Invalid value: {quoted}: prefix part {text}")
    if not name:
        problems.append(f"Invalid value: {quoted}: name part must be non-empty")
    elif len(name) > 63:
        problems.append(f"Invalid value: {quoted}: name part must be no more than 63 characters")
    if not _LABEL_NAME.fullmatch(name):
        problems.append(f"Invalid value: {quoted}: name part {_QUALIFIED_NAME_PART}")
    return problems


def label_value_problems(value: str) -> list[str]:
    """apimachinery's ``IsValidLabelValue`` as ``field.Invalid`` messages."""
    return _label_shaped(value, _LABEL_VALUE, _LABEL_VALUE_MESSAGE)


def go_value(value: Any) -> str:
    """A value as ``field.Invalid`` prints it: ``null``, ``%v`` for numbers and bools, ``%q`` for
    strings, JSON for the rest."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return go_quote(value)
    return go_json(value)


def go_json(value: Any) -> str:
    """``encoding/json`` output: compact, HTML-safe escapes as Go writes them."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def unsupported(value: Any, supported: Any) -> str:
    """``field.NotSupported``: ``Unsupported value: "x": supported values: "a", "b"``."""
    return f"Unsupported value: {go_value(value)}: supported values: " + ", ".join(
        go_quote(str(item)) for item in supported
    )


def qualified_name(value: str) -> str | None:
    """DRA QualifiedName: a C identifier (<= 32) optionally prefixed by ``<DNS subdomain <= 63>/``."""
    domain, _, identifier = value.rpartition("/")
    if domain and dns_subdomain(domain, 63) is not None:
        return f"Invalid value: {value!r}: the domain must be a DNS subdomain of at most 63 characters"
    if len(identifier) > 32 or not _C_IDENTIFIER.fullmatch(identifier):
        return f"Invalid value: {value!r}: the name must be a C identifier of at most 32 characters"
    return None


def label_key(value: str) -> str | None:
    prefix, _, name = value.rpartition("/")
    if prefix and dns_subdomain(prefix) is not None:
        return f"Invalid value: {value!r}: prefix part must be a DNS subdomain"
    if len(name) > 63 or not _LABEL_NAME.fullmatch(name):
        return (
            f"Invalid value: {value!r}: name part must consist of alphanumeric characters, '-', '_' or '.', "
            "start and end with an alphanumeric character, and be at most 63 characters"
        )
    return None


def label_value(value: Any) -> str | None:
    if not isinstance(value, str):
        return "Invalid value: must be a string"
    if value and (len(value) > 63 or not _LABEL_NAME.fullmatch(value)):
        return (
            f"Invalid value: {value!r}: a valid label value must be at most 63 characters of alphanumerics, "
            "'-', '_' or '.', starting and ending with an alphanumeric character"
        )
    return None


def quantity(value: Any, field: str, causes: Causes) -> Decimal | None:
    try:
        return Decimal(parse_quantity(value))  # type: ignore[no-untyped-call]  # the client ships no hints
    except (ValueError, TypeError, ArithmeticError):
        causes.append(
            (
                field,
                f"Invalid value: {value!r}: quantities must match the regular expression "
                "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'",
            )
        )
        return None


_BINARY_SUFFIXES = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_DECIMAL_SUFFIXES = {-9: "n", -6: "u", -3: "m", 0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P", 18: "E"}


def go_quantity(text: str) -> str:
    """A quantity as ``resource.Quantity.String()`` prints it (the canonical form of its format:
    ``1024Mi`` is ``1Gi``, ``1500m`` is ``1500m``, ``2000`` is ``2k``). Unparseable text is returned as is."""
    try:
        value = Decimal(parse_quantity(text))  # type: ignore[no-untyped-call]  # the client ships no hints
    except (ValueError, TypeError, ArithmeticError):
        return str(text)
    return format_quantity(value, binary_quantity(text))


def binary_quantity(text: Any) -> bool:
    """Whether a quantity is written with a binary suffix (``Ki``...``Ei``): its format is BinarySI."""
    return isinstance(text, str) and re.search(r"[KMGTPE]i$", text.strip()) is not None


def format_quantity(value: Decimal, binary: bool) -> str:
    """``value`` in the canonical form of the BinarySI (``binary``) or DecimalSI format."""
    if binary and abs(value) >= 1024 and value == value.to_integral_value():
        number, power = int(value), 0
        while power < 6 and number % 1024 == 0 and number != 0:
            number, power = number // 1024, power + 1
        return f"{number}{_BINARY_SUFFIXES[power]}"
    if value == 0:
        return "0"
    exponent = 0
    scaled = value
    while scaled != scaled.to_integral_value() and exponent > -9:  # up to nano: mantissa integral
        scaled, exponent = scaled * 1000, exponent - 3
    scaled = scaled.to_integral_value(rounding="ROUND_CEILING")
    number = int(scaled)
    while exponent < 18 and number % 1000 == 0:
        number, exponent = number // 1000, exponent + 3
    return f"{number}{_DECIMAL_SUFFIXES[exponent]}"


def too_many(items: Any, limit: int, field: str, causes: Causes) -> None:
    if isinstance(items, (list, dict)) and len(items) > limit:
        causes.append((field, f"Too many: {len(items)}: must have at most {limit} items"))


def check_metadata(rtype: ResourceType, obj: Obj, causes: Causes) -> None:
    metadata = obj.get("metadata") or {}
    check = dns_label_problems if rtype.plural == "namespaces" else dns_subdomain_problems
    for name_problem in check(metadata.get("name")):
        causes.append(("metadata.name", name_problem))
    for key, value in (metadata.get("labels") or {}).items():
        for problem in (label_key(key), label_value(value)):
            if problem:
                causes.append((f"metadata.labels[{key}]", problem))

"""Name, label and quantity formats of the embedded API emulator (a test double), as the
apiserver's validation helpers check them. Problems are (field, message) causes."""

from __future__ import annotations

import datetime
import re
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from driver.cluster.apiserver.store import ResourceType

__all__ = [
    "canonical_time",
    "Causes",
    "check_metadata",
    "dns_label",
    "dns_subdomain",
    "go_quote",
    "label_key",
    "label_value",
    "quantity",
    "qualified_name",
    "too_many",
]

Obj = dict[str, Any]
Causes = list[tuple[str, str]]

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
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


def dns_subdomain(value: Any, max_length: int = 253) -> str | None:
    if not isinstance(value, str) or not value:
        return "Required value"
    if len(value) > max_length:
        return f"Too long: may not be more than {max_length} bytes"
    if not _DNS_SUBDOMAIN.fullmatch(value):
        return (
            f"Invalid value: {go_quote(value)}: a lowercase RFC 1123 subdomain must consist of lower "
            "case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character "
            "(e.g. 'example.com', regex used for validation is "
            "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
        )
    return None


def dns_label(value: Any) -> str | None:
    if not isinstance(value, str) or not value:
        return "Required value"
    if len(value) > 63 or not _DNS_LABEL.fullmatch(value):
        return (
            f"Invalid value: {go_quote(value)}: a lowercase RFC 1123 label must consist of lower case "
            "alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. "
            "'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
        )
    return None


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


def too_many(items: Any, limit: int, field: str, causes: Causes) -> None:
    if isinstance(items, (list, dict)) and len(items) > limit:
        causes.append((field, f"Too many: {len(items)}: must have at most {limit} items"))


def check_metadata(rtype: ResourceType, obj: Obj, causes: Causes) -> None:
    metadata = obj.get("metadata") or {}
    check = dns_label if rtype.plural == "namespaces" else dns_subdomain
    problem = check(metadata.get("name"))
    if problem:
        causes.append(("metadata.name", problem))
    for key, value in (metadata.get("labels") or {}).items():
        for problem in (label_key(key), label_value(value)):
            if problem:
                causes.append((f"metadata.labels[{key}]", problem))

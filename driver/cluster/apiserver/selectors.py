"""Label and field selectors of the embedded API emulator (a test double), parsed as the apiserver
parses ``labelSelector`` and ``fieldSelector`` query parameters."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from driver.cluster.apiserver.store import StatusError

__all__ = ["build_matcher", "match_label_selector", "parse_field_selector", "parse_label_selector"]

Predicate = Callable[[dict[str, Any]], bool]

_SET_RE = re.compile(r"^\s*(!?)\s*([A-Za-z0-9._/-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_BINARY_RE = re.compile(r"^\s*([A-Za-z0-9._/-]+)\s*(==|!=|=)\s*([A-Za-z0-9._-]*)\s*$")
_EXISTS_RE = re.compile(r"^\s*(!?)\s*([A-Za-z0-9._/-]+)\s*$")
_ALWAYS_FIELDS = frozenset({"metadata.name", "metadata.namespace"})


def _bad_selector(kind: str, text: str, problem: str) -> StatusError:
    return StatusError(
        code=400, reason="BadRequest", message=f'unable to parse requirement in {kind} "{text}": {problem}'
    )


def _split_requirements(text: str) -> list[str]:
    """Split on commas outside parentheses (``a in (x,y),b``)."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return [part for part in parts if part.strip()]


def _label_requirement(text: str, whole: str) -> Predicate:
    match = _SET_RE.match(text)
    if match:
        if match.group(1):
            raise _bad_selector("labelSelector", whole, f"unexpected '!' before set requirement {text!r}")
        key, operator = match.group(2), match.group(3)
        values = frozenset(value.strip() for value in match.group(4).split(",") if value.strip())
        if operator == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    match = _BINARY_RE.match(text)
    if match:
        key, operator, value = match.groups()
        if operator == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    match = _EXISTS_RE.match(text)
    if match:
        negate, key = match.groups()
        if negate:
            return lambda labels: key not in labels
        return lambda labels: key in labels
    raise _bad_selector("labelSelector", whole, f"cannot parse {text.strip()!r}")


def parse_label_selector(text: str) -> Predicate:
    """``=``, ``==``, ``!=``, ``in``, ``notin``, ``key`` (exists) and ``!key`` requirements, ANDed."""
    requirements = [_label_requirement(part, text) for part in _split_requirements(text)]

    def matches(obj: dict[str, Any]) -> bool:
        labels = obj["metadata"].get("labels") or {}
        return all(requirement(labels) for requirement in requirements)

    return matches


def match_label_selector(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether ``labels`` satisfy a ``metav1.LabelSelector`` object (``matchLabels`` and
    ``matchExpressions``, ANDed); an empty selector matches everything. ``NotIn`` and
    ``DoesNotExist`` match a missing key, as apimachinery's ``LabelSelectorAsSelector`` makes them."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or ():
        key, operator = expression.get("key"), expression.get("operator")
        values = expression.get("values") or []
        present = key in labels
        if operator == "In":
            matched = present and labels[key] in values
        elif operator == "NotIn":
            matched = not present or labels[key] not in values
        elif operator == "Exists":
            matched = present
        elif operator == "DoesNotExist":
            matched = not present
        else:  # refused when the selector was written
            matched = False
        if not matched:
            return False
    return True


def _field_value(obj: dict[str, Any], path: str) -> str:
    node: Any = obj
    for part in path.split("."):
        if not isinstance(node, dict):
            return ""
        node = node.get(part)
    if node is None:
        return ""
    if isinstance(node, bool):
        return "true" if node else "false"
    return str(node)


def parse_field_selector(text: str, allowed: frozenset[str], kind: str) -> Predicate:
    """``path=value``, ``path==value`` and ``path!=value`` over the field labels ``kind`` supports."""
    requirements: list[tuple[str, bool, str]] = []
    for part in _split_requirements(text):
        match = _BINARY_RE.match(part)
        if not match:
            raise _bad_selector("fieldSelector", text, f"cannot parse {part.strip()!r}")
        path, operator, value = match.groups()
        if path not in allowed and path not in _ALWAYS_FIELDS:
            raise StatusError(
                code=400,
                reason="BadRequest",
                message=f'field label not supported: "{path}" (kind {kind})',
            )
        requirements.append((path, operator == "!=", value))

    def matches(obj: dict[str, Any]) -> bool:
        return all((_field_value(obj, path) != value) is negate for path, negate, value in requirements)

    return matches


def build_matcher(
    label_selector: str | None, field_selector: str | None, allowed: frozenset[str], kind: str
) -> Predicate:
    """One predicate for both selectors; an absent selector matches everything."""
    checks = []
    if label_selector:
        checks.append(parse_label_selector(label_selector))
    if field_selector:
        checks.append(parse_field_selector(field_selector, allowed, kind))
    if not checks:
        return lambda _obj: True
    return lambda obj: all(check(obj) for check in checks)

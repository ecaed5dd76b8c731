"""Bounded decoding of what the API server sends: every object the controller reads passes here.

Tenants write ResourceClaims and Pods; the API server accepts JSON nested up to 10,000 levels,
Python's ``json`` gives up near 1,000 (a RecursionError that would fail a whole LIST), and even
an object that decodes would later overflow the stack in a ``deepcopy`` or the client's
serializer. So a subtree nested deeper than ``MAX_OBJECT_DEPTH`` (counted from the object's own
root) is cut out before decoding and replaced with None, and the cut is reported with its field
path: the object is then marked rejected, never written back, and its owner is told why (an
Event). Everything else in the same LIST or watch stream decodes as usual.

Echoed input is bounded too (``bounded``): error text and log lines quote at most a few hundred
characters of anything a tenant wrote.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from driver.jsondepth import json_depth

__all__ = [
    "MAX_ECHO_CHARS",
    "MAX_OBJECT_DEPTH",
    "Decoded",
    "bounded",
    "decode_json",
    "format_field_path",
]

MAX_OBJECT_DEPTH = 64  # real objects nest about 15 levels (managedFields included)
MAX_ECHO_CHARS = 300

_STRING = r'"(?:[^"\\]|\\.)*"'
_SCANNER = re.compile(rf"{_STRING}|[\[\]{{}}]")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PATH_PARTS_SHOWN = 12


@dataclass(frozen=True, slots=True)
class Decoded:
    value: Any
    too_deep: tuple[tuple[str | int, ...], ...] = ()  # document paths of the subtrees cut out


def bounded(text: object, limit: int = MAX_ECHO_CHARS) -> str:
    """``text`` as a string of at most about ``limit`` characters, saying how much was left out."""
    value = str(text)
    if len(value) <= limit:
        return value
    return f"{value[:limit]}... ({len(value) - limit} more characters)"


def format_field_path(parts: Sequence[str | int]) -> str:
    """``spec.devices.config[0].opaque.parameters.x[0][0]...`` (long paths elided)."""
    text = ""
    for part in parts[:_PATH_PARTS_SHOWN]:
        if isinstance(part, int):
            text += f"[{part}]"
        elif _IDENTIFIER.fullmatch(part):
            text += f".{part}" if text else part
        else:
            text += f"[{bounded(part, 40)!r}]"
    if len(parts) > _PATH_PARTS_SHOWN:
        text += "..."
    return text


def _skip_subtree(text: str, start: int) -> int:
    """The index just after the container opening at ``text[start]`` (no recursion)."""
    depth = 0
    position = start
    while (match := _SCANNER.search(text, position)) is not None:
        position = match.end()
        token = match.group()
        if token in ("[", "{"):
            depth += 1
        elif token in ("]", "}"):
            depth -= 1
            if depth == 0:
                return position
    raise ValueError("unbalanced JSON")


def decode_json(raw: bytes | str, *, max_depth: int) -> Decoded:
    """Decode ``raw``; containers opening deeper than ``max_depth`` become None and are reported.

    Raises ValueError when ``raw`` is not JSON (never RecursionError)."""
    if json_depth(raw) <= max_depth:
        return Decoded(json.loads(raw))
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    marker = f"@@too-deep-{secrets.token_hex(8)}@@"
    pieces: list[str] = []
    depth, copied, position = 0, 0, 0
    while (match := _SCANNER.search(text, position)) is not None:
        position = match.end()
        token = match.group()
        if token in ("]", "}"):
            depth -= 1
        elif token in ("[", "{"):
            depth += 1
            if depth > max_depth:
                end = _skip_subtree(text, match.start())
                pieces += [text[copied : match.start()], json.dumps(marker)]
                copied = position = end
                depth -= 1
    pieces.append(text[copied:])
    value = json.loads("".join(pieces))
    found: list[tuple[str | int, ...]] = []
    # Walk what is left (at most max_depth levels) with an explicit stack, replacing the markers.
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        container, path = stack.pop()
        entries: Any = container.items() if isinstance(container, dict) else enumerate(container)
        for key, item in list(entries):
            if item == marker:
                container[key] = None
                found.append((*path, key))
            elif isinstance(item, dict | list):
                stack.append((item, (*path, key)))
    return Decoded(value, tuple(sorted(found, key=str)))

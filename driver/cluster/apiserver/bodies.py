"""JSON bodies for the embedded API emulator (a test double), nested as deep as kube-apiserver allows.

kube-apiserver decodes JSON up to 10,000 levels deep; Python's ``json`` stops near 1,000 (the
interpreter's recursion limit), and everything else the emulator does with a body (validation,
patching, copying) recurses too. So a body nested deeper than ``SHALLOW_DEPTH`` keeps each subtree
below that depth as a ``RawJSON`` leaf: checked to be well-formed JSON, stored and served back
verbatim (compacted), never walked. Bodies that are not that deep (all of them, in practice) take
the plain ``json`` path, after a cheap depth check.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from driver.jsondepth import json_depth

__all__ = ["MAX_DEPTH", "SHALLOW_DEPTH", "JSONSyntaxError", "RawJSON", "dumps", "loads"]

MAX_DEPTH = 10_000  # kube-apiserver's JSON decoder limit (sigs.k8s.io/json)
SHALLOW_DEPTH = 100  # deeper subtrees become RawJSON leaves

_STRING = r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"'
_TOKEN = re.compile(
    rf"\s*(?:({_STRING})|(-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)|(true|false|null)|([\[\]{{}},:]))"
)


class RawJSON:
    """A well-formed JSON subtree kept as compact text (too deep to hold as Python objects)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RawJSON) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return f"RawJSON({self.text[:40]!r}...)"

    def __deepcopy__(self, memo: dict[int, Any]) -> RawJSON:
        return self  # immutable

    def __copy__(self) -> RawJSON:
        return self


def _compact_subtree(text: str, start: int, outer_depth: int) -> tuple[str, int]:
    """Check the value opening at ``text[start]`` with a pushdown automaton (no recursion); return it
    compacted and the index after it. Raises ValueError when it is not JSON or nests too deep.

    Each open container has a state: ``[0``/``{0`` just opened, ``[v``/``{v`` a value is due,
    ``{k`` a key is due, ``{:`` a colon is due, ``[,``/``{,`` a comma or the close is due."""
    stack: list[str] = []
    parts: list[str] = []
    position = start
    while True:
        match = _TOKEN.match(text, position)
        if match is None:
            raise ValueError(f"invalid JSON at offset {position}")
        position = match.end()
        string, number, literal, punct = match.groups()
        parts.append(string or number or literal or punct)
        state = stack[-1] if stack else "[v"
        closed = False
        if state in ("[0", "[v", "{v"):
            if punct in ("[", "{"):
                stack.append(punct + "0")
                if outer_depth + len(stack) > MAX_DEPTH:
                    raise ValueError(f"exceeded max depth of {MAX_DEPTH}")
                continue
            if punct == "]" and state == "[0":
                stack.pop()
            elif punct is not None:
                raise ValueError(f"unexpected {punct!r} at offset {match.start()}")
            closed = True
        elif state in ("{0", "{k"):
            if string is not None:
                stack[-1] = "{:"
            elif punct == "}" and state == "{0":
                stack.pop()
                closed = True
            else:
                raise ValueError(f"expected a key at offset {match.start()}")
        elif state == "{:":
            if punct != ":":
                raise ValueError(f"expected ':' at offset {match.start()}")
            stack[-1] = "{v"
        elif punct == ",":
            stack[-1] = state[0] + ("v" if state[0] == "[" else "k")
        elif punct == ("]" if state[0] == "[" else "}"):
            stack.pop()
            closed = True
        else:
            raise ValueError(f"expected ',' or a close at offset {match.start()}")
        if closed:
            if not stack:
                return "".join(parts), position
            stack[-1] = stack[-1][0] + ","


def _deep_loads(text: str) -> Any:
    """Decode with every subtree opening below ``SHALLOW_DEPTH`` kept as a RawJSON leaf."""
    nonce = secrets.token_hex(8)
    leaves: dict[str, RawJSON] = {}
    pieces: list[str] = []
    depth, copied, position = 0, 0, 0
    scanner = re.compile(rf"{_STRING}|[\[\]{{}}]")
    while (match := scanner.search(text, position)) is not None:
        position = match.end()
        token = match.group()
        if token in "]}":
            depth -= 1
        elif token in "[{":
            depth += 1
            if depth > SHALLOW_DEPTH:
                compact, end = _compact_subtree(text, match.start(), depth - 1)
                marker = f"@@rawjson-{nonce}-{len(leaves)}@@"
                leaves[marker] = RawJSON(compact)
                pieces += [text[copied : match.start()], json.dumps(marker)]
                copied = position = end
                depth -= 1
    pieces.append(text[copied:])
    decoded = json.loads("".join(pieces), parse_constant=_reject_constant)

    def restore(value: Any) -> Any:  # bounded by SHALLOW_DEPTH: recursion is safe here
        if isinstance(value, str):
            return leaves.get(value, value)
        if isinstance(value, list):
            return [restore(v) for v in value]
        if isinstance(value, dict):
            return {k: restore(v) for k, v in value.items()}
        return value

    return restore(decoded)


class JSONSyntaxError(ValueError):
    """A body that Go's encoding/json refuses though Python's json accepts it; the message is Go's."""


# Python's json reads these as floats; Go's (and so kube-apiserver) refuses them at their first letter.
_GO_CONSTANT_ERRORS = {
    "NaN": "invalid character 'N' looking for beginning of value",
    "Infinity": "invalid character 'I' looking for beginning of value",
    "-Infinity": "invalid character 'I' in numeric literal",
}


def _reject_constant(name: str) -> Any:
    raise JSONSyntaxError(_GO_CONSTANT_ERRORS.get(name, f"invalid character {name[:1]!r}"))


def loads(raw: bytes | str) -> Any:
    """Decode a request body as kube-apiserver would (ValueError when it is not JSON, also on
    ``NaN`` and ``Infinity``, which are no JSON: ``JSONSyntaxError`` with Go's message)."""
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    if json_depth(text) <= SHALLOW_DEPTH:
        return json.loads(text, parse_constant=_reject_constant)
    return _deep_loads(text)


def dumps(obj: Any, *, ensure_ascii: bool = True) -> str:
    """Compact JSON; RawJSON leaves are written back verbatim."""
    leaves: list[RawJSON] = []
    nonce: list[str] = []  # drawn at the first leaf: most bodies have none, and a draw is a syscall

    def leaf(value: Any) -> str:
        if isinstance(value, RawJSON):
            leaves.append(value)
            if not nonce:
                nonce.append(secrets.token_hex(8))
            return f"@@rawjson-{nonce[0]}-{len(leaves) - 1}@@"
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")

    text = json.dumps(obj, separators=(",", ":"), default=leaf, ensure_ascii=ensure_ascii)
    for index, value in enumerate(leaves):
        text = text.replace(json.dumps(f"@@rawjson-{nonce[0]}-{index}@@"), value.text, 1)
    return text


def encoded_size(obj: Any) -> int:
    """The bytes of ``obj`` as compact UTF-8 JSON: what kube-apiserver measures of a raw extension
    (its text as sent, where non-ASCII characters are not escaped)."""
    return len(dumps(obj, ensure_ascii=False).encode("utf-8", errors="surrogatepass"))

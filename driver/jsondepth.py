"""How deep a JSON text nests, measured before it is decoded (no recursion, C-speed passes).

Tenants write the objects every component reads (claims, pods, opaque parameters). Python's
``json`` gives up near 1,000 levels with a RecursionError, and even a document that decodes may
later overflow the stack in a ``deepcopy``; so the agent, the controller and the embedded API
measure the depth first and decode only what is shallow enough.

The measure runs on every watch event and every API answer, so it avoids Python-level loops over
the text: escapes are dropped (a regex that only stops at backslashes), then every byte but
brackets and quotes (``bytes.translate``), then what lies between quotes; the depth is the
largest prefix sum of the remaining brackets (+1 opening, -1 closing), taken with ``accumulate``.

For well-formed JSON the answer is exact. For text that is not JSON it is some number; callers
decode afterwards, and the decoder reports the error.
"""

from __future__ import annotations

import operator
import re
from itertools import accumulate

__all__ = ["json_depth"]

_ESCAPE = re.compile(rb"\\.", re.DOTALL)  # \" \\ \n \uXXXX: the escaped byte is never structural
_NOT_STRUCTURAL = bytes(b for b in range(256) if b not in b'[]{}"')
_QUOTED = re.compile(rb'"[^"]*"')
# opening bracket -> 2, closing -> 0: the prefix sum minus the position is the depth after each one
_STEP = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")


def json_depth(raw: bytes | str) -> int:
    """How many arrays/objects the deepest value of ``raw`` sits in (``1`` for ``{"a": 1}``)."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if b"\\" in data:
        data = _ESCAPE.sub(b"", data)
    # Quotes and brackets only. Removing a pair of adjacent quotes is safe: it is an empty string,
    # or the end of one string and the start of the next (merging them keeps in-string brackets
    # in a string); what is left between quotes are brackets inside strings.
    skeleton = data.translate(None, _NOT_STRUCTURAL).replace(b'""', b"")
    if b'"' in skeleton:
        skeleton = _QUOTED.sub(b"", skeleton)
    if not skeleton:
        return 0
    steps = skeleton.translate(_STEP)
    deepest: int = max(map(operator.sub, accumulate(steps), range(1, len(steps) + 1)))
    return max(0, deepest)

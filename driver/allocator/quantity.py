"""Kubernetes quantities as exact Python numbers (int when integral, Fraction otherwise).

Parsing follows ``k8s.io/apimachinery/pkg/api/resource``: an optional sign, a decimal number, then a
binary suffix (Ki..Ei), a decimal suffix (n, u, m, "", k, M, G, T, P, E) or an exponent (e3, E-2).
Formatting writes the canonical forms the API server writes for what we produce (BinarySI for
values divisible by 1024, plain integers, milli or nano units for fractions).
"""

from __future__ import annotations

import re
from fractions import Fraction
from functools import lru_cache

__all__ = ["Number", "ceil_value", "format_quantity", "parse_quantity"]

Number = int | Fraction

_PATTERN = re.compile(r"^([+-]?)(\d+\.?\d*|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$")
_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
_BINARY_SUFFIXES = (
    ("Ei", 1 << 60),
    ("Pi", 1 << 50),
    ("Ti", 1 << 40),
    ("Gi", 1 << 30),
    ("Mi", 1 << 20),
    ("Ki", 1 << 10),
)


@lru_cache(maxsize=4096)
def parse_quantity(text: str) -> Number:
    """Parse a quantity string; raises ValueError quoting the input when it is not one."""
    if not isinstance(text, str):
        raise ValueError(f"quantity {text!r} is not a string")
    match = _PATTERN.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a valid quantity")
    sign, digits, suffix = match.groups()
    value = Fraction(digits)
    suffix = suffix or ""
    if suffix in _BINARY:
        value *= _BINARY[suffix]
    elif suffix in _DECIMAL:
        value *= _DECIMAL[suffix]
    else:
        value *= Fraction(10) ** int(suffix[1:])
    if sign == "-":
        value = -value
    return int(value) if value.denominator == 1 else value


def ceil_value(value: Number) -> int:
    """``Quantity.Value()``: the value rounded up to an integer."""
    if isinstance(value, int):
        return value
    return -((-value.numerator) // value.denominator)


def format_quantity(value: Number) -> str:
    """Canonical quantity string for a number (semantically exact)."""
    if isinstance(value, Fraction) and value.denominator == 1:
        value = int(value)
    if isinstance(value, int):
        magnitude = abs(value)
        if magnitude >= 1024:
            for suffix, factor in _BINARY_SUFFIXES:
                if magnitude % factor == 0:
                    return f"{value // factor}{suffix}"
        return str(value)
    milli = value * 1000
    if milli.denominator == 1:
        return f"{int(milli)}m"
    micro = value * 10**6
    if micro.denominator == 1:
        return f"{int(micro)}u"
    nano = value * 10**9
    return f"{ceil_value(nano)}n"

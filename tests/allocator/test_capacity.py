"""Request-policy rounding and policy checks (KEP-5075), and quantity parsing/formatting."""

from __future__ import annotations

from fractions import Fraction

import pytest

from driver.allocator.capacity import consumed_value, violates_policy
from driver.allocator.model import CapacitySpec
from driver.allocator.quantity import format_quantity, parse_quantity

MI = 1 << 20
GI = 1 << 30
RANGE_2_4_STEP_2 = CapacitySpec(10, default=2, range_min=2, range_max=4, range_step=2, has_policy=True)
VALUES_1_3 = CapacitySpec(10, default=1, valid_values=(1, 3), has_policy=True)
VALUES_0 = CapacitySpec(10, default=0, valid_values=(0,), has_policy=True)
OUR_MEMORY = CapacitySpec(
    80 * GI, default=80 * GI, range_min=256 * MI, range_max=80 * GI, range_step=256 * MI, has_policy=True
)
OUR_COMPUTE = CapacitySpec(100, default=0, range_min=0, range_max=100, range_step=1, has_policy=True)
NO_POLICY = CapacitySpec(4)
DEFAULT_ONLY = CapacitySpec(4, default=1, has_policy=True)


@pytest.mark.parametrize(
    ("spec", "requested", "consumed", "violates"),
    [
        (RANGE_2_4_STEP_2, 1, 2, False),  # below min -> min
        (RANGE_2_4_STEP_2, 3, 4, False),  # rounded up to min + n*step
        (RANGE_2_4_STEP_2, 6, 6, True),  # above max
        (RANGE_2_4_STEP_2, None, 2, False),  # no request -> default
        (VALUES_1_3, 2, 3, False),  # smallest listed value >= request
        (VALUES_1_3, 4, 4, True),  # none >= request: the request itself, which violates
        (VALUES_0, 1, 1, True),
        (VALUES_0, 0, 0, False),
        (NO_POLICY, None, 4, False),  # no request, no policy: the whole value
        (NO_POLICY, 3, 3, False),  # no policy: exactly the request
        (DEFAULT_ONLY, None, 1, False),
        (DEFAULT_ONLY, 3, 3, False),
        (OUR_MEMORY, 5 * GI, 5 * GI, False),
        (OUR_MEMORY, 5 * GI + 1, 5 * GI + 256 * MI, False),
        (OUR_MEMORY, 100 * MI, 256 * MI, False),
        (OUR_MEMORY, None, 80 * GI, False),  # a claim asking for no memory gets the whole GPU
        (OUR_MEMORY, 81 * GI, 81 * GI, True),
        (OUR_COMPUTE, None, 0, False),
        (OUR_COMPUTE, 25, 25, False),
        (OUR_COMPUTE, Fraction(1, 2), 1, False),  # Value() rounds up before the step arithmetic
    ],
)
def test_request_policy_rounding(
    spec: CapacitySpec, requested: int | None, consumed: int, violates: bool
) -> None:
    value = consumed_value(requested, spec)
    assert value == consumed
    assert violates_policy(value, spec) is violates


@pytest.mark.parametrize(
    ("text", "value"),
    [("80Gi", 80 * GI), ("256Mi", 256 * MI), ("100", 100), ("1.5", Fraction(3, 2)), ("100m", Fraction(1, 10)),
     ("2k", 2000), ("1e3", 1000), ("-1Ki", -1024), (".5", Fraction(1, 2))],
)  # fmt: skip
def test_parse_quantity(text: str, value: int | Fraction) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "Gi", "1.2.3", "1 Gi", "1gi", "0x10"])
def test_parse_quantity_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a valid quantity"):
        parse_quantity(text)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (80 * GI, "80Gi"),
        (256 * MI, "256Mi"),
        (100, "100"),
        (0, "0"),
        (1500, "1500"),
        (Fraction(3, 2), "1500m"),
    ],
)
def test_format_quantity_round_trips(value: int | Fraction, text: str) -> None:
    assert format_quantity(value) == text
    assert parse_quantity(format_quantity(value)) == value

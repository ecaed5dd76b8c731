"""Consumable capacity (KEP-5075): request-policy rounding, policy checks, the per-device fit test.

Mirrors ``internal/incubating/consumable_capacity.go`` (dra-api.md section 4.8): every capacity of the
device is consumed (an unrequested one consumes the policy default, else the whole value), a request
naming a capacity the device lacks skips the device, and the sum of committed, in-pass and new
consumption may not exceed the capacity value.
"""

from __future__ import annotations

from collections.abc import Mapping

from driver.allocator.model import CapacitySpec, Device
from driver.allocator.quantity import Number, ceil_value

__all__ = ["compute_consumption", "consumed_value", "violates_policy"]


def consumed_value(requested: Number | None, spec: CapacitySpec) -> Number:
    """``calculateConsumedCapacity``: what one allocation consumes of a capacity."""
    if requested is None:
        return spec.default if spec.default is not None else spec.value
    if not spec.has_policy:
        return requested
    if spec.range_min is not None:
        if requested < spec.range_min:
            return spec.range_min
        if spec.range_step is None:
            return requested
        base = ceil_value(spec.range_min)
        step = ceil_value(spec.range_step)
        added = ceil_value(requested) - base
        steps = -(-added // step) if step > 0 else 0
        return base + step * steps
    if spec.valid_values is not None:
        for value in spec.valid_values:
            if value >= requested:
                return value
        return requested
    return requested


def violates_policy(value: Number, spec: CapacitySpec) -> bool:
    if not spec.has_policy:
        return False
    if spec.default is not None and value == spec.default:
        return False
    if spec.range_min is not None:
        if value < spec.range_min:
            return True
        if spec.range_max is not None and value > spec.range_max:
            return True
        if spec.range_step is not None:
            step = ceil_value(spec.range_step)
            if step > 0 and (ceil_value(value) - ceil_value(spec.range_min)) % step != 0:
                return True
        return False
    if spec.valid_values is not None:
        return value not in spec.valid_values
    return False


_EMPTY: dict[str, Number] = {}


def compute_consumption(
    device: Device,
    requested: tuple[tuple[str, Number], ...] | None,
    committed: Mapping[str, Number] | None,
    allocating: Mapping[str, Number] | None,
) -> dict[str, Number] | None:
    """``CmpRequestOverCapacity``: every capacity's consumption, or None when the device cannot take it."""
    wanted = dict(requested) if requested else _EMPTY
    capacity = device.capacity
    for key in wanted:
        if key not in capacity:
            return None
    committed = committed or _EMPTY
    allocating = allocating or _EMPTY
    consumed: dict[str, Number] = {}
    for key, spec in capacity.items():
        value = consumed_value(wanted.get(key), spec)
        if violates_policy(value, spec):
            return None
        if value + committed.get(key, 0) + allocating.get(key, 0) > spec.value:
            return None
        consumed[key] = value
    return consumed

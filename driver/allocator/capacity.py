"""Consumable capacity (KEP-5075): request-policy rounding, policy checks, the per-device fit test.

Mirrors upstream ``structured/internal/incubating/consumable_capacity.go`` (kubernetes
``staging/src/k8s.io/dynamic-resource-allocation``): every capacity of the device is consumed (an
unrequested one consumes the policy default, else the whole value), a request naming a capacity
the device lacks skips the device, and the sum of committed, in-pass and new consumption may not
exceed the capacity value.
"""

from __future__ import annotations

from collections.abc import Mapping

from driver.allocator.model import CapacitySpec, Device
from driver.allocator.quantity import Number, ceil_value

__all__ = [
    "CAPACITY_WEIGHTS",
    "FULLNESS_POWER",
    "compute_consumption",
    "consumed_value",
    "room_score",
    "room_term",
    "violates_policy",
]


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
_BASE: dict[
    tuple[int, tuple[tuple[str, Number], ...] | None], tuple[tuple[str, Number, Number], ...] | None
] = {}


def _base_consumption(
    device: Device, requested: tuple[tuple[str, Number], ...] | None
) -> tuple[tuple[str, Number, Number], ...] | None:
    """(capacity, consumed, value) for every capacity, or None (missing capacity, policy violated).

    Depends only on the device's capacities and the request, so it is memoized by ``capacity_id``.
    """
    key = (device.capacity_id, requested)
    if key in _BASE:
        return _BASE[key]
    wanted = dict(requested) if requested else _EMPTY
    capacity = device.capacity
    result: tuple[tuple[str, Number, Number], ...] | None
    if any(name not in capacity for name in wanted):
        result = None
    else:
        rows: list[tuple[str, Number, Number]] = []
        allowed = True
        for name, spec in capacity.items():
            value = consumed_value(wanted.get(name), spec)
            if violates_policy(value, spec):
                allowed = False
                break
            rows.append((name, value, spec.value))
        result = tuple(rows) if allowed else None
    if len(_BASE) > 100_000:
        _BASE.clear()
    _BASE[key] = result
    return result


def compute_consumption(
    device: Device,
    requested: tuple[tuple[str, Number], ...] | None,
    committed: Mapping[str, Number] | None,
    allocating: Mapping[str, Number] | None,
) -> dict[str, Number] | None:
    """``CmpRequestOverCapacity``: every capacity's consumption, or None when the device cannot take it."""
    base = _base_consumption(device, requested)
    if base is None:
        return None
    if committed is None and allocating is None:
        for _name, value, total in base:
            if value > total:
                return None
        return {name: value for name, value, _ in base}
    committed = committed or _EMPTY
    allocating = allocating or _EMPTY
    for name, value, total in base:
        if value + committed.get(name, 0) + allocating.get(name, 0) > total:
            return None
    return {name: value for name, value, _ in base}


# How much each capacity weighs in ``room_score`` (others: 1). Compute counts double: chosen for the
# rule before (the room left after the share), over bench/bench_allocator.py's memory-bound,
# compute-bound and mixed families; with the current rule (fullest first, below) it is again the weight
# that meets the criterion on bench/packing_traces.py's tuning traces (equal weights: balanced prefix
# -1, mixed GPUs +1).
CAPACITY_WEIGHTS: Mapping[str, float] = {"compute": 2.0}

# The power of each capacity's fraction used in ``room_score``: the weighted L4 norm of the load.
FULLNESS_POWER = 4


def room_term(used_fraction: float) -> float:
    """One capacity's part of ``room_score``: 1 less the fraction used to the power ``FULLNESS_POWER``."""
    used = min(max(used_fraction, 0.0), 1.0)
    return 1.0 - used**FULLNESS_POWER


def room_score(
    device: Device, committed: Mapping[str, Number] | None, extra: Mapping[str, Number] | None = None
) -> float:
    """How empty a shared device is *before* a new share lands on it: over its capacities, weighted by
    ``CAPACITY_WEIGHTS``, 1 less the fourth power of the fraction ``committed`` and ``extra`` (what
    this pass already placed there) use. 0 is full in every capacity; best-fit prefers the smallest.

    The rule: a share goes to the fullest device in use that can take it, fullness being
    the weighted L4 norm of the device's load. Devices are ranked by their load alone, not by what the
    share would leave: that is first-fit with the devices in use ordered fullest first instead of
    oldest first (in one dimension, exactly best-fit). Ranked by the room left *after* the share
    instead (the rule before, and every norm of it tried), the share picks whichever device it would
    close, even in a capacity that does not bind: in the mixed family none of those used fewer GPUs
    than first-fit. The power sits between the sum (L1: Kubernetes' MostAllocated, which treats a
    device half full in both capacities as full in one) and the largest fraction (the dominant share,
    which ignores the other capacity). What was tried, on bench/packing_traces.py's tuning seeds only,
    and with what figures, is in that module's docstring.
    """
    score = 0.0
    committed = committed or _EMPTY
    extra = extra or _EMPTY
    for name, spec in device.capacity.items():
        total = spec.value
        if total <= 0:
            continue
        used = float(committed.get(name, 0) + extra.get(name, 0)) / float(total)
        score += CAPACITY_WEIGHTS.get(name, 1.0) * room_term(used)
    return score

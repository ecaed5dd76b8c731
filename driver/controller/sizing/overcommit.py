"""Devices allocated beyond what they publish: pure, no I/O.

Two allocators write claims in one cluster (ours and kube-scheduler's); each checks its own view,
so a race can leave a device holding more than it offers. Per device, the ``consumedCapacity`` of
every allocated share is summed against the capacity the device's slice publishes, per dimension;
a device held exclusively by more than one claim, or exclusively and shared at once, is
overcommitted too (dimension ``exclusive``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from driver.controller.model.objects import object_key, quantity

__all__ = ["Overcommit", "compute_overcommits"]

DeviceKey = tuple[str, str, str]  # (driver, pool, device)


@dataclass(frozen=True, slots=True)
class Overcommit:
    device: DeviceKey
    dimension: str  # a capacity name, or "exclusive"
    consumed: Decimal  # the sum over the claims (for "exclusive": how many claims hold the device)
    capacity: Decimal  # what the device publishes (for "exclusive": 1)
    claims: tuple[str, ...]  # namespace/name of every claim on the device, sorted

    @property
    def device_name(self) -> str:
        return "/".join(self.device)

    def describe(self) -> str:
        if self.dimension == "exclusive":
            return (
                f"device {self.device_name} is allocated {int(self.consumed)} times at once, at least once "
                f"exclusively ({', '.join(self.claims)})"
            )
        return (
            f"device {self.device_name} is overcommitted on {self.dimension}: the claims on it consume "
            f"{self.consumed}, it publishes {self.capacity} ({', '.join(self.claims)})"
        )


def _published(
    slices: Iterable[Mapping[str, Any]], only: frozenset[DeviceKey] | None
) -> dict[DeviceKey, dict[str, Decimal]]:
    found: dict[DeviceKey, dict[str, Decimal]] = {}
    for resource_slice in slices:
        spec = resource_slice.get("spec") or {}
        driver, pool = str(spec.get("driver", "")), str((spec.get("pool") or {}).get("name", ""))
        for device in spec.get("devices") or ():
            if only is not None and (driver, pool, str(device.get("name", ""))) not in only:
                continue
            capacity: dict[str, Decimal] = {}
            for name, value in (device.get("capacity") or {}).items():
                try:
                    capacity[str(name)] = quantity((value or {}).get("value"))
                except ValueError:
                    continue  # unreadable: the allocators skip it too
            found[(driver, pool, str(device.get("name", "")))] = capacity
    return found


def _results(claim: Mapping[str, Any]) -> Any:
    allocation = (claim.get("status") or {}).get("allocation") or {}
    return (allocation.get("devices") or {}).get("results") or ()


def compute_overcommits(
    slices: Iterable[Mapping[str, Any]],
    claims: Iterable[Mapping[str, Any]],
    *,
    only: Iterable[DeviceKey] | None = None,
) -> tuple[Overcommit, ...]:
    """Every (device, dimension) the allocated ``claims`` hold beyond what ``slices`` publish,
    sorted. Devices no slice publishes (a node being removed) are left out: nothing to compare;
    so are devices outside ``only``, when given (a commit checks its own devices, not their pool's)."""
    claims = list(claims)
    held = {
        (str(r.get("driver", "")), str(r.get("pool", "")), str(r.get("device", "")))
        for claim in claims
        for r in _results(claim)
    }
    # Only a device some claim holds can be overcommitted: the others' capacities are not parsed
    # (every published device's, each refresh of the metrics, took 0.5 s at 5,000 nodes).
    published = _published(slices, frozenset(held) if only is None else frozenset(only) & held)
    consumed: dict[DeviceKey, dict[str, Decimal]] = {}
    holders: dict[DeviceKey, set[str]] = {}
    exclusive: dict[DeviceKey, int] = {}
    results: dict[DeviceKey, int] = {}
    for claim in claims:
        key = str(object_key(dict(claim)))
        for result in _results(claim):
            if result.get("adminAccess"):
                continue  # admin access holds nothing (upstream)
            device = (
                str(result.get("driver", "")),
                str(result.get("pool", "")),
                str(result.get("device", "")),
            )
            if device not in published:
                continue
            holders.setdefault(device, set()).add(key)
            results[device] = results.get(device, 0) + 1
            if not result.get("shareID"):
                exclusive[device] = exclusive.get(device, 0) + 1
                continue
            sums = consumed.setdefault(device, {})
            for name, value in (result.get("consumedCapacity") or {}).items():
                try:
                    sums[str(name)] = sums.get(str(name), Decimal(0)) + quantity(value)
                except ValueError:
                    continue
    found: list[Overcommit] = []
    for device, names in sorted(holders.items()):
        claims_on = tuple(sorted(names))
        if exclusive.get(device) and results[device] > 1:
            found.append(Overcommit(device, "exclusive", Decimal(results[device]), Decimal(1), claims_on))
        for name, total in sorted((consumed.get(device) or {}).items()):
            capacity = published[device].get(name)
            if capacity is not None and total > capacity:
                found.append(Overcommit(device, name, total, capacity, claims_on))
    return tuple(found)

"""Would an allocation someone else wrote book a device past what it publishes? (pure, no I/O)

Two allocators can write allocations for the same devices: ours and kube-scheduler's (for pods
that do not carry our scheduling gate). Each decides on its own view, so without a common check a
device can be booked twice. ``check_booking`` is that check: the allocation a claim is about to
get, against everything the allocator's state counts now for *other* claims (what the API holds,
plus what is assumed in flight), per device and per capacity, by the rules of
``ledger_entries``: admin access holds nothing; a result with a ``shareID`` consumes its
``consumedCapacity``; a result without one holds the device exclusively.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from driver.allocator.model import DeviceID
from driver.allocator.quantity import Number, format_quantity
from driver.allocator.state import ClusterData, LedgerEntry, ledger_entries

__all__ = ["Overbooking", "check_booking"]

EXCLUSIVE = "exclusive"


@dataclass(frozen=True, slots=True)
class Overbooking:
    """One device and dimension the allocation would take past its capacity."""

    device: DeviceID
    dimension: str  # a capacity name as published, or "exclusive"
    asked: Number  # what this allocation takes (for "exclusive": 1 = the whole device, 0 = a share)
    booked: Number  # what other claims hold already (for "exclusive": how many claims)
    capacity: Number  # what the device publishes (for "exclusive": 1)

    @property
    def device_name(self) -> str:
        return "/".join(self.device)

    def describe(self) -> str:
        if self.dimension == EXCLUSIVE:
            how = "the whole device" if self.asked else "a share"
            return (
                f"device {self.device_name}: asks for {how}, but {self.booked} other claim(s) already "
                "hold it and one of them (or this one) needs it alone"
            )
        return (
            f"device {self.device_name}: {self.dimension} {_amount(self.dimension, self.asked)} asked, "
            f"{_amount(self.dimension, self.booked)} of {_amount(self.dimension, self.capacity)} "
            "already allocated to other claims"
        )


def _amount(dimension: str, value: Number) -> str:
    return format_quantity(value) if dimension.rsplit("/", 1)[-1] == "memory" else str(value)


def _claim_uid(claim: Mapping[str, Any]) -> str:
    metadata = claim.get("metadata") or {}
    return str(metadata.get("uid") or f"{metadata.get('namespace', '')}/{metadata.get('name', '')}")


def check_booking(data: ClusterData, claim: Mapping[str, Any]) -> tuple[Overbooking, ...]:
    """What ``claim``'s ``status.allocation`` would hold past capacity, given what ``data`` counts for
    every other claim (the claim's own counted entries, if any, are set aside). Devices no current
    slice publishes are left out: nothing to compare against. Empty: it fits."""
    own_entries = data.claim_ledger(_claim_uid(claim))
    by_device: dict[DeviceID, list[LedgerEntry]] = {}
    for entry in ledger_entries(claim):
        by_device.setdefault(entry.device_id, []).append(entry)
    found: list[Overbooking] = []
    for device_id, entries in sorted(by_device.items()):
        device = data.device(device_id)
        if device is None:
            continue
        own = [e for e in own_entries if e.device_id == device_id]
        exclusive_others = data.exclusive_count(device_id) - sum(1 for e in own if not e.shared)
        shares_others = data.share_count(device_id) - sum(1 for e in own if e.shared)
        wants_whole = any(not e.shared for e in entries)
        holders = exclusive_others + shares_others
        if exclusive_others or (holders and (wants_whole or not device.allow_multiple)):
            found.append(Overbooking(device_id, EXCLUSIVE, int(wants_whole), holders, 1))
            continue
        if wants_whole:
            continue
        committed = dict(data.committed_consumed(device_id) or {})
        for entry in own:
            for key, value in entry.consumed:
                committed[key] = committed.get(key, 0) - value
        asked: dict[str, Number] = {}
        for entry in entries:
            for key, value in entry.consumed:
                asked[key] = asked.get(key, 0) + value
        for key, spec in sorted(device.capacity.items()):
            want = asked.get(key, 0)
            held = max(committed.get(key, 0), 0)
            if want and held + want > spec.value:
                found.append(Overbooking(device_id, key, want, held, spec.value))
    return tuple(found)

"""DRA server-side rules of the embedded API emulator (a test double): the checks of
``pkg/apis/resource/validation`` that the JSON schemas cannot express, and the silent dropping of
fields whose feature gate is off (``reference/dra-api.md`` sections 0-2)."""

from __future__ import annotations

from typing import Any

from driver.kube.emulator_store import ResourceType

__all__ = ["check_rules", "drop_disabled_fields"]

Obj = dict[str, Any]
Causes = list[tuple[str, str]]


def _drop_consumable_capacity(obj: Obj) -> Obj:
    spec = obj.get("spec") or {}
    devices = []
    for device in spec.get("devices") or []:
        device = {k: v for k, v in device.items() if k != "allowMultipleAllocations"}
        if device.get("capacity"):
            device["capacity"] = {
                key: {k: v for k, v in capacity.items() if k != "requestPolicy"}
                for key, capacity in device["capacity"].items()
            }
        devices.append(device)
    if "devices" in spec:
        spec = {**spec, "devices": devices}
    return {**obj, "spec": spec}


def drop_disabled_fields(rtype: ResourceType, obj: Obj, disabled_features: frozenset[str]) -> Obj:
    """Silently drop the fields of disabled gates, as an apiserver with the gate off does."""
    if rtype.plural == "resourceslices" and "DRAConsumableCapacity" in disabled_features:
        return _drop_consumable_capacity(obj)
    return obj


def check_rules(rtype: ResourceType, obj: Obj, old: Obj | None) -> Causes:
    """(field, problem) for every broken rule; empty when the object is acceptable."""
    if rtype.plural == "resourceclaims" and old is not None and obj.get("spec") != old.get("spec"):
        return [("spec", "Invalid value: field is immutable")]
    return []

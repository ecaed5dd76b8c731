"""DRA server-side rules of the embedded API emulator (a test double): the checks of kubernetes
``pkg/apis/resource/validation/validation.go`` that the JSON schemas cannot express (the limits
are the constants of ``staging/src/k8s.io/api/resource/v1/types.go``), object names and labels,
and the silent dropping of fields whose feature gate is off."""

from __future__ import annotations

import itertools
import re
from decimal import Decimal
from typing import Any

from driver.cluster.apiserver import bodies
from driver.cluster.apiserver.formats import (
    Causes,
    canonical_time,
    check_metadata,
    dns_label,
    dns_subdomain,
    label_key,
    label_value,
    qualified_name,
    quantity,
    too_many,
)
from driver.cluster.apiserver.store import ResourceType

__all__ = ["check_rules", "drop_disabled_fields"]

Obj = dict[str, Any]

_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)"
    r"(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_ATTRIBUTE_VALUE_FIELDS = ("int", "bool", "string", "version", "ints", "bools", "strings", "versions")
_TAINT_EFFECTS = frozenset({"None", "NoSchedule", "NoExecute"})
_NODE_SELECTION = ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")

MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_WITH_ADVANCED_FEATURES = 64
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_TAINTS_PER_DEVICE = 16
MAX_ATTRIBUTE_STRING_LENGTH = 64
MAX_VALID_VALUES = 10
MAX_SHARED_COUNTER_SETS = 8
MAX_COUNTER_CONSUMPTIONS = 2
MAX_REQUESTS = 32
MAX_RESULTS = 32
MAX_RESERVED_FOR = 256
MAX_OPAQUE_PARAMETERS_BYTES = 10 * 1024


# --- dropped fields --------------------------------------------------------------------------


def _drop_consumable_capacity(obj: Obj) -> Obj:
    spec = obj.get("spec") or {}
    if "devices" not in spec:
        return obj
    devices = []
    for device in spec.get("devices") or []:
        device = {k: v for k, v in device.items() if k != "allowMultipleAllocations"}
        if device.get("capacity"):
            device["capacity"] = {
                key: {k: v for k, v in capacity.items() if k != "requestPolicy"}
                for key, capacity in device["capacity"].items()
            }
        devices.append(device)
    return {**obj, "spec": {**spec, "devices": devices}}


def _drop_device_taints(obj: Obj) -> Obj:
    spec = obj.get("spec") or {}
    if "devices" not in spec:
        return obj
    devices = [{k: v for k, v in device.items() if k != "taints"} for device in spec.get("devices") or []]
    return {**obj, "spec": {**spec, "devices": devices}}


def drop_disabled_fields(rtype: ResourceType, obj: Obj, disabled_features: frozenset[str]) -> Obj:
    """Silently drop slice fields of disabled gates, as an apiserver with the gate off does:
    ``DRAConsumableCapacity`` (``allowMultipleAllocations``, ``requestPolicy``) and
    ``DRADeviceTaints`` (device ``taints``)."""
    if rtype.plural != "resourceslices":
        return obj
    if "DRAConsumableCapacity" in disabled_features:
        obj = _drop_consumable_capacity(obj)
    if "DRADeviceTaints" in disabled_features:
        obj = _drop_device_taints(obj)
    return obj


# --- ResourceSlice ---------------------------------------------------------------------------


def _check_request_policy(policy: Obj, value: Decimal | None, base: str, causes: Causes) -> None:
    default = quantity(policy["default"], f"{base}.default", causes) if "default" in policy else None
    values, valid_range = policy.get("validValues"), policy.get("validRange")
    if values is not None and valid_range is not None:
        causes.append((base, "Invalid value: exactly one of validValues or validRange may be set"))
    if (values is not None or valid_range is not None) and "default" not in policy:
        causes.append((f"{base}.default", "Required value: required when validValues or validRange is set"))
    if values is not None:
        parsed = [quantity(item, f"{base}.validValues[{i}]", causes) for i, item in enumerate(values)]
        if not 1 <= len(values) <= MAX_VALID_VALUES:
            causes.append(
                (f"{base}.validValues", f"Invalid value: must have 1 to {MAX_VALID_VALUES} entries")
            )
        numbers = [number for number in parsed if number is not None]
        if any(later <= earlier for earlier, later in itertools.pairwise(numbers)):
            causes.append(
                (f"{base}.validValues", "Invalid value: must be sorted in ascending order without duplicates")
            )
        if value is not None and any(number > value for number in numbers):
            causes.append(
                (f"{base}.validValues", "Invalid value: entries must not exceed the capacity value")
            )
        if default is not None and default not in numbers:
            causes.append((f"{base}.default", "Invalid value: default must be one of validValues"))
    if valid_range is not None:
        range_base = f"{base}.validRange"
        if "min" not in valid_range:
            causes.append((f"{range_base}.min", "Required value"))
            return
        low = quantity(valid_range["min"], f"{range_base}.min", causes)
        high = quantity(valid_range["max"], f"{range_base}.max", causes) if "max" in valid_range else None
        step = quantity(valid_range["step"], f"{range_base}.step", causes) if "step" in valid_range else None
        if low is None or value is None:
            return
        if not 0 <= low <= value:
            causes.append(
                (f"{range_base}.min", "Invalid value: min must be between 0 and the capacity value")
            )
        if high is not None and not low <= high <= value:
            causes.append(
                (f"{range_base}.max", "Invalid value: max must be between min and the capacity value")
            )
        if step is not None and (step <= 0 or low + step > value):
            causes.append(
                (f"{range_base}.step", "Invalid value: step must be positive and min + step <= value")
            )
        if default is not None and not (
            low <= default and (high is None or default <= high) and default <= value
        ):
            causes.append((f"{base}.default", "Invalid value: default must lie within validRange"))
        if step is not None and step > 0:
            for label, amount in (("default", default), ("validRange.max", high)):
                if amount is not None and (amount - low) % step != 0:
                    causes.append((f"{base}.{label}", f"Invalid value: {label} must equal min + n*step"))


def _check_device(device: Obj, base: str, per_device_nodes: bool, causes: Causes) -> None:
    attributes, capacity = device.get("attributes") or {}, device.get("capacity") or {}
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        causes.append(
            (
                base,
                f"Too many: {len(attributes) + len(capacity)}: must have at most "
                f"{MAX_ATTRIBUTES_AND_CAPACITIES} attributes and capacities combined",
            )
        )
    for key, attribute in attributes.items():
        field = f"{base}.attributes[{key}]"
        if problem := qualified_name(key):
            causes.append((field, problem))
        present = [name for name in _ATTRIBUTE_VALUE_FIELDS if attribute.get(name) is not None]
        if len(present) != 1:
            causes.append((field, "Invalid value: exactly one value must be specified"))
        text = attribute.get("string")
        if isinstance(text, str) and len(text) > MAX_ATTRIBUTE_STRING_LENGTH:
            causes.append(
                (f"{field}.string", f"Too long: may not be more than {MAX_ATTRIBUTE_STRING_LENGTH} bytes")
            )
        version = attribute.get("version")
        if isinstance(version, str) and (
            len(version) > MAX_ATTRIBUTE_STRING_LENGTH or not _SEMVER.fullmatch(version)
        ):
            causes.append((f"{field}.version", f"Invalid value: {version!r}: must be a semantic version"))
    multiple = device.get("allowMultipleAllocations") is True
    for key, entry in capacity.items():
        field = f"{base}.capacity[{key}]"
        if problem := qualified_name(key):
            causes.append((field, problem))
        value = quantity(entry.get("value"), f"{field}.value", causes)
        if entry.get("requestPolicy") is not None:
            if not multiple:
                causes.append((f"{field}.requestPolicy", "Forbidden: allowMultipleAllocations must be true"))
            _check_request_policy(entry["requestPolicy"], value, f"{field}.requestPolicy", causes)
    taints = device.get("taints") or []
    too_many(taints, MAX_TAINTS_PER_DEVICE, f"{base}.taints", causes)
    for index, taint in enumerate(taints):
        if problem := label_key(str(taint.get("key", ""))):
            causes.append((f"{base}.taints[{index}].key", problem))
        if problem := label_value(taint.get("value", "")):
            causes.append((f"{base}.taints[{index}].value", problem))
        if taint.get("effect") not in _TAINT_EFFECTS:
            causes.append(
                (
                    f"{base}.taints[{index}].effect",
                    f"Unsupported value: {taint.get('effect')!r}: supported values: {sorted(_TAINT_EFFECTS)}",
                )
            )
    too_many(device.get("consumesCounters"), MAX_COUNTER_CONSUMPTIONS, f"{base}.consumesCounters", causes)
    selection = [
        name for name in ("nodeName", "nodeSelector", "allNodes") if device.get(name) not in (None, False)
    ]
    if per_device_nodes and len(selection) != 1:
        causes.append((base, "Invalid value: exactly one of nodeName, nodeSelector or allNodes is required"))
    if not per_device_nodes and selection:
        causes.append(
            (f"{base}.{selection[0]}", "Forbidden: only allowed when perDeviceNodeSelection is true")
        )


def _check_slice(spec: Obj, old_spec: Obj | None, causes: Causes) -> None:
    driver = spec.get("driver")
    if problem := dns_subdomain(driver.lower() if isinstance(driver, str) else driver, 63):
        causes.append(("spec.driver", problem))
    pool = spec.get("pool") or {}
    pool_name = pool.get("name")
    if not isinstance(pool_name, str) or not pool_name or len(pool_name) > 253:
        causes.append(("spec.pool.name", "Invalid value: must be 1 to 253 characters"))
    else:
        for part in pool_name.split("/"):
            if problem := dns_subdomain(part):
                causes.append(("spec.pool.name", problem))
                break
    if int(pool.get("generation") or 0) < 0:
        causes.append(("spec.pool.generation", "Invalid value: must be greater than or equal to 0"))
    if int(pool.get("resourceSliceCount") or 0) <= 0:
        causes.append(("spec.pool.resourceSliceCount", "Invalid value: must be greater than zero"))
    selection = [name for name in _NODE_SELECTION if name in spec and spec[name] is not None]
    if len(selection) != 1:
        causes.append(
            (
                "spec",
                "Invalid value: exactly one of nodeName, nodeSelector, allNodes or "
                f"perDeviceNodeSelection is required, found {selection or 'none'}",
            )
        )
    for flag in ("allNodes", "perDeviceNodeSelection"):
        if spec.get(flag) is False:
            causes.append((f"spec.{flag}", "Invalid value: false: may only be set to true"))
    if "nodeName" in spec and (problem := dns_subdomain(spec["nodeName"])):
        causes.append(("spec.nodeName", problem))
    terms = (spec.get("nodeSelector") or {}).get("nodeSelectorTerms")
    if spec.get("nodeSelector") is not None and len(terms or []) != 1:
        causes.append(
            ("spec.nodeSelector.nodeSelectorTerms", "Invalid value: must have exactly one node selector term")
        )
    devices = spec.get("devices") or []
    advanced = any(device.get("taints") or device.get("consumesCounters") for device in devices)
    limit = MAX_DEVICES_WITH_ADVANCED_FEATURES if advanced else MAX_DEVICES_PER_SLICE
    too_many(devices, limit, "spec.devices", causes)
    seen: set[str] = set()
    for index, device in enumerate(devices):
        base = f"spec.devices[{index}]"
        name = device.get("name")
        if problem := dns_label(name):
            causes.append((f"{base}.name", problem))
        elif name in seen:
            causes.append((f"{base}.name", f"Duplicate value: {name!r}"))
        seen.add(str(name))
        _check_device(device, base, spec.get("perDeviceNodeSelection") is True, causes)
    counters = spec.get("sharedCounters") or []
    too_many(counters, MAX_SHARED_COUNTER_SETS, "spec.sharedCounters", causes)
    if counters and devices:
        causes.append(("spec", "Invalid value: a slice holds either devices or sharedCounters, not both"))
    if old_spec is not None:
        for field, before, after in (
            ("spec.driver", old_spec.get("driver"), spec.get("driver")),
            ("spec.pool.name", (old_spec.get("pool") or {}).get("name"), pool_name),
            ("spec.nodeName", old_spec.get("nodeName"), spec.get("nodeName")),
        ):
            if before != after:
                causes.append((field, "Invalid value: field is immutable"))


# --- DeviceClass, ResourceClaim --------------------------------------------------------------


def _check_opaque(config: list[Obj], base: str, causes: Causes) -> None:
    for index, entry in enumerate(config):
        opaque = entry.get("opaque") or {}
        if problem := dns_subdomain(str(opaque.get("driver", "")).lower(), 63):
            causes.append((f"{base}[{index}].opaque.driver", problem))
        parameters = opaque.get("parameters")
        if not isinstance(parameters, dict):
            causes.append((f"{base}[{index}].opaque.parameters", "Invalid value: must be a JSON object"))
        elif len(bodies.dumps(parameters)) > MAX_OPAQUE_PARAMETERS_BYTES:
            causes.append(
                (
                    f"{base}[{index}].opaque.parameters",
                    f"Too long: may not be more than {MAX_OPAQUE_PARAMETERS_BYTES} bytes",
                )
            )


def _check_claim_spec(spec: Obj, base: str, causes: Causes) -> None:
    devices = spec.get("devices") or {}
    requests = devices.get("requests") or []
    too_many(requests, MAX_REQUESTS, f"{base}.devices.requests", causes)
    names: set[str] = set()
    for index, request in enumerate(requests):
        field = f"{base}.devices.requests[{index}]"
        if problem := dns_label(request.get("name")):
            causes.append((f"{field}.name", problem))
        elif request["name"] in names:
            causes.append((f"{field}.name", f"Duplicate value: {request['name']!r}"))
        names.add(str(request.get("name")))
        variants = [key for key in ("exactly", "firstAvailable") if request.get(key) is not None]
        if len(variants) != 1:
            causes.append((field, "Invalid value: exactly one of exactly or firstAvailable is required"))
        subrequests = [request["exactly"]] if request.get("exactly") else request.get("firstAvailable") or []
        for sub_index, sub in enumerate(subrequests):
            sub_field = (
                f"{field}.exactly" if request.get("exactly") else f"{field}.firstAvailable[{sub_index}]"
            )
            mode = sub.get("allocationMode", "ExactCount")
            if mode not in ("ExactCount", "All"):
                causes.append((f"{sub_field}.allocationMode", f"Unsupported value: {mode!r}"))
            if mode == "ExactCount" and sub.get("count") is not None and int(sub["count"]) <= 0:
                causes.append((f"{sub_field}.count", "Invalid value: must be greater than zero"))
            if mode == "All" and sub.get("count") is not None:
                causes.append((f"{sub_field}.count", "Forbidden: must not be set when allocationMode is All"))
            for key, amount in ((sub.get("capacity") or {}).get("requests") or {}).items():
                quantity(amount, f"{sub_field}.capacity.requests[{key}]", causes)
    _check_opaque(devices.get("config") or [], f"{base}.devices.config", causes)


def _check_claim_status(status: Obj, old_status: Obj, deleting: bool, causes: Causes) -> None:
    allocation, old_allocation = status.get("allocation"), old_status.get("allocation")
    if allocation is not None and "allocationTimestamp" in allocation:  # compared as times, as stored
        allocation["allocationTimestamp"] = canonical_time(allocation["allocationTimestamp"])
    if old_allocation is not None and allocation is not None and allocation != old_allocation:
        causes.append(("status.allocation", "Invalid value: field is immutable (it may only be cleared)"))
    results = ((allocation or {}).get("devices") or {}).get("results") or []
    too_many(results, MAX_RESULTS, "status.allocation.devices.results", causes)
    allocated = set()
    for index, result in enumerate(results):
        share_id = result.get("shareID")
        if share_id is not None and not _UUID.fullmatch(str(share_id)):
            causes.append(
                (
                    f"status.allocation.devices.results[{index}].shareID",
                    f"Invalid value: {share_id!r}: must be a lowercase UUID",
                )
            )
        for key, amount in (result.get("consumedCapacity") or {}).items():
            quantity(amount, f"status.allocation.devices.results[{index}].consumedCapacity[{key}]", causes)
        allocated.add((result.get("driver"), result.get("pool"), result.get("device"), share_id))
    reserved = status.get("reservedFor") or []
    too_many(reserved, MAX_RESERVED_FOR, "status.reservedFor", causes)
    if reserved and allocation is None:
        causes.append(("status.reservedFor", "Forbidden: may not be specified when `allocated` is not set"))
    uids = [entry.get("uid") for entry in reserved]
    if len(set(uids)) != len(uids):
        causes.append(("status.reservedFor", "Duplicate value: entries must be unique by uid"))
    if deleting and set(uids) - {entry.get("uid") for entry in old_status.get("reservedFor") or []}:
        causes.append(
            (
                "status.reservedFor",
                "Forbidden: new entries may not be added while `deallocationRequested` "
                "or `deletionTimestamp` are set",
            )
        )
    for index, entry in enumerate(status.get("devices") or []):
        key = (entry.get("driver"), entry.get("pool"), entry.get("device"), entry.get("shareID"))
        if key not in allocated:
            causes.append(
                (f"status.devices[{index}]", f"Invalid value: {key}: must match an allocated device")
            )


def check_rules(rtype: ResourceType, obj: Obj, old: Obj | None) -> Causes:
    """(field, problem) for every broken rule; empty when the object is acceptable."""
    causes: Causes = []
    check_metadata(rtype, obj, causes)
    spec = obj.get("spec") or {}
    if rtype.plural == "resourceslices":
        _check_slice(spec, (old or {}).get("spec") if old else None, causes)
    elif rtype.plural == "deviceclasses":
        too_many(spec.get("selectors"), 32, "spec.selectors", causes)
        too_many(spec.get("config"), 32, "spec.config", causes)
        _check_opaque(spec.get("config") or [], "spec.config", causes)
    elif rtype.plural == "resourceclaims":
        if old is not None and spec != old.get("spec"):
            causes.append(("spec", "Invalid value: field is immutable"))
        elif old is None:
            _check_claim_spec(spec, "spec", causes)
        deleting = bool((old or {}).get("metadata", {}).get("deletionTimestamp"))
        _check_claim_status(obj.get("status") or {}, (old or {}).get("status") or {}, deleting, causes)
    elif rtype.plural == "resourceclaimtemplates":
        if old is not None and spec != old.get("spec"):
            causes.append(("spec", "Invalid value: field is immutable"))
        _check_claim_spec(spec.get("spec") or {}, "spec.spec", causes)
    return causes

"""DRA server-side rules of the embedded API emulator (a test double): the checks of kubernetes
``pkg/apis/resource/validation/validation.go`` that the JSON schemas cannot express (the limits
are the constants of ``staging/src/k8s.io/api/resource/v1/types.go``), in the order, field paths
and wording of kube-apiserver 1.37 (the differential corpus's recording); object names and labels;
the defaults of ``pkg/apis/resource/v1/defaults.go`` for claims and templates; quantities that do
not parse (refused when the body is decoded, 400); and the silent dropping of fields whose
feature gate is off."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

import cel
from kubernetes.utils.quantity import parse_quantity

from driver.allocator.celenv import SelectorError, compile_selector
from driver.cluster.apiserver import bodies
from driver.cluster.apiserver.formats import (
    Causes,
    binary_quantity,
    c_identifier,
    canonical_time,
    check_metadata,
    dns_label_problems,
    dns_subdomain_problems,
    driver_name,
    format_quantity,
    go_json,
    go_quantity,
    go_quote,
    go_value,
    label_name,
    label_value_problems,
    unsupported,
)
from driver.cluster.apiserver.store import ResourceType, StatusError

__all__ = ["check_decodable", "check_rules", "default_claim", "default_claim_devices", "drop_disabled_fields"]

Obj = dict[str, Any]

_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)"
    r"(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
_ATTRIBUTE_VALUE_FIELDS = ("int", "bool", "string", "version", "ints", "bools", "strings", "versions")
_TAINT_EFFECTS = ("NoExecute", "NoSchedule", "None")  # sorted, as sets.List prints them
_TOLERATION_OPERATORS = ("Equal", "Exists")
_ALLOCATION_MODES = ("All", "ExactCount")
_CONSTRAINT_ATTRIBUTES = ("matchAttribute", "distinctAttribute")
_NODE_SELECTION = ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
_REQUEST_REF = (
    "must be the name of a request in the claim or the name of a request and a subrequest separated by '/'"
)
_NODE_CHOICE = "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required"
_DEVICE_NODE_CHOICE = (
    "exactly one of `nodeName`, `nodeSelector`, or `allNodes` is required when `perDeviceNodeSelection` "
    "is set to true in the ResourceSlice spec"
)
_QUANTITY_SYNTAX = (
    "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
)

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
MAX_CONSTRAINTS = 32
MAX_CONFIGS = 32
MAX_SELECTORS = 32
MAX_SUBREQUESTS = 8
MAX_TOLERATIONS = 16
MAX_COUNTERS_PER_SET = 32


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


# --- defaults ---------------------------------------------------------------------------------


def _default_exact(request: Obj) -> Obj:
    """``SetDefaults_ExactDeviceRequest`` / ``SetDefaults_DeviceSubRequest`` and the tolerations'
    ``SetDefaults_DeviceToleration``."""
    request = dict(request)
    if not request.get("allocationMode"):
        request["allocationMode"] = "ExactCount"
    if request["allocationMode"] == "ExactCount" and not request.get("count"):
        request["count"] = 1
    if isinstance(request.get("tolerations"), list):
        request["tolerations"] = [
            {**toleration, "operator": toleration.get("operator") or "Equal"}
            if isinstance(toleration, dict)
            else toleration
            for toleration in request["tolerations"]
        ]
    return request


def default_claim_devices(spec_devices: Obj) -> Obj:
    """A claim's ``spec.devices`` as kube-apiserver stores it: each exact request and subrequest
    with its allocation mode (``ExactCount``) and, in that mode, a count (1); toleration operators
    ``Equal``; an empty request list stored as ``null`` (protobuf keeps no empty list)."""
    if not isinstance(spec_devices, dict):
        return spec_devices
    devices = dict(spec_devices)
    requests = devices.get("requests")
    if isinstance(requests, list):
        if not requests:
            devices["requests"] = None
        else:
            defaulted = []
            for request in requests:
                if isinstance(request, dict):
                    request = dict(request)
                    if isinstance(request.get("exactly"), dict):
                        request["exactly"] = _default_exact(request["exactly"])
                    if isinstance(request.get("firstAvailable"), list):
                        request["firstAvailable"] = [
                            _default_exact(sub) if isinstance(sub, dict) else sub
                            for sub in request["firstAvailable"]
                        ]
                defaulted.append(request)
            devices["requests"] = defaulted
    return devices


def default_claim(plural: str, obj: Obj) -> Obj:
    """A ResourceClaim (``plural`` ``resourceclaims``) or ResourceClaimTemplate
    (``resourceclaimtemplates``) with the defaults of :func:`default_claim_devices`; a template's
    ``spec.metadata`` is always there (``{}``: a struct, which ``omitempty`` does not drop)."""
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return obj
    if plural == "resourceclaims":
        if isinstance(spec.get("devices"), dict):
            return {**obj, "spec": {**spec, "devices": default_claim_devices(spec["devices"])}}
        return obj
    if plural == "resourceclaimtemplates":
        template_spec = spec.get("spec")
        spec = {**spec, "metadata": spec.get("metadata") or {}}
        if isinstance(template_spec, dict) and isinstance(template_spec.get("devices"), dict):
            spec["spec"] = {**template_spec, "devices": default_claim_devices(template_spec["devices"])}
        return {**obj, "spec": spec}
    return obj


# --- decoding -----------------------------------------------------------------------------------


def _quantities(rtype: ResourceType, obj: Obj) -> list[Any]:
    """Every quantity of a DRA object (what the decoder parses into ``resource.Quantity``)."""
    found: list[Any] = []

    def values(mapping: Any, key: str | None = None) -> None:
        if isinstance(mapping, dict):
            for entry in mapping.values():
                found.append(entry.get(key) if key and isinstance(entry, dict) else entry)

    def claim_devices(devices: Any) -> None:
        for request in (devices or {}).get("requests") or [] if isinstance(devices, dict) else []:
            if not isinstance(request, dict):
                continue
            subs = [request.get("exactly"), *(request.get("firstAvailable") or [])]
            for sub in subs:
                if isinstance(sub, dict):
                    values((sub.get("capacity") or {}).get("requests"))

    spec = _map(obj.get("spec"))
    if rtype.plural == "resourceclaims":
        claim_devices(spec.get("devices"))
        allocation = (
            (obj.get("status") or {}).get("allocation") if isinstance(obj.get("status"), dict) else None
        )
        for result in ((allocation or {}).get("devices") or {}).get("results") or []:
            if isinstance(result, dict):
                values(result.get("consumedCapacity"))
    elif rtype.plural == "resourceclaimtemplates":
        inner = spec.get("spec")
        if isinstance(inner, dict):
            claim_devices(inner.get("devices"))
    elif rtype.plural == "resourceslices":
        for device in spec.get("devices") or []:
            if not isinstance(device, dict):
                continue
            for capacity in (device.get("capacity") or {}).values():
                if not isinstance(capacity, dict):
                    continue
                found.append(capacity.get("value"))
                policy = capacity.get("requestPolicy")
                if isinstance(policy, dict):
                    found.append(policy.get("default"))
                    found.extend(policy.get("validValues") or [])
                    found.extend((policy.get("validRange") or {}).get(k) for k in ("min", "max", "step"))
            for consumption in device.get("consumesCounters") or []:
                if isinstance(consumption, dict):
                    values(consumption.get("counters"), "value")
        for counter_set in spec.get("sharedCounters") or []:
            if isinstance(counter_set, dict):
                values(counter_set.get("counters"), "value")
    return [value for value in found if isinstance(value, str)]


def check_decodable(rtype: ResourceType, obj: Obj) -> None:
    """Raise 400, as kube-apiserver's decoder does before any validation, for a quantity that does
    not parse (``"12 GiB"``)."""
    for text in _quantities(rtype, obj):
        if _parse(text) is None:
            raise StatusError(
                code=400,
                reason="BadRequest",
                message=f'{rtype.kind} in version "{rtype.version}" cannot be handled as a {rtype.kind}: '
                f"{_QUANTITY_SYNTAX}",
            )


def _parse(value: Any) -> Decimal | None:
    try:
        return Decimal(parse_quantity(value))  # type: ignore[no-untyped-call]  # the client ships no hints
    except (ValueError, TypeError, ArithmeticError):
        return None


# --- shared -------------------------------------------------------------------------------------


def _map(value: Any) -> Obj:
    return value if isinstance(value, dict) else {}


def _each(field: str, problems: list[str], causes: Causes) -> None:
    causes.extend((field, problem) for problem in problems)


def _too_many(items: Any, limit: int, field: str, causes: Causes) -> bool:
    """``field.TooMany``; True when the list is too long (the caller checks no item then)."""
    if isinstance(items, (list, dict)) and len(items) > limit:
        causes.append((field, f"Too many: {len(items)}: must have at most {limit} items"))
        return True
    return False


def _qualified_name(name: str, field: str, causes: Causes) -> None:
    """``validateQualifiedName``: a C identifier, optionally after ``<driver name>/``."""
    parts = name.split("/")
    if len(parts) == 1:
        _each(field, c_identifier(parts[0]), causes)
    elif len(parts) == 2:
        if not parts[0]:
            causes.append((field, 'Invalid value: "": the domain must not be empty'))
        else:
            _each(field, driver_name(parts[0]), causes)
        if not parts[1]:
            causes.append((field, 'Invalid value: "": the name must not be empty'))
        else:
            _each(field, c_identifier(parts[1]), causes)


def _fully_qualified_name(name: str, field: str, causes: Causes) -> None:
    _qualified_name(name, field, causes)
    if "/" not in name:
        causes.append(
            (
                field,
                f"Invalid value: {go_quote(name)}: a fully qualified name must be a domain and a name "
                "separated by a slash",
            )
        )


def _label_value(value: str, field: str, causes: Causes) -> None:
    _each(field, label_value_problems(value), causes)


def _uid(value: Any, field: str, causes: Causes) -> None:
    text = str(value)
    if not _UUID.fullmatch(text):
        reason = (
            f"invalid UUID length: {len(text)}"
            if len(text) not in (32, 36, 38, 41)
            else "invalid UUID format"
        )
        causes.append((field, f"Invalid value: {go_quote(text)}: error validating uid: {reason}"))
    elif text != text.lower():
        causes.append(
            (
                field,
                f"Invalid value: {go_quote(text)}: uid must be in RFC 4122 normalized form, "
                "`xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` with lowercase hexadecimal characters",
            )
        )


def _opaque_parameters(parameters: Any, field: str, causes: Causes) -> None:
    """``validateRawExtension``: a JSON object of at most 10 KiB."""
    if parameters is None:
        causes.append((field, "Required value"))
    elif bodies.encoded_size(parameters) > MAX_OPAQUE_PARAMETERS_BYTES:
        causes.append((field, f"Too long: may not be more than {MAX_OPAQUE_PARAMETERS_BYTES} bytes"))
    elif not isinstance(parameters, dict):
        causes.append((field, 'Invalid value: "<value omitted>": must be a valid JSON object'))


def _device_configuration(config: Obj, base: str, causes: Causes) -> None:
    opaque = config.get("opaque")
    if not isinstance(opaque, dict):
        causes.append((f"{base}.opaque", "Required value"))
        return
    _each(f"{base}.opaque.driver", driver_name(opaque.get("driver")), causes)
    _opaque_parameters(opaque.get("parameters"), f"{base}.opaque.parameters", causes)


def _request_refs(refs: list[Any], field: str, names: dict[str, set[str] | None], causes: Causes) -> None:
    """A constraint's or a config's ``requests``: each a request of the claim, none twice."""
    for index, ref in enumerate(refs):
        _request_ref(ref, f"{field}[{index}]", names, causes)
    _duplicates(refs, lambda r: r, field, go_value, causes)


def _request_ref(name: Any, field: str, names: dict[str, set[str] | None], causes: Causes) -> None:
    """``validateRequestNameRef``: ``<request>`` or ``<request>/<subrequest>`` of the claim."""
    text = str(name)
    segments = text.split("/")
    if len(segments) > 2:
        causes.append((field, f"Invalid value: {go_quote(text)}: {_REQUEST_REF}"))
        return
    for segment in segments:
        _each(field, dns_label_problems(segment), causes)
    known = segments[0] in names and (len(segments) == 1 or segments[1] in (names[segments[0]] or set()))
    if not known:
        causes.append((field, f"Invalid value: {go_quote(text)}: {_REQUEST_REF}"))


def _duplicates(items: list[Any], key: Any, base: str, render: Any, causes: Causes) -> None:
    seen: set[Any] = set()
    for index, item in enumerate(items):
        value = key(item)
        if value in seen:
            causes.append((f"{base}[{index}]", f"Duplicate value: {render(item)}"))
        else:
            seen.add(value)


# --- ResourceSlice ------------------------------------------------------------------------------


def _q(text: Any) -> str:
    return go_quantity(text) if isinstance(text, str) else str(text)


def _check_request_policy(policy: Obj, value_text: Any, base: str, causes: Causes) -> None:
    """``validateRequestPolicy`` as 1.37 reports it (default comparisons under ``validRange.default``)."""
    value = _parse(value_text)
    values, valid_range = policy.get("validValues"), policy.get("validRange")
    if values and valid_range is not None:
        causes.append(
            (
                base,
                'Forbidden: exactly one policy can be specified, cannot specify "validValues" and '
                '"validRange" at the same time',
            )
        )
        return
    default_text = policy.get("default")
    default = _parse(default_text) if default_text is not None else None
    if values:
        if default is None:
            causes.append((f"{base}.default", "Required value: required when validValues is defined"))
            return
        field = f"{base}.validValues"
        parsed = [_parse(item) for item in values]
        for index in range(len(parsed) - 1):
            left, right = parsed[index], parsed[index + 1]
            if left is not None and right is not None and left > right:
                causes.append(
                    (
                        f"{field}[{index + 1}]",
                        f"Invalid value: {go_quote(_q(values[index + 1]))}: values must be "
                        "sorted in ascending order",
                    )
                )
        if _too_many(values, MAX_VALID_VALUES, field, causes):
            return
        found = False
        seen: set[int] = set()
        for index, (text, number) in enumerate(zip(values, parsed, strict=True)):
            if number is None:
                continue
            if value is not None and number > value:
                causes.append(
                    (
                        f"{field}[{index}]",
                        f"Invalid value: {go_quote(_q(text))}: option is larger than capacity "
                        f"value: {_q(value_text)}",
                    )
                )
            if number == default:
                found = True
        for index, number in enumerate(parsed):
            if number is None:
                continue
            whole = int(number.to_integral_value(rounding="ROUND_CEILING"))
            if whole in seen:
                causes.append((f"{field}[{index}]", f'Duplicate value: "{whole}"'))
            seen.add(whole)
        if not found:
            causes.append(
                (
                    field,
                    f"Invalid value: {go_quote(_q(default_text))}: default value is not valid according to "
                    "the requestPolicy",
                )
            )
        return
    if valid_range is None:
        return
    if default is None:
        causes.append((f"{base}.default", "Required value: required when validRange is defined"))
        return
    field = f"{base}.validRange"
    if valid_range.get("min") is None:
        causes.append((f"{field}.min", "Required value: required when validRange is defined"))
        return
    low_text, high_text, step_text = valid_range.get("min"), valid_range.get("max"), valid_range.get("step")
    low, high, step = _parse(low_text), _parse(high_text), _parse(step_text)
    if low is None or value is None:
        return
    if low > value:
        causes.append(
            (
                f"{field}.min",
                f"Invalid value: {go_quote(_q(low_text))}: min is larger than capacity value: "
                f"{_q(value_text)}",
            )
        )
    if default < low:
        causes.append(
            (
                f"{field}.default",
                f"Invalid value: {go_quote(_q(default_text))}: default is less than min: {_q(low_text)}",
            )
        )
    if high is not None:
        if low > high:
            causes.append(
                (
                    f"{field}.max",
                    f"Invalid value: {go_quote(_q(low_text))}: min is larger than max: {_q(high_text)}",
                )
            )
        if high > value:
            causes.append(
                (
                    f"{field}.max",
                    f"Invalid value: {go_quote(_q(high_text))}: max is larger than capacity value: "
                    f"{_q(value_text)}",
                )
            )
        if default > high:
            causes.append(
                (
                    f"{field}.default",
                    f"Invalid value: {go_quote(_q(default_text))}: default is more than max: {_q(high_text)}",
                )
            )
    if step is not None:
        added = low + step
        if added > value:
            causes.append(
                (
                    f"{field}.step",
                    f"Invalid value: {go_quote(_q(step_text))}: one step "
                    f"{format_quantity(added, binary_quantity(low_text))} is larger than capacity value: "
                    f"{_q(value_text)}",
                )
            )
        whole_step = int(step.to_integral_value(rounding="ROUND_CEILING"))
        whole_low = int(low.to_integral_value(rounding="ROUND_CEILING"))
        for text, amount in ((default_text, default), (high_text, high)):
            if amount is None or whole_step == 0:
                continue
            difference = int(amount.to_integral_value(rounding="ROUND_CEILING")) - whole_low
            if abs(difference) % whole_step != 0:
                causes.append(
                    (
                        f"{field}.step",
                        f"Invalid value: {go_quote(_q(text))}: value is not a multiple of a given "
                        f"step ({_q(step_text)}) from ({_q(low_text)})",
                    )
                )


def _check_attribute(attribute: Any, field: str, causes: Causes) -> None:
    attribute = _map(attribute)
    present = [name for name in _ATTRIBUTE_VALUE_FIELDS if attribute.get(name) is not None]
    text = attribute.get("string")
    if isinstance(text, str) and len(text) > MAX_ATTRIBUTE_STRING_LENGTH:
        causes.append(
            (f"{field}.string", f"Too long: may not be more than {MAX_ATTRIBUTE_STRING_LENGTH} bytes")
        )
    version = attribute.get("version")
    if isinstance(version, str):
        if not _SEMVER.fullmatch(version):
            causes.append(
                (
                    f"{field}.version",
                    f"Invalid value: {go_quote(version)}: must be a string compatible with "
                    "semver.org spec 2.0.0",
                )
            )
        if len(version) > MAX_ATTRIBUTE_STRING_LENGTH:
            causes.append(
                (f"{field}.version", f"Too long: may not be more than {MAX_ATTRIBUTE_STRING_LENGTH} bytes")
            )
    names = ", ".join(f"`{name}`" for name in _ATTRIBUTE_VALUE_FIELDS)
    if not present:
        causes.append((field, f'Invalid value: "": must specify one of: {names}'))
    elif len(present) > 1:
        causes.append(
            (
                field,
                f'Invalid value: "{{{", ".join(sorted(present))}}}": must specify exactly one of: {names}',
            )
        )


def _check_taint(taint: Obj, base: str, causes: Causes) -> None:
    _each(f"{base}.key", label_name(str(taint.get("key") or "")), causes)
    if taint.get("value"):
        _label_value(str(taint["value"]), f"{base}.value", causes)
    effect = taint.get("effect")
    if not effect:
        causes.append((f"{base}.effect", "Required value"))
    elif effect not in _TAINT_EFFECTS:
        causes.append((f"{base}.effect", unsupported(effect, _TAINT_EFFECTS)))


def _check_device(device: Obj, base: str, per_device_nodes: bool, causes: Causes) -> None:
    _each(f"{base}.name", dns_label_problems(device.get("name")), causes)
    attributes = _map(device.get("attributes"))
    capacity = _map(device.get("capacity"))
    total = len(attributes) + len(capacity)
    if total > MAX_ATTRIBUTES_AND_CAPACITIES:
        causes.append(
            (
                base,
                f"Invalid value: {total}: the total number of attributes and capacities must not exceed "
                f"{MAX_ATTRIBUTES_AND_CAPACITIES}",
            )
        )
    for key, attribute in attributes.items():
        _qualified_name(key, f"{base}.attributes", causes)
        _check_attribute(attribute, f"{base}.attributes[{key}]", causes)
    multiple = device.get("allowMultipleAllocations") is True
    for key, entry in capacity.items():
        _qualified_name(key, f"{base}.capacity", causes)
        entry = _map(entry)
        if entry.get("requestPolicy") is not None:
            field = f"{base}.capacity[{key}].requestPolicy"
            if multiple:
                _check_request_policy(entry["requestPolicy"], entry.get("value"), field, causes)
            else:
                causes.append((field, "Forbidden: allowMultipleAllocations must be true"))
    taints = device.get("taints") or []
    if not _too_many(taints, MAX_TAINTS_PER_DEVICE, f"{base}.taints", causes):
        for index, taint in enumerate(taints):
            _check_taint(_map(taint), f"{base}.taints[{index}]", causes)
    consumptions = device.get("consumesCounters") or []
    if not _too_many(consumptions, MAX_COUNTER_CONSUMPTIONS, f"{base}.consumesCounters", causes):
        for index, consumption in enumerate(consumptions):
            _check_counters(consumption, "counterSet", f"{base}.consumesCounters[{index}]", causes)
        _duplicates(
            consumptions,
            lambda c: c.get("counterSet"),
            f"{base}.consumesCounters",
            lambda c: go_value(c.get("counterSet")),
            causes,
        )
    if per_device_nodes:
        chosen = []
        if device.get("nodeName") is not None:
            if device["nodeName"]:
                chosen.append("`nodeName`")
                _each(f"{base}.nodeName", dns_subdomain_problems(device["nodeName"]), causes)
            else:
                causes.append((f"{base}.nodeName", 'Invalid value: "": must not be empty'))
        if device.get("nodeSelector") is not None:
            chosen.append("`nodeSelector`")
        if device.get("allNodes") is not None:
            if device["allNodes"]:
                chosen.append("`allNodes`")
            else:
                causes.append(
                    (f"{base}.allNodes", "Invalid value: false: must be either unset or set to true")
                )
        if not chosen:
            causes.append((base, f"Required value: {_DEVICE_NODE_CHOICE}"))
        elif len(chosen) > 1:
            causes.append((base, f'Invalid value: "{{{", ".join(chosen)}}}": {_DEVICE_NODE_CHOICE}'))
    elif any(device.get(name) is not None for name in ("nodeName", "nodeSelector", "allNodes")):
        causes.append(
            (
                base,
                "Invalid value: null: `nodeName`, `nodeSelector` and `allNodes` can only be set if "
                "`perDeviceNodeSelection` is set to true in the ResourceSlice spec",
            )
        )


def _check_counters(entry: Any, name_key: str, base: str, causes: Causes) -> None:
    entry = _map(entry)
    if not entry.get(name_key):
        causes.append((f"{base}.{name_key}", "Required value"))
    else:
        _each(f"{base}.{name_key}", dns_label_problems(entry[name_key]), causes)
    counters = entry.get("counters")
    if not counters:
        causes.append((f"{base}.counters", "Required value"))
    elif not _too_many(counters, MAX_COUNTERS_PER_SET, f"{base}.counters", causes):
        for key in counters:
            _each(f"{base}.counters[{key}]", dns_label_problems(key), causes)


def _check_pool(pool: Obj, causes: Causes) -> None:
    name = pool.get("name")
    if not name:
        causes.append(("spec.pool.name", "Required value"))
    else:
        name = str(name)
        if len(name) > 253:
            causes.append(("spec.pool.name", "Too long: may not be more than 253 bytes"))
        for part in name.split("/"):
            _each("spec.pool.name", dns_subdomain_problems(part), causes)
    count = pool.get("resourceSliceCount") or 0
    if isinstance(count, int) and count <= 0:
        causes.append(("spec.pool.resourceSliceCount", f"Invalid value: {count}: must be greater than zero"))
    generation = pool.get("generation") or 0
    if isinstance(generation, int) and generation < 0:
        causes.append(
            ("spec.pool.generation", f"Invalid value: {generation}: must be greater than or equal to zero")
        )


def _check_slice(spec: Obj, old_spec: Obj | None, causes: Causes) -> None:
    _each("spec.driver", driver_name(spec.get("driver")), causes)
    pool = _map(spec.get("pool"))
    _check_pool(pool, causes)
    if old_spec is not None:
        for field, before, after in (
            ("spec.pool.name", (old_spec.get("pool") or {}).get("name"), pool.get("name")),
            ("spec.driver", old_spec.get("driver"), spec.get("driver")),
            ("spec.nodeName", old_spec.get("nodeName"), spec.get("nodeName")),
        ):
            if before != after:
                causes.append((field, f"Invalid value: {go_value(after)}: field is immutable"))
    chosen = []
    if spec.get("nodeName") is not None:
        if spec["nodeName"]:
            chosen.append("`nodeName`")
            _each("spec.nodeName", dns_subdomain_problems(spec["nodeName"]), causes)
        else:
            causes.append(
                ("spec.nodeName", 'Invalid value: "": must be either unset or set to a non-empty string')
            )
    if spec.get("nodeSelector") is not None:
        chosen.append("`nodeSelector`")
        terms = (spec["nodeSelector"] or {}).get("nodeSelectorTerms") or []
        if len(terms) != 1:
            causes.append(
                (
                    "spec.nodeSelector.nodeSelectorTerms",
                    f"Invalid value: {go_json(terms) if terms else 'null'}: "
                    "must have exactly one node selector term",
                )
            )
    for flag in ("allNodes", "perDeviceNodeSelection"):
        if spec.get(flag) is not None:
            if spec[flag]:
                chosen.append(f"`{flag}`")
            else:
                causes.append((f"spec.{flag}", "Invalid value: false: must be either unset or set to true"))
    if not chosen:
        causes.append(("spec", f"Required value: {_NODE_CHOICE}"))
    elif len(chosen) > 1:
        causes.append(
            ("spec", f'Invalid value: "{{{", ".join(chosen)}}}": {_NODE_CHOICE}, but multiple fields are set')
        )
    devices = spec.get("devices")
    counters = spec.get("sharedCounters")
    if devices is not None and counters is not None:
        causes.append(("spec", 'Invalid value: "": only one of `sharedCounters` or `devices` is allowed'))
    devices = devices if isinstance(devices, list) else []
    advanced = any(isinstance(d, dict) and (d.get("taints") or d.get("consumesCounters")) for d in devices)
    limit = MAX_DEVICES_WITH_ADVANCED_FEATURES if advanced else MAX_DEVICES_PER_SLICE
    if not _too_many(devices, limit, "spec.devices", causes):
        for index, device in enumerate(devices):
            _check_device(
                _map(device),
                f"spec.devices[{index}]",
                spec.get("perDeviceNodeSelection") is True,
                causes,
            )
        _duplicates(
            devices, lambda d: d.get("name"), "spec.devices", lambda d: go_value(d.get("name")), causes
        )
    counters = counters if isinstance(counters, list) else []
    if not _too_many(counters, MAX_SHARED_COUNTER_SETS, "spec.sharedCounters", causes):
        for index, counter_set in enumerate(counters):
            _check_counters(counter_set, "name", f"spec.sharedCounters[{index}]", causes)
        _duplicates(
            counters,
            lambda c: c.get("name"),
            "spec.sharedCounters",
            lambda c: go_value(c.get("name")),
            causes,
        )


# --- DeviceClass, ResourceClaim -----------------------------------------------------------------


_CEL_TYPES = {str: "string", int: "int", float: "double", bytes: "bytes"}


def _check_selector_types(selectors: Any, base: str, causes: Causes) -> None:
    """A selector that compiles must yield a bool (or the dynamic type): what can be told without
    cel-go's type checker is an expression that touches no attribute nor capacity (whose values are
    dynamic) and yields a string, number or bytes on any device."""
    for index, selector in enumerate(selectors or []):
        expression = (
            ((selector or {}).get("cel") or {}).get("expression") if isinstance(selector, dict) else None
        )
        if not isinstance(expression, str) or re.search(r"\b(attributes|capacity)\b", expression):
            continue
        try:
            compiled = compile_selector(expression)
        except SelectorError:
            continue  # reported with the other compilation errors
        if set(compiled.program.references()["variables"]) - {"device"}:
            continue
        device = {"driver": "", "attributes": {}, "capacity": {}, "allowMultipleAllocations": False}
        try:
            value = compiled.program.execute(cel.Context(variables={"device": device}))
        except Exception:  # a runtime error says nothing of the type
            continue
        kind = _CEL_TYPES.get(type(value))
        if kind is not None:
            causes.append(
                (
                    f"{base}[{index}].cel.expression",
                    f"Invalid value: {go_quote(expression)}: must evaluate to bool "
                    f"or the unknown type, not {kind}",
                )
            )


def _go_request(request: Any) -> str:
    """A request as ``encoding/json`` writes the v1 struct (field order of the Go type, omitempty)."""
    order = {
        "": ("name", "exactly", "firstAvailable"),
        "exactly": (
            "deviceClassName",
            "selectors",
            "allocationMode",
            "count",
            "adminAccess",
            "tolerations",
            "capacity",
        ),
        "firstAvailable": (
            "name",
            "deviceClassName",
            "selectors",
            "allocationMode",
            "count",
            "tolerations",
            "capacity",
        ),
        "tolerations": ("key", "operator", "value", "effect", "tolerationSeconds"),
    }

    def ordered(value: Any, kind: str) -> Any:
        if isinstance(value, list):
            return [ordered(item, kind) for item in value]
        if not isinstance(value, dict) or kind not in order:
            return value
        keys = [key for key in order[kind] if key in value] + sorted(k for k in value if k not in order[kind])
        return {key: ordered(value[key], key) for key in keys if value[key] not in (None, "", [], {})}

    return go_json(ordered(request, ""))


def _check_toleration(toleration: Obj, base: str, causes: Causes) -> None:
    if toleration.get("key"):
        _each(f"{base}.key", label_name(str(toleration["key"])), causes)
    operator = toleration.get("operator")
    if operator == "Exists":
        if toleration.get("value"):
            causes.append(
                (
                    f"{base}.value",
                    f"Invalid value: {go_quote(str(toleration['value']))}: must be empty for "
                    "operator `Exists`",
                )
            )
    elif operator == "Equal":
        _label_value(str(toleration.get("value") or ""), f"{base}.value", causes)
    elif not operator:
        causes.append((f"{base}.operator", "Required value"))
    else:
        causes.append((f"{base}.operator", unsupported(operator, _TOLERATION_OPERATORS)))
    effect = toleration.get("effect")
    if effect and effect not in _TAINT_EFFECTS:
        causes.append((f"{base}.effect", unsupported(effect, _TAINT_EFFECTS)))


def _check_exact(request: Obj, base: str, causes: Causes) -> None:
    """``validateExactDeviceRequest`` / ``validateDeviceSubRequest`` less the class name and the CEL
    compilation (``core_rules``)."""
    _check_selector_types(request.get("selectors"), f"{base}.selectors", causes)
    mode, count = request.get("allocationMode") or "", request.get("count") or 0
    if mode == "All":
        if count != 0:
            causes.append(
                (
                    f"{base}.count",
                    f"Invalid value: {go_value(count)}: must not be specified when allocationMode is 'All'",
                )
            )
    elif mode == "ExactCount":
        if isinstance(count, int) and count <= 0:
            causes.append((f"{base}.count", f"Invalid value: {go_value(count)}: must be greater than zero"))
    else:
        causes.append((f"{base}.allocationMode", unsupported(mode, _ALLOCATION_MODES)))
    tolerations = request.get("tolerations") or []
    if not _too_many(tolerations, MAX_TOLERATIONS, f"{base}.tolerations", causes):
        for index, toleration in enumerate(tolerations):
            _check_toleration(_map(toleration), f"{base}.tolerations[{index}]", causes)


def _request_names(requests: list[Any]) -> dict[str, set[str] | None]:
    names: dict[str, set[str] | None] = {}
    for request in requests:
        if not isinstance(request, dict):
            continue
        subs = request.get("firstAvailable") or []
        names[str(request.get("name"))] = {
            str(sub.get("name")) for sub in subs if isinstance(sub, dict)
        } or None
    return names


def _check_claim_spec(spec: Obj, base: str, causes: Causes) -> None:
    devices = _map(spec.get("devices"))
    requests = devices.get("requests") or []
    names = _request_names(requests)
    field = f"{base}.devices.requests"
    if not _too_many(requests, MAX_REQUESTS, field, causes):
        for index, request in enumerate(requests):
            request = _map(request)
            request_field = f"{field}[{index}]"
            _each(f"{request_field}.name", dns_label_problems(request.get("name")), causes)
            exactly, first = request.get("exactly"), request.get("firstAvailable") or []
            if exactly is None and not first:
                causes.append(
                    (
                        request_field,
                        "Required value: exactly one of `exactly` or `firstAvailable` is required",
                    )
                )
            elif exactly is not None and first:
                causes.append(
                    (
                        request_field,
                        "Invalid value: null: exactly one of `exactly` or `firstAvailable` is required, "
                        "but multiple fields are set",
                    )
                )
            elif first:
                if not _too_many(first, MAX_SUBREQUESTS, f"{request_field}.firstAvailable", causes):
                    for sub_index, sub in enumerate(first):
                        sub = _map(sub)
                        sub_field = f"{request_field}.firstAvailable[{sub_index}]"
                        _each(f"{sub_field}.name", dns_label_problems(sub.get("name")), causes)
                        _check_exact(sub, sub_field, causes)
                    _duplicates(
                        first, lambda s: s.get("name"), f"{request_field}.firstAvailable", _go_request, causes
                    )
            else:
                _check_exact(_map(exactly), f"{request_field}.exactly", causes)
        _duplicates(requests, lambda r: r.get("name"), field, _go_request, causes)
    constraints = devices.get("constraints") or []
    if not _too_many(constraints, MAX_CONSTRAINTS, f"{base}.devices.constraints", causes):
        for index, constraint in enumerate(constraints):
            constraint = _map(constraint)
            constraint_field = f"{base}.devices.constraints[{index}]"
            _request_refs(constraint.get("requests") or [], f"{constraint_field}.requests", names, causes)
            attribute = next((k for k in _CONSTRAINT_ATTRIBUTES if constraint.get(k) is not None), None)
            if attribute is not None:
                _fully_qualified_name(str(constraint[attribute]), f"{constraint_field}.{attribute}", causes)
            else:
                causes.append(
                    (
                        constraint_field,
                        'Required value: exactly one of "matchAttribute" or "distinctAttribute" is '
                        "required, but multiple fields are set",
                    )
                )
    configs = devices.get("config") or []
    if not _too_many(configs, MAX_CONFIGS, f"{base}.devices.config", causes):
        for index, config in enumerate(configs):
            config = _map(config)
            config_field = f"{base}.devices.config[{index}]"
            _request_refs(config.get("requests") or [], f"{config_field}.requests", names, causes)
            _device_configuration(config, config_field, causes)


def _shared_device_id(entry: Obj) -> str:
    """``structured.SharedDeviceID`` as ``field.Invalid`` prints it (JSON of the Go struct)."""
    return go_json(
        {
            "Driver": str(entry.get("driver") or ""),
            "Pool": str(entry.get("pool") or ""),
            "Device": str(entry.get("device") or ""),
            "ShareID": str(entry.get("shareID") or ""),
        }
    )


def _check_allocation(allocation: Obj, names: dict[str, set[str] | None], causes: Causes) -> None:
    devices = _map(allocation.get("devices"))
    results = devices.get("results") or []
    base = "status.allocation.devices.results"
    if not _too_many(results, MAX_RESULTS, base, causes):
        for index, result in enumerate(results):
            result = _map(result)
            field = f"{base}[{index}]"
            _request_ref(result.get("request", ""), f"{field}.request", names, causes)
            _each(f"{field}.driver", driver_name(result.get("driver")), causes)
            pool = result.get("pool")
            if not pool:
                causes.append((f"{field}.pool", "Required value"))
            else:
                for part in str(pool).split("/"):
                    _each(f"{field}.pool", dns_subdomain_problems(part), causes)
            _each(f"{field}.device", dns_label_problems(result.get("device")), causes)
            if result.get("shareID") is not None:
                _uid(result["shareID"], f"{field}.shareID", causes)
    configs = devices.get("config") or []
    base = "status.allocation.devices.config"
    if not _too_many(configs, 2 * MAX_CONFIGS, base, causes):
        for index, config in enumerate(configs):
            config = _map(config)
            field = f"{base}[{index}]"
            source = config.get("source")
            if not source:
                causes.append((f"{field}.source", "Required value"))
            elif source not in ("FromClaim", "FromClass"):
                causes.append((f"{field}.source", unsupported(source, ("FromClaim", "FromClass"))))
            for ref_index, ref in enumerate(config.get("requests") or []):
                _request_ref(ref, f"{field}.requests[{ref_index}]", names, causes)
            _device_configuration(config, field, causes)


def _check_claim_status(spec: Obj, status: Obj, old_status: Obj, deleting: bool, causes: Causes) -> None:
    """``validateResourceClaimStatusUpdate``, in its order."""
    allocation, old_allocation = status.get("allocation"), old_status.get("allocation")
    if allocation is not None and "allocationTimestamp" in allocation:  # compared as times, as stored
        allocation["allocationTimestamp"] = canonical_time(allocation["allocationTimestamp"])
    reserved = status.get("reservedFor") or []
    if not _too_many(reserved, MAX_RESERVED_FOR, "status.reservedFor", causes):
        for index, entry in enumerate(reserved):
            for key in ("resource", "name", "uid"):
                if not (entry or {}).get(key):
                    causes.append((f"status.reservedFor[{index}].{key}", "Required value"))
        _duplicates(
            reserved,
            lambda e: (e or {}).get("uid"),
            "status.reservedFor",
            lambda e: go_value((e or {}).get("uid")),
            causes,
        )
    allocated = set()
    for result in ((allocation or {}).get("devices") or {}).get("results") or []:
        if isinstance(result, dict):
            allocated.add(_shared_device_id(result))
    device_statuses = status.get("devices") or []
    for index, entry in enumerate(device_statuses):
        entry = _map(entry)
        field = f"status.devices[{index}]"
        _each(f"{field}.driver", driver_name(entry.get("driver")), causes)
        if not entry.get("pool"):
            causes.append((f"{field}.pool", "Required value"))
        _each(f"{field}.device", dns_label_problems(entry.get("device")), causes)
        if entry.get("shareID") is not None:
            _uid(entry["shareID"], f"{field}.shareID", causes)
        key = _shared_device_id(entry)
        if key not in allocated:
            causes.append((field, f"Invalid value: {key}: must be an allocated device in the claim"))
    _duplicates(device_statuses, _shared_device_id, "status.devices", _shared_device_id, causes)
    if reserved:
        if allocation is None:
            causes.append(
                ("status.reservedFor", "Forbidden: may not be specified when `allocated` is not set")
            )
        elif deleting:
            old_uids = {(entry or {}).get("uid") for entry in old_status.get("reservedFor") or []}
            if {(entry or {}).get("uid") for entry in reserved} - old_uids:
                causes.append(
                    (
                        "status.reservedFor",
                        "Forbidden: new entries may not be added while `deallocationRequested` "
                        "or `deletionTimestamp` are set",
                    )
                )
    if old_allocation is not None and allocation is not None:
        if allocation != old_allocation:
            causes.append(("status.allocation", "Invalid value: null: field cannot be modified once set"))
    elif allocation is not None:
        _check_allocation(
            allocation, _request_names((spec.get("devices") or {}).get("requests") or []), causes
        )


def _check_class(spec: Obj, causes: Causes) -> None:
    selectors = spec.get("selectors") or []
    if not _too_many(selectors, MAX_SELECTORS, "spec.selectors", causes):
        _check_selector_types(selectors, "spec.selectors", causes)
    configs = spec.get("config") or []
    if not _too_many(configs, MAX_CONFIGS, "spec.config", causes):
        for index, config in enumerate(configs):
            _device_configuration(_map(config), f"spec.config[{index}]", causes)


_MICRO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|[+-]\d\d:\d\d)$")
_MICRO_LAYOUT = "2006-01-02T15:04:05.000000Z07:00"


def check_micro_times(rtype: ResourceType, obj: Obj) -> None:
    """Raise 400 for a Lease time that is no metav1.MicroTime: Go parses it with exactly six
    fractional digits, so a whole second written by Python's isoformat() is refused."""
    if (rtype.group, rtype.plural) != ("coordination.k8s.io", "leases"):
        return
    spec = _map(obj.get("spec"))
    for name in ("acquireTime", "renewTime"):
        value = spec.get(name)
        if not isinstance(value, str) or _MICRO_TIME.match(value):
            continue
        rest = value[19:] if len(value) > 19 else value
        raise StatusError(
            code=400,
            reason="BadRequest",
            message=f'{rtype.kind} in version "{rtype.version}" cannot be handled as a {rtype.kind}: parsing '
            f'time {go_quote(value)} as "{_MICRO_LAYOUT}": cannot parse {go_quote(rest)} as ".000000"',
        )


def check_rules(rtype: ResourceType, obj: Obj, old: Obj | None) -> Causes:
    """(field, problem) for every broken rule; empty when the object is acceptable. A quantity that
    does not parse raises 400 (:func:`check_decodable`) before any rule, as does a Lease time that
    is no MicroTime (:func:`check_micro_times`)."""
    if rtype.group == "resource.k8s.io":
        check_decodable(rtype, obj)
    check_micro_times(rtype, obj)
    causes: Causes = []
    check_metadata(rtype, obj, causes)
    spec = obj.get("spec") or {}
    if rtype.plural == "resourceslices":
        _check_slice(spec, (old or {}).get("spec") if old else None, causes)
    elif rtype.plural == "deviceclasses":
        _check_class(spec, causes)
    elif rtype.plural == "resourceclaims":
        if not isinstance(obj.get("status"), dict):  # a struct Go never omits: served as {} when empty
            obj["status"] = {}
        if old is not None and spec != old.get("spec"):
            causes.append(("spec", "Invalid value: null: field is immutable"))
        elif old is None:
            _check_claim_spec(spec, "spec", causes)
        if old is not None:
            deleting = bool((old.get("metadata") or {}).get("deletionTimestamp"))
            _check_claim_status(spec, obj.get("status") or {}, old.get("status") or {}, deleting, causes)
    elif rtype.plural == "resourceclaimtemplates":
        if old is not None and spec != old.get("spec"):
            causes.append(("spec", "Invalid value: null: field is immutable"))
        elif old is None:
            _check_claim_spec(spec.get("spec") or {}, "spec.spec", causes)
    return causes

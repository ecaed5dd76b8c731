"""What Kueue (v0.19) charges a ResourceClaimTemplate against a ClusterQueue's quota. Pure.

Kueue's DRA integration (kubernetes-sigs/kueue ``pkg/dra/claims.go``, ``pkg/dra/capacity.go``;
docs/kueue.md section 1) maps a claim's DeviceClass to a quota resource through
the Configuration's ``resources.deviceClassMappings``:

- a mapping without ``sources``: the request's ``count`` (default 1);
- a mapping with a ``capacity`` source: per device that matches (driver, the source's CEL selector,
  the class's and the request's selectors) and publishes that capacity, the request's
  ``capacity.requests[name]``, else the device's ``requestPolicy.default``, else its full value,
  rounded by the device's policy (``validValues``: the smallest value at or above; ``validRange``:
  at least ``min``, up to ``min + n*step``, more than ``max`` is an error); the charge is the
  maximum over those devices, times ``count``.

Kueue refuses (marks inadmissible) a pod naming a claim directly, ``firstAvailable`` and
``allocationMode: All``; :func:`kueue_refusals` names those so ``fractional plan`` can warn.
This is our own code following that rule, checked against Kueue's e2e numbers in the tests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Any

from driver.allocator.celenv import SelectorError, compile_selector, evaluate_selector
from driver.allocator.model import Device, parse_slice
from driver.controller.model.objects import quantity

__all__ = [
    "CapacitySource",
    "DeviceClassMapping",
    "KueueQuotaError",
    "compute_claim_charges",
    "default_mappings",
    "kueue_refusals",
    "parse_mappings",
    "round_by_policy",
]

DRIVER = "fractional.dev"
GPU_MEMORY_RESOURCE = "fractional.dev/gpu-memory"
NIC_RESOURCE = "fractional.dev/nic"


class KueueQuotaError(Exception):
    """A claim Kueue would not count (its message names the claim, the request and why)."""


@dataclass(frozen=True, slots=True)
class CapacitySource:
    name: str  # the capacity key, literally as in the slices and in capacity.requests
    driver: str
    expression: str  # the deviceSelector's CEL; "" selects every device of the driver


@dataclass(frozen=True, slots=True)
class DeviceClassMapping:
    """One ``resources.deviceClassMappings[]`` entry of Kueue's Configuration."""

    name: str  # the quota resource
    device_class_names: tuple[str, ...]
    capacity_sources: tuple[CapacitySource, ...] = ()


def default_mappings() -> tuple[DeviceClassMapping, ...]:
    """The mappings of ``examples/kueue/kueue-configuration.yaml``: GPU memory by capacity, NICs by count."""
    gpu_selector = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "gpu"'
    return (
        DeviceClassMapping(
            GPU_MEMORY_RESOURCE,
            ("gpu.fractional.dev",),
            (CapacitySource("memory", DRIVER, gpu_selector),),
        ),
        DeviceClassMapping(NIC_RESOURCE, ("nic.fractional.dev",)),
    )


def parse_mappings(configuration: Mapping[str, Any]) -> tuple[DeviceClassMapping, ...]:
    """The mappings of a Kueue ``Configuration`` document (``config.kueue.x-k8s.io/v1beta2``)."""
    raw = ((configuration.get("resources") or {}).get("deviceClassMappings")) or ()
    mappings = []
    for entry in raw:
        sources = []
        for source in entry.get("sources") or ():
            capacity = source.get("capacity")
            if capacity is None:
                continue  # counter sources: not published by this driver
            expression = (((capacity.get("deviceSelector") or {}).get("cel")) or {}).get("expression", "")
            sources.append(CapacitySource(str(capacity["name"]), str(capacity["driver"]), str(expression)))
        mappings.append(
            DeviceClassMapping(str(entry["name"]), tuple(entry.get("deviceClassNames") or ()), tuple(sources))
        )
    return tuple(mappings)


def round_by_policy(base: Decimal, capacity: Mapping[str, Any]) -> Decimal:
    """Kueue's rounding of one device's capacity policy; raises ValueError above ``validRange.max``."""
    policy = capacity.get("requestPolicy") or {}
    if values := policy.get("validValues"):
        for value in sorted(quantity(v) for v in values):
            if value >= base:
                return value
        raise ValueError(f"{base} is above every valid value")
    valid_range = policy.get("validRange")
    if not valid_range:
        return base
    low = quantity(valid_range.get("min", 0))
    value = max(base, low)
    if step_raw := valid_range.get("step"):
        step = quantity(step_raw)
        if step > 0:
            steps = ((value - low) / step).to_integral_value(rounding=ROUND_CEILING)  # Decimal // truncates
            value = low + steps * step
    if "max" in valid_range and value > quantity(valid_range["max"]):
        raise ValueError(f"{base} is above the valid range's max {valid_range['max']}")
    return value


def _selectors(obj: Mapping[str, Any]) -> list[str]:
    return [
        str((s.get("cel") or {}).get("expression", "")) for s in obj.get("selectors") or () if s.get("cel")
    ]


def _matches(device: Device, expressions: Sequence[str]) -> bool:
    for expression in expressions:
        if not expression:
            continue
        try:
            if not evaluate_selector(compile_selector(expression), device.facts):
                return False
        except SelectorError:
            return False  # Kueue counts only devices the selector accepts
    return True


def _devices(slices: Iterable[Mapping[str, Any]], driver: str) -> list[tuple[Device, Mapping[str, Any]]]:
    found: list[tuple[Device, Mapping[str, Any]]] = []
    for raw in slices:
        spec = raw.get("spec") or {}
        if spec.get("driver") != driver:
            continue
        parsed = parse_slice(raw)
        by_name = {str(d.get("name")): d for d in spec.get("devices") or ()}
        found.extend((device, by_name[device.name]) for device in parsed.devices if device.name in by_name)
    return found


def kueue_refusals(pod_or_claim_spec: Mapping[str, Any], *, name: str) -> list[str]:
    """Why Kueue v0.19 would make a workload using this pod spec or claim spec inadmissible."""
    problems = []
    for entry in pod_or_claim_spec.get("resourceClaims") or ():  # a pod spec
        if entry.get("resourceClaimName"):
            problems.append(
                f"{name}: resourceClaims[{entry.get('name')}] names ResourceClaim "
                f"{entry['resourceClaimName']} directly; Kueue counts only resourceClaimTemplateName"
            )
    for request in ((pod_or_claim_spec.get("devices") or {}).get("requests")) or ():  # a claim spec
        if request.get("firstAvailable"):
            problems.append(f"{name}: request {request.get('name')} uses firstAvailable, which Kueue refuses")
        elif (request.get("exactly") or {}).get("allocationMode") == "All":
            problems.append(
                f"{name}: request {request.get('name')} uses allocationMode All, which Kueue refuses"
            )
    return problems


def compute_claim_charges(
    claim_spec: Mapping[str, Any],
    *,
    slices: Iterable[Mapping[str, Any]],
    classes: Iterable[Mapping[str, Any]],
    mappings: Sequence[DeviceClassMapping] | None = None,
    name: str = "claim",
) -> dict[str, Decimal]:
    """Quota resource -> amount Kueue charges for one claim (template spec); raises KueueQuotaError."""
    mappings = default_mappings() if mappings is None else mappings
    class_by_name = {str(c["metadata"]["name"]): c for c in classes}
    slices = list(slices)
    charges: dict[str, Decimal] = {}
    for problem in kueue_refusals(claim_spec, name=name):
        raise KueueQuotaError(problem)
    for request in ((claim_spec.get("devices") or {}).get("requests")) or ():
        exactly = request.get("exactly") or {}
        if exactly.get("adminAccess"):
            continue  # Kueue skips admin-access requests
        class_name = str(exactly.get("deviceClassName", ""))
        where = f"{name}: request {request.get('name')}"
        mapping = next((m for m in mappings if class_name in m.device_class_names), None)
        if mapping is None:
            raise KueueQuotaError(f"{where}: DeviceClass {class_name} is not mapped in DRA configuration")
        count = int(exactly.get("count", 1))
        if not mapping.capacity_sources:
            charges[mapping.name] = charges.get(mapping.name, Decimal(0)) + count
            continue
        device_class = class_by_name.get(class_name)
        if device_class is None:
            raise KueueQuotaError(f"{where}: DeviceClass {class_name} not found")
        requested = ((exactly.get("capacity") or {}).get("requests")) or {}
        class_selectors = _selectors(device_class.get("spec") or {})
        for source in mapping.capacity_sources:
            selectors = [source.expression, *class_selectors, *_selectors(exactly)]
            matched = [
                (device, raw)
                for device, raw in _devices(slices, source.driver)
                if _matches(device, selectors)
            ]
            if len(matched) < count:
                raise KueueQuotaError(f"{where}: insufficient matching devices ({len(matched)} < {count})")
            best: Decimal | None = None
            for _device, raw in matched:
                capacity = (raw.get("capacity") or {}).get(source.name)
                if capacity is None:
                    continue
                if source.name in requested:
                    base = quantity(requested[source.name])
                elif (default := (capacity.get("requestPolicy") or {}).get("default")) is not None:
                    base = quantity(default)
                else:
                    base = quantity(capacity["value"])
                try:
                    value = round_by_policy(base, capacity)
                except ValueError as error:
                    raise KueueQuotaError(f"{where}: capacity {source.name}: {error}") from None
                best = value if best is None else max(best, value)
            if best is not None:
                charges[mapping.name] = charges.get(mapping.name, Decimal(0)) + best * count
    return charges

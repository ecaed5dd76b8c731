"""Parsed, compact forms of ResourceSlices, DeviceClasses and ResourceClaims (camelCase API dicts in).

Slices are parsed once when they enter the state; claims are parsed per allocation (their classes may
change). Parse problems in a *slice* make its pool invalid (the API server validated it, so this only
happens for objects the allocator does not understand); problems in a *claim* raise AllocationError.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from driver.allocator.backends import Backends, request_backends
from driver.allocator.celenv import CompiledSelector, DeviceFacts, SelectorError, compile_selector, semver_map
from driver.allocator.quantity import Number, parse_quantity
from driver.errors import AllocationError

__all__ = [
    "CapacitySpec",
    "Claim",
    "Constraint",
    "Device",
    "DeviceID",
    "Request",
    "RequestSlot",
    "Slice",
    "Taint",
    "Toleration",
    "attribute_set",
    "claim_key",
    "lookup_attribute",
    "parse_claim",
    "parse_slice",
]

DeviceID = tuple[str, str, str]  # (driver, pool, device)
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
NUMA_NODE = "resource.kubernetes.io/numaNode"
MAX_RESULTS = 32


@dataclass(frozen=True, slots=True)
class CapacitySpec:
    value: Number
    default: Number | None = None
    valid_values: tuple[Number, ...] | None = None
    range_min: Number | None = None
    range_max: Number | None = None
    range_step: Number | None = None
    has_policy: bool = False


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str
    effect: str


@dataclass(frozen=True, slots=True)
class Toleration:
    key: str
    operator: str
    value: str
    effect: str

    def tolerates(self, taint: Taint) -> bool:
        if self.effect and self.effect != taint.effect:
            return False
        if self.key and self.key != taint.key:
            return False
        if self.operator in ("", "Equal"):
            return self.value == taint.value
        return self.operator == "Exists"


@dataclass(eq=False, slots=True)
class Device:
    """One device of a slice; identity is ``id`` (driver, pool, name)."""

    id: DeviceID
    name: str
    slice_name: str
    attributes: dict[str, tuple[str, Any]]  # key as published -> (type, value)
    capacity: dict[str, CapacitySpec]  # key as published (no domain normalization)
    allow_multiple: bool
    taints: tuple[Taint, ...]
    consumes: tuple[tuple[str, tuple[tuple[str, Number], ...]], ...]
    binding_conditions: tuple[str, ...]
    binding_failure_conditions: tuple[str, ...]
    binds_to_node: bool
    node_name: str | None
    node_selector: dict[str, Any] | None
    all_nodes: bool
    facts: DeviceFacts
    pcie_root: Any = None
    numa_node: Any = None
    memory_key: str | None = None  # the capacity whose id is "memory", used by best-fit scoring
    capacity_id: int = 0  # equal for devices with equal capacities and policies (a cache key)


@dataclass(eq=False, slots=True)
class Slice:
    name: str
    driver: str
    pool: str
    generation: int
    count: int
    node_name: str | None
    node_selector: dict[str, Any] | None
    all_nodes: bool
    per_device: bool
    devices: tuple[Device, ...]
    counters: dict[str, dict[str, Number]]  # counter set -> counter -> value
    counter_set_names: tuple[str, ...]
    invalid: str | None = None

    @property
    def pool_key(self) -> tuple[str, str]:
        return (self.driver, self.pool)


UNKNOWN = "unknown"  # an attribute of a type this allocator does not know (a newer API, or none set)
LIST_KINDS = {"ints": "int", "bools": "bool", "strings": "string", "versions": "version"}


_TYPED_VALUES: dict[tuple[str, Any], tuple[str, Any]] = {}
_SHARED_MAX = 50_000


def _shared(typed: tuple[str, Any]) -> tuple[str, Any]:
    """One tuple for each attribute value that devices publish alike (a bounded memo: it starts
    afresh when full). A model of 8 GPUs held 20 such tuples a device."""
    try:
        held = _TYPED_VALUES.get(typed)
    except TypeError:  # not hashable (a malformed value): kept as it is
        return typed
    if held is None:
        if len(_TYPED_VALUES) >= _SHARED_MAX:
            _TYPED_VALUES.clear()
        held = _TYPED_VALUES[typed] = typed
    return held


def _attribute_value(raw: Mapping[str, Any]) -> tuple[str, Any]:
    """(kind, value): lists first, as upstream reads them; ``UNKNOWN`` when no known field is set.

    An unknown attribute does not invalidate its pool (upstream drops unknown fields when decoding
    and fails only where the value is read: a CEL selector on that device, or a constraint)."""
    for kind in ("ints", "bools", "strings", "versions"):
        if raw.get(kind) is not None:
            return _shared((kind, tuple(raw[kind])))
    for kind in ("int", "bool", "string", "version"):
        if raw.get(kind) is not None:
            return _shared((kind, raw[kind]))
    return UNKNOWN, None


def attribute_set(typed: tuple[str, Any]) -> tuple[str, frozenset[Any]] | None:
    """An attribute as (element kind, set of values) for list-aware constraints (DRAListTypeAttributes):
    a scalar is a set of one; an empty list or an unknown type is None (upstream ``attributeAsSet``)."""
    kind, value = typed
    if kind in LIST_KINDS:
        return (LIST_KINDS[kind], frozenset(value)) if value else None
    if kind == UNKNOWN:
        return None
    return kind, frozenset((value,))


def _cel_value(kind: str, value: Any) -> Any:
    if kind == "version":
        return semver_map(value)
    if kind == "versions":
        return [semver_map(v) for v in value]
    if isinstance(value, tuple):
        return list(value)
    return value


@functools.lru_cache(maxsize=4096)
def _split(name: str, driver: str) -> tuple[str, str]:
    if "/" in name:
        domain, _, ident = name.partition("/")
        return domain, ident
    return driver, name


_CAPACITY_CACHE: dict[str, CapacitySpec] = {}
_CAPACITY_IDS: dict[tuple[tuple[str, CapacitySpec], ...], int] = {}


def _capacity(raw: Mapping[str, Any]) -> CapacitySpec:
    """Parsed capacity, memoized by content (every GPU of a model publishes the same capacities)."""
    key = repr(raw)
    cached = _CAPACITY_CACHE.get(key)
    if cached is None:
        cached = _parse_capacity(raw)
        if len(_CAPACITY_CACHE) > 10_000:
            _CAPACITY_CACHE.clear()
        _CAPACITY_CACHE[key] = cached
    return cached


def _parse_capacity(raw: Mapping[str, Any]) -> CapacitySpec:
    value = parse_quantity(raw["value"])
    policy = raw.get("requestPolicy")
    if not policy:
        return CapacitySpec(value=value)
    default = parse_quantity(policy["default"]) if policy.get("default") is not None else None
    values = policy.get("validValues")
    valid_range = policy.get("validRange")
    if values:
        return CapacitySpec(value, default, tuple(parse_quantity(v) for v in values), has_policy=True)
    if valid_range:
        return CapacitySpec(
            value,
            default,
            range_min=parse_quantity(valid_range["min"]) if valid_range.get("min") is not None else None,
            range_max=parse_quantity(valid_range["max"]) if valid_range.get("max") is not None else None,
            range_step=parse_quantity(valid_range["step"]) if valid_range.get("step") is not None else None,
            has_policy=True,
        )
    return CapacitySpec(value, default, has_policy=True)


def _device(raw: Mapping[str, Any], driver: str, pool: str, slice_name: str) -> Device:
    name = raw["name"]
    attributes: dict[str, tuple[str, Any]] = {}
    cel_attributes: dict[str, dict[str, Any]] = {}
    unsupported = None
    for key, value in (raw.get("attributes") or {}).items():
        typed = _attribute_value(value)
        attributes[key] = typed
        if typed[0] == UNKNOWN:
            unsupported = unsupported or f"attribute {key}: unsupported attribute value"
            continue
        domain, ident = _split(key, driver)
        try:
            cel_attributes.setdefault(domain, {})[ident] = _cel_value(*typed)
        except ValueError as error:  # a version the API would have refused; upstream fails in CEL
            unsupported = unsupported or f"attribute {key}: parse semantic version: {error}"
    capacity: dict[str, CapacitySpec] = {}
    cel_capacity: dict[str, dict[str, Number]] = {}
    memory_key = None
    for key, value in (raw.get("capacity") or {}).items():
        spec = _capacity(value)
        capacity[key] = spec
        domain, ident = _split(key, driver)
        cel_capacity.setdefault(domain, {})[ident] = spec.value
        if ident == "memory" and memory_key is None:
            memory_key = key
    allow_multiple = bool(raw.get("allowMultipleAllocations"))
    consumes = tuple(
        (
            entry["counterSet"],
            tuple((c, parse_quantity(v["value"])) for c, v in (entry.get("counters") or {}).items()),
        )
        for entry in raw.get("consumesCounters") or ()
    )
    taints = tuple(
        Taint(key=t.get("key", ""), value=t.get("value", "") or "", effect=t.get("effect", "") or "")
        for t in raw.get("taints") or ()
    )
    facts = DeviceFacts(
        driver=driver, allow_multiple=allow_multiple, attributes=cel_attributes, capacity=cel_capacity,
        unsupported=unsupported,
    )  # fmt: skip
    device = Device(
        id=(driver, pool, name),
        name=name,
        slice_name=slice_name,
        attributes=attributes,
        capacity=capacity,
        allow_multiple=allow_multiple,
        taints=taints,
        consumes=consumes,
        binding_conditions=tuple(raw.get("bindingConditions") or ()),
        binding_failure_conditions=tuple(raw.get("bindingFailureConditions") or ()),
        binds_to_node=bool(raw.get("bindsToNode")),
        node_name=raw.get("nodeName"),
        node_selector=raw.get("nodeSelector"),
        all_nodes=bool(raw.get("allNodes")),
        facts=facts,
        memory_key=memory_key,
    )
    capacity_key = tuple(capacity.items())
    device.capacity_id = _CAPACITY_IDS.setdefault(capacity_key, len(_CAPACITY_IDS))
    pcie = lookup_attribute(device, PCIE_ROOT)
    numa = lookup_attribute(device, NUMA_NODE)
    device.pcie_root = pcie[1] if pcie and pcie[0] != UNKNOWN else None
    device.numa_node = numa[1] if numa and numa[0] != UNKNOWN else None
    return device


def _unnamed_slice_key(metadata: Mapping[str, Any], pool_name: str, spec: Mapping[str, Any]) -> str:
    """A stable key for a slice not yet named by a server (built locally, e.g. template nodes for
    scale-up hints): without it, two such slices would replace each other."""
    devices = spec.get("devices") or []
    first = devices[0].get("name", "") if devices else ""
    return f"{metadata.get('generateName', '')}{pool_name}/{first}/{len(devices)}"


def parse_slice(raw: Mapping[str, Any]) -> Slice:
    """Parse a ResourceSlice dict; content it cannot understand marks the slice (and its pool) invalid."""
    metadata = raw.get("metadata") or {}
    spec = raw.get("spec") or {}
    pool = spec.get("pool") or {}
    driver = spec.get("driver", "")
    pool_name = pool.get("name", "")
    name = metadata.get("name") or _unnamed_slice_key(metadata, pool.get("name", ""), spec)
    invalid = None
    devices: list[Device] = []
    counters: dict[str, dict[str, Number]] = {}
    set_names: list[str] = []
    try:
        for entry in spec.get("sharedCounters") or ():
            set_names.append(entry["name"])
            counters[entry["name"]] = {
                c: parse_quantity(v["value"]) for c, v in (entry.get("counters") or {}).items()
            }
        for device in spec.get("devices") or ():
            devices.append(_device(device, driver, pool_name, name))
    except (KeyError, TypeError, ValueError) as error:
        invalid = f"ResourceSlice {name}: cannot parse: {error}"
    return Slice(
        name=name,
        driver=driver,
        pool=pool_name,
        generation=int(pool.get("generation") or 0),
        count=int(pool.get("resourceSliceCount") or 1),
        node_name=spec.get("nodeName") or None,
        node_selector=spec.get("nodeSelector"),
        all_nodes=bool(spec.get("allNodes")),
        per_device=bool(spec.get("perDeviceNodeSelection")),
        devices=tuple(devices),
        counters=counters,
        counter_set_names=tuple(set_names),
        invalid=invalid,
    )


def lookup_attribute(device: Device, name: str) -> tuple[str, Any] | None:
    """Constraint lookup: the full name, else the bare id when the domain is the device's driver."""
    found = device.attributes.get(name)
    if found is None and "/" in name:
        domain, _, ident = name.partition("/")
        if domain == device.id[0]:
            found = device.attributes.get(ident)
    return found


# ---------------------------------------------------------------- claims


@dataclass(frozen=True, slots=True)
class Request:
    name: str  # "req" or "req/sub"
    parent: str
    index: int  # position of the parent in spec.devices.requests
    class_name: str
    selectors: tuple[tuple[str, CompiledSelector], ...]  # (label for errors, selector); class ones first
    all_mode: bool
    count: int
    admin: bool
    tolerations: tuple[Toleration, ...]
    tolerations_raw: tuple[dict[str, Any], ...]
    capacity: tuple[tuple[str, Number], ...] | None
    backends: Backends = ()  # the sharing backend per driver its config picks (backends.py)


@dataclass(frozen=True, slots=True)
class RequestSlot:
    name: str
    alternatives: tuple[Request, ...]
    prioritized: bool


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: str  # "match" | "distinct"
    attribute: str
    requests: frozenset[str]


@dataclass(frozen=True, slots=True)
class Claim:
    key: str
    uid: str
    slots: tuple[RequestSlot, ...]
    constraints: tuple[Constraint, ...]
    config: tuple[dict[str, Any], ...]
    classes: dict[str, dict[str, Any]] = field(default_factory=dict)
    signature: tuple[Any, ...] = ()


def claim_key(raw: Mapping[str, Any]) -> str:
    metadata = raw.get("metadata") or {}
    return f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"


def _fail(claim: str, path: str, problem: str) -> AllocationError:
    return AllocationError(f"ResourceClaim {claim}: {path}: {problem}")


def _selectors(
    claim: str, path: str, raw: Sequence[Mapping[str, Any]] | None
) -> list[tuple[str, CompiledSelector]]:
    compiled = []
    for index, selector in enumerate(raw or ()):
        expression = (selector.get("cel") or {}).get("expression")
        if expression is None:
            raise _fail(claim, f"{path}[{index}]", "unsupported selector type")
        try:
            compiled.append((f"{path}[{index}]", compile_selector(expression)))
        except SelectorError as error:
            raise _fail(claim, f"{path}[{index}].cel.expression", str(error)) from error
    return compiled


def _request(
    claim: str, path: str, raw: Mapping[str, Any], name: str, parent: str, index: int,
    classes: Mapping[str, Mapping[str, Any]], used: dict[str, dict[str, Any]], admin_allowed: bool,
) -> Request:  # fmt: skip
    class_name = raw.get("deviceClassName") or ""
    if not class_name:
        raise _fail(claim, f"{path}.deviceClassName", "must not be empty")
    device_class = classes.get(class_name)
    if device_class is None:
        raise _fail(
            claim, f"{path}.deviceClassName", f"could not retrieve device class {class_name!r}: not found"
        )
    used.setdefault(class_name, dict(device_class))
    selectors = _selectors(
        claim, f"DeviceClass {class_name}: spec.selectors", (device_class.get("spec") or {}).get("selectors")
    )
    selectors += _selectors(claim, f"{path}.selectors", raw.get("selectors"))
    mode = raw.get("allocationMode") or "ExactCount"
    if mode not in ("ExactCount", "All"):
        raise _fail(claim, f"{path}.allocationMode", f"unsupported count mode {mode!r}")
    count = int(raw.get("count") or 1) if mode == "ExactCount" else 0
    if mode == "ExactCount" and count <= 0:
        raise _fail(claim, f"{path}.count", f"must be positive, got {count}")
    admin = bool(raw.get("adminAccess"))
    if admin and not admin_allowed:
        raise _fail(claim, f"{path}.adminAccess", "admin access is not enabled")
    tolerations_raw = tuple(dict(t) for t in raw.get("tolerations") or ())
    tolerations = tuple(
        Toleration(
            t.get("key", "") or "",
            t.get("operator", "") or "Equal",
            t.get("value", "") or "",
            t.get("effect", "") or "",
        )
        for t in tolerations_raw
    )
    capacity = None
    requests = (raw.get("capacity") or {}).get("requests")
    if requests:
        try:
            capacity = tuple(sorted((k, parse_quantity(v)) for k, v in requests.items()))
        except ValueError as error:
            raise _fail(claim, f"{path}.capacity.requests", str(error)) from error
    return Request(
        name=name,
        parent=parent,
        index=index,
        class_name=class_name,
        selectors=tuple(selectors),
        all_mode=mode == "All",
        count=count,
        admin=admin,
        tolerations=tolerations,
        tolerations_raw=tolerations_raw,
        capacity=capacity,
    )


def parse_claim(
    raw: Mapping[str, Any], classes: Mapping[str, Mapping[str, Any]], *, admin_allowed: bool = True
) -> Claim:
    """Parse a ResourceClaim dict; raises AllocationError naming claim and field for fatal problems."""
    key = claim_key(raw)
    uid = (raw.get("metadata") or {}).get("uid", "") or key
    devices = (raw.get("spec") or {}).get("devices") or {}
    used: dict[str, dict[str, Any]] = {}
    slots = []
    for index, request in enumerate(devices.get("requests") or ()):
        name = request.get("name", "")
        path = f"spec.devices.requests[{index}]"
        if request.get("exactly") is not None:
            alternative = _request(
                key, f"{path}.exactly", request["exactly"], name, name, index, classes, used, admin_allowed
            )
            slots.append(RequestSlot(name, (alternative,), prioritized=False))
        elif request.get("firstAvailable"):
            alternatives = []
            for sub_index, sub in enumerate(request["firstAvailable"]):
                sub_name = f"{name}/{sub.get('name', '')}"
                sub_path = f"{path}.firstAvailable[{sub_index}]"
                sub_raw = {k: v for k, v in sub.items() if k != "adminAccess"}
                alternatives.append(
                    _request(key, sub_path, sub_raw, sub_name, name, index, classes, used, admin_allowed)
                )
            slots.append(RequestSlot(name, tuple(alternatives), prioritized=True))
        else:
            raise _fail(key, path, "neither exactly nor firstAvailable is set")
    configs = [c for c in devices.get("config") or () if isinstance(c, Mapping)]
    slots = [
        replace(slot, alternatives=tuple(
            replace(r, backends=request_backends(r.name, (used[r.class_name].get("spec") or {}), configs))
            for r in slot.alternatives
        ))
        for slot in slots
    ]  # fmt: skip
    constraints = []
    for index, raw_constraint in enumerate(devices.get("constraints") or ()):
        names = frozenset(raw_constraint.get("requests") or ())
        if raw_constraint.get("matchAttribute"):
            constraints.append(Constraint("match", raw_constraint["matchAttribute"], names))
        elif raw_constraint.get("distinctAttribute"):
            constraints.append(Constraint("distinct", raw_constraint["distinctAttribute"], names))
        else:
            raise _fail(key, f"spec.devices.constraints[{index}]", "unsupported constraint type")
    signature = (
        tuple(
            tuple((r.class_name, tuple(s.expression for _, s in r.selectors), r.all_mode, r.count, r.admin,
                   r.tolerations, r.capacity, r.backends) for r in slot.alternatives)
            for slot in slots
        ),
        tuple(constraints),
    )  # fmt: skip
    return Claim(
        key=key,
        uid=uid,
        slots=tuple(slots),
        constraints=tuple(constraints),
        config=tuple(dict(c) for c in devices.get("config") or ()),
        classes=used,
        signature=signature,
    )

# ruff: noqa: E501 - one scenario per table row reads better than wrapped rows
"""Conformance scenarios from dra-api.md section 6 (upstream ``allocatortesting``), as table data.

Each case: slices, classes, claims, already-allocated claims, node, and the expectation:
- a list (one entry per claim) of lists of (request, pool, device) or (request, pool, device, consumed);
- FAIL: no allocation and no error;
- Error("substring"): AllocationError whose message contains the substring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from allocator_builders import (
    DRIVER,
    allocated_claim,
    allocated_result,
    claim,
    device,
    device_class,
    exact,
    first_available,
    resource_slice,
    version,
)

FAIL = "fail"


@dataclass(frozen=True)
class Error:
    text: str


@dataclass
class Case:
    name: str
    slices: list[dict[str, Any]]
    claims: list[dict[str, Any]]
    expect: Any
    classes: list[dict[str, Any]] = field(default_factory=lambda: [device_class()])
    allocated: list[dict[str, Any]] = field(default_factory=list)
    node: str = "node1"
    nodes: dict[str, dict[str, str]] | None = None
    node_selector: dict[str, Any] | None = None  # expected nodeSelector of claim 0 (None: not checked)


def _mem(value: str) -> dict[str, Any]:
    return {"memory": value}


def _ge(value: str) -> str:
    return f'device.capacity["{DRIVER}"].memory.compareTo(quantity("{value}")) >= 0'


def _multi(name: str, cap: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    return device(name, capacity=cap, multi=True, **kw)


def _cap(value: str, policy: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"value": value}
    if policy:
        out["requestPolicy"] = policy
    return out


PINNED = {
    "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node1"]}]}]
}
ZONE_A = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}
RACK_1 = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "rack", "operator": "In", "values": ["1"]}]}]}
TWO_DEVICES = [device("device-1"), device("device-2")]

CASES: list[Case] = [
    Case("simple", [resource_slice("s1", [device("device-1")])], [claim()], [[("req0", "node1", "device-1")]],
         node_selector=PINNED),
    Case("other-node", [resource_slice("s2", [device("device-2")], node="node2"),
                        resource_slice("s1", [device("device-1")])],
         [claim()], [[("req0", "node1", "device-1")]]),
    Case("small-and-large-backtrack-requests",
         [resource_slice("s1", [device("device-2g", capacity=_mem("2Gi")), device("device-1g", capacity=_mem("1Gi"))])],
         [claim("c", exact("req0", selectors=[_ge("1Gi")]), exact("req1", selectors=[_ge("2Gi")]))],
         [[("req0", "node1", "device-1g"), ("req1", "node1", "device-2g")]]),
    Case("small-and-large-backtrack-claims",
         [resource_slice("s1", [device("device-2g", capacity=_mem("2Gi")), device("device-1g", capacity=_mem("1Gi"))])],
         [claim("c0", exact("req0", selectors=[_ge("1Gi")])), claim("c1", exact("req0", selectors=[_ge("2Gi")]))],
         [[("req0", "node1", "device-1g")], [("req0", "node1", "device-2g")]]),
    Case("devices-split-across-different-slices",
         [resource_slice("s1", [device("device-1")], pool="pool-1"), resource_slice("s2", [device("device-2")], pool="pool-2")],
         [claim("c", exact(count=2))], [[("req0", "pool-1", "device-1"), ("req0", "pool-2", "device-2")]]),
    Case("no-allocation-from-incomplete-pools", [resource_slice("s1", [device("device-1")], count=2)], [claim()], FAIL),
    Case("multi-host-resource-pool-with-stale-slice-for-current-node",
         [resource_slice("s1", [device("device-1")], pool="p", count=2, generation=1),
          resource_slice("s2", [device("device-2")], pool="p", node="node2", count=2, generation=2)],
         [claim()], FAIL),
    Case("multi-host-resource-pool-complete",
         [resource_slice("s1", [device("device-1")], pool="p", count=2),
          resource_slice("s2", [device("device-2")], pool="p", node="node2", count=2)],
         [claim()], [[("req0", "p", "device-1")]]),
    Case("duplicate-slice", [resource_slice("s1", [device("device-1")], pool="p", count=2),
                             resource_slice("s2", [device("device-1")], pool="p", count=2)],
         [claim()], Error("invalid resource pools were encountered")),
    Case("invalid-pool-is-ok-if-devices-can-be-allocated-from-other",
         [resource_slice("s1", [device("device-1")], pool="p", count=2),
          resource_slice("s2", [device("device-1")], pool="p", count=2),
          resource_slice("s3", [device("device-3")], pool="q")],
         [claim()], [[("req0", "q", "device-3")]]),
    Case("unknown-class", [resource_slice("s1", [device("device-1")])], [claim("c", exact(class_name="nope"))],
         Error("could not retrieve device class")),
    Case("empty-class", [resource_slice("s1", [device("device-1")])], [claim("c", exact(class_name=""))],
         Error("deviceClassName")),
    Case("not-enough-suitable-devices", [resource_slice("s1", [device("device-1")])], [claim("c", exact(count=2))], FAIL),
    Case("all-devices-single", [resource_slice("s1", [device("device-1")])], [claim("c", exact(all_devices=True))],
         [[("req0", "node1", "device-1")]]),
    Case("all-devices-many", [resource_slice("s1", TWO_DEVICES)], [claim("c", exact(all_devices=True))],
         [[("req0", "node1", "device-1"), ("req0", "node1", "device-2")]]),
    Case("all-devices-some-allocated", [resource_slice("s1", TWO_DEVICES)], [claim("c", exact(all_devices=True))], FAIL,
         allocated=[allocated_claim("old", allocated_result("device-1"))]),
    Case("all-devices-of-the-incomplete-pool", [resource_slice("s1", [device("device-1")], count=2)],
         [claim("c", exact(all_devices=True))], Error("currently being updated")),
    Case("all-devices-no-slices", [], [claim("c", exact(all_devices=True))], FAIL),
    Case("too-many-devices-single-request", [resource_slice("s1", TWO_DEVICES)], [claim("c", exact(count=500))],
         Error("exceeds the claim limit")),
    Case("too-many-devices-total", [resource_slice("s1", TWO_DEVICES)],
         [claim("c", *[exact(f"req{i}") for i in range(33)])], Error("exceeds the claim limit")),
    Case("prioritized-list-too-many-in-first-subrequest",
         [resource_slice("s1", [device(f"device-{i}") for i in range(40)])],
         [claim("c", first_available("req0", exact("subReq-0", count=33), exact("subReq-1", count=1)))],
         [[("req0/subReq-1", "node1", "device-0")]]),
    Case("with-constraint",
         [resource_slice("s1", [device("device-1", attributes={"ver": version("1.0.0"), "s": "a"}),
                                device("device-2", attributes={"ver": version("1.0.0"), "s": "b"}),
                                device("device-3", attributes={"ver": version("1.0.0"), "s": "b"})])],
         [claim("c", exact("req0"), exact("req1"),
                constraints=[{"requests": ["req0"], "matchAttribute": f"{DRIVER}/ver"}, {"matchAttribute": f"{DRIVER}/s"}])],
         [[("req0", "node1", "device-2"), ("req1", "node1", "device-3")]]),
    Case("with-constraint-non-existent-attribute", [resource_slice("s1", TWO_DEVICES)],
         [claim("c", exact(count=2), constraints=[{"matchAttribute": f"{DRIVER}/missing"}])], FAIL),
    *[
        Case(f"with-constraint-not-matching-{kind}-attribute",
             [resource_slice("s1", [device("device-1", attributes={"x": a}), device("device-2", attributes={"x": b})])],
             [claim("c", exact(count=2), constraints=[{"matchAttribute": f"{DRIVER}/x"}])], FAIL)
        for kind, a, b in (("int", 1, 2), ("string", "a", "b"), ("bool", True, False),
                           ("version", version("1.0.0"), version("1.0.1")))
    ],
    Case("with-constraint-all-devices",
         [resource_slice("s1", [device("device-1", attributes={"x": 1}), device("device-2", attributes={"x": 2})])],
         [claim("c", exact(all_devices=True), constraints=[{"matchAttribute": f"{DRIVER}/x"}])],
         Error("claim constraint would not be satisfied")),
    Case("invalid-CEL-one-device", [resource_slice("s1", [device("device-1")])],
         [claim("c", exact(selectors=[f'device.attributes["{DRIVER}"].missing == 1']))], Error("no such key")),
    Case("invalid-CEL-one-device-class", [resource_slice("s1", [device("device-1")])], [claim()],
         Error("no such key"), classes=[device_class(selectors=[f'device.attributes["{DRIVER}"].missing == 1'])]),
    Case("unknown-selector", [resource_slice("s1", [device("device-1")])],
         [claim("c", {"name": "req0", "exactly": {"deviceClassName": "class-a", "selectors": [{"other": {}}]}})],
         Error("unsupported selector type")),
    Case("non-boolean-CEL", [resource_slice("s1", [device("device-1")])], [claim("c", exact(selectors=["1 + 1"]))],
         Error("not bool")),
    Case("unparseable-CEL", [resource_slice("s1", [device("device-1")])],
         [claim("c", exact(selectors=[f'device.attributes["{DRIVER}"].?x.orValue(1) == 1']))], Error("compilation failed")),
    Case("cel-bind-unsupported", [resource_slice("s1", [device("device-1")])],
         [claim("c", exact(selectors=['cel.bind(d, device.driver, d == "x")']))], Error("cel.bind")),
    Case("all-devices-some-allocated-admin-access", [resource_slice("s1", TWO_DEVICES)],
         [claim("c", exact(all_devices=True, admin=True))],
         [[("req0", "node1", "device-1"), ("req0", "node1", "device-2")]],
         allocated=[allocated_claim("old", allocated_result("device-1"))]),
    Case("separate-claims-share-device-admin-access", [resource_slice("s1", [device("device-1")])],
         [claim("c0", exact(admin=True)), claim("c1", exact(admin=True))],
         [[("req0", "node1", "device-1")], [("req0", "node1", "device-1")]]),
    Case("all-devices-some-allocating-admin-access", [resource_slice("s1", TWO_DEVICES)],
         [claim("c", exact("req0"), exact("req1", all_devices=True, admin=True))], FAIL),
    Case("network-attached-device", [resource_slice("s1", [device("device-1")], node_selector=ZONE_A, pool="net")],
         [claim()], [[("req0", "net", "device-1")]], nodes={"node1": {"zone": "a"}}, node_selector=ZONE_A),
    Case("network-attached-device-not-matching", [resource_slice("s1", [device("device-1")], node_selector=ZONE_A)],
         [claim()], FAIL, nodes={"node1": {"zone": "b"}}),
    Case("many-network-attached-devices",
         [resource_slice("s1", [device("device-1")], node_selector=ZONE_A, pool="net-a"),
          resource_slice("s2", [device("device-2")], node_selector=RACK_1, pool="net-b")],
         [claim("c", exact(count=2))], [[("req0", "net-a", "device-1"), ("req0", "net-b", "device-2")]],
         nodes={"node1": {"zone": "a", "rack": "1"}},
         node_selector={"nodeSelectorTerms": [{"matchExpressions": [
             {"key": "zone", "operator": "In", "values": ["a"]}, {"key": "rack", "operator": "In", "values": ["1"]}]}]}),
    Case("local-and-network-attached-devices",
         [resource_slice("s1", [device("device-1")], pool="local"),
          resource_slice("s2", [device("device-2")], node_selector=ZONE_A, pool="net")],
         [claim("c", exact(count=2))], [[("req0", "local", "device-1"), ("req0", "net", "device-2")]],
         nodes={"node1": {"zone": "a"}}, node_selector=PINNED),
    Case("all-nodes-device", [resource_slice("s1", [device("device-1")], all_nodes=True, pool="everywhere")],
         [claim()], [[("req0", "everywhere", "device-1")]], node_selector=None),
    Case("prioritized-list-first-unavailable", [resource_slice("s1", [device("device-1", attributes={"kind": "b"})])],
         [claim("c", first_available("req0", exact("subReq-0", selectors=[f'device.attributes["{DRIVER}"].kind == "a"']),
                                     exact("subReq-1")))],
         [[("req0/subReq-1", "node1", "device-1")]]),
    Case("prioritized-list-with-backtracking",
         [resource_slice("s1", [device("device-4g", capacity=_mem("4Gi")), device("device-8g", capacity=_mem("8Gi"))])],
         [claim("c", first_available("req0", exact("subReq0", selectors=[_ge("8Gi")]), exact("subReq1", selectors=[_ge("4Gi")])),
                exact("req1", selectors=[_ge("8Gi")]))],
         [[("req0/subReq1", "node1", "device-4g"), ("req1", "node1", "device-8g")]]),
    Case("partitionable-devices-multiple-devices",
         [resource_slice("s1", [
             device(n, consumes=[{"counterSet": "cs", "counters": {"mem": {"value": v}}}])
             for n, v in (("device-1", "4Gi"), ("device-2", "6Gi"), ("device-3", "4Gi"))], count=2),
          resource_slice("s0", count=2, counters=[{"name": "cs", "counters": {"mem": {"value": "8Gi"}}}])],
         [claim("c", exact("req0"), exact("req1"))], [[("req0", "node1", "device-1"), ("req1", "node1", "device-3")]]),
    Case("partitionable-devices-overallocated-capacity-pool",
         [resource_slice("s1", [
             device(n, consumes=[{"counterSet": "cs", "counters": {"mem": {"value": v}}}])
             for n, v in (("device-1", "6Gi"), ("device-2", "4Gi"), ("device-3", "1Gi"))], count=2),
          resource_slice("s0", count=2, counters=[{"name": "cs", "counters": {"mem": {"value": "8Gi"}}}])],
         [claim()], FAIL, allocated=[allocated_claim("old", allocated_result("device-1"), allocated_result("device-2"))]),
    Case("partitionable-devices-references-unknown-counter-set",
         [resource_slice("s1", [device("device-1", consumes=[{"counterSet": "nope", "counters": {"mem": {"value": "1"}}}])])],
         [claim()], Error("invalid resource pools")),
    Case("partitionable-devices-rollback-after-taint",
         [resource_slice("s1", [
             device("device-1", consumes=[{"counterSet": "cs", "counters": {"mem": {"value": "8Gi"}}}],
                    taints=[{"key": "k", "effect": "NoSchedule"}]),
             device("device-2", consumes=[{"counterSet": "cs", "counters": {"mem": {"value": "8Gi"}}}])], count=2),
          resource_slice("s0", count=2, counters=[{"name": "cs", "counters": {"mem": {"value": "8Gi"}}}])],
         [claim()], [[("req0", "node1", "device-2")]]),
    Case("tainted-two-devices",
         [resource_slice("s1", [device("device-1", taints=[{"key": "k", "value": "v", "effect": "NoSchedule"}]),
                                device("device-2", taints=[{"key": "k", "value": "v", "effect": "NoExecute"}])])],
         [claim()], FAIL),
    Case("tainted-two-devices-tolerated",
         [resource_slice("s1", [device("device-1", taints=[{"key": "k", "value": "v", "effect": "NoSchedule"}]),
                                device("device-2", taints=[{"key": "k", "value": "v", "effect": "NoExecute"}])])],
         [claim("c", exact(count=2, tolerations=[{"key": "k", "operator": "Exists"}]))],
         [[("req0", "node1", "device-1"), ("req0", "node1", "device-2")]]),
    Case("tainted-no-effect", [resource_slice("s1", [device("device-1", taints=[{"key": "k", "effect": "None"}])])],
         [claim()], [[("req0", "node1", "device-1")]]),
    Case("tainted-admin-access",
         [resource_slice("s1", [device("device-1", taints=[{"key": "k", "effect": "NoSchedule"}])])],
         [claim("c", exact(admin=True))], FAIL),
    Case("binding-conditions-with-and-without",
         [resource_slice("s1", [device("device-1", binding_conditions=["ready"])], pool="a-pool"),
          resource_slice("s2", [device("device-2")], pool="b-pool")],
         [claim("c", exact(count=2))], [[("req0", "b-pool", "device-2"), ("req0", "a-pool", "device-1")]]),
    # consumable capacity (KEP-5075)
    Case("consumable-capacity-multi-allocatable-device-without-policy-with-capacity-request",
         [resource_slice("s1", [_multi("device-1", {"cap": "2"})])],
         [claim("c0", exact(capacity={"cap": "1"})), claim("c1", exact(capacity={"cap": "1"}))],
         [[("req0", "node1", "device-1", {"cap": "1"})], [("req0", "node1", "device-1", {"cap": "1"})]]),
    Case("consumable-capacity-multi-allocatable-device-without-policy-without-capacity-request-block",
         [resource_slice("s1", [_multi("device-1", {"cap": "2"})])], [claim("c0"), claim("c1")], FAIL),
    Case("consumable-capacity-multi-allocatable-device-without-capacity-without-capacity-request",
         [resource_slice("s1", [_multi("device-1")])], [claim("c0"), claim("c1")],
         [[("req0", "node1", "device-1", None)], [("req0", "node1", "device-1", None)]]),
    Case("consumable-capacity-multi-allocatable-device-with-policy-without-capacity-request",
         [resource_slice("s1", [_multi("device-1", {"cap": _cap("4", {"default": "2", "validRange": {"min": "2"}})})])],
         [claim("c0"), claim("c1")],
         [[("req0", "node1", "device-1", {"cap": "2"})], [("req0", "node1", "device-1", {"cap": "2"})]]),
    Case("consumable-capacity-with-range-policy-step",
         [resource_slice("s1", [_multi("device-1", {"cap": _cap("10", {"default": "2",
                                                                          "validRange": {"min": "2", "max": "4", "step": "2"}})})])],
         [claim("c0", exact(capacity={"cap": "3"}))], [[("req0", "node1", "device-1", {"cap": "4"})]]),
    Case("consumable-capacity-with-request-over-max-sharing-policy",
         [resource_slice("s1", [_multi("device-1", {"cap": _cap("10", {"default": "2",
                                                                          "validRange": {"min": "2", "max": "4", "step": "2"}})})])],
         [claim("c0", exact(capacity={"cap": "6"}))], FAIL),
    Case("consumable-capacity-with-valid-values-policy-round-up",
         [resource_slice("s1", [_multi("device-1", {"cap": _cap("10", {"default": "1", "validValues": ["1", "3"]})})])],
         [claim("c0", exact(capacity={"cap": "2"}))], [[("req0", "node1", "device-1", {"cap": "3"})]]),
    Case("consumable-capacity-violates-zero-request-policy",
         [resource_slice("s1", [_multi("device-1", {"cap": _cap("10", {"default": "0", "validValues": ["0"]})})])],
         [claim("c0", exact(capacity={"cap": "1"}))], FAIL),
    Case("consumable-capacity-with-zero-request-policy",
         [resource_slice("s1", [_multi("device-1", {"cap": _cap("1", {"default": "0", "validValues": ["0"]})})])],
         [claim("c0", exact(capacity={"cap": "0"})), claim("c1", exact(capacity={"cap": "0"}))],
         [[("req0", "node1", "device-1", {"cap": "0"})], [("req0", "node1", "device-1", {"cap": "0"})]]),
    Case("consumable-capacity-with-allocated-capacity-use-remaining",
         [resource_slice("s1", [_multi("device-1", {"cap": "4"})])], [claim("c", exact(capacity={"cap": "2"}))],
         [[("req0", "node1", "device-1", {"cap": "2"})]],
         allocated=[allocated_claim("old", allocated_result("device-1", shareID="0f0f0f0f-0000-4000-8000-000000000000",
                                                            consumedCapacity={"cap": "2"}))]),
    Case("consumable-capacity-with-allocated-capacity-next-device",
         [resource_slice("s1", [_multi("device-1", {"cap": "4"}), _multi("device-2", {"cap": "4"})])],
         [claim("c", exact(capacity={"cap": "2"}))], [[("req0", "node1", "device-2", {"cap": "2"})]],
         allocated=[allocated_claim("old", allocated_result("device-1", shareID="0f0f0f0f-0000-4000-8000-000000000000",
                                                            consumedCapacity={"cap": "4"}))]),
    Case("consumable-capacity-with-no-available-consumable-capacity",
         [resource_slice("s1", [_multi("device-1", {"cap": "4"})])], [claim("c", exact(capacity={"cap": "2"}))], FAIL,
         allocated=[allocated_claim("old", allocated_result("device-1", shareID="0f0f0f0f-0000-4000-8000-000000000000",
                                                            consumedCapacity={"cap": "3"}))]),
    Case("consumable-capacity-with-missing-capacity-request",
         [resource_slice("s1", [_multi("device-1", {"cap": "4"})])], [claim("c", exact(capacity={"other": "1"}))], FAIL),
    Case("consumable-capacity-with-multi-allocatable-device-backtrack",
         [resource_slice("s1", [_multi("device-2", {"cap": "2"}, attributes={"g": "x"}),
                                _multi("device-1", {"cap": "4"}, attributes={"g": "y"})])],
         [claim("c0", exact("req0", capacity={"cap": "2"}), exact("req1", capacity={"cap": "2"}),
                constraints=[{"matchAttribute": f"{DRIVER}/g"}]),
          claim("c1", exact("req0", capacity={"cap": "2"}))],
         [[("req0", "node1", "device-1", {"cap": "2"}), ("req1", "node1", "device-1", {"cap": "2"})],
          [("req0", "node1", "device-2", {"cap": "2"})]]),
    Case("consumable-capacity-multi-allocatable-device-with-subrequest",
         [resource_slice("s1", [_multi("device-1", {"cap": _cap("2", {"default": "1", "validRange": {"min": "1"}})})])],
         [claim("c", first_available("req0", exact("subReq-0", capacity={"cap": "4"}),
                                     exact("subReq-1", capacity={"cap": "2"}), exact("subReq-2")))],
         [[("req0/subReq-1", "node1", "device-1", {"cap": "2"})]]),
    Case("consumable-capacity-allocation-mode-all-filter-out-no-capacity",
         [resource_slice("s1", [_multi("device-1", {"cap": "4"}), _multi("device-2")])],
         [claim("c", exact(all_devices=True, capacity={"cap": "1"}))], [[("req0", "node1", "device-1", {"cap": "1"})]]),
    Case("consumable-capacity-allocation-mode-all-filter-out-insufficient-capacity",
         [resource_slice("s1", [_multi("device-1", {"cap": "4"}), _multi("device-2", {"cap": "1"})])],
         [claim("c", exact(all_devices=True, capacity={"cap": "2"}))], [[("req0", "node1", "device-1", {"cap": "2"})]]),
    Case("consumable-capacity-allocation-mode-all-in-use-insufficient",
         [resource_slice("s1", [_multi("device-1", {"cap": "4"}), _multi("device-2", {"cap": "4"})])],
         [claim("c", exact(all_devices=True, capacity={"cap": "2"}))], [[("req0", "node1", "device-2", {"cap": "2"})]],
         allocated=[allocated_claim("old", allocated_result("device-1", shareID="0f0f0f0f-0000-4000-8000-000000000000",
                                                            consumedCapacity={"cap": "3"}))]),
    Case("consumable-capacity-allocation-mode-all-allocating-insufficient",
         [resource_slice("s1", [_multi("device-1", {"cap": "4"}), _multi("device-2", {"cap": "4"})])],
         [claim("c", exact("req0", capacity={"cap": "3"}), exact("req1", all_devices=True, capacity={"cap": "2"}))], FAIL),
    Case("consumable-capacity-dedicated-device-with-consumable-capacity-request",
         [resource_slice("s1", [device("device-1", capacity={"cap": "4"})])], [claim("c", exact(capacity={"cap": "2"}))],
         [[("req0", "node1", "device-1")]]),
    Case("consumable-capacity-dedicated-device-with-multiple-claims",
         [resource_slice("s1", [device("device-1", capacity={"cap": "4"})])],
         [claim("c0", exact(capacity={"cap": "2"})), claim("c1", exact(capacity={"cap": "2"}))], FAIL),
    Case("not-allocate-multi-allocatable-device-which-already-dedicated",
         [resource_slice("s1", [_multi("device-1", {"cap": "4"})])], [claim("c", exact(capacity={"cap": "1"}))], FAIL,
         allocated=[allocated_claim("old", allocated_result("device-1"))]),
    Case("not-allocate-dedicated-device-which-change-from-multi-allocatable",
         [resource_slice("s1", [device("device-1", capacity={"cap": "4"})])], [claim()], FAIL,
         allocated=[allocated_claim("old", allocated_result("device-1", shareID="0f0f0f0f-0000-4000-8000-000000000000",
                                                            consumedCapacity={"cap": "1"}))]),
    Case("allow-multiple-allocations-exclude-multi-allocatable-device-by-class-selector",
         [resource_slice("s1", [_multi("device-1")])], [claim()], FAIL,
         classes=[device_class(selectors=["device.allowMultipleAllocations == false"])]),
    Case("allow-multiple-allocations-with-shared-device-counter-cross-cycle",
         [resource_slice("s1", [
             _multi("device-1", {"cap": "4"}, consumes=[{"counterSet": "cs", "counters": {"c": {"value": "1"}}}]),
             _multi("device-2", {"cap": "4"}, consumes=[{"counterSet": "cs", "counters": {"c": {"value": "1"}}}])], count=2),
          resource_slice("s0", count=2, counters=[{"name": "cs", "counters": {"c": {"value": "1"}}}])],
         [claim("c", exact(capacity={"cap": "1"}, selectors=[f'device.driver == "{DRIVER}"']))],
         [[("req0", "node1", "device-1", {"cap": "1"})]],
         allocated=[allocated_claim("old", allocated_result("device-1", shareID="0f0f0f0f-0000-4000-8000-000000000000",
                                                            consumedCapacity={"cap": "1"}))]),
    Case("allow-multiple-allocations-shared-counter-blocks-other-device",
         [resource_slice("s1", [
             _multi("device-1", {"cap": "1"}, consumes=[{"counterSet": "cs", "counters": {"c": {"value": "1"}}}]),
             _multi("device-2", {"cap": "4"}, consumes=[{"counterSet": "cs", "counters": {"c": {"value": "1"}}}])], count=2),
          resource_slice("s0", count=2, counters=[{"name": "cs", "counters": {"c": {"value": "1"}}}])],
         [claim("c", exact(capacity={"cap": "1"}))], FAIL,
         allocated=[allocated_claim("old", allocated_result("device-1", shareID="0f0f0f0f-0000-4000-8000-000000000000",
                                                            consumedCapacity={"cap": "1"}))]),
    Case("with-distinct-constraints",
         [resource_slice("s1", [device(f"device-{i}", attributes={"b": i % 2 == 0, "v": version(f"1.0.{i}"), "i": i})
                                for i in range(4)])],
         [claim("c", *[exact(f"req{i}") for i in range(4)],
                constraints=[{"requests": ["req0", "req1"], "distinctAttribute": f"{DRIVER}/b"},
                             {"distinctAttribute": f"{DRIVER}/v"}, {"distinctAttribute": f"{DRIVER}/i"}])],
         [[(f"req{i}", "node1", f"device-{i}") for i in range(4)]]),
    Case("distinct-constraint-one-multi-allocatable-device-with-distinct-constraint",
         [resource_slice("s1", [_multi("device-1", attributes={"uuid": "u1"})])],
         [claim("c", exact("req0"), exact("req1"), constraints=[{"distinctAttribute": f"{DRIVER}/uuid"}])], FAIL),
    Case("with-distinct-constraints-attribute-not-set", [resource_slice("s1", TWO_DEVICES)],
         [claim("c", exact("req0"), exact("req1"), constraints=[{"distinctAttribute": f"{DRIVER}/uuid"}])], FAIL),
    Case("check-combinations-5-of-4", [resource_slice("s1", [device(f"device-{i}") for i in range(4)])],
         [claim("c", exact(count=5))], FAIL),
    Case("check-combinations-5-requests-of-4", [resource_slice("s1", [device(f"device-{i}") for i in range(4)])],
         [claim("c", *[exact(f"req{i}") for i in range(5)])], FAIL),
    Case("class-and-claim-config",
         [resource_slice("s1", TWO_DEVICES)],
         [claim("c", exact("req0"), exact("req1"),
                config=[{"requests": ["req1"], "opaque": {"driver": DRIVER, "parameters": {"x": 1}}},
                        {"opaque": {"driver": DRIVER, "parameters": {"y": 2}}},
                        {"requests": ["other"], "opaque": {"driver": DRIVER, "parameters": {"z": 3}}}])],
         [[("req0", "node1", "device-1"), ("req1", "node1", "device-2")]],
         classes=[device_class(config=[{"opaque": {"driver": DRIVER, "parameters": {"c": 0}}}])]),
]  # fmt: skip

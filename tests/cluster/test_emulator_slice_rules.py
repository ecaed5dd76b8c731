"""ResourceSlice server-side rules: each rule with objects it rejects (422 naming the field) and accepts.

Objects go through ``CustomObjectsApi`` so that the typed models cannot refuse them client-side.
"""

from __future__ import annotations

import copy
import json
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from tests.cluster.conftest import slice_body

Mutation = Callable[[dict[str, Any]], None]


def _device(index: int = 0, **fields: Any) -> dict[str, Any]:
    return {"name": f"gpu-{index}", **fields}


def _set(path: str, value: Any) -> Mutation:
    """Set a dotted path under ``spec`` (list indexes as numbers)."""

    def mutate(body: dict[str, Any]) -> None:
        node: Any = body["spec"]
        parts = path.split(".")
        for part in parts[:-1]:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        node[parts[-1]] = value

    return mutate


def _devices(*devices: dict[str, Any]) -> Mutation:
    return _set("devices", list(devices))


def _policy(value: str, policy: dict[str, Any], multiple: bool = True) -> Mutation:
    device = _device(capacity={"memory": {"value": value, "requestPolicy": policy}})
    if multiple:
        device["allowMultipleAllocations"] = True
    return _devices(device)


def _taint(effect: str = "NoSchedule", key: str = "fractional.dev/unhealthy") -> dict[str, Any]:
    return {"key": key, "effect": effect}


def _drop_node_name(extra: dict[str, Any]) -> Mutation:
    def mutate(body: dict[str, Any]) -> None:
        del body["spec"]["nodeName"]
        body["spec"].update(extra)

    return mutate


def _many_attributes(count: int) -> dict[str, Any]:
    return _device(attributes={f"a{i}": {"int": i} for i in range(count)})


_RANGE = {"min": "1Gi", "step": "1Gi"}
REJECTED: list[tuple[str, Mutation, str]] = [
    ("driver not a DNS subdomain", _set("driver", "fractional_dev!"), "spec.driver"),
    ("driver longer than 63", _set("driver", "a" * 64), "spec.driver"),
    ("pool name with a space", _set("pool.name", "bad pool"), "spec.pool.name"),
    ("resourceSliceCount zero", _set("pool.resourceSliceCount", 0), "spec.pool.resourceSliceCount"),
    ("nodeName and allNodes", _set("allNodes", True), "is required, but multiple fields are set"),
    ("no node selection", _drop_node_name({}), "spec: Required value: exactly one of `nodeName`"),
    ("allNodes false", _drop_node_name({"allNodes": False}), "spec.allNodes"),
    (
        "two node selector terms",
        _drop_node_name({"nodeSelector": {"nodeSelectorTerms": [{}, {}]}}),
        "nodeSelectorTerms",
    ),
    ("129 devices", _devices(*[_device(i) for i in range(129)]), "spec.devices"),
    (
        "65 devices when one has taints",
        _devices(_device(0, taints=[_taint()]), *[_device(i) for i in range(1, 65)]),
        "spec.devices",
    ),
    ("device name not a DNS label", _devices(_device(name="GPU_0")), "spec.devices[0].name"),
    ("duplicate device names", _devices(_device(0), _device(0)), "spec.devices[1]: Duplicate value"),
    ("33 attributes and capacities", _devices(_many_attributes(33)), "spec.devices[0]"),
    (
        "attribute with two values",
        _devices(_device(attributes={"numa": {"int": 0, "string": "0"}})),
        "attributes[numa]",
    ),
    ("attribute with no value", _devices(_device(attributes={"numa": {}})), "attributes[numa]"),
    (
        "string longer than 64",
        _devices(_device(attributes={"model": {"string": "x" * 65}})),
        "attributes[model].string",
    ),
    (
        "version not semver",
        _devices(_device(attributes={"driverVersion": {"version": "1.2"}})),
        "attributes[driverVersion].version",
    ),
    (
        "attribute name not a C identifier",
        _devices(_device(attributes={"bad-name": {"int": 1}})),
        'spec.devices[0].attributes: Invalid value: "bad-name": a valid C identifier',
    ),
    (
        "attribute identifier longer than 32",
        _devices(_device(attributes={"a" * 33: {"int": 1}})),
        "spec.devices[0].attributes",
    ),
    (
        "attribute domain not a DNS subdomain",
        _devices(_device(attributes={"Bad_Domain/numa": {"int": 1}})),
        'spec.devices[0].attributes: Invalid value: "Bad_Domain": an RFC 1123 subdomain',
    ),
    (
        "requestPolicy without allowMultipleAllocations",
        _policy("80Gi", {"default": "1Gi"}, multiple=False),
        "allowMultipleAllocations must be true",
    ),
    ("validRange without default", _policy("80Gi", {"validRange": _RANGE}), "requestPolicy.default"),
    (
        "validRange without min",
        _policy("80Gi", {"default": "1Gi", "validRange": {"step": "1Gi"}}),
        "validRange.min",
    ),
    (
        "validRange min above value",
        _policy("8Gi", {"default": "9Gi", "validRange": {"min": "9Gi"}}),
        "validRange.min",
    ),
    (
        "validRange max below min",
        _policy("80Gi", {"default": "2Gi", "validRange": {"min": "2Gi", "max": "1Gi"}}),
        "validRange.max",
    ),
    (
        "validRange max above value",
        _policy("80Gi", {"default": "2Gi", "validRange": {"min": "2Gi", "max": "81Gi"}}),
        "validRange.max",
    ),
    (
        "default off the step grid",
        _policy("80Gi", {"default": "1536Mi", "validRange": _RANGE}),
        'requestPolicy.validRange.step: Invalid value: "1536Mi": value is not a multiple of a given step',
    ),
    (
        "max off the step grid",
        _policy("100", {"default": "0", "validRange": {"min": "0", "max": "99", "step": "5"}}),
        'validRange.step: Invalid value: "99": value is not a multiple of a given step (5) from (0)',
    ),
    (
        "default outside the range",
        _policy("100", {"default": "50", "validRange": {"min": "0", "max": "40", "step": "5"}}),
        'requestPolicy.validRange.default: Invalid value: "50": default is more than max: 40',
    ),
    ("validValues unsorted", _policy("100", {"default": "50", "validValues": ["50", "25"]}), "validValues"),
    ("validValues duplicated", _policy("100", {"default": "50", "validValues": ["50", "50"]}), "validValues"),
    (
        "validValues above value",
        _policy("100", {"default": "50", "validValues": ["50", "200"]}),
        "validValues",
    ),
    (
        "default not among validValues",
        _policy("100", {"default": "40", "validValues": ["25", "50"]}),
        'requestPolicy.validValues: Invalid value: "40": default value is not valid according to the',
    ),
    (
        "validValues and validRange",
        _policy("100", {"default": "50", "validValues": ["50"], "validRange": {"min": "0"}}),
        'cannot specify "validValues" and "validRange" at the same time',
    ),
    (
        "17 taints",
        _devices(_device(taints=[_taint(key=f"k{i}") for i in range(17)])),
        "spec.devices[0].taints",
    ),
    ("taint with unknown effect", _devices(_device(taints=[_taint(effect="Bogus")])), "taints[0].effect"),
    ("taint key not a label name", _devices(_device(taints=[_taint(key="bad key")])), "taints[0].key"),
    (
        "devices and sharedCounters together",
        _set("sharedCounters", [{"name": "set", "counters": {"c": {"value": "1"}}}]),
        "only one of `sharedCounters` or `devices` is allowed",
    ),
    (
        "per-device node name without perDeviceNodeSelection",
        _devices(_device(nodeName="node1")),
        "perDeviceNodeSelection",
    ),
]

ACCEPTED: list[tuple[str, Mutation]] = [
    ("driver with dots", _set("driver", "gpu.example.com")),
    ("pool name with slashes", _set("pool.name", "rack-1/node1.example")),
    ("allNodes alone", _drop_node_name({"allNodes": True})),
    ("one node selector term", _drop_node_name({"nodeSelector": {"nodeSelectorTerms": [{}]}})),
    ("128 devices", _devices(*[_device(i) for i in range(128)])),
    (
        "64 devices when one has taints",
        _devices(_device(0, taints=[_taint()]), *[_device(i) for i in range(1, 64)]),
    ),
    ("32 attributes and capacities", _devices(_many_attributes(32))),
    ("string of 64", _devices(_device(attributes={"model": {"string": "x" * 64}}))),
    (
        "semver with pre-release",
        _devices(_device(attributes={"driverVersion": {"version": "1.2.3-rc.1+build.5"}})),
    ),
    ("qualified attribute name", _devices(_device(attributes={"gpu.example.com/numa": {"int": 0}}))),
    ("range policy on the grid", _policy("141Gi", {"default": "1Gi", "validRange": _RANGE})),
    (
        "compute range with max",
        _policy("100", {"default": "0", "validRange": {"min": "0", "max": "100", "step": "5"}}),
    ),
    ("default-only policy", _policy("80Gi", {"default": "80Gi"})),
    ("valid values", _policy("100", {"default": "50", "validValues": ["25", "50", "100"]})),
    (
        "16 taints of every effect",
        _devices(
            _device(
                taints=[
                    _taint(effect=("None", "NoSchedule", "NoExecute")[i % 3], key=f"k{i}") for i in range(16)
                ]
            )
        ),
    ),
    (
        "per-device node names",
        _drop_node_name({"perDeviceNodeSelection": True, "devices": [_device(nodeName="node1")]}),
    ),
]


def _create(custom: client.CustomObjectsApi, body: dict[str, Any]) -> dict[str, Any]:
    return custom.create_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", body)


@pytest.mark.parametrize(("mutate", "field"), [pytest.param(m, f, id=i) for i, m, f in REJECTED])
def test_slice_rule_rejects(custom: client.CustomObjectsApi, mutate: Mutation, field: str) -> None:
    body = slice_body()
    mutate(body)
    with pytest.raises(client.ApiException) as caught:
        _create(custom, body)
    status = json.loads(caught.value.body)
    assert (caught.value.status, status["reason"]) == (422, "Invalid")
    assert field in status["message"]
    assert status["details"]["causes"]


@pytest.mark.parametrize("mutate", [pytest.param(m, id=i) for i, m in ACCEPTED])
def test_slice_rule_accepts(custom: client.CustomObjectsApi, mutate: Mutation) -> None:
    body = slice_body()
    mutate(body)
    created = _create(custom, copy.deepcopy(body))
    assert created["spec"] == body["spec"]


def test_unknown_field_is_refused_under_strict_field_validation(custom: client.CustomObjectsApi) -> None:
    body = slice_body(devices=[_device(capacity={"memory": {"value": "1Gi", "limit": "2Gi"}})])
    with pytest.raises(client.ApiException) as caught:
        custom.create_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices", body, field_validation="Strict"
        )
    assert caught.value.status == 400
    assert json.loads(caught.value.body)["message"] == (
        'ResourceSlice in version "v1" cannot be handled as a ResourceSlice: strict decoding error: '
        'unknown field "spec.devices[0].capacity[memory].limit"'
    )


def test_unknown_field_is_dropped_with_a_warning_by_default(api_server: Any) -> None:
    """``fieldValidation=Warn`` is the server's default: the object is stored without the field and
    a ``Warning`` header names it."""
    body = slice_body(devices=[_device(capacity={"memory": {"value": "1Gi", "limit": "2Gi"}})])
    request = urllib.request.Request(
        f"{api_server.url}/apis/resource.k8s.io/v1/resourceslices",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        created = json.loads(response.read())
        warnings = response.headers.get_all("Warning")
    assert warnings == ['299 - "unknown field \\"spec.devices[0].capacity[memory].limit\\""']
    assert created["spec"]["devices"][0]["capacity"]["memory"] == {"value": "1Gi"}


def test_schema_type_mismatch_is_rejected(custom: client.CustomObjectsApi) -> None:
    with pytest.raises(client.ApiException) as caught:
        _create(custom, slice_body(devices=[_device(attributes={"numa": {"int": "zero"}})]))
    assert caught.value.status == 422
    assert "spec.devices[0].attributes[numa].int" in json.loads(caught.value.body)["message"]


@pytest.mark.parametrize(
    ("field", "value"), [("driver", "other.dev"), ("pool.name", "other"), ("nodeName", "node2")]
)
def test_slice_identity_fields_are_immutable(resource: client.ResourceV1Api, field: str, value: str) -> None:
    resource.create_resource_slice(slice_body())
    patch: dict[str, Any] = {"spec": {}}
    _set(field, value)(patch)
    with pytest.raises(client.ApiException) as caught:
        resource.patch_resource_slice("node1-slice", patch)
    assert caught.value.status == 422
    assert f"spec.{field}" in json.loads(caught.value.body)["message"]


def test_slice_content_is_mutable(resource: client.ResourceV1Api) -> None:
    resource.create_resource_slice(slice_body())
    patched = resource.patch_resource_slice(
        "node1-slice", {"spec": {"pool": {"generation": 2}, "devices": [{"name": "gpu-1"}]}}
    )
    assert [device.name for device in patched.spec.devices] == ["gpu-1"]


@pytest.mark.parametrize(
    ("labels", "accepted"),
    [({"fractional.dev/node": "node1"}, True), ({"bad key": "x"}, False), ({"k": "-bad"}, False)],
)
def test_label_formats(custom: client.CustomObjectsApi, labels: dict[str, str], accepted: bool) -> None:
    body = slice_body()
    body["metadata"]["labels"] = labels
    if accepted:
        assert _create(custom, body)["metadata"]["labels"] == labels
    else:
        with pytest.raises(client.ApiException) as caught:
            _create(custom, body)
        assert "metadata.labels" in json.loads(caught.value.body)["message"]


@pytest.mark.parametrize(("name", "accepted"), [("node1-gpu.example.com-0", True), ("Node_1", False)])
def test_object_name_format(custom: client.CustomObjectsApi, name: str, accepted: bool) -> None:
    body = slice_body(name)
    if accepted:
        assert _create(custom, body)["metadata"]["name"] == name
    else:
        with pytest.raises(client.ApiException) as caught:
            _create(custom, body)
        assert "metadata.name" in json.loads(caught.value.body)["message"]


def test_unparseable_quantity_is_refused_when_decoded(custom: client.CustomObjectsApi) -> None:
    """kube-apiserver parses quantities while decoding the body: 400 before any rule
    (tests/data/differential/real-1.37.2.json, claim-bad-quantity)."""
    body = slice_body()
    _devices(_device(capacity={"memory": {"value": "12 GB"}}))(body)
    with pytest.raises(client.ApiException) as caught:
        _create(custom, body)
    status = json.loads(caught.value.body)
    assert (caught.value.status, status["reason"]) == (400, "BadRequest")
    assert status["message"] == (
        'ResourceSlice in version "v1" cannot be handled as a ResourceSlice: quantities must match the '
        "regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
    )

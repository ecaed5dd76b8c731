"""The compiled schema checks agree with ``jsonschema`` walking the same official schemas."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest
from referencing import Registry, Resource

from driver.cluster.apiserver.schema import SCHEMA_VERSION, SchemaViolation, schema_check, schema_document
from tests.cluster.conftest import claim_body, pod_body, slice_body


def _jsonschema_accepts(schema_file: str, obj: Any) -> bool:
    """The reference: what kubernetes_validate.validate(strict=True) does, with the same files."""
    schema = schema_document(schema_file)
    registry: Registry[Any] = Resource.from_contents(schema) @ Registry()
    registry = Resource.from_contents(schema_document("_definitions.json")) @ registry
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    return next(iter(validator.iter_errors(obj)), None) is None


def _compiled_accepts(schema_file: str, obj: Any) -> bool:
    try:
        schema_check(schema_file)(obj, ())
    except SchemaViolation:
        return False
    return True


def _allocated_claim() -> dict[str, Any]:
    claim = claim_body()
    claim["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "gpu",
                        "driver": "d",
                        "pool": "p",
                        "device": "gpu-0",
                        "consumedCapacity": {"m": "1Gi"},
                    }
                ]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}]}
                ]
            },
        },
        "reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}],
    }
    return claim


def _set(obj: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    mutated = copy.deepcopy(obj)
    node: Any = mutated
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return mutated


_SLICE = slice_body(
    devices=[
        {
            "name": "gpu-0",
            "allowMultipleAllocations": True,
            "attributes": {"numa": {"int": 0}, "ok": {"bool": True}},
            "capacity": {
                "memory": {"value": "80Gi", "requestPolicy": {"default": "1Gi", "validRange": {"min": "1Gi"}}}
            },
            "taints": [{"key": "k", "effect": "NoSchedule"}],
        }
    ]
)
_POD = pod_body(resourceClaims=[{"name": "gpu", "resourceClaimName": "c"}])
_POD["spec"]["containers"][0]["ports"] = [{"containerPort": 80}]
_POD["spec"]["containers"][0]["resources"] = {"limits": {"cpu": 1}, "claims": [{"name": "gpu"}]}
_LEASE = {
    "apiVersion": "coordination.k8s.io/v1",
    "kind": "Lease",
    "metadata": {"name": "l", "namespace": "default", "resourceVersion": "5"},
    "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15, "renewTime": "2026-01-01T00:00:00.000000Z"},
}

_S, _C = "resourceslice-resource-v1.json", "resourceclaim-resource-v1.json"
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("slice valid", "resourceslice-resource-v1.json", _SLICE),
    ("slice unknown nested field", _S, _set(_SLICE, ("spec", "devices", 0, "color"), "red")),
    (
        "slice unknown field in map value",
        _S,
        _set(_SLICE, ("spec", "devices", 0, "attributes", "numa", "float"), 1.5),
    ),
    (
        "slice int attribute as string",
        _S,
        _set(_SLICE, ("spec", "devices", 0, "attributes", "numa", "int"), "0"),
    ),
    ("slice quantity as number", _S, _set(_SLICE, ("spec", "devices", 0, "capacity", "memory", "value"), 80)),
    ("slice quantity as list", _S, _set(_SLICE, ("spec", "devices", 0, "capacity", "memory", "value"), [1])),
    (
        "slice missing pool name",
        _S,
        _set(_SLICE, ("spec", "pool"), {"generation": 1, "resourceSliceCount": 1}),
    ),
    ("slice null node name", _S, _set(_SLICE, ("spec", "nodeName"), None)),
    ("slice devices not a list", _S, _set(_SLICE, ("spec", "devices"), {"name": "x"})),
    ("slice wrong kind", _S, _set(_SLICE, ("kind",), "Pod")),
    ("slice generation as float", _S, _set(_SLICE, ("spec", "pool", "generation"), 1.0)),
    ("slice generation as bool", _S, _set(_SLICE, ("spec", "pool", "generation"), True)),
    ("slice unknown metadata field", _S, _set(_SLICE, ("metadata", "owner"), "x")),
    ("claim allocated", "resourceclaim-resource-v1.json", _allocated_claim()),
    (
        "claim result missing device",
        _C,
        _set(
            _allocated_claim(),
            ("status", "allocation", "devices", "results", 0),
            {"request": "gpu", "driver": "d", "pool": "p"},
        ),
    ),
    ("claim unknown status field", _C, _set(_allocated_claim(), ("status", "phase"), "Allocated")),
    ("pod valid", "pod-v1.json", _POD),
    (
        "pod port as string",
        "pod-v1.json",
        _set(_POD, ("spec", "containers", 0, "ports", 0, "containerPort"), "80"),
    ),
    (
        "pod int-or-string",
        "pod-v1.json",
        _set(_POD, ("spec", "containers", 0, "ports"), [{"containerPort": 80, "name": "http"}]),
    ),
    ("pod unknown container field", "pod-v1.json", _set(_POD, ("spec", "containers", 0, "gpu"), 1)),
    ("lease valid", "lease-coordination-v1.json", _LEASE),
    (
        "lease duration as string",
        "lease-coordination-v1.json",
        _set(_LEASE, ("spec", "leaseDurationSeconds"), "15"),
    ),
]


@pytest.mark.parametrize(("schema_file", "obj"), [pytest.param(f, o, id=i) for i, f, o in CASES])
def test_compiled_check_agrees_with_jsonschema(schema_file: str, obj: dict[str, Any]) -> None:
    assert _compiled_accepts(schema_file, obj) == _jsonschema_accepts(schema_file, obj)


def test_corpus_has_both_verdicts() -> None:
    verdicts = {_jsonschema_accepts(schema_file, obj) for _, schema_file, obj in CASES}
    assert verdicts == {True, False}


def test_schema_version_is_at_least_1_35() -> None:
    major, minor, _ = (int(part) for part in SCHEMA_VERSION.split("."))
    assert (major, minor) >= (1, 35)


def test_violation_names_the_unknown_field() -> None:
    with pytest.raises(SchemaViolation) as caught:
        schema_check("resourceslice-resource-v1.json")(
            _set(_SLICE, ("spec", "devices", 0, "color"), "red"), ()
        )
    assert caught.value.path == ("spec", "devices", 0, "color")
    assert caught.value.kind == "unknown"

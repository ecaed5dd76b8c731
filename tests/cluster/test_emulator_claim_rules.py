"""ResourceClaim rules: immutable spec, allocation written once, result and reservation limits,
device status matching, the reserved finalizer; plus DeviceClass and template rules."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client

from tests.cluster.conftest import claim_body

SHARE_ID = "6f9619ff-8b86-d011-b42d-00c04fc964ff"


def _result(device: str = "gpu-0", share_id: str | None = SHARE_ID, request: str = "gpu") -> dict[str, Any]:
    result = {"request": request, "driver": "fractional.dev", "pool": "node1", "device": device}
    if share_id is not None:
        result["shareID"] = share_id
    return result


def _allocation(*results: dict[str, Any]) -> dict[str, Any]:
    return {"devices": {"results": list(results) or [_result()]}}


def _write_status(resource: client.ResourceV1Api, status: dict[str, Any]) -> Any:
    return resource.patch_namespaced_resource_claim_status(
        "claim", "default", {"status": status}, _content_type="application/merge-patch+json"
    )


def _invalid(caught: pytest.ExceptionInfo[client.ApiException]) -> str:
    assert caught.value.status == 422
    return str(json.loads(caught.value.body)["message"])


@pytest.fixture
def claim(resource: client.ResourceV1Api) -> Any:
    return resource.create_namespaced_resource_claim("default", claim_body())


@pytest.mark.usefixtures("claim")
def test_claim_spec_is_immutable(resource: client.ResourceV1Api) -> None:
    patch = {"spec": {"devices": {"requests": [{"name": "other", "exactly": {"deviceClassName": "x"}}]}}}
    with pytest.raises(client.ApiException) as caught:
        resource.patch_namespaced_resource_claim("claim", "default", patch)
    assert "spec: Invalid value: null: field is immutable" in _invalid(caught)


@pytest.mark.usefixtures("claim")
def test_allocation_is_set_once_then_only_cleared(resource: client.ResourceV1Api) -> None:
    allocated = _write_status(resource, {"allocation": _allocation()})
    assert allocated.status.allocation.devices.results[0].share_id == SHARE_ID
    with pytest.raises(client.ApiException) as caught:
        _write_status(resource, {"allocation": _allocation(_result("gpu-1"))})
    assert "status.allocation" in _invalid(caught)
    cleared = _write_status(resource, {"allocation": None})
    assert cleared.status is None or cleared.status.allocation is None
    again = _write_status(resource, {"allocation": _allocation(_result("gpu-1"))})
    assert again.status.allocation.devices.results[0].device == "gpu-1"


@pytest.mark.usefixtures("claim")
def test_allocation_timestamp_is_a_time_and_part_of_the_immutable_allocation(
    resource: client.ResourceV1Api,
) -> None:
    """As kube-apiserver: the stamp is stored as RFC 3339 UTC seconds whatever form it came in,
    the same instant written another way is no change, and stamping an allocation afterwards is
    one (what kube-scheduler's PreBind tries when the allocator left it out)."""
    stamped = {**_allocation(), "allocationTimestamp": "2026-12-01T16:40:00+00:00"}
    stored = _write_status(resource, {"allocation": stamped})
    raw = resource.read_namespaced_resource_claim("claim", "default", _preload_content=False)
    assert json.loads(raw.data)["status"]["allocation"]["allocationTimestamp"] == "2026-12-01T16:40:00Z"
    assert stored.status.allocation.allocation_timestamp is not None
    same_instant = {**_allocation(), "allocationTimestamp": "2026-12-01T16:40:00Z"}
    _write_status(resource, {"allocation": same_instant, "reservedFor": [_consumer()]})
    _write_status(resource, {"allocation": None, "reservedFor": None})
    _write_status(resource, {"allocation": _allocation()})
    with pytest.raises(client.ApiException) as caught:
        _write_status(resource, {"allocation": stamped})
    assert "status.allocation" in _invalid(caught)


def _consumer() -> dict[str, str]:
    return {"resource": "pods", "name": "app", "uid": "0c2fa7f5-6d7e-4a3e-9a73-2b7d0c1f4a11"}


@pytest.mark.usefixtures("claim")
def test_allocation_replace_with_stale_version_conflicts(resource: client.ResourceV1Api) -> None:
    stale = resource.read_namespaced_resource_claim("claim", "default")
    _write_status(resource, {"allocation": _allocation()})
    stale.status = client.V1ResourceClaimStatus(
        allocation=client.V1AllocationResult(
            devices=client.V1DeviceAllocationResult(
                results=[
                    client.V1DeviceRequestAllocationResult(request="gpu", driver="d", pool="p", device="x")
                ]
            )
        )
    )
    with pytest.raises(client.ApiException) as caught:
        resource.replace_namespaced_resource_claim_status("claim", "default", stale)
    assert caught.value.status == 409


@pytest.mark.usefixtures("claim")
@pytest.mark.parametrize(
    ("status", "field"),
    [
        (
            {"allocation": _allocation(*[_result(f"gpu-{i}") for i in range(33)])},
            "status.allocation.devices.results",
        ),
        ({"allocation": _allocation(_result(share_id=SHARE_ID.upper()))}, "shareID"),
        ({"allocation": _allocation(_result(share_id="not-a-uuid"))}, "shareID"),
        ({"reservedFor": [{"resource": "pods", "name": "p", "uid": "u1"}]}, "status.reservedFor"),
        (
            {
                "allocation": _allocation(),
                "reservedFor": [{"resource": "pods", "name": f"p{i}", "uid": f"u{i}"} for i in range(257)],
            },
            "status.reservedFor",
        ),
        (
            {
                "allocation": _allocation(),
                "reservedFor": [
                    {"resource": "pods", "name": "p", "uid": "u"},
                    {"resource": "pods", "name": "q", "uid": "u"},
                ],
            },
            "status.reservedFor",
        ),
        (
            {
                "allocation": _allocation(),
                "devices": [{"driver": "fractional.dev", "pool": "node1", "device": "gpu-9"}],
            },
            "status.devices[0]",
        ),
    ],
)
def test_claim_status_rule_rejects(
    resource: client.ResourceV1Api, status: dict[str, Any], field: str
) -> None:
    with pytest.raises(client.ApiException) as caught:
        _write_status(resource, status)
    assert field in _invalid(caught)


@pytest.mark.usefixtures("claim")
@pytest.mark.parametrize(
    "status",
    [
        {"allocation": _allocation(*[_result(f"gpu-{i}") for i in range(32)])},
        {"allocation": _allocation(_result(share_id=None))},
        {
            "allocation": _allocation(),
            "reservedFor": [{"resource": "pods", "name": f"p{i}", "uid": f"u{i}"} for i in range(256)],
        },
        {
            "allocation": _allocation(),
            "devices": [
                {"driver": "fractional.dev", "pool": "node1", "device": "gpu-0", "shareID": SHARE_ID}
            ],
        },
        {
            "allocation": {
                "devices": {
                    "results": [{**_result(), "consumedCapacity": {"memory": "10Gi", "compute": "25"}}]
                }
            }
        },
    ],
)
def test_claim_status_rule_accepts(resource: client.ResourceV1Api, status: dict[str, Any]) -> None:
    written = _write_status(resource, status)
    assert written.status.allocation is not None


def test_reserved_finalizer_is_accepted_on_create(resource: client.ResourceV1Api) -> None:
    """kube-apiserver 1.37.2 lets a client create a claim with the claim controller's finalizer
    (the differential corpus's claim-reserved-finalizer); the emulator refused it before."""
    body = claim_body()
    body["metadata"]["finalizers"] = ["resource.kubernetes.io/delete-protection"]
    created = resource.create_namespaced_resource_claim("default", body)
    assert created.metadata.finalizers == ["resource.kubernetes.io/delete-protection"]
    resource.patch_namespaced_resource_claim("claim", "default", {"metadata": {"finalizers": None}})
    resource.delete_namespaced_resource_claim("claim", "default")
    body["metadata"]["finalizers"] = ["fractional.dev/allocation"]
    created = resource.create_namespaced_resource_claim("default", body)
    assert created.metadata.finalizers == ["fractional.dev/allocation"]


def test_no_new_reservations_while_deleting(resource: client.ResourceV1Api) -> None:
    body = claim_body()
    body["metadata"]["finalizers"] = ["fractional.dev/allocation"]
    resource.create_namespaced_resource_claim("default", body)
    _write_status(resource, {"allocation": _allocation()})
    resource.delete_namespaced_resource_claim("claim", "default")
    with pytest.raises(client.ApiException) as caught:
        _write_status(resource, {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]})
    assert "status.reservedFor" in _invalid(caught)


@pytest.mark.parametrize(
    ("requests", "field"),
    [
        ([{"name": "gpu", "exactly": {"deviceClassName": "c"}}] * 2, "requests[1]: Duplicate value"),
        ([{"name": "GPU", "exactly": {"deviceClassName": "c"}}], "requests[0].name"),
        ([{"name": "gpu"}], "exactly one of `exactly` or `firstAvailable` is required"),
        ([{"name": "gpu", "exactly": {"deviceClassName": "c", "count": -1}}], "exactly.count"),
        ([{"name": "gpu", "exactly": {"deviceClassName": "c", "allocationMode": "Some"}}], "allocationMode"),
    ],
)
def test_claim_request_rules(
    custom: client.CustomObjectsApi, requests: list[dict[str, Any]], field: str
) -> None:
    body = claim_body()
    body["spec"]["devices"]["requests"] = requests
    with pytest.raises(client.ApiException) as caught:
        custom.create_namespaced_custom_object("resource.k8s.io", "v1", "default", "resourceclaims", body)
    assert field in _invalid(caught)


@pytest.mark.usefixtures("claim")
def test_unparseable_quantity_is_refused_when_decoded(
    custom: client.CustomObjectsApi, resource: client.ResourceV1Api
) -> None:
    """kube-apiserver parses quantities while decoding the body: 400 before any rule, in the spec and
    in the status (tests/data/differential/real-1.37.2.json, claim-bad-quantity)."""
    expected = (
        'ResourceClaim in version "v1" cannot be handled as a ResourceClaim: quantities must match the '
        "regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
    )
    body = claim_body("other")
    body["spec"]["devices"]["requests"][0]["exactly"]["capacity"] = {"requests": {"memory": "x"}}
    with pytest.raises(client.ApiException) as caught:
        custom.create_namespaced_custom_object("resource.k8s.io", "v1", "default", "resourceclaims", body)
    assert (caught.value.status, json.loads(caught.value.body)["message"]) == (400, expected)
    status = {"allocation": {"devices": {"results": [{**_result(), "consumedCapacity": {"memory": "lots"}}]}}}
    with pytest.raises(client.ApiException) as caught:
        _write_status(resource, status)
    assert (caught.value.status, json.loads(caught.value.body)["message"]) == (400, expected)


def test_claim_requests_are_defaulted(resource: client.ResourceV1Api) -> None:
    """``allocationMode: ExactCount`` and, in that mode, ``count: 1`` (a count of 0 too); an empty request
    list is stored as null (tests/data/differential/real-1.37.2.json: claim-share-created,
    claim-count-zero, claim-no-requests)."""
    body = claim_body()
    body["spec"]["devices"]["requests"] = [
        {"name": "a", "exactly": {"deviceClassName": "c", "count": 0}},
        {"name": "b", "firstAvailable": [{"name": "x", "deviceClassName": "c"}]},
        {"name": "c", "exactly": {"deviceClassName": "c", "allocationMode": "All"}},
    ]
    created = resource.create_namespaced_resource_claim("default", body)
    first, second, third = created.spec.devices.requests
    assert (first.exactly.allocation_mode, first.exactly.count) == ("ExactCount", 1)
    assert (second.first_available[0].allocation_mode, second.first_available[0].count) == ("ExactCount", 1)
    assert (third.exactly.allocation_mode, third.exactly.count) == ("All", None)
    empty = claim_body("empty")
    empty["spec"]["devices"]["requests"] = []
    assert resource.create_namespaced_resource_claim("default", empty).spec.devices.requests is None


def test_claim_with_capacity_request_is_accepted(resource: client.ResourceV1Api) -> None:
    body = claim_body()
    body["spec"]["devices"]["requests"][0]["exactly"]["capacity"] = {"requests": {"memory": "10Gi"}}
    created = resource.create_namespaced_resource_claim("default", body)
    assert created.spec.devices.requests[0].exactly.capacity.requests == {"memory": "10Gi"}


def test_claim_template_spec_is_immutable(resource: client.ResourceV1Api) -> None:
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "t"},
        "spec": {"spec": claim_body()["spec"]},
    }
    resource.create_namespaced_resource_claim_template("default", template)
    with pytest.raises(client.ApiException) as caught:
        resource.patch_namespaced_resource_claim_template(
            "t", "default", {"spec": {"metadata": {"labels": {"a": "b"}}}}
        )
    assert "field is immutable" in _invalid(caught)


@pytest.mark.parametrize(("size", "accepted"), [(100, True), (11 * 1024, False)])
def test_device_class_opaque_parameters_limit(
    resource: client.ResourceV1Api, size: int, accepted: bool
) -> None:
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "fractional.dev"},
        "spec": {
            "selectors": [{"cel": {"expression": 'device.driver == "fractional.dev"'}}],
            "config": [{"opaque": {"driver": "fractional.dev", "parameters": {"blob": "x" * size}}}],
        },
    }
    if accepted:
        assert resource.create_device_class(body).metadata.name == "fractional.dev"
    else:
        with pytest.raises(client.ApiException) as caught:
            resource.create_device_class(body)
        assert "spec.config[0].opaque.parameters" in _invalid(caught)

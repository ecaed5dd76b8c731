"""CRUD, optimistic concurrency, status subresource and finalizers through the real client."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest
from kubernetes import client

from driver.cluster.apiserver import APIServer
from tests.cluster.conftest import claim_body, pod_body, slice_body


def _status(error: client.ApiException) -> dict:
    return json.loads(error.body)


def test_create_fills_server_metadata(resource: client.ResourceV1Api) -> None:
    created = resource.create_resource_slice(slice_body())
    assert created.metadata.uid
    assert created.metadata.creation_timestamp is not None
    assert int(created.metadata.resource_version) > 0
    assert created.metadata.generation == 1
    assert resource.read_resource_slice("node1-slice").metadata.uid == created.metadata.uid


def test_generate_name_appends_five_characters(resource: client.ResourceV1Api) -> None:
    body = slice_body()
    body["metadata"] = {"generateName": "node1-fractional.dev-"}
    names = {resource.create_resource_slice(body).metadata.name for _ in range(3)}
    assert len(names) == 3
    for name in names:
        assert name.startswith("node1-fractional.dev-")
        assert len(name) == len("node1-fractional.dev-") + 5


def test_create_twice_is_already_exists(resource: client.ResourceV1Api) -> None:
    resource.create_resource_slice(slice_body())
    with pytest.raises(client.ApiException) as caught:
        resource.create_resource_slice(slice_body())
    assert caught.value.status == 409
    status = _status(caught.value)
    assert (status["kind"], status["reason"], status["code"]) == ("Status", "AlreadyExists", 409)


def test_get_missing_is_not_found_status(resource: client.ResourceV1Api) -> None:
    with pytest.raises(client.ApiException) as caught:
        resource.read_resource_slice("absent")
    status = _status(caught.value)
    assert caught.value.status == 404
    assert status["reason"] == "NotFound"
    assert status["status"] == "Failure"
    assert "absent" in status["message"]


def test_replace_with_stale_resource_version_conflicts(resource: client.ResourceV1Api) -> None:
    first = resource.create_resource_slice(slice_body())
    resource.patch_resource_slice("node1-slice", {"metadata": {"labels": {"a": "1"}}})
    first.metadata.labels = {"b": "2"}
    with pytest.raises(client.ApiException) as caught:
        resource.replace_resource_slice("node1-slice", first)
    assert caught.value.status == 409
    assert "the object has been modified" in _status(caught.value)["message"]
    fresh = resource.read_resource_slice("node1-slice")
    fresh.metadata.labels = {"b": "2"}
    replaced = resource.replace_resource_slice("node1-slice", fresh)
    assert replaced.metadata.labels == {"b": "2"}
    assert int(replaced.metadata.resource_version) > int(fresh.metadata.resource_version)


def test_replace_missing_is_not_found(resource: client.ResourceV1Api) -> None:
    with pytest.raises(client.ApiException) as caught:
        resource.replace_resource_slice("absent", slice_body("absent"))
    assert caught.value.status == 404


def test_spec_change_bumps_generation_label_change_does_not(resource: client.ResourceV1Api) -> None:
    resource.create_resource_slice(slice_body())
    labelled = resource.patch_resource_slice("node1-slice", {"metadata": {"labels": {"a": "1"}}})
    assert labelled.metadata.generation == 1
    bumped = resource.patch_resource_slice("node1-slice", {"spec": {"pool": {"generation": 2}}})
    assert bumped.metadata.generation == 2
    assert bumped.spec.pool.generation == 2


def test_noop_write_keeps_resource_version(resource: client.ResourceV1Api) -> None:
    created = resource.create_resource_slice(slice_body())
    same = resource.patch_resource_slice("node1-slice", {"metadata": {"labels": None}})
    assert same.metadata.resource_version == created.metadata.resource_version


@pytest.mark.parametrize(
    ("content_type", "patch", "expected"),
    [
        (
            "application/merge-patch+json",
            {"metadata": {"labels": {"a": None, "c": "3"}}},
            {"b": "2", "c": "3"},
        ),
        (
            "application/strategic-merge-patch+json",
            {"metadata": {"labels": {"a": "9"}}},
            {"a": "9", "b": "2"},
        ),
        (
            "application/json-patch+json",
            [
                {"op": "test", "path": "/metadata/labels/a", "value": "1"},
                {"op": "remove", "path": "/metadata/labels/a"},
            ],
            {"b": "2"},
        ),
    ],
)
def test_patch_content_types(
    resource: client.ResourceV1Api, content_type: str, patch: object, expected: dict
) -> None:
    body = slice_body()
    body["metadata"]["labels"] = {"a": "1", "b": "2"}
    resource.create_resource_slice(body)
    patched = resource.patch_resource_slice("node1-slice", patch, _content_type=content_type)
    assert patched.metadata.labels == expected


def test_json_patch_failed_test_changes_nothing(resource: client.ResourceV1Api) -> None:
    created = resource.create_resource_slice(slice_body())
    ops = [
        {"op": "add", "path": "/metadata/labels", "value": {"x": "y"}},
        {"op": "test", "path": "/spec/driver", "value": "other"},
    ]
    with pytest.raises(client.ApiException) as caught:
        resource.patch_resource_slice("node1-slice", ops, _content_type="application/json-patch+json")
    assert caught.value.status == 422
    assert (
        resource.read_resource_slice("node1-slice").metadata.resource_version
        == created.metadata.resource_version
    )


def test_patch_carrying_stale_resource_version_conflicts(resource: client.ResourceV1Api) -> None:
    created = resource.create_resource_slice(slice_body())
    resource.patch_resource_slice("node1-slice", {"metadata": {"labels": {"a": "1"}}})
    with pytest.raises(client.ApiException) as caught:
        resource.patch_resource_slice(
            "node1-slice",
            {"metadata": {"resourceVersion": created.metadata.resource_version, "labels": {"a": "2"}}},
        )
    assert caught.value.status == 409


def test_strategic_patch_merges_scheduling_gates_and_finalizers_by_key(core: client.CoreV1Api) -> None:
    body = pod_body(schedulingGates=[{"name": "fractional.dev/gang"}, {"name": "other"}])
    body["metadata"]["finalizers"] = ["a/one"]
    core.create_namespaced_pod("default", body)
    patched = core.patch_namespaced_pod(
        "pod",
        "default",
        {
            "metadata": {"finalizers": ["b/two"]},
            "spec": {"schedulingGates": [{"name": "fractional.dev/gang", "$patch": "delete"}]},
        },
    )
    assert [gate.name for gate in patched.spec.scheduling_gates] == ["other"]
    assert patched.metadata.finalizers == ["a/one", "b/two"]
    removed = core.patch_namespaced_pod(
        "pod", "default", {"metadata": {"$deleteFromPrimitiveList/finalizers": ["a/one"]}}
    )
    assert removed.metadata.finalizers == ["b/two"]


def test_claim_status_subresource_is_isolated(resource: client.ResourceV1Api) -> None:
    body = claim_body()
    body["status"] = {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]}
    created = resource.create_namespaced_resource_claim("default", body)
    assert created.status is None or not created.status.reserved_for  # status is dropped on create
    labelled = resource.patch_namespaced_resource_claim(
        "claim",
        "default",
        {"metadata": {"labels": {"a": "1"}}, "status": {"allocation": {"devices": {"results": []}}}},
    )
    assert labelled.status is None or labelled.status.allocation is None
    status_written = resource.patch_namespaced_resource_claim_status(
        "claim",
        "default",
        {"metadata": {"labels": {"ignored": "x"}}, "status": {"allocation": {"devices": {"results": []}}}},
    )
    assert status_written.status.allocation is not None
    assert status_written.metadata.labels == {"a": "1"}
    assert int(status_written.metadata.resource_version) > int(labelled.metadata.resource_version)


def test_pod_status_reset_on_create_and_written_through_status(core: client.CoreV1Api) -> None:
    body = pod_body()
    body["status"] = {"phase": "Running"}
    assert core.create_namespaced_pod("default", body).status.phase == "Pending"
    core.patch_namespaced_pod("pod", "default", {"status": {"phase": "Failed"}})
    assert core.read_namespaced_pod("pod", "default").status.phase == "Pending"
    core.patch_namespaced_pod_status("pod", "default", {"status": {"phase": "Running"}})
    assert core.read_namespaced_pod("pod", "default").status.phase == "Running"


def test_delete_with_finalizer_waits_for_finalizer_removal(
    api_server: APIServer, resource: client.ResourceV1Api
) -> None:
    body = claim_body()
    body["metadata"]["finalizers"] = ["fractional.dev/allocation"]
    resource.create_namespaced_resource_claim("default", body)
    resource.delete_namespaced_resource_claim("claim", "default")
    deleting = resource.read_namespaced_resource_claim("claim", "default")
    assert deleting.metadata.deletion_timestamp is not None
    with pytest.raises(client.ApiException) as caught:
        resource.patch_namespaced_resource_claim(
            "claim", "default", {"metadata": {"finalizers": ["x/new", "fractional.dev/allocation"]}}
        )
    assert caught.value.status == 422
    resource.patch_namespaced_resource_claim(
        "claim", "default", {"metadata": {"finalizers": None}}, _content_type="application/merge-patch+json"
    )
    with pytest.raises(client.ApiException) as gone:
        resource.read_namespaced_resource_claim("claim", "default")
    assert gone.value.status == 404
    assert api_server.object_count("resourceclaims") == 0


def test_delete_returns_status_for_kinds_that_do_not_return_objects(core: client.CoreV1Api) -> None:
    core.create_namespaced_config_map(
        "default", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}
    )
    result = core.delete_namespaced_config_map("c", "default")
    assert result["status"] == "Success"
    assert result["details"]["name"] == "c"


def test_delete_precondition_on_resource_version(resource: client.ResourceV1Api) -> None:
    created = resource.create_resource_slice(slice_body())
    resource.patch_resource_slice("node1-slice", {"metadata": {"labels": {"a": "1"}}})
    with pytest.raises(client.ApiException) as caught:
        resource.delete_resource_slice(
            "node1-slice",
            body=client.V1DeleteOptions(
                preconditions=client.V1Preconditions(resource_version=created.metadata.resource_version)
            ),
        )
    assert caught.value.status == 409
    resource.delete_resource_slice("node1-slice")
    assert resource.list_resource_slice().items == []


def test_create_in_a_missing_namespace_is_not_found(core: client.CoreV1Api) -> None:
    """NamespaceLifecycle admission: the namespace must exist first."""
    with pytest.raises(client.ApiException) as caught:
        core.create_namespaced_config_map(
            "team-a", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}
        )
    assert caught.value.status == 404
    assert json.loads(caught.value.body)["message"] == 'namespaces "team-a" not found'


def test_system_namespaces_exist_from_the_start(core: client.CoreV1Api) -> None:
    names = {item.metadata.name for item in core.list_namespace().items}
    assert {"default", "kube-system", "kube-public", "kube-node-lease"} <= names
    namespace = core.read_namespace("kube-system")
    assert namespace.status.phase == "Active"
    assert namespace.metadata.labels["kubernetes.io/metadata.name"] == "kube-system"


def test_deleted_namespace_terminates_until_finalized(core: client.CoreV1Api) -> None:
    core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-b"}})
    core.create_namespaced_config_map(
        "team-b", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}
    )
    core.delete_namespace("team-b")
    assert core.read_namespace("team-b").status.phase == "Terminating"
    with pytest.raises(client.ApiException) as caught:
        core.create_namespaced_config_map(
            "team-b", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "d"}}
        )
    assert caught.value.status == 403
    assert "because it is being terminated" in json.loads(caught.value.body)["message"]
    core.replace_namespace_finalize(
        "team-b",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-b"}, "spec": {"finalizers": []}},
    )
    with pytest.raises(client.ApiException) as gone:
        core.read_namespace("team-b")
    assert gone.value.status == 404


def test_namespace_mismatch_is_bad_request(core: client.CoreV1Api) -> None:
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "other"}}
    with pytest.raises(client.ApiException) as caught:
        core.create_namespaced_config_map("default", body)
    assert caught.value.status == 400


def test_times_are_stored_in_utc_with_z(api_server: Any) -> None:
    """Python clients send ``+00:00`` offsets; the server stores and serves ``Z``."""
    body = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "timed"},
        "spec": {"holderIdentity": "me", "renewTime": "2026-01-01T02:00:00.250000+02:00"},
    }
    request = urllib.request.Request(
        f"{api_server.url}/apis/coordination.k8s.io/v1/namespaces/default/leases",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        created = json.loads(response.read())
    assert created["spec"]["renewTime"] == "2026-01-01T00:00:00.250000Z"
    assert created["metadata"]["creationTimestamp"].endswith("Z")

"""Every served kind through its client API, list selectors, and the test hooks."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from driver.cluster.apiserver import APIServer
from tests.cluster.conftest import claim_body, create_namespaces, pod_body, slice_body

REPO_ROOT = Path(__file__).resolve().parents[2]


def _node(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}}}


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("pool=a", ["n1", "n2"]),
        ("pool==a,zone=z1", ["n1"]),
        ("pool!=a", ["n3", "n4"]),
        ("pool in (a, b)", ["n1", "n2", "n3"]),
        ("pool notin (a)", ["n3", "n4"]),
        ("zone", ["n1", "n3"]),
        ("!zone", ["n2", "n4"]),
        ("pool in (b),zone", ["n3"]),
    ],
)
def test_label_selectors(core: client.CoreV1Api, selector: str, expected: list[str]) -> None:
    core.create_node(_node("n1", {"pool": "a", "zone": "z1"}))
    core.create_node(_node("n2", {"pool": "a"}))
    core.create_node(_node("n3", {"pool": "b", "zone": "z2"}))
    core.create_node(_node("n4"))
    assert [node.metadata.name for node in core.list_node(label_selector=selector).items] == expected


def test_bad_label_selector_is_bad_request(core: client.CoreV1Api) -> None:
    with pytest.raises(client.ApiException) as caught:
        core.list_node(label_selector="pool in a")
    assert caught.value.status == 400


def test_slice_field_selectors(resource: client.ResourceV1Api) -> None:
    resource.create_resource_slice(slice_body("a"))
    resource.create_resource_slice(slice_body("b", nodeName="node2"))
    other = slice_body("c", driver="other.dev")
    resource.create_resource_slice(other)
    mine = resource.list_resource_slice(field_selector="spec.driver=fractional.dev,spec.nodeName=node1")
    assert [item.metadata.name for item in mine.items] == ["a"]
    assert [
        i.metadata.name for i in resource.list_resource_slice(field_selector="spec.nodeName!=node1").items
    ] == ["b"]
    assert [
        i.metadata.name for i in resource.list_resource_slice(field_selector="metadata.name=c").items
    ] == ["c"]


def test_unsupported_field_label_is_bad_request(resource: client.ResourceV1Api) -> None:
    with pytest.raises(client.ApiException) as caught:
        resource.list_resource_slice(field_selector="spec.perDeviceNodeSelection=x")  # spec.pool.name is one
    assert caught.value.status == 400
    assert "field label not supported" in json.loads(caught.value.body)["message"]


def test_pod_field_selectors(core: client.CoreV1Api) -> None:
    create_namespaces(core, "team-a")
    core.create_namespaced_pod("default", pod_body("bound", nodeName="node1"))
    core.create_namespaced_pod("team-a", pod_body("pending"))
    core.patch_namespaced_pod_status("bound", "default", {"status": {"phase": "Running"}})
    on_node = core.list_pod_for_all_namespaces(field_selector="spec.nodeName=node1")
    assert [pod.metadata.name for pod in on_node.items] == ["bound"]
    unbound = core.list_pod_for_all_namespaces(field_selector="spec.nodeName=,status.phase=Pending")
    assert [pod.metadata.name for pod in unbound.items] == ["pending"]
    assert [p.metadata.name for p in core.list_namespaced_pod("team-a").items] == ["pending"]


def test_claims_listed_across_namespaces(core: client.CoreV1Api, resource: client.ResourceV1Api) -> None:
    create_namespaces(core, "team-a", "team-b")
    resource.create_namespaced_resource_claim("team-a", claim_body("a", "team-a"))
    resource.create_namespaced_resource_claim("team-b", claim_body("b", "team-b"))
    listed = resource.list_resource_claim_for_all_namespaces()
    assert [(c.metadata.namespace, c.metadata.name) for c in listed.items] == [
        ("team-a", "a"),
        ("team-b", "b"),
    ]
    assert int(listed.metadata.resource_version) >= 2
    assert [c.metadata.name for c in resource.list_namespaced_resource_claim("team-b").items] == ["b"]


def test_delete_collection_of_slices_by_selector(
    api_server: APIServer, resource: client.ResourceV1Api
) -> None:
    resource.create_resource_slice(slice_body("a"))
    resource.create_resource_slice(slice_body("b", nodeName="node2"))
    resource.delete_collection_resource_slice(field_selector="spec.nodeName=node1")
    assert [item.metadata.name for item in resource.list_resource_slice().items] == ["b"]
    assert api_server.request_count("deletecollection", "resourceslices") == 1


def test_lease_roundtrip(api_client: client.ApiClient) -> None:
    coordination = client.CoordinationV1Api(api_client)
    now = datetime.datetime.now(datetime.UTC)
    lease = client.V1Lease(
        metadata=client.V1ObjectMeta(name="fractional-controller"),
        spec=client.V1LeaseSpec(holder_identity="a", lease_duration_seconds=15, renew_time=now),
    )
    created = coordination.create_namespaced_lease("kube-system", lease)
    created.spec.holder_identity = "b"
    replaced = coordination.replace_namespaced_lease("fractional-controller", "kube-system", created)
    assert replaced.spec.holder_identity == "b"
    created.spec.holder_identity = "c"
    with pytest.raises(client.ApiException) as caught:
        coordination.replace_namespaced_lease("fractional-controller", "kube-system", created)
    assert caught.value.status == 409


def test_events_in_both_groups(api_client: client.ApiClient) -> None:
    core = client.CoreV1Api(api_client)
    events = client.EventsV1Api(api_client)
    core.create_namespaced_event(
        "default",
        {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": "claim-"},
            "involvedObject": {"kind": "ResourceClaim", "name": "claim", "namespace": "default"},
            "reason": "Allocated",
            "type": "Normal",
            "message": "allocated",
        },
    )
    events.create_namespaced_event(
        "default",
        {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"name": "claim.1"},
            "eventTime": "2026-01-01T00:00:00.000000Z",
            "regarding": {"kind": "Pod", "name": "p"},
            "reason": "Waiting",
            "action": "Allocate",
            "type": "Normal",
            "reportingController": "fractional.dev/controller",
            "reportingInstance": "controller-0",
        },
    )
    core_events = core.list_namespaced_event(
        "default", field_selector="involvedObject.name=claim,reason=Allocated"
    )
    assert [event.reason for event in core_events.items] == ["Allocated"]
    # one store, as kube-apiserver has it: each group lists the Events written through either. (A core
    # Event has no eventTime, which the typed client's EventsV1Event refuses: read the JSON.)
    answer = events.list_namespaced_event("default", _preload_content=False)
    listed = {event["reason"]: event for event in json.loads(answer.data)["items"]}
    assert sorted(listed) == ["Allocated", "Waiting"]
    assert listed["Allocated"]["regarding"]["name"] == "claim"
    assert listed["Allocated"]["note"] == "allocated"
    assert listed["Waiting"]["reportingController"] == "fractional.dev/controller"
    assert sorted(event.reason for event in core.list_namespaced_event("default").items) == [
        "Allocated",
        "Waiting",
    ]


def test_device_taint_rule_and_config_map(api_client: client.ApiClient) -> None:
    resource = client.ResourceV1Api(api_client)
    rule = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {"name": "drain-gpu-0"},
        "spec": {
            "deviceSelector": {"driver": "fractional.dev"},
            "taint": {"key": "k", "effect": "NoExecute"},
        },
    }
    assert resource.create_device_taint_rule(rule).spec.taint.effect == "NoExecute"
    core = client.CoreV1Api(api_client)
    core.create_namespaced_config_map(
        "default", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"k": "v"}}
    )
    assert core.read_namespaced_config_map("c", "default").data == {"k": "v"}


def test_provisioning_request_with_status(custom: client.CustomObjectsApi) -> None:
    group, version, plural = "autoscaling.x-k8s.io", "v1", "provisioningrequests"
    body = {
        "apiVersion": f"{group}/{version}",
        "kind": "ProvisioningRequest",
        "metadata": {"name": "gang"},
        "spec": {"provisioningClassName": "check-capacity.autoscaling.x-k8s.io", "podSets": []},
        "status": {"conditions": [{"type": "Provisioned", "status": "True"}]},
    }
    created = custom.create_namespaced_custom_object(group, version, "default", plural, body)
    assert "status" not in created
    condition = {"type": "Provisioned", "status": "True", "reason": "CapacityFound"}
    custom.patch_namespaced_custom_object_status(
        group, version, "default", plural, "gang", {"status": {"conditions": [condition]}}
    )
    read = custom.get_namespaced_custom_object(group, version, "default", plural, "gang")
    assert read["status"]["conditions"] == [condition]
    listed = custom.list_namespaced_custom_object(group, version, "default", plural)
    assert [item["metadata"]["name"] for item in listed["items"]] == ["gang"]
    with pytest.raises(client.ApiException) as caught:
        custom.create_namespaced_custom_object(
            group, version, "default", plural, {**body, "metadata": {"name": "x"}, "spec": None}
        )
    assert caught.value.status == 422


def test_disabled_consumable_capacity_drops_fields_silently() -> None:
    device = {
        "name": "gpu-0",
        "allowMultipleAllocations": True,
        "capacity": {
            "memory": {
                "value": "80Gi",
                "requestPolicy": {"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}},
            }
        },
    }
    with (
        APIServer(disabled_features={"DRAConsumableCapacity"}) as server,
        client.ApiClient(server.configuration()) as api,
    ):
        written = client.ResourceV1Api(api).create_resource_slice(slice_body(devices=[device]))
    assert written.spec.devices[0].allow_multiple_allocations is None
    assert written.spec.devices[0].capacity["memory"].request_policy is None
    assert written.spec.devices[0].capacity["memory"].value == "80Gi"


def test_enabled_gates_keep_consumable_capacity(resource: client.ResourceV1Api) -> None:
    device = {"name": "gpu-0", "allowMultipleAllocations": True, "capacity": {"memory": {"value": "80Gi"}}}
    assert (
        resource.create_resource_slice(slice_body(devices=[device]))
        .spec.devices[0]
        .allow_multiple_allocations
    )


def test_inject_fault_fails_matching_requests_then_recovers(
    api_server: APIServer, resource: client.ResourceV1Api
) -> None:
    resource.create_resource_slice(slice_body())
    api_server.inject_fault("patch", "resourceslices", 409, times=2)
    api_server.inject_fault("get", "resourceslices", 500, name="other")
    for _ in range(2):
        with pytest.raises(client.ApiException) as caught:
            resource.patch_resource_slice("node1-slice", {"metadata": {"labels": {"a": "1"}}})
        assert caught.value.status == 409
    assert resource.patch_resource_slice(
        "node1-slice", {"metadata": {"labels": {"a": "1"}}}
    ).metadata.labels == {"a": "1"}
    assert resource.read_resource_slice("node1-slice").metadata.name == "node1-slice"  # fault is for "other"
    with pytest.raises(client.ApiException) as caught:
        resource.read_resource_slice("other")
    assert caught.value.status == 500
    assert json.loads(caught.value.body)["kind"] == "Status"


def test_inject_fault_on_status_subresource(api_server: APIServer, resource: client.ResourceV1Api) -> None:
    resource.create_namespaced_resource_claim("default", claim_body())
    api_server.inject_fault("patch", "resourceclaims/status", 503)
    with pytest.raises(client.ApiException) as caught:
        resource.patch_namespaced_resource_claim_status("claim", "default", {"status": {}})
    assert caught.value.status == 503
    resource.patch_namespaced_resource_claim("claim", "default", {"metadata": {"labels": {"a": "b"}}})


def test_request_counts_by_verb_and_resource(api_server: APIServer, resource: client.ResourceV1Api) -> None:
    resource.create_namespaced_resource_claim("default", claim_body())
    resource.read_namespaced_resource_claim("claim", "default")
    resource.list_resource_claim_for_all_namespaces()
    resource.patch_namespaced_resource_claim_status("claim", "default", {"status": {}})
    resource.patch_namespaced_resource_claim_status("claim", "default", {"status": {}})
    assert api_server.request_count("create", "resourceclaims") == 1
    assert api_server.request_count("get", "resourceclaims") == 1
    assert api_server.request_count("list", "resourceclaims") == 1
    assert api_server.request_count("patch", "resourceclaims/status") == 2
    assert api_server.request_count("patch") == 2
    assert api_server.request_count(resource="resourceclaims") == 3
    assert api_server.request_count() == 5
    api_server.reset_counts()
    assert api_server.request_count() == 0


def test_discovery_and_kubeconfig(api_server: APIServer, tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    api_server.write_kubeconfig(str(path))
    configuration = client.Configuration()
    config.load_kube_config(config_file=str(path), client_configuration=configuration)
    with client.ApiClient(configuration) as api:
        assert client.VersionApi(api).get_code().minor == "37"
        groups = client.ApisApi(api).get_api_versions()
        assert "resource.k8s.io" in [group.name for group in groups.groups]
        resources = client.ResourceV1Api(api).get_api_resources()
        assert "resourceclaims/status" in [entry.name for entry in resources.resources]


def test_concurrent_writers_never_lose_updates(api_server: APIServer, resource: client.ResourceV1Api) -> None:
    """Read-modify-write with resourceVersion from several threads: 409s are retried, nothing is lost."""
    resource.create_resource_slice(slice_body())

    def bump(times: int) -> None:
        with client.ApiClient(api_server.configuration()) as api:
            mine = client.ResourceV1Api(api)
            for _ in range(times):
                while True:
                    current = mine.read_resource_slice("node1-slice")
                    current.spec.pool.generation += 1
                    try:
                        mine.replace_resource_slice("node1-slice", current)
                        break
                    except client.ApiException as error:
                        assert error.status == 409

    threads = [threading.Thread(target=bump, args=(10,), name=f"writer-{i}") for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert resource.read_resource_slice("node1-slice").spec.pool.generation == 41


def test_cli_apiserver_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    process = subprocess.Popen(
        [sys.executable, "-m", "driver", "apiserver", "--port", "0", "--write-kubeconfig", str(kubeconfig)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        deadline = time.monotonic() + 30
        while not kubeconfig.exists() or not kubeconfig.read_text():
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline, "kubeconfig not written"
            threading.Event().wait(0.05)
        configuration = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        with client.ApiClient(configuration) as api:
            core = client.CoreV1Api(api)
            core.create_node(_node("n1"))
            assert [node.metadata.name for node in core.list_node().items] == ["n1"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for stream in (process.stdout, process.stderr):
            if stream:
                stream.close()


def test_pod_binding_sets_node_once(api_server: APIServer, core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("default", pod_body("p"))
    binding = client.V1Binding(
        metadata=client.V1ObjectMeta(name="p"), target=client.V1ObjectReference(kind="Node", name="node1")
    )
    # the apiserver answers a Status, which the client's V1Binding model cannot parse: read it raw
    response = core.create_namespaced_pod_binding("p", "default", binding, _preload_content=False)
    assert json.loads(response.data)["status"] == "Success"
    pod = core.read_namespaced_pod("p", "default")
    assert pod.spec.node_name == "node1"
    assert [(c.type, c.status) for c in pod.status.conditions] == [("PodScheduled", "True")]
    with pytest.raises(client.ApiException) as caught:
        core.create_namespaced_pod_binding("p", "default", binding)
    assert caught.value.status == 409
    assert api_server.request_count("create", "pods/binding") == 2


def test_gated_pod_cannot_be_bound(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("default", pod_body("p", schedulingGates=[{"name": "fractional.dev/gang"}]))
    binding = client.V1Binding(
        metadata=client.V1ObjectMeta(name="p"), target=client.V1ObjectReference(kind="Node", name="n")
    )
    with pytest.raises(client.ApiException) as caught:
        core.create_namespaced_pod_binding("p", "default", binding)
    assert caught.value.status == 409  # kube-apiserver: Conflict, "pod p has non-empty .spec.schedulingGates"

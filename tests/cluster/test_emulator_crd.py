"""CustomResourceDefinitions in the emulator: Kueue's CRDs served with their schemas (patterns,
enums, x-kubernetes-list-type, CEL rules, defaults), the status subresource, printer columns,
discovery, and deletion taking the objects along. Real HTTP, real kubernetes client."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from driver.cluster.apiserver import APIServer
from driver.cluster.apiserver.crd_schema import python_pattern
from tests.kueue_support import GROUP, VERSION, install_kueue_crds


@pytest.fixture(scope="module")
def kueue_server() -> Iterator[APIServer]:
    with APIServer() as server:
        with client.ApiClient(server.configuration()) as api:
            install_kueue_crds(api)
        yield server


@pytest.fixture
def objects(kueue_server: APIServer) -> Iterator[client.CustomObjectsApi]:
    with client.ApiClient(kueue_server.configuration()) as api:
        yield client.CustomObjectsApi(api)


def _workload(name: str, **spec: Any) -> dict[str, Any]:
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Workload",
        "metadata": {"name": name},
        "spec": {
            "queueName": "team-a",
            "podSets": [
                {
                    "name": "main",
                    "count": 2,
                    "template": {"spec": {"containers": [{"name": "c", "image": "busybox"}]}},
                }
            ],
            **spec,
        },
    }
    return body


def test_go_patterns_are_rewritten_for_python() -> None:
    assert python_pattern("^(?i)[a-z]([-a-z0-9]*[a-z0-9])?$").search("Abc")
    assert python_pattern(r"^[[:alpha:]]+\z").search("abc")
    assert not python_pattern(r"^[[:alpha:]]+\z").search("abc1")


def test_crd_is_established_and_discovered(kueue_server: APIServer, objects: client.CustomObjectsApi) -> None:
    with client.ApiClient(kueue_server.configuration()) as api:
        crd = client.ApiextensionsV1Api(api).read_custom_resource_definition("workloads.kueue.x-k8s.io")
        conditions = {c.type: c.status for c in crd.status.conditions}
        assert conditions["Established"] == "True"
        assert crd.status.stored_versions == ["v1beta2"]
        resources = client.CustomObjectsApi(api).get_api_resources(GROUP, VERSION).to_dict()["resources"]
    by_name = {r["name"]: r for r in resources}
    assert by_name["workloads"]["kind"] == "Workload"
    assert "kwl" in by_name["workloads"]["short_names"]
    assert by_name["workloads/status"]["verbs"] == ["get", "patch", "update"]
    assert by_name["admissionchecks"]["namespaced"] is False


def test_workload_defaults_status_subresource_and_list_map(objects: client.CustomObjectsApi) -> None:
    created = objects.create_namespaced_custom_object(
        GROUP, VERSION, "default", "workloads", {**_workload("wl-1"), "status": {"conditions": []}}
    )
    assert created["spec"]["active"] is True  # default: true
    assert "status" not in created  # the status subresource drops status on create
    status = {
        "admissionChecks": [
            {
                "name": "fractional",
                "state": "Pending",
                "message": "",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }
        ]
    }
    updated = objects.patch_namespaced_custom_object_status(
        GROUP, VERSION, "default", "workloads", "wl-1", {"status": status}
    )
    assert updated["status"]["admissionChecks"][0]["state"] == "Pending"
    duplicate = {"admissionChecks": status["admissionChecks"] * 2}
    with pytest.raises(ApiException) as error:
        objects.patch_namespaced_custom_object_status(
            GROUP, VERSION, "default", "workloads", "wl-1", {"status": duplicate}
        )
    assert error.value.status == 422
    assert "status.admissionChecks[1]" in json.loads(error.value.body)["message"]
    bad_state = {"admissionChecks": [{**status["admissionChecks"][0], "state": "Maybe"}]}
    with pytest.raises(ApiException) as error:
        objects.patch_namespaced_custom_object_status(
            GROUP, VERSION, "default", "workloads", "wl-1", {"status": bad_state}
        )
    assert "Unsupported value" in json.loads(error.value.body)["message"]
    # a write to the main resource keeps the status
    spec_change = objects.patch_namespaced_custom_object(
        GROUP, VERSION, "default", "workloads", "wl-1", {"spec": {"priority": 5}, "status": None}
    )
    assert spec_change["status"]["admissionChecks"][0]["state"] == "Pending"
    assert spec_change["metadata"]["generation"] == 2


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"queueName": "Not_A_Name!"}, "spec.queueName"),  # pattern
        ({"podSets": []}, "spec.podSets"),  # minItems
        (
            {"podSets": [{"name": "main", "count": "two", "template": {"spec": {"containers": []}}}]},
            "spec.podSets[0].count",
        ),  # type
    ],
)
def test_schema_violations_name_the_field(
    objects: client.CustomObjectsApi, change: dict[str, Any], field: str
) -> None:
    with pytest.raises(ApiException) as error:
        objects.create_namespaced_custom_object(
            GROUP, VERSION, "default", "workloads", _workload("bad", **change)
        )
    assert error.value.status == 422
    assert field in json.loads(error.value.body)["message"]


def test_unknown_fields_are_pruned_or_refused_when_strict(kueue_server: APIServer) -> None:
    with client.ApiClient(kueue_server.configuration()) as api:
        objects = client.CustomObjectsApi(api)
        created = objects.create_cluster_custom_object(
            GROUP,
            VERSION,
            "resourceflavors",
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "ResourceFlavor",
                "metadata": {"name": "gpu"},
                "spec": {"nodeLabels": {"pool": "gpu"}, "bogus": 1},
            },
        )
        assert "bogus" not in created["spec"]
        with pytest.raises(ApiException) as error:
            objects.create_cluster_custom_object(
                GROUP,
                VERSION,
                "resourceflavors",
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": "ResourceFlavor",
                    "metadata": {"name": "gpu2"},
                    "spec": {"bogus": 1},
                },
                field_validation="Strict",
            )
        assert error.value.status == 400
        assert 'unknown field "spec.bogus"' in json.loads(error.value.body)["message"]


def test_cel_rule_of_the_crd_is_enforced(objects: client.CustomObjectsApi) -> None:
    check = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "AdmissionCheck",
        "metadata": {"name": "ac-cel"},
        "spec": {"controllerName": "fractional.dev/placement"},
    }
    objects.create_cluster_custom_object(GROUP, VERSION, "admissionchecks", check)
    with pytest.raises(ApiException) as error:  # controllerName is immutable (x-kubernetes-validations)
        objects.patch_cluster_custom_object(
            GROUP, VERSION, "admissionchecks", "ac-cel", {"spec": {"controllerName": "other"}}
        )
    assert error.value.status == 422


def test_printer_columns_in_tables(kueue_server: APIServer, objects: client.CustomObjectsApi) -> None:
    objects.create_namespaced_custom_object(GROUP, VERSION, "default", "workloads", _workload("wl-table"))
    request = urllib.request.Request(
        f"{kueue_server.url}/apis/{GROUP}/{VERSION}/namespaces/default/workloads",
        headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:  # loopback
        table = json.loads(response.read())
    names = [c["name"] for c in table["columnDefinitions"]]
    assert names[:3] == ["Name", "Queue", "Reserved in"]
    row = next(r for r in table["rows"] if r["cells"][0] == "wl-table")
    assert row["cells"][1] == "team-a"


def test_deleting_the_crd_stops_serving_and_removes_objects() -> None:
    with APIServer() as server, client.ApiClient(server.configuration()) as api:
        install_kueue_crds(api, ("resourceflavors",))
        objects = client.CustomObjectsApi(api)
        objects.create_cluster_custom_object(
            GROUP,
            VERSION,
            "resourceflavors",
            {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceFlavor", "metadata": {"name": "f"}},
        )
        assert server.object_count("resourceflavors") == 1
        client.ApiextensionsV1Api(api).delete_custom_resource_definition("resourceflavors.kueue.x-k8s.io")
        assert server.object_count("resourceflavors") == 0
        with pytest.raises(ApiException) as error:
            objects.list_cluster_custom_object(GROUP, VERSION, "resourceflavors")
        assert error.value.status == 404


KUBECTL = Path(sys.prefix) / "bin" / "kubectl"


@pytest.mark.skipif(not KUBECTL.exists(), reason="kubectl is installed with the dev extra")
def test_kubectl_applies_lists_and_explains_custom_resources(kueue_server: APIServer, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kueue_server.write_kubeconfig(str(kubeconfig))
    examples = Path(__file__).resolve().parents[2] / "examples" / "kueue"

    def kubectl(*args: str) -> str:
        done = subprocess.run(
            [str(KUBECTL), "--kubeconfig", str(kubeconfig), *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "created" in kubectl("apply", "-f", str(examples / "local-queue.yaml"))
    listed = kubectl("get", "lq", "-A")  # short name, printer columns
    assert listed.split("\n")[0].split() == [
        "NAMESPACE",
        "NAME",
        "CLUSTERQUEUE",
        "PENDING",
        "WORKLOADS",
        "ADMITTED",
        "WORKLOADS",
    ]
    assert "gpu-cluster-queue" in listed
    assert "borrowing cohort" in kubectl("explain", "clusterqueue.spec.cohortName")  # the CRD's OpenAPI

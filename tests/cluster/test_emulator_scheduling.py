"""The gang API as each release serves it: versions, the official schemas (pods too),
immutability, and 1.37's mutable minCount; through the real client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from driver.cluster.apiserver import APIServer
from driver.controller.gangs.api import discover_gang_api

GROUP = "scheduling.k8s.io"


@pytest.fixture(params=["1.35", "1.36", "1.37"])
def server(request: pytest.FixtureRequest) -> Iterator[APIServer]:
    with APIServer(kubernetes_version=request.param) as api_server:
        yield api_server


def _post(server: APIServer, api: client.ApiClient, path: str, body: dict[str, Any]) -> tuple[int, str]:
    response = api.rest_client.pool_manager.request(
        "POST",
        server.url + path,
        body=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    return int(response.status), response.data.decode()


def _pod(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "image": "x"}], **spec},
    }


def test_each_release_serves_its_own_version_and_pod_fields(server: APIServer) -> None:
    api = client.ApiClient(server.configuration())
    try:
        release = server.kubernetes_version
        found = discover_gang_api(api)
        expected = {
            "1.35": ("v1alpha1", {"workloads"}),
            "1.36": ("v1alpha2", {"workloads", "podgroups"}),
            "1.37": ("v1beta1", {"workloads", "podgroups"}),
        }[release]
        assert (found.version, {kind.value for kind, _ in found.resources}) == expected
        pods = "/api/v1/namespaces/default/pods?fieldValidation=Strict"
        old_pod = _post(server, api, pods, _pod(workloadRef={"name": "w", "podGroup": "g"}))
        new_pod = _post(
            server, api, pods, {**_pod(schedulingGroup={"podGroupName": "g"}), "metadata": {"name": "q"}}
        )
        # No alpha is carried forward: 1.35 knows only workloadRef, 1.36+ only schedulingGroup.
        assert (old_pod[0], new_pod[0]) == ((201, 400) if release == "1.35" else (400, 201)), (
            old_pod,
            new_pod,
        )
        gone = {"1.35": "v1alpha2", "1.36": "v1alpha1", "1.37": "v1alpha2"}[release]
        status, _ = _post(server, api, f"/apis/{GROUP}/{gone}/namespaces/default/workloads", {})
        assert status == 404
    finally:
        api.close()


@pytest.mark.parametrize("server", ["1.36", "1.37"], indirect=True)
def test_podgroup_spec_is_immutable_but_1_37_scales_min_count(server: APIServer) -> None:
    api = client.ApiClient(server.configuration())
    custom = client.CustomObjectsApi(api)
    version = "v1alpha2" if server.kubernetes_version == "1.36" else "v1beta1"
    try:
        body = {
            "apiVersion": f"{GROUP}/{version}",
            "kind": "PodGroup",
            "metadata": {"name": "pg"},
            "spec": {"schedulingPolicy": {"gang": {"minCount": 2}}},
        }
        condition = {"type": "PodGroupScheduled", "status": "True", "reason": "Scheduled", "message": ""}
        condition["lastTransitionTime"] = "2026-01-01T00:00:00Z"
        written = {**body, "status": {"conditions": [condition]}}
        created = custom.create_namespaced_custom_object(GROUP, version, "default", "podgroups", written)
        assert "status" not in created or not created["status"]  # status only through /status
        with pytest.raises(client.ApiException) as unknown:
            custom.create_namespaced_custom_object(
                GROUP,
                version,
                "default",
                "podgroups",
                {
                    **body,
                    "metadata": {"name": "bad"},
                    "spec": {"schedulingPolicy": {"gang": {"minCount": 2, "minMember": 2}}},
                },
            )
        assert unknown.value.status == 422 and "minMember" in str(unknown.value.body)

        def change(path: tuple[str, ...], value: Any) -> int:
            current = custom.get_namespaced_custom_object(GROUP, version, "default", "podgroups", "pg")
            target = current["spec"]
            for key in path[:-1]:
                target = target.setdefault(key, {})
            target[path[-1]] = value
            try:
                custom.replace_namespaced_custom_object(GROUP, version, "default", "podgroups", "pg", current)
            except client.ApiException as error:
                return int(error.status)
            return 200

        scaled = change(("schedulingPolicy", "gang", "minCount"), 3)
        assert scaled == (200 if server.kubernetes_version == "1.37" else 422)
        assert change(("schedulingConstraints", "topology"), [{"key": "rack"}]) == 422
    finally:
        api.close()

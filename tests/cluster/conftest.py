"""Fixtures for the emulator tests: typed API objects bound to the ``api_server`` fixture."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from driver.cluster.apiserver import APIServer


@pytest.fixture
def api_client(api_server: APIServer) -> Iterator[client.ApiClient]:
    with client.ApiClient(api_server.configuration()) as api:
        yield api


@pytest.fixture
def core(api_client: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api_client)


@pytest.fixture
def resource(api_client: client.ApiClient) -> client.ResourceV1Api:
    return client.ResourceV1Api(api_client)


@pytest.fixture
def custom(api_client: client.ApiClient) -> client.CustomObjectsApi:
    """Untyped access: lets tests send fields the typed models would refuse client-side."""
    return client.CustomObjectsApi(api_client)


def create_namespaces(core: client.CoreV1Api, *names: str) -> None:
    """Namespaces a test writes into (beyond the system ones, which exist from the start)."""
    for name in names:
        core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})


def slice_body(
    name: str = "node1-slice", *, devices: list[dict[str, Any]] | None = None, **spec: Any
) -> dict[str, Any]:
    """A valid ResourceSlice; ``spec`` entries override or add fields."""
    body: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": "fractional.dev",
            "nodeName": "node1",
            "pool": {"name": "node1", "generation": 1, "resourceSliceCount": 1},
            "devices": devices
            if devices is not None
            else [
                {
                    "name": "gpu-0",
                    "attributes": {"uuid": {"string": "GPU-0"}},
                    "capacity": {"memory": {"value": "80Gi"}},
                }
            ],
        },
    }
    body["spec"].update(spec)
    return body


def claim_body(name: str = "claim", namespace: str = "default") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "fractional.dev"}}]}
        },
    }


def pod_body(name: str = "pod", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "main", "image": "busybox"}], **spec},
    }

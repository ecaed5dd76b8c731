"""A small fake cluster in the API emulator, and the controller run in-process as threads."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from driver.cluster.apiserver import APIServer
from driver.config import ControllerConfig
from driver.controller import (
    FINALIZER,
    GANG_LABEL,
    GANG_SIZE_ANNOTATION,
    GATE,
    Controller,
    ReconcilerSettings,
)
from driver.controller.loop.run import run_controller
from driver.controller.writes.writer import WriteHook
from driver.inventory.fake import load_profile, resolve_profile
from driver.slices import build_device_classes, build_resource_slices

NAMESPACE = "default"
T = 20.0  # generous deadline for polls on a loaded 2-core machine


def wait_for(predicate: Callable[[], Any], timeout: float = T, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def gpu_claim(name: str, *, memory: str | None = "12Gi", compute: int | None = 15, count: int = 1,
              nvlink: bool = False) -> dict[str, Any]:  # fmt: skip
    exactly: dict[str, Any] = {"deviceClassName": "gpu.fractional.dev"}
    requests = {}
    if memory:
        requests["memory"] = memory
    if compute is not None:
        requests["compute"] = str(compute)
    if requests:
        exactly["capacity"] = {"requests": requests}
    if count != 1:
        exactly["count"] = count
    spec: dict[str, Any] = {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}
    if nvlink:
        spec["devices"]["constraints"] = [{"matchAttribute": "fractional.dev/nvlinkDomain"}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }


def gated_pod(name: str, claims: list[str], *, gang: str | None = None, size: int | None = None,
              cpu: str = "1", templates: list[str] | None = None) -> dict[str, Any]:  # fmt: skip
    metadata: dict[str, Any] = {"name": name, "namespace": NAMESPACE, "labels": {}}
    if gang:
        metadata["labels"][GANG_LABEL] = gang
        metadata["annotations"] = {GANG_SIZE_ANNOTATION: str(size or 1)}
    entries = [{"name": f"c{i}", "resourceClaimName": c} for i, c in enumerate(claims)]
    entries += [{"name": f"t{i}", "resourceClaimTemplateName": t} for i, t in enumerate(templates or ())]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "schedulingGates": [{"name": GATE}],
            "resourceClaims": entries,
            "containers": [
                {
                    "name": "main",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {
                        "requests": {"cpu": cpu, "memory": "1Gi"},
                        "claims": [{"name": e["name"]} for e in entries],
                    },
                }
            ],
        },
    }


def _body(response: Any) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(response.data)
    return result


@dataclass
class Cluster:
    server: APIServer
    kubeconfig: Path
    api_client: client.ApiClient
    nodes: list[str] = field(default_factory=list)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api_client)

    @property
    def resource(self) -> client.ResourceV1Api:
        return client.ResourceV1Api(self.api_client)

    def add_node(self, name: str, profile: str, *, cpu: str = "64", pods: str = "110") -> None:
        inventory = load_profile(resolve_profile(profile), node_name=name)
        allocatable = {"cpu": cpu, "memory": "512Gi", "pods": pods}
        labels = {"kubernetes.io/hostname": name, **dict(inventory.labels)}
        self.core.create_node({
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "status": {"allocatable": allocatable, "capacity": allocatable},
        })  # fmt: skip
        for s in build_resource_slices(inventory):
            self.resource.create_resource_slice(s)
        self.nodes.append(name)
        # A real kube-apiserver taints a new Node not-ready (TaintNodesByCondition) until
        # kube-controller-manager lifts it, about 2 s later for a Node no kubelet reports on. The
        # tests' nodes are ready ones: a gang decided in between is held with an Event, and every
        # write the tests count comes one later. The emulator never taints.
        wait_for(lambda: not self.not_ready(name), what=f"node {name} without the not-ready taint")

    def not_ready(self, name: str) -> bool:
        taints = self.core.read_node(name).spec.taints or ()
        return any(t.key == "node.kubernetes.io/not-ready" for t in taints)

    def add_classes(self) -> None:
        for device_class in build_device_classes():
            self.resource.create_device_class(device_class)

    def create_claim(self, claim: dict[str, Any]) -> dict[str, Any]:
        return _body(self.resource.create_namespaced_resource_claim(NAMESPACE, claim, _preload_content=False))

    def post_raw(self, path: str, text: str) -> tuple[int, bytes]:
        """POST a JSON text as written (the client's own serializer recurses: no deep bodies) over
        the client's own connection pool; returns (status, the answer undecoded: it may be deep)."""
        response = self.api_client.rest_client.pool_manager.request(
            "POST", self.server.url + path, body=text.encode(), headers={"Content-Type": "application/json"},
            timeout=T,
        )  # fmt: skip
        return int(response.status), bytes(response.data)

    def create_claim_text(self, text: str) -> tuple[int, bytes]:
        return self.post_raw(f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims", text)

    def create_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        return _body(self.core.create_namespaced_pod(NAMESPACE, pod, _preload_content=False))

    def claim(self, name: str) -> dict[str, Any] | None:
        try:
            return _body(
                self.resource.read_namespaced_resource_claim(name, NAMESPACE, _preload_content=False)
            )
        except client.ApiException as error:
            if error.status == 404:
                return None
            raise

    def pod(self, name: str) -> dict[str, Any]:
        return _body(self.core.read_namespaced_pod(name, NAMESPACE, _preload_content=False))

    def claims(self) -> list[dict[str, Any]]:
        body = _body(self.resource.list_namespaced_resource_claim(NAMESPACE, _preload_content=False))
        return list(body["items"])

    def events(self) -> list[dict[str, Any]]:
        return list(_body(self.core.list_namespaced_event(NAMESPACE, _preload_content=False))["items"])

    def ungated(self, name: str) -> bool:
        return not any(g["name"] == GATE for g in self.pod(name)["spec"].get("schedulingGates") or ())

    def allocated(self, name: str) -> bool:
        claim = self.claim(name)
        return bool(claim and (claim.get("status") or {}).get("allocation"))

    def has_finalizer(self, name: str) -> bool:
        claim = self.claim(name)
        return bool(claim and FINALIZER in (claim["metadata"].get("finalizers") or ()))


@pytest.fixture
def cluster(api_server: APIServer, kubeconfig_file: Path) -> Iterator[Cluster]:
    with client.ApiClient(api_server.configuration()) as api_client:
        c = Cluster(server=api_server, kubeconfig=kubeconfig_file, api_client=api_client)
        c.add_classes()
        yield c


@dataclass
class RunningController:
    stop: threading.Event
    thread: threading.Thread
    started: threading.Event
    result: list[int]

    def shutdown(self, timeout: float = T) -> int | None:
        self.stop.set()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "controller did not stop"
        return self.result[0] if self.result else None


def start_controller(
    cluster: Cluster, *, write_hook: WriteHook | None = None, **overrides: Any
) -> RunningController:
    config = ControllerConfig(kubeconfig=str(cluster.kubeconfig), metrics_port=0, **overrides)
    stop, started, result = threading.Event(), threading.Event(), []

    def target() -> None:
        result.append(run_controller(config, stop, write_hook=write_hook, started=started))

    thread = threading.Thread(
        target=target, name=f"test-controller-{overrides.get('identity', '')}", daemon=True
    )
    thread.start()
    return RunningController(stop=stop, thread=thread, started=started, result=result)


@pytest.fixture
def controller(cluster: Cluster) -> Iterator[Callable[..., RunningController]]:
    running: list[RunningController] = []

    def factory(**kwargs: Any) -> RunningController:
        instance = start_controller(cluster, **kwargs)
        running.append(instance)
        return instance

    yield factory
    for instance in running:
        with contextlib.suppress(AssertionError):
            instance.shutdown()


@pytest.fixture
def fenced(cluster: Cluster) -> Iterator[Controller]:
    """A controller replica that lost its lease (its successor leads): it must write nothing."""
    instance = Controller(configuration=cluster.server.configuration(), settings=ReconcilerSettings())
    instance.fence.set()
    instance.start()
    try:
        yield instance
    finally:
        instance.stop()

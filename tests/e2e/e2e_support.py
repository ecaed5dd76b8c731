"""kubectl-driven helpers for the end-to-end tests, on any real cluster with the driver installed.

``make e2e`` runs them on the local cluster of upstream binaries (``hack/localcluster``; KUBECONFIG
is set to ``.cluster/kubeconfig``) or on the cluster ``KUBECONFIG`` names; ``make kind-e2e`` on the
kind cluster of ``make kind-up``. Everything goes through ``kubectl`` (the context
``FRACTIONAL_E2E_CONTEXT`` when set, else the kubeconfig's current one when KUBECONFIG is set, else
``kind-fractional-dra``), so the tests exercise the cluster exactly as a user would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "AUTO_GATE_LABEL",
    "CONTEXT",
    "DRIVER",
    "DRIVER_IMAGE",
    "IMAGE",
    "LOCAL_CLUSTER",
    "KubectlError",
    "REPO_ROOT",
    "apply",
    "cdi_files",
    "cluster_problem",
    "get",
    "kubectl",
    "list_items",
    "node_dir",
    "node_key",
    "pod",
    "pod_env",
    "wait_for",
]

CONTEXT: str | None = os.environ.get("FRACTIONAL_E2E_CONTEXT") or (
    None if os.environ.get("KUBECONFIG") else "kind-fractional-dra"
)
# The local cluster (hack/localcluster): its nodes' directories are on this machine.
LOCAL_CLUSTER = os.environ.get("FRACTIONAL_E2E_LOCAL_CLUSTER") == "1"
IMAGE = os.environ.get("FRACTIONAL_E2E_IMAGE", "busybox:1.36")
# The driver's image: what `make image` builds and `make image-test` ran, loaded by kind-up and by
# the local cluster (podman names it localhost/fractional-dra:dev).
DRIVER_IMAGE = os.environ.get(
    "FRACTIONAL_E2E_DRIVER_IMAGE", "localhost/fractional-dra:dev" if LOCAL_CLUSTER else "fractional-dra:dev"
)
DRIVER = "fractional.dev"
# A namespace or pod labelled with it (value "disabled") is left alone by the chart's gate policy.
AUTO_GATE_LABEL = "fractional.dev/auto-gate"

T = TypeVar("T")


class KubectlError(RuntimeError):
    pass


def kubectl(*args: str, stdin: str | None = None, timeout: float = 60) -> str:
    command = ["kubectl", *(("--context", CONTEXT) if CONTEXT else ()), *args]
    done = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise KubectlError(f"{' '.join(command)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def cluster_problem() -> str | None:
    """Why the e2e tests cannot run here, or None when the kind cluster and the driver are there."""
    if shutil.which("kubectl") is None:
        return "kubectl is not installed"
    try:
        kubectl("get", "--raw", "/readyz", timeout=15)
    except (KubectlError, subprocess.TimeoutExpired) as error:
        return (
            f"no reachable cluster in kubectl context {CONTEXT or 'of KUBECONFIG'} (run `make e2e`): {error}"
        )
    try:
        kubectl("get", "deviceclass", "gpu.fractional.dev", "-o", "name", timeout=15)
    except KubectlError as error:
        return f"fractional-dra is not installed in {CONTEXT or 'the cluster'} (run `make e2e`): {error}"
    return None


REPO_ROOT = Path(__file__).resolve().parents[2]


def node_key(node: str) -> str:
    """The local cluster's name for a node's directory and processes (``node-198-18-0-2``)."""
    return "node-" + node.replace(".", "-")


def node_dir(node: str) -> Path:
    """A node's own directory on this machine (the local cluster only): its ``cdi/`` is the node's
    ``/var/run/cdi`` and its ``kubelet/`` the node's ``/var/lib/kubelet``."""
    return REPO_ROOT / ".cluster" / "nodes" / node_key(node)


def cdi_files(node: str) -> set[str]:
    """Names of our CDI spec files on ``node`` (``k8s.fractional.dev-<class>_<claimUID>.json``)."""
    if LOCAL_CLUSTER:
        return {p.name for p in (node_dir(node) / "cdi").glob("k8s.fractional.dev-*")}
    # kind's node containers: docker's, or podman's (hack/kind-e2e.sh exports KIND_PROVIDER).
    engine = os.environ.get("KIND_PROVIDER", "docker")
    listed = subprocess.run(
        [engine, "exec", node, "sh", "-c", "ls /var/run/cdi"], capture_output=True, text=True, check=False
    )
    return {name for name in listed.stdout.split() if name.startswith("k8s.fractional.dev-")}


def apply(objects: list[dict[str, Any]], namespace: str) -> None:
    kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}),
    )


def get(resource: str, name: str, namespace: str | None = None) -> dict[str, Any]:
    args = ["get", resource, name, "-o", "json"]
    if namespace:
        args += ["-n", namespace]
    loaded: dict[str, Any] = json.loads(kubectl(*args))
    return loaded


def list_items(resource: str, *args: str) -> list[dict[str, Any]]:
    loaded = json.loads(kubectl("get", resource, "-o", "json", *args))
    items: list[dict[str, Any]] = loaded["items"]
    return items


def wait_for(predicate: Callable[[], T | None], *, timeout: float, what: str, interval: float = 2.0) -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    last_error: Exception | None = None
    while True:
        try:
            result = predicate()
            if result:
                return result
        except KubectlError as error:  # e.g. not created yet
            last_error = error
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout:.0f}s waiting for {what} (last error: {last_error})"
            )
        pause.wait(interval)


def pod(
    name: str,
    claims: dict[str, dict[str, str]],
    *,
    command: str = "env; exec sleep 3600",
    node: str | None = None,
    gang: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """A pod with one container that uses every claim; ``claims`` maps pod claim name to its source."""
    metadata: dict[str, Any] = {"name": name}
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "resourceClaims": [{"name": claim, **source} for claim, source in claims.items()],
        "containers": [
            {
                "name": "main",
                "image": IMAGE,
                "command": ["sh", "-c", command],
                "resources": {"claims": [{"name": claim} for claim in claims]},
            }
        ],
    }
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    if gang:
        metadata["labels"] = {"fractional.dev/gang": gang[0]}
        metadata["annotations"] = {"fractional.dev/gang-size": str(gang[1])}
        spec["schedulingGates"] = [{"name": "fractional.dev/allocation"}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def pod_env(name: str, namespace: str) -> dict[str, str]:
    """The environment the container printed (its command starts with ``env``)."""
    env = {}
    for line in kubectl("logs", "-n", namespace, name, "-c", "main").splitlines():
        key, sep, value = line.partition("=")
        if sep and key.isidentifier():
            env[key] = value
    return env

"""The driver installed into the local cluster as users install it: ``helm install`` of
``charts/fractional-dra`` with real Helm (the Helm SDK behind ``helm_python``), from the image
``make image`` builds, with fake devices (each node's profile from its ``fractional.dev/fake-profile``
label), the agent and the controller on the host network, reaching the apiserver at 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

from localcluster.cluster import PROFILE_LABEL, REPO_ROOT, Binaries, ClusterError, LocalCluster
from localcluster.node import kubectl_command

__all__ = [
    "NAMESPACE",
    "RELEASE",
    "chart_values",
    "install_driver",
    "reload_driver",
    "uninstall_driver",
    "upgrade_driver",
    "wait_for_driver",
]

RELEASE = "fractional-dra"
NAMESPACE = "fractional-system"
CHART = REPO_ROOT / "charts" / "fractional-dra"


def chart_values(cluster: LocalCluster, **overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "image": {"repository": "localhost/fractional-dra", "tag": "dev", "pullPolicy": "Never"},
        "fakeDevices": {"enabled": True, "profile": "h100-8x", "profileNodeLabel": PROFILE_LABEL},
        "agent": {"hostNetwork": True},
        "controller": {"hostNetwork": True},
        "apiServer": {"host": "127.0.0.1", "port": str(cluster.ports["apiserver"])},
        "logFormat": "text",
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key] = {**values[key], **value}
        else:
            values[key] = value
    return values


def _helm(cluster: LocalCluster) -> Any:
    import helm_python as helm  # the venv's Helm SDK (a test dependency)

    return helm.Config(kubeconfig_path=str(cluster.kubeconfig), namespace=NAMESPACE)


def install_driver(cluster: LocalCluster, **overrides: Any) -> None:
    helm = _helm(cluster)
    try:
        helm.install(
            str(CHART), RELEASE, chart_values(cluster, **overrides), namespace=NAMESPACE,
            create_namespace=True, wait="watcher", timeout=300,
        )  # fmt: skip
    finally:
        helm.close()
    wait_for_driver(cluster)


def upgrade_driver(cluster: LocalCluster, **overrides: Any) -> None:
    """``helm upgrade`` with the local cluster's values and ``overrides`` (a rolling update when the
    pods' template changes)."""
    helm = _helm(cluster)
    try:
        helm.upgrade(
            str(CHART), RELEASE, chart_values(cluster, **overrides), namespace=NAMESPACE,
            wait="watcher", timeout=300,
        )  # fmt: skip
    finally:
        helm.close()


def uninstall_driver(cluster: LocalCluster) -> None:
    helm = _helm(cluster)
    try:
        helm.uninstall(RELEASE, wait="watcher", timeout=180, ignore_not_found=True)
    finally:
        helm.close()


def reload_driver(cluster: LocalCluster, binaries: Binaries) -> None:
    """Rebuild the image, import it into every node, and restart the agent and the controller."""
    from localcluster.images import load_images

    load_images(cluster, binaries, cluster.nodes, with_driver=True)
    kubectl = kubectl_command(cluster)
    selector = ["-n", NAMESPACE, "-l", "app.kubernetes.io/part-of=fractional-dra"]
    for kind in ("daemonset", "deployment"):
        subprocess.run([*kubectl, "rollout", "restart", kind, *selector], check=True)
        subprocess.run([*kubectl, "rollout", "status", kind, *selector, "--timeout=180s"], check=True)


def wait_for_driver(cluster: LocalCluster, timeout_seconds: float = 180.0) -> None:
    """Until every node has published our slices (the agents registered and ran)."""
    kubectl = kubectl_command(cluster)
    deadline = time.monotonic() + timeout_seconds
    nodes: set[str] = set()
    while time.monotonic() < deadline:
        done = subprocess.run(
            [*kubectl, "get", "resourceslices", "-o", "json"], capture_output=True, text=True
        )
        if done.returncode == 0:
            items = json.loads(done.stdout)["items"]
            nodes = {i["spec"].get("nodeName") for i in items if i["spec"].get("driver") == "fractional.dev"}
            if nodes >= {n.name for n in cluster.nodes}:
                return
        time.sleep(1)
    raise ClusterError(f"the driver published slices for {sorted(nodes)} only after {timeout_seconds:.0f}s")

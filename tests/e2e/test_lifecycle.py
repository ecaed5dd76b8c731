"""The driver's own lifecycle on the local cluster: a rolling ``helm upgrade`` under running shares,
then ``helm uninstall`` leaving no slices, sockets or CDI files behind (then the driver is put back).

These change the installation itself, so they run on the local cluster of ``make e2e`` only (or
where ``FRACTIONAL_E2E_LIFECYCLE=1`` says the cluster may be changed); they run after
``test_driver.py`` (file order).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_support import (
    DRIVER,
    LOCAL_CLUSTER,
    REPO_ROOT,
    get,
    kubectl,
    list_items,
    node_dir,
    wait_for,
)
from test_driver import _claim_of_pod, running, start_share

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        not (LOCAL_CLUSTER or os.environ.get("FRACTIONAL_E2E_LIFECYCLE") == "1"),
        reason="changes the installation: local cluster only (or FRACTIONAL_E2E_LIFECYCLE=1)",
    ),
]

sys.path.insert(0, str(REPO_ROOT / "hack"))


@pytest.fixture
def local() -> Iterator[Any]:
    from localcluster.cluster import LocalCluster

    yield LocalCluster()


def _agents() -> list[dict[str, Any]]:
    return list_items("pods", "-n", "fractional-system", "-l", "app.kubernetes.io/component=agent")


def test_a_rolling_upgrade_keeps_running_shares_and_serves_new_ones(namespace: str, local: Any) -> None:
    from localcluster.driver import NAMESPACE, upgrade_driver

    start_share("steady", namespace, memory="5Gi", compute="5")
    before = {p["metadata"]["uid"] for p in _agents()}
    upgrade_driver(local, logLevel="debug")
    kubectl("rollout", "status", "daemonset", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=agent",
            "--timeout=300s", timeout=320)  # fmt: skip
    after = {p["metadata"]["uid"] for p in _agents()}
    assert not before & after, "every agent pod was replaced by the upgrade"
    assert running("steady", namespace)
    start_share("fresh", namespace, memory="5Gi", compute="5")


def test_uninstall_leaves_no_slices_sockets_or_cdi_files(namespace: str, local: Any) -> None:
    from localcluster.driver import install_driver, uninstall_driver

    start_share("last", namespace, memory="3Gi")
    uid = _claim_of_pod("last", namespace)["metadata"]["uid"]
    node = get("pod", "last", namespace)["spec"]["nodeName"]
    # Workloads go first (their claims are unprepared by the agents), as the docs tell users.
    for other in list_items("namespaces"):
        name = other["metadata"]["name"]
        if name.startswith("e2e-"):
            kubectl("delete", "pods", "--all", "-n", name, "--wait=true", timeout=180)
    assert not (node_dir(node) / "cdi" / f"k8s.fractional.dev-gpu_{uid}.json").exists()
    uninstall_driver(local)
    try:
        wait_for(
            lambda: not list_items("resourceslices", "--field-selector", f"spec.driver={DRIVER}"),
            timeout=120,
            what="our ResourceSlices gone",
        )
        for spec in local.nodes:
            base = node_dir(spec.name)
            leftovers = [
                *(base / "cdi").glob("k8s.fractional.dev-*"),
                *(base / "kubelet" / "plugins_registry").glob("*fractional*"),
                *(base / "kubelet" / "plugins" / DRIVER).glob("*.sock"),
            ]
            assert not leftovers, f"{spec.name}: {leftovers}"
        assert not list_items("deviceclasses", "-l", "app.kubernetes.io/part-of=fractional-dra")
    finally:
        install_driver(local)

"""A node group of the local cluster (``python hack/localcluster nodegroup``), as a cloud provider
grows one for cluster-autoscaler: a real kubelet node joins with its providerID and group label, the
chart's DaemonSet starts our agent there, its ResourceSlices are published complete (what
cluster-autoscaler waits for before it counts a new node as ready), and deleting the node takes its
slices with it. The time from the request to a Ready node with its slices is printed (``-s``)."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest
from e2e_support import DRIVER, LOCAL_CLUSTER, REPO_ROOT, list_items, wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not LOCAL_CLUSTER, reason="node groups are the local cluster harness's"),
]

GROUP = "l4-group"
GROUP_LABEL = "fractional.dev/node-group"


def nodegroup(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "hack" / "localcluster"), "nodegroup", *args],
        capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
    )  # fmt: skip


def _group_nodes() -> list[dict[str, Any]]:
    return list_items("nodes", "-l", f"{GROUP_LABEL}={GROUP}")


def test_a_node_group_grows_by_a_real_node_with_our_slices_and_shrinks_again() -> None:
    before = {n["metadata"]["name"] for n in list_items("nodes")}
    names: list[str] = []
    try:
        grown = nodegroup("grow", GROUP, "1", "--profile", "l4-2x", "--max", "1")
        assert grown.returncode == 0, grown.stderr[-3000:]
        joined = re.findall(r"(\S+) joined l4-group with its ResourceSlices in ([0-9.]+)s", grown.stdout)
        assert len(joined) == 1, grown.stdout
        name, seconds = joined[0]
        names.append(name)
        print(f"\nnode group: {name} Ready with its ResourceSlices {seconds} s after the request")
        refused = nodegroup("grow", GROUP, "1", "--profile", "l4-2x", "--max", "1")
        assert refused.returncode == 1 and "exceeds its maximum 1" in refused.stderr

        (node,) = _group_nodes()
        assert node["metadata"]["name"] == name and name not in before
        assert node["spec"]["providerID"] == f"fractional-local://{GROUP}/{name}"
        assert node["metadata"]["labels"]["fractional.dev/fake-profile"] == "l4-2x"
        agents = [
            p
            for p in list_items("pods", "-A", "-l", "app.kubernetes.io/component=agent")
            if p["spec"].get("nodeName") == name
        ]
        assert len(agents) == 1 and agents[0]["status"]["phase"] == "Running"
        slices = [s for s in list_items("resourceslices") if s["spec"].get("nodeName") == name]
        assert slices and all(s["spec"]["driver"] == DRIVER for s in slices)
        devices = [d for s in slices for d in s["spec"].get("devices") or ()]
        assert len([d for d in devices if d["name"].startswith("gpu-")]) == 2  # l4-2x
        owners = {o["kind"] for s in slices for o in s["metadata"].get("ownerReferences") or ()}
        assert owners == {"Node"}
    finally:
        if names:
            deleted = nodegroup("delete", GROUP, *names)
            assert deleted.returncode == 0, deleted.stderr[-3000:]
    wait_for(lambda: not _group_nodes() or None, timeout=60, what="the group's node deleted")
    wait_for(
        lambda: not [s for s in list_items("resourceslices") if s["spec"].get("nodeName") in names] or None,
        timeout=120, what="its ResourceSlices gone with it (owned by the Node)",
    )  # fmt: skip
    assert {n["metadata"]["name"] for n in list_items("nodes")} == before

"""The fleet of fake GPU nodes on the local cluster (``python hack/localcluster fleet up N``): kwok
keeps the fleet's Nodes Ready and runs the pods bound there, our controller places gated pods on
them as on any node, the real kubelets' Nodes are left as they were, and ``fleet down`` leaves
nothing behind. Builds kwok (``COMPONENTS=kwok hack/upstream-build.sh``, about 2 minutes) when it
is not cached."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from e2e_support import LOCAL_CLUSTER, REPO_ROOT, apply, kubectl, list_items, pod, wait_for
from test_driver import gpu_request, template

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not LOCAL_CLUSTER, reason="the fleet is the local cluster harness's"),
]

FLEET = 40
PODS = 24  # 12Gi / 15 % each: 6 to a GPU, half a node
FLEET_LABEL = "fractional.dev/fleet"
TOLERATION = {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}


def fleet(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "hack" / "localcluster"), "fleet", *args],
        capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _nodes(selector: str) -> list[dict[str, Any]]:
    return list_items("nodes", "-l", selector)


def _ready(node: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions") or ())


def _manager_argv() -> list[str]:
    state = json.loads((REPO_ROOT / ".cluster" / "state.json").read_text(encoding="utf-8"))
    entries = state["processes"] if isinstance(state, dict) and "processes" in state else state
    return next(e["argv"] for e in entries if e["name"] == "kube-controller-manager")


def test_a_fleet_of_fake_gpu_nodes_comes_and_goes(user_namespace: str) -> None:
    real_before = {n["metadata"]["name"]: n["metadata"].get("labels") for n in _nodes(f"!{FLEET_LABEL}")}
    try:
        said = fleet("up", str(FLEET))
        assert f"{FLEET} ResourceSlices published for {FLEET} nodes" in said

        def ready() -> list[dict[str, Any]] | None:
            found = _nodes(FLEET_LABEL)
            return found if len(found) == FLEET and all(_ready(n) for n in found) else None

        nodes = wait_for(ready, timeout=120, what="the fleet Ready")
        # kwok's taint alone: admission's not-ready one is lifted (no node-lifecycle controller would)
        assert all([t["key"] for t in n["spec"]["taints"]] == ["kwok.x-k8s.io/node"] for n in nodes)
        assert "--controllers=*,-node-lifecycle-controller" in _manager_argv()
        real_after = {n["metadata"]["name"]: n["metadata"].get("labels") for n in _nodes(f"!{FLEET_LABEL}")}
        assert real_after == real_before  # kwok took no real kubelet's node
        assert all(_ready(n) for n in _nodes(f"!{FLEET_LABEL}"))

        apply([template("share", [gpu_request(memory="12Gi", compute="15")])], user_namespace)
        pods = []
        for index in range(PODS):
            item = pod(f"f-{index:02d}", {"gpu": {"resourceClaimTemplateName": "share"}})
            item["spec"]["nodeSelector"] = {FLEET_LABEL: "kwok"}
            item["spec"]["tolerations"] = [
                {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}
            ]
            pods.append(item)
        apply(pods, user_namespace)

        def running() -> list[dict[str, Any]] | None:
            found = list_items("pods", "-n", user_namespace)
            done = [p for p in found if p["status"].get("phase") == "Running"]
            return found if len(done) == PODS else None

        placed = wait_for(running, timeout=300, what=f"{PODS} pods Running on the fleet")
        hosts = {p["spec"]["nodeName"] for p in placed}
        assert all(host.startswith("kwok-") for host in hosts)
        assert len(hosts) == 1, hosts  # packed: 6 shares to a GPU, 8 GPUs to a node (24 pods: one node)
        claims = list_items("resourceclaims", "-n", user_namespace)
        assert all(c["status"]["allocation"] for c in claims) and len(claims) == PODS
        kubectl("delete", "pods", "--all", "-n", user_namespace, "--wait=true", timeout=180)
    finally:
        fleet("down")
    assert _nodes(FLEET_LABEL) == []
    pools = {s["spec"].get("nodeName") for s in list_items("resourceslices")}
    assert not any((n or "").startswith("kwok-") for n in pools)
    assert "--controllers=*,-node-lifecycle-controller" not in _manager_argv()

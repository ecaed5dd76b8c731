"""A gang that fits nowhere, on the real components: our controller writes its ProvisioningRequest,
a stand-in for cluster-autoscaler 1.36's processing (hack/localcluster/autoscaler.py) grows a node
group of the local cluster (hack/localcluster/nodegroups.py) by real kubelet nodes, our agent
publishes their slices, the gang is placed across the old and new nodes and the request is deleted.
Then a group at its maximum: ``Provisioned=False`` (``CapacityIsNotFound``), and no second request.

The chart runs with ``controller.provisioningRequests.enabled`` and cluster-autoscaler's CRD (from
its API module, as Kueue requires it); the group starts with one node, which cluster-autoscaler
copies for new ones (from zero it sees no devices)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_support import LOCAL_CLUSTER, REPO_ROOT, apply, kubectl, list_items, pod, wait_for
from test_driver import gpu_request, template

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not LOCAL_CLUSTER, reason="node groups are the local cluster harness's"),
]

GROUP = "l4-auto"
GROUP_LABEL = "fractional.dev/node-group"


@pytest.fixture(scope="module")
def groups(real_cluster: None) -> Iterator[Any]:
    import sys

    sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "hack")]
    from localcluster.autoscaler import AutoscalerDouble
    from localcluster.cluster import Binaries, LocalCluster
    from localcluster.driver import upgrade_driver
    from localcluster.nodegroups import NodeGroup, NodeGroupProvider, wait_joined

    from driver.kube.client import load_configuration
    from tests.go_modules import provisioning_request_crd_path

    local = LocalCluster()
    crd = provisioning_request_crd_path()
    kubectl("apply", "--server-side", "-f", str(crd), timeout=60)
    kubectl("wait", "--for=condition=Established", "crd/provisioningrequests.autoscaling.x-k8s.io",
            "--timeout=60s", timeout=70)  # fmt: skip
    provider = NodeGroupProvider(
        local, Binaries.build(local.version, "node"), [NodeGroup(GROUP, "l4-2x", min_size=1, max_size=2)]
    )
    seed = provider.increase_size(GROUP, 1)
    try:
        wait_joined(provider, GROUP, seed, timeout_seconds=300)
        upgrade_driver(local, controller={"provisioningRequests": {"enabled": True, "retrySeconds": 5},
                                          "hintProfiles": ["l4-2x"]})  # fmt: skip
        kubectl("rollout", "status", "deployment", "-n", "fractional-system", "-l",
                "app.kubernetes.io/component=controller", "--timeout=300s", timeout=320)  # fmt: skip
        configuration = load_configuration(str(local.kubeconfig))
        with AutoscalerDouble(configuration, provider, scan_seconds=2.0, initial_backoff=10.0) as double:
            yield provider, double
    finally:
        names = [i.node.name for i in provider.instances(GROUP)]
        if names:
            provider.delete_nodes(GROUP, names)
        upgrade_driver(local)


def _requests(namespace: str) -> list[dict[str, Any]]:
    return list_items("provisioningrequests.autoscaling.x-k8s.io", "-n", namespace)


def _conditions(request: dict[str, Any]) -> dict[str, str]:
    return {
        c["type"]: f"{c['status']}/{c['reason']}"
        for c in (request.get("status") or {}).get("conditions") or ()
    }


def _gang(name: str, pods: int, namespace: str) -> None:
    objects: list[dict[str, Any]] = [template("whole", [gpu_request()])]
    for index in range(pods):
        item = pod(f"{name}-{index}", {"gpu": {"resourceClaimTemplateName": "whole"}})
        item["metadata"].setdefault("labels", {})["fractional.dev/gang"] = name
        item["metadata"].setdefault("annotations", {})["fractional.dev/gang-size"] = str(pods)
        item["spec"]["nodeSelector"] = {GROUP_LABEL: GROUP}  # only the group's nodes will do
        item["spec"]["tolerations"] = [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
        objects.append(item)
    apply(objects, namespace)


def test_a_gang_that_fits_nowhere_grows_the_group_and_is_placed(groups: Any, user_namespace: str) -> None:
    provider, double = groups
    started = time.monotonic()
    _gang("grow", 3, user_namespace)  # three whole L4s: two on the group's node, one on a new one
    (request,) = wait_for(
        lambda: _requests(user_namespace) or None, timeout=120, what="our ProvisioningRequest"
    )
    assert [s["count"] for s in request["spec"]["podSets"]] == [1, 1, 1]
    podsets = [kubectl("get", "podtemplate", s["podTemplateRef"]["name"], "-n", user_namespace, "-o", "json")
               for s in request["spec"]["podSets"]]  # fmt: skip
    claims = {json.loads(t)["template"]["spec"]["resourceClaims"][0]["resourceClaimName"] for t in podsets}
    generated = {c["metadata"]["name"] for c in list_items("resourceclaims", "-n", user_namespace)}
    assert claims == generated and len(claims) == 3  # each pod's own generated claim, by name

    def running() -> list[dict[str, Any]] | None:
        found = list_items("pods", "-n", user_namespace)
        return (
            found if len(found) == 3 and all(p["status"].get("phase") == "Running" for p in found) else None
        )

    placed = wait_for(running, timeout=600, what="the gang Running on the grown group")
    took = time.monotonic() - started
    hosts = {p["spec"]["nodeName"] for p in placed}
    assert len(hosts) == 2 and len(provider.instances(GROUP)) == 2, hosts
    print(f"\nautoscaling: gang of 3 Running {took:.0f} s after it was created (a node added on request)")
    wait_for(
        lambda: not _requests(user_namespace) or None, timeout=120, what="the request deleted once placed"
    )
    assert not double.errors, double.errors
    kubectl("delete", "pods", "--all", "-n", user_namespace, "--wait=true", timeout=180)


def test_a_group_at_its_maximum_is_not_found_and_not_asked_twice(groups: Any, user_namespace: str) -> None:
    provider, double = groups
    assert provider.target_size(GROUP) == 2  # its maximum
    _gang("toobig", 6, user_namespace)  # four GPUs in the group at most

    def answered() -> list[dict[str, Any]] | None:
        found = [r for r in _requests(user_namespace) if "Provisioned" in _conditions(r)]
        return found or None

    (request,) = wait_for(answered, timeout=180, what="cluster-autoscaler's answer")
    assert _conditions(request)["Provisioned"] == "False/CapacityIsNotFound"
    time.sleep(15)  # its backoff passes and it looks again: still the one request, still gated
    assert [r["metadata"]["name"] for r in _requests(user_namespace)] == [request["metadata"]["name"]]
    assert all(p["spec"].get("schedulingGates") for p in list_items("pods", "-n", user_namespace))
    events = list_items("events", "-n", user_namespace)
    assert any("CapacityIsNotFound" in (e.get("message") or "") for e in events)
    assert not double.errors, double.errors


def test_a_node_whose_agent_never_publishes_is_waited_for_not_asked_for_twice(
    groups: Any, user_namespace: str
) -> None:
    """The group's next node comes Ready, but our agent there cannot start (its fake profile names
    none), so its slices never appear. Seen with the real cluster-autoscaler 1.36.1: it counts the
    node as unready, still coming, and books the request's pods onto it; the booking expires, we ask
    again, and within its --max-node-provision-time (15 minutes by default, more than the 10 of a
    booking) it finds that same node and adds none. The gang waits, and ``fractional why`` names the
    node. (Past that time it gives the node up and grows the group again:
    tests/controller/test_autoscaling.py.)"""
    import subprocess
    import sys

    from localcluster.nodegroups import NodeGroup

    provider, double = groups
    provider.replace_group(NodeGroup(GROUP, "no-such-profile", min_size=1, max_size=4))
    double.booking_seconds = 20.0  # cluster-autoscaler's 10 minutes, shortened
    free = 2 * provider.target_size(GROUP)  # every L4 of the group is free again
    _gang("dark", free + 1, user_namespace)

    def second_attempt() -> dict[str, Any] | None:
        found = [r for r in _requests(user_namespace) if "-a1-" in r["metadata"]["name"]]
        return found[0] if found and "Provisioned" in _conditions(found[0]) else None

    again = wait_for(second_attempt, timeout=300, what="the request made again after the booking expired")
    assert _conditions(again)["Provisioned"] == "True/CapacityIsFound"  # the dark node counts as coming
    dark = [i for i in provider.instances(GROUP) if i.node.profile == "no-such-profile"]
    assert len(dark) == 1 and provider.target_size(GROUP) == free // 2 + 1  # one node added, not two
    assert all(p["spec"].get("schedulingGates") for p in list_items("pods", "-n", user_namespace))
    why = subprocess.run(
        [sys.executable, "-m", "driver", "why", f"{user_namespace}/dark-0"],
        capture_output=True, text=True, timeout=60, check=True, cwd=REPO_ROOT,
    ).stdout  # fmt: skip
    assert f"{dark[0].node.name} (Ready, no fractional.dev devices published" in why, why
    assert not double.errors, double.errors

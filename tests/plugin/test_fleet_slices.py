"""The fleet of fake nodes (hack/localcluster/fleet.py): each node's slices are what its agent
would publish, and kwok is pointed at the fleet's nodes alone, never at a real kubelet's."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from driver.plugin.agent import NodeAgent
from tests.plugin.conftest import PROFILE

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "hack"))

from localcluster.cluster import DEFAULT_NODES
from localcluster.fleet import (
    FLEET_LABEL,
    FLEET_SELECTOR,
    FleetError,
    create_nodes,
    fleet_node,
    is_fleet_node,
    kwok_argv,
    node_names,
    publish_slices,
)

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)


def _pool(api: client.ApiClient, node: str) -> list[dict[str, Any]]:
    listed = client.ResourceV1Api(api).list_resource_slice(field_selector=f"spec.nodeName={node}")
    return [api.sanitize_for_serialization(item) for item in listed.items]


def _comparable(item: dict[str, Any], node: str) -> dict[str, Any]:
    """A slice with what the server assigns dropped and the node's name made neutral."""
    metadata = item["metadata"]
    owners = [{k: v for k, v in o.items() if k != "uid"} for o in metadata.get("ownerReferences") or ()]
    text = repr({"spec": item["spec"], "owners": owners, "labels": metadata.get("labels")})
    return {"slice": text.replace(node, "NODE")}


def test_a_fleet_nodes_slices_are_what_its_agent_publishes(
    start_agent: Callable[..., NodeAgent], kube_configuration: client.Configuration
) -> None:
    agent_node, fleet_name = "fleet-agent-node", "kwok-00000"
    with client.ApiClient(kube_configuration) as api:
        core = client.CoreV1Api(api)
        assert create_nodes(core, [fleet_node(n, PROFILE, cpu="8", memory="64Gi", pods="110")
                                   for n in (agent_node, fleet_name)]) == 2  # fmt: skip
        start_agent(publish_slices=True, config={"node_name": agent_node})
        deadline = time.monotonic() + 30
        while not _pool(api, agent_node) and time.monotonic() < deadline:
            time.sleep(0.1)
        published = _pool(api, agent_node)
        assert published, "the agent published no slice"
        assert publish_slices(kube_configuration, [fleet_name], PROFILE) == len(published)
        fleet = _pool(api, fleet_name)
        assert sorted(map(str, (_comparable(s, fleet_name) for s in fleet))) == sorted(
            map(str, (_comparable(s, agent_node) for s in published))
        )
        owner = fleet[0]["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"]) == ("Node", fleet_name)  # deleted with its Node
        # published again (a second `fleet up`): nothing changes
        assert publish_slices(kube_configuration, [fleet_name], PROFILE) == len(published)
        assert [s["metadata"]["resourceVersion"] for s in _pool(api, fleet_name)] == [
            s["metadata"]["resourceVersion"] for s in fleet
        ]


def test_the_not_ready_taint_admission_gives_a_new_node_is_lifted(
    kube_configuration: client.Configuration,
) -> None:
    """kube-apiserver's TaintNodesByCondition admission taints every new Node not-ready, and the
    node-lifecycle controller that would lift it is off for the fleet: a pod tolerating kwok's taint
    alone stayed Pending on a real control plane until the fleet set its taints itself."""
    node = fleet_node("kwok-00002", PROFILE, cpu="8", memory="64Gi", pods="110")
    not_ready = {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}
    admitted = {**node, "spec": {"taints": [*node["spec"]["taints"], not_ready]}}
    with client.ApiClient(kube_configuration) as api:
        core = client.CoreV1Api(api)
        core.create_node(admitted)
        assert create_nodes(core, [node]) == 0  # there already, as a fleet node
        taints = [t.to_dict() for t in core.read_node("kwok-00002").spec.taints]
        assert [(t["key"], t["effect"]) for t in taints] == [("kwok.x-k8s.io/node", "NoSchedule")]


def test_a_real_node_of_the_same_name_is_never_taken_over(kube_configuration: client.Configuration) -> None:
    with client.ApiClient(kube_configuration) as api:
        core = client.CoreV1Api(api)
        core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "kwok-00001"}})
        with pytest.raises(FleetError, match="kwok-00001 exists and is not a fleet node"):
            create_nodes(core, [fleet_node("kwok-00001", PROFILE, cpu="8", memory="64Gi", pods="110")])
        labels = core.read_node("kwok-00001").metadata.labels or {}
        assert FLEET_LABEL not in labels


def test_kwok_keeps_the_fleets_nodes_only(tmp_path: Path) -> None:
    argv = kwok_argv(tmp_path / "kwok", tmp_path / "kubeconfig", [tmp_path / "node-initialize.yaml"])
    assert "--manage-all-nodes=false" in argv
    assert f"--manage-nodes-with-label-selector={FLEET_SELECTOR}" in argv
    assert not any(a.startswith(("--manage-single-node", "--manage-nodes-with-annotation")) for a in argv)
    assert "--node-lease-duration-seconds=0" in argv  # no leases at thousands of nodes
    node = fleet_node("kwok-00000", PROFILE, cpu="8", memory="64Gi", pods="110")
    assert is_fleet_node(node) and node["spec"]["taints"][0]["effect"] == "NoSchedule"
    # The local cluster's kubelets register without the fleet's label.
    from localcluster.node import kubelet_node_labels

    for spec in DEFAULT_NODES:
        assert FLEET_LABEL not in kubelet_node_labels(spec)


def test_fleet_node_names_sort_in_order_and_a_fleet_has_nodes() -> None:
    names = node_names(12000)
    assert names[:2] == ["kwok-00000", "kwok-00001"] and names == sorted(names) and len(set(names)) == 12000
    with pytest.raises(FleetError, match="nodes: must be at least 1"):
        node_names(0)

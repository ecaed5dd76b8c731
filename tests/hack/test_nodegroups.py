"""The local cluster's node groups (hack/localcluster/nodegroups.py) without starting a node: the
bookkeeping a cloud provider keeps for cluster-autoscaler, and what a node of a group registers
with. ``tests/e2e/test_nodegroups_real.py`` starts real ones."""

from __future__ import annotations

import ipaddress
import sys
import threading
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "hack"))

from localcluster.cluster import DEFAULT_NODES, LocalCluster, NodeSpec  # noqa: E402
from localcluster.node import _cni_config, _kubelet_config, bridge_name, kubelet_node_labels  # noqa: E402
from localcluster.nodegroups import (  # noqa: E402
    GROUP_LABEL,
    NodeGroup,
    NodeGroupError,
    NodeGroupProvider,
    parse_provider_id,
    provider_id,
)


@pytest.fixture
def cluster(tmp_path: Path) -> LocalCluster:
    made = LocalCluster(state_dir=tmp_path / "state")
    made.ports = {"apiserver": 6443}
    return made


def provider(
    cluster: LocalCluster, started: list[list[NodeSpec]], *, fail: bool = False,
    registered: set[str] | None = None,
) -> NodeGroupProvider:  # fmt: skip
    def start(nodes: list[NodeSpec]) -> None:
        if fail:
            raise RuntimeError("containerd did not open its socket")
        cluster.add_nodes(nodes)
        started.append(nodes)

    groups = [NodeGroup("h100", "h100-8x", max_size=3), NodeGroup("l4", "l4-2x", max_size=1)]
    return NodeGroupProvider(
        cluster, binaries=None, groups=groups, start_nodes=start,  # type: ignore[arg-type]
        registered_nodes=lambda: registered if registered is not None else set(),
    )  # fmt: skip


def wait(predicate: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_group_grows_to_its_maximum_and_no_further(cluster: LocalCluster) -> None:
    started: list[list[NodeSpec]] = []
    groups = provider(cluster, started)
    added = groups.increase_size("h100", 2)
    assert [i.state for i in added] == ["creating", "creating"]  # answered before the nodes start
    assert groups.target_size("h100") == 2
    wait(lambda: len(started) == 1)
    (nodes,) = started
    addresses = [ipaddress.ip_address(n.ip) for n in nodes]
    assert len(set(addresses)) == 2
    assert all(a in ipaddress.ip_network("198.18.1.0/24") for a in addresses)  # clear of the first nodes
    assert not {n.ip for n in nodes} & {n.ip for n in DEFAULT_NODES}
    assert len({n.pod_cidr for n in (*DEFAULT_NODES, *nodes)}) == len(DEFAULT_NODES) + 2
    for node in nodes:
        assert node.profile == "h100-8x"
        assert parse_provider_id(node.provider_id) == ("h100", node.ip)
        assert node.taints == (("nvidia.com/gpu", "present", "NoSchedule"),)  # the agent tolerates it
        assert groups.group_for_node(node.provider_id) == NodeGroup("h100", "h100-8x", max_size=3)
    with pytest.raises(NodeGroupError, match="exceeds its maximum 3"):
        groups.increase_size("h100", 2)
    groups.increase_size("h100", 1)
    with pytest.raises(NodeGroupError, match="no node group 'a100'"):
        groups.increase_size("a100", 1)
    assert groups.group_for_node("aws:///us-east-1a/i-0abc") is None


def test_a_replaced_group_starts_its_next_nodes_from_the_new_spec(cluster: LocalCluster) -> None:
    started: list[list[NodeSpec]] = []
    groups = provider(cluster, started)
    (first,) = groups.increase_size("l4", 1)
    with pytest.raises(NodeGroupError, match="exceeds its maximum 1"):
        groups.increase_size("l4", 1)
    groups.replace_group(NodeGroup("l4", "nope", max_size=2))  # a template whose agent cannot start
    (second,) = groups.increase_size("l4", 1)
    wait(lambda: len(started) == 2)
    assert [first.node.profile, second.node.profile] == ["l4-2x", "nope"]
    assert groups.target_size("l4") == 2
    with pytest.raises(NodeGroupError, match="no node group 'other'"):
        groups.replace_group(NodeGroup("other", "l4-2x"))


def test_decreasing_the_target_size_gives_up_only_nodes_not_registered(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cluster-autoscaler reverts a scale-up that timed out by decreasing the target size; its
    contract: never an existing node. Seen with a node that registered but never published."""
    started: list[list[NodeSpec]] = []
    registered: set[str] = set()
    groups = provider(cluster, started, registered=registered)
    stopped: list[str] = []
    monkeypatch.setattr("localcluster.node.stop_node", lambda _cluster, node: stopped.append(node.name))
    monkeypatch.setattr("localcluster.nodegroups.subprocess.run", lambda *a, **k: None)
    first, second = groups.increase_size("h100", 2)
    wait(lambda: len(started) == 1)
    registered.add(first.node.name)  # its kubelet registered it; the other never came
    with pytest.raises(NodeGroupError, match="1 node\\(s\\) not registered yet"):
        groups.decrease_target_size("h100", -2)
    assert groups.target_size("h100") == 2 and not stopped
    groups.decrease_target_size("h100", -1)
    assert stopped == [second.node.name] and groups.target_size("h100") == 1
    with pytest.raises(NodeGroupError, match="must be negative"):
        groups.decrease_target_size("h100", 1)


def test_a_node_that_does_not_start_is_reported_on_its_instance(cluster: LocalCluster) -> None:
    groups = provider(cluster, [], fail=True)
    (instance,) = groups.increase_size("l4", 1)
    wait(lambda: instance.error)
    assert "containerd did not open its socket" in groups.instances("l4")[0].error


def test_a_node_of_a_group_registers_with_its_provider_id_and_labels(cluster: LocalCluster) -> None:
    node = NodeSpec("198.18.1.12", "l4-2x", "10.245.12.0/24", provider_id=provider_id("l4", "198.18.1.12"),
                    labels=((GROUP_LABEL, "l4"),))  # fmt: skip
    cluster.add_nodes([node])
    config = _kubelet_config(cluster, node)
    assert config["providerID"] == "fractional-local://l4/198.18.1.12"
    assert "registerWithTaints" not in config
    tainted = NodeSpec(
        "198.18.1.13", "l4-2x", "10.245.13.0/24", taints=(("nvidia.com/gpu", "present", "NoSchedule"),)
    )
    assert _kubelet_config(cluster, tainted)["registerWithTaints"] == [
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    ]
    assert kubelet_node_labels(node) == {"fractional.dev/fake-profile": "l4-2x", GROUP_LABEL: "l4"}
    assert "providerID" not in _kubelet_config(cluster, DEFAULT_NODES[0])
    # Its bridge is named by its address: the first nodes' names, by place, do not shift.
    assert bridge_name(cluster, node) == "frng12"
    assert [bridge_name(cluster, n) for n in DEFAULT_NODES] == ["frbr0", "frbr1"]
    bridges = [_cni_config(cluster, n)["plugins"][0]["bridge"] for n in cluster.nodes]  # type: ignore[index]
    assert len(set(bridges)) == len(bridges) and all(len(b) <= 15 for b in bridges)  # IFNAMSIZ


def test_the_cluster_remembers_the_nodes_that_joined(cluster: LocalCluster) -> None:
    """``make cluster-down`` (a new process) must stop them too, and a provider made later knows them."""
    started: list[list[NodeSpec]] = []
    groups = provider(cluster, started)
    groups.increase_size("h100", 1)
    wait(lambda: started)
    again = LocalCluster(state_dir=cluster.state_dir)
    assert again.nodes == (*DEFAULT_NODES, *started[0])
    later = NodeGroupProvider(again, binaries=None, groups=groups.groups())  # type: ignore[arg-type]
    assert [i.state for i in later.instances("h100")] == ["running"]
    again.forget_node(started[0][0])
    assert LocalCluster(state_dir=cluster.state_dir).nodes == DEFAULT_NODES


def test_concurrent_growth_gives_distinct_addresses(cluster: LocalCluster) -> None:
    started: list[list[NodeSpec]] = []
    groups = provider(cluster, started)
    groups._groups["h100"] = NodeGroup("h100", "h100-8x", max_size=40)
    threads = [threading.Thread(target=groups.increase_size, args=("h100", 2)) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wait(lambda: sum(len(n) for n in started) == 20)
    assert len({n.ip for nodes in started for n in nodes}) == 20

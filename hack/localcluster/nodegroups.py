"""Node groups of the local cluster that grow and shrink on request: what a cloud provider does for
cluster-autoscaler, here with real kubelet nodes (test infrastructure for the autoscaler boundary).

A group has a name, a fake GPU profile and a minimum and maximum size. ``increase_size`` adds nodes
as cluster-autoscaler's cloud providers do: at once it records them as instances being created and
returns, then each node is started on a thread of its own (its certificates, address, containerd,
the images, its kubelet), as ``up`` starts the first ones. A node of a group registers with
``spec.providerID`` ``fractional-local://<group>/<address>`` and the labels
``fractional.dev/node-group`` and ``fractional.dev/fake-profile``, and the taint
``nvidia.com/gpu=present:NoSchedule`` (the chart's agent tolerates it, other pods must): the chart's
DaemonSet starts our agent there, which publishes the profile's ResourceSlices. ``delete_nodes``
stops a node and deletes its Node object; ``instances`` reports each one as creating, running
(its Node Ready) or deleting, and the error that stopped one from starting.

Its addresses are 198.18.1.10 and up (the first nodes are 198.18.0.x), its pod networks
10.245.<n>.0/24. Everything it starts is the cluster's: ``make cluster-down`` stops it too.
"""

from __future__ import annotations

import json
import logging
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from localcluster.cluster import Binaries, ClusterError, LocalCluster, NodeSpec

__all__ = [
    "GPU_TAINT",
    "GROUP_LABEL",
    "PROVIDER",
    "Instance",
    "NodeGroup",
    "NodeGroupError",
    "NodeGroupProvider",
    "parse_provider_id",
    "provider_id",
    "published",
    "wait_joined",
]

log = logging.getLogger(__name__)

PROVIDER = "fractional-local"
GROUP_LABEL = "fractional.dev/node-group"
FIRST_HOST = 10  # 198.18.1.10: clear of the first nodes' 198.18.0.x
LAST_HOST = 250


class NodeGroupError(RuntimeError):
    """A request the group cannot meet (an unknown group, its maximum size, a node not its own)."""


GPU_TAINT = ("nvidia.com/gpu", "present", "NoSchedule")  # what GPU node groups commonly carry


@dataclass(frozen=True, slots=True)
class NodeGroup:
    name: str
    profile: str  # a shipped fake profile (fake_devices/<profile>.yaml)
    min_size: int = 0
    max_size: int = 4
    # The taints its nodes register with: by default the GPU taint, which the chart's agent
    # tolerates and other pods (our controller's among them) do not.
    taints: tuple[tuple[str, str, str], ...] = (GPU_TAINT,)


@dataclass
class Instance:
    """A node of a group as the provider sees it (cluster-autoscaler's ``Instance``)."""

    provider_id: str
    node: NodeSpec
    state: str = "creating"  # creating, running, deleting
    error: str = ""
    asked_at: float = field(default_factory=time.monotonic)
    ready_after: float | None = None  # seconds from the request to a Ready Node


def provider_id(group: str, ip: str) -> str:
    return f"{PROVIDER}://{group}/{ip}"


def parse_provider_id(text: str) -> tuple[str, str] | None:
    """(group, address) of one of ours; None for any other providerID."""
    prefix = f"{PROVIDER}://"
    if not text.startswith(prefix):
        return None
    group, _, ip = text[len(prefix) :].partition("/")
    return (group, ip) if group and ip else None


class NodeGroupProvider:
    def __init__(
        self,
        cluster: LocalCluster,
        binaries: Binaries,
        groups: Sequence[NodeGroup],
        *,
        start_nodes: Callable[[list[NodeSpec]], None] | None = None,
        registered_nodes: Callable[[], set[str]] | None = None,
    ) -> None:
        """``start_nodes``: how nodes are started (the default starts real ones; tests of the
        bookkeeping alone pass their own); ``registered_nodes``: the names of the cluster's Nodes
        (the default asks the apiserver)."""
        self._cluster = cluster
        self._binaries = binaries
        self._groups = {g.name: g for g in groups}
        self._lock = threading.Lock()
        self._starting = threading.Lock()  # one start at a time: they change the cluster's records
        self._instances: dict[str, Instance] = {}
        self._start_nodes = start_nodes or self._start_real_nodes
        self._registered_nodes = registered_nodes or (lambda: _node_names(cluster))
        for node in cluster.nodes:  # nodes of a group started earlier (another process): still ours
            parsed = parse_provider_id(node.provider_id)
            if parsed and parsed[0] in self._groups:
                self._instances[node.provider_id] = Instance(node.provider_id, node, state="running")

    @property
    def cluster(self) -> LocalCluster:
        return self._cluster

    # -- what cluster-autoscaler asks --------------------------------------------------------------

    def groups(self) -> list[NodeGroup]:
        return list(self._groups.values())

    def group_for_node(self, node_provider_id: str) -> NodeGroup | None:
        parsed = parse_provider_id(node_provider_id)
        return self._groups.get(parsed[0]) if parsed else None

    def target_size(self, group: str) -> int:
        self._group(group)
        with self._lock:
            return sum(1 for i in self._instances.values() if self._in(i, group) and i.state != "deleting")

    def instances(self, group: str) -> list[Instance]:
        self._group(group)
        with self._lock:
            return [i for i in self._instances.values() if self._in(i, group)]

    def increase_size(self, group: str, delta: int) -> list[Instance]:
        """Add ``delta`` nodes (started in the background); refuses beyond the group's maximum."""
        spec = self._group(group)
        if delta <= 0:
            raise NodeGroupError(f"increase_size: delta must be positive, got {delta}")
        with self._lock:
            size = sum(1 for i in self._instances.values() if self._in(i, group) and i.state != "deleting")
            if size + delta > spec.max_size:
                raise NodeGroupError(
                    f"node group {group}: size {size} + {delta} exceeds its maximum {spec.max_size}"
                )
            added = [self._new_instance(spec) for _ in range(delta)]
        threading.Thread(target=self._start, args=(added,), name=f"grow-{group}", daemon=True).start()
        return added

    def delete_nodes(self, group: str, names: Sequence[str]) -> None:
        """Stop the named nodes of ``group`` and delete their Node objects."""
        self._group(group)
        with self._lock:
            chosen = [i for i in self._instances.values() if self._in(i, group) and i.node.name in names]
            if len(chosen) != len(set(names)):
                raise NodeGroupError(f"node group {group}: not all of {sorted(names)} are its nodes")
            for instance in chosen:
                instance.state = "deleting"
        from localcluster.node import kubectl_command, stop_node

        for instance in chosen:
            stop_node(self._cluster, instance.node)
            subprocess.run(
                [*kubectl_command(self._cluster), "delete", "node", instance.node.name, "--ignore-not-found",
                 "--wait=false"],
                capture_output=True, check=False,
            )  # fmt: skip
            subprocess.run(["ip", "addr", "del", f"{instance.node.ip}/32", "dev", "lo"], capture_output=True)
            self._cluster.forget_node(instance.node)
            with self._lock:
                self._instances.pop(instance.provider_id, None)

    def decrease_target_size(self, group: str, delta: int) -> None:
        """Give up ``-delta`` nodes asked for that have not registered (cluster-autoscaler reverts
        a timed-out scale-up so); never a node that registered, as its contract says: then refused."""
        self._group(group)
        if delta >= 0:
            raise NodeGroupError(f"decrease_target_size: delta must be negative, got {delta}")
        registered = self._registered_nodes()
        with self._lock:
            unregistered = [
                i for i in self._instances.values()
                if self._in(i, group) and i.state == "creating" and i.node.name not in registered
            ]  # fmt: skip
        if len(unregistered) < -delta:
            raise NodeGroupError(
                f"node group {group}: {len(unregistered)} node(s) not registered yet; decreasing the "
                f"target size by {-delta} would delete registered nodes"
            )
        self.delete_nodes(group, [i.node.name for i in unregistered[delta:]])

    def replace_group(self, group: NodeGroup) -> None:
        """Change a group's spec for the nodes it starts from now on (as a cloud's node template is
        edited): its profile, sizes and taints. Its running nodes stay as they are; a smaller
        maximum than its size only refuses growth."""
        self._group(group.name)
        with self._lock:
            self._groups[group.name] = group

    def refresh(self) -> None:
        """Mark the instances whose Node is Ready as running (cluster-autoscaler calls Refresh each loop)."""
        ready = _ready_nodes(self._cluster)
        now = time.monotonic()
        with self._lock:
            for instance in self._instances.values():
                if instance.state == "creating" and instance.node.name in ready:
                    instance.state = "running"
                    instance.ready_after = now - instance.asked_at

    # -- the nodes -----------------------------------------------------------------------------------

    def _group(self, name: str) -> NodeGroup:
        group = self._groups.get(name)
        if group is None:
            raise NodeGroupError(f"no node group {name!r} (have: {', '.join(sorted(self._groups))})")
        return group

    @staticmethod
    def _in(instance: Instance, group: str) -> bool:
        parsed = parse_provider_id(instance.provider_id)
        return parsed is not None and parsed[0] == group

    def _new_instance(self, group: NodeGroup) -> Instance:
        """The next free address and pod network (under the lock)."""
        used = {n.ip for n in self._cluster.nodes} | {i.node.ip for i in self._instances.values()}
        for host in range(FIRST_HOST, LAST_HOST + 1):
            ip = f"198.18.1.{host}"
            if ip not in used:
                break
        else:
            raise NodeGroupError("no address left for another node (198.18.1.10-250 are taken)")
        node = NodeSpec(
            ip, group.profile, f"10.245.{host}.0/24", provider_id=provider_id(group.name, ip),
            labels=((GROUP_LABEL, group.name),), taints=group.taints,
        )  # fmt: skip
        instance = Instance(node.provider_id, node)
        self._instances[node.provider_id] = instance
        return instance

    def _start(self, instances: list[Instance]) -> None:
        try:
            with self._starting:
                self._start_nodes([i.node for i in instances])
        except Exception as error:  # reported as the instances' error, as a cloud does
            log.warning("nodes %s did not start: %s", [i.node.name for i in instances], error)
            with self._lock:
                for instance in instances:
                    instance.error = str(error)[-2000:]

    def _start_real_nodes(self, nodes: list[NodeSpec]) -> None:
        from localcluster.node import start_nodes
        from localcluster.pki import node_certs

        for node in nodes:
            node_certs(self._cluster.pki_dir, node.ip)
        self._cluster.add_nodes(nodes)
        start_nodes(self._cluster, self._binaries, tuple(nodes), reuse_images=True)


def published(cluster: LocalCluster, node: str, driver: str = "fractional.dev") -> bool:
    """Whether ``driver``'s pool of ``node`` is complete: every one of its ``resourceSliceCount``
    slices at its newest generation is there (what cluster-autoscaler waits for before it counts a
    new node as ready)."""
    from localcluster.node import kubectl_command

    result = subprocess.run(
        [*kubectl_command(cluster), "get", "resourceslices", f"--field-selector=spec.nodeName={node}",
         "-o", "json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        return False
    pools: dict[str, list[dict[str, object]]] = {}
    for item in json.loads(result.stdout)["items"]:
        if item["spec"].get("driver") == driver:
            pools.setdefault(item["spec"]["pool"]["name"], []).append(item["spec"]["pool"])
    for pool in pools.values():
        newest = max(int(p["generation"]) for p in pool)  # type: ignore[call-overload]
        current = [p for p in pool if int(p["generation"]) == newest]  # type: ignore[call-overload]
        if len(current) != int(current[0]["resourceSliceCount"]):  # type: ignore[call-overload]
            return False
    return bool(pools)


def wait_joined(
    provider: NodeGroupProvider, group: str, instances: Sequence[Instance], timeout_seconds: float = 300.0
) -> dict[str, float]:
    """Wait until each instance's Node is Ready and its slices are published; returns, per node, the
    seconds from the request to that point. Raises ``NodeGroupError`` on a start's error or the timeout."""
    joined: dict[str, float] = {}
    deadline = time.monotonic() + timeout_seconds
    while len(joined) < len(instances):
        provider.refresh()
        for instance in provider.instances(group):
            if instance.error:
                raise NodeGroupError(f"{instance.node.name} did not start: {instance.error}")
        for instance in instances:
            name = instance.node.name
            if name not in joined and instance.state == "running" and published(provider.cluster, name):
                joined[name] = time.monotonic() - instance.asked_at
        if time.monotonic() > deadline:
            missing = sorted({i.node.name for i in instances} - set(joined))
            raise NodeGroupError(f"not joined with their slices after {timeout_seconds:.0f}s: {missing}")
        time.sleep(0.5)
    return joined


def _nodes(cluster: LocalCluster) -> list[dict[str, Any]]:
    from localcluster.node import kubectl_command

    result = subprocess.run(
        [*kubectl_command(cluster), "get", "nodes", "-o", "json"], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise ClusterError(f"kubectl get nodes: {result.stderr.strip()[-500:]}")
    return list(json.loads(result.stdout)["items"])


def _node_names(cluster: LocalCluster) -> set[str]:
    return {item["metadata"]["name"] for item in _nodes(cluster)}


def _ready_nodes(cluster: LocalCluster) -> set[str]:
    return {
        item["metadata"]["name"]
        for item in _nodes(cluster)
        for condition in item.get("status", {}).get("conditions", [])
        if condition["type"] == "Ready" and condition["status"] == "True"
    }

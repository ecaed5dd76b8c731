"""A fleet of fake GPU nodes on the local control plane: kwok keeps the Nodes, our slice code
publishes their devices.

``python hack/localcluster fleet up N [--profile h100-8x]`` on a running local cluster:

- N Nodes ``kwok-00000`` ... with the label ``fractional.dev/fleet=kwok`` (the only nodes kwok
  manages: ``--manage-nodes-with-label-selector``, never ``--manage-all-nodes``, so the real
  kubelets' nodes are never touched), kwok's annotation, and the taint
  ``kwok.x-k8s.io/node=fake:NoSchedule`` (kwok's convention: what does not tolerate it, the agent's
  DaemonSet among them, stays off nodes no kubelet runs). Allocatable CPU, memory and pods are
  given (``--cpu``, ``--memory``, ``--pods``: the fake profiles describe GPUs only).
- Each node's ResourceSlices, from the agent's own publisher (``driver.publisher.SlicePublisher``
  with the profile's inventory for that node name: owner reference to the Node, pool generation,
  device chunks, as a node agent publishes them), all from this one process.
- kwok (built by ``COMPONENTS=kwok hack/upstream-build.sh``), started as one of the cluster's
  processes with the stages its module ships (``kustomize/stage``, read from the Go module cache):
  node-initialize (Ready, addresses) and pod-ready, pod-complete, pod-delete. No node-heartbeat
  stage and no leases (``--node-lease-duration-seconds=0``): at thousands of nodes they would be
  most of the API's load; kube-controller-manager is restarted without its node-lifecycle
  controller instead, so nothing marks the quiet nodes NotReady.

``fleet down`` stops kwok, deletes the fleet's slices and Nodes, and starts kube-controller-manager
again as it was.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

FLEET_LABEL = "fractional.dev/fleet"
FLEET_VALUE = "kwok"
FLEET_SELECTOR = f"{FLEET_LABEL}={FLEET_VALUE}"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_TAINT = {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}
HOSTNAME_LABEL = "kubernetes.io/hostname"
PROFILE_LABEL = "fractional.dev/fake-profile"
KWOK_STAGES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
)
NAME_PREFIX = "kwok-"
NO_NODE_LIFECYCLE = "--controllers=*,-node-lifecycle-controller"


class FleetError(RuntimeError):
    """The fleet could not be brought up or down; the message says why."""


def node_names(count: int) -> list[str]:
    if count < 1:
        raise FleetError(f"nodes: must be at least 1, got {count}")
    width = max(5, len(str(count - 1)))
    return [f"{NAME_PREFIX}{index:0{width}d}" for index in range(count)]


def fleet_node(name: str, profile: str, *, cpu: str, memory: str, pods: str) -> dict[str, Any]:
    """One fake Node: kwok's to keep (the fleet label), tainted as kwok nodes are."""
    allocatable = {"cpu": cpu, "memory": memory, "pods": pods}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                FLEET_LABEL: FLEET_VALUE,
                HOSTNAME_LABEL: name,
                PROFILE_LABEL: profile,
                "type": "kwok",
            },
            "annotations": {KWOK_ANNOTATION: "fake"},
        },
        "spec": {"taints": [dict(KWOK_TAINT)]},
        "status": {"allocatable": allocatable, "capacity": dict(allocatable)},
    }


def kwok_argv(binary: Path, kubeconfig: Path, stages: list[Path]) -> list[str]:
    """kwok on the fleet's nodes only, with the given stage files and no node leases."""
    return [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-label-selector={FLEET_SELECTOR}",
        "--node-lease-duration-seconds=0",
        "--server-address=",
        *(f"--config={stage}" for stage in stages),
    ]


def stage_files(kwok_module: Path) -> list[Path]:
    files = [kwok_module / stage for stage in KWOK_STAGES]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FleetError(f"kwok's module lacks its stages: {', '.join(missing)}")
    return files


def is_fleet_node(node: dict[str, Any]) -> bool:
    return ((node.get("metadata") or {}).get("labels") or {}).get(FLEET_LABEL) == FLEET_VALUE


def create_nodes(core: Any, nodes: list[dict[str, Any]], *, workers: int = 8) -> int:
    """Create the fleet's Nodes; one that exists already must be a fleet node (a real kubelet's
    node of the same name is never taken over). Returns how many were created."""
    from kubernetes import client

    def create(node: dict[str, Any]) -> int:
        name = node["metadata"]["name"]
        made = 1
        try:
            core.create_node(node, _preload_content=False)
        except client.ApiException as error:
            if error.status != 409:
                raise
            if not is_fleet_node(core.read_node(name).to_dict()):
                raise FleetError(
                    f"node {name} exists and is not a fleet node (no {FLEET_SELECTOR} label)"
                ) from None
            made = 0
        # Admission (TaintNodesByCondition) gave the new Node node.kubernetes.io/not-ready:NoSchedule;
        # the node-lifecycle controller that would lift it once kwok reports Ready is off for the
        # fleet (see the module's docstring), so the fleet's own taints are set here, kwok's alone.
        core.patch_node(name, {"spec": {"taints": node["spec"]["taints"]}}, _preload_content=False)
        return made

    with ThreadPoolExecutor(workers) as pool:
        return sum(pool.map(create, nodes))


def publish_slices(configuration: Any, names: list[str], profile: str, *, workers: int = 8) -> int:
    """Each node's pool as its agent would publish it (the agent's own publisher); returns the
    number of slices the fleet's nodes hold."""
    from driver.inventory.fake import load_profile, resolve_profile
    from driver.publisher import SlicePublisher

    path = resolve_profile(profile)

    def publish(name: str) -> int:
        with SlicePublisher(configuration, name) as publisher:
            return publisher.publish(load_profile(path, node_name=name)).slice_count

    with ThreadPoolExecutor(workers) as pool:
        return sum(pool.map(publish, names))


def up_fleet(
    cluster: Any,
    count: int,
    *,
    profile: str = "h100-8x",
    cpu: str = "224",
    memory: str = "2000Gi",
    pods: str = "110",
    say: Callable[[str], None] = print,
) -> None:
    from kubernetes import client
    from localcluster.cluster import Binaries

    from driver.kube import load_configuration

    if cluster.processes.get("kube-apiserver") is None:
        raise FleetError("no local cluster runs here: make cluster-up first")
    binary = Binaries.kwok()
    import gomodules  # hack/ is on sys.path: localcluster runs from it

    stages = stage_files(gomodules.kwok_dir())
    configuration = load_configuration(str(cluster.kubeconfig))
    names = node_names(count)
    with client.ApiClient(configuration) as api:
        created = create_nodes(client.CoreV1Api(api), [
            fleet_node(n, profile, cpu=cpu, memory=memory, pods=pods) for n in names])  # fmt: skip
    say(f"fleet: {created} Nodes created, {count - created} there already ({FLEET_SELECTOR})")
    slices = publish_slices(configuration, names, profile)
    say(f"fleet: {slices} ResourceSlices published for {count} nodes ({profile})")
    manager = cluster.processes.get("kube-controller-manager")
    if manager is not None and NO_NODE_LIFECYCLE not in manager.argv:
        argv = [*manager.argv, NO_NODE_LIFECYCLE]
        cluster.restart("kube-controller-manager", signum=signal.SIGTERM, argv=argv)
        say("fleet: kube-controller-manager restarted without its node-lifecycle controller")
    if cluster.processes.get("kwok") is None:
        cluster.processes.start("kwok", kwok_argv(binary, cluster.kubeconfig, stages))
        say(f"fleet: kwok started (log {cluster.state_dir / 'logs' / 'kwok.log'})")


def _fleet_pool(node: str, fleet: set[str], real: set[str]) -> bool:
    """A slice of a fleet node, or of one an earlier fleet left (named as ours, no real Node)."""
    return node in fleet or (node.startswith(NAME_PREFIX) and node not in real)


def _gone(delete: Callable[[str], Any], name: str) -> None:
    """Delete ``name``; already gone (the garbage collector was quicker) is fine."""
    from kubernetes import client

    try:
        delete(name)
    except client.ApiException as error:
        if error.status != 404:
            raise


def down_fleet(cluster: Any, *, say: Callable[[str], None] = print) -> None:
    from kubernetes import client

    from driver.kube import load_configuration

    kwok = cluster.processes.get("kwok")
    if kwok is not None:
        cluster.processes.stop(kwok)
        say("fleet: kwok stopped")
    configuration = load_configuration(str(cluster.kubeconfig))
    with client.ApiClient(configuration) as api:
        core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
        every = core.list_node().items
        names = {n.metadata.name for n in every if is_fleet_node({"metadata": {"labels": n.metadata.labels}})}
        real = {n.metadata.name for n in every} - names
        # Their slices first, by this process: the garbage collector would follow the owner
        # references at its own client limits (about 1 a second, a quarter of an hour for 1,000);
        # and those an earlier fleet's deleted Nodes left to it.
        slices = [s.metadata.name for s in resource.list_resource_slice().items
                  if _fleet_pool(s.spec.node_name or "", names, real)]  # fmt: skip
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda name: _gone(resource.delete_resource_slice, name), slices))
            list(pool.map(lambda name: _gone(core.delete_node, name), sorted(names)))
    say(f"fleet: {len(names)} Nodes and their {len(slices)} ResourceSlices deleted")
    manager = cluster.processes.get("kube-controller-manager")
    if manager is not None and NO_NODE_LIFECYCLE in manager.argv:
        argv = [a for a in manager.argv if a != NO_NODE_LIFECYCLE]
        cluster.restart("kube-controller-manager", signum=signal.SIGTERM, argv=argv)
        say("fleet: kube-controller-manager restarted with its node-lifecycle controller")

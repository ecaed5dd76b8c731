"""``--policy ours``: the production trace placed by the allocation controller's own decision path.

Every GPU pod of the trace becomes what a user would submit: a ResourceClaim of our DeviceClass and a
pod carrying our scheduling gate, both put into the controller's watch cache (``ClusterCache``) as
the watches would. Then the controller's reconcile steps decide it, in process and unchanged:
``plan_gang`` (the pod's gang: a gang of one), ``decide_all`` (node and GPU choice by the allocator,
the nodes' CPU and memory by the node-fit check, the GPU model by a CEL selector), and the decision
is committed into the cache as the API would echo it (the claim's ``status.allocation``, the pod
ungated and bound to the node). Nothing of the decision path is copied here.

The mapping of the trace's one GPU dimension onto our share model (docs/architecture.md: The share
model): each trace GPU is one device of ``memory`` = 1,000 x 256 MiB (250,000 MiB; the share step is
256 MiB), so a share of ``gpu_milli`` m asks for ``memory: m x 256Mi`` and a set of shares fits one
GPU exactly when their milli add up to at most 1,000. ``compute`` is not asked (0: best effort):
compute has 100 steps, so m/10 would not add up exactly (three shares of 333 milli would need 102 %).
A whole-GPU pod (m = 1000) asks for ``count: k`` devices with no capacity, which takes each whole.
The GPU model is the device's ``productName`` attribute; a pod's ``gpu_spec`` becomes the selector
``device.attributes["fractional.dev"].productName in [...]``. A node's ``status.allocatable`` is the
trace's CPU and memory.

CPU-only pods (no claim) are kube-scheduler's to place on a real cluster unless their namespace opts
in to ours (``fractional.dev/placement=all-pods``: the chart's admission policy gates them, and the
controller chooses their node and pins them there). ``all_pods=False`` (the default install): they
are placed as kube-scheduler's default profile scores a pod without claims, written from its
documented rules (``KubeSchedulerDefault``). ``all_pods=True``: every CPU-only pod is a gated pod
without claims, decided by the controller like the others.
"""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from bench.fgd_trace import GpuAssignment, Placement, TraceNode, TracePod
from driver.allocator.quantity import parse_quantity
from driver.config import DEFAULT_POLICY
from driver.controller.gangs.burst import decide_all
from driver.controller.gangs.decide import Decision
from driver.controller.gangs.plan import plan_gang
from driver.controller.model.objects import object_key
from driver.controller.view.cache import ClusterCache, Kind
from driver.inventory.fake import load_profile, resolve_profile
from driver.inventory.model import NodeInventory
from driver.slices import DRIVER_NAME, build_device_classes, build_resource_slices

__all__ = ["MILLI_BYTES", "OursPolicy"]

MIB = 1024 * 1024
MILLI_BYTES = 256 * MIB  # one trace milli of a GPU: one 256 MiB share step
GPU_MEMORY_MIB = 1000 * 256
NAMESPACE = "trace"
GATE = "fractional.dev/allocation"


def trace_inventory(node: TraceNode, template: NodeInventory) -> NodeInventory:
    """The node agent's fake inventory for one trace node: ``gpus`` GPUs of its model, 1,000 steps each."""
    base = template.gpus[0]
    gpus = []
    for index in range(node.gpus):
        gpus.append(
            replace(
                base,
                name=f"gpu-{index}",
                uuid=f"GPU-{index:08x}-0000-4000-8000-{abs(hash(node.name)) % 10**12:012d}",
                product_name=node.model,
                memory_bytes=GPU_MEMORY_MIB * MIB,
                pci_bus_id=f"0000:{0x10 + index:02x}:00.0",
                pcie_root=None,
                numa_node=None,
                nvlink_domain=None,
                nvlink_peers=(),
                minor_number=index,
            )
        )
    return replace(template, node_name=node.name, gpus=tuple(gpus), nics=(), numa_nodes=())


def _node_object(node: TraceNode) -> dict[str, Any]:
    allocatable = {"cpu": f"{node.cpu_milli}m", "memory": f"{node.memory_mib}Mi", "pods": "1001"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node.name, "uid": f"node-{node.name}", "resourceVersion": "1",
                     "labels": {"kubernetes.io/hostname": node.name, "gpu-model": node.model}},
        "status": {"allocatable": allocatable, "capacity": allocatable},
    }  # fmt: skip


def _claim_spec(pod: TracePod) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": "gpu.fractional.dev", "count": pod.num_gpu}
    if pod.gpu_milli < 1000:
        exactly["capacity"] = {"requests": {"memory": f"{pod.gpu_milli * 256}Mi"}}
    if pod.gpu_spec:
        models = ", ".join(f'"{m}"' for m in pod.gpu_spec)
        exactly["selectors"] = [
            {"cel": {"expression": f'device.attributes["{DRIVER_NAME}"].productName in [{models}]'}}
        ]
    return {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}


def _containers(pod: TracePod, claim: bool) -> list[dict[str, Any]]:
    resources: dict[str, Any] = {"requests": {"cpu": f"{pod.cpu_milli}m", "memory": f"{pod.memory_mib}Mi"}}
    if claim:
        resources["claims"] = [{"name": "gpu"}]
    return [{"name": "main", "image": "registry.k8s.io/pause:3.10", "resources": resources}]


class KubeSchedulerDefault:
    """kube-scheduler's default profile for a pod that asks for no devices, from its documented rules:
    filter on CPU, memory and pod count (NodeResourcesFit); score NodeResourcesFit's LeastAllocated
    (the mean over CPU and memory of the fraction left free after the pod, x100) plus
    NodeResourcesBalancedAllocation ((1 - the standard deviation of the two fractions used after the
    pod) x100), each truncated to an integer, weight 1 each. The other default score plugins give
    every node the same score here (no images, affinities, taints or spread constraints). With many
    nodes it scores only the first feasible ones found (``percentageOfNodesToScore``: adaptive,
    50 % minus 1 % per 125 nodes, at least 5 % and at least 100 nodes), searching from where the
    previous pod's search stopped, and takes the highest score, ties drawn at random."""

    def __init__(self, nodes: Sequence[TraceNode], rng: random.Random) -> None:
        self.cpu = [n.cpu_milli for n in nodes]
        self.memory = [n.memory_mib for n in nodes]
        self.free_cpu = list(self.cpu)
        self.free_memory = list(self.memory)
        self.rng = rng
        self.start = 0
        count = len(nodes)
        percentage = max(5, 50 - count // 125)
        self.to_find = max(min(count, 100), count * percentage // 100)

    def place(self, pod: TracePod) -> int | None:
        count = len(self.cpu)
        found: list[int] = []
        examined = 0
        for step in range(count):
            index = (self.start + step) % count
            examined = step + 1
            if pod.cpu_milli <= self.free_cpu[index] and pod.memory_mib <= self.free_memory[index]:
                found.append(index)
                if len(found) >= self.to_find:
                    break
        self.start = (self.start + examined) % count
        best: list[int] = []
        best_score = -1
        for index in found:
            cpu_used = (self.cpu[index] - self.free_cpu[index] + pod.cpu_milli) / self.cpu[index]
            memory_used = (self.memory[index] - self.free_memory[index] + pod.memory_mib) / self.memory[index]
            least = int(((1 - cpu_used) + (1 - memory_used)) / 2 * 100)
            balanced = int((1 - abs(cpu_used - memory_used) / 2) * 100)
            score = least + balanced
            if score > best_score:
                best, best_score = [index], score
            elif score == best_score:
                best.append(index)
        if not best:
            return None
        return best[self.rng.randrange(len(best))] if len(best) > 1 else best[0]

    def take(self, index: int, cpu_milli: int, memory_mib: int) -> None:
        self.free_cpu[index] -= cpu_milli
        self.free_memory[index] -= memory_mib


class OursPolicy:
    """The controller's decision path over the trace cluster (see the module's docstring)."""

    name = "ours"

    def __init__(
        self, nodes: Sequence[TraceNode], *, seed: int, policy: str = DEFAULT_POLICY, all_pods: bool = False
    ) -> None:
        self.nodes = list(nodes)
        self.all_pods = all_pods
        self.index = {n.name: i for i, n in enumerate(self.nodes)}
        self.policy = policy
        self.cache = ClusterCache(topology_label="topology.kubernetes.io/zone")
        self.cache.learn_workload = policy == "fragmentation"
        self.versions = itertools.count(2)
        self.kube_scheduler = KubeSchedulerDefault(self.nodes, random.Random(seed))
        template = load_profile(resolve_profile("h100-8x"))
        for device_class in build_device_classes():
            device_class.setdefault("metadata", {})["resourceVersion"] = "1"
            self.cache.apply(Kind.CLASS, "ADDED", device_class)
        for node in self.nodes:
            self.cache.apply(Kind.NODE, "ADDED", _node_object(node))
            for resource_slice in build_resource_slices(trace_inventory(node, template)):
                meta = resource_slice["metadata"]
                meta["name"] = meta.pop("generateName") + "0"
                meta.update(uid=meta["name"], resourceVersion="1")
                self.cache.apply(Kind.SLICE, "ADDED", resource_slice)
        self._serial = itertools.count()

    def _meta(self, name: str) -> dict[str, Any]:
        return {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}",
                "resourceVersion": str(next(self.versions))}  # fmt: skip

    def place(self, pod: TracePod) -> Placement | None:
        name = f"p{next(self._serial)}"
        if pod.num_gpu == 0 and not self.all_pods:
            node = self.kube_scheduler.place(pod)
            if node is None:
                return None
            self._bind(self._pod_object(pod, name, claim=False), self.nodes[node].name, pod)
            return node, ()
        if pod.num_gpu == 0:
            gated = self._pod_object(pod, name, claim=False, gated=True)
            decision = self._decide(gated)
            if decision is None:
                return None
            [(_, node_name)] = decision.pod_nodes
            assert node_name is not None
            self._bind(gated, node_name, pod)
            return self.index[node_name], ()
        claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": self._meta(name),
                 "spec": _claim_spec(pod)}  # fmt: skip
        self.cache.apply(Kind.CLAIM, "ADDED", claim)
        gated = self._pod_object(pod, name, claim=True)
        decision = self._decide(gated)
        if decision is None:
            self.cache.apply(Kind.CLAIM, "DELETED", claim)
            return None
        [(_, allocation)] = decision.allocations
        [(_, node_name)] = decision.pod_nodes
        assert node_name is not None
        allocated = copy.deepcopy(claim)
        allocated["metadata"]["resourceVersion"] = str(next(self.versions))
        allocated["status"] = {"allocation": allocation}
        self.cache.apply(Kind.CLAIM, "MODIFIED", allocated)  # the API's echo of our write
        self.cache.forget_assumed([str(object_key(claim))])
        self._bind(gated, node_name, pod)
        return self.index[node_name], self._gpus(pod, allocation)

    def _decide(self, gated: dict[str, Any]) -> Decision | None:
        """The controller's decision for one gated pod just created; None (and the pod gone again:
        the run's pod fails, it is never retried) when it places nothing."""
        self.cache.apply(Kind.POD, "ADDED", gated)
        plan = plan_gang(self.cache, self.cache.gang_key(gated))
        [decision] = decide_all(self.cache, [plan], policy=self.policy)
        if not isinstance(decision, Decision) or decision.outcome != "allocated":
            self.cache.apply(Kind.POD, "DELETED", gated)
            return None
        return decision

    def _pod_object(self, pod: TracePod, name: str, *, claim: bool, gated: bool = False) -> dict[str, Any]:
        spec: dict[str, Any] = {"containers": _containers(pod, claim)}
        if claim or gated:
            spec["schedulingGates"] = [{"name": GATE}]
        if claim:
            spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": name}]
        return {"apiVersion": "v1", "kind": "Pod", "metadata": self._meta(name), "spec": spec}

    def _bind(self, pod: dict[str, Any], node: str, trace_pod: TracePod) -> None:
        bound = copy.deepcopy(pod)
        bound["metadata"]["resourceVersion"] = str(next(self.versions))
        bound["spec"].pop("schedulingGates", None)
        bound["spec"]["nodeName"] = node
        self.cache.apply(Kind.POD, "MODIFIED", bound)
        self.cache.forget_placement(str(object_key(pod)))
        self.kube_scheduler.take(self.index[node], trace_pod.cpu_milli, trace_pod.memory_mib)

    @staticmethod
    def _gpus(pod: TracePod, allocation: dict[str, Any]) -> GpuAssignment:
        taken = []
        for result in allocation["devices"]["results"]:
            gpu = int(str(result["device"]).removeprefix("gpu-"))
            consumed = (result.get("consumedCapacity") or {}).get("memory")
            taken.append((gpu, 1000 if consumed is None else int(parse_quantity(consumed) // MILLI_BYTES)))
        return tuple(sorted(taken))

    def placed(self, pod: TracePod, node: int, gpus: GpuAssignment) -> None:
        """The harness applied it: ours already holds it in the controller's cache."""

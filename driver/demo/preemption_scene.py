"""The demo's priority-preemption scene: low-priority research shares fill the GPUs of
the quietest node, then a high-priority training gang pinned to that node arrives; the controller
evicts the cheapest victims and places the gang. Prints who was preempted, why, and where the
gang landed (read back from the API: the Events and the claims' allocations)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

from kubernetes import client

from driver.demo.objects import build_claim, build_pod, gpu_request
from driver.gpu_usage import GPUUsage, compute_gpu_usage
from driver.kube import REQUEST_TIMEOUT_SECONDS, as_dict

__all__ = ["create_pinned", "events", "run_preemption_scene"]

MIB = 1 << 20
LOW, HIGH = ("research-low", 100), ("training-high", 10000)


class SceneHost(Protocol):
    """What the scene uses of the demo (driver/demo/scenario.py)."""

    core: client.CoreV1Api
    resource: client.ResourceV1Api

    def say(self, message: str) -> None: ...
    def slices(self) -> list[dict[str, Any]]: ...
    def claims(self) -> list[dict[str, Any]]: ...
    def running(self, names: list[str]) -> bool: ...
    def allocation_of(self, claim_name: str) -> list[dict[str, Any]]: ...
    def expect(self, predicate: Callable[[], Any], what: str) -> None: ...


def create_pinned(
    demo: SceneHost, namespace: str, name: str, request: dict[str, Any], node: str, *,
    priority: str | None = None, gang: str | None = None, size: int | None = None,
) -> None:  # fmt: skip
    """A claim of ``request`` and a gated pod using it, held to ``node`` by its nodeSelector."""
    claim = build_claim(f"{name}-claim", namespace, [request])
    demo.resource.create_namespaced_resource_claim(
        namespace, cast(Any, claim), _request_timeout=REQUEST_TIMEOUT_SECONDS
    )
    pod = build_pod(name, namespace, [f"{name}-claim"], gang=gang, gang_size=size, cpu="1", memory="1Gi")
    if priority:
        pod["spec"]["priorityClassName"] = priority
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    demo.core.create_namespaced_pod(namespace, cast(Any, pod), _request_timeout=REQUEST_TIMEOUT_SECONDS)


def events(demo: SceneHost, namespace: str, reason: str) -> list[dict[str, Any]]:
    items = demo.core.list_namespaced_event(namespace, _request_timeout=REQUEST_TIMEOUT_SECONDS).items
    return [as_dict(e) for e in items if e.reason == reason]


def _quietest_node(usage: list[GPUUsage]) -> tuple[str, list[GPUUsage]]:
    """The node with the least GPU memory in use (among those with at least two GPUs)."""
    by_node: dict[str, list[GPUUsage]] = {}
    for gpu in usage:
        by_node.setdefault(gpu.node, []).append(gpu)
    candidates = [
        (sum(g.memory_used_bytes for g in gpus), node) for node, gpus in by_node.items() if len(gpus) >= 2
    ]
    node = min(candidates)[1]
    return node, by_node[node]


def run_preemption_scene(demo: SceneHost, namespace: str) -> None:
    scheduling = client.SchedulingV1Api(demo.core.api_client)
    for name, value in (LOW, HIGH):
        body = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name}}
        scheduling.create_priority_class(
            cast(Any, {**body, "value": value}), _request_timeout=REQUEST_TIMEOUT_SECONDS
        )
    node, gpus = _quietest_node(compute_gpu_usage(demo.slices(), demo.claims()))
    share_mib = min(g.memory_total_bytes for g in gpus) // 2 // MIB // 256 * 256  # two fill a GPU
    room = sum((g.memory_total_bytes - g.memory_used_bytes) // (share_mib * MIB) for g in gpus)
    research = [f"research-{i}" for i in range(room)]
    demo.say(
        f"priority preemption: {len(research)} research shares ({share_mib}Mi, PriorityClass {LOW[0]} = "
        f"{LOW[1]}) fill the {len(gpus)} GPUs of {node}"
    )
    for name in research:
        create_pinned(demo, namespace, name, gpu_request(memory=f"{share_mib}Mi"), node, priority=LOW[0])
    demo.expect(lambda: demo.running(research), "research shares running")
    urgent = ["urgent-0", "urgent-1"]
    demo.say(
        f"gang 'urgent' arrives: {len(urgent)} pods, each a whole GPU of {node}, PriorityClass {HIGH[0]} = "
        f"{HIGH[1]}"
    )
    for name in urgent:
        create_pinned(
            demo, namespace, name, gpu_request(), node, priority=HIGH[0], gang="urgent", size=len(urgent)
        )
    demo.expect(lambda: demo.running(urgent), "gang 'urgent' placed after preempting research shares")
    for event in events(demo, namespace, "Preempting"):
        demo.say(f"  {event['involvedObject']['name']}: {event['message']}")
    for event in sorted(events(demo, namespace, "Preempted"), key=lambda e: e["involvedObject"]["name"]):
        demo.say(
            f"  preempted {event['involvedObject']['name']}: {event['message']} (evicted through the "
            "Eviction API, which marks it DisruptionTarget: EvictionByEvictionAPI)"
        )
    for name in urgent:
        placed = ", ".join(f"{r['pool']}/{r['device']}" for r in demo.allocation_of(f"{name}-claim"))
        demo.say(f"  {name} landed on {placed}")

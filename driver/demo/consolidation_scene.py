"""The demo's consolidation scene: two replicas of Deployment 'web' (one GPU share each, from a
ResourceClaimTemplate), left on two GPUs of one node by churn, keep a whole-GPU pod of the same
priority out although half of each GPU is free. No preemption applies (nobody has a lower
priority); the controller moves one replica beside the other through the Eviction API and keeps
room for its replacement, which the ReplicaSet makes; the whole-GPU pod takes the freed GPU. Prints
the controller's Events and where each pod landed (read back from the API)."""

from __future__ import annotations

from typing import Any, cast

from kubernetes import client

from driver.demo.cluster import CONSOLIDATION_MIN_RUNTIME_SECONDS
from driver.demo.objects import GATE, gpu_request
from driver.demo.preemption_scene import SceneHost, create_pinned, events
from driver.gpu_usage import compute_gpu_usage
from driver.kube import REQUEST_TIMEOUT_SECONDS, as_dict

__all__ = ["run_consolidation_scene"]

MIB = 1 << 20
APP = "web"
MOVABLE_LABEL = "fractional.dev/movable"  # written as a user writes it (docs/consolidation.md)


def _deployment(namespace: str, node: str, replicas: int) -> dict[str, Any]:
    """Deployment 'web': replicas of one GPU share each (ResourceClaimTemplate 'web-gpu'), opted in
    to moves by the label on its pod template."""
    labels = {"app": APP, MOVABLE_LABEL: "true"}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": APP, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": APP}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "schedulingGates": [{"name": GATE}],
                    "nodeSelector": {"kubernetes.io/hostname": node},
                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": f"{APP}-gpu"}],
                    "containers": [{
                        "name": "main", "image": "registry.k8s.io/pause:3.10",
                        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "claims": [{"name": "gpu"}]},
                    }],
                },
            },
        },
    }  # fmt: skip


def _web_pods(demo: SceneHost, namespace: str) -> list[dict[str, Any]]:
    items = demo.core.list_namespaced_pod(
        namespace, label_selector=f"app={APP}", _request_timeout=REQUEST_TIMEOUT_SECONDS
    ).items
    pods = [as_dict(p) for p in items]
    return sorted((p for p in pods if not p["metadata"].get("deletionTimestamp")),
                  key=lambda p: str(p["metadata"].get("creationTimestamp")))  # fmt: skip


def _running(pods: list[dict[str, Any]]) -> list[str]:
    return [p["metadata"]["name"] for p in pods if (p.get("status") or {}).get("phase") == "Running"]


def _claim_of(pod: dict[str, Any]) -> str:
    statuses = (pod.get("status") or {}).get("resourceClaimStatuses") or []
    return str(statuses[0]["resourceClaimName"]) if statuses else ""


def _gpu(demo: SceneHost, claim: str) -> str:
    return ", ".join(f"{r['pool']}/{r['device']}" for r in demo.allocation_of(claim))


def _finish(demo: SceneHost, namespace: str, name: str) -> None:
    """Pod ``name`` ends: deleted, its claim's devices released, then the claim deleted."""
    demo.core.delete_namespaced_pod(name, namespace, _request_timeout=REQUEST_TIMEOUT_SECONDS)
    demo.expect(lambda: not demo.allocation_of(f"{name}-claim"), f"the claim of {name} released")
    demo.resource.delete_namespaced_resource_claim(
        f"{name}-claim", namespace, _request_timeout=REQUEST_TIMEOUT_SECONDS
    )


def run_consolidation_scene(demo: SceneHost, namespace: str) -> None:
    usage = compute_gpu_usage(demo.slices(), demo.claims())
    free: dict[str, list[Any]] = {}
    for gpu in usage:
        if gpu.memory_used_bytes == 0:
            free.setdefault(gpu.node, []).append(gpu)
    candidates = sorted((len(gpus), node) for node, gpus in free.items() if len(gpus) >= 2)
    if not candidates:
        demo.say("consolidation: skipped, no node has two free GPUs left")
        return
    node = candidates[-1][1]
    gpus = free[node]
    total_mib = min(g.memory_total_bytes for g in gpus) // MIB
    share_mib = total_mib * 2 // 5 // 256 * 256  # two fit one GPU
    batch = [f"batch-{i}" for i in range(len(gpus) - 2)]
    demo.say(
        f"consolidation: {len(batch)} whole-GPU batch pods take the free GPUs of {node} but two; "
        f"Deployment '{APP}' (pod label {MOVABLE_LABEL}=true: its pods may be moved) runs two "
        f"{share_mib}Mi shares there, left on those two GPUs by churn"
    )
    for name in batch:
        create_pinned(demo, namespace, name, gpu_request(), node)
    demo.expect(lambda: demo.running(batch), "batch pods running")
    template = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": f"{APP}-gpu", "namespace": namespace},
        "spec": {"spec": {"devices": {"requests": [gpu_request(memory=f"{share_mib}Mi")]}}},
    }  # fmt: skip
    demo.resource.create_namespaced_resource_claim_template(
        namespace, cast(Any, template), _request_timeout=REQUEST_TIMEOUT_SECONDS
    )
    apps = client.AppsV1Api(demo.core.api_client)
    # Churn, played out: one replica, a pad beside it that fills its GPU, the second replica on the
    # other GPU, the pad gone.
    apps.create_namespaced_deployment(
        namespace, cast(Any, _deployment(namespace, node, 1)), _request_timeout=REQUEST_TIMEOUT_SECONDS
    )
    demo.expect(lambda: len(_running(_web_pods(demo, namespace))) == 1, f"one replica of '{APP}' running")
    create_pinned(demo, namespace, "pad", gpu_request(memory=f"{total_mib - share_mib}Mi"), node)
    demo.expect(lambda: demo.running(["pad"]), "pad running")
    apps.patch_namespaced_deployment(
        APP, namespace, {"spec": {"replicas": 2}}, _request_timeout=REQUEST_TIMEOUT_SECONDS
    )
    demo.expect(lambda: len(_running(_web_pods(demo, namespace))) == 2, f"two replicas of '{APP}' running")
    _finish(demo, namespace, "pad")
    before = {p["metadata"]["name"]: _claim_of(p) for p in _web_pods(demo, namespace)}
    where = ", ".join(f"{name} on {_gpu(demo, claim)}" for name, claim in before.items())
    demo.say(f"  {where}: no GPU of {node} is free")
    demo.say(
        f"pod 'solo' arrives: a whole GPU of {node}, the same priority as '{APP}' (no preemption "
        f"applies); the demo's controller runs with --consolidation (minimum runtime "
        f"{CONSOLIDATION_MIN_RUNTIME_SECONDS} s for the demo; the chart's default is 600 s)"
    )
    create_pinned(demo, namespace, "solo", gpu_request(), node)
    demo.expect(lambda: events(demo, namespace, "Consolidated"), f"a replica of '{APP}' moved")
    for event in events(demo, namespace, "Consolidating"):
        demo.say(f"  {event['involvedObject']['name']}: {event['message']}")
    (moved_event,) = events(demo, namespace, "Consolidated")
    moved = str(moved_event["involvedObject"]["name"])
    demo.say(f"  moved {moved}: {moved_event['message']}")
    demo.expect(lambda: demo.running(["solo"]), "'solo' placed on the freed GPU")
    demo.say(f"  solo landed on {_gpu(demo, 'solo-claim')}, the GPU {moved} left")

    def replaced() -> bool:
        running = _running(_web_pods(demo, namespace))
        return len(running) == 2 and moved not in running

    demo.expect(replaced, f"the ReplicaSet's replacement for {moved} running")
    stays = next(name for name in before if name != moved)
    (replacement,) = [p for p in _web_pods(demo, namespace) if p["metadata"]["name"] not in before]
    demo.say(
        f"  the ReplicaSet made {replacement['metadata']['name']}; it landed on "
        f"{_gpu(demo, _claim_of(replacement))}, in the room kept for it beside {stays}"
    )
    for name in batch:  # room for what a user tries next (fractional demo --keep-running, README)
        _finish(demo, namespace, name)
    demo.say(f"  the batch pods finish: {len(batch)} GPUs of {node} free again")

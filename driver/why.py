"""``fractional why NAMESPACE/POD``: why a pod is still gated or pending, in words.

Read from the API (pods, claims, slices, classes, nodes, events), then explained by pure code:

- what holds the pod: our scheduling gate (the allocation controller has not placed it), Kueue's
  gate (admission first), another gate, or kube-scheduler (no gate, no node);
- each claim: allocated (where) or not, and what it asks for (``explain.describe_demand``);
- the GPUs that came closest and what each lacks (memory, compute, taken whole, shares in the way
  of a whole-GPU request), from the allocator's free capacities;
- a request no GPU of the cluster can ever hold (compute over 100 %, more memory than the largest
  GPU, more devices than any node has), named with the largest capacity published;
- the gang it waits with (members present and gated), the best single node's offer
  (``explain.best_node_offer``), the scale-up hint annotation and the latest events about the pod,
  its gang's pods or its PodGroup/Workload, matched on ``involvedObject`` (core/v1) or
  ``regarding`` (events.k8s.io/v1): kind, namespace, name, and UID when the Event has one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from driver import DRIVER_NAME
from driver.allocator import ClusterState
from driver.config import DEFAULT_POLICY, WhyConfig
from driver.controller.diagnosis.explain import best_node_offer, describe_demand, format_bytes
from driver.controller.gangs.nodefit import node_admits_pod
from driver.controller.gangs.plan import PodGroup
from driver.controller.model.gang_identity import GangSource, identify, resolve
from driver.controller.model.objects import (
    GATE,
    HINT_ANNOTATION,
    PROVISIONING_ANNOTATION,
    PROVISIONING_OURS_ANNOTATION,
    gang_size_of,
    is_gated,
    pod_claim_refs,
    quantity,
)
from driver.controller.sizing.fragmentation import GpuCapacity, build_gpu_capacities, products_from_slices
from driver.controller.sizing.provisioning import Phase, phase_of
from driver.errors import FractionalError

__all__ = [
    "ClusterView",
    "DeviceFit",
    "GpuNeed",
    "compute_device_fits",
    "compute_impossible",
    "event_is_about",
    "explain_pod",
    "run_why",
]

KUEUE_GATE = "kueue.x-k8s.io/admission"
CONSOLIDATING = "Consolidating"  # the controller's Events (driver/controller/consolidation/consolidator.py)
CONSOLIDATION_BLOCKED = "ConsolidationBlocked"
GPU_CLASS = "gpu.fractional.dev"
CLOSEST = 5


@dataclass(frozen=True, slots=True)
class GpuNeed:
    """The largest GPU request among a pod's pending claims."""

    memory_bytes: int
    compute_percent: int
    whole: bool


@dataclass(frozen=True, slots=True)
class DeviceFit:
    node: str
    device: str
    product: str
    lacks: tuple[str, ...]  # empty: fits on capacity


@dataclass(frozen=True, slots=True)
class ClusterView:
    """What ``explain_pod`` reads: API-shaped dicts."""

    pods: Sequence[dict[str, Any]]  # of the pod's namespace
    claims: Sequence[dict[str, Any]]  # of the pod's namespace
    all_claims: Sequence[dict[str, Any]]  # every namespace (capacity in use)
    slices: Sequence[dict[str, Any]]
    classes: Sequence[dict[str, Any]]
    nodes: Sequence[dict[str, Any]]
    events: Sequence[dict[str, Any]]  # of the pod's namespace
    # autoscaling.x-k8s.io/v1 ProvisioningRequests of the pod's namespace (none: the CRD is not served)
    provisioning_requests: Sequence[dict[str, Any]] = ()


def _allocated(claim: Mapping[str, Any]) -> bool:
    return bool((claim.get("status") or {}).get("allocation"))


def gpu_need(claims: Iterable[Mapping[str, Any]]) -> GpuNeed | None:
    memory, compute, whole, any_gpu = 0, 0, False, False
    for claim in claims:
        for request in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ():
            exact = request.get("exactly") or next(iter(request.get("firstAvailable") or ()), None) or {}
            if exact.get("deviceClassName") != GPU_CLASS:
                continue
            any_gpu = True
            asked = (exact.get("capacity") or {}).get("requests") or {}
            if not asked:
                whole = True
                continue
            memory = max(memory, int(quantity(asked.get("memory", 0))))
            compute = max(compute, int(quantity(asked.get("compute", 0))))
    return GpuNeed(memory, compute, whole) if any_gpu else None


def compute_device_fits(gpus: Iterable[GpuCapacity], need: GpuNeed) -> list[DeviceFit]:
    """Every GPU with what it lacks for ``need``, closest first (fewest and smallest shortfalls)."""
    ranked = []
    for gpu in gpus:
        lacks = []
        shortfall = 0
        if gpu.exclusive:
            lacks.append("taken whole by another claim")
            shortfall += gpu.memory_total_bytes
        elif need.whole and gpu.shares:
            lacks.append(f"holds {gpu.shares} share(s); a whole-GPU request needs it empty")
            shortfall += gpu.memory_total_bytes - gpu.memory_free_bytes
        if not gpu.exclusive and gpu.memory_free_bytes == 0:
            lacks.append(f"all of its memory is allocated ({gpu.shares} claim(s))")
            shortfall += need.memory_bytes or gpu.memory_total_bytes
        elif not gpu.exclusive and need.memory_bytes > gpu.memory_free_bytes:
            lacks.append(
                f"memory: needs {format_bytes(need.memory_bytes)}, {format_bytes(gpu.memory_free_bytes)} free"
            )
            shortfall += need.memory_bytes - gpu.memory_free_bytes
        if not gpu.exclusive and need.compute_percent > gpu.compute_free_percent:
            lacks.append(f"compute: needs {need.compute_percent}%, {gpu.compute_free_percent}% free")
            shortfall += (need.compute_percent - gpu.compute_free_percent) * gpu.memory_total_bytes // 100
        ranked.append((len(lacks), shortfall, DeviceFit(gpu.node, gpu.device, gpu.product, tuple(lacks))))
    ranked.sort(key=lambda entry: (entry[0], entry[1], entry[2].node, entry[2].device))
    return [fit for _, _, fit in ranked]


def _gpu_capacities(slices: Iterable[Mapping[str, Any]]) -> tuple[dict[str, int], int]:
    """The largest value each capacity of our GPUs takes in the cluster, and the most GPUs one node has."""
    largest: dict[str, int] = {}
    per_node: dict[str, int] = {}
    for resource_slice in slices:
        spec = resource_slice.get("spec") or {}
        if spec.get("driver") != DRIVER_NAME:
            continue
        node = str(spec.get("nodeName") or (spec.get("pool") or {}).get("name") or "")
        for device in spec.get("devices") or ():
            if ((device.get("attributes") or {}).get("type") or {}).get("string") != "gpu":
                continue
            per_node[node] = per_node.get(node, 0) + 1
            for name, capacity in (device.get("capacity") or {}).items():
                value = int(quantity((capacity or {}).get("value", 0)))
                largest[name] = max(largest.get(name, 0), value)
    return largest, max(per_node.values(), default=0)


def _amount(name: str, value: int) -> str:
    return format_bytes(value) if name == "memory" else f"{value}%" if name == "compute" else str(value)


def compute_impossible(claims: Iterable[Mapping[str, Any]], slices: Sequence[Mapping[str, Any]]) -> list[str]:
    """Why each GPU request of ``claims`` can never be allocated in this cluster, whatever is freed:
    a capacity above the largest any GPU publishes, or more GPUs than any node has (pure)."""
    largest, most_per_node = _gpu_capacities(slices)
    if most_per_node == 0:
        return []  # no GPU published: said elsewhere
    reasons = []
    for claim in claims:
        claim_name = (claim.get("metadata") or {}).get("name")
        for request in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ():
            exact = request.get("exactly") or next(iter(request.get("firstAvailable") or ()), None) or {}
            if exact.get("deviceClassName") != GPU_CLASS:
                continue
            where = f"ResourceClaim {claim_name} request {request.get('name')}"
            for name, raw in sorted(((exact.get("capacity") or {}).get("requests") or {}).items()):
                asked = int(quantity(raw))
                if name not in largest:
                    reasons.append(f"{where}: asks for capacity {name!r}, which no GPU publishes")
                elif asked > largest[name]:
                    reasons.append(
                        f"{where}: {name}: asks for {_amount(name, asked)}, the largest GPU in the "
                        f"cluster has {_amount(name, largest[name])}"
                    )
            count = int(exact.get("count") or 1) if exact.get("allocationMode", "ExactCount") != "All" else 1
            if count > most_per_node:
                reasons.append(
                    f"{where}: count: asks for {count} GPUs on one node, the largest node has {most_per_node}"
                )
    return reasons


def event_is_about(event: Mapping[str, Any], kind: str, namespace: str, name: str, uid: str | None) -> bool:
    """The Event's object (core/v1 ``involvedObject``, events.k8s.io/v1 ``regarding``) is this one:
    kind, namespace and name equal, and the UID too when both have one (a re-created pod is another)."""
    ref = event.get("involvedObject") or event.get("regarding") or {}
    if ref.get("kind") != kind or ref.get("name") != name:
        return False
    if (ref.get("namespace") or (event.get("metadata") or {}).get("namespace")) != namespace:
        return False
    return not (uid and ref.get("uid") and ref.get("uid") != uid)


def _state(view: ClusterView) -> ClusterState:
    state = ClusterState()
    for device_class in view.classes:
        state.upsert_class(device_class)
    for resource_slice in view.slices:
        state.upsert_slice(resource_slice)
    for node in view.nodes:
        meta = node.get("metadata") or {}
        state.upsert_node(str(meta.get("name")), meta.get("labels") or {})
    for claim in view.all_claims:
        if _allocated(claim):
            state.upsert_claim(claim)
    return state


def _holder(pod: Mapping[str, Any], impossible: Sequence[str] = ()) -> list[str]:
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return ["is being deleted"]
    if spec.get("nodeName"):
        return [
            f"is bound to node {spec['nodeName']} (phase {status.get('phase') or 'Pending'}): not held back"
        ]
    gates = [str(g.get("name")) for g in spec.get("schedulingGates") or ()]
    lines = []
    if KUEUE_GATE in gates:
        lines.append(f"gated by {KUEUE_GATE}: Kueue has not admitted its workload (ours waits until it has)")
    if GATE in gates:
        lines.append(f"gated by {GATE}: the fractional-dra allocation controller has not placed it yet")
    for gate in gates:
        if gate not in (KUEUE_GATE, GATE):
            lines.append(f"gated by {gate} (not ours)")
    if not gates and impossible:
        lines.append("not gated and not bound: no node of this cluster can ever hold its claims (below)")
    elif not gates:
        lines.append("not gated and not bound: waiting for kube-scheduler")
        for condition in status.get("conditions") or ():
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                lines.append(f"  kube-scheduler: {condition.get('reason')}: {condition.get('message')}")
    return lines


def explain_pod(pod: dict[str, Any], view: ClusterView, *, policy: str = DEFAULT_POLICY) -> list[str]:
    """The lines ``fractional why`` prints (pure: reads only its arguments)."""
    meta = pod["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    claims_by_name = {c["metadata"]["name"]: c for c in view.claims}
    own_pending = [
        claims_by_name[r.claim_name]
        for r in pod_claim_refs(pod)
        if r.claim_name in claims_by_name and not _allocated(claims_by_name[r.claim_name])
    ]
    impossible = compute_impossible(own_pending, view.slices)
    lines = [f"pod {namespace}/{name}:", *(f"  {line}" for line in _holder(pod, impossible))]
    pending: list[dict[str, Any]] = []
    lines.append("claims:")
    refs = pod_claim_refs(pod)
    if not refs:
        lines.append("  none")
    for ref in refs:
        claim = claims_by_name.get(ref.claim_name or "")
        if claim is None:
            what = "from a template, not created yet" if ref.from_template else "not found"
            lines.append(f"  {ref.entry}: ResourceClaim {ref.claim_name or '?'} {what}")
            continue
        if _allocated(claim):
            results = claim["status"]["allocation"]["devices"].get("results") or ()
            where = ", ".join(f"{r['pool']}/{r['device']}" for r in results) or "no devices"
            lines.append(f"  {claim['metadata']['name']}: allocated ({where})")
        else:
            pending.append(claim)
            lines.append(f"  {claim['metadata']['name']}: not allocated; asks for {describe_demand([claim])}")

    gang_ref = identify(pod)  # every source: PodGroup, Workload, our label, the third-party markers
    gang = gang_ref.key
    members = [p for p in view.pods if identify(p).key == gang]
    if gang_ref.source is not None:
        # A size the pods carry (ours, Kueue, LWS); a PodGroup's or Workload's minCount is not read here.
        size = (
            gang_size_of(pod)
            if gang_ref.source is GangSource.FRACTIONAL
            else resolve(gang_ref, lambda _k, _n: None).min_count
        )
        gated = sum(1 for p in members if is_gated(p))
        lines.append(
            f"gang {gang}: {size if size is not None else '?'} pods expected, "
            f"{len(members)} present, {gated} gated"
        )
        if size is not None and len(members) < size:
            lines.append(f"  waits for {size - len(members)} more pod(s) of the gang to exist")

    if impossible:
        lines.append("impossible: no GPU in the cluster can ever hold this request, whatever is freed:")
        lines += [f"  {reason}" for reason in impossible]
    state = _state(view) if view.slices else None
    need = gpu_need(pending)
    # Only the nodes this pod may run on (its nodeSelector, affinity, tolerations), as the
    # controller counts them: room on a node the pod is kept off is no answer.
    admitting = {str(n["metadata"]["name"]) for n in view.nodes if node_admits_pod(pod, n)}
    if need is not None and state is not None:
        gpus = build_gpu_capacities(state.free_summary(), products_from_slices(view.slices))
        fits = [f for f in compute_device_fits(gpus, need) if not view.nodes or f.node in admitting]
        lines.append("closest GPUs and what each lacks:")
        for fit in fits[:CLOSEST]:
            lacks = "; ".join(fit.lacks) or "fits on memory and compute (selectors or constraints decide)"
            lines.append(f"  {fit.node}/{fit.device} ({fit.product}): {lacks}")
        if not fits:
            lines.append(
                "  no GPU of fractional.dev is published on a node this pod may use"
                f" ({len(admitting)} of {len(view.nodes)} nodes admit it)"
            )
    if pending and state is not None and is_gated(pod):
        groups = []
        for member in members:
            member_claims = [
                claims_by_name[r.claim_name]
                for r in pod_claim_refs(member)
                if r.claim_name in claims_by_name and not _allocated(claims_by_name[r.claim_name])
            ]
            if is_gated(member) and member_claims:
                groups.append(PodGroup(pods=(member,), pending_claims=tuple(member_claims), pinned_node=None))
        node_names = [
            str(n["metadata"]["name"])
            for n in view.nodes
            if all(node_admits_pod(g.pods[0], n) for g in groups)
        ]
        offer = best_node_offer(state, groups, node_names, policy=policy)
        if offer is not None and offer.shares:
            lines.append(
                f"best single node: {offer.node} has room for {offer.pods} of {len(groups)} gated pod(s) "
                f"({offer.shares} devices)"
            )
        elif groups:
            lines.append("best single node: none has room for any of its pods")
    hint = (meta.get("annotations") or {}).get(HINT_ANNOTATION)
    lines.append(f"scale-up hint: {hint}" if hint else "scale-up hint: none")
    lines += _provisioning_lines(
        meta.get("annotations") or {},
        view.provisioning_requests,
        _usable_nodes(view, admitting),
        view.slices,
        since=str(meta.get("creationTimestamp") or ""),
    )
    about = [("Pod", str(p["metadata"]["name"]), p["metadata"].get("uid")) for p in [pod, *members]]
    if gang_ref.source in (GangSource.PODGROUP, GangSource.COSCHEDULING, GangSource.VOLCANO):
        about.append(("PodGroup", gang_ref.name, None))
    elif gang_ref.source is GangSource.WORKLOAD:
        about.append(("Workload", gang_ref.name, None))
    related = [e for e in view.events if any(event_is_about(e, k, namespace, n, u) for k, n, u in about)]
    related.sort(key=_event_time)
    lines += _consolidation_lines(pod, related)
    if related:
        lines.append("latest events:")
        for event in related[-3:]:
            text = event.get("message") or event.get("note")
            lines.append(f"  {event.get('reason')}: {text}")
    return lines


def _consolidation_lines(pod: Mapping[str, Any], related: Sequence[Mapping[str, Any]]) -> list[str]:
    """The latest word of the consolidation about this gated pod (``related``: its events, oldest first)."""
    said = [e for e in related if e.get("reason") in (CONSOLIDATING, CONSOLIDATION_BLOCKED)]
    if not said or not is_gated(dict(pod)):
        return []
    latest = said[-1]
    text = latest.get("message") or latest.get("note") or ""
    if latest.get("reason") == CONSOLIDATING:
        nominated = (pod.get("status") or {}).get("nominatedNodeName")
        where = f" on node {nominated}" if nominated else ""
        return [f"waits for a consolidation: pods are being moved to make room for it{where}", f"  {text}"]
    return [f"consolidation: nothing moved for it: {text}"]


def _usable_nodes(view: ClusterView, admitting: set[str]) -> list[dict[str, Any]]:
    return [n for n in view.nodes if str(n["metadata"]["name"]) in admitting]


def _is_ready(node: Mapping[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _arrived(since: str, nodes: Sequence[dict[str, Any]], slices: Sequence[Mapping[str, Any]]) -> str:
    """The nodes (the pod may use) created since the pod was: what cluster-autoscaler added,
    and whether each is Ready and has our devices published. A node Ready for minutes without our
    slices is one whose agent does not run or cannot publish (seen with the real cluster-autoscaler,
    which counts such a node as still coming, so it never adds another)."""
    ours = {
        str((s.get("spec") or {}).get("nodeName"))
        for s in slices
        if (s.get("spec") or {}).get("driver") == DRIVER_NAME
    }
    said = []
    for node in nodes:
        meta = node.get("metadata") or {}
        if since and str(meta.get("creationTimestamp") or "") > since:  # in a later second
            name = str(meta.get("name"))
            if not _is_ready(node):
                said.append(f"{name} (not Ready yet)")
            elif name in ours:
                said.append(f"{name} (Ready, devices published)")
            else:
                said.append(
                    f"{name} (Ready, no {DRIVER_NAME} devices published: is our node agent running there?)"
                )
    return "; nodes added since the pod was created: " + ", ".join(said) if said else "; no node added yet"


def _provisioning_lines(
    annotations: Mapping[str, str],
    requests: Sequence[dict[str, Any]],
    nodes: Sequence[dict[str, Any]] = (),
    slices: Sequence[Mapping[str, Any]] = (),
    *,
    since: str = "",
) -> list[str]:
    """What became of the ProvisioningRequest that asks for the pod's nodes, if one does."""
    name = annotations.get(PROVISIONING_ANNOTATION)
    if not name:
        return []
    whose = "ours" if name == annotations.get(PROVISIONING_OURS_ANNOTATION) else "not ours: Kueue's check"
    request = next((r for r in requests if (r.get("metadata") or {}).get("name") == name), None)
    if request is None:
        return [f"ProvisioningRequest {name} ({whose}): gone (it ended, or the gang was placed)"]
    phase, why = phase_of(request)
    line = f"ProvisioningRequest {name} ({whose}): {why}"
    if phase is Phase.PROVISIONED:
        line += "; waits for the new nodes and their ResourceSlices"
    elif phase is Phase.ENDED:
        line += "; the controller deletes it and asks again after a backoff"
    else:
        line += "; cluster-autoscaler has not found the capacity yet"
    # In every phase: a node added for an earlier attempt that never published is why a later one
    # finds no capacity (cluster-autoscaler stops counting it as coming past its provision time).
    return [line + _arrived(since, nodes, slices)]


def _event_time(event: Mapping[str, Any]) -> str:
    series = event.get("series") or {}
    return str(
        series.get("lastObservedTime") or event.get("lastTimestamp") or event.get("eventTime")
        or event.get("firstTimestamp") or ""
    )  # fmt: skip


def read_view(configuration: Any, namespace: str) -> ClusterView:
    from kubernetes import client

    from driver.kube import REQUEST_TIMEOUT_SECONDS, api_errors, as_dict, new_api_client

    api_client = new_api_client(configuration)
    core = client.CoreV1Api(api_client)
    resource = client.ResourceV1Api(api_client)
    timeout = REQUEST_TIMEOUT_SECONDS

    def items(what: str, call: Any, *args: Any) -> list[dict[str, Any]]:
        with api_errors(f"list {what}"):
            return [as_dict(item) for item in call(*args, _request_timeout=timeout).items]

    return ClusterView(
        pods=items(f"Pods in {namespace}", core.list_namespaced_pod, namespace),
        claims=items(f"ResourceClaims in {namespace}", resource.list_namespaced_resource_claim, namespace),
        all_claims=items("ResourceClaims", resource.list_resource_claim_for_all_namespaces),
        slices=items("ResourceSlices", resource.list_resource_slice),
        classes=items("DeviceClasses", resource.list_device_class),
        nodes=items("Nodes", core.list_node),
        events=items(f"Events in {namespace}", core.list_namespaced_event, namespace),
        provisioning_requests=_provisioning_requests(api_client, namespace),
    )


def _provisioning_requests(api_client: Any, namespace: str) -> list[dict[str, Any]]:
    from kubernetes import client

    from driver.errors import NotFoundError
    from driver.kube import REQUEST_TIMEOUT_SECONDS, api_errors

    try:
        with api_errors(f"list ProvisioningRequests in {namespace}"):
            listed = client.CustomObjectsApi(api_client).list_namespaced_custom_object(
                "autoscaling.x-k8s.io", "v1", namespace, "provisioningrequests",
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            )  # fmt: skip
    except NotFoundError:
        return []  # cluster-autoscaler's CRD is not installed
    return list(cast(dict[str, Any], listed).get("items") or ())


def run_why(config: WhyConfig) -> list[str]:
    """Raises ``FractionalError`` when the pod does not exist."""
    from driver.kube.client import load_configuration

    namespace, name = config.pod.split("/", 1)
    view = read_view(load_configuration(config.kubeconfig), namespace)
    pod = next((p for p in view.pods if p["metadata"]["name"] == name), None)
    if pod is None:
        raise FractionalError(f"pod {config.pod} not found")
    return explain_pod(pod, view, policy=config.policy)

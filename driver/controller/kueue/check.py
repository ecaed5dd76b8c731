"""The Kueue admission check ``fractional.dev/placement``: pure decisions (no I/O).

Kueue (v0.19, ``kueue.x-k8s.io/v1beta2``; see kubernetes-sigs/kueue
``apis/kueue/v1beta2/admissioncheck_types.go`` and docs/kueue.md section 2) reserves quota
for a Workload, then waits for every AdmissionCheck of its ClusterQueue. Ours answers whether our
allocator can place the whole workload now, all pod sets as one gang, against the published slices,
the current allocations and the reservations of workloads we admitted whose pods have not come yet:

- fits: ``Ready``, with ``podSetUpdates`` annotations tying each pod set's pods to the reservation
  (and the gang size); the planned allocations are held (``Reservation``) for a bounded time;
- would fit on more nodes of a known shape: ``Retry`` with a capped-backoff ``requeueAfterSeconds``,
  naming the fragmentation and the scale-up hint;
- can never fit (no node shape can hold it, a template missing, a claim Kueue refuses): ``Rejected``.

Only our own entry of ``status.admissionChecks`` is ever built here; the others are copied as read.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from driver.allocator import AllocationError, ClusterState
from driver.controller.model.objects import (
    GANG_SIZE_ANNOTATION,
    GATE,
    PROVISIONING_ANNOTATION,
    PROVISIONING_OURS_ANNOTATION,
    allocation_node,
    quantity,
)
from driver.controller.sizing.hints import NodeShape, compute_hint, existing_node_shapes

__all__ = [
    "CONTROLLER_NAME",
    "KUEUE_GATES",
    "POD_SET_ANNOTATION",
    "RESERVATION_ANNOTATION",
    "CheckDecision",
    "PlannedPod",
    "Reservation",
    "WorkloadClaims",
    "build_active_condition",
    "build_check_status",
    "build_workload_claims",
    "compute_backoff_seconds",
    "decide_workload",
    "find_check",
    "foreign_gates",
    "kueue_provisions",
    "reservation_wait_reason",
    "quota_reserved",
    "reservation_problem",
]

CONTROLLER_NAME = "fractional.dev/placement"
RESERVATION_ANNOTATION = "fractional.dev/reservation"  # "<namespace>/<workload name>"
POD_SET_ANNOTATION = "fractional.dev/pod-set"
KUEUE_GATES = ("kueue.x-k8s.io/admission", "kueue.x-k8s.io/topology", "kueue.x-k8s.io/elastic-job")
# What Kueue's ProvisioningRequest check merges into the pods of the workloads it provisioned
# (kubernetes-sigs/kueue pkg/controller/admissionchecks/provisioning: ConsumesAnnotationKey), the
# same key our own --provisioning-requests path writes: ours names the request that our annotation
# beside it names too (PROVISIONING_OURS_ANNOTATION), Kueue's names another.
KUEUE_PROVISIONING_ANNOTATION = PROVISIONING_ANNOTATION
MAX_MESSAGE_CHARS = 32768  # the CRD's maxLength of admissionChecks[].message
GI = 1024**3


def foreign_gates(pod: Mapping[str, Any]) -> list[str]:
    """Kueue's scheduling gates still on ``pod`` (we act only once ours is the last one)."""
    gates = (pod.get("spec") or {}).get("schedulingGates") or ()
    return [str(g.get("name")) for g in gates if g.get("name") in KUEUE_GATES]


def kueue_provisions(pods: Iterable[Mapping[str, Any]]) -> bool:
    """True when Kueue's ProvisioningRequest check already asked for nodes for these pods (their
    ClusterQueue runs it): we then publish no ProvisioningRequest of our own for them."""
    for pod in pods:
        annotations = (pod.get("metadata") or {}).get("annotations") or {}
        consumed = annotations.get(KUEUE_PROVISIONING_ANNOTATION)
        if consumed and consumed != annotations.get(PROVISIONING_OURS_ANNOTATION):
            return True
    return False


def reservation_wait_reason(pods: Iterable[Mapping[str, Any]]) -> str:
    """Why the generic gang path leaves these gated pods alone ('' when it need not): Kueue's gate is
    still on one of them, or the admission check placed them (it allocates them per its plan)."""
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name")
        if gates := foreign_gates(pod):
            return f"pod {name} still carries Kueue's scheduling gate {gates[0]}"
        reservation = ((pod.get("metadata") or {}).get("annotations") or {}).get(RESERVATION_ANNOTATION)
        if reservation:
            return (
                f"pod {name} is placed by the Kueue admission check (reservation of Workload {reservation})"
            )
    return ""


def quota_reserved(workload: Mapping[str, Any]) -> bool:
    conditions = (workload.get("status") or {}).get("conditions") or ()
    reserved = any(c.get("type") == "QuotaReserved" and c.get("status") == "True" for c in conditions)
    finished = any(c.get("type") == "Finished" and c.get("status") == "True" for c in conditions)
    return reserved and not finished and bool((workload.get("status") or {}).get("admission"))


def find_check(workload: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any] | None:
    """Our entry of ``status.admissionChecks`` (the first whose name is one of our checks)."""
    wanted = set(names)
    for entry in (workload.get("status") or {}).get("admissionChecks") or ():
        if entry.get("name") in wanted:
            return dict(entry)
    return None


def _timestamp(now: datetime.datetime) -> str:
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_active_condition(check: Mapping[str, Any], now: datetime.datetime) -> list[dict[str, Any]] | None:
    """The AdmissionCheck's conditions with ``Active=True``; None when already so for this generation."""
    generation = int((check.get("metadata") or {}).get("generation") or 1)
    conditions = list((check.get("status") or {}).get("conditions") or ())
    for condition in conditions:
        if (
            condition.get("type") == "Active"
            and condition.get("status") == "True"
            and condition.get("observedGeneration") == generation
        ):
            return None
    kept = [c for c in conditions if c.get("type") != "Active"]
    kept.append({
        "type": "Active", "status": "True", "reason": "Active", "observedGeneration": generation,
        "message": "fractional.dev places workloads with its allocator",
        "lastTransitionTime": _timestamp(now),
    })  # fmt: skip
    return kept


def compute_backoff_seconds(retry_count: int, *, base_seconds: int = 15, max_seconds: int = 600) -> int:
    """Capped exponential backoff for ``requeueAfterSeconds`` (Kueue keeps ``retryCount``)."""
    return int(min(max_seconds, base_seconds * 2 ** min(max(retry_count, 0), 16)))


# -------------------------------------------------------------------------- the workload as a gang


@dataclass(frozen=True, slots=True)
class PlannedPod:
    pod_set: str
    index: int  # the pod's place within its pod set
    entries: tuple[str, ...]  # the pod's resourceClaims[].name, in order, one claim each


@dataclass(frozen=True, slots=True)
class WorkloadClaims:
    """Every pod of every pod set with the claims its templates make, flattened for the allocator."""

    claims: tuple[dict[str, Any], ...]
    pod_groups: tuple[tuple[int, ...], ...]  # claim indexes per pod
    pods: tuple[PlannedPod, ...]
    size: int  # pods in all


class WorkloadProblem(Exception):
    """The workload cannot be planned at all (its message names why)."""


def build_workload_claims(
    workload: Mapping[str, Any], templates: Mapping[str, Mapping[str, Any]]
) -> WorkloadClaims:
    """The claims each pod would get from its ResourceClaimTemplates (``templates``: name -> object,
    of the workload's namespace); raises WorkloadProblem for what can never be placed."""
    meta = workload.get("metadata") or {}
    namespace, name = str(meta.get("namespace")), str(meta.get("name"))
    claims: list[dict[str, Any]] = []
    groups: list[tuple[int, ...]] = []
    pods: list[PlannedPod] = []
    for pod_set in (workload.get("spec") or {}).get("podSets") or ():
        set_name = str(pod_set.get("name"))
        spec = (pod_set.get("template") or {}).get("spec") or {}
        count = int(pod_set.get("count", 1))
        entries = list(spec.get("resourceClaims") or ())
        for entry in entries:
            if entry.get("resourceClaimName"):
                raise WorkloadProblem(
                    f"pod set {set_name}: resourceClaims[{entry.get('name')}] names ResourceClaim "
                    f"{entry['resourceClaimName']} directly; only templates can be planned per pod"
                )
            template_name = entry.get("resourceClaimTemplateName")
            if template_name and template_name not in templates:
                raise WorkloadProblem(
                    f"pod set {set_name}: ResourceClaimTemplate {namespace}/{template_name} not found"
                )
        for index in range(count):
            group = []
            for entry in entries:
                template = templates[str(entry["resourceClaimTemplateName"])]
                claim_name = f"{name}-{set_name}-{index}-{entry.get('name')}"
                group.append(len(claims))
                claims.append({
                    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                    "metadata": {"name": claim_name, "namespace": namespace, "uid": f"plan-{claim_name}"},
                    "spec": dict((template.get("spec") or {}).get("spec") or {}),
                })  # fmt: skip
            groups.append(tuple(group))
            pods.append(PlannedPod(set_name, index, tuple(str(e.get("name")) for e in entries)))
    return WorkloadClaims(tuple(claims), tuple(groups), tuple(pods), len(pods))


# -------------------------------------------------------------------------- reservations


@dataclass(frozen=True, slots=True)
class Reservation:
    """The allocations held for an admitted workload until its pods arrive (or it expires)."""

    workload: str  # "<namespace>/<name>"
    uid: str
    pods: tuple[PlannedPod, ...]
    allocations: tuple[tuple[dict[str, Any], ...], ...]  # per pod, one per entry
    expires_at: float  # monotonic seconds

    def as_claims(self) -> list[dict[str, Any]]:
        """Synthetic allocated claims: what the allocator must treat as taken."""
        claims = []
        for pod, allocations in zip(self.pods, self.allocations, strict=True):
            for entry, allocation in zip(pod.entries, allocations, strict=True):
                name = f"reservation-{self.uid}-{pod.pod_set}-{pod.index}-{entry}"
                claims.append({
                    "metadata": {"name": name, "namespace": self.workload.split("/", 1)[0], "uid": name},
                    "spec": {}, "status": {"allocation": allocation},
                })  # fmt: skip
        return claims


def _device_capacities(slices: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    found = {}
    for resource_slice in slices:
        spec = resource_slice.get("spec") or {}
        pool = str((spec.get("pool") or {}).get("name"))
        for device in spec.get("devices") or ():
            found[(str(spec.get("driver")), pool, str(device.get("name")))] = device
    return found


def reservation_problem(
    reservation: Reservation, *, slices: Iterable[Mapping[str, Any]], allocated: Iterable[Mapping[str, Any]]
) -> str:
    """Why the held allocations can no longer be honoured ('' while they can): a device gone, taken
    whole by another claim (or used by one where we hold it whole), or its capacity now short."""
    devices = _device_capacities(slices)
    whole: set[tuple[str, str, str]] = set()
    users: dict[tuple[str, str, str], int] = {}
    consumed: dict[tuple[str, str, str], dict[str, Any]] = {}

    def results(allocation: Mapping[str, Any]) -> Iterable[tuple[tuple[str, str, str], Mapping[str, Any]]]:
        for result in ((allocation.get("devices") or {}).get("results")) or ():
            yield (str(result.get("driver")), str(result.get("pool")), str(result.get("device"))), result

    for claim in allocated:
        for key, result in results((claim.get("status") or {}).get("allocation") or {}):
            users[key] = users.get(key, 0) + 1
            if result.get("shareID") is None:
                whole.add(key)
            used = consumed.setdefault(key, {})
            for name, value in (result.get("consumedCapacity") or {}).items():
                used[name] = used.get(name, 0) + quantity(value)
    for allocations in reservation.allocations:
        for allocation in allocations:
            for key, result in results(allocation):
                where = f"device {key[1]}/{key[2]}"
                device = devices.get(key)
                if device is None:
                    return f"{where} is no longer published"
                if key in whole:
                    return f"{where} is now allocated whole to another claim"
                if result.get("shareID") is None and users.get(key):
                    return f"{where}, held whole, is now used by another claim"
                users[key] = users.get(key, 0) + 1
                used = consumed.setdefault(key, {})
                for name, value in (result.get("consumedCapacity") or {}).items():
                    used[name] = used.get(name, 0) + quantity(value)
                    total = ((device.get("capacity") or {}).get(name) or {}).get("value")
                    if total is not None and used[name] > quantity(total):
                        return f"{where}: {name} is now short for the reservation"
    return ""


# -------------------------------------------------------------------------- the decision


@dataclass(frozen=True, slots=True)
class CheckDecision:
    state: str  # Ready | Retry | Rejected
    message: str
    allocations: tuple[tuple[dict[str, Any], ...], ...] = ()  # per pod (Ready)
    nodes: tuple[str, ...] = ()  # the nodes the plan uses (Ready)
    hint: str = ""
    pods: tuple[PlannedPod, ...] = field(default=())


def _describe_gpu_demand(claims: Sequence[Mapping[str, Any]]) -> str:
    sizes: dict[str, int] = {}
    for claim in claims:
        for request in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ():
            exactly = request.get("exactly") or {}
            memory = ((exactly.get("capacity") or {}).get("requests") or {}).get("memory")
            what = f"{memory} GPU share" if memory else f"{exactly.get('deviceClassName', 'device')}"
            sizes[what] = sizes.get(what, 0) + int(exactly.get("count", 1))
    return ", ".join(f"{n} x {what}" for what, n in sorted(sizes.items())) or "no devices"


def _free_gpu_memory(state: ClusterState) -> list[int]:
    free = []
    for devices in state.free_summary().values():
        for info in devices.values():
            if "memory_bytes_total" in info and not info.get("exclusive"):
                free.append(int(info.get("memory_bytes_free") or 0))
    return free


def _gib(value: int) -> str:
    return f"{value / GI:.4g}Gi"


def decide_workload(
    wanted: WorkloadClaims,
    *,
    slices: Sequence[dict[str, Any]],
    classes: Sequence[dict[str, Any]],
    allocated: Sequence[dict[str, Any]],
    nodes: Sequence[dict[str, Any]],
    shapes: Sequence[NodeShape] = (),
    policy: str = "best-fit",
    topology_label: str = "topology.kubernetes.io/zone",
) -> CheckDecision:
    """Ready (with the plan), Retry (fits on more nodes of a known shape) or Rejected (never)."""
    if not wanted.claims:
        return CheckDecision("Ready", "no device claims: nothing to place", pods=wanted.pods)
    state = ClusterState(topology_label=topology_label)
    for device_class in classes:
        state.upsert_class(device_class)
    for resource_slice in slices:
        state.upsert_slice(resource_slice)
    for node in nodes:
        state.upsert_node(str(node["metadata"]["name"]), dict(node["metadata"].get("labels") or {}))
    for claim in allocated:
        state.upsert_claim(claim)
    demand = _describe_gpu_demand(wanted.claims)
    try:
        result = state.allocate(
            list(wanted.claims), policy=policy, pod_groups=[list(g) for g in wanted.pod_groups]
        )
    except AllocationError as error:
        return CheckDecision("Rejected", f"the workload's claims cannot be allocated: {error}")
    if result is not None:
        per_pod = tuple(tuple(result[i] for i in group) for group in wanted.pod_groups)
        used = tuple(sorted({n for n in (allocation_node(a) for a in result) if n}))
        return CheckDecision(
            "Ready",
            f"fractional.dev reserved {demand} for {wanted.size} pod(s) on {', '.join(used) or 'any node'}",
            allocations=per_pod, nodes=used, pods=wanted.pods,
        )  # fmt: skip
    free = sorted(_free_gpu_memory(state), reverse=True)
    shape_list = list(shapes) or existing_node_shapes(list(slices), list(nodes))
    hint = compute_hint(
        list(wanted.claims), pod_groups=[list(g) for g in wanted.pod_groups], shapes=shape_list,
        cluster_slices=slices, classes=classes, allocated_claims=allocated, nodes=nodes, policy=policy,
        topology_label=topology_label,
    )  # fmt: skip
    fragmentation = (
        f"{len(free)} GPU(s) with {_gib(sum(free))} free in all, the largest free on one GPU {_gib(free[0])}"
        if free
        else "no GPU has free memory"
    )
    if hint is None:
        return CheckDecision(
            "Rejected",
            f"the workload ({demand}, {wanted.size} pod(s)) does not fit on any number of nodes of any known "
            f"shape ({', '.join(s.name for s in shape_list) or 'none'}): a pod asks more than a node offers",
        )
    text = f"{hint.nodes} more node(s) like {hint.profile}"
    return CheckDecision(
        "Retry",
        f"does not fit now: {demand} for {wanted.size} pod(s) cannot be placed; "
        f"fragmentation: {fragmentation}; scale-up hint: it would fit on {text}",
        hint=text,
    )


def build_check_status(
    workload: Mapping[str, Any],
    check_name: str,
    *,
    state: str,
    message: str,
    now: datetime.datetime,
    requeue_after_seconds: int | None = None,
    pod_set_updates: Sequence[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """``status.admissionChecks`` with only our entry changed (others copied as read)."""
    entries = []
    for entry in (workload.get("status") or {}).get("admissionChecks") or ():
        if entry.get("name") != check_name:
            entries.append(dict(entry))
            continue
        updated = {k: v for k, v in entry.items() if k not in ("podSetUpdates", "requeueAfterSeconds")}
        if entry.get("state") != state:
            updated["lastTransitionTime"] = _timestamp(now)
        updated["state"] = state
        updated["message"] = message[:MAX_MESSAGE_CHARS]
        if requeue_after_seconds is not None:
            updated["requeueAfterSeconds"] = requeue_after_seconds
        if pod_set_updates:
            updated["podSetUpdates"] = [dict(u) for u in pod_set_updates]
        entries.append(updated)
    return entries


def build_pod_set_updates(workload: Mapping[str, Any], size: int) -> list[dict[str, Any]]:
    """Per pod set, the annotations that tie its pods to our reservation and name the gang size.
    A key the pod template already sets is left out: Kueue fails admission when an update would
    change a value the template has (podSetUpdates are additive only)."""
    meta = workload.get("metadata") or {}
    key = f"{meta.get('namespace')}/{meta.get('name')}"
    updates = []
    for pod_set in (workload.get("spec") or {}).get("podSets") or ():
        present = (((pod_set.get("template") or {}).get("metadata") or {}).get("annotations")) or {}
        wanted = {
            RESERVATION_ANNOTATION: key,
            POD_SET_ANNOTATION: str(pod_set.get("name")),
            GANG_SIZE_ANNOTATION: str(size),
        }
        annotations = {k: v for k, v in wanted.items() if k not in present}
        updates.append({"name": str(pod_set.get("name")), "annotations": annotations})
    return updates


def ours_is_last_gate(pod: Mapping[str, Any]) -> bool:
    """True when the pod carries our gate and no Kueue gate."""
    gates = [str(g.get("name")) for g in (pod.get("spec") or {}).get("schedulingGates") or ()]
    return GATE in gates and not any(g in KUEUE_GATES for g in gates)

"""Names the controller relies on (docs/architecture.md: Contracts) and pure readers of API-shaped dicts.

Everything here takes the camelCase dicts the API server serves and returns plain values; no I/O.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, NewType

from kubernetes.utils import parse_quantity

__all__ = [
    "FIELD_MANAGER",
    "FINALIZER",
    "GANG_LABEL",
    "GANG_SIZE_ANNOTATION",
    "GATE",
    "HINT_ANNOTATION",
    "PLACED_ANNOTATION",
    "PROVISIONING_ANNOTATION",
    "PROVISIONING_CLASS_ANNOTATION",
    "PROVISIONING_OURS_ANNOTATION",
    "RESERVED_FINALIZER",
    "ClaimRef",
    "GangKey",
    "ObjectKey",
    "Resources",
    "allocated_by_us",
    "allocation_node",
    "gang_key_of",
    "gang_size_of",
    "has_finalizer",
    "is_deleting",
    "is_gated",
    "is_ours",
    "is_terminated",
    "kept_managed_fields",
    "node_allocatable",
    "object_key",
    "placed_by_us",
    "pod_claim_refs",
    "pod_consumer",
    "pod_requests",
    "quantity",
    "reserved_pods",
    "resource_version_is_older",
]

GATE = "fractional.dev/allocation"
GANG_LABEL = "fractional.dev/gang"
GANG_SIZE_ANNOTATION = "fractional.dev/gang-size"
HINT_ANNOTATION = "fractional.dev/scale-up-hint"
# Written on a pod in the write that removes our gate (the node chosen, or "" when its claims name
# none): the pod was placed by us, so a claim of it that lost its allocation lost ours.
PLACED_ANNOTATION = "fractional.dev/placed-on"
# The pod annotations cluster-autoscaler reads (its v1 types.go ProvisioningRequestPodAnnotationKey
# and ProvisioningClassPodAnnotationKey; the cluster-autoscaler.kubernetes.io twins are deprecated),
# and ours beside them naming the same request: a consume annotation naming another request was put
# there by someone else (Kueue's ProvisioningRequest admission check).
PROVISIONING_ANNOTATION = "autoscaling.x-k8s.io/consume-provisioning-request"
PROVISIONING_CLASS_ANNOTATION = "autoscaling.x-k8s.io/provisioning-class-name"
PROVISIONING_OURS_ANNOTATION = "fractional.dev/provisioning-request"
# Our finalizer: written on claims only by earlier versions of the controller (one write per pod that
# kube-scheduler's own path has no match for); still removed where found, so that their claims can go.
FINALIZER = "fractional.dev/allocation"
RESERVED_FINALIZER = "resource.kubernetes.io/delete-protection"  # Kubernetes' own; never ours to touch

ObjectKey = NewType("ObjectKey", str)  # "namespace/name", or "name" for cluster-scoped kinds
GangKey = NewType("GangKey", str)  # "namespace/<gang label>" or "namespace/pod:<pod name>"


def object_key(obj: dict[str, Any]) -> ObjectKey:
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace")
    return ObjectKey(f"{namespace}/{meta.get('name')}" if namespace else str(meta.get("name")))


def is_gated(pod: dict[str, Any]) -> bool:
    gates = (pod.get("spec") or {}).get("schedulingGates") or ()
    return any(gate.get("name") == GATE for gate in gates)


def is_terminated(pod: dict[str, Any]) -> bool:
    return ((pod.get("status") or {}).get("phase")) in ("Succeeded", "Failed")


def is_deleting(obj: dict[str, Any]) -> bool:
    return bool((obj.get("metadata") or {}).get("deletionTimestamp"))


def has_finalizer(obj: dict[str, Any], finalizer: str = FINALIZER) -> bool:
    return finalizer in ((obj.get("metadata") or {}).get("finalizers") or ())


# The manager every controller write names (``?fieldManager=``): kube-apiserver records under it the
# fields each write changed, so an allocation we wrote says so itself in ``metadata.managedFields``.
FIELD_MANAGER = "fractional-dra-controller"
_OURS_IN_STATUS = {"manager": FIELD_MANAGER, "operation": "Update", "subresource": "status",
                   "fieldsV1": {"f:status": {"f:allocation": {}}}}  # fmt: skip


def _manages_allocation(entry: Any) -> bool:
    if not isinstance(entry, dict) or entry.get("manager") != FIELD_MANAGER:
        return False
    status = (entry.get("fieldsV1") or {}).get("f:status")
    return isinstance(status, dict) and "f:allocation" in status


def kept_managed_fields(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """What a held claim keeps of ``metadata.managedFields`` (the cache drops the rest): the one
    fact ``allocated_by_us`` reads, in the server's own shape."""
    fields = (obj.get("metadata") or {}).get("managedFields") or ()
    return [dict(_OURS_IN_STATUS)] if any(_manages_allocation(e) for e in fields) else []


def allocated_by_us(claim: dict[str, Any]) -> bool:
    """An allocation this controller wrote: kube-apiserver lists ``status.allocation`` among the fields
    of our ``FIELD_MANAGER`` (ownership stays with the manager that set a field until another
    changes it; an allocation is immutable). A claim with our finalizer is one an earlier version
    of the controller allocated (it wrote no field manager)."""
    if not (claim.get("status") or {}).get("allocation"):
        return False
    if has_finalizer(claim):
        return True
    return any(_manages_allocation(e) for e in (claim.get("metadata") or {}).get("managedFields") or ())


def is_ours(claim: dict[str, Any]) -> bool:
    """A claim the controller must look after: allocated by us, or carrying our finalizer (an earlier
    version's, to be removed when the claim is released or deleted)."""
    return allocated_by_us(claim) or has_finalizer(claim)


def placed_by_us(pod: dict[str, Any]) -> bool:
    """The pod's gate was removed by us, with its claims allocated (``PLACED_ANNOTATION``)."""
    return PLACED_ANNOTATION in ((pod.get("metadata") or {}).get("annotations") or {})


def pod_consumer(pod: dict[str, Any]) -> dict[str, str]:
    """The ``status.reservedFor`` entry naming ``pod`` (a resource.k8s.io/v1
    ResourceClaimConsumerReference: ``apiGroup`` is the core group's empty name, left out)."""
    meta = pod.get("metadata") or {}
    return {"resource": "pods", "name": str(meta.get("name")), "uid": str(meta.get("uid"))}


def reserved_pods(claim: dict[str, Any]) -> tuple[tuple[str, str], ...] | None:
    """(name, uid) of each ``status.reservedFor`` entry, in order; None when an entry names
    anything but a core Pod (a PodGroup, KEP-5729, or another consumer type)."""
    pods = []
    for entry in (claim.get("status") or {}).get("reservedFor") or ():
        if not isinstance(entry, dict) or entry.get("apiGroup") or entry.get("resource") != "pods":
            return None
        pods.append((str(entry.get("name") or ""), str(entry.get("uid") or "")))
    return tuple(pods)


def generated_for(claim: dict[str, Any]) -> str | None:
    """The UID of the pod ``claim`` was made for (kube-controller-manager's claims from a
    template: their controlling ``ownerReferences`` entry is a core Pod); None for any other claim."""
    for ref in (claim.get("metadata") or {}).get("ownerReferences") or ():
        if isinstance(ref, dict) and ref.get("controller"):
            if ref.get("kind") == "Pod" and ref.get("apiVersion") == "v1" and ref.get("uid"):
                return str(ref["uid"])
            return None
    return None


def gang_key_of(pod: dict[str, Any]) -> GangKey:
    """Pods sharing a ``fractional.dev/gang`` label in a namespace form one gang; others a gang of one."""
    meta = pod.get("metadata") or {}
    gang = (meta.get("labels") or {}).get(GANG_LABEL)
    return GangKey(
        f"{meta.get('namespace')}/{gang}" if gang else f"{meta.get('namespace')}/pod:{meta.get('name')}"
    )


def gang_size_of(pod: dict[str, Any]) -> int | None:
    """The pod's ``fractional.dev/gang-size`` annotation, 1 without a gang label, None when unreadable."""
    meta = pod.get("metadata") or {}
    if not (meta.get("labels") or {}).get(GANG_LABEL):
        return 1
    raw = (meta.get("annotations") or {}).get(GANG_SIZE_ANNOTATION)
    if raw is None:
        return 1  # a gang label without a size: the pods present form the gang
    try:
        size = int(raw)
    except ValueError:
        return None
    return size if size >= 1 else None


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """One ``spec.resourceClaims`` entry of a pod, resolved to a claim name when known."""

    entry: str  # the pod-level name (spec.resourceClaims[].name)
    claim_name: str | None  # None: a template whose claim is not created yet
    from_template: bool


def pod_claim_refs(pod: dict[str, Any]) -> tuple[ClaimRef, ...]:
    """Resolve ``resourceClaimName`` directly and ``resourceClaimTemplateName`` through
    ``status.resourceClaimStatuses`` (an entry there with no claim name means "no claim needed",
    which is then left out)."""
    statuses = {s.get("name"): s for s in ((pod.get("status") or {}).get("resourceClaimStatuses") or ())}
    refs: list[ClaimRef] = []
    for entry in (pod.get("spec") or {}).get("resourceClaims") or ():
        name = str(entry.get("name"))
        if entry.get("resourceClaimName"):
            refs.append(ClaimRef(entry=name, claim_name=str(entry["resourceClaimName"]), from_template=False))
        elif entry.get("resourceClaimTemplateName"):
            status = statuses.get(name)
            if status is None:
                refs.append(ClaimRef(entry=name, claim_name=None, from_template=True))
            elif status.get("resourceClaimName"):
                refs.append(
                    ClaimRef(entry=name, claim_name=str(status["resourceClaimName"]), from_template=True)
                )
    return tuple(refs)


def allocation_node(allocation: dict[str, Any] | None) -> str | None:
    """The node an allocation is bound to (``matchFields metadata.name In [node]``), else None."""
    if not allocation:
        return None
    terms = ((allocation.get("nodeSelector") or {}).get("nodeSelectorTerms")) or ()
    for term in terms:
        for field in term.get("matchFields") or ():
            values: list[Any] = list(field.get("values") or ())
            if field.get("key") == "metadata.name" and field.get("operator") == "In" and len(values) == 1:
                return str(values[0])
    return None


def resource_version_is_older(candidate: str | None, current: str | None) -> bool:
    """True when ``candidate`` is known to be older than ``current``.

    resourceVersions are opaque, but every real server (and the emulator) uses integers; like
    upstream's assume cache we compare them as integers and never call an unparsable one older.
    """
    if not candidate or not current:
        return False
    try:
        return int(candidate) < int(current)
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class Resources:
    """CPU in millicores, memory in bytes, pod count; the three node-fit dimensions."""

    cpu_millis: int = 0
    memory_bytes: int = 0
    pods: int = 0

    def __add__(self, other: Resources) -> Resources:
        return Resources(
            self.cpu_millis + other.cpu_millis, self.memory_bytes + other.memory_bytes, self.pods + other.pods
        )

    def __sub__(self, other: Resources) -> Resources:
        return Resources(
            self.cpu_millis - other.cpu_millis, self.memory_bytes - other.memory_bytes, self.pods - other.pods
        )

    def fits_within(self, available: Resources) -> bool:
        return (
            self.cpu_millis <= available.cpu_millis
            and self.memory_bytes <= available.memory_bytes
            and self.pods <= available.pods
        )

    def shortfall(self, available: Resources) -> str:
        """The first dimension that does not fit, in words (empty when it fits)."""
        if self.cpu_millis > available.cpu_millis:
            return f"cpu {self.cpu_millis}m > {max(available.cpu_millis, 0)}m free"
        if self.memory_bytes > available.memory_bytes:
            return f"memory {self.memory_bytes} > {max(available.memory_bytes, 0)} bytes free"
        if self.pods > available.pods:
            return "no pod slots free"
        return ""


def quantity(value: Any) -> Decimal:
    """A Kubernetes quantity ("12Gi", "500m") as a number."""
    return _quantity(str(value))


@functools.lru_cache(maxsize=4096)
def _quantity(text: str) -> Decimal:
    """Parsed once per distinct text (a cluster's quantities repeat: every GPU of a model publishes
    the same capacity); a ``Decimal`` is immutable, so sharing it is safe."""
    return Decimal(parse_quantity(text))  # type: ignore[no-untyped-call]  # the client is untyped


def _container_requests(container: dict[str, Any]) -> tuple[int, int]:
    requests = ((container.get("resources") or {}).get("requests")) or {}
    limits = ((container.get("resources") or {}).get("limits")) or {}
    cpu = requests.get("cpu", limits.get("cpu", 0))  # the API defaults requests to limits
    memory = requests.get("memory", limits.get("memory", 0))
    return int((quantity(cpu) * 1000).to_integral_value(rounding="ROUND_CEILING")), int(quantity(memory))


def pod_requests(pod: dict[str, Any]) -> Resources:
    """What kube-scheduler's NodeResourcesFit counts: the sum over containers, at least each
    (non-sidecar) init container, plus ``spec.overhead``; one pod slot."""
    spec = pod.get("spec") or {}
    cpu = memory = 0
    sidecar_cpu = sidecar_memory = 0
    for container in spec.get("containers") or ():
        c, m = _container_requests(container)
        cpu, memory = cpu + c, memory + m
    init_cpu = init_memory = 0
    for container in spec.get("initContainers") or ():
        c, m = _container_requests(container)
        if container.get("restartPolicy") == "Always":  # a sidecar runs beside the app containers
            sidecar_cpu, sidecar_memory = sidecar_cpu + c, sidecar_memory + m
            continue
        init_cpu, init_memory = max(init_cpu, c + sidecar_cpu), max(init_memory, m + sidecar_memory)
    cpu, memory = max(cpu + sidecar_cpu, init_cpu), max(memory + sidecar_memory, init_memory)
    overhead = spec.get("overhead") or {}
    if "cpu" in overhead:
        cpu += int((quantity(overhead["cpu"]) * 1000).to_integral_value(rounding="ROUND_CEILING"))
    if "memory" in overhead:
        memory += int(quantity(overhead["memory"]))
    return Resources(cpu, memory, 1)


_UNLIMITED = 1 << 62


def node_allocatable(node: dict[str, Any]) -> Resources:
    """A node's ``status.allocatable``; a dimension the node does not report is not limited."""
    allocatable = ((node.get("status") or {}).get("allocatable")) or {}
    cpu = (
        int((quantity(allocatable["cpu"]) * 1000).to_integral_value(rounding="ROUND_FLOOR"))
        if "cpu" in allocatable
        else _UNLIMITED
    )
    memory = int(quantity(allocatable["memory"])) if "memory" in allocatable else _UNLIMITED
    pods = int(quantity(allocatable["pods"])) if "pods" in allocatable else _UNLIMITED
    return Resources(cpu, memory, pods)

"""Which gang a pod belongs to, and what that gang asks for: pure readers of API-shaped dicts.

A gated pod's gang is found from its own fields, first match wins among the sources turned on
(upstream API: KEP-4671 and kubernetes ``staging/src/k8s.io/api/scheduling/``):

(a) ``spec.schedulingGroup.podGroupName`` (``scheduling.k8s.io`` PodGroup, 1.36+);
(b) ``spec.workloadRef {name, podGroup, podGroupReplicaKey}`` (Workload, 1.35): one gang per
    replica key;
(c) our label ``fractional.dev/gang`` with its size in ``fractional.dev/gang-size``;
(d) third-party markers: scheduler-plugins coscheduling (label ``scheduling.x-k8s.io/pod-group``,
    its PodGroup's ``spec.minMember``), Kueue plain pod groups (label
    ``kueue.x-k8s.io/pod-group-name``, annotation ``kueue.x-k8s.io/pod-group-total-count``), LWS
    (label ``leaderworkerset.sigs.k8s.io/group-key``, annotation ``leaderworkerset.sigs.k8s.io/size``)
    and Volcano (annotation ``scheduling.k8s.io/group-name``, its PodGroup's ``spec.minMember``).

``identify`` reads the pod alone (the cache indexes by it); ``resolve`` then reads the gang's
objects (PodGroup, Workload, the CRDs) through a lookup and returns its ``GangSpec``: how many pods
must be placed together (``minCount``), a ``basic`` policy (pod by pod), the topology key, the
PodGroup's claims, and the object that Events about the gang also go to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from driver.controller.model.objects import GANG_LABEL, GANG_SIZE_ANNOTATION, ClaimRef, GangKey
from driver.gang_sources import (
    ALL_SOURCES,
    MARKER_SOURCES,
    UPSTREAM_SOURCES,
    GangSource,
    parse_gang_sources,
)

__all__ = [
    "ALL_SOURCES",
    "COSCHEDULING_LABEL",
    "KUEUE_GROUP_LABEL",
    "KUEUE_TOTAL_ANNOTATION",
    "LWS_GROUP_LABEL",
    "LWS_SIZE_ANNOTATION",
    "MARKER_SOURCES",
    "OBJECT_KINDS",
    "UPSTREAM_SOURCES",
    "VOLCANO_ANNOTATION",
    "GangRef",
    "GangSource",
    "GangSpec",
    "Lookup",
    "binds_to_podgroup",
    "default_sources",
    "gangs_of_object",
    "identify",
    "parse_gang_sources",
    "podgroup_claim",
    "resolve",
]

COSCHEDULING_LABEL = "scheduling.x-k8s.io/pod-group"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
LWS_GROUP_LABEL = "leaderworkerset.sigs.k8s.io/group-key"
LWS_SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"
VOLCANO_ANNOTATION = "scheduling.k8s.io/group-name"

# The cache kinds (plural, or plural.group for the custom resources) the gang objects live under.
PODGROUPS = "podgroups"
WORKLOADS = "workloads"
COSCHEDULING_PODGROUPS = "podgroups.scheduling.x-k8s.io"
VOLCANO_PODGROUPS = "podgroups.scheduling.volcano.sh"
OBJECT_KINDS = (PODGROUPS, WORKLOADS, COSCHEDULING_PODGROUPS, VOLCANO_PODGROUPS)

Lookup = Callable[[str, str], "dict[str, Any] | None"]
"""``lookup(kind, "namespace/name")``: the cached object, or None."""


# The API group whose presence turns a marker source on by default.
MARKER_GROUPS = {
    GangSource.COSCHEDULING: "scheduling.x-k8s.io",
    GangSource.KUEUE: "kueue.x-k8s.io",
    GangSource.LWS: "leaderworkerset.x-k8s.io",
    GangSource.VOLCANO: "scheduling.volcano.sh",
}


def default_sources(served_groups: Iterable[str]) -> frozenset[GangSource]:
    """The upstream API, ours, and each marker whose API group the cluster serves."""
    groups = set(served_groups)
    markers = {source for source, group in MARKER_GROUPS.items() if group in groups}
    return UPSTREAM_SOURCES | {GangSource.FRACTIONAL} | markers


@dataclass(frozen=True, slots=True)
class GangRef:
    """A pod's gang as its own fields say: the cache key and where to read the rest."""

    key: GangKey
    source: GangSource | None  # None: a gang of one
    namespace: str
    name: str = ""  # the PodGroup, Workload or marker value
    pod_group: str = ""  # Workload: the podGroups[].name
    size_text: str | None = None  # a size the pod itself carries (ours, Kueue, LWS)


def _meta(pod: dict[str, Any]) -> tuple[str, str, dict[str, str], dict[str, str]]:
    meta = pod.get("metadata") or {}
    return (
        str(meta.get("namespace") or ""),
        str(meta.get("name") or ""),
        dict(meta.get("labels") or {}),
        dict(meta.get("annotations") or {}),
    )


def identify(pod: dict[str, Any], sources: frozenset[GangSource] = ALL_SOURCES) -> GangRef:
    """The pod's gang, first match wins among ``sources``; a gang of one when none matches."""
    namespace, name, labels, annotations = _meta(pod)
    spec = pod.get("spec") or {}
    for source in GangSource:  # in the order a pod is matched, first match wins
        if source not in sources:
            continue
        if source is GangSource.PODGROUP:
            group = (spec.get("schedulingGroup") or {}).get("podGroupName")
            if group:
                return GangRef(GangKey(f"{namespace}/podgroup:{group}"), source, namespace, str(group))
        elif source is GangSource.WORKLOAD:
            ref = spec.get("workloadRef") or {}
            if ref.get("name") and ref.get("podGroup"):
                replica = str(ref.get("podGroupReplicaKey") or "")
                key = f"{namespace}/workload:{ref['name']}:{ref['podGroup']}:{replica}"
                return GangRef(
                    GangKey(key), source, namespace, str(ref["name"]), pod_group=str(ref["podGroup"])
                )
        elif source is GangSource.FRACTIONAL:
            gang = labels.get(GANG_LABEL)
            if gang:
                size = annotations.get(GANG_SIZE_ANNOTATION)
                return GangRef(GangKey(f"{namespace}/{gang}"), source, namespace, gang, size_text=size)
        elif source is GangSource.COSCHEDULING:
            group = labels.get(COSCHEDULING_LABEL)
            if group:
                return GangRef(GangKey(f"{namespace}/coscheduling:{group}"), source, namespace, group)
        elif source is GangSource.KUEUE:
            group = labels.get(KUEUE_GROUP_LABEL)
            if group:
                total = annotations.get(KUEUE_TOTAL_ANNOTATION)
                key = GangKey(f"{namespace}/kueue:{group}")
                return GangRef(key, source, namespace, group, size_text=total if total is not None else "")
        elif source is GangSource.LWS:
            group = labels.get(LWS_GROUP_LABEL)
            if group:
                size = annotations.get(LWS_SIZE_ANNOTATION)
                key = GangKey(f"{namespace}/lws:{group}")
                return GangRef(key, source, namespace, group, size_text=size if size is not None else "")
        elif source is GangSource.VOLCANO:
            group = annotations.get(VOLCANO_ANNOTATION)
            if group:
                return GangRef(GangKey(f"{namespace}/volcano:{group}"), source, namespace, group)
    return GangRef(GangKey(f"{namespace}/pod:{name}"), None, namespace)


@dataclass(frozen=True, slots=True)
class GangSpec:
    """What a gang asks for, read from its objects.

    ``min_count``: pods placed together, all or nothing (None with ``whole``: every pod present;
    None otherwise: not known yet, see ``waiting``). ``basic``: no gang, pod by pod.
    """

    min_count: int | None
    whole: bool = False
    basic: bool = False
    waiting: str = ""  # why the gang cannot be sized yet (its object is not there)
    invalid: str = ""  # why its size cannot be read (a bad annotation)
    topology_key: str | None = None
    claims: tuple[dict[str, Any], ...] = ()  # the PodGroup's spec.resourceClaims
    claim_statuses: tuple[dict[str, Any], ...] = ()  # its status.resourceClaimStatuses
    target: dict[str, Any] | None = None  # the object Events about the gang also go to
    # kube-scheduler gang-schedules it too (a scheduling.k8s.io PodGroup or Workload): it binds the
    # group only once no pod of it carries a scheduling gate, ours included (seen on 1.37.2).
    scheduler_gang: bool = False


ONE = GangSpec(min_count=1)


def _positive(text: str | None, what: str) -> GangSpec:
    if text is None or text == "":
        return GangSpec(min_count=None, invalid=f"{what} is missing")
    try:
        value = int(text)
    except ValueError:
        return GangSpec(min_count=None, invalid=f"{what} is not a positive integer: {text!r}")
    if value < 1:
        return GangSpec(min_count=None, invalid=f"{what} is not a positive integer: {text!r}")
    return GangSpec(min_count=value)


def _target(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata") or {}
    return {
        "apiVersion": obj.get("apiVersion"),
        "kind": obj.get("kind"),
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "uid": meta.get("uid"),
    }


def _policy(policy: dict[str, Any], where: str) -> GangSpec:
    """``{gang: {minCount}}`` or ``{basic: {}}``."""
    if "basic" in policy and "gang" not in policy:
        return GangSpec(min_count=1, basic=True)
    count = (policy.get("gang") or {}).get("minCount")
    if isinstance(count, int) and not isinstance(count, bool) and count >= 1:
        return GangSpec(min_count=count)
    return GangSpec(min_count=None, invalid=f"{where}: no gang.minCount or basic policy")


def _podgroup_spec(group: dict[str, Any]) -> GangSpec:
    spec = group.get("spec") or {}
    policy = _policy(spec.get("schedulingPolicy") or {}, "spec.schedulingPolicy")
    topology = ((spec.get("schedulingConstraints") or {}).get("topology")) or ()
    key = next((str(t["key"]) for t in topology if t.get("key")), None)
    return GangSpec(
        min_count=policy.min_count,
        basic=policy.basic,
        invalid=policy.invalid,
        topology_key=key,
        claims=tuple(spec.get("resourceClaims") or ()),
        claim_statuses=tuple((group.get("status") or {}).get("resourceClaimStatuses") or ()),
        target=_target(group),
        scheduler_gang=not policy.basic and not policy.invalid,
    )


def resolve(ref: GangRef, lookup: Lookup) -> GangSpec:
    """The gang's spec from its objects (``lookup``) or from the size its pods carry."""
    source = ref.source
    if source is None:
        return ONE
    if source is GangSource.PODGROUP:
        group = lookup(PODGROUPS, f"{ref.namespace}/{ref.name}")
        if group is None:
            return GangSpec(min_count=None, waiting=f"PodGroup {ref.name} does not exist yet")
        return _podgroup_spec(group)
    if source is GangSource.WORKLOAD:
        workload = lookup(WORKLOADS, f"{ref.namespace}/{ref.name}")
        if workload is None:
            return GangSpec(min_count=None, waiting=f"Workload {ref.name} does not exist yet")
        for entry in (workload.get("spec") or {}).get("podGroups") or ():
            if entry.get("name") == ref.pod_group:
                policy = _policy(entry.get("policy") or {}, f"podGroups[{ref.pod_group}].policy")
                return GangSpec(
                    min_count=policy.min_count,
                    basic=policy.basic,
                    invalid=policy.invalid,
                    target=_target(workload),
                    scheduler_gang=not policy.basic and not policy.invalid,
                )
        return GangSpec(min_count=None, invalid=f"Workload {ref.name} has no podGroup {ref.pod_group!r}")
    if source is GangSource.FRACTIONAL:
        if ref.size_text is None:
            return GangSpec(min_count=None, whole=True)  # a label without a size: the pods present
        found = _positive(ref.size_text, GANG_SIZE_ANNOTATION)
        return GangSpec(min_count=found.min_count, invalid=found.invalid)
    if source is GangSource.KUEUE:
        return _positive(ref.size_text, KUEUE_TOTAL_ANNOTATION)
    if source is GangSource.LWS:
        return _positive(ref.size_text, LWS_SIZE_ANNOTATION)
    kind = COSCHEDULING_PODGROUPS if source is GangSource.COSCHEDULING else VOLCANO_PODGROUPS
    group = lookup(kind, f"{ref.namespace}/{ref.name}")
    if group is None:
        return GangSpec(min_count=None, waiting=f"PodGroup {ref.name} ({kind}) does not exist yet")
    count = (group.get("spec") or {}).get("minMember")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        return GangSpec(
            min_count=None, invalid=f"PodGroup {ref.name}: spec.minMember is not a positive integer"
        )
    return GangSpec(min_count=count, target=_target(group))


def binds_to_podgroup(pod: dict[str, Any], entry_name: str, spec: GangSpec) -> bool:
    """Whether the pod's claim entry ``entry_name`` matches one of its PodGroup's claims exactly
    (``name`` and the same ``resourceClaimName``/``resourceClaimTemplateName``, KEP-5729): such a
    claim serves the PodGroup and is reserved for it (upstream ``resourceclaim.BindTo``)."""
    entry = next(
        (e for e in (pod.get("spec") or {}).get("resourceClaims") or () if e.get("name") == entry_name), None
    )
    if entry is None:
        return False
    fields = ("name", "resourceClaimName", "resourceClaimTemplateName")
    return any(all(claim.get(f) == entry.get(f) for f in fields) for claim in spec.claims)


def podgroup_claim(pod: dict[str, Any], ref: ClaimRef, spec: GangSpec) -> ClaimRef:
    """A pod claim that matches one of its PodGroup's claims exactly (``binds_to_podgroup``)
    resolves to the one claim generated for the PodGroup (its ``status.resourceClaimStatuses``);
    else ``ref`` unchanged."""
    if not binds_to_podgroup(pod, ref.entry, spec):
        return ref
    status = next((s for s in spec.claim_statuses if s.get("name") == ref.entry), None)
    if status is not None and status.get("resourceClaimName"):
        return ClaimRef(entry=ref.entry, claim_name=str(status["resourceClaimName"]), from_template=True)
    return ref


_OBJECT_PREFIXES = {
    PODGROUPS: "podgroup",
    COSCHEDULING_PODGROUPS: "coscheduling",
    VOLCANO_PODGROUPS: "volcano",
}


def gangs_of_object(kind: str, obj: dict[str, Any], known: Iterable[str]) -> list[GangKey]:
    """The gang keys a PodGroup, Workload or custom PodGroup sizes: its own key, or for a Workload
    each of ``known`` keys (one per pod group and replica key) that names it."""
    meta = obj.get("metadata") or {}
    namespace, name = meta.get("namespace"), meta.get("name")
    if kind in _OBJECT_PREFIXES:
        return [GangKey(f"{namespace}/{_OBJECT_PREFIXES[kind]}:{name}")]
    if kind == WORKLOADS:
        prefix = f"{namespace}/workload:{name}:"
        return [GangKey(k) for k in known if k.startswith(prefix)]
    return []

"""``fractional plan --profile FILE --claims FILE``: how many nodes of one profile a set of gangs
needs, computed offline with the same allocator and hint search the controller uses.

Claims file (YAML), either a ``gangs`` document::

    deviceClasses: [...]        # optional; default: gpu.fractional.dev and nic.fractional.dev
    gangs:
      - name: train             # required, unique
        replicas: 4             # pods in the gang (default 1); all of them must fit at once
        claim:                  # one ResourceClaim spec per pod (its ``devices``) ...
          devices: {requests: [...], constraints: [...]}
        claims: [{devices: ...}, ...]   # ... or several claims per pod (instead of ``claim``)

or plain ``ResourceClaim`` documents (``---``-separated); each is a gang of one pod, unless
claims carry the ``fractional.dev/gang`` label, which groups them into one gang with one pod
per claim. Each gang is planned on its own; the last row places all gangs together.

Gangs as Kubernetes writes them are read too: a ``scheduling.k8s.io`` ``PodGroup``
(``minCount`` pods) or a ``Workload``'s pod group (``podGroups`` on 1.35, ``podGroupTemplates``
on 1.36+, unless a PodGroup in the file is made from that template), with the ``Pod`` documents
that point at it (``spec.schedulingGroup`` or ``spec.workloadRef``) and the
``ResourceClaimTemplate``/``ResourceClaim`` documents their claims name; the first such pod's
claims are planned ``minCount`` times. A claim shared through the PodGroup (KEP-5729) is left
out: the plan counts per-pod claims.

Workloads are read as the controller would see them (``workloads``): a ``Pod``, ``Deployment``,
``ReplicaSet``, ``StatefulSet``, ``Job``, ``JobSet`` or ``LeaderWorkerSet`` stamps pods from its
template, and the gated pods fall in gangs by the controller's own markers (our label and size,
Kueue's pod group, LWS's group key and size, coscheduling's and Volcano's PodGroup in the file);
the other pods of one workload are planned together as one row named ``<kind>/<name>``. A
``ResourceClaim`` that a pod names is planned with that pod (once per gang), not on its own.
Whatever the file holds that is not planned is named with the reason (``skipped``); a file with
nothing to plan is an error that lists them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from driver.allocator import ClusterState
from driver.config import PlanConfig
from driver.controller.diagnosis.explain import format_bytes
from driver.controller.diagnosis.workloads import stamp_pods
from driver.controller.kueue.plan import append_kueue_report
from driver.controller.model.decode import bounded
from driver.controller.model.gang_identity import (
    COSCHEDULING_PODGROUPS,
    PODGROUPS,
    VOLCANO_PODGROUPS,
    WORKLOADS,
    GangSource,
    identify,
    resolve,
)
from driver.controller.model.objects import GANG_LABEL, allocation_node, is_gated, quantity
from driver.controller.sizing.hints import Hint, NodeShape, build_template, compute_hint, profile_shapes
from driver.errors import ConfigError
from driver.slices import build_device_classes

__all__ = [
    "ClaimsFile",
    "Gang",
    "PlanRow",
    "Skipped",
    "compute_plan",
    "parse_claims_file",
    "read_claims_file",
    "render_plan",
    "run_plan",
]

MAX_PLAN_NODES = 512


@dataclass(frozen=True, slots=True)
class Gang:
    name: str
    replicas: int
    claim_specs: tuple[dict[str, Any], ...]  # per pod (the first pod's when ``pod_claim_specs`` is set)
    pod_claim_specs: tuple[tuple[dict[str, Any], ...], ...] = ()  # pods unlike each other: each one's


@dataclass(frozen=True, slots=True)
class Skipped:
    """Something in the claims file that is not planned, and why."""

    what: str  # e.g. "HorizontalPodAutoscaler inference"
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"object": self.what, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class ClaimsFile:
    gangs: tuple[Gang, ...]
    classes: tuple[dict[str, Any], ...]
    skipped: tuple[Skipped, ...] = ()


@dataclass(frozen=True, slots=True)
class PlanRow:
    gang: str
    pods: int
    profile: str
    nodes: int | None  # None: does not fit on any number of these nodes
    gpus_used: int = 0
    memory_used_bytes: int = 0
    leftover_bytes_per_node: tuple[tuple[str, int], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "gang": self.gang,
            "pods": self.pods,
            "profile": self.profile,
            "fits": self.nodes is not None,
            "nodes": self.nodes,
            "gpusUsed": self.gpus_used,
            "memoryUsedBytes": self.memory_used_bytes,
            "leftoverMemoryBytesPerNode": dict(self.leftover_bytes_per_node),
        }


def _fail(source: str, field: str, problem: str) -> ConfigError:
    return ConfigError(field=f"--claims {source}: {field}", problem=problem)


def _claim_spec(source: str, field: str, raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict) or not isinstance(raw.get("devices"), dict):
        raise _fail(source, field, "expected a ResourceClaim spec with a 'devices' mapping")
    return raw


def _min_count(policy: Any) -> int | None:
    """``{gang: {minCount}}`` -> minCount; ``{basic: {}}`` -> 1; else None."""
    if not isinstance(policy, dict):
        return None
    if "basic" in policy and "gang" not in policy:
        return 1
    count = (policy.get("gang") or {}).get("minCount")
    return count if isinstance(count, int) and not isinstance(count, bool) and count >= 1 else None


def scheduling_gangs(path: str, documents: list[Any]) -> tuple[list[Gang], set[str]]:
    """Gangs from Workload/PodGroup documents and the Pods that point at them; also the names of
    the ResourceClaim documents their pods use."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for document in documents:
        by_kind.setdefault(str(document.get("kind")), []).append(document)
    templates = {
        str(d["metadata"]["name"]): (d.get("spec") or {}).get("spec")
        for d in by_kind.get("ResourceClaimTemplate", ())
    }
    claims = {str(d["metadata"]["name"]): d.get("spec") for d in by_kind.get("ResourceClaim", ())}
    pods = by_kind.get("Pod", [])
    used: set[str] = set()

    def pod_claims(pod: dict[str, Any], shared: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
        name = pod["metadata"].get("name")
        specs = []
        for position, entry in enumerate((pod.get("spec") or {}).get("resourceClaims") or ()):
            fields = ("name", "resourceClaimName", "resourceClaimTemplateName")
            if any(all(s.get(f) == entry.get(f) for f in fields)
                   for s in shared):  # fmt: skip
                continue  # one claim for the whole PodGroup
            field = f"Pod {name}: spec.resourceClaims[{position}]"
            if entry.get("resourceClaimTemplateName"):
                spec = templates.get(str(entry["resourceClaimTemplateName"]))
            else:
                spec = claims.get(str(entry.get("resourceClaimName")))
                used.add(str(entry.get("resourceClaimName")))
            if spec is None:
                raise _fail(path, field, "names a ResourceClaimTemplate or ResourceClaim not in the file")
            specs.append(_claim_spec(path, field, spec))
        return tuple(specs)

    gangs: list[Gang] = []
    covered: set[tuple[str, str]] = set()  # (workload, template) a PodGroup in the file is made from
    for group in by_kind.get("PodGroup", ()):
        name, spec = str(group["metadata"]["name"]), group.get("spec") or {}
        ref = spec.get("workloadRef") or (spec.get("podGroupTemplateRef") or {}).get("workload") or {}
        covered.add(
            (str(ref.get("workloadName")), str(ref.get("templateName") or ref.get("podGroupTemplateName")))
        )
        count = _min_count(spec.get("schedulingPolicy"))
        if count is None:
            raise _fail(path, f"PodGroup {name}: spec.schedulingPolicy", "no gang.minCount or basic policy")
        members = [
            p
            for p in pods
            if ((p.get("spec") or {}).get("schedulingGroup") or {}).get("podGroupName") == name
        ]
        if not members:
            raise _fail(path, f"PodGroup {name}", "no Pod in the file names it in spec.schedulingGroup")
        specs = pod_claims(members[0], list(spec.get("resourceClaims") or ()))
        gangs.append(Gang(name=name, replicas=count, claim_specs=specs))
    for workload in by_kind.get("Workload", ()):
        name, spec = str(workload["metadata"]["name"]), workload.get("spec") or {}
        entries = [(e, e.get("policy")) for e in spec.get("podGroups") or ()]
        entries += [(e, e.get("schedulingPolicy")) for e in spec.get("podGroupTemplates") or ()]
        for entry, policy in entries:
            template = str(entry.get("name"))
            if (name, template) in covered:
                continue
            count = _min_count(policy)
            members = [p for p in pods if ((p.get("spec") or {}).get("workloadRef") or {}).get("name") == name
                       and (p["spec"]["workloadRef"].get("podGroup") == template)]  # fmt: skip
            if count is None or not members:
                problem = "needs a gang.minCount or basic policy and a Pod whose spec.workloadRef names it"
                raise _fail(path, f"Workload {name}: pod group {template}", problem)
            gangs.append(
                Gang(name=f"{name}/{template}", replicas=count, claim_specs=pod_claims(members[0], []))
            )
    return gangs, used


_OBJECT_KIND = {  # (apiVersion group, kind) -> the gang object kind gang_identity looks up
    ("scheduling.k8s.io", "PodGroup"): PODGROUPS,
    ("scheduling.k8s.io", "Workload"): WORKLOADS,
    ("scheduling.x-k8s.io", "PodGroup"): COSCHEDULING_PODGROUPS,
    ("scheduling.volcano.sh", "PodGroup"): VOLCANO_PODGROUPS,
}
_PLANNED_KINDS = {"ResourceClaim", "ResourceClaimTemplate", "PodGroup", "Workload", "DeviceClass"}


def _namespaced(document: dict[str, Any]) -> str:
    meta = document.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name')}"


def workload_gangs(path: str, documents: list[Any]) -> tuple[list[Gang], set[str], set[str], list[Skipped]]:
    """Gangs from the pods the workload documents stamp (``workloads.stamp_pods``), grouped as the
    controller groups them; also the ResourceClaim and ResourceClaimTemplate names their pods use,
    and what was skipped. Pods that join a PodGroup or Workload are ``scheduling_gangs``'."""
    templates = {str(d["metadata"]["name"]): (d.get("spec") or {}).get("spec")
                 for d in documents if d.get("kind") == "ResourceClaimTemplate"}  # fmt: skip
    claims = {
        str(d["metadata"]["name"]): d.get("spec") for d in documents if d.get("kind") == "ResourceClaim"
    }
    objects = {}
    for document in documents:
        group = str(document.get("apiVersion") or "").rpartition("/")[0]
        kind = _OBJECT_KIND.get((group, str(document.get("kind"))))
        if kind is not None:
            objects[(kind, _namespaced(document))] = document
    used_claims: set[str] = set()
    used_templates: set[str] = set()
    skipped: list[Skipped] = []
    # gang (or workload) -> (row name, what the controller reads, the workloads, the pods)
    groups: dict[str, tuple[str, Any, list[str], list[dict[str, Any]]]] = {}
    for document in documents:
        stamped = stamp_pods(document)
        if stamped is None:
            continue
        if stamped.problem:
            skipped.append(Skipped(stamped.workload, stamped.problem))
            continue
        for pod in stamped.pods:
            for entry in (pod.get("spec") or {}).get("resourceClaims") or ():
                if entry.get("resourceClaimTemplateName"):
                    used_templates.add(str(entry["resourceClaimTemplateName"]))
                elif entry.get("resourceClaimName"):
                    used_claims.add(str(entry["resourceClaimName"]))
        ref = identify(stamped.pods[0])
        joined = (
            PODGROUPS if ref.source is GangSource.PODGROUP else WORKLOADS,
            f"{ref.namespace}/{ref.name}",
        )
        if ref.source in (GangSource.PODGROUP, GangSource.WORKLOAD):
            if document.get("kind") != "Pod":
                what = "PodGroup" if ref.source is GangSource.PODGROUP else "Workload"
                skipped.append(Skipped(stamped.workload, f"its pods join the {what} {ref.name}: give the "
                                       f"{what} and one Pod document that names it"))  # fmt: skip
            elif joined not in objects:
                skipped.append(Skipped(stamped.workload, f"it joins {ref.name}, which is not in the file"))
            continue  # scheduling_gangs plans it
        for pod in stamped.pods:
            ref = identify(pod)
            if is_gated(pod) and ref.source is not None:
                key, row = str(ref.key), ref.name
            else:  # placed pod by pod (a gang of one, or kube-scheduler's): one row per workload
                kind, _, name = stamped.workload.partition(" ")
                key, row = f"workload:{stamped.workload}", f"{kind.lower()}/{name}"
            entry = groups.setdefault(key, (row, ref, [], []))
            if stamped.workload not in entry[2]:
                entry[2].append(stamped.workload)
            entry[3].append(pod)
    gangs: list[Gang] = []
    for key, (row, ref, workloads, pods) in groups.items():
        what = " and ".join(workloads)
        if not key.startswith("workload:"):
            spec = resolve(ref, lambda kind, name: objects.get((kind, name)))
            if spec.invalid or spec.waiting:
                skipped.append(Skipped(what, f"gang {row}: {spec.invalid or spec.waiting}"))
                continue
            size = len(pods) if spec.whole or spec.min_count is None else spec.min_count
            if len(pods) < size:
                skipped.append(Skipped(what, f"gang {row} needs {size} pods together, the file makes "
                                       f"{len(pods)}: the controller would wait for the rest"))  # fmt: skip
                continue
        per_pod: list[tuple[dict[str, Any], ...]] = []
        shared: set[str] = set()
        missing = ""
        for pod in pods:
            specs = []
            for position, entry in enumerate((pod.get("spec") or {}).get("resourceClaims") or ()):
                field = f"{pod['metadata']['name']}: spec.resourceClaims[{position}]"
                if entry.get("resourceClaimTemplateName"):
                    template = str(entry["resourceClaimTemplateName"])
                    spec_doc = templates.get(template)
                    missing = missing or ("" if spec_doc is not None else f"ResourceClaimTemplate {template}")
                else:
                    claim_name = str(entry.get("resourceClaimName"))
                    if claim_name in shared:
                        continue  # one claim, shared by the pods: planned once, with the first
                    shared.add(claim_name)
                    spec_doc = claims.get(claim_name)
                    missing = missing or ("" if spec_doc is not None else f"ResourceClaim {claim_name}")
                if spec_doc is not None:
                    specs.append(_claim_spec(path, f"{what}: pod {field}", spec_doc))
            if specs:
                per_pod.append(tuple(specs))
        if missing:
            skipped.append(Skipped(what, f"its pods name {missing}, which is not in the file"))
        elif not per_pod:
            skipped.append(Skipped(what, "its pods ask for no devices (no resourceClaims)"))
        else:
            alike = all(specs == per_pod[0] for specs in per_pod)
            gangs.append(Gang(name=row, replicas=len(per_pod), claim_specs=per_pod[0],
                              pod_claim_specs=() if alike else tuple(per_pod)))  # fmt: skip
    return gangs, used_claims, used_templates, skipped


def parse_claims_file(path: str) -> tuple[list[Gang], list[dict[str, Any]]]:
    """Gangs and device classes from a claims file (format in the module docstring)."""
    parsed = read_claims_file(path)
    return list(parsed.gangs), list(parsed.classes)


def read_claims_file(path: str) -> ClaimsFile:
    """Gangs, device classes and what was skipped, from a claims file (format in the module docstring)."""
    try:
        documents = [d for d in yaml.safe_load_all(Path(path).read_text(encoding="utf-8")) if d is not None]
    except OSError as error:
        raise _fail(path, "file", f"cannot read: {error.strerror or error}") from error
    except yaml.YAMLError as error:
        raise _fail(path, "file", f"not valid YAML: {bounded(error)}") from error
    except RecursionError as error:  # PyYAML composes recursively: a deeply nested file
        raise _fail(path, "file", "nested too deeply to read") from error
    classes = build_device_classes()
    for index, document in enumerate(documents):
        if not isinstance(document, dict):
            raise _fail(path, f"document {index}", "expected a mapping")
    gangs, used_claims = scheduling_gangs(path, documents)
    stamped, pod_claims, used_templates, skipped = workload_gangs(path, documents)
    gangs += stamped
    used_claims |= pod_claims
    grouped: dict[str, list[dict[str, Any]]] = {}
    for index, document in enumerate(documents):
        kind = document.get("kind")
        what = f"{kind} {(document.get('metadata') or {}).get('name') or '(unnamed)'}"
        if kind == "ResourceClaim" and (document.get("metadata") or {}).get("name") in used_claims:
            continue  # a pod names it: planned with that pod
        if kind == "ResourceClaimTemplate" and document["metadata"].get("name") not in used_templates:
            skipped.append(Skipped(what, "no pod in the file uses it"))
            continue
        if kind is not None and kind not in _PLANNED_KINDS and stamp_pods(document) is None:
            skipped.append(Skipped(what, "not a workload: it makes no pods and asks for no devices"))
            continue
        if kind is None and "gangs" not in document and "deviceClasses" not in document:
            skipped.append(
                Skipped(f"document {index}", "no kind and no gangs: not an object this plan reads")
            )
            continue
        if kind == "ResourceClaim":
            meta = document.get("metadata") or {}
            spec = _claim_spec(path, f"document {index}.spec", document.get("spec"))
            gang = (meta.get("labels") or {}).get(GANG_LABEL) or meta.get("name") or f"claim-{index}"
            grouped.setdefault(str(gang), []).append(spec)
            continue
        if "deviceClasses" in document:
            classes = list(document["deviceClasses"] or ())
        for position, entry in enumerate(document.get("gangs") or ()):
            field = f"gangs[{position}]"
            if not isinstance(entry, dict) or not entry.get("name"):
                raise _fail(path, f"{field}.name", "required")
            replicas = entry.get("replicas", 1)
            if not isinstance(replicas, int) or replicas < 1:
                raise _fail(path, f"{field}.replicas", f"{replicas!r} is not a positive integer")
            if ("claim" in entry) == ("claims" in entry):
                raise _fail(path, field, "give exactly one of 'claim' or 'claims'")
            specs = [entry["claim"]] if "claim" in entry else list(entry["claims"] or ())
            checked = tuple(_claim_spec(path, f"{field}.claims[{i}]", s) for i, s in enumerate(specs))
            gangs.append(Gang(name=str(entry["name"]), replicas=replicas, claim_specs=checked))
    for name, specs in grouped.items():
        if len(specs) == 1:
            gangs.append(Gang(name=name, replicas=1, claim_specs=(specs[0],)))
        else:  # a labelled group: one pod per claim, all at once
            gangs.extend(Gang(name=f"{name}/{i}", replicas=1, claim_specs=(s,)) for i, s in enumerate(specs))
    if not gangs:
        reasons = (
            "; ".join(f"{s.what}: {s.reason}" for s in skipped) or "the file holds no gangs and no claims"
        )
        raise _fail(path, "gangs", f"nothing to plan ({reasons})")
    names = [g.name for g in gangs]
    if len(set(names)) != len(names):
        raise _fail(path, "gangs[].name", "names must be unique")
    return ClaimsFile(gangs=tuple(gangs), classes=tuple(classes), skipped=tuple(skipped))


def _claims_for(gangs: Sequence[Gang]) -> tuple[list[dict[str, Any]], list[list[int]]]:
    claims: list[dict[str, Any]] = []
    groups: list[list[int]] = []
    for gang in gangs:
        for replica in range(gang.replicas):
            group = []
            specs = gang.pod_claim_specs[replica] if gang.pod_claim_specs else gang.claim_specs
            for index, spec in enumerate(specs):
                name = f"{gang.name.replace('/', '-')}-{replica}-{index}".lower()
                group.append(len(claims))
                claims.append({
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaim",
                    "metadata": {"name": name, "namespace": "plan", "uid": f"plan-{name}"},
                    "spec": spec,
                })  # fmt: skip
            groups.append(group)
    return claims, groups


def _gpu_memory(shape: NodeShape) -> dict[str, int]:
    memory: dict[str, int] = {}
    for s in shape.slices:
        for device in (s.get("spec") or {}).get("devices") or ():
            if ((device.get("attributes") or {}).get("type") or {}).get("string") == "gpu":
                value = ((device.get("capacity") or {}).get("memory") or {}).get("value", "0")
                memory[str(device["name"])] = int(quantity(value))
    return memory


def _row(name: str, pods: int, shape: NodeShape, hint: Hint | None) -> PlanRow:
    if hint is None:
        return PlanRow(gang=name, pods=pods, profile=shape.name, nodes=None)
    device_memory = _gpu_memory(shape)
    used_devices: set[tuple[str, str]] = set()
    used_bytes: dict[str, int] = {node: 0 for node in hint.node_names}
    for allocation in hint.allocations:
        node = allocation_node(allocation) or ""
        for result in (allocation.get("devices") or {}).get("results") or ():
            device = str(result.get("device"))
            if device not in device_memory:
                continue  # NICs and other devices: not GPU memory
            used_devices.add((node, device))
            consumed = (result.get("consumedCapacity") or {}).get("memory")
            amount = int(quantity(consumed)) if consumed is not None else device_memory[device]
            used_bytes[node] = used_bytes.get(node, 0) + amount
    total_per_node = sum(device_memory.values())
    return PlanRow(
        gang=name,
        pods=pods,
        profile=shape.name,
        nodes=hint.nodes,
        gpus_used=len(used_devices),
        memory_used_bytes=sum(used_bytes.values()),
        leftover_bytes_per_node=tuple((n, total_per_node - used_bytes.get(n, 0)) for n in hint.node_names),
    )


def _place_in_order(
    gangs: Sequence[Gang], classes: Sequence[dict[str, Any]], shape: NodeShape, *, policy: str, start: int
) -> Hint | None:
    """All gangs on ``n`` nodes, allocated one gang after the other as the controller would (file
    order), for the smallest ``n >= start``. A joint search over every gang at once is what the
    controller never does, and it costs exponentially more."""
    pods = sum(g.replicas for g in gangs)
    for count in range(max(1, start), min(MAX_PLAN_NODES, pods) + 1):
        state = ClusterState()
        for device_class in classes:
            state.upsert_class(device_class)
        names = [f"plan-{shape.name}-{i}" for i in range(count)]
        for node in names:
            slices, labels = build_template(shape, node)
            state.upsert_node(node, labels)
            for s in slices:
                state.upsert_slice(s)
        allocations: list[dict[str, Any]] = []
        for gang in gangs:
            claims, groups = _claims_for([gang])
            result = state.allocate(claims, policy=policy, pod_groups=groups)
            if result is None:
                break
            for claim, allocation in zip(claims, result, strict=True):
                state.upsert_claim({**claim, "status": {"allocation": allocation}})
            allocations.extend(result)
        else:
            used = [n for n in names if any(allocation_node(a) == n for a in allocations)]
            return Hint(
                profile=shape.name, nodes=len(used), allocations=tuple(allocations), node_names=tuple(used)
            )
    return None


def compute_plan(
    gangs: Sequence[Gang], classes: Sequence[dict[str, Any]], shape: NodeShape, *, policy: str
) -> list[PlanRow]:
    """One row per gang on its own, then one for all gangs together (when there are several)."""
    build_template(shape, "check")  # fails early on a malformed shape
    rows = []
    for gang in gangs:
        claims, groups = _claims_for([gang])
        hint = compute_hint(
            claims, pod_groups=groups, shapes=[shape], classes=classes, policy=policy,
            max_nodes=min(MAX_PLAN_NODES, max(1, len(groups))),
        )  # fmt: skip
        rows.append(_row(gang.name, len(groups), shape, hint))
    if len(gangs) > 1:
        fitting = [r.nodes for r in rows if r.nodes is not None]
        together = None
        if len(fitting) == len(rows):
            together = _place_in_order(gangs, classes, shape, policy=policy, start=max(fitting))
        rows.append(_row("(all gangs, in order)", sum(r.pods for r in rows), shape, together))
    return rows


def _leftover_text(row: PlanRow) -> str:
    values = [v for _, v in row.leftover_bytes_per_node]
    if not values:
        return "-"
    if len(values) <= 4:
        return ", ".join(format_bytes(v) if v else "0" for v in values)
    return f"{format_bytes(min(values)) if min(values) else '0'} .. {format_bytes(max(values))}"


def render_plan(rows: Sequence[PlanRow], output: str, skipped: Sequence[Skipped] = ()) -> str:
    data: dict[str, Any] = {"rows": [r.as_dict() for r in rows]}
    if skipped:
        data["skipped"] = [s.as_dict() for s in skipped]
    if output == "json":
        return json.dumps(data, indent=2)
    if output == "yaml":
        return str(yaml.safe_dump(data, sort_keys=False)).rstrip()
    header = ("GANG", "PODS", "FITS ON", "GPUS USED", "GPU MEMORY USED", "LEFTOVER GPU MEMORY PER NODE")
    table = [header]
    for r in rows:
        fits = f"{r.nodes} x {r.profile}" if r.nodes is not None else f"does not fit on {r.profile}"
        used = format_bytes(r.memory_used_bytes) if r.memory_used_bytes else "0"
        table.append((r.gang, str(r.pods), fits, str(r.gpus_used), used, _leftover_text(r)))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table]
    if skipped:
        lines += ["", "skipped:", *(f"  {s.what}: {s.reason}" for s in skipped)]
    return "\n".join(lines)


def run_plan(config: PlanConfig) -> str:
    """The text ``fractional plan`` prints."""
    parsed = read_claims_file(config.claims)
    gangs, classes = list(parsed.gangs), list(parsed.classes)
    (shape,) = profile_shapes([config.profile])
    text = render_plan(
        compute_plan(gangs, classes, shape, policy=config.policy), config.output, parsed.skipped
    )
    # Warn about claims Kueue refuses; with --kueue, what Kueue charges (driver/controller/kueue/plan.py)
    return append_kueue_report(text, gangs, classes, shape, output=config.output, charges=config.kueue)

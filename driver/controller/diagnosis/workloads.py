"""The pods a workload document makes, as its controller would stamp them, for ``fractional plan``.

Pods come from the workload's pod template, as many as it runs at once: a ``Deployment``,
``ReplicaSet`` or ``StatefulSet`` its ``replicas``; a ``Job`` its ``parallelism`` (at most
``completions``); a ``JobSet`` (``jobset.x-k8s.io``) each ``replicatedJobs[]`` entry's ``replicas``
times its Job's; a ``LeaderWorkerSet`` (``leaderworkerset.x-k8s.io``) ``replicas`` groups of
``leaderWorkerTemplate.size`` pods (a leader from ``leaderTemplate``, else from
``workerTemplate``, and the workers), each group labelled with its group key and size as the LWS
controller does. A ``Pod`` document is its own pod. The gang each pod then falls in is the
controller's own reading (``gang_identity.identify``). Pure: dicts in, dicts out.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from driver.controller.model.gang_identity import LWS_GROUP_LABEL, LWS_SIZE_ANNOTATION

__all__ = ["WORKLOAD_KINDS", "Stamped", "stamp_pods"]

WORKLOAD_KINDS = ("Pod", "Deployment", "ReplicaSet", "StatefulSet", "Job", "JobSet", "LeaderWorkerSet")
MAX_STAMPED_PODS = 4096  # a replica count above this is refused (gang plan's MAX_GANG_PODS)


@dataclass(frozen=True, slots=True)
class Stamped:
    """What one workload document makes: its pods, or why it makes none (``problem``)."""

    workload: str  # e.g. "Job gang-train"
    pods: tuple[dict[str, Any], ...] = ()
    problem: str = ""


def _count(value: Any, default: int) -> int | None:
    """A replica count as the API would default it; None when it is not a non-negative integer."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _pod(template: Any, name: str, namespace: str, labels: dict[str, str] | None = None,
         annotations: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    template = template if isinstance(template, dict) else {}
    meta = template.get("metadata") or {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {**(meta.get("labels") or {}), **(labels or {})},
            "annotations": {**(meta.get("annotations") or {}), **(annotations or {})},
        },
        "spec": copy.deepcopy(template.get("spec") or {}),
    }


def _job_pods(job_spec: Any) -> int | None:
    spec = job_spec if isinstance(job_spec, dict) else {}
    parallelism = _count(spec.get("parallelism"), 1)
    completions = _count(spec.get("completions"), parallelism or 0)
    if parallelism is None or completions is None:
        return None
    return min(parallelism, completions)


def stamp_pods(document: dict[str, Any]) -> Stamped | None:
    """The pods ``document`` makes; None when its kind makes no pods."""
    kind = str(document.get("kind") or "")
    if kind not in WORKLOAD_KINDS:
        return None
    meta = document.get("metadata") or {}
    name = str(meta.get("name") or "unnamed")
    namespace = str(meta.get("namespace") or "default")
    spec = document.get("spec") or {}
    workload = f"{kind} {name}"
    pods: list[dict[str, Any]] = []
    if kind == "Pod":
        pods.append(_pod({"metadata": meta, "spec": spec}, name, namespace))
    elif kind in ("Deployment", "ReplicaSet", "StatefulSet", "Job"):
        count = _job_pods(spec) if kind == "Job" else _count(spec.get("replicas"), 1)
        if count is None:
            return Stamped(
                workload, problem="its replica count (replicas/parallelism/completions) is not a count"
            )
        if count > MAX_STAMPED_PODS:
            return Stamped(workload, problem=f"makes {count} pods, more than the {MAX_STAMPED_PODS} planned")
        pods.extend(_pod(spec.get("template"), f"{name}-{i}", namespace) for i in range(count))
    elif kind == "JobSet":
        for entry in spec.get("replicatedJobs") or ():
            entry = entry if isinstance(entry, dict) else {}
            job = (entry.get("template") or {}).get("spec") or {}
            replicas, per_job = _count(entry.get("replicas"), 1), _job_pods(job)
            if replicas is None or per_job is None:
                return Stamped(
                    workload, problem=f"replicatedJobs {entry.get('name')}: a count is not a count"
                )
            if len(pods) + replicas * per_job > MAX_STAMPED_PODS:
                return Stamped(workload, problem=f"makes more than the {MAX_STAMPED_PODS} pods planned")
            for replica in range(replicas):
                for index in range(per_job):
                    pod_name = f"{name}-{entry.get('name')}-{replica}-{index}"
                    pods.append(_pod(job.get("template"), pod_name, namespace))
    else:  # LeaderWorkerSet
        groups = _count(spec.get("replicas"), 1)
        template = spec.get("leaderWorkerTemplate") or {}
        size = _count(template.get("size"), 1)
        if groups is None or size is None or size < 1:
            return Stamped(workload, problem="replicas or leaderWorkerTemplate.size is not a count")
        if groups * size > MAX_STAMPED_PODS:
            return Stamped(
                workload, problem=f"makes {groups * size} pods, more than the {MAX_STAMPED_PODS} planned"
            )
        worker = template.get("workerTemplate")
        leader = template.get("leaderTemplate") or worker
        for group in range(groups):
            marks = {
                "labels": {LWS_GROUP_LABEL: f"{name}-{group}"},
                "annotations": {LWS_SIZE_ANNOTATION: str(size)},
            }
            pods.append(_pod(leader, f"{name}-{group}", namespace, **marks))
            pods.extend(_pod(worker, f"{name}-{group}-{w}", namespace, **marks) for w in range(1, size))
    if not pods:
        return Stamped(workload, problem="makes no pods (its replica count is 0)")
    return Stamped(workload, pods=tuple(pods))

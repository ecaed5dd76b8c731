"""Two admission steps of kube-apiserver the emulator (a test double) plays for preemption:

- the ``Priority`` admission plugin (plugin/pkg/admission/priority/admission.go): a new pod's
  ``spec.priorityClassName`` is resolved into ``spec.priority`` and ``spec.preemptionPolicy``
  (default ``PreemptLowerPriority``); a missing class is refused with 403; without a class name the
  ``globalDefault`` class applies, else priority 0; the two system classes always exist.
- the eviction REST's budget check (pkg/registry/core/pod/storage/eviction.go): a pod covered by a
  PodDisruptionBudget is evicted only while the budget allows a disruption, else 429
  TooManyRequests with cause ``DisruptionBudget``. Departure: the real server reads the budget's
  ``status`` kept by the disruption controller; here (no such controller runs) the allowance is
  computed from the pods at the time of the request, as that controller would compute it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from driver.cluster.apiserver.store import StatusError

__all__ = ["SYSTEM_PRIORITY_CLASSES", "admit_pod_priority", "check_eviction_budgets"]

Obj = dict[str, Any]
SYSTEM_PRIORITY_CLASSES = {"system-cluster-critical": 2000000000, "system-node-critical": 2000001000}


def admit_pod_priority(pod: Obj, priority_classes: Callable[[], Iterable[Obj]]) -> Obj:
    """The pod as the Priority admission plugin leaves it (a copy), or raise 403 as it does."""
    spec = dict(pod.get("spec") or {})
    pod_name = (pod.get("metadata") or {}).get("name", "")
    name = spec.get("priorityClassName")
    classes = {str(c["metadata"]["name"]): c for c in priority_classes()}
    chosen: Obj | None = None
    if name:
        chosen = classes.get(str(name))
        if chosen is None and name in SYSTEM_PRIORITY_CLASSES:
            chosen = {"value": SYSTEM_PRIORITY_CLASSES[str(name)]}
        if chosen is None:
            raise StatusError(
                code=403, reason="Forbidden",
                message=f'pods "{pod_name}" is forbidden: no PriorityClass '
                        f"with name {name} was found",
            )  # fmt: skip
    else:
        defaults = sorted(
            (c for c in classes.values() if c.get("globalDefault")), key=lambda c: int(c.get("value", 0))
        )
        if defaults:
            chosen = defaults[0]
            spec["priorityClassName"] = defaults[0]["metadata"]["name"]
    value = int(chosen.get("value", 0)) if chosen is not None else 0
    policy = (chosen or {}).get("preemptionPolicy") or "PreemptLowerPriority"
    if spec.get("priority") is not None and int(spec["priority"]) != value:
        raise StatusError(
            code=403, reason="Forbidden",
            message=f'pods "{pod_name}" is forbidden: the integer value of '
                    "priority must not be provided in pod spec; priority admission controller computed "
                    f"{value} from the given PriorityClass name",
        )  # fmt: skip
    spec["priority"] = value
    spec["preemptionPolicy"] = policy
    return {**pod, "spec": spec}


def _selects(selector: Obj, labels: dict[str, str]) -> bool:
    """policy/v1: an empty selector selects every pod of the namespace."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or ():
        key, operator, values = (
            expression.get("key"),
            expression.get("operator"),
            expression.get("values") or [],
        )
        present = key in labels
        if (
            (operator == "In" and not (present and labels[key] in values))
            or (operator == "NotIn" and present and labels[key] in values)
            or (operator == "Exists" and not present)
            or (operator == "DoesNotExist" and present)
        ):
            return False
    return True


def _healthy(pod: Obj) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ()
    )
    return status.get("phase") == "Running" and ready


def _desired_healthy(spec: Obj, expected: int) -> int:
    def amount(value: Any, *, round_up: bool) -> int:
        if isinstance(value, str) and value.endswith("%"):
            fraction = int(value[:-1]) * expected / 100
            return math.ceil(fraction) if round_up else math.floor(fraction)
        return int(value)

    if spec.get("minAvailable") is not None:
        return amount(spec["minAvailable"], round_up=True)
    if spec.get("maxUnavailable") is not None:
        return max(0, expected - amount(spec["maxUnavailable"], round_up=True))
    return expected  # neither set: the API defaults minAvailable to 1 only when both are absent


def check_eviction_budgets(pod: Obj, budgets: Iterable[Obj], pods: Iterable[Obj]) -> None:
    """Raise 429 when evicting ``pod`` would take a covering budget below its healthy minimum.

    A pod that is not healthy itself may always go (upstream: unhealthy pods do not count against
    the budget with the default ``IfHealthyBudget`` policy).
    """
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    covering = [
        b for b in budgets
        if (b.get("metadata") or {}).get("namespace") == meta.get("namespace")
        and _selects((b.get("spec") or {}).get("selector") or {}, labels)
    ]  # fmt: skip
    if not covering or not _healthy(pod) or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return
    if len(covering) > 1:
        raise StatusError(
            code=500, reason="InternalError",
            message="This pod has more than one PodDisruptionBudget, which the eviction subresource does "
                    "not support.",
        )  # fmt: skip
    budget = covering[0]
    spec = budget.get("spec") or {}
    selector = spec.get("selector") or {}
    matching = [
        p for p in pods
        if (p.get("metadata") or {}).get("namespace") == meta.get("namespace")
        and _selects(selector, (p.get("metadata") or {}).get("labels") or {})
        and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
    ]  # fmt: skip
    healthy = sum(1 for p in matching if _healthy(p))
    desired = _desired_healthy(spec, len(matching))
    if healthy - desired > 0:
        return
    name = budget["metadata"]["name"]
    raise StatusError(
        code=429, reason="TooManyRequests",
        message="Cannot evict pod as it would violate the pod's disruption budget.",
        details={"causes": [{
            "reason": "DisruptionBudget",
            "message": f"The disruption budget {name} needs {desired} healthy pods and has {healthy} "
                       "currently",
        }]},
    )  # fmt: skip

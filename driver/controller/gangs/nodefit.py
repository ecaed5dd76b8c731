"""Would kube-scheduler let this pod onto that node? Pure checks on API-shaped dicts.

The controller only writes an allocation for a node where the pod will also pass kube-scheduler's
other filters; otherwise the scheduler's DRA PostFilter clears the (unreserved) allocation and
the work is lost. We check what decides most placements: ``spec.unschedulable``, ``nodeSelector``,
required node affinity, NoSchedule/NoExecute taints, and CPU/memory/pod-count fit (the last in
``decide.py``, which knows what is already bound and placed).
"""

from __future__ import annotations

from typing import Any

__all__ = ["node_admits_pod", "node_rejection"]


def _match_expression(labels: dict[str, str], expression: dict[str, Any]) -> bool:
    key = expression.get("key", "")
    operator = expression.get("operator")
    values = [str(v) for v in expression.get("values") or ()]
    present = key in labels
    if operator == "In":
        return present and labels[key] in values
    if operator == "NotIn":
        return not present or labels[key] not in values
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt") and present and values:
        try:
            found, bound = int(labels[key]), int(values[0])
        except ValueError:
            return False
        return found > bound if operator == "Gt" else found < bound
    return False


def _match_term(node: dict[str, Any], term: dict[str, Any]) -> bool:
    labels = (node.get("metadata") or {}).get("labels") or {}
    name = (node.get("metadata") or {}).get("name", "")
    if not term.get("matchExpressions") and not term.get("matchFields"):
        return False  # an empty term matches nothing (upstream semantics)
    if not all(_match_expression(labels, e) for e in term.get("matchExpressions") or ()):
        return False
    return all(_match_expression({"metadata.name": name}, f) for f in term.get("matchFields") or ())


def _tolerates(tolerations: list[dict[str, Any]], taint: dict[str, Any]) -> bool:
    for toleration in tolerations:
        effect = toleration.get("effect")
        if effect and effect != taint.get("effect"):
            continue
        key = toleration.get("key")
        if toleration.get("operator") == "Exists":
            if not key or key == taint.get("key"):
                return True
            continue
        if key == taint.get("key") and (toleration.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def node_rejection(pod: dict[str, Any], node: dict[str, Any]) -> str:
    """Why kube-scheduler would not put ``pod`` on ``node`` (empty string: it would)."""
    spec = pod.get("spec") or {}
    node_spec = node.get("spec") or {}
    tolerations = list(spec.get("tolerations") or ())
    if node_spec.get("unschedulable") and not _tolerates(
        tolerations, {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
    ):
        return "node is cordoned"
    labels = (node.get("metadata") or {}).get("labels") or {}
    for key, value in (spec.get("nodeSelector") or {}).items():
        if labels.get(key) != value:
            return f"nodeSelector {key}={value} does not match"
    required = (
        ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        )
    ) or {}
    terms = required.get("nodeSelectorTerms")
    if terms and not any(_match_term(node, term) for term in terms):
        return "required node affinity does not match"
    for taint in node_spec.get("taints") or ():
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(tolerations, taint):
            return f"taint {taint.get('key')}:{taint.get('effect')} is not tolerated"
    return ""


def node_admits_pod(pod: dict[str, Any], node: dict[str, Any]) -> bool:
    return not node_rejection(pod, node)

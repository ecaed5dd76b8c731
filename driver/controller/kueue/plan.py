"""``fractional plan --kueue``: what Kueue (v0.19) would charge each gang of a claims file, and
what one node of the profile counts in the same quota units (for a ClusterQueue's
``nominalQuota``); and, always, a warning for each claim Kueue would refuse (``firstAvailable``,
``allocationMode: All``). Pure; the rule is ``driver.controller.kueue.quota``'s."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

import yaml

from driver.controller.kueue.quota import (
    KueueQuotaError,
    compute_claim_charges,
    default_mappings,
    kueue_refusals,
)
from driver.controller.model.objects import quantity
from driver.controller.sizing.hints import NodeShape

__all__ = ["append_kueue_report", "compute_kueue_report"]


def _amount(resource: str, value: Decimal) -> str:
    """An exact Kubernetes quantity, as a ClusterQueue's nominalQuota would be written."""
    whole = int(value)
    if "memory" not in resource:
        return str(whole)
    for suffix, unit in (("Ti", 1024**4), ("Gi", 1024**3), ("Mi", 1024**2), ("Ki", 1024)):
        if whole and whole % unit == 0:
            return f"{whole // unit}{suffix}"
    return str(whole)


def _node_quota(shape: NodeShape) -> dict[str, Decimal]:
    """What one node of ``shape`` counts: the mapped capacity summed over its matching devices, and
    the devices of count-mapped classes (our NICs)."""
    totals: dict[str, Decimal] = {}
    for mapping in default_mappings():
        for resource_slice in shape.slices:
            for device in (resource_slice.get("spec") or {}).get("devices") or ():
                kind = ((device.get("attributes") or {}).get("type") or {}).get("string")
                if mapping.capacity_sources:
                    for source in mapping.capacity_sources:
                        value = ((device.get("capacity") or {}).get(source.name) or {}).get("value")
                        if value is not None and kind == "gpu":
                            totals[mapping.name] = totals.get(mapping.name, Decimal(0)) + quantity(value)
                elif kind == "nic" and "nic.fractional.dev" in mapping.device_class_names:
                    totals[mapping.name] = totals.get(mapping.name, Decimal(0)) + 1
    return totals


def compute_kueue_report(
    gangs: Sequence[Any], classes: Sequence[Mapping[str, Any]], shape: NodeShape
) -> dict[str, Any]:
    """{"warnings": [...], "gangs": [{gang, pods, per_pod, total}], "node": {...}}; amounts as strings."""
    warnings: list[str] = []
    rows = []
    for gang in gangs:
        per_pod: dict[str, Decimal] = {}
        for index, spec in enumerate(gang.claim_specs):
            name = f"gang {gang.name} claim {index}"
            warnings.extend(kueue_refusals(spec, name=name))
            try:
                charges = compute_claim_charges(spec, slices=shape.slices, classes=classes, name=name)
            except KueueQuotaError as error:
                warnings.append(str(error))
                continue
            for resource, value in charges.items():
                per_pod[resource] = per_pod.get(resource, Decimal(0)) + value
        rows.append({
            "gang": gang.name, "pods": gang.replicas,
            "perPod": {r: _amount(r, v) for r, v in sorted(per_pod.items())},
            "total": {r: _amount(r, v * gang.replicas) for r, v in sorted(per_pod.items())},
        })  # fmt: skip
    node = {r: _amount(r, v) for r, v in sorted(_node_quota(shape).items())}
    return {
        "warnings": list(dict.fromkeys(warnings)),
        "gangs": rows,
        "node": {"profile": shape.name, "counts": node},
    }


def _render_text(report: Mapping[str, Any], charges: bool) -> str:
    lines = [f"warning: Kueue would refuse it: {w}" for w in report["warnings"]]
    if charges:
        lines.append("")
        lines.append("KUEUE CHARGE (deviceClassMappings of examples/kueue/kueue-configuration.yaml)")
        for row in report["gangs"]:
            per_pod = ", ".join(f"{r} {v}" for r, v in row["perPod"].items()) or "nothing"
            total = ", ".join(f"{r} {v}" for r, v in row["total"].items()) or "nothing"
            lines.append(f"  {row['gang']}: {per_pod} per pod; {total} for {row['pods']} pod(s)")
        counts = ", ".join(f"{r} {v}" for r, v in report["node"]["counts"].items())
        lines.append(f"  one {report['node']['profile']} node counts: {counts}")
    return "\n".join(lines).strip("\n")


def append_kueue_report(
    text: str,
    gangs: Sequence[Any],
    classes: Sequence[Mapping[str, Any]],
    shape: NodeShape,
    *,
    output: str,
    charges: bool,
) -> str:
    """``text`` (render_plan's) with the warnings, and the charges when asked, in the same format."""
    report = compute_kueue_report(gangs, classes, shape)
    if not report["warnings"] and not charges:
        return text
    if output in ("json", "yaml"):
        data = json.loads(text) if output == "json" else yaml.safe_load(text)
        data["kueue"] = report if charges else {"warnings": report["warnings"]}
        if output == "json":
            return json.dumps(data, indent=2)
        return str(yaml.safe_dump(data, sort_keys=False)).rstrip()
    return f"{text}\n\n{_render_text(report, charges)}"

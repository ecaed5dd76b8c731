"""``fractional plan`` reads gangs written as Workload + PodGroup, 1.35's podGroups too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from driver.config import PlanConfig
from driver.controller.diagnosis.plan import run_plan
from driver.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gangs" / "workload-podgroup.yaml"


def _rows(profile: str, claims: str | Path) -> dict[str, dict[str, object]]:
    text = run_plan(PlanConfig(profile=profile, claims=str(claims), output="json"))
    return {row["gang"]: row for row in json.loads(text)["rows"]}


def test_a_podgroup_gang_is_planned_min_count_times() -> None:
    rows = _rows("h100-8x", EXAMPLE)
    assert set(rows) == {"train-workers-0"}  # one gang: the Workload template is the PodGroup's
    assert rows["train-workers-0"]["pods"] == 4
    assert rows["train-workers-0"]["nodes"] == 1
    assert rows["train-workers-0"]["memoryUsedBytes"] == 4 * 40 * 1024**3


def test_a_1_35_workload_with_workload_ref_pods(tmp_path: Path) -> None:
    path = tmp_path / "gang.yaml"
    path.write_text(
        "apiVersion: scheduling.k8s.io/v1alpha1\nkind: Workload\nmetadata: {name: w}\n"
        "spec: {podGroups: [{name: g, policy: {gang: {minCount: 3}}}]}\n---\n"
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: c}\n"
        "spec: {devices: {requests: [{name: g, exactly: {deviceClassName: gpu.fractional.dev}}]}}\n---\n"
        "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n"
        "spec: {workloadRef: {name: w, podGroup: g}, resourceClaims: [{name: x, resourceClaimName: c}],"
        " containers: [{name: c, image: x}]}\n"
    )
    rows = _rows("l4-2x", path)
    assert "c" not in rows  # the pod's claim belongs to the gang, not a gang of its own
    assert rows["w/g"]["pods"] == 3 and rows["w/g"]["nodes"] == 2  # three whole L4s, two per node


def test_a_podgroup_without_pods_is_named(tmp_path: Path) -> None:
    path = tmp_path / "gang.yaml"
    path.write_text(
        "apiVersion: scheduling.k8s.io/v1beta1\nkind: PodGroup\nmetadata: {name: lonely}\n"
        "spec: {schedulingPolicy: {gang: {minCount: 2}}}\n"
    )
    with pytest.raises(ConfigError, match="PodGroup lonely"):
        run_plan(PlanConfig(profile="l4-2x", claims=str(path), output="json"))

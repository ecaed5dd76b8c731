"""bench/production_scale.py's pure pieces: the fill's pod list, the pods' shapes against the fleet's
nodes, the scheduler profiles it configures, the trace's templates, and the ratios it reports."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bench.fgd_trace import TracePod
from bench.production_scale import (
    NODE_CPU,
    NODE_MEMORY_GI,
    SHAPES,
    WHOLE8,
    bound_from_listing,
    fill_plan,
    pod_body,
    ratios,
    record,
    scheduler_config,
    stuck_report,
    trace_pod_body,
    trace_templates,
    unbound_summary,
)


@pytest.mark.parametrize("gpus", [160, 8000, 40000])
def test_the_fill_asks_for_90_percent_of_the_gpus_in_one_seeded_order(gpus: int) -> None:
    plan = fill_plan(gpus)
    asked = sum(shape.gpu_fraction for _, shape in plan)
    assert 0.89 * gpus <= asked <= 0.90 * gpus
    whole8 = sum(8 for _, shape in plan if shape is WHOLE8)
    assert whole8 == 8 * int(0.80 * gpus / 8)
    assert plan == fill_plan(gpus)  # the same list for every path
    assert [shape for _, shape in plan] != sorted((s for _, s in plan), key=lambda s: -s.gpu_fraction)
    assert len({name for name, _ in plan}) == len(plan)


def test_a_full_node_of_any_shape_fits_its_cpu_and_memory() -> None:
    """Eight GPUs' worth of any shape fits a fleet node's CPU and memory: the GPUs, not the CPU,
    are what fills a node, for kube-scheduler's MostAllocated profile as for ours."""
    for shape in SHAPES.values():
        per_node = 8 / shape.gpu_fraction
        assert per_node * shape.cpu_milli <= 1000 * NODE_CPU
        assert per_node * shape.memory_mi <= 1024 * NODE_MEMORY_GI


def test_pods_are_gated_only_on_our_path_and_tolerate_kwok() -> None:
    ours = pod_body("p", WHOLE8, gated=True, group="g")
    theirs = pod_body("p", WHOLE8, gated=False)
    assert ours["spec"]["schedulingGates"] == [{"name": "fractional.dev/allocation"}]
    assert ours["spec"]["schedulingGroup"] == {"podGroupName": "g"}
    assert "schedulingGates" not in theirs["spec"]
    assert theirs["spec"]["tolerations"][0]["key"] == "kwok.x-k8s.io/node"
    requests = theirs["spec"]["containers"][0]["resources"]["requests"]
    assert requests == {"cpu": f"{8 * 24 * 1000}m", "memory": f"{8 * 200 * 1024}Mi"}


def test_the_scheduler_profiles_carry_the_client_limits(tmp_path: Path) -> None:
    plain = yaml.safe_load(scheduler_config(tmp_path, tmp_path / "k", 50, 100, packing=False).read_text())
    packing = yaml.safe_load(scheduler_config(tmp_path, tmp_path / "k", 500, 1000, packing=True).read_text())
    assert plain["clientConnection"] == {"kubeconfig": str(tmp_path / "k"), "qps": 50, "burst": 100}
    assert "pluginConfig" not in plain["profiles"][0]
    assert packing["clientConnection"]["qps"] == 500
    (fit,) = packing["profiles"][0]["pluginConfig"]
    assert fit["name"] == "NodeResourcesFit"
    assert fit["args"]["scoringStrategy"]["type"] == "MostAllocated"


def test_the_trace_gates_only_its_gpu_pods_and_shares_templates() -> None:
    pods = [
        TracePod("openb-pod-0001", 4000, 8192, 1, 500, ("T4",)),
        TracePod("openb-pod-0002", 4000, 8192, 1, 500, ("T4",)),
        TracePod("openb-pod-0003", 2000, 4096, 0, 0, ()),
        TracePod("openb-pod-0004-tuned-0", 8000, 8192, 8, 1000, ()),
    ]
    templates = trace_templates(pods)
    assert len(templates) == 2  # one per distinct ask
    gpu = trace_pod_body(pods[0], templates[(1, 500, ("T4",))], gated=True)
    cpu_only = trace_pod_body(pods[2], None, gated=True)
    assert gpu["spec"]["schedulingGates"] and gpu["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
    assert "schedulingGates" not in cpu_only["spec"] and "resourceClaims" not in cpu_only["spec"]


def test_the_ratios_compare_ours_with_the_better_kube_scheduler_profile() -> None:
    base = {"nodes": 1000, "setting": "raised"}
    rows = [
        {**base, "case": "fill", "path": "kube-scheduler", "pods_per_s": 10.0},
        {**base, "case": "fill", "path": "kube-scheduler-mostallocated", "pods_per_s": 20.0},
        {**base, "case": "fill", "path": "ours", "pods_per_s": 30.0},
        # kube-scheduler bound fewer pods: more GPUs free, but less of what is left is whole
        {
            **base,
            "case": "churn",
            "path": "kube-scheduler",
            "gpus_free": 500,
            "whole_free_share": 0.5,
            "p99_s": 2.0,
        },
        {
            **base,
            "case": "churn",
            "path": "kube-scheduler-mostallocated",
            "gpus_free": 100,
            "whole_free_share": 0.6,
            "p99_s": 1.0,
        },
        {**base, "case": "churn", "path": "ours", "gpus_free": 150, "whole_free_share": 0.9, "p99_s": 1.5},
    ]
    text = ratios(rows)
    assert "fill throughput 1.50x (kube-scheduler-mostallocated)" in text
    assert "whole GPUs free after churn (whole_free_share) 1.50x (150 against 100 GPUs" in text
    assert "churn p99 1.50 s against 1.00 s (1.50x" in text


def test_rows_of_different_runs_are_not_compared() -> None:
    base = {"nodes": 5000, "setting": "raised"}
    rows = [
        {**base, "case": "fill", "path": "kube-scheduler-mostallocated", "pods_per_s": 5.0, "date": "run 1"},
        {**base, "case": "fill", "path": "ours", "pods_per_s": 15.0, "date": "run 2"},
    ]
    assert "fill throughput" not in ratios(rows)
    rows[1]["date"] = "run 1"
    assert "fill throughput 3.00x (kube-scheduler-mostallocated)" in ratios(rows)


def test_a_run_of_one_path_and_case_replaces_only_those_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run of ours' fill alone at 5,000 nodes once dropped every other row of that size: kube-
    scheduler's, and our churn and gangs."""
    import json

    import bench._common as common
    import bench.production_scale as production_scale

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(production_scale, "RESULTS_DIR", tmp_path)
    base = {"nodes": 5000, "setting": "raised", "date": "run 1", "commit": "a"}
    old = [
        {**base, "path": "ours", "case": "startup", "startup_s": 12.0},
        {**base, "path": "ours", "case": "fill", "pods_per_s": 15.0},
        {**base, "path": "ours", "case": "churn", "p99_s": 2.8},
        {**base, "path": "kube-scheduler-mostallocated", "case": "fill", "pods_per_s": 5.0},
        {**base, "nodes": 1000, "path": "ours", "case": "fill", "pods_per_s": 29.0},
    ]
    (tmp_path / "scale.json").write_text(json.dumps({"rows": old}), encoding="utf-8")
    new = {**base, "date": "run 2", "commit": "b"}
    record([{**new, "path": "ours", "case": "startup", "startup_s": 14.0},
            {**new, "path": "ours", "case": "fill", "pods_per_s": 17.0}])  # fmt: skip
    rows = json.loads((tmp_path / "scale.json").read_text(encoding="utf-8"))["rows"]
    held = {(r["nodes"], r["path"], r["case"]): r for r in rows}
    assert len(rows) == 5
    fill = held[(5000, "ours", "fill")]
    assert fill["pods_per_s"] == 17.0 and fill["commit"] == "b"
    assert held[(5000, "ours", "churn")]["commit"] == "a"
    assert held[(5000, "kube-scheduler-mostallocated", "fill")]["commit"] == "a"
    assert held[(1000, "ours", "fill")]["pods_per_s"] == 29.0


def test_binds_the_watch_missed_are_timed_by_their_pod_scheduled_condition() -> None:
    """Seen at 1,000 nodes after the churn: pods bound for over a minute before the watch said so.
    The read that catches up times each by its PodScheduled transition, on the monotonic clock."""
    scheduled = {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-12-06T13:20:51Z"}
    pods = [
        {"metadata": {"name": "g-0"}, "spec": {"nodeName": "kwok-1"}, "status": {"conditions": [scheduled]}},
        {"metadata": {"name": "g-1"}, "spec": {}, "status": {"conditions": []}},  # still unbound
        {"metadata": {"name": "x"}, "spec": {"nodeName": "kwok-2"}, "status": {"conditions": [scheduled]}},
    ]
    offset = 1_796_000_000.0  # wall clock minus monotonic clock
    found = bound_from_listing(pods, {"g-0", "g-1"}, offset)
    assert found == {"g-0": 1796563251.0 - offset}


def test_a_stall_names_each_unbound_pod_with_its_gates_condition_and_claims() -> None:
    """What the gangs case prints when it stops on a stall: enough to tell a pod never ungated
    from one kube-scheduler holds as unschedulable, and an allocated claim from a missing one."""
    unschedulable = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "lastTransitionTime": "2026-12-07T08:00:00Z",
        "message": "0/1000 nodes are available",
    }
    pods = [
        {"metadata": {"name": "g-0"}, "spec": {"schedulingGates": [{"name": "fractional.dev/allocation"}]},
         "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "g-0-gpu"}]}},
        {"metadata": {"name": "g-1"}, "spec": {}, "status": {
            "conditions": [unschedulable], "resourceClaimStatuses": [
                {"name": "gpu", "resourceClaimName": "g-1-gpu"},
                {"name": "nic", "resourceClaimName": "gone"}]}},
        {"metadata": {"name": "g-2"}, "spec": {"nodeName": "kwok-1"}, "status": {}},  # bound: not listed
    ]  # fmt: skip
    selector = {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "values": ["kwok-7"]}]}]}
    claims = [
        {"metadata": {"name": "g-0-gpu"}, "status": {}},
        {"metadata": {"name": "g-1-gpu"}, "status": {"allocation": {"nodeSelector": selector},
                                                     "reservedFor": [{"name": "g-1"}]}},
    ]  # fmt: skip
    lines = stuck_report(pods, claims, {"g-0", "g-1", "g-2"})
    assert lines == [
        "stuck g-0: gates fractional.dev/allocation; PodScheduled no PodScheduled condition; "
        "claims: g-0-gpu: not allocated, reserved for 0",
        "stuck g-1: gates -; PodScheduled False/Unschedulable since 2026-12-07T08:00:00Z: "
        "0/1000 nodes are available; claims: g-1-gpu: allocated on kwok-7, reserved for 1; nic: no claim",
    ]


def test_the_pods_a_trace_part_leaves_are_counted_by_what_holds_them() -> None:
    refused = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
               "message": "0/1213 nodes are available: 1213 Insufficient cpu."}  # fmt: skip
    pods = [
        {"metadata": {"name": "a"}, "spec": {"schedulingGates": [{"name": "g"}]}, "status": {}},
        {"metadata": {"name": "b"}, "spec": {"schedulingGates": [{"name": "g"}]}, "status": {}},
        {"metadata": {"name": "c"}, "spec": {}, "status": {"conditions": [refused]}},
        {"metadata": {"name": "d"}, "spec": {}, "status": {}},
        {"metadata": {"name": "e"}, "spec": {"nodeName": "n"}, "status": {}},  # bound
        {"metadata": {"name": "f"}, "spec": {"schedulingGates": [{"name": "g"}]}, "status": {}},  # not asked
    ]
    assert unbound_summary(pods, {"a", "b", "c", "d", "e"}) == [
        (2, "gated"),
        (1, "Unschedulable: 0/1213 nodes are available: 1213 Insufficient cpu."),
        (1, "not tried: "),
    ]

"""The chart's Grafana dashboard: valid JSON, shipped in a ConfigMap only when enabled, and every
metric its queries name is one the agent or the controller really exports."""

from __future__ import annotations

import json
import re
from typing import Any

from chart_support import CHART_DIR, KUBE_VERSIONS, NAMESPACE, render_chart, validate_strict
from prometheus_client import CollectorRegistry

from driver.controller.metrics import ControllerMetrics
from driver.inventory.fake import load_profile, resolve_profile
from driver.inventory.fake_nvml import FakeNVML, FakeProcess
from driver.plugin.checkpoint import ClaimPhase, PreparedClaim
from driver.plugin.devices import DeviceKind, PreparedDevice
from driver.plugin.gpu_metrics import GpuMetricsCollector, GpuMetricsSource
from driver.plugin.sharing.base import ContainerEdits, ShareSpec
from driver.plugin.usage import PodIndex, PodRef

DASHBOARD = CHART_DIR / "dashboards" / "fractional-dra.json"
METRIC = re.compile(r"\b(fractional_[a-z0-9_]+|DCGM_FI_[A-Z0-9_]+)\b")
POD_UID = "0b9ad2f6-1c1e-4a57-9d43-3f4c2b8e7a10"


def _expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            exprs.append(target["expr"])
    return exprs


def _agent_sample_names(tmp_path: Any) -> set[str]:
    """Scrape an agent's GPU source with one prepared share and one process on it."""
    inventory = load_profile(resolve_profile("l4-2x"), node_name="node-a")
    gpu = inventory.gpus[0]
    share = ShareSpec(
        claim_uid="uid-1",
        device=gpu.name,
        gpu_uuid=gpu.uuid,
        ordinal=0,
        share_id="s-1",
        memory_bytes=1024**3,
        compute_percent=10,
        whole_gpu=False,
    )
    device = PreparedDevice(
        kind=DeviceKind.GPU,
        request_names=("gpu",),
        pool="node-a",
        device=gpu.name,
        share_id="s-1",
        cdi_name="x",
        cdi_device_ids=(),
        edits=ContainerEdits(),
        share=share,
        backend="none",
    )
    claim = PreparedClaim("uid-1", "default", "c", ClaimPhase.COMPLETED, "boot", (device,))
    pods = PodIndex()
    pods.remember("uid-1", [PodRef("default", "p", POD_UID)])
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text(f"0::/kubepods/pod{POD_UID}/abc\n")
    nvml = FakeNVML(inventory)
    nvml.start_process(FakeProcess(pid=42, gpu_uuid=gpu.uuid, memory_bytes=512 * 1024**2, sm_percent=5))
    source = GpuMetricsSource(
        inventory=inventory,
        nvml=nvml,
        prepared_claims=lambda: {"uid-1": claim},
        pods=pods,
        proc_root=tmp_path,
        dcgm_names=True,
    )
    registry = CollectorRegistry()
    GpuMetricsCollector().add_source(source, registry)
    return {sample.name for family in registry.collect() for sample in family.samples}


def _controller_sample_names() -> set[str]:
    registry = CollectorRegistry()
    metrics = ControllerMetrics(registry)
    metrics.decisions.labels(outcome="allocated").inc()
    metrics.consolidation_plans.labels(outcome="committed").inc()  # labelled: a sample once used
    metrics.consolidation_refused.labels(reason="no_plan").inc()
    metrics.observe_capacity({"node-a": {}}, [])
    summary = {"node-a": {"gpu-0": {"pool": "node-a", "memory_bytes_total": 1, "memory_bytes_free": 1}}}
    metrics.observe_fragmentation(summary, [], ["default/g"], now=1.0)
    return {sample.name for family in registry.collect() for sample in family.samples}


def test_dashboard_names_only_exported_metrics(tmp_path: Any) -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dashboard["uid"] == "fractional-dra"
    exprs = _expressions(dashboard)
    assert len(exprs) >= 15
    named = {name for expr in exprs for name in METRIC.findall(expr)}
    exported = _agent_sample_names(tmp_path) | _controller_sample_names()
    assert named - exported == set()
    # What the dashboard must show: packing, per-pod usage vs allocation,
    # fragmentation, controller decision rate and latency.
    for needed in (
        "fractional_share_memory_allocated_bytes",
        "fractional_gpu_memory_total_bytes",
        "fractional_share_memory_used_bytes",
        "fractional_share_compute_used_percent",
        "fractional_controller_gpus_free",
        "fractional_controller_stranded_memory_bytes",
        "fractional_controller_largest_free_share_memory_bytes",
        "fractional_controller_gpu_shares_bucket",
        "fractional_controller_gangs_waiting",
        "fractional_controller_decisions_total",
        "fractional_controller_decision_duration_seconds_bucket",
        "fractional_controller_consolidation_pods_moved_total",
    ):
        assert needed in named, needed
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_dashboard_config_map_only_when_enabled() -> None:
    assert not [
        o for o in render_chart(None) if o["kind"] == "ConfigMap" and "dashboard" in o["metadata"]["name"]
    ]
    objects = render_chart(
        {"metrics": {"dashboard": {"enabled": True, "annotations": {"grafana_folder": "GPU"}}}}
    )
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap" and "dashboard" in o["metadata"]["name"]]
    assert config_map["metadata"]["namespace"] == NAMESPACE
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "GPU"}
    assert json.loads(config_map["data"]["fractional-dra.json"]) == json.loads(DASHBOARD.read_text())
    for version in KUBE_VERSIONS:
        validate_strict(config_map, version)


def test_pod_monitor_only_when_enabled() -> None:
    assert not [o for o in render_chart(None) if o["kind"] == "PodMonitor"]
    objects = render_chart({"metrics": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}}}})
    (monitor,) = [o for o in objects if o["kind"] == "PodMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "kps"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
    assert monitor["spec"]["selector"]["matchExpressions"][0]["values"] == ["agent", "controller"]

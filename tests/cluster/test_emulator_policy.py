"""PriorityClasses, PodDisruptionBudgets and the eviction budget check, through the real client."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client


def pod(
    name: str, *, labels: dict[str, str] | None = None, priority_class: str | None = None
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}
    if priority_class:
        spec["priorityClassName"] = priority_class
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": spec,
    }


def priority_class(name: str, value: int, **extra: Any) -> dict[str, Any]:
    return {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name},
            "value": value, **extra}  # fmt: skip


def run(core: client.CoreV1Api, name: str) -> None:
    """What the kubelet reports for a started pod: Running and Ready."""
    current = core.read_namespaced_pod(name, "default", _preload_content=False)
    body = json.loads(current.data)
    body["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    core.replace_namespaced_pod_status(name, "default", body)


def evict(core: client.CoreV1Api, name: str, *, dry_run: bool = False) -> None:
    body: dict[str, Any] = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name}}
    if dry_run:
        body["deleteOptions"] = {"dryRun": ["All"]}
    core.create_namespaced_pod_eviction(name, "default", body)


def test_priority_class_resolved_into_the_pod(api_client: client.ApiClient, core: client.CoreV1Api) -> None:
    scheduling = client.SchedulingV1Api(api_client)
    scheduling.create_priority_class(priority_class("high", 1000))
    scheduling.create_priority_class(priority_class("polite", 500, preemptionPolicy="Never"))
    created = core.create_namespaced_pod("default", pod("a", priority_class="high"))
    assert created.spec.priority == 1000 and created.spec.preemption_policy == "PreemptLowerPriority"
    polite = core.create_namespaced_pod("default", pod("b", priority_class="polite"))
    assert polite.spec.priority == 500 and polite.spec.preemption_policy == "Never"
    assert core.create_namespaced_pod("default", pod("c")).spec.priority == 0
    critical = core.create_namespaced_pod("default", pod("d", priority_class="system-node-critical"))
    assert critical.spec.priority == 2000001000
    with pytest.raises(client.ApiException) as missing:
        core.create_namespaced_pod("default", pod("e", priority_class="nope"))
    assert missing.value.status == 403 and "no PriorityClass with name nope was found" in missing.value.body


def test_global_default_priority_class(api_client: client.ApiClient, core: client.CoreV1Api) -> None:
    client.SchedulingV1Api(api_client).create_priority_class(priority_class("dflt", 7, globalDefault=True))
    created = core.create_namespaced_pod("default", pod("a"))
    assert created.spec.priority == 7 and created.spec.priority_class_name == "dflt"


def test_eviction_honours_a_disruption_budget(api_client: client.ApiClient, core: client.CoreV1Api) -> None:
    policy = client.PolicyV1Api(api_client)
    created = policy.create_namespaced_pod_disruption_budget("default", {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "keep-one"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "web"}}},
        "status": {"disruptionsAllowed": 5, "currentHealthy": 0, "desiredHealthy": 0, "expectedPods": 0},
    })  # fmt: skip
    assert created.status is None or not created.status.disruptions_allowed  # reset on create
    for name in ("web-0", "web-1"):
        core.create_namespaced_pod("default", pod(name, labels={"app": "web"}))
        run(core, name)
    evict(core, "web-0", dry_run=True)  # allowed, and nothing happens
    core.read_namespaced_pod("web-0", "default")
    evict(core, "web-0")
    with pytest.raises(client.ApiException) as refused:
        core.read_namespaced_pod("web-0", "default")
    assert refused.value.status == 404
    for dry_run in (True, False):
        with pytest.raises(client.ApiException) as refused:
            evict(core, "web-1", dry_run=dry_run)
        assert refused.value.status == 429
        body = json.loads(refused.value.body)
        assert body["reason"] == "TooManyRequests"
        assert body["details"]["causes"][0]["reason"] == "DisruptionBudget"
    core.read_namespaced_pod("web-1", "default")
    core.create_namespaced_pod("default", pod("pending", labels={"app": "web"}))
    evict(core, "pending")  # a pod that is not running holds no budget back

"""Cooperation with Kueue without the admission check: a pod that still carries a Kueue
gate is never allocated, and is once ours is the last gate; pods the admission check placed are left
to it; no ProvisioningRequest of ours for pods Kueue's ProvisioningRequest check already covers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from driver.controller.kueue.check import (
    CONTROLLER_NAME,
    KUEUE_PROVISIONING_ANNOTATION,
    RESERVATION_ANNOTATION,
)
from driver.controller.model.objects import GATE, HINT_ANNOTATION
from tests.controller.conftest import Cluster, RunningController, gated_pod, gpu_claim, wait_for
from tests.kueue_support import install_kueue_crds

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)


def _with_gates(pod: dict[str, Any], *gates: str) -> dict[str, Any]:
    pod["spec"]["schedulingGates"] = [{"name": g} for g in gates]
    return pod


@pytest.mark.parametrize("kueue_gate", ["kueue.x-k8s.io/admission", "kueue.x-k8s.io/topology"])
def test_pod_with_a_kueue_gate_is_never_allocated_until_ours_is_the_last(
    cluster: Cluster, controller: Callable[..., RunningController], kueue_gate: str
) -> None:
    cluster.add_node("node-a", "h100-8x")
    cluster.create_claim(gpu_claim("held"))
    cluster.create_pod(_with_gates(gated_pod("held", ["held"]), kueue_gate, GATE))
    cluster.create_claim(gpu_claim("free"))
    cluster.create_pod(gated_pod("free", ["free"]))
    controller()
    wait_for(lambda: cluster.ungated("free") and cluster.allocated("free"), what="the control pod placed")
    # the controller has run its passes over both; the Kueue-gated one is untouched
    held = cluster.pod("held")
    assert [g["name"] for g in held["spec"]["schedulingGates"]] == [kueue_gate, GATE]
    assert not cluster.allocated("held") and not cluster.has_finalizer("held")
    # Kueue admits: its gate goes, ours is the last one
    held["spec"]["schedulingGates"] = [{"name": GATE}]
    cluster.core.replace_namespaced_pod("held", "default", held)
    wait_for(
        lambda: cluster.ungated("held") and cluster.allocated("held"), what="allocated after Kueue's gate"
    )


def test_pods_placed_by_the_admission_check_are_left_to_it(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    cluster.add_node("node-a", "h100-8x")
    cluster.create_claim(gpu_claim("reserved"))
    pod = gated_pod("reserved", ["reserved"])
    pod["metadata"]["annotations"] = {RESERVATION_ANNOTATION: "default/train"}
    cluster.create_pod(pod)
    cluster.create_claim(gpu_claim("other"))
    cluster.create_pod(gated_pod("other", ["other"]))
    controller()
    wait_for(lambda: cluster.ungated("other"), what="the control pod placed")
    assert not cluster.ungated("reserved") and not cluster.allocated("reserved")


def test_no_provisioning_request_of_ours_where_kueue_provisions(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    cluster.add_node("node-a", "l4-2x")
    for i in range(3):
        cluster.create_claim(gpu_claim(f"kq-{i}", memory="16Gi", compute=None))
        pod = gated_pod(f"kq-{i}", [f"kq-{i}"], gang="kq", size=3)
        pod["metadata"]["annotations"][KUEUE_PROVISIONING_ANNOTATION] = "kueue-made-it"
        cluster.create_pod(pod)
    controller(provisioning_requests=True, hint_profiles=("l4-2x",))
    # the gang was found unfit (its hint is written after any ProvisioningRequest would be)
    wait_for(
        lambda: (cluster.pod("kq-0")["metadata"].get("annotations") or {}).get(HINT_ANNOTATION), what="hint"
    )
    try:
        listed = client.CustomObjectsApi(cluster.api_client).list_namespaced_custom_object(
            "autoscaling.x-k8s.io", "v1", "default", "provisioningrequests"
        )
    except client.ApiException as error:  # pragma: no cover - the emulator serves them
        pytest.fail(f"provisioningrequests not served: {error}")
    assert listed["items"] == []


def test_controller_flag_runs_the_admission_check(
    cluster: Cluster, controller: Callable[..., RunningController]
) -> None:
    install_kueue_crds(cluster.api_client, ("admissionchecks", "workloads"))
    objects = client.CustomObjectsApi(cluster.api_client)
    objects.create_cluster_custom_object(
        "kueue.x-k8s.io",
        "v1beta2",
        "admissionchecks",
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "AdmissionCheck",
            "metadata": {"name": "ours"},
            "spec": {"controllerName": CONTROLLER_NAME},
        },
    )
    objects.create_cluster_custom_object(
        "kueue.x-k8s.io",
        "v1beta2",
        "admissionchecks",
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "AdmissionCheck",
            "metadata": {"name": "theirs"},
            "spec": {"controllerName": "kueue.x-k8s.io/provisioning-request"},
        },
    )
    controller(kueue_admission_check=True)

    def active(name: str) -> list[dict[str, Any]]:
        check = objects.get_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "admissionchecks", name)
        return [c for c in (check.get("status") or {}).get("conditions") or [] if c["type"] == "Active"]

    (condition,) = wait_for(lambda: active("ours"), what="Active=True on our AdmissionCheck")
    assert condition["status"] == "True" and condition["observedGeneration"] == 1
    assert active("theirs") == []  # another controller's check is not ours to touch

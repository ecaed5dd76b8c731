"""`fractional why`: Events matched on their object, not on a name inside a string; a
request no GPU can ever hold is called impossible, with the dimension and the largest capacity."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from kubernetes import client

from driver.cli import main
from driver.demo.objects import build_claim, build_device_classes, build_node, build_pod, gpu_request
from driver.inventory.fake import load_profile, resolve_profile
from driver.kube import as_dict, new_api_client
from driver.slices import build_resource_slices
from driver.why import event_is_about

NAMESPACE = "team"
NODE = "node-a"


@pytest.fixture
def api_client(kube_configuration: client.Configuration) -> Iterator[client.ApiClient]:
    with new_api_client(kube_configuration) as api_client:
        yield api_client


@pytest.fixture
def core(api_client: client.ApiClient) -> Iterator[client.CoreV1Api]:
    core, resource = client.CoreV1Api(api_client), client.ResourceV1Api(api_client)
    core.create_namespace(cast(Any, {"metadata": {"name": NAMESPACE}}))
    for device_class in build_device_classes():
        resource.create_device_class(cast(Any, device_class))
    core.create_node(cast(Any, build_node(NODE, profile="l4-2x", zone="z")))
    for resource_slice in build_resource_slices(load_profile(resolve_profile("l4-2x"), node_name=NODE)):
        resource.create_resource_slice(cast(Any, resource_slice))

    def pod(name: str, request: dict[str, Any], *, gated: bool = True) -> None:
        resource.create_namespaced_resource_claim(
            NAMESPACE, cast(Any, build_claim(f"{name}-claim", NAMESPACE, [request]))
        )
        body = build_pod(name, NAMESPACE, [f"{name}-claim"])
        if not gated:
            del body["spec"]["schedulingGates"]
        core.create_namespaced_pod(NAMESPACE, cast(Any, body))

    pod("train-1", gpu_request(memory="8Gi", compute=20))
    pod("train-10", gpu_request(memory="8Gi", compute=20))
    pod("over-compute", gpu_request(memory="8Gi", compute=150), gated=False)
    pod("over-memory", gpu_request(memory="100Gi"), gated=False)
    pod("three-gpus", {**gpu_request(), "exactly": {**gpu_request()["exactly"], "count": 3}}, gated=False)
    yield core


def _event(core: client.CoreV1Api, pod: str, message: str, uid: str | None = None) -> None:
    current = as_dict(core.read_namespaced_pod(pod, NAMESPACE))
    core.create_namespaced_event(NAMESPACE, cast(Any, {
        "metadata": {"generateName": f"{pod}."},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": NAMESPACE, "name": pod,
                           "uid": uid or current["metadata"]["uid"]},
        "reason": "GangUnschedulable", "message": message, "type": "Warning",
        "firstTimestamp": "2030-01-01T00:00:00Z", "lastTimestamp": "2030-01-01T00:00:00Z", "count": 1,
    }))  # fmt: skip


def _why(pod: str, kubeconfig: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    assert main(["why", f"{NAMESPACE}/{pod}", "--kubeconfig", str(kubeconfig)]) == 0
    return capsys.readouterr().out.splitlines()


def test_events_of_another_pod_whose_name_contains_this_one_are_not_shown(
    core: client.CoreV1Api, kubeconfig_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _event(core, "train-1", "about train-1")
    _event(core, "train-10", "about train-10 (gang pod:train-1 is not this)")
    _event(core, "train-1", "about an earlier train-1", uid="another-uid")  # a deleted namesake
    lines = _why("train-1", kubeconfig_file, capsys)
    events = lines[lines.index("latest events:") + 1 :]
    assert events == ["  GangUnschedulable: about train-1"]
    assert not any(line.startswith("impossible") for line in lines)  # 8Gi and 20 % fit an L4


def test_events_k8s_io_regarding_is_matched_too() -> None:
    event = {"regarding": {"kind": "Pod", "namespace": NAMESPACE, "name": "train-1", "uid": "u"}}
    assert event_is_about(event, "Pod", NAMESPACE, "train-1", "u")
    assert not event_is_about(event, "Pod", NAMESPACE, "train-10", "u")
    assert not event_is_about(event, "Pod", "other", "train-1", "u")
    assert not event_is_about(event, "PodGroup", NAMESPACE, "train-1", None)
    assert not event_is_about(event, "Pod", NAMESPACE, "train-1", "v")  # the name's earlier owner


@pytest.mark.parametrize(
    ("pod", "reason"),
    [
        ("over-compute", "compute: asks for 150%, the largest GPU in the cluster has 100%"),
        ("over-memory", "memory: asks for 100Gi, the largest GPU in the cluster has 22Gi"),
        ("three-gpus", "count: asks for 3 GPUs on one node, the largest node has 2"),
    ],
)
def test_a_request_that_can_never_fit_is_called_impossible(
    core: client.CoreV1Api, kubeconfig_file: Path, capsys: pytest.CaptureFixture[str], pod: str, reason: str
) -> None:
    lines = _why(pod, kubeconfig_file, capsys)
    assert not any("waiting for kube-scheduler" in line for line in lines)
    assert "  not gated and not bound: no node of this cluster can ever hold its claims (below)" in lines
    start = lines.index("impossible: no GPU in the cluster can ever hold this request, whatever is freed:")
    assert lines[start + 1] == f"  ResourceClaim {pod}-claim request gpu: {reason}"


def test_the_provisioning_request_asking_for_the_pods_nodes_is_shown(
    core: client.CoreV1Api, api_client: client.ApiClient, kubeconfig_file: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    custom = client.CustomObjectsApi(api_client)
    name = "train-scale-up-1a2b3c4d-a0-p0"
    core.create_namespaced_pod_template(NAMESPACE, cast(Any, {
        "metadata": {"name": f"{name}-0"},
        "template": {"spec": {"containers": [{"name": "c", "image": "i"}]}},
    }))  # fmt: skip
    custom.create_namespaced_custom_object("autoscaling.x-k8s.io", "v1", NAMESPACE, "provisioningrequests", {
        "apiVersion": "autoscaling.x-k8s.io/v1", "kind": "ProvisioningRequest", "metadata": {"name": name},
        "spec": {"provisioningClassName": "best-effort-atomic-scale-up.autoscaling.x-k8s.io",
                 "podSets": [{"podTemplateRef": {"name": f"{name}-0"}, "count": 1}]},
    })  # fmt: skip
    custom.patch_namespaced_custom_object_status(
        "autoscaling.x-k8s.io", "v1", NAMESPACE, "provisioningrequests", name,
        {"status": {"conditions": [{"type": "Provisioned", "status": "True",
                                    "reason": "CapacityIsProvisioned",
                                    "message": "Capacity is found in the cluster",
                                    "lastTransitionTime": "2030-01-01T00:00:00Z"}]}},
    )  # fmt: skip
    ours = {
        "autoscaling.x-k8s.io/consume-provisioning-request": name,
        "fractional.dev/provisioning-request": name,
    }
    core.patch_namespaced_pod("train-1", NAMESPACE, {"metadata": {"annotations": ours}})
    kueue = {"autoscaling.x-k8s.io/consume-provisioning-request": "job-train-10-check-1"}
    core.patch_namespaced_pod("train-10", NAMESPACE, {"metadata": {"annotations": kueue}})
    said = (
        f"ProvisioningRequest {name} (ours): Provisioned=True (CapacityIsProvisioned): "
        "Capacity is found in the cluster; waits for the new nodes and their ResourceSlices"
    )
    assert f"{said}; no node added yet" in _why("train-1", kubeconfig_file, capsys)
    # The node cluster-autoscaler adds, through its life: not Ready, Ready without our slices (an
    # agent that does not run there: the real cluster-autoscaler counts it as still coming and never
    # adds another, so this is where the wait is explained), then with them.
    time.sleep(1.1)  # creation times are in seconds: the node comes in a later one than the pod
    core.create_node(cast(Any, build_node("added-0", profile="l4-2x", zone="z")))
    added = f"{said}; nodes added since the pod was created: added-0"
    assert f"{added} (not Ready yet)" in _why("train-1", kubeconfig_file, capsys)
    ready = {
        "type": "Ready",
        "status": "True",
        "reason": "KubeletReady",
        "message": "ready",
        "lastHeartbeatTime": "2030-01-01T00:00:00Z",
        "lastTransitionTime": "2030-01-01T00:00:00Z",
    }
    core.patch_node_status("added-0", {"status": {"conditions": [ready]}})
    dark = f"{added} (Ready, no fractional.dev devices published: is our node agent running there?)"
    assert dark in _why("train-1", kubeconfig_file, capsys)
    resource = client.ResourceV1Api(api_client)
    for resource_slice in build_resource_slices(load_profile(resolve_profile("l4-2x"), node_name="added-0")):
        resource.create_resource_slice(cast(Any, resource_slice))
    assert f"{added} (Ready, devices published)" in _why("train-1", kubeconfig_file, capsys)
    assert (
        "ProvisioningRequest job-train-10-check-1 (not ours: Kueue's check): "
        "gone (it ended, or the gang was placed)" in _why("train-10", kubeconfig_file, capsys)
    )

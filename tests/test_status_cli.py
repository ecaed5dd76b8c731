"""`fractional status` and `fractional why` against the API emulator, run in-process through the CLI."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from kubernetes import client

from driver.allocator import allocate
from driver.cli import main
from driver.config import StatusConfig
from driver.controller.model.objects import HINT_ANNOTATION
from driver.demo.objects import build_claim, build_device_classes, build_node, build_pod, gpu_request
from driver.inventory.fake import load_profile, resolve_profile
from driver.kube import as_dict, new_api_client
from driver.slices import build_resource_slices
from driver.status import run_status

NAMESPACE = "team"
NODE = "node-a"
GIB = 1024**3


@pytest.fixture
def api_client(kube_configuration: client.Configuration) -> Iterator[client.ApiClient]:
    with new_api_client(kube_configuration) as api_client:
        yield api_client


@pytest.fixture
def cluster(api_client: client.ApiClient) -> Iterator[tuple[client.CoreV1Api, client.ResourceV1Api]]:
    core, resource = client.CoreV1Api(api_client), client.ResourceV1Api(api_client)
    core.create_namespace(
        cast(Any, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    )
    classes = build_device_classes()
    for device_class in classes:
        resource.create_device_class(cast(Any, device_class))
    core.create_node(cast(Any, build_node(NODE, profile="l4-2x", zone="z")))
    slices = build_resource_slices(load_profile(resolve_profile("l4-2x"), node_name=NODE))
    for resource_slice in slices:
        resource.create_resource_slice(cast(Any, resource_slice))
    allocated: list[dict[str, Any]] = []

    def running(name: str, request: dict[str, Any], device: str) -> None:
        claim = as_dict(
            resource.create_namespaced_resource_claim(
                NAMESPACE, cast(Any, build_claim(f"{name}-claim", NAMESPACE, [request]))
            )
        )
        body = build_pod(name, NAMESPACE, [f"{name}-claim"])
        del body["spec"]["schedulingGates"]  # placed already
        pod = as_dict(core.create_namespaced_pod(NAMESPACE, cast(Any, body)))
        pinned = [
            {**s, "spec": {**s["spec"], "devices": [d for d in s["spec"]["devices"] if d["name"] == device]}}
            for s in slices
        ]
        (allocation,) = allocate([claim], slices=pinned, classes=classes, allocated=allocated, node=NODE) or [
            None
        ]
        assert allocation is not None
        claim["status"] = {
            "allocation": allocation,
            "reservedFor": [{"resource": "pods", "name": name, "uid": pod["metadata"]["uid"]}],
        }
        resource.replace_namespaced_resource_claim_status(f"{name}-claim", NAMESPACE, cast(Any, claim))
        allocated.append(claim)

    running("infer", gpu_request(memory="20Gi", compute=10), "gpu-0")
    running("train", gpu_request(), "gpu-1")
    # A gang of two, one pod present and gated, asking for more than gpu-0 has left.
    resource.create_namespaced_resource_claim(
        NAMESPACE, cast(Any, build_claim("wait-0-claim", NAMESPACE, [gpu_request(memory="8Gi", compute=20)]))
    )
    pod = build_pod("wait-0", NAMESPACE, ["wait-0-claim"], gang="g", gang_size=2)
    pod["metadata"]["annotations"][HINT_ANNOTATION] = '{"profile":"l4-2x","nodes":1}'
    core.create_namespaced_pod(NAMESPACE, cast(Any, pod))
    yield core, resource


def test_status_shows_gpus_shares_and_pods(
    cluster: Any, kubeconfig_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--kubeconfig", str(kubeconfig_file)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    (gpu0,) = [line for line in lines if line.startswith(f"{NODE}   gpu-0")]
    (gpu1,) = [line for line in lines if line.startswith(f"{NODE}   gpu-1")]
    assert "20.0/" in gpu0 and "10%" in gpu0 and gpu0.endswith("1 shares")
    assert gpu1.endswith("whole GPU")
    assert "2 GPUs: 0 free, 1 taken whole, 1 shares on the others" in out
    assert f"  {NODE}/gpu-0: {NAMESPACE}/infer [infer-claim] 20Gi 10%" in lines
    assert f"  {NODE}/gpu-1: {NAMESPACE}/train [train-claim] whole GPU" in lines


def test_status_of_one_namespace_keeps_the_cluster_counts(
    cluster: Any, kubeconfig_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every GPU is held by the namespace "team": seen from another namespace, none is free either.
    assert main(["status", "-n", "other", "--kubeconfig", str(kubeconfig_file)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "GPUs of the whole cluster; claims of namespace other listed"
    assert "2 GPUs: 0 free, 1 taken whole, 1 shares on the others (cluster-wide)" in lines
    assert "no claim of namespace other holds a GPU" in lines
    assert not any(line.startswith(f"  {NODE}/") for line in lines)
    assert main(["status", "-n", NAMESPACE, "--kubeconfig", str(kubeconfig_file)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "2 GPUs: 0 free, 1 taken whole, 1 shares on the others (cluster-wide)" in lines
    assert f"  {NODE}/gpu-0: {NAMESPACE}/infer [infer-claim] 20Gi 10%" in lines


def test_status_watch_redraws_until_stopped(cluster: Any, kubeconfig_file: Path) -> None:
    stop = threading.Event()
    frames: list[str] = []

    class Out:
        def write(self, text: str) -> None:
            frames.append(text)
            if len(frames) == 2:
                stop.set()  # a second redraw happened: enough

        def flush(self) -> None:
            pass

    config = StatusConfig(
        kubeconfig=str(kubeconfig_file), watch=True, interval_seconds=0.01, namespace=NAMESPACE
    )
    assert run_status(config, stop, out=cast(Any, Out())) == 0
    assert len(frames) == 2 and all(frame.startswith("\x1b[H\x1b[2J") for frame in frames)


def test_why_explains_a_gated_gang_pod(
    cluster: Any, kubeconfig_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["why", f"{NAMESPACE}/wait-0", "--kubeconfig", str(kubeconfig_file)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"pod {NAMESPACE}/wait-0:"
    assert any("gated by fractional.dev/allocation" in line for line in lines)
    assert "  wait-0-claim: not allocated; asks for 1 shares of >=8Gi (20% compute)" in lines
    assert f"gang {NAMESPACE}/g: 2 pods expected, 1 present, 1 gated" in lines
    assert "  waits for 1 more pod(s) of the gang to exist" in lines
    closest = lines.index("closest GPUs and what each lacks:")
    assert lines[closest + 1].startswith(f"  {NODE}/gpu-0 (NVIDIA L4): memory: needs 8Gi,")
    assert lines[closest + 2] == f"  {NODE}/gpu-1 (NVIDIA L4): all of its memory is allocated (1 claim(s))"
    assert "best single node: none has room for any of its pods" in lines
    assert 'scale-up hint: {"profile":"l4-2x","nodes":1}' in lines


def test_why_for_a_running_pod_and_a_missing_one(
    cluster: Any, kubeconfig_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    core, _ = cluster
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "infer", "namespace": NAMESPACE},
        "target": {"apiVersion": "v1", "kind": "Node", "name": NODE},
    }
    core.create_namespaced_pod_binding("infer", NAMESPACE, cast(Any, binding), _preload_content=False)
    assert main(["why", f"{NAMESPACE}/infer", "--kubeconfig", str(kubeconfig_file)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"  is bound to node {NODE} (phase Pending): not held back" in lines
    assert f"  infer-claim: allocated ({NODE}/gpu-0)" in lines
    assert main(["why", f"{NAMESPACE}/nope", "--kubeconfig", str(kubeconfig_file)]) == 1
    assert main(["why", "no-slash", "--kubeconfig", str(kubeconfig_file)]) == 2


def test_why_counts_only_the_nodes_the_pod_may_use(
    cluster: Any, kubeconfig_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A second node with both GPUs free, which the gang's pod is kept off by its nodeSelector (as a
    # gang kept to one node group is, seen with cluster-autoscaler): its room is no answer.
    core, resource = cluster
    core.create_node(cast(Any, build_node("node-b", profile="l4-2x", zone="z")))
    for resource_slice in build_resource_slices(load_profile(resolve_profile("l4-2x"), node_name="node-b")):
        resource.create_resource_slice(cast(Any, resource_slice))
    resource.create_namespaced_resource_claim(
        NAMESPACE, cast(Any, build_claim("kept-0-claim", NAMESPACE, [gpu_request()]))
    )
    pod = build_pod("kept-0", NAMESPACE, ["kept-0-claim"], gang="kept", gang_size=1)
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": NODE}
    core.create_namespaced_pod(NAMESPACE, cast(Any, pod))
    assert main(["why", f"{NAMESPACE}/kept-0", "--kubeconfig", str(kubeconfig_file)]) == 0
    lines = capsys.readouterr().out.splitlines()
    closest = lines.index("closest GPUs and what each lacks:")
    listed = [line for line in lines[closest + 1 :] if line.startswith("  ")]
    assert listed and all(line.startswith(f"  {NODE}/") for line in listed[:2]), lines
    assert not any("node-b" in line for line in lines), lines
    assert "best single node: none has room for any of its pods" in lines
    # Without the nodeSelector node-b is the answer: the filter, not the room, decided above.
    pod = build_pod("free-0", NAMESPACE, ["kept-0-claim"], gang="free", gang_size=1)
    core.create_namespaced_pod(NAMESPACE, cast(Any, pod))
    assert main(["why", f"{NAMESPACE}/free-0", "--kubeconfig", str(kubeconfig_file)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "best single node: node-b has room for 1 of 1 gated pod(s) (1 devices)" in lines

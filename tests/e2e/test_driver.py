"""End to end on the kind cluster of ``make kind-up`` (fake h100-8x devices on two workers).

Run with ``make kind-e2e``; skipped unless kubectl reaches the context kind-fractional-dra and the
chart is installed. The claims and pods are made here (not read from examples/) so that each
test controls placement and can check exactly what it asked for.
"""

from __future__ import annotations

from typing import Any

import pytest
from e2e_support import DRIVER, DRIVER_IMAGE, apply, get, kubectl, list_items, pod, pod_env, wait_for
from kubernetes.utils import parse_quantity

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

GIB = 1024**3
POD_START_SECONDS = 300  # includes pulling the test image on a fresh cluster
GANG_DECISION_SECONDS = 120


def claim(
    name: str, requests: list[dict[str, Any]], constraints: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": requests}
    if constraints:
        devices["constraints"] = constraints
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": devices},
    }


def template(name: str, requests: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": requests}}},
    }


def gpu_request(
    name: str = "gpu", *, memory: str | None = None, compute: str | None = None, count: int | None = None,
    selectors: list[str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    exactly: dict[str, Any] = {"deviceClassName": "gpu.fractional.dev"}
    capacity = {key: value for key, value in (("memory", memory), ("compute", compute)) if value is not None}
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    if count is not None:
        exactly["count"] = count
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": expression}} for expression in selectors]
    return {"name": name, "exactly": exactly}


def our_slices() -> list[dict[str, Any]]:
    return list_items("resourceslices", "--field-selector", f"spec.driver={DRIVER}")


def device_in_slices(pool: str, device: str) -> dict[str, Any]:
    for resource_slice in our_slices():
        if resource_slice["spec"]["pool"]["name"] == pool:
            for candidate in resource_slice["spec"].get("devices", []):
                if candidate["name"] == device:
                    return dict(candidate)
    raise AssertionError(f"device {pool}/{device} is not published")


def attribute(device: dict[str, Any], name: str) -> Any:
    (value,) = device["attributes"][name].values()
    return value


def running(name: str, namespace: str) -> bool:
    phase = get("pod", name, namespace)["status"].get("phase")
    assert phase not in ("Failed", "Succeeded"), f"pod {namespace}/{name} ended: {phase}"
    return phase == "Running"


def allocation_of(name: str, namespace: str) -> dict[str, Any] | None:
    allocation: dict[str, Any] | None = (
        get("resourceclaim", name, namespace).get("status", {}).get("allocation")
    )
    return allocation


def our_results(allocation: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in allocation["devices"]["results"] if r["driver"] == DRIVER]


def test_the_driver_runs_the_image_make_image_built(kind_cluster: None) -> None:
    selector = "app.kubernetes.io/part-of=fractional-dra"
    workloads = ("daemonsets,deployments", "-n", "fractional-system", "-l", selector)
    images = kubectl("get", *workloads, "-o", "jsonpath={.items[*].spec.template.spec.containers[*].image}")
    assert set(images.split()) == {DRIVER_IMAGE}


def test_two_pods_share_one_gpu_and_each_sees_its_own_limits(namespace: str) -> None:
    # Pin both claims to the same GPU of the same node: gpu-0 of the first worker's pool.
    first = min(our_slices(), key=lambda s: s["spec"]["nodeName"])
    node = first["spec"]["nodeName"]
    gpu = device_in_slices(first["spec"]["pool"]["name"], "gpu-0")
    uuid = attribute(gpu, "uuid")
    selector = f'device.attributes["{DRIVER}"].uuid == "{uuid}"'
    shares = {"share-a": ("4Gi", "10"), "share-b": ("8Gi", "30")}
    objects: list[dict[str, Any]] = []
    for name, (memory, compute) in shares.items():
        objects.append(claim(name, [gpu_request(memory=memory, compute=compute, selectors=[selector])]))
        objects.append(pod(name, {"gpu": {"resourceClaimName": name}}, node=node))
    apply(objects, namespace)

    for name in shares:
        wait_for(
            lambda name=name: running(name, namespace), timeout=POD_START_SECONDS, what=f"pod {name} running"
        )
    results = {}
    for name in shares:
        allocation = allocation_of(name, namespace)
        assert allocation is not None
        (results[name],) = our_results(allocation)
    a, b = results["share-a"], results["share-b"]
    assert (a["pool"], a["device"]) == (b["pool"], b["device"]), "the two shares are on different GPUs"
    assert a.get("shareID") and b.get("shareID") and a["shareID"] != b["shareID"]
    for name, (memory, compute) in shares.items():
        consumed = results[name]["consumedCapacity"]
        assert parse_quantity(consumed["memory"]) == parse_quantity(memory)
        assert parse_quantity(consumed["compute"]) == parse_quantity(compute)
        env = pod_env(name, namespace)
        assert env["FRACTIONAL_GPU_UUID"] == uuid
        assert int(env["FRACTIONAL_GPU_MEMORY_LIMIT"]) == int(parse_quantity(memory))
        assert int(env["FRACTIONAL_GPU_COMPUTE_PERCENT"]) == int(compute)
        assert env["FRACTIONAL_CLAIM_UID"] == get("resourceclaim", name, namespace)["metadata"]["uid"]


def test_a_whole_gpu_pod_gets_a_gpu_nobody_shares(namespace: str) -> None:
    apply([claim("whole", [gpu_request()]), pod("whole", {"gpu": {"resourceClaimName": "whole"}})], namespace)
    wait_for(lambda: running("whole", namespace), timeout=POD_START_SECONDS, what="pod whole running")
    allocation = allocation_of("whole", namespace)
    assert allocation is not None
    (result,) = our_results(allocation)
    device = device_in_slices(result["pool"], result["device"])
    total = parse_quantity(device["capacity"]["memory"]["value"])
    assert parse_quantity(result["consumedCapacity"]["memory"]) == total
    assert int(pod_env("whole", namespace)["FRACTIONAL_GPU_MEMORY_LIMIT"]) == int(total)
    # Nobody else, in any namespace, holds that GPU.
    holders = [
        f"{c['metadata']['namespace']}/{c['metadata']['name']}"
        for c in list_items("resourceclaims", "--all-namespaces")
        for r in our_results(c.get("status", {}).get("allocation") or {"devices": {"results": []}})
        if (r["pool"], r["device"]) == (result["pool"], result["device"])
    ]
    assert holders == [f"{namespace}/whole"]


def test_gpu_and_nic_under_one_pcie_root(namespace: str) -> None:
    nic_request = {"name": "nic", "exactly": {"deviceClassName": "nic.fractional.dev"}}
    pair = claim(
        "pair",
        [gpu_request(), nic_request],
        constraints=[{"requests": ["gpu", "nic"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}],
    )
    apply([pair, pod("pair", {"pair": {"resourceClaimName": "pair"}})], namespace)
    wait_for(lambda: running("pair", namespace), timeout=POD_START_SECONDS, what="pod pair running")
    allocation = allocation_of("pair", namespace)
    assert allocation is not None
    by_request = {r["request"]: r for r in our_results(allocation)}
    assert set(by_request) == {"gpu", "nic"}
    roots = {
        name: attribute(device_in_slices(r["pool"], r["device"]), "resource.kubernetes.io/pcieRoot")
        for name, r in by_request.items()
    }
    assert roots["gpu"] == roots["nic"], roots
    assert by_request["gpu"]["pool"] == by_request["nic"]["pool"]
    assert pod_env("pair", namespace).get("FRACTIONAL_NIC_INTERFACE")


def _gang(namespace: str, gang: str, size: int, request: dict[str, Any]) -> list[str]:
    names = [f"{gang}-{index}" for index in range(size)]
    objects = [template(gang, [request])]
    objects += [pod(name, {"gpu": {"resourceClaimTemplateName": gang}}, gang=(gang, size)) for name in names]
    apply(objects, namespace)
    return names


def _gates(name: str, namespace: str) -> list[str]:
    return [g["name"] for g in get("pod", name, namespace)["spec"].get("schedulingGates", [])]


def _claims_of(name: str, namespace: str) -> list[str]:
    statuses = get("pod", name, namespace).get("status", {}).get("resourceClaimStatuses", [])
    return [s["resourceClaimName"] for s in statuses if s.get("resourceClaimName")]


def test_a_gated_gang_of_four_runs(namespace: str) -> None:
    names = _gang(namespace, "fits", 4, gpu_request(memory="8Gi", compute="10"))
    for name in names:
        wait_for(
            lambda name=name: running(name, namespace), timeout=POD_START_SECONDS, what=f"gang pod {name}"
        )
    for name in names:
        assert "fractional.dev/allocation" not in _gates(name, namespace)
        (claim_name,) = _claims_of(name, namespace)
        allocation = allocation_of(claim_name, namespace)
        assert allocation is not None and len(our_results(allocation)) == 1
        # The pod runs where the controller put its share.
        node = get("pod", name, namespace)["spec"]["nodeName"]
        (result,) = our_results(allocation)
        pools_on_node = {s["spec"]["pool"]["name"] for s in our_slices() if s["spec"]["nodeName"] == node}
        assert result["pool"] in pools_on_node


def test_a_gang_too_large_for_the_cluster_stays_gated_with_an_event(namespace: str) -> None:
    # Three pods of eight whole GPUs each: 24 GPUs, while two h100-8x workers have 16.
    names = _gang(namespace, "too-big", 3, gpu_request(count=8))

    def unschedulable_event() -> dict[str, Any] | None:
        for event in list_items("events", "-n", namespace):
            involved = event.get("involvedObject", {})
            if event.get("reason") == "GangUnschedulable" and involved.get("name") in names:
                return event
        return None

    event = wait_for(unschedulable_event, timeout=GANG_DECISION_SECONDS, what="a GangUnschedulable event")
    assert event["type"] == "Warning" and event.get("message")
    for name in names:
        assert _gates(name, namespace) == ["fractional.dev/allocation"]
        assert get("pod", name, namespace)["spec"].get("nodeName") is None
        for claim_name in _claims_of(name, namespace):
            assert allocation_of(claim_name, namespace) is None, (
                "a claim of an unschedulable gang was allocated"
            )
    hints = [get("pod", name, namespace)["metadata"].get("annotations", {}) for name in names]
    assert any("fractional.dev/scale-up-hint" in annotations for annotations in hints)

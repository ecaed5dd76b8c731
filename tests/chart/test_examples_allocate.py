"""The examples do what examples/README.md says, with the chart's DeviceClasses and the shipped
fake profiles, through the project's allocator (the same rules as kube-scheduler)."""

from __future__ import annotations

from typing import Any

import pytest
from chart_support import EXAMPLES_DIR, REPO_ROOT, load_manifest_file, render_chart
from kubernetes.utils import parse_quantity

from driver.allocator import allocate
from driver.inventory.fake import load_profile
from driver.slices import build_resource_slices


@pytest.fixture(scope="module")
def classes() -> list[dict[str, Any]]:
    return [o for o in render_chart(None) if o["kind"] == "DeviceClass"]


def slices_of(profile: str, node: str) -> list[dict[str, Any]]:
    return build_resource_slices(load_profile(REPO_ROOT / "fake_devices" / f"{profile}.yaml", node_name=node))


def claims_from(file_name: str, copies: int = 1) -> list[dict[str, Any]]:
    """The file's ResourceClaims, and ``copies`` claims made from each ResourceClaimTemplate."""
    claims = []
    for obj in load_manifest_file(EXAMPLES_DIR / file_name):
        if obj["kind"] == "ResourceClaim":
            specs = [obj["spec"]]
        elif obj["kind"] == "ResourceClaimTemplate":
            specs = [obj["spec"]["spec"]] * copies
        else:
            continue
        for spec in specs:
            index = len(claims)
            metadata = {"name": f"claim-{index}", "namespace": "default", "uid": f"uid-{index}"}
            claims.append(
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaim",
                    "metadata": metadata,
                    "spec": spec,
                }
            )
    assert claims, f"{file_name} has no claims"
    return claims


def device(slices: list[dict[str, Any]], result: dict[str, Any]) -> dict[str, Any]:
    for resource_slice in slices:
        for candidate in resource_slice["spec"].get("devices", []):
            if (
                resource_slice["spec"]["pool"]["name"] == result["pool"]
                and candidate["name"] == result["device"]
            ):
                return dict(candidate)
    raise AssertionError(f"no device {result['pool']}/{result['device']}")


def test_inference_replicas_get_12gib_20_percent_shares(classes: list[dict[str, Any]]) -> None:
    slices = slices_of("h100-8x", "worker-1")
    allocations = allocate(claims_from("inference-fractional.yaml", copies=3), slices=slices, classes=classes)
    assert allocations is not None
    for allocation in allocations:
        (result,) = allocation["devices"]["results"]
        assert parse_quantity(result["consumedCapacity"]["memory"]) == 12 * 1024**3
        assert parse_quantity(result["consumedCapacity"]["compute"]) == 20
        assert result["shareID"]


def test_whole_gpu_pod_takes_all_of_a_gpu(classes: list[dict[str, Any]]) -> None:
    slices = slices_of("a100-pcie-4x", "worker-1")
    claims = claims_from("whole-gpu-pod.yaml")
    allocations = allocate(claims, slices=slices, classes=classes)
    assert allocations is not None
    (result,) = allocations[0]["devices"]["results"]
    total = device(slices, result)["capacity"]["memory"]["value"]
    assert parse_quantity(result["consumedCapacity"]["memory"]) == parse_quantity(total)
    # ... so not even the smallest share fits on that GPU any more.
    smallest = {
        "metadata": {"name": "small", "namespace": "default", "uid": "small"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.fractional.dev",
            "capacity": {"requests": {"memory": "256Mi"}},
            "selectors": [{"cel": {"expression": f'device.attributes["fractional.dev"].uuid == '
                                   f'"{device(slices, result)["attributes"]["uuid"]["string"]}"'}}]}}]}},
    }  # fmt: skip
    allocated = [{**claims[0], "status": {"allocation": allocations[0]}}]
    assert allocate([smallest], slices=slices, classes=classes, allocated=allocated) is None
    assert allocate([smallest], slices=slices, classes=classes) is not None


def test_gpu_and_nic_share_a_pcie_root(classes: list[dict[str, Any]]) -> None:
    slices = slices_of("h100-8x", "worker-1")
    allocations = allocate(claims_from("gpu-nic-training.yaml"), slices=slices, classes=classes)
    assert allocations is not None
    results = {r["request"]: r for r in allocations[0]["devices"]["results"]}
    roots = {
        name: device(slices, r)["attributes"]["resource.kubernetes.io/pcieRoot"]["string"]
        for name, r in results.items()
    }
    assert set(roots) == {"gpu", "nic"} and roots["gpu"] == roots["nic"]


def test_gang_of_four_fits_together_or_not_at_all(classes: list[dict[str, Any]]) -> None:
    pods = [[index] for index in range(4)]  # one claim per pod
    claims = claims_from("gang-job.yaml", copies=4)
    slices = slices_of("h100-8x", "worker-1")
    allocations = allocate(claims, slices=slices, classes=classes, pod_groups=pods)
    assert allocations is not None
    for allocation in allocations:
        (result,) = allocation["devices"]["results"]
        assert parse_quantity(result["consumedCapacity"]["memory"]) == 20 * 1024**3
    # An L4 (~22 GiB) holds one 20 GiB share: a 2-GPU node takes two workers, never the gang.
    assert allocate(claims, slices=slices_of("l4-2x", "worker-1"), classes=classes, pod_groups=pods) is None


def test_cel_selection_picks_by_product_and_memory(classes: list[dict[str, Any]]) -> None:
    claims = claims_from("cel-selection.yaml")
    for profile in ("h100-8x", "a100-pcie-4x"):
        assert allocate(claims, slices=slices_of(profile, "worker-1"), classes=classes) is not None, profile
    assert allocate(claims, slices=slices_of("l4-2x", "worker-1"), classes=classes) is None
    mixed = slices_of("l4-2x", "small") + slices_of("h100-8x", "big")
    allocations = allocate(claims, slices=mixed, classes=classes)
    assert allocations is not None and allocations[0]["devices"]["results"][0]["pool"] == "big"

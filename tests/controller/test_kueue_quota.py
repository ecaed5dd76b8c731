"""The quota calculator against Kueue's own numbers (kubernetes-sigs/kueue
``test/e2e/dra/capacity/dra_test.go``: 20Gi -> 20Gi, 15500Mi -> 16Gi with a 1Gi step, count 2 -> 40Gi,
no request -> the full 80Gi) and against our published slices."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from driver.controller.kueue.quota import (
    GPU_MEMORY_RESOURCE,
    NIC_RESOURCE,
    CapacitySource,
    DeviceClassMapping,
    KueueQuotaError,
    compute_claim_charges,
    kueue_refusals,
    round_by_policy,
)
from driver.controller.model.objects import quantity
from driver.inventory.fake import load_profile, resolve_profile
from driver.slices import build_device_classes, build_resource_slices

GI = 1024**3
MI = 1024**2

# Kueue's e2e driver: devices with memory 80Gi, validRange min 1Gi step 1Gi (dra_test.go).
KUEUE_SLICE = {
    "metadata": {"name": "e2e-node-gpu"},
    "spec": {
        "driver": "gpu.example.com",
        "nodeName": "node-a",
        "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
        "devices": [
            {
                "name": f"gpu-{i}",
                "allowMultipleAllocations": True,
                "capacity": {
                    "memory": {
                        "value": "80Gi",
                        "requestPolicy": {"default": "80Gi",
                                          "validRange": {"min": "1Gi", "max": "80Gi", "step": "1Gi"}},
                    }
                },
            }
            for i in range(4)
        ],
    },
}  # fmt: skip
KUEUE_CLASS = {"metadata": {"name": "gpu.example.com"}, "spec": {}}
KUEUE_MAPPING = (
    DeviceClassMapping("memory", ("gpu.example.com",), (CapacitySource("memory", "gpu.example.com", ""),)),
)


def _claim(memory: str | None, count: int = 1, device_class: str = "gpu.example.com") -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if memory:
        exactly["capacity"] = {"requests": {"memory": memory}}
    if count != 1:
        exactly["count"] = count
    return {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}


@pytest.mark.parametrize(
    ("memory", "count", "charged"),
    [("20Gi", 1, 20 * GI), ("15500Mi", 1, 16 * GI), ("20Gi", 2, 40 * GI), (None, 1, 80 * GI)],
)
def test_kueue_e2e_numbers(memory: str | None, count: int, charged: int) -> None:
    charges = compute_claim_charges(
        _claim(memory, count), slices=[KUEUE_SLICE], classes=[KUEUE_CLASS], mappings=KUEUE_MAPPING
    )
    assert charges == {"memory": Decimal(charged)}


def test_above_max_and_too_few_devices_are_errors() -> None:
    with pytest.raises(KueueQuotaError, match="above the valid range"):
        compute_claim_charges(
            _claim("81Gi"), slices=[KUEUE_SLICE], classes=[KUEUE_CLASS], mappings=KUEUE_MAPPING
        )
    with pytest.raises(KueueQuotaError, match="insufficient matching devices"):
        compute_claim_charges(
            _claim("1Gi", 5), slices=[KUEUE_SLICE], classes=[KUEUE_CLASS], mappings=KUEUE_MAPPING
        )
    with pytest.raises(KueueQuotaError, match="not mapped"):
        compute_claim_charges(_claim("1Gi", device_class="other"), slices=[KUEUE_SLICE], classes=[],
                              mappings=KUEUE_MAPPING)  # fmt: skip


def test_valid_values_round_up() -> None:
    capacity = {
        "value": "40Gi",
        "requestPolicy": {"default": "10Gi", "validValues": ["10Gi", "20Gi", "40Gi"]},
    }
    assert round_by_policy(Decimal(11 * GI), capacity) == 20 * GI
    with pytest.raises(ValueError):
        round_by_policy(Decimal(41 * GI), capacity)


def test_our_h100_slices_charge_memory_rounded_by_256mi_and_nics_by_count() -> None:
    slices = build_resource_slices(load_profile(resolve_profile("h100-8x"), node_name="n1"))
    classes = build_device_classes()
    share = compute_claim_charges(_claim("12.1Gi", device_class="gpu.fractional.dev"), slices=slices,
                                  classes=classes)  # fmt: skip
    assert share == {GPU_MEMORY_RESOURCE: Decimal(12 * GI + 256 * MI)}
    whole = compute_claim_charges(
        _claim(None, device_class="gpu.fractional.dev"), slices=slices, classes=classes
    )
    gpu_values = [
        quantity(d["capacity"]["memory"]["value"])
        for s in slices for d in s["spec"]["devices"] if "memory" in (d.get("capacity") or {})
    ]  # fmt: skip
    assert whole == {GPU_MEMORY_RESOURCE: max(gpu_values)}  # the largest GPU's memory (79Gi)
    assert max(gpu_values) == 79 * GI
    nic = {
        "devices": {
            "requests": [{"name": "nic", "exactly": {"deviceClassName": "nic.fractional.dev", "count": 2}}]
        }
    }
    assert compute_claim_charges(nic, slices=slices, classes=classes) == {NIC_RESOURCE: Decimal(2)}


def test_refusals_name_what_kueue_refuses() -> None:
    pod = {"resourceClaims": [{"name": "gpu", "resourceClaimName": "shared"}]}
    assert "directly" in kueue_refusals(pod, name="pod p")[0]
    first = {"devices": {"requests": [{"name": "g", "firstAvailable": [{"name": "a"}]}]}}
    assert "firstAvailable" in kueue_refusals(first, name="c")[0]
    all_mode = {
        "devices": {"requests": [{"name": "g", "exactly": {"deviceClassName": "x", "allocationMode": "All"}}]}
    }
    assert "allocationMode All" in kueue_refusals(all_mode, name="c")[0]
    assert kueue_refusals(_claim("1Gi"), name="c") == []

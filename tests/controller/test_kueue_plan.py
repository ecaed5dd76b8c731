"""``fractional plan`` and Kueue: warnings for claims Kueue refuses, and with ``--kueue`` what Kueue
charges per gang and what one node of the profile counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from driver.cli import main

CLAIMS = {
    "gangs": [
        {"name": "train", "replicas": 4, "claim": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": "gpu.fractional.dev", "count": 2,
                                         "capacity": {"requests": {"memory": "20Gi"}}}},
            {"name": "nic", "exactly": {"deviceClassName": "nic.fractional.dev"}}]}}},
        {"name": "odd", "claim": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": "gpu.fractional.dev",
                                         "capacity": {"requests": {"memory": "15500Mi"}}}}]}}},
        {"name": "either", "claim": {"devices": {"requests": [
            {"name": "gpu", "firstAvailable": [
                {"name": "big", "deviceClassName": "gpu.fractional.dev",
                 "capacity": {"requests": {"memory": "40Gi"}}},
                {"name": "small", "deviceClassName": "gpu.fractional.dev",
                 "capacity": {"requests": {"memory": "20Gi"}}}]}]}}},
    ]
}  # fmt: skip


@pytest.fixture
def claims_file(tmp_path: Path) -> Path:
    path = tmp_path / "claims.yaml"
    path.write_text(yaml.safe_dump(CLAIMS), encoding="utf-8")
    return path


def test_plan_warns_about_claims_kueue_refuses(claims_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--profile", "h100-8x", "--claims", str(claims_file)]) == 0
    out = capsys.readouterr().out
    assert "warning: Kueue would refuse it: gang either claim 0: request gpu uses firstAvailable" in out
    assert "KUEUE CHARGE" not in out


def test_plan_prints_kueue_charges_by_kueues_rule(
    claims_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--profile", "h100-8x", "--claims", str(claims_file), "--kueue", "-o", "json"]) == 0
    report = json.loads(capsys.readouterr().out)["kueue"]
    rows = {row["gang"]: row for row in report["gangs"]}
    # count 2 x 20Gi, and one NIC, per pod; x 4 pods
    assert rows["train"]["perPod"] == {"fractional.dev/gpu-memory": "40Gi", "fractional.dev/nic": "1"}
    assert rows["train"]["total"] == {"fractional.dev/gpu-memory": "160Gi", "fractional.dev/nic": "4"}
    # 15500Mi rounded up by our 256Mi step (Kueue rounds by the device's requestPolicy)
    assert rows["odd"]["perPod"] == {"fractional.dev/gpu-memory": "15616Mi"}
    counts = {"fractional.dev/gpu-memory": "632Gi", "fractional.dev/nic": "8"}
    assert report["node"] == {"profile": "h100-8x", "counts": counts}
    assert any("firstAvailable" in w for w in report["warnings"])

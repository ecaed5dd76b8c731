"""``fractional plan``: the same hint search, offline, on a claims file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from driver.cli import main
from driver.config import PlanConfig
from driver.controller.diagnosis.plan import run_plan
from driver.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plan" / "claims.yaml"


def _rows(profile: str, claims: str | Path) -> dict[str, dict[str, object]]:
    text = run_plan(PlanConfig(profile=profile, claims=str(claims), output="json"))
    return {row["gang"]: row for row in json.loads(text)["rows"]}


def test_example_on_l4_nodes() -> None:
    rows = _rows("l4-2x", EXAMPLE)
    # An L4 has ~22Gi: one 12Gi share per GPU, so 18 replicas need 18 GPUs on 9 two-GPU nodes.
    assert rows["infer"]["nodes"] == 9
    assert rows["infer"]["gpusUsed"] == 18
    assert rows["infer"]["memoryUsedBytes"] == 18 * 12 * 1024**3
    # 40Gi shares never fit a 22Gi GPU.
    assert rows["train"]["fits"] is False
    assert rows["(all gangs, in order)"]["fits"] is False


def test_example_on_h100_nodes_and_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _rows("h100-8x", EXAMPLE)
    # 8 x 40Gi on eight ~79.5Gi GPUs (two 40Gi shares do not fit one GPU): exactly one node.
    assert rows["train"]["nodes"] == 1 and rows["train"]["gpusUsed"] == 8
    assert rows["notebook"]["gpusUsed"] == 1
    leftover = rows["train"]["leftoverMemoryBytesPerNode"]
    assert isinstance(leftover, dict) and len(leftover) == 1
    assert main(["plan", "--profile", "h100-8x", "--claims", str(EXAMPLE)]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:3] == ["GANG", "PODS", "FITS"]
    assert "1 x h100-8x" in table


def test_plain_resource_claim_documents(tmp_path: Path) -> None:
    path = tmp_path / "claims.yaml"
    path.write_text(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: one}\n"
        "spec: {devices: {requests: [{name: g, exactly: {deviceClassName: gpu.fractional.dev, count: 3}}]}}\n"
    )
    rows = _rows("l4-2x", path)
    assert rows["one"]["fits"] is False  # three whole GPUs in one claim: one node has two
    assert _rows("a100-pcie-4x", path)["one"]["nodes"] == 1


@pytest.mark.parametrize(
    ("content", "field"),
    [
        ("gangs: [{replicas: 2, claim: {devices: {}}}]", "gangs[0].name"),
        ("gangs: [{name: a, replicas: 0, claim: {devices: {}}}]", "gangs[0].replicas"),
        ("gangs: [{name: a, claim: {}}]", "gangs[0].claims[0]"),
        ("gangs: [{name: a, claim: {devices: {}}, claims: []}]", "gangs[0]"),
        ("other: 1", "gangs"),
    ],
)
def test_bad_claims_file_names_the_field(tmp_path: Path, content: str, field: str) -> None:
    path = tmp_path / "claims.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError) as raised:
        run_plan(PlanConfig(profile="l4-2x", claims=str(path)))
    assert f": {field}" in str(raised.value)


def test_a_deeply_nested_claims_file_is_a_clear_error(tmp_path: Path) -> None:
    claims = tmp_path / "deep.yaml"
    claims.write_text("gangs: " + "[" * 3000 + "]" * 3000 + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="nested too deeply"):
        run_plan(PlanConfig(profile="h100-8x", claims=str(claims), output="json"))

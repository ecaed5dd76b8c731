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


EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").rglob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(EXAMPLES[0].parents[1])))
def test_every_shipped_example_is_planned_or_its_skip_is_named(example: Path) -> None:
    """Each example either plans (rows, and a reason for anything left out) or says, per object,
    why there is nothing to plan."""
    try:
        text = run_plan(PlanConfig(profile="h100-8x", claims=str(example), output="json"))
    except ConfigError as error:
        assert ": gangs: nothing to plan (" in str(error)
        reasons = str(error).split("nothing to plan (", 1)[1]
        assert all(": " in part for part in reasons.split("; ")), reasons
        return
    document = json.loads(text)
    assert document["rows"], example
    assert all(row["fits"] for row in document["rows"]), document  # every example fits one h100-8x
    for skipped in document.get("skipped", ()):
        assert skipped["object"] and skipped["reason"]


@pytest.mark.parametrize(
    ("example", "gang", "pods"),
    [
        ("gang-job.yaml", "gang-train", 4),  # a Job's parallelism, gang by our label
        ("inference-fractional.yaml", "deployment/inference", 3),  # a Deployment's replicas
        ("gpu-nic-training.yaml", "pod/aligned-training", 1),  # a Pod with a template
        ("kueue/job.yaml", "kueue-train", 4),
        ("kueue/whole-gpu-job.yaml", "job/whole-gpu", 1),
    ],
)
def test_workloads_with_claim_templates_are_read(example: str, gang: str, pods: int) -> None:
    rows = _rows("h100-8x", _example(example))
    assert rows[gang]["pods"] == pods and rows[gang]["nodes"] == 1


def _example(name: str) -> Path:
    return Path(__file__).resolve().parents[2] / "examples" / name


_TEMPLATE = (
    "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata: {name: share}\n"
    "spec: {spec: {devices: {requests: [{name: g, exactly: {deviceClassName: gpu.fractional.dev,"
    " capacity: {requests: {memory: 40Gi}}}}]}}}\n---\n"
    "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata: {name: whole}\n"
    "spec: {spec: {devices: {requests: [{name: g, exactly: {deviceClassName: gpu.fractional.dev}}]}}}\n---\n"
)
_POD = (
    "{metadata: {labels: {fractional.dev/gang: %s}, annotations: {fractional.dev/gang-size: '%d'}},"
    " spec: {schedulingGates: [{name: fractional.dev/allocation}], resourceClaims: [{name: g,"
    " resourceClaimTemplateName: %s}], containers: [{name: c, image: x}]}}"
)


def test_a_jobset_is_replicated_jobs_times_replicas_times_parallelism(tmp_path: Path) -> None:
    path = tmp_path / "jobset.yaml"
    path.write_text(
        _TEMPLATE + "apiVersion: jobset.x-k8s.io/v1alpha2\nkind: JobSet\nmetadata: {name: js}\n"
        "spec: {replicatedJobs: [{name: workers, replicas: 2, template: {spec: {parallelism: 3,"
        f" completions: 3, template: {_POD % ('js', 6, 'share')}}}}}}}]}}\n"
    )
    rows = _rows("h100-8x", path)
    assert rows["js"]["pods"] == 6 and rows["js"]["nodes"] == 1  # 2 x 3 pods, one 40Gi share each
    assert rows["js"]["gpusUsed"] == 6


def test_a_leader_worker_set_is_size_times_replicas_one_gang_per_group(tmp_path: Path) -> None:
    path = tmp_path / "lws.yaml"
    path.write_text(
        _TEMPLATE + "apiVersion: leaderworkerset.x-k8s.io/v1\nkind: LeaderWorkerSet\nmetadata: {name: lws}\n"
        "spec: {replicas: 2, leaderWorkerTemplate: {size: 3,"
        " leaderTemplate: {spec: {schedulingGates: [{name: fractional.dev/allocation}], resourceClaims:"
        " [{name: g, resourceClaimTemplateName: whole}], containers: [{name: c, image: x}]}},"
        " workerTemplate: {spec: {schedulingGates: [{name: fractional.dev/allocation}], resourceClaims:"
        " [{name: g, resourceClaimTemplateName: share}], containers: [{name: c, image: x}]}}}}\n"
    )
    rows = _rows("h100-8x", path)
    # LWS labels each group with its group key and size: two gangs of three pods (leader + 2 workers)
    assert set(rows) == {"lws-0", "lws-1", "(all gangs, in order)"}
    assert rows["lws-0"]["pods"] == 3
    assert rows["lws-0"]["memoryUsedBytes"] == 79 * 1024**3 + 2 * 40 * 1024**3  # a whole H100, two shares


def test_what_cannot_be_planned_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mixed.yaml"
    path.write_text(
        _TEMPLATE + "apiVersion: batch/v1\nkind: Job\nmetadata: {name: short}\n"
        f"spec: {{parallelism: 2, template: {_POD % ('short', 4, 'share')}}}\n---\n"
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: settings}\n---\n"
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\n"
        "spec: {replicas: 2, selector: {}, template: {spec: {resourceClaims: [{name: g,"
        " resourceClaimTemplateName: whole}], containers: [{name: c, image: x}]}}}\n"
    )
    assert main(["plan", "--profile", "h100-8x", "--claims", str(path)]) == 0
    out = capsys.readouterr().out
    assert "deployment/web" in out
    skipped = out.split("skipped:\n", 1)[1].splitlines()
    assert skipped == [
        "  Job short: gang short needs 4 pods together, the file makes 2: the controller would wait for"
        " the rest",
        "  ConfigMap settings: not a workload: it makes no pods and asks for no devices",
    ]

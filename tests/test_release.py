"""The release path: the workflow files pass actionlint; the version is written once (pyproject.toml)
and the chart, the package and the release workflow follow it; CI runs what the README says.

actionlint comes from the ``workflows`` extra (``pip install -e '.[workflows]'``), from PATH, or
from ``make actionlint`` (upstream's binary built from its Go module); the test that runs it is
skipped only when none of these gives a binary that runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

import driver

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = REPO_ROOT / ".github" / "workflows"
CHART = REPO_ROOT / "charts" / "fractional-dra" / "Chart.yaml"
ACTIONLINT_CACHE = Path.home() / ".cache" / "fractional-dra" / "bin" / "actionlint"


def _version() -> str:
    with (REPO_ROOT / "pyproject.toml").open("rb") as file:
        version: str = tomllib.load(file)["project"]["version"]
    return version


def _workflow(name: str) -> dict[Any, Any]:
    loaded = yaml.safe_load((WORKFLOWS / name).read_text(encoding="utf-8"))
    assert isinstance(loaded, dict), f"{name}: not a mapping"
    return loaded


def _steps(workflow: dict[Any, Any]) -> list[dict[str, Any]]:
    return [step for job in workflow["jobs"].values() for step in job.get("steps") or ()]


def _actionlint() -> str | None:
    candidates = [Path(sys.prefix) / "bin" / "actionlint", shutil.which("actionlint"), ACTIONLINT_CACHE]
    for candidate in candidates:
        if candidate is None or not Path(candidate).is_file():
            continue
        try:
            subprocess.run([str(candidate), "-version"], capture_output=True, timeout=30, check=True)
        except (OSError, subprocess.SubprocessError):
            continue  # present but cannot run here (another architecture, a broken download)
        return str(candidate)
    return None


def test_the_workflows_pass_actionlint() -> None:
    files = sorted(WORKFLOWS.glob("*.yml"))
    assert [path.name for path in files] == ["ci.yml", "release.yml"]
    binary = _actionlint()
    if binary is None:
        pytest.skip("no actionlint that runs: pip install -e '.[workflows]', or make actionlint (needs Go)")
    result = subprocess.run(
        [binary, "-color=false", *(str(path.relative_to(REPO_ROOT)) for path in files)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_version_is_written_once_and_the_chart_and_package_follow_it() -> None:
    chart = yaml.safe_load(CHART.read_text(encoding="utf-8"))
    assert (chart["version"], chart["appVersion"], driver.__version__) == (_version(),) * 3


def _version_step() -> dict[str, Any]:
    return next(step for step in _steps(_workflow("release.yml")) if step.get("id") == "version")


@pytest.mark.parametrize(
    ("tag", "owner", "published"),
    [
        pytest.param(f"v{_version()}", "Fractional-DRA", True, id="the-version"),
        pytest.param("v9.9.9", "fractional-dra", False, id="another-version"),
        pytest.param(_version(), "fractional-dra", False, id="no-v"),
    ],
)
def test_the_release_workflow_publishes_only_the_tag_of_the_version(
    tmp_path: Path, tag: str, owner: str, published: bool
) -> None:
    """The version job's own script, run here as the forge runs it (bash, GITHUB_OUTPUT)."""
    outputs = tmp_path / "outputs"
    outputs.touch()
    env = {**os.environ, "TAG": tag, "OWNER": owner, "GITHUB_OUTPUT": str(outputs)}
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", _version_step()["run"]],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if published:
        assert result.returncode == 0, result.stdout + result.stderr
        assert outputs.read_text().splitlines() == [
            f"version={_version()}",
            "registry=ghcr.io/fractional-dra",
        ]
    else:
        assert result.returncode == 1
        assert f"::error::tag {tag} is not v{_version()}" in result.stdout
        assert outputs.read_text() == ""


def test_the_release_builds_both_architectures_and_pushes_image_and_chart() -> None:
    workflow = _workflow("release.yml")
    assert workflow[True]["push"]["tags"] == ["v*"]  # PyYAML reads the key `on` as True
    steps = _steps(workflow)
    build = next(step for step in steps if str(step.get("uses", "")).startswith("docker/build-push-action"))
    assert build["with"]["platforms"].split(",") == ["linux/amd64", "linux/arm64"]
    assert build["with"]["push"] is True
    image = "${{ needs.version.outputs.registry }}/fractional-dra:${{ needs.version.outputs.version }}"
    assert build["with"]["tags"] == image
    scripts = "\n".join(str(step.get("run", "")) for step in steps)
    assert re.search(
        r'helm package charts/fractional-dra --version "\$\{VERSION\}" --app-version "\$\{VERSION\}"', scripts
    )
    assert 'helm push "dist/fractional-dra-${VERSION}.tgz" "oci://${REGISTRY}/charts"' in scripts
    assert workflow["jobs"]["ci"]["uses"] == "./.github/workflows/ci.yml"  # nothing ships that fails CI


def test_ci_runs_the_readmes_test_command_and_the_image_test() -> None:
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    quick_start = readme.split("## Quick start", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    assert quick_start.split() == ["make", "demo", "make", "test"]
    runs = [str(step.get("run", "")).strip() for step in _steps(_workflow("ci.yml"))]
    assert "make test" in runs
    assert "make image-test" in runs

"""The image build context, the shell scripts, the kind config and the chart's profile copies."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from chart_support import CHART_DIR, REPO_ROOT

SCRIPTS = sorted((REPO_ROOT / "hack").glob("*.sh"))


# -- shell scripts ------------------------------------------------------------------------------


def test_scripts_exist_and_are_executable() -> None:
    names = {path.name for path in SCRIPTS}
    assert {"kind-up.sh", "kind-down.sh", "sync-chart-profiles.sh"} <= names
    for path in SCRIPTS:
        assert path.stat().st_mode & 0o111, f"{path.name} is not executable"
        text = path.read_text(encoding="utf-8")
        assert text.startswith("#!/usr/bin/env bash\n"), path.name
        assert "set -euo pipefail" in text, path.name


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(path: Path) -> None:
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_script_passes_shellcheck(path: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (Debian package shellcheck; .ci/run installs it)")
    done = subprocess.run(
        ["shellcheck", "--severity=style", str(path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_kind_config() -> None:
    config = yaml.safe_load((REPO_ROOT / "hack/kind-config.yaml").read_text(encoding="utf-8"))
    assert config["kind"] == "Cluster" and config["name"] == "fractional-dra"
    assert [node["role"] for node in config["nodes"]] == ["control-plane", "worker", "worker"]
    # The feature gates and runtime config are the release's, added by hack/kind_settings.py
    # (tests/hack/test_kind_settings.py), so that one file serves 1.35 to 1.37.
    assert "featureGates" not in config and "runtimeConfig" not in config
    (patch,) = config["containerdConfigPatches"]
    assert re.search(r"enable_cdi\s*=\s*true", patch)
    # kind-up.sh selects the workers by the label the config gives them, and their profiles by the other.
    labels = {key for node in config["nodes"] for key in node.get("labels", {})}
    assert labels == {"fractional.dev/fake-node", "fractional.dev/fake-profile"}
    script = (REPO_ROOT / "hack/kind-up.sh").read_text(encoding="utf-8")
    assert "fractional.dev/fake-node".replace(".", "\\\\.") in script
    assert "fakeDevices.profileNodeLabel=fractional.dev/fake-profile" in script


# -- the chart's copies of fake_devices/ --------------------------------------------------------


def test_chart_profiles_equal_fake_devices() -> None:
    originals = {path.name: path for path in (REPO_ROOT / "fake_devices").glob("*.yaml")}
    copies = {path.name: path for path in (CHART_DIR / "files/profiles").glob("*.yaml")}
    assert originals, "fake_devices/ has no profiles"
    assert set(copies) == set(originals), "run hack/sync-chart-profiles.sh"
    for name, path in originals.items():
        assert copies[name].read_bytes() == path.read_bytes(), (
            f"{name} differs: run hack/sync-chart-profiles.sh"
        )


# -- Dockerfile and .dockerignore ---------------------------------------------------------------


def _dockerignore() -> list[tuple[bool, str]]:
    rules = []
    for line in (REPO_ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            rules.append((line.startswith("!"), line.lstrip("!")))
    return rules


def _in_context(relative: str) -> bool:
    """Docker's rule: the last matching pattern wins; an excluded parent excludes its files."""
    included = True
    parts = relative.split("/")
    for negated, pattern in _dockerignore():
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            if fnmatch.fnmatchcase(prefix, pattern) or (
                pattern.startswith("**/") and fnmatch.fnmatchcase(parts[depth - 1], pattern[3:])
            ):
                included = negated
                break
    return included


def _stages() -> list[list[str]]:
    stages: list[list[str]] = []
    text = (REPO_ROOT / "Dockerfile").read_text(encoding="utf-8").replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def test_build_context_holds_what_the_build_copies() -> None:
    copied = []
    for stage in _stages():
        for line in stage:
            if line.startswith("COPY ") and "--from=" not in line:
                *sources, _ = line.split()[1:]
                copied += sources
    assert {"pyproject.toml", "README.md", "driver", "fake_devices"} <= set(copied)
    for source in copied:
        assert (REPO_ROOT / source).exists(), f"COPY {source}: missing"
        assert _in_context(source), f"COPY {source}: excluded by .dockerignore"
    # pip install . needs every package module (generated gRPC stubs included) and the readme.
    for path in (REPO_ROOT / "driver").rglob("*.py"):
        relative = str(path.relative_to(REPO_ROOT))
        if "__pycache__" not in relative:
            assert _in_context(relative), relative
    assert not _in_context(".venv") and not _in_context("tests") and not _in_context(".git")
    assert not _in_context("driver/__pycache__")


def test_image_is_multi_stage_non_root_without_build_tools() -> None:
    builder, final = _stages()
    assert builder[0] == "FROM ${PYTHON_IMAGE} AS builder" and final[0] == "FROM ${PYTHON_IMAGE}"
    header = (REPO_ROOT / "Dockerfile").read_text(encoding="utf-8")
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in header
    assert any(
        "pip install" in line and line.rstrip().split("&&")[0].rstrip().endswith(" .") for line in builder
    )
    assert "COPY --from=builder /opt/venv /opt/venv" in final
    for line in final:
        assert not re.search(r"\b(apt-get|apk|gcc|build-essential|pip install)\b", line), line
    (user,) = [line for line in final if line.startswith("USER ")]
    uid = user.split()[1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    assert final[-2:] == ['ENTRYPOINT ["fractional"]', 'CMD ["--help"]']
    pyproject = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'fractional = "driver.cli:main"' in pyproject

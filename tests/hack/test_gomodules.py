"""hack/gomodules.py: where other projects' files come from (the Go module cache), at which pins."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.go_modules import gomodules

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_pins_are_the_local_clusters() -> None:
    from localcluster.cluster import DEFAULT_VERSION  # hack/ is on sys.path through tests.go_modules

    assert gomodules.KUBERNETES_RELEASE == DEFAULT_VERSION
    build = (REPO_ROOT / "hack" / "upstream-build.sh").read_text(encoding="utf-8")
    pin = re.search(r'kueue_version="\$\(version_of "\$\{KUEUE_VERSION:-([^}]+)\}"\)"', build)
    assert pin is not None and f"v{pin.group(1)}" == gomodules.KUEUE_VERSION
    kwok = re.search(r'kwok_version="\$\(version_of "\$\{KWOK_VERSION:-([^}]+)\}"\)"', build)
    assert kwok is not None and f"v{kwok.group(1)}" == gomodules.KWOK_VERSION  # the binary and its stages


@pytest.mark.parametrize(
    ("release", "version"),
    [("1.37.2", "v0.37.2"), ("v1.36.3", "v0.36.3"), ("1.38.0-alpha.1", "v0.38.0-alpha.1")],
)
def test_a_releases_staging_modules_are_v0_of_it(release: str, version: str) -> None:
    assert gomodules.kubernetes_staging_version(release) == version


def test_what_is_not_a_release_is_refused() -> None:
    with pytest.raises(ValueError, match=re.escape("'2.0' is not a Kubernetes release")):
        gomodules.kubernetes_staging_version("2.0")


def test_the_required_version_is_read_from_go_mod(tmp_path: Path) -> None:
    (tmp_path / "go.mod").write_text(
        "module example.com/m\n\ngo 1.25\n\nrequire example.com/single v1.0.0\n\n"
        "require (\n\tk8s.io/api v0.36.2\n\tk8s.io/autoscaler/cluster-autoscaler/apis v0.0.0-2024-abc\n"
        "\tk8s.io/autoscaler/cluster-autoscaler v1.30.0 // indirect\n)\n\n"
        "replace example.com/moved => example.com/moved v1.2.3\n"
        "replace example.com/local => ../local\n"
    )
    assert (
        gomodules.required_version(tmp_path, "k8s.io/autoscaler/cluster-autoscaler/apis") == "v0.0.0-2024-abc"
    )
    assert gomodules.required_version(tmp_path, "example.com/single") == "v1.0.0"
    assert gomodules.required_version(tmp_path, "example.com/moved") == "v1.2.3"
    with pytest.raises(ValueError, match=re.escape("replaces example.com/local by ../local")):
        gomodules.required_version(tmp_path, "example.com/local")
    with pytest.raises(ValueError, match=re.escape("does not require example.com/absent")):
        gomodules.required_version(tmp_path, "example.com/absent")


def test_a_module_in_the_cache_is_used_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FRACTIONAL_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", "")  # no Go: nothing may be fetched
    held = tmp_path / "go" / "mod" / "github.com" / "!burnt!sushi" / "toml@v1.0.0"
    held.mkdir(parents=True)
    (held / "go.mod").write_text("module github.com/BurntSushi/toml\n")
    assert gomodules.module_dir("github.com/BurntSushi/toml", "v1.0.0") == held


def test_without_the_cache_or_go_the_error_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FRACTIONAL_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", "")
    with pytest.raises(gomodules.ModuleUnavailable) as caught:
        gomodules.kueue_dir()
    message = str(caught.value)
    assert f"sigs.k8s.io/kueue@{gomodules.KUEUE_VERSION}" in message
    assert "Go is not installed" in message and "make go-modules" in message

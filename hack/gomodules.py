"""Upstream files the project reads but does not hold, found in the Go module cache.

Kubernetes' ``.proto`` definitions, Kueue's and cluster-autoscaler's CustomResourceDefinitions are
other projects' files: they are published in those projects' Go modules, so they are taken from
there when a generator or a test needs them, never copied into the repository. The modules go
into the same cache as the local cluster's binaries (``hack/upstream-build.sh``):
``${FRACTIONAL_CACHE:-~/.cache/fractional-dra}/go/mod``, fetched through the Go module proxy with
``go mod download`` when Go is installed.

The pins follow what the project tests against: the Kubernetes release the local cluster builds
by default (its ``k8s.io/api`` and ``k8s.io/apimachinery`` are ``v0.<minor>.<patch>``), the Kueue
release it builds, and the cluster-autoscaler API module at the version that Kueue release
requires (read from its ``go.mod``).

Usage: gomodules.py   fetch every module named above and print where each is (``make go-modules``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = [
    "AUTOSCALER_APIS",
    "KUBERNETES_RELEASE",
    "KUEUE_VERSION",
    "ModuleUnavailable",
    "autoscaler_apis_dir",
    "kubernetes_staging_version",
    "kueue_dir",
    "module_cache",
    "module_dir",
    "required_version",
]

# The release hack/localcluster builds when K8S_VERSION is not set (tests/hack checks they agree).
KUBERNETES_RELEASE = "1.37.2"
# hack/upstream-build.sh's Kueue pin (tests/hack checks they agree).
KUEUE_VERSION = "v0.19.2"
KWOK_VERSION = "v0.8.0"  # the fleet's fake nodes (hack/localcluster/fleet.py): its stages
AUTOSCALER_APIS = "k8s.io/autoscaler/cluster-autoscaler/apis"
FETCH_TIMEOUT_SECONDS = 300.0


class ModuleUnavailable(RuntimeError):
    """A module is not in the cache and cannot be fetched here; the message says how to get it."""


def module_cache() -> Path:
    """GOMODCACHE of the project's cache outside the checkout."""
    root = Path(os.environ.get("FRACTIONAL_CACHE") or Path.home() / ".cache" / "fractional-dra")
    return root / "go" / "mod"


def _escaped(path: str) -> str:
    """The module cache's spelling of a path: each capital letter becomes ``!`` and its lower case."""
    return re.sub(r"[A-Z]", lambda match: "!" + match.group(0).lower(), path)


def kubernetes_staging_version(release: str = KUBERNETES_RELEASE) -> str:
    """``1.37.2`` -> ``v0.37.2``: the version of k8s.io/api and k8s.io/apimachinery of a release."""
    match = re.fullmatch(r"v?1\.(\d+\.\d+(?:-[0-9A-Za-z.-]+)?)", release)
    if match is None:
        raise ValueError(f"{release!r} is not a Kubernetes release such as 1.37.2")
    return f"v0.{match.group(1)}"


def module_dir(path: str, version: str, *, fetch: bool = True) -> Path:
    """The unpacked source of ``path@version`` in the cache, fetched with ``go mod download`` when
    it is missing and Go is installed; ``ModuleUnavailable`` when it cannot be had."""
    cache = module_cache()
    found = cache / f"{_escaped(path)}@{_escaped(version)}"
    if found.is_dir() and any(found.iterdir()):
        return found
    go = shutil.which("go")
    if not fetch or go is None:
        raise ModuleUnavailable(
            f"{path}@{version} is not in the Go module cache {cache}"
            + ("" if go else " and Go is not installed")
            + ": install Go and run `make go-modules` (or `python3 hack/gomodules.py`)"
        )
    env = dict(os.environ, GOMODCACHE=str(cache), GOFLAGS="-modcacherw")
    try:
        result = subprocess.run(
            [go, "mod", "download", "-json", f"{path}@{version}"],
            env=env,
            cwd=cache.parent if cache.parent.is_dir() else None,
            capture_output=True,
            text=True,
            timeout=FETCH_TIMEOUT_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ModuleUnavailable(
            f"go mod download {path}@{version} took over {FETCH_TIMEOUT_SECONDS:.0f} s"
        ) from None
    try:
        answer = json.loads(result.stdout or "{}")
    except json.JSONDecodeError:
        answer = {}
    if result.returncode != 0 or answer.get("Error") or not answer.get("Dir"):
        reason = answer.get("Error") or result.stderr.strip() or f"exit {result.returncode}"
        raise ModuleUnavailable(f"go mod download {path}@{version} failed: {reason}")
    return Path(answer["Dir"])


def required_version(module: Path, dependency: str) -> str:
    """The version of ``dependency`` that the ``go.mod`` in ``module`` requires (a ``replace`` of it
    to another version is honoured; a local ``replace`` is refused)."""
    text = (module / "go.mod").read_text(encoding="utf-8")
    name = re.escape(dependency)
    replaced = re.search(rf"^\s*(?:replace\s+)?{name}(?:\s+v\S+)?\s+=>\s+(\S+)(?:\s+(v\S+))?", text, re.M)
    if replaced is not None:
        if replaced.group(1) != dependency or replaced.group(2) is None:
            raise ValueError(f"{module}/go.mod replaces {dependency} by {replaced.group(1)}")
        return replaced.group(2)
    required = re.search(rf"^\s*(?:require\s+)?{name}\s+(v\S+)", text, re.M)
    if required is None:
        raise ValueError(f"{module}/go.mod does not require {dependency}")
    return required.group(1)


def kueue_dir(*, fetch: bool = True) -> Path:
    """sigs.k8s.io/kueue at the local cluster's pin (its CRDs: ``config/components/crd/bases``)."""
    return module_dir("sigs.k8s.io/kueue", KUEUE_VERSION, fetch=fetch)


def kwok_dir(*, fetch: bool = True) -> Path:
    """sigs.k8s.io/kwok at the fleet's pin (its node and pod stages: ``kustomize/stage``)."""
    return module_dir("sigs.k8s.io/kwok", KWOK_VERSION, fetch=fetch)


def autoscaler_apis_dir(*, fetch: bool = True) -> Path:
    """cluster-autoscaler's API module at the version Kueue requires (its CRDs: ``config/crd``)."""
    return module_dir(AUTOSCALER_APIS, required_version(kueue_dir(fetch=fetch), AUTOSCALER_APIS), fetch=fetch)


def _modules() -> list[tuple[str, str]]:
    staging = kubernetes_staging_version()
    kueue = kueue_dir()
    return [
        ("k8s.io/api", staging),
        ("k8s.io/apimachinery", staging),
        ("sigs.k8s.io/kueue", KUEUE_VERSION),
        (AUTOSCALER_APIS, required_version(kueue, AUTOSCALER_APIS)),
    ]


def main() -> int:
    try:
        for path, version in _modules():
            print(f"{path}@{version}\t{module_dir(path, version)}")
    except ModuleUnavailable as error:
        print(f"gomodules: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

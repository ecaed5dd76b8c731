"""Other projects' files that tests need, read from their published Go modules (``hack/gomodules.py``):
Kueue's CRDs, cluster-autoscaler's ProvisioningRequest CRD and Kubernetes' ``.proto`` definitions.

They live in the Go module cache outside the checkout, fetched with Go when missing. Where neither
the cache nor Go has them, the test that needs one skips with a line saying how to get it; CI has Go.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HACK = Path(__file__).resolve().parents[1] / "hack"
if str(HACK) not in sys.path:
    sys.path.insert(0, str(HACK))

import gomodules  # noqa: E402

__all__ = ["gomodules", "kueue_crd_path", "provisioning_request_crd_path", "skip_without_go_modules"]


@contextlib.contextmanager
def skip_without_go_modules() -> Iterator[None]:
    """Skip the calling test when a module it reads is not in the cache and cannot be fetched."""
    try:
        yield
    except gomodules.ModuleUnavailable as error:
        pytest.skip(str(error))


def kueue_crd_path(plural: str) -> Path:
    """Kueue's CRD of ``plural`` at the version the local cluster builds."""
    with skip_without_go_modules():
        bases = gomodules.kueue_dir() / "config" / "components" / "crd" / "bases"
    return bases / f"kueue.x-k8s.io_{plural}.yaml"


def provisioning_request_crd_path() -> Path:
    """cluster-autoscaler's ProvisioningRequest CRD, from its API module at the version Kueue requires."""
    with skip_without_go_modules():
        apis = gomodules.autoscaler_apis_dir()
    return apis / "config" / "crd" / "autoscaling.x-k8s.io_provisioningrequests.yaml"

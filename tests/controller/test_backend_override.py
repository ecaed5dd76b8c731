"""Claims may not pick the sharing backend when the admin forbids it: the gang gets an
AllocationFailed Event naming the field, stays gated, and nothing is allocated."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from driver.controller import Controller, ReconcilerSettings
from tests.controller.conftest import Cluster, gated_pod, gpu_claim, wait_for

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)


def with_backend(claim: dict[str, Any], backend: str) -> dict[str, Any]:
    parameters = {
        "apiVersion": "fractional.dev/v1alpha1",
        "kind": "GpuConfig",
        "sharing": {"backend": backend},
    }
    claim["spec"]["devices"]["config"] = [{"opaque": {"driver": "fractional.dev", "parameters": parameters}}]
    return claim


@pytest.fixture
def forbidding(cluster: Cluster) -> Iterator[Controller]:
    instance = Controller(
        configuration=cluster.server.configuration(),
        settings=ReconcilerSettings(allow_claim_backend_override=False),
    )
    instance.start()
    yield instance
    instance.stop()


@pytest.mark.timeout(60)
def test_claim_backend_refused_when_overrides_are_forbidden(cluster: Cluster, forbidding: Controller) -> None:
    cluster.add_node("node-a", "l4-2x")
    cluster.create_claim(with_backend(gpu_claim("tenant"), "none"))
    cluster.create_pod(gated_pod("tenant", ["tenant"]))
    cluster.create_claim(gpu_claim("plain"))
    cluster.create_pod(gated_pod("plain", ["plain"]))
    wait_for(lambda: cluster.ungated("plain"), what="the claim without a backend placed")
    (event,) = wait_for(
        lambda: [e for e in cluster.events() if e["reason"] == "AllocationFailed"
                 and e["involvedObject"]["name"] == "tenant"], what="AllocationFailed on the pod",
    )  # fmt: skip
    assert "spec.devices.config[0].opaque.parameters.sharing.backend" in event["message"]
    assert "allowClaimBackendOverride" in event["message"]
    assert not cluster.allocated("tenant") and not cluster.ungated("tenant")

"""Fixtures for the end-to-end tests: skipped unless a real cluster with the driver is reachable."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator

import pytest
from e2e_support import AUTO_GATE_LABEL, cluster_problem, kubectl, list_items, wait_for


@pytest.fixture(scope="session")
def real_cluster() -> None:
    problem = cluster_problem()
    if problem is not None:
        if os.environ.get("FRACTIONAL_E2E_REQUIRE") == "1":  # make e2e: a cluster that is not there fails
            pytest.fail(problem)
        pytest.skip(problem)


def _fresh_namespace(request: pytest.FixtureRequest, *, auto_gate: bool) -> Iterator[str]:
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"e2e-{slug}-{uuid.uuid4().hex[:5]}"
    kubectl("create", "namespace", name)
    if not auto_gate:
        kubectl("label", "namespace", name, f"{AUTO_GATE_LABEL}=disabled")
    try:
        yield name
    finally:
        kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture
def namespace(real_cluster: None, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (without waiting), opted out of the chart's
    scheduling-gate policy: a pod here is gated only when the test writes the gate, so the cases of
    kube-scheduler's own allocation stay that."""
    yield from _fresh_namespace(request, auto_gate=False)


@pytest.fixture
def user_namespace(real_cluster: None, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace as a user makes it (``kubectl create namespace``): the chart's policy gates its
    pods with claims, so the controller places them."""
    yield from _fresh_namespace(request, auto_gate=True)


@pytest.fixture
def idle(namespace: str) -> Iterator[str]:
    """The namespace, once no claim elsewhere holds a device (other tests' namespaces are deleted
    without waiting)."""

    def others_gone() -> bool:
        claims = list_items("resourceclaims", "--all-namespaces")
        return not any(
            c["metadata"]["namespace"] != namespace and (c.get("status") or {}).get("allocation")
            for c in claims
        )

    wait_for(others_gone, timeout=300, what="other tests' claims released")
    yield namespace

"""Fixtures for the end-to-end tests: skipped unless a real cluster with the driver is reachable."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator

import pytest
from e2e_support import cluster_problem, kubectl


@pytest.fixture(scope="session")
def real_cluster() -> None:
    problem = cluster_problem()
    if problem is not None:
        if os.environ.get("FRACTIONAL_E2E_REQUIRE") == "1":  # make e2e: a cluster that is not there fails
            pytest.fail(problem)
        pytest.skip(problem)


@pytest.fixture
def namespace(real_cluster: None, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (without waiting)."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"e2e-{slug}-{uuid.uuid4().hex[:5]}"
    kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        kubectl("delete", "namespace", name, "--wait=false")

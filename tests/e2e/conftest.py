"""Fixtures for the kind end-to-end tests: skipped unless the kind cluster is reachable."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest
from e2e_support import cluster_problem, kubectl


@pytest.fixture(scope="session")
def kind_cluster() -> None:
    problem = cluster_problem()
    if problem is not None:
        pytest.skip(problem)


@pytest.fixture
def namespace(kind_cluster: None, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (without waiting)."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"e2e-{slug}-{uuid.uuid4().hex[:5]}"
    kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        kubectl("delete", "namespace", name, "--wait=false")

"""Shared fixtures: the embedded API emulator on 127.0.0.1:0, reached with the real client."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kubernetes import client

    from driver.cluster.apiserver import APIServer

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_REFERENCE = REPO_ROOT.parent / "shared" / "reference"


@pytest.fixture(autouse=True)
def _restore_root_logging() -> Iterator[None]:
    """Tests that run ``driver.cli.main`` in-process get its stderr handler on the root logger;
    that stream is pytest's capture of that one test, closed afterwards. Put the root back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def api_server() -> Iterator[APIServer]:
    from driver.cluster.apiserver import APIServer

    server = APIServer(host="127.0.0.1", port=0)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def kube_configuration(api_server: APIServer) -> client.Configuration:
    """A client ``Configuration`` pointing at the emulator (never the global default)."""
    return api_server.configuration()


@pytest.fixture
def kubeconfig_file(api_server: APIServer, tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig"
    api_server.write_kubeconfig(str(path))
    return path

"""Shared fixtures: the embedded API emulator on 127.0.0.1:0, reached with the real client.

``pytest --cluster=real`` puts the real control plane (tests/real_backend.py) behind the same
``api_server`` fixture and runs only the tests marked ``shared``: those that reach the cluster
through its API alone. The default, ``--cluster=emulator``, runs everything on the emulator.
"""

from __future__ import annotations

import gc
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kubernetes import client

    from driver.cluster.apiserver import APIServer
    from tests.real_backend import RealAPIServer

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


def _open_sockets() -> set[tuple[int, int]] | None:
    """(descriptor, inode) of every socket this process has open; None where descriptors cannot be
    listed (neither /proc/self/fd nor /dev/fd)."""
    for directory in ("/proc/self/fd", "/dev/fd"):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        found = set()
        for name in names:
            try:
                info = os.fstat(int(name))
            except OSError:  # the listing's own descriptor, closed by now
                continue
            if stat.S_ISSOCK(info.st_mode):
                found.add((int(name), info.st_ino))
        return found
    return None


@pytest.fixture(autouse=True)
def _collect_leaked_sockets() -> Iterator[None]:
    """A client a test leaves unclosed (an ApiClient, a PoolManager, an answer read with
    ``_preload_content=False`` and left unread) keeps its socket open. Held in a reference cycle (a
    caught exception's traceback keeps the test's frame and its locals alive), it is finalized when
    the garbage collector next runs, and its ResourceWarning (an error here) then fails whichever
    test runs at that moment. So when a test ends with a socket open that was not open before it,
    collect now: the warning fails this test. Set up before the test's own fixtures, so checked
    after their teardown. Not after every test: a full collection takes 0.1-0.2 s of CPU, and one
    after each test made tests/chart, tests/allocator and tests/inventory take 111 s instead of 38 s."""
    before = _open_sockets()
    yield
    after = _open_sockets()
    if before is None or after is None or after - before:
        gc.collect()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cluster",
        choices=("emulator", "real"),
        default="emulator",
        help="the apiserver behind api_server: the embedded emulator (default), or the real "
        "control plane of hack/localcluster (K8S_VERSION), running only the tests marked shared",
    )
    parser.addoption(
        "--record-differential",
        action="store_true",
        help="with --cluster=real: write the real apiserver's answers to the differential corpus "
        "into tests/data/differential/real-<version>.json",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "shared: reaches the cluster only through its API; runs on --cluster=real too"
    )
    config.addinivalue_line("markers", "real_only: needs the real control plane (--cluster=real)")
    if config.getoption("cluster") == "real" and (getattr(config.option, "numprocesses", 0) or 0) > 0:
        raise pytest.UsageError("--cluster=real shares one control plane between the tests: add -n0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    real = config.getoption("cluster") == "real"
    kept = [
        item
        for item in items
        if (item.get_closest_marker("shared") if real else not item.get_closest_marker("real_only"))
    ]
    chosen = {id(item) for item in kept}
    left = [item for item in items if id(item) not in chosen]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


@pytest.fixture(scope="session")
def _real_control_plane(request: pytest.FixtureRequest) -> Iterator[RealAPIServer]:
    from tests import real_backend

    server = real_backend.start()
    try:
        yield server
    finally:
        real_backend.stop(server)


@pytest.fixture
def api_server(request: pytest.FixtureRequest) -> Iterator[APIServer]:
    if request.config.getoption("cluster") == "real":
        real: RealAPIServer = request.getfixturevalue("_real_control_plane")
        before = set(threading.enumerate())
        try:
            yield real  # type: ignore[misc]  # the same surface, duck-typed
        finally:
            # The next test shares this apiserver: threads this one started (controllers, agents,
            # watches) must be gone first, or they act on the next test's objects of the same names.
            deadline = time.monotonic() + 15
            for thread in set(threading.enumerate()) - before:
                thread.join(max(0.0, deadline - time.monotonic()))
            real.reset()
        return
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

"""The watcher thread survives a failing event handler: it logs, re-lists and keeps watching."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from driver.cluster.apiserver import APIServer
from driver.controller.view.cache import ClusterCache, Kind
from driver.controller.view.watch import Watcher
from tests.controller.conftest import wait_for

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)


def _node(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}


@pytest.fixture
def core(api_server: APIServer) -> Iterator[client.CoreV1Api]:
    with client.ApiClient(api_server.configuration()) as api_client:
        yield client.CoreV1Api(api_client)


def test_watcher_keeps_running_after_a_handler_raises(api_server: APIServer, core: client.CoreV1Api) -> None:
    core.create_node(_node("n1"))
    cache = ClusterCache(topology_label="topology.kubernetes.io/zone")
    seen: list[str] = []
    failed = threading.Event()

    def on_event(kind: Kind, event_type: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        name = obj["metadata"]["name"]
        if name == "n2" and not failed.is_set():
            failed.set()
            raise KeyError("a bug in a handler")
        seen.append(name)

    stop = threading.Event()
    watcher = Watcher(
        kind=Kind.NODE, configuration=api_server.configuration(), cache=cache, on_event=on_event, stop=stop,
        watch_timeout_seconds=5, backoff_seconds=0.05,
    )  # fmt: skip
    watcher.start()
    try:
        assert watcher.synced.wait(20)
        core.create_node(_node("n2"))
        wait_for(failed.is_set, what="the handler failure")
        core.create_node(_node("n3"))
        wait_for(lambda: "n3" in seen, what="events after the failure")
        assert watcher.is_alive()
        assert cache.get(Kind.NODE, "n3") is not None
    finally:
        stop.set()
        watcher.interrupt()
        watcher.join(10)


def _claim(rv: str, *, uid: str = "u1", allocated: bool = False) -> dict[str, Any]:
    claim: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ns", "uid": uid, "resourceVersion": rv},
        "spec": {"devices": {"requests": []}},
    }  # fmt: skip
    if allocated:
        claim["status"] = {"allocation": {"devices": {"results": []}}}
    return claim


def test_the_echo_of_a_version_already_held_changes_nothing() -> None:
    """Our writer applies what the server answered; the watch then delivers the same version. The
    echo is not applied again (no handler runs, the allocator state is not rebuilt), while a newer
    version, a new object under the same name, a deletion and a change of rejection still apply."""
    cache = ClusterCache(topology_label="topology.kubernetes.io/zone")
    assert cache.apply(Kind.CLAIM, "ADDED", _claim("5")) == (True, None)
    held = cache.get(Kind.CLAIM, "ns/c")
    applied, old = cache.apply(Kind.CLAIM, "MODIFIED", _claim("5", allocated=True))
    assert (applied, old) == (False, held)
    assert cache.get(Kind.CLAIM, "ns/c") is held
    assert cache.apply(Kind.CLAIM, "MODIFIED", _claim("5"), rejected="nested too deep")[0]
    assert cache.rejection(Kind.CLAIM, "ns/c") == "nested too deep"
    assert cache.apply(Kind.CLAIM, "MODIFIED", _claim("5"))[0]  # the rejection is lifted
    assert cache.apply(Kind.CLAIM, "MODIFIED", _claim("6"))[0]
    assert cache.apply(Kind.CLAIM, "MODIFIED", _claim("6", uid="u2"))[0]
    assert cache.apply(Kind.CLAIM, "DELETED", _claim("6", uid="u2"))[0]
    assert cache.get(Kind.CLAIM, "ns/c") is None

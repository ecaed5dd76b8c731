"""The watcher thread survives a failing event handler: it logs, re-lists and keeps watching."""

from __future__ import annotations

import threading
from typing import Any

from kubernetes import client

from driver.cluster.emulator import APIServer
from driver.controller.cache import ClusterCache, Kind
from driver.controller.watch import Watcher
from tests.controller.conftest import wait_for


def _node(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}


def test_watcher_keeps_running_after_a_handler_raises(api_server: APIServer) -> None:
    api_client = client.ApiClient(api_server.configuration())
    core = client.CoreV1Api(api_client)
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
        api_client.close()

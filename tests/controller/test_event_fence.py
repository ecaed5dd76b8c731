"""A controller that lost its lease posts no Event: Events are fenced like every
other write, so a successor's Events are the only ones after it leads."""

from __future__ import annotations

import json
import threading

import pytest
from kubernetes import client

from driver.cluster.apiserver import APIServer
from driver.controller import Controller, HaltWrites
from driver.controller.writes.events import EventRecorder
from tests.controller.conftest import NAMESPACE, Cluster, gated_pod, gpu_claim, wait_for

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)


def test_a_recorder_behind_a_set_fence_posts_nothing(api_server: APIServer) -> None:
    with client.ApiClient(api_server.configuration()) as api_client:
        core = client.CoreV1Api(api_client)
        body = gated_pod("p", [])
        pod = json.loads(core.create_namespaced_pod(NAMESPACE, body, _preload_content=False).data)
        fence = threading.Event()
        recorder = EventRecorder(api_client, identity="old-leader", fence=fence)
        assert recorder.gang_unschedulable(f"{NAMESPACE}/g", pod, "does not fit")  # leading: said
        fence.set()  # the lease is lost
        api_server.reset_counts()
        with pytest.raises(HaltWrites):
            recorder.gang_unschedulable(f"{NAMESPACE}/g", pod, "does not fit")  # a repeat: no update
        with pytest.raises(HaltWrites):
            recorder.gang_unschedulable(f"{NAMESPACE}/g", pod, "a new message")  # nor a new Event
        with pytest.raises(HaltWrites):
            recorder.object_rejected("pods", pod, "spec: nested too deep")
        assert api_server.request_count("create", "events") == 0
        assert api_server.request_count("patch", "events") == 0


def test_a_controller_that_lost_its_lease_posts_no_event(cluster: Cluster, fenced: Controller) -> None:
    cluster.add_node("node-a", "l4-2x")
    for i in range(2):  # 40Gi shares: an L4 has ~22Gi, so the gang never fits and would be explained
        cluster.create_claim(gpu_claim(f"big-{i}", memory="40Gi", compute=None))
        cluster.create_pod(gated_pod(f"big-{i}", [f"big-{i}"], gang="big", size=2))
    wait_for(fenced.halted.is_set, what="the fenced controller halted at its first write, an Event")
    assert [e for e in cluster.events() if e["reason"] == "GangUnschedulable"] == []

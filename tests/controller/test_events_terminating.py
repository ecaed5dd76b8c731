"""An Event for an object in a namespace being deleted is dropped, not retried.

Learned on kube-apiserver 1.37.2: the e2e tests delete their namespaces while a gang still waits
in one; every Event the controller tried there was refused with 403 (cause NamespaceTerminating),
and the retry kept the gang's key coming back about five times a second until the namespace was
gone."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client

from driver.cluster.apiserver import APIServer
from driver.controller.writes.events import EventRecorder
from driver.errors import NamespaceTerminatingError
from driver.kube import api_errors


@pytest.fixture
def api() -> Iterator[client.ApiClient]:
    server = APIServer()
    server.start()
    try:
        configuration = client.Configuration()
        configuration.host = server.url
        with client.ApiClient(configuration) as api_client:
            yield api_client
    finally:
        server.stop()


def _terminating_namespace(core: client.CoreV1Api, name: str) -> None:
    core.create_namespace({"metadata": {"name": name}, "spec": {"finalizers": ["kubernetes"]}})
    core.create_namespaced_pod(
        name, {"metadata": {"name": "waiting"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    )
    core.delete_namespace(name)
    assert core.read_namespace(name).status.phase == "Terminating"


def test_the_server_answers_namespace_terminating_and_we_name_it(api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    _terminating_namespace(core, "going")
    with pytest.raises(NamespaceTerminatingError), api_errors("create Event"):
        core.create_namespaced_event(
            "going", {"metadata": {"generateName": "x."}, "involvedObject": {"name": "waiting"}}
        )


def test_a_gang_event_in_a_terminating_namespace_is_dropped(api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    _terminating_namespace(core, "going")
    recorder = EventRecorder(api, identity="test")
    pod = {"metadata": {"name": "waiting", "namespace": "going", "uid": "u-1"}}
    assert recorder.gang_unschedulable("going/gang", pod, "gang gang (2 pods) needs 2 GPUs") is False
    assert recorder.emitted == 0
    # The same message is not tried again: the key can settle.
    assert recorder.gang_unschedulable("going/gang", pod, "gang gang (2 pods) needs 2 GPUs") is False

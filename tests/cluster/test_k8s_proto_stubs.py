"""The committed stubs of Kubernetes' .proto files are current, and decode what kubectl sends."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.cluster.apiserver.proto_gen import (
    k8s_io_api_core_v1_pb2,
    k8s_io_apimachinery_pkg_runtime_pb2,
)
from driver.cluster.apiserver.protobuf import decode_protobuf
from driver.cluster.apiserver.store import StatusError
from tests.go_modules import skip_without_go_modules
from tests.proto_stubs_support import REPO_ROOT, assert_stubs_current

COMMITTED = REPO_ROOT / "driver" / "cluster" / "apiserver" / "proto_gen"


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    """The definitions come from k8s.io/api and k8s.io/apimachinery in the Go module cache (fetched
    with Go when missing): without them this one test skips, saying how to get them."""
    with skip_without_go_modules():
        assert_stubs_current(
            "gen_k8s_proto",
            COMMITTED,
            tmp_path,
            hint="run `make proto` and commit driver/cluster/apiserver/proto_gen",
        )


def _envelope(api_version: str, kind: str, raw: bytes) -> bytes:
    unknown = k8s_io_apimachinery_pkg_runtime_pb2.Unknown()
    unknown.typeMeta.apiVersion = api_version
    unknown.typeMeta.kind = kind
    unknown.raw = raw
    return b"k8s\x00" + unknown.SerializeToString()


def test_a_config_map_decodes_to_its_json_form() -> None:
    config_map = k8s_io_api_core_v1_pb2.ConfigMap()
    config_map.metadata.name = "settings"
    config_map.metadata.creationTimestamp.seconds = 0  # Go's zero time: left out, as JSON has null
    config_map.metadata.namespace = ""  # Go writes empty strings in protobuf; JSON omits them
    config_map.data["mode"] = "fast"
    config_map.binaryData["blob"] = b"\x00\x01"
    config_map.immutable = False
    decoded = decode_protobuf(_envelope("v1", "ConfigMap", config_map.SerializeToString()))
    assert decoded == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "settings"},
        "data": {"mode": "fast"},
        "binaryData": {"blob": "AAE="},
        "immutable": False,
    }


def test_quantities_and_int_or_strings_take_their_json_spelling() -> None:
    container = k8s_io_api_core_v1_pb2.Container(name="c", image="x")
    container.resources.limits["memory"].string = "1Gi"
    port = container.ports.add()
    port.containerPort = 80
    probe = container.readinessProbe
    probe.handler.httpGet.port.type = 1  # ProbeHandler is inlined into Probe in JSON
    probe.handler.httpGet.port.strVal = "http"
    pod = k8s_io_api_core_v1_pb2.Pod()
    pod.metadata.name = "p"
    pod.spec.containers.append(container)
    pod.spec.terminationGracePeriodSeconds = 30
    decoded = decode_protobuf(_envelope("v1", "Pod", pod.SerializeToString()))
    (decoded_container,) = decoded["spec"]["containers"]
    assert decoded_container["resources"] == {"limits": {"memory": "1Gi"}}
    assert decoded_container["readinessProbe"]["httpGet"]["port"] == "http"
    assert decoded_container["ports"] == [{"containerPort": 80}]
    assert decoded["spec"]["terminationGracePeriodSeconds"] == 30


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"kind": "ConfigMap"}', "missing the k8s\\0 prefix"),
        (
            _envelope("example.com/v1", "Widget", b""),
            "no kind 'Widget' is registered for version 'example.com/v1'",
        ),
    ],
)
def test_what_cannot_be_decoded_is_a_bad_request(body: bytes, message: str) -> None:
    with pytest.raises(StatusError) as caught:
        decode_protobuf(body)
    assert caught.value.code == 400
    assert message in caught.value.message

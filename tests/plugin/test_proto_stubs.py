"""The protos are wire-identical to the kubelet's, and the committed stubs are not stale."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.plugin.proto_gen import (
    dra_health_v1alpha1_pb2,
    dra_v1_pb2,
    dra_v1beta1_pb2,
    pluginregistration_pb2,
)
from tests.proto_stubs_support import REPO_ROOT, assert_stubs_current

COMMITTED = REPO_ROOT / "driver" / "plugin" / "proto_gen"


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    assert_stubs_current(
        "gen_proto", COMMITTED, tmp_path, hint="run `make proto` and commit driver/plugin/proto_gen"
    )


@pytest.mark.parametrize(
    ("module", "service", "methods"),
    [
        (pluginregistration_pb2, "pluginregistration.Registration", ["GetInfo", "NotifyRegistrationStatus"]),
        (
            dra_v1beta1_pb2,
            "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin",
            ["NodePrepareResources", "NodeUnprepareResources"],
        ),
        (
            dra_v1_pb2,
            "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
            ["NodePrepareResources", "NodeUnprepareResources"],
        ),
        (dra_health_v1alpha1_pb2, "v1alpha1.DRAResourceHealth", ["NodeWatchResources"]),
    ],
)
def test_service_full_names_and_methods(module, service: str, methods: list[str]) -> None:
    (descriptor,) = module.DESCRIPTOR.services_by_name.values()
    assert descriptor.full_name == service
    assert [method.name for method in descriptor.methods] == methods


def test_health_stream_is_server_streaming_only() -> None:
    method = dra_health_v1alpha1_pb2.DESCRIPTOR.services_by_name["DRAResourceHealth"].methods_by_name[
        "NodeWatchResources"
    ]
    assert method.server_streaming and not method.client_streaming


def _fields(message) -> dict[str, tuple[int, bool]]:
    return {field.name: (field.number, field.is_repeated) for field in message.DESCRIPTOR.fields}


@pytest.mark.parametrize("module", [dra_v1beta1_pb2, dra_v1_pb2])
def test_dra_field_numbers(module) -> None:
    assert _fields(module.Claim) == {"namespace": (1, False), "uid": (2, False), "name": (3, False)}
    device = _fields(module.Device)
    assert {k: v for k, v in device.items() if k != "share_id"} == {
        "request_names": (1, True),
        "pool_name": (2, False),
        "device_name": (3, False),
        "cdi_device_ids": (4, True),
    }
    assert _fields(module.NodePrepareResourceResponse) == {"devices": (1, True), "error": (2, False)}
    assert _fields(module.NodeUnprepareResourceResponse) == {"error": (1, False)}
    claims_map = module.NodePrepareResourcesResponse.DESCRIPTOR.fields_by_name["claims"]
    assert claims_map.number == 1 and claims_map.message_type.GetOptions().map_entry


def test_v1_share_id_is_optional_field_5_and_absent_in_v1beta1() -> None:
    share_id = dra_v1_pb2.Device.DESCRIPTOR.fields_by_name["share_id"]
    assert share_id.number == 5 and share_id.has_presence
    assert "share_id" not in dra_v1beta1_pb2.Device.DESCRIPTOR.fields_by_name
    assert not dra_v1_pb2.Device().HasField("share_id")
    # A v1 message with share_id decodes as v1beta1 (unknown field skipped): the wire shapes agree.
    wire = dra_v1_pb2.Device(pool_name="p", device_name="gpu-0", share_id="abc").SerializeToString()
    old = dra_v1beta1_pb2.Device.FromString(wire)
    assert (old.pool_name, old.device_name) == ("p", "gpu-0")


def test_registration_and_health_field_numbers() -> None:
    assert _fields(pluginregistration_pb2.PluginInfo) == {
        "type": (1, False),
        "name": (2, False),
        "endpoint": (3, False),
        "supported_versions": (4, True),
    }
    assert _fields(pluginregistration_pb2.RegistrationStatus) == {
        "plugin_registered": (1, False),
        "error": (2, False),
    }
    assert _fields(dra_health_v1alpha1_pb2.DeviceHealth) == {
        "device": (1, False),
        "health": (2, False),
        "last_updated_time": (3, False),
        "health_check_timeout_seconds": (4, False),
        "message": (5, False),
    }
    assert dict(dra_health_v1alpha1_pb2.HealthStatus.items()) == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}

"""``parse_claim`` and ``compute_prepared_devices``: pure, deterministic, errors naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from driver.errors import ClaimError
from driver.inventory.model import NodeInventory
from driver.plugin.claims import ClaimRef, ClaimUID, parse_claim
from driver.plugin.devices import (
    MEMORY_STEP_BYTES,
    DeviceKind,
    PreparedDevice,
    PrepareSettings,
    compute_prepared_devices,
    make_claim_ref,
)
from driver.plugin.sharing.base import ContainerEdits, DeviceNode, ShareSpec
from tests.plugin.conftest import GIB, NODE, result

UID = "6a0e3c1d-2f4b-4a59-8e7d-1c2b3a4d5e6f"
SHARE = "9f8e7d6c-5b4a-4321-8fed-cba987654321"


class EnvBackend:
    """A sharing backend double whose edits name it (records nothing: compute must stay pure)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def container_edits(self, share: ShareSpec) -> ContainerEdits:
        options = ",".join(f"{k}={v}" for k, v in share.backend_options)
        return ContainerEdits(
            env=(f"{self.name.upper()}_LIMIT_{share.ordinal}={share.memory_bytes}:{options}",)
        )

    def acquire(self, share: ShareSpec) -> None:
        raise AssertionError("compute must not acquire")

    def release(self, share: ShareSpec) -> None:
        raise AssertionError("compute must not release")

    def close(self) -> None:
        pass

    def describe(self) -> dict[str, str]:
        return {"name": self.name}


BACKENDS = {name: EnvBackend(name) for name in ("none", "mps", "hami")}


def body(
    results: list[dict[str, Any]] | None, *, uid: str = UID, config: list[Any] | None = None
) -> dict[str, Any]:
    status: dict[str, Any] = {}
    if results is not None:
        status["allocation"] = {"devices": {"results": results, **({"config": config} if config else {})}}
    return {"metadata": {"name": "c", "namespace": "ns", "uid": uid}, "status": status}


REF = ClaimRef(namespace="ns", name="c", uid=ClaimUID(UID))


def compute(
    results: list[dict[str, Any]],
    inventory: NodeInventory,
    *,
    config: list[Any] | None = None,
    **settings: Any,
) -> tuple[PreparedDevice, ...]:
    prepare_settings = PrepareSettings(**{"default_backend": "none", "backends": BACKENDS, **settings})
    return compute_prepared_devices(
        parse_claim(body(results, config=config), REF), inventory, prepare_settings
    )


def env(device: PreparedDevice) -> dict[str, str]:
    return dict(item.split("=", 1) for item in device.edits.env)


def test_claim_checks() -> None:
    with pytest.raises(ClaimError, match=r"ns/c: metadata.uid: expected .* \(the claim was replaced\)"):
        parse_claim(body([result("gpu-0")], uid="other"), REF)
    with pytest.raises(ClaimError, match=r"ns/c: status.allocation: the claim is not allocated"):
        parse_claim(body(None), REF)
    with pytest.raises(
        ClaimError, match=r"status.allocation.devices.results: no device of driver fractional.dev"
    ):
        parse_claim(body([result("gpu-0", driver="gpu.nvidia.com")]), REF)
    with pytest.raises(ClaimError, match=r"results\[0\].pool: required"):
        parse_claim(body([{**result("gpu-0"), "pool": ""}]), REF)
    claim = parse_claim(body([result("x", driver="other.dev"), result("gpu-1")]), REF)
    assert [(r.index, r.device) for r in claim.results] == [(1, "gpu-1")]


@pytest.mark.parametrize(
    ("namespace", "name", "uid", "field"),
    [
        ("default", "../../etc", UID, "metadata.name"),
        ("default", "a/b", UID, "metadata.name"),
        ("default", "x" * 254, UID, "metadata.name"),
        ("../x", "c", UID, "namespace"),
        ("default", "c", "../../../etc/passwd", "metadata.uid"),
        ("default", "c", "u" * 200, "metadata.uid"),
        ("default\n", "c", UID, "namespace"),  # "$" would match before a final newline
        ("default", "c\n", UID, "metadata.name"),
        ("default", "c", UID + "\n", "metadata.uid"),
    ],
)
def test_claim_reference_checks(namespace: str, name: str, uid: str, field: str) -> None:
    with pytest.raises(ClaimError, match=f": {field}: "):
        make_claim_ref(namespace=namespace, name=name, uid=uid)


def test_exclusive_gpu_gets_the_whole_gpu(inventory: NodeInventory) -> None:
    (device,) = compute([result("gpu-1", request="train/big")], inventory)
    gpu = inventory.gpus[1]
    assert device.kind is DeviceKind.GPU
    assert device.request_names == ("train",)  # subrequest suffix stripped
    assert (device.pool, device.device, device.share_id) == (NODE, "gpu-1", None)
    assert device.cdi_name == f"{UID}-gpu-1"
    assert device.cdi_device_ids == (f"k8s.fractional.dev/gpu={UID}-gpu-1",)
    assert device.share is not None and device.share.whole_gpu
    assert (device.share.memory_bytes, device.share.compute_percent) == (gpu.memory_bytes, 100)
    assert env(device) == {
        "FRACTIONAL_CLAIM_UID": UID,
        "FRACTIONAL_GPU_UUID": gpu.uuid,
        "FRACTIONAL_GPU_MEMORY_LIMIT": str(gpu.memory_bytes),
        "FRACTIONAL_GPU_COMPUTE_PERCENT": "100",
        "FRACTIONAL_GPU_SHARING": "none",
        "NONE_LIMIT_0": f"{gpu.memory_bytes}:",
    }


def test_share_limits_and_determinism(inventory: NodeInventory) -> None:
    results = [result("gpu-0", share_id=SHARE, memory="4Gi", compute="30")]
    first = compute(results, inventory)
    assert first == compute(results, inventory)
    (device,) = first
    assert device.cdi_name == f"{UID}-gpu-0-9f8e7d6c"
    assert device.share is not None and not device.share.whole_gpu
    assert (device.share.memory_bytes, device.share.compute_percent, device.share_id) == (4 * GIB, 30, SHARE)
    assert PreparedDevice.from_dict(device.to_dict()) == device


def test_share_without_memory_is_the_whole_published_gpu(inventory: NodeInventory) -> None:
    (device,) = compute([result("gpu-0", share_id=SHARE)], inventory)
    published = inventory.gpus[0].memory_bytes // MEMORY_STEP_BYTES * MEMORY_STEP_BYTES
    assert device.share is not None and device.share.whole_gpu
    assert (device.share.memory_bytes, device.share.compute_percent) == (published, 0)


def test_two_gpus_and_a_nic(inventory: NodeInventory) -> None:
    sysfs_nodes = {"mlx5_0": (DeviceNode(path="/dev/infiniband/uverbs0"),)}
    devices = compute(
        [
            result("gpu-0", share_id=SHARE, memory="2Gi"),
            result("nic-0", request="net"),
            result("gpu-1", request="gpu", memory="1Gi", share_id="1" + SHARE[1:]),
        ],
        inventory,
        toolkit_cdi=True,
        rdma_device_nodes=sysfs_nodes,
    )
    assert [d.device for d in devices] == ["gpu-0", "nic-0", "gpu-1"]  # allocation order
    gpu0, nic, gpu1 = devices
    assert gpu1.share is not None and gpu1.share.ordinal == 1
    assert env(gpu0)["FRACTIONAL_GPU_MEMORY_LIMIT"] == f"{2 * GIB},{GIB}"
    assert (
        env(gpu0)["FRACTIONAL_GPU_UUID"]
        == env(gpu1)["FRACTIONAL_GPU_UUID"]
        == ",".join(g.uuid for g in inventory.gpus)
    )
    assert gpu0.cdi_device_ids[1] == f"nvidia.com/gpu={inventory.gpus[0].uuid}"
    assert nic.kind is DeviceKind.NIC and nic.cdi_device_ids == (f"k8s.fractional.dev/nic={UID}-nic-0",)
    nic_env = env(nic)
    assert nic_env["NCCL_IB_HCA"] == nic_env["FRACTIONAL_NIC_RDMA_DEVICE"] == "mlx5_0"
    assert nic_env["NCCL_SOCKET_IFNAME"] == nic_env["FRACTIONAL_NIC_INTERFACE"] == inventory.nics[0].if_name
    assert [n.path for n in nic.edits.device_nodes] == ["/dev/infiniband/uverbs0", "/dev/infiniband/rdma_cm"]


def test_gpu_config_chooses_the_backend(inventory: NodeInventory) -> None:
    config = [
        {
            "source": "FromClaim",
            "requests": ["gpu"],
            "opaque": {
                "driver": "fractional.dev",
                "parameters": {
                    "apiVersion": "fractional.dev/v1alpha1",
                    "kind": "GpuConfig",
                    "sharing": {"backend": "mps", "mps": {"defaultActiveThreadPercentage": 40}},
                },
            },
        }
    ]
    (device,) = compute([result("gpu-0", share_id=SHARE, memory="1Gi")], inventory, config=config)
    assert device.backend == "mps"
    assert env(device)["FRACTIONAL_GPU_SHARING"] == "mps"
    assert env(device)["MPS_LIMIT_0"] == f"{GIB}:defaultActiveThreadPercentage=40"


@pytest.mark.parametrize(
    ("results", "match"),
    [
        ([result("gpu-7")], r"results\[0\].device: 'gpu-7' is not a device of this node"),
        ([{**result("gpu-0"), "pool": "node-b"}], r"results\[0\].pool: 'node-b' is not this node's 'node-a'"),
        (
            [result("gpu-0", share_id=SHARE, memory="lots")],
            r"consumedCapacity.memory: 'lots' is not a quantity",
        ),
        ([result("gpu-0", share_id=SHARE, memory="4000Gi")], r"consumedCapacity.memory: .* is outside"),
        (
            [result("gpu-0", share_id=SHARE, compute="150")],
            r"consumedCapacity.compute: 150 is outside 0..100",
        ),
        ([result("../gpu-0")], r"results\[0\].device: '../gpu-0' contains"),
        ([result("gpu-0", share_id="../../x")], r"results\[0\].shareID: "),
    ],
)
def test_bad_results(results: list[dict[str, Any]], match: str, inventory: NodeInventory) -> None:
    with pytest.raises(ClaimError, match=match):
        compute(results, inventory)


def test_unknown_backend(inventory: NodeInventory) -> None:
    settings = PrepareSettings(default_backend="mps", backends={"none": BACKENDS["none"]})
    with pytest.raises(ClaimError, match=r"'mps' is not enabled on this node"):
        compute_prepared_devices(parse_claim(body([result("gpu-0")]), REF), inventory, settings)

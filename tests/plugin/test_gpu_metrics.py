"""The node agent's GPU and per-share metrics, scraped over real HTTP from an in-process agent.

NVML is the fake backend's stand-in (``driver.inventory.fake_nvml``) and ``/proc`` a fake tree in
``tmp_path``: the only two things mocked.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from driver.cluster.kubelet import KubeletSimulator
from driver.inventory.fake_nvml import FakeNVML, FakeProcess
from driver.plugin.agent import NodeAgent
from driver.plugin.gpu_metrics import XidCounter
from driver.plugin.health import DeviceHealth
from driver.plugin.usage import ContainerIdentity, parse_cgroup
from driver.probes import ProbeServer
from tests.plugin.conftest import GIB, NAMESPACE, NODE, Claims, new_share_id, result, wait_for

POD_UID = "0b9ad2f6-1c1e-4a57-9d43-3f4c2b8e7a10"
CONTAINER_ID = "4f1c9e2ab7d34c0e8f5a6b7c8d9e0f1a2b3c4d5e6f708192a3b4c5d6e7f80912"
Sample = tuple[str, dict[str, str], float]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (  # cgroup v2, systemd driver, containerd
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
            + POD_UID.replace("-", "_")
            + f".slice/cri-containerd-{CONTAINER_ID}.scope\n",
            ContainerIdentity(POD_UID, CONTAINER_ID),
        ),
        (  # cgroup v1, cgroupfs driver
            f"12:pids:/kubepods/besteffort/pod{POD_UID}/{CONTAINER_ID}\n"
            f"11:memory:/kubepods/besteffort/pod{POD_UID}/{CONTAINER_ID}\n",
            ContainerIdentity(POD_UID, CONTAINER_ID),
        ),
        (  # CRI-O, guaranteed QoS
            f"0::/kubepods.slice/kubepods-pod{POD_UID.replace('-', '_')}.slice/crio-{CONTAINER_ID}.scope\n",
            ContainerIdentity(POD_UID, CONTAINER_ID),
        ),
        ("0::/system.slice/containerd.service\n", None),  # not in a pod
        ("", None),
    ],
)
def test_parse_cgroup(text: str, expected: ContainerIdentity | None) -> None:
    assert parse_cgroup(text) == expected


def test_xid_counter_counts_each_new_fault_once() -> None:
    counter = XidCounter()
    counter.observe({"gpu-0": DeviceHealth("gpu-0", False, 79, "XID 79", 10.0, "xid-79")})
    counter.observe({"gpu-0": DeviceHealth("gpu-0", False, 79, "XID 79", 10.0, "xid-79")})  # same fault
    counter.observe({"gpu-0": DeviceHealth("gpu-0", True, None, "", 20.0)})  # recovered
    counter.observe({"gpu-0": DeviceHealth("gpu-0", False, 79, "XID 79", 30.0, "xid-79")})
    assert (counter.count("gpu-0"), counter.count("gpu-1")) == (2, 0)


# -- through the agent --------------------------------------------------------------------------------


@pytest.fixture
def scrape() -> Iterator[Callable[[], list[Sample]]]:
    """A real HTTP GET of /metrics (the default registry, where the agent's collector lives)."""
    server = ProbeServer(host="127.0.0.1", port=0, checks={}, name="test-metrics")
    server.start()

    def get() -> list[Sample]:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        return [
            (sample.name, dict(sample.labels), sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]

    yield get
    server.close()


def _select(samples: list[Sample], name: str, **labels: str) -> list[Sample]:
    return [s for s in samples if s[0] == name and all(s[1].get(k) == v for k, v in labels.items())]


def _fake_proc(root: Path, pid: int, pod_uid: str, container_id: str) -> None:
    directory = root / str(pid)
    directory.mkdir(parents=True)
    (directory / "cgroup").write_text(
        f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{pod_uid.replace('-', '_')}"
        f".slice/cri-containerd-{container_id}.scope\n"
    )


def _stand_in(agent: NodeAgent) -> FakeNVML:
    assert agent.gpu_metrics is not None
    nvml = agent.gpu_metrics.nvml
    assert isinstance(nvml, FakeNVML)
    return nvml


def test_share_series_appear_on_prepare_map_processes_to_pods_and_vanish_on_unprepare(
    start_agent: Callable[..., NodeAgent],
    make_kubelet: Callable[..., KubeletSimulator],
    claims: Claims,
    scrape: Callable[[], list[Sample]],
    tmp_path: Path,
) -> None:
    proc = tmp_path / "proc"
    agent = start_agent(config={"proc_root": str(proc)})
    kubelet = make_kubelet()
    ref = claims.create(
        "metrics-share", [result("gpu-0", share_id=new_share_id(), memory="4Gi", compute="20")]
    )
    claims.reserve(ref["name"], [{"resource": "pods", "name": "infer-0", "uid": POD_UID}])
    gpu = agent.inventory.gpu("gpu-0")
    assert gpu is not None
    before = scrape()
    assert _select(before, "fractional_share_memory_allocated_bytes", claim="metrics-share") == []
    (gpu_total,) = _select(before, "fractional_gpu_memory_total_bytes", node=NODE, gpu="gpu-0")
    assert gpu_total[1] == {"node": NODE, "gpu": "gpu-0", "uuid": gpu.uuid, "product": gpu.product_name}
    assert gpu_total[2] == gpu.memory_bytes

    assert kubelet.prepare([ref])[ref["uid"]]["error"] == ""
    share_labels = {"namespace": NAMESPACE, "pod": "infer-0", "claim": "metrics-share", "gpu": "gpu-0"}
    after = scrape()
    (allocated,) = _select(after, "fractional_share_memory_allocated_bytes", **share_labels)
    assert allocated[1] == {**share_labels, "node": NODE, "container": "", "uuid": gpu.uuid}
    assert allocated[2] == 4 * GIB
    assert _select(after, "fractional_share_compute_allocated_percent", **share_labels)[0][2] == 20
    (idle,) = _select(after, "fractional_share_memory_used_bytes", **share_labels)
    assert idle[2] == 0

    # Two processes of the pod's container and one of a pod holding no share of this GPU.
    _fake_proc(proc, 4242, POD_UID, CONTAINER_ID)
    _fake_proc(proc, 4243, POD_UID, CONTAINER_ID)
    _fake_proc(proc, 5000, "11111111-2222-4333-8444-555555555555", CONTAINER_ID)
    nvml = _stand_in(agent)
    nvml.start_process(FakeProcess(pid=4242, gpu_uuid=gpu.uuid, memory_bytes=GIB, sm_percent=15))
    nvml.start_process(FakeProcess(pid=4243, gpu_uuid=gpu.uuid, memory_bytes=GIB // 2, sm_percent=5))
    nvml.start_process(FakeProcess(pid=5000, gpu_uuid=gpu.uuid, memory_bytes=GIB, sm_percent=30))
    busy = scrape()
    container = {**share_labels, "container": CONTAINER_ID[:12]}
    assert _select(busy, "fractional_share_memory_used_bytes", **container)[0][2] == GIB + GIB // 2
    assert _select(busy, "fractional_share_compute_used_percent", **container)[0][2] == 20
    gpu_labels = {"node": NODE, "gpu": "gpu-0"}
    assert _select(busy, "fractional_gpu_memory_used_bytes", **gpu_labels)[0][2] == 2.5 * GIB
    assert _select(busy, "fractional_gpu_utilization_ratio", **gpu_labels)[0][2] == pytest.approx(0.5)
    assert _select(busy, "fractional_gpu_temperature_celsius", **gpu_labels)[0][2] > 30
    assert _select(busy, "fractional_gpu_power_watts", **gpu_labels)[0][2] > 60
    assert _select(busy, "fractional_gpu_xid_errors_total", **gpu_labels)[0][2] == 0
    assert _select(busy, "DCGM_FI_DEV_GPU_UTIL") == []  # off by default

    assert kubelet.unprepare([ref])[ref["uid"]]["error"] == ""
    gone = scrape()
    for name in (
        "fractional_share_memory_allocated_bytes",
        "fractional_share_compute_allocated_percent",
        "fractional_share_memory_used_bytes",
        "fractional_share_compute_used_percent",
    ):
        assert _select(gone, name, claim="metrics-share") == [], name


def test_dcgm_named_series_when_enabled(
    start_agent: Callable[..., NodeAgent],
    make_kubelet: Callable[..., KubeletSimulator],
    claims: Claims,
    scrape: Callable[[], list[Sample]],
    tmp_path: Path,
) -> None:
    agent = start_agent(config={"dcgm_metrics": True, "proc_root": str(tmp_path)})
    kubelet = make_kubelet()
    ref = claims.create("dcgm-share", [result("gpu-1", share_id=new_share_id(), memory="2Gi")])
    claims.reserve(ref["name"], [{"resource": "pods", "name": "train-0", "uid": POD_UID}])
    assert kubelet.prepare([ref])[ref["uid"]]["error"] == ""
    gpu = agent.inventory.gpu("gpu-1")
    assert gpu is not None
    _stand_in(agent).start_process(
        FakeProcess(pid=77, gpu_uuid=gpu.uuid, memory_bytes=3 * GIB, sm_percent=40)
    )
    samples = scrape()
    expected_labels = {
        "gpu": str(gpu.minor_number if gpu.minor_number is not None else 1),
        "UUID": gpu.uuid,
        "pci_bus_id": gpu.pci_bus_id,
        "device": f"nvidia{gpu.minor_number if gpu.minor_number is not None else 1}",
        "modelName": gpu.product_name,
        "Hostname": NODE,
        "namespace": NAMESPACE,
        "pod": "train-0",
        "container": "",
    }
    values = {}
    for name in (
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_POWER_USAGE",
    ):
        (sample,) = _select(samples, name, UUID=gpu.uuid, pod="train-0")
        assert sample[1] == expected_labels, name
        values[name] = sample[2]
    assert values["DCGM_FI_DEV_GPU_UTIL"] == 40
    assert values["DCGM_FI_DEV_FB_USED"] == 3 * 1024  # MiB
    assert values["DCGM_FI_DEV_FB_FREE"] == (gpu.memory_bytes - 3 * GIB) // (1024 * 1024)
    # The other GPU, which no pod holds a share of, has one series with empty pod labels.
    other = agent.inventory.gpu("gpu-0")
    assert other is not None
    (idle,) = _select(samples, "DCGM_FI_DEV_GPU_UTIL", UUID=other.uuid)
    assert (idle[1]["namespace"], idle[1]["pod"], idle[2]) == ("", "", 0)
    kubelet.unprepare([ref])


def test_a_restarted_agent_names_the_pods_of_restored_shares(
    start_agent: Callable[..., NodeAgent],
    make_kubelet: Callable[..., KubeletSimulator],
    claims: Claims,
    scrape: Callable[[], list[Sample]],
) -> None:
    first = start_agent()
    kubelet = make_kubelet()
    ref = claims.create("restored-share", [result("gpu-0", share_id=new_share_id(), memory="1Gi")])
    claims.reserve(ref["name"], [{"resource": "pods", "name": "survivor", "uid": POD_UID}])
    assert kubelet.prepare([ref])[ref["uid"]]["error"] == ""
    first.stop(grace=0)
    assert _select(scrape(), "fractional_share_memory_allocated_bytes", claim="restored-share") == []
    start_agent()  # same plugin dir and boot: the checkpoint is restored, no Prepare comes again

    def named() -> list[Sample]:
        return _select(
            scrape(), "fractional_share_memory_allocated_bytes", claim="restored-share", pod="survivor"
        )

    assert wait_for(named, what="the restored share's series with its pod")

"""Shares enforced end to end: a running agent, the simulated kubelet, the emulator, CDI files on disk.

The backend comes from the agent's ``--sharing`` and is overridden per claim by a ``GpuConfig`` in
``status.allocation.devices.config``. MPS runs the fake ``nvidia-cuda-mps-control`` of
``test_sharing_mps`` (a script in ``tmp_path`` that forks a daemon and records every call).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from driver.cluster.kubelet import KubeletSimulator
from driver.inventory.model import NodeInventory
from driver.plugin.agent import NodeAgent, check_toolkit_cdi_spec
from driver.plugin.cdi import find_spec_for_kind
from driver.plugin.claims import ClaimRef, ClaimUID, parse_claim
from driver.plugin.devices import PrepareSettings, compute_prepared_devices, deduplicated_edits
from driver.plugin.sharing import ContainerEdits, DeviceNode, Mount, NoneBackend, ShareSpec
from tests.plugin.conftest import GIB, PROFILE, REPO_ROOT, Claims, NodeDirs, new_share_id, result, wait_for
from tests.plugin.test_sharing_mps import FakeControl, alive

StartAgent = Callable[..., NodeAgent]
MakeKubelet = Callable[..., KubeletSimulator]
CheckCDI = Callable[[Path], dict[str, Any]]
RUNNER = Path(__file__).resolve().parent / "agent_runner.py"


@pytest.fixture
def control(tmp_path: Path) -> Iterator[FakeControl]:
    fake = FakeControl(tmp_path)
    yield fake
    for row in fake.events("daemon"):  # never leave a fake daemon behind
        if alive(row["pid"]):
            os.kill(row["pid"], signal.SIGKILL)


def gpu_config(**sharing: Any) -> dict[str, Any]:
    return {
        "source": "FromClaim",
        "requests": [],
        "opaque": {
            "driver": "fractional.dev",
            "parameters": {"apiVersion": "fractional.dev/v1alpha1", "kind": "GpuConfig", "sharing": sharing},
        },
    }


def fractional_env(uid: str, gpu_uuid: str, backend: str) -> list[str]:
    return [
        f"FRACTIONAL_CLAIM_UID={uid}",
        f"FRACTIONAL_GPU_UUID={gpu_uuid}",
        f"FRACTIONAL_GPU_MEMORY_LIMIT={10 * GIB}",
        "FRACTIONAL_GPU_COMPUTE_PERCENT=25",
        f"FRACTIONAL_GPU_SHARING={backend}",
    ]


def expected_edits(backend: str, uid: str, gpu_uuid: str, plugin_dir: Path) -> dict[str, Any]:
    """Exactly what a 10 GiB / 25 % share of ``gpu_uuid`` gets under ``backend``."""
    env = fractional_env(uid, gpu_uuid, backend)
    if backend == "mps":
        env += [
            "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
            f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={gpu_uuid}=10240M",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
        ]
        mounts = [
            {
                "hostPath": str(plugin_dir / "mps" / gpu_uuid / "pipe"),
                "containerPath": "/tmp/nvidia-mps",
                "options": ["rbind", "rw"],
            }
        ]
        return {"env": env, "mounts": mounts}
    if backend == "hami":
        env += [
            "CUDA_DEVICE_MEMORY_LIMIT_0=10240m",
            "CUDA_DEVICE_SM_LIMIT=25",
            "CUDA_DEVICE_SM_LIMIT_0=25",
            f"CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/hami/{uid}.cache",
        ]
        mounts = [
            {
                "hostPath": str(plugin_dir / "hami" / "claims" / uid),
                "containerPath": "/tmp/hami",
                "options": ["rbind", "rw"],
            }
        ]
        return {"env": env, "mounts": mounts}
    return {"env": env}


def prepared_edits(node_dirs: NodeDirs, check_cdi: CheckCDI, uid: str) -> dict[str, Any]:
    spec = check_cdi(node_dirs.cdi / f"k8s.fractional.dev-gpu_{uid}.json")
    (device,) = spec["devices"]
    edits: dict[str, Any] = device["containerEdits"]
    return edits


def gpu_uuid(inventory: NodeInventory, name: str) -> str:
    gpu = inventory.gpu(name)
    assert gpu is not None
    return gpu.uuid


@pytest.mark.parametrize("backend", ["mps", "hami", "none"])
def test_share_edits_follow_the_node_backend(
    backend: str,
    start_agent: StartAgent,
    make_kubelet: MakeKubelet,
    claims: Claims,
    node_dirs: NodeDirs,
    check_cdi: CheckCDI,
    control: FakeControl,
    inventory: NodeInventory,
) -> None:
    start_agent(config={"sharing": backend, "mps_control": str(control.binary)})
    kubelet = make_kubelet()
    ref = claims.create("c", [result("gpu-0", share_id=new_share_id(), memory="10Gi", compute="25")])
    assert kubelet.prepare([ref])[ref["uid"]]["error"] == ""
    edits = prepared_edits(node_dirs, check_cdi, ref["uid"])
    assert edits == expected_edits(backend, ref["uid"], gpu_uuid(inventory, "gpu-0"), node_dirs.plugin)
    assert len(control.events("launch")) == (1 if backend == "mps" else 0)
    assert kubelet.unprepare([ref]) == {ref["uid"]: {"error": ""}}


@pytest.mark.parametrize(("node", "claim"), [("none", "mps"), ("mps", "hami"), ("hami", "none")])
def test_claim_gpu_config_overrides_the_node_backend(
    node: str,
    claim: str,
    start_agent: StartAgent,
    make_kubelet: MakeKubelet,
    claims: Claims,
    node_dirs: NodeDirs,
    check_cdi: CheckCDI,
    control: FakeControl,
    inventory: NodeInventory,
) -> None:
    start_agent(config={"sharing": node, "mps_control": str(control.binary)})
    kubelet = make_kubelet()
    ref = claims.create(
        "c",
        [result("gpu-1", share_id=new_share_id(), memory="10Gi", compute="25")],
        config=[gpu_config(backend=claim)],
    )
    assert kubelet.prepare([ref])[ref["uid"]]["error"] == ""
    edits = prepared_edits(node_dirs, check_cdi, ref["uid"])
    assert edits == expected_edits(claim, ref["uid"], gpu_uuid(inventory, "gpu-1"), node_dirs.plugin)
    assert len(control.events("launch")) == (1 if claim == "mps" else 0)


def test_one_mps_daemon_for_two_shares_stopped_after_the_last_unprepare(
    start_agent: StartAgent, make_kubelet: MakeKubelet, claims: Claims, control: FakeControl
) -> None:
    start_agent(config={"sharing": "mps", "mps_control": str(control.binary)})
    kubelet = make_kubelet()
    first = claims.create("a", [result("gpu-0", share_id=new_share_id(), memory="4Gi", compute="25")])
    second = claims.create("b", [result("gpu-0", share_id=new_share_id(), memory="6Gi", compute="50")])
    answer = kubelet.prepare([first, second])
    assert [answer[ref["uid"]]["error"] for ref in (first, second)] == ["", ""]
    assert len(control.events("launch")) == 1
    (daemon,) = control.events("daemon")
    assert alive(daemon["pid"])

    assert kubelet.unprepare([first]) == {first["uid"]: {"error": ""}}
    assert alive(daemon["pid"]) and control.events("command") == []
    assert kubelet.unprepare([second]) == {second["uid"]: {"error": ""}}
    assert [row["command"] for row in control.events("command")] == ["quit"]
    wait_for(lambda: not alive(daemon["pid"]), what="the daemon gone after quit")
    assert len(control.events("launch")) == 1


@pytest.mark.parametrize(
    ("sharing", "field", "problem"),
    [
        (
            {"backend": "mps", "mps": {"defaultActiveThreadPercentage": 150}},
            "status.allocation.devices.config[0].opaque.parameters.sharing.mps.defaultActiveThreadPercentage",
            "150 is outside 0..100",
        ),
        (
            {"bakend": "mps"},
            "status.allocation.devices.config[0].opaque.parameters.sharing.bakend",
            "unknown field",
        ),
        (
            {"backend": "gpu-direct"},
            "status.allocation.devices.config[0].opaque.parameters.sharing.backend",
            "'gpu-direct' is not one of mps, hami, none",
        ),
    ],
)
def test_bad_gpu_config_is_a_claim_error_naming_the_field(
    sharing: dict[str, Any],
    field: str,
    problem: str,
    start_agent: StartAgent,
    make_kubelet: MakeKubelet,
    claims: Claims,
    node_dirs: NodeDirs,
    control: FakeControl,
) -> None:
    start_agent(config={"sharing": "mps", "mps_control": str(control.binary)})
    kubelet = make_kubelet()
    bad = claims.create(
        "bad", [result("gpu-0", share_id=new_share_id(), memory="1Gi")], config=[gpu_config(**sharing)]
    )
    good = claims.create("good", [result("gpu-1", share_id=new_share_id(), memory="1Gi")])
    answer = kubelet.prepare([bad, good])
    error = answer[bad["uid"]]["error"]
    assert error.startswith("ResourceClaim default/bad: ") and field in error and problem in error, error
    assert answer[bad["uid"]]["devices"] == []
    assert answer[good["uid"]]["error"] == ""  # the error is per claim
    assert [path.name for path in node_dirs.cdi.glob("*.json")] == [
        f"k8s.fractional.dev-gpu_{good['uid']}.json"
    ]
    assert len(control.events("launch")) == 1  # only the good claim's GPU


def test_restart_stops_a_daemon_left_by_a_crash_mid_prepare(
    node_dirs: NodeDirs,
    kubeconfig_file: Path,
    claims: Claims,
    control: FakeControl,
    start_agent: StartAgent,
    make_kubelet: MakeKubelet,
) -> None:
    """``kill -9`` right after the daemon started: the checkpoint says PrepareStarted, which a restart
    does not restore, so nothing needs the daemon; the restarted agent stops it (and the kubelet's
    retry starts a new one)."""
    ref = claims.create("c", [result("gpu-0", share_id=new_share_id(), memory="2Gi")])
    spec = {
        "config": {
            "node_name": "node-a",
            "profile": PROFILE,
            "registry_dir": str(node_dirs.registry),
            "plugin_dir": str(node_dirs.plugin),
            "cdi_root": str(node_dirs.cdi),
            "metrics_port": 0,
            "sharing": "mps",
            "mps_control": str(control.binary),
        },
        "kubeconfig": str(kubeconfig_file),
        "boot_id_path": str(node_dirs.boot_id),
        "crash_after": "shares-acquired",
    }
    process = subprocess.Popen(
        [sys.executable, str(RUNNER), json.dumps(spec)],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stderr=subprocess.DEVNULL,
    )
    try:
        kubelet = KubeletSimulator(node_dirs.registry, kubelet_version="1.35")
        try:
            kubelet.register(timeout=60)
            with pytest.raises(grpc.RpcError):
                kubelet.prepare([ref], timeout=30)
        finally:
            kubelet.close()
        assert process.wait(timeout=30) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    (left,) = control.events("daemon")
    assert alive(left["pid"])

    start_agent(config={"sharing": "mps", "mps_control": str(control.binary)})
    assert [row["command"] for row in control.events("command")] == ["quit"]
    wait_for(lambda: not alive(left["pid"]), what="the left-over daemon stopped")
    kubelet = make_kubelet()
    assert kubelet.prepare([ref])[ref["uid"]]["error"] == ""
    assert len(control.events("launch")) == 2


# -- start-up check of the toolkit's CDI spec, and merged edits ----------------------------------


def test_toolkit_cdi_spec_check(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    etc, run = tmp_path / "etc-cdi", tmp_path / "run-cdi"
    run.mkdir()
    (run / "k8s.fractional.dev-gpu_x.json").write_text(
        json.dumps({"cdiVersion": "0.3.0", "kind": "k8s.fractional.dev/gpu"})
    )
    (run / "broken.yaml").write_text("kind: [unclosed")
    (run / "notes.txt").write_text("kind: nvidia.com/gpu")  # not a spec file name
    with caplog.at_level(logging.INFO, logger="driver.plugin.agent"):
        assert check_toolkit_cdi_spec([etc, run, run]) is None
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "no nvidia.com/gpu CDI spec found" in warning.getMessage()
    assert warning.searched == [str(etc), str(run)]  # type: ignore[attr-defined]

    caplog.clear()
    etc.mkdir()
    (etc / "nvidia.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: []\n")
    with caplog.at_level(logging.INFO, logger="driver.plugin.agent"):
        assert check_toolkit_cdi_spec([etc, run]) == etc / "nvidia.yaml"
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert find_spec_for_kind([run, etc], "k8s.fractional.dev/gpu") == run / "k8s.fractional.dev-gpu_x.json"


def test_merged_edits_drop_exact_duplicates_only() -> None:
    cache = Mount("/host/hami/claims/u", "/tmp/hami")
    edits = ContainerEdits(
        env=("A=1", "B=2", "A=1", "A=3"),
        mounts=(cache, Mount("/host/other", "/tmp/hami", ("rbind", "ro")), cache),
        device_nodes=(DeviceNode("/dev/x"), DeviceNode("/dev/x"), DeviceNode("/dev/x", permissions="r")),
    )
    assert deduplicated_edits(edits) == ContainerEdits(
        env=("A=1", "B=2", "A=3"),  # a different value is a conflict and stays visible
        mounts=(cache, Mount("/host/other", "/tmp/hami", ("rbind", "ro"))),
        device_nodes=(DeviceNode("/dev/x"), DeviceNode("/dev/x", permissions="r")),
    )


class _RepeatingBackend(NoneBackend):
    """A backend whose edits repeat the core's variables and one mount (as several shares' would)."""

    def container_edits(self, share: ShareSpec) -> ContainerEdits:
        mount = Mount("/host/cache", "/cache")
        return ContainerEdits(
            env=(f"FRACTIONAL_CLAIM_UID={share.claim_uid}", "X=1", "X=1"), mounts=(mount, mount)
        )


def test_prepared_gpu_edits_are_deduplicated(inventory: NodeInventory) -> None:
    body = {
        "metadata": {"namespace": "default", "name": "c", "uid": "u-1"},
        "status": {"allocation": {"devices": {"results": [result("gpu-0")]}}},
    }
    claim = parse_claim(body, ClaimRef(namespace="default", name="c", uid=ClaimUID("u-1")))
    settings = PrepareSettings(default_backend="none", backends={"none": _RepeatingBackend()})
    (device,) = compute_prepared_devices(claim, inventory, settings)
    assert device.edits.env.count("FRACTIONAL_CLAIM_UID=u-1") == 1 and device.edits.env.count("X=1") == 1
    assert device.edits.mounts == (Mount("/host/cache", "/cache"),)

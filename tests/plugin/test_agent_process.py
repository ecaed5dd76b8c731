"""The agent as a process: SIGTERM shutdown through the CLI, and ``kill -9`` in the middle of a Prepare."""

from __future__ import annotations

import json
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
from tests.plugin.conftest import PROFILE, REPO_ROOT, Claims, NodeDirs, new_share_id, result

RUNNER = Path(__file__).resolve().parent / "agent_runner.py"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def _register(dirs: NodeDirs, process: subprocess.Popen[bytes]) -> KubeletSimulator:
    kubelet = KubeletSimulator(dirs.registry, kubelet_version="1.35")
    try:
        kubelet.register(timeout=60)
    except Exception:
        kubelet.close()
        process.kill()
        _, stderr = process.communicate(timeout=30)
        raise AssertionError(f"agent did not register; stderr:\n{stderr.decode()[-3000:]}") from None
    return kubelet


def test_sigterm_removes_sockets_and_exits_0(
    node_dirs: NodeDirs, kubeconfig_file: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    command = [sys.executable, "-m", "driver", "plugin", "--node-name", "node-a", "--backend", "fake"]
    command += ["--profile", PROFILE, "--registry-dir", str(node_dirs.registry)]
    command += ["--plugin-dir", str(node_dirs.plugin), "--cdi-root", str(node_dirs.cdi)]
    command += ["--kubeconfig", str(kubeconfig_file), "--metrics-port", "0"]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=_env(), stderr=subprocess.PIPE)
    processes.append(process)
    kubelet = _register(node_dirs, process)
    try:
        assert kubelet.prepare([]) == {}
    finally:
        kubelet.close()
    sockets = [node_dirs.registry / "fractional.dev-reg.sock", node_dirs.plugin / "dra.sock"]
    assert all(path.exists() for path in sockets)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr.decode()[-3000:]
    assert not any(path.exists() for path in sockets)


def _start_runner(
    dirs: NodeDirs, kubeconfig: Path, crash_after: str | None, processes: list[subprocess.Popen[bytes]]
) -> subprocess.Popen[bytes]:
    spec = {
        "config": {
            "node_name": "node-a",
            "profile": PROFILE,
            "registry_dir": str(dirs.registry),
            "plugin_dir": str(dirs.plugin),
            "cdi_root": str(dirs.cdi),
            "metrics_port": 0,
        },
        "kubeconfig": str(kubeconfig),
        "boot_id_path": str(dirs.boot_id),
        "crash_after": crash_after,
    }
    process = subprocess.Popen(
        [sys.executable, str(RUNNER), json.dumps(spec)], cwd=REPO_ROOT, env=_env(), stderr=subprocess.PIPE
    )
    processes.append(process)
    return process


# One real kill -9 (each process start costs seconds here); test_state.py crashes after every effect.
@pytest.mark.parametrize("crash_after", ["checkpoint-started"])
def test_kill_9_during_prepare_then_restart(
    crash_after: str,
    node_dirs: NodeDirs,
    kubeconfig_file: Path,
    claims: Claims,
    processes: list[subprocess.Popen[bytes]],
    check_cdi: Callable[[Path], dict[str, Any]],
) -> None:
    share = new_share_id()
    ref = claims.create("c", [result("gpu-1", share_id=share, memory="3Gi", compute="50")])
    expected_id = f"k8s.fractional.dev/gpu={ref['uid']}-gpu-1-{share[:8]}"

    crashing = _start_runner(node_dirs, kubeconfig_file, crash_after, processes)
    kubelet = _register(node_dirs, crashing)
    try:
        with pytest.raises(grpc.RpcError):
            kubelet.prepare([ref], timeout=30)
    finally:
        kubelet.close()
    crashing.communicate(timeout=30)
    assert crashing.returncode == -signal.SIGKILL
    assert (node_dirs.registry / "fractional.dev-reg.sock").exists()  # a killed agent leaves its sockets

    restarted = _start_runner(node_dirs, kubeconfig_file, None, processes)
    kubelet = _register(node_dirs, restarted)
    try:
        answer = kubelet.prepare([ref])
        again = kubelet.prepare([ref])
    finally:
        kubelet.close()
    assert answer == again
    (device,) = answer[ref["uid"]]["devices"]
    assert device["cdi_device_ids"] == [expected_id]
    (spec_path,) = node_dirs.cdi.glob("*.json")
    spec = check_cdi(spec_path)
    (cdi_device,) = spec["devices"]
    assert f"k8s.fractional.dev/gpu={cdi_device['name']}" == expected_id
    assert "FRACTIONAL_GPU_MEMORY_LIMIT=3221225472" in cdi_device["containerEdits"]["env"]
    checkpoint = json.loads((node_dirs.plugin / "checkpoint.json").read_text())
    assert checkpoint["preparedClaims"][ref["uid"]]["phase"] == "PrepareCompleted"
    restarted.send_signal(signal.SIGTERM)
    restarted.communicate(timeout=60)
    assert restarted.returncode == 0

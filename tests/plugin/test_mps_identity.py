"""Which MPS daemon is whose: the pipe directory's pid file is tenant-writable, so it is never trusted.

The fake ``nvidia-cuda-mps-control`` of ``test_sharing_mps`` runs real daemon processes; a "crash"
of the agent leaves them running (its supervisor is stopped), and a new backend on the same plugin
dir is the restarted agent. What a tenant can do is what these tests do to the pipe directory,
which is mounted read-write into every container of the GPU's shares.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.plugin.fakes_nvml import FakeNVML
from tests.plugin.test_sharing_mps import (
    GPU_A,
    GPU_B,
    FakeControl,
    alive,
    control,
    make_backend,
    nvml,
    share,
    wait_for,
)

__all__ = ["control", "nvml"]  # fixtures, imported for pytest


def pipe_dir(tmp_path: Path, gpu: str) -> Path:
    return tmp_path / "plugin" / "mps" / gpu / "pipe"


def plant_pid_file(tmp_path: Path, gpu: str, content: str) -> None:
    directory = pipe_dir(tmp_path, gpu)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "nvidia-cuda-mps-control.pid").write_text(content)


def sigterms(control: FakeControl, pid: int) -> list[dict[str, object]]:
    return [row for row in control.events("sigterm") if row["pid"] == pid]


def test_a_pid_file_naming_another_gpus_daemon_is_not_adopted_nor_signalled(
    tmp_path: Path, control: FakeControl, nvml: FakeNVML, caplog: pytest.LogCaptureFixture
) -> None:
    crashed = make_backend(tmp_path, control, nvml)
    crashed.acquire(share("claim-b", gpu=GPU_B, device="gpu-1"))
    pid_b = crashed.daemons()[GPU_B].pid
    assert pid_b is not None
    crashed._stop.set()  # white box: the crashed agent's supervisor is gone, its daemon is not
    plant_pid_file(tmp_path, GPU_A, f"{pid_b}\n")  # a tenant of GPU A writes B's daemon's pid

    backend = make_backend(tmp_path, control, nvml)
    try:
        backend.acquire(share("claim-b", gpu=GPU_B, device="gpu-1"))  # restored: B's daemon adopted
        with caplog.at_level(logging.WARNING, logger="driver.plugin.sharing.mps"):
            backend.acquire(share("claim-a"))
        pid_a = backend.daemons()[GPU_A].pid
        assert pid_a is not None and pid_a != pid_b
        assert [row["env"]["CUDA_VISIBLE_DEVICES"] for row in control.events("launch")] == [GPU_B, GPU_A]
        [ignored] = [
            r for r in caplog.records if r.getMessage() == "mps pid file ignored: not this GPU's daemon"
        ]
        assert ignored.__dict__["gpu_uuid"] == GPU_A
        assert f"CUDA_VISIBLE_DEVICES={GPU_B!r}" in ignored.__dict__["reason"]

        backend.release(share("claim-a"))  # A's last share: A's daemon goes, B's stays
        assert wait_for(lambda: not alive(pid_a))
        assert alive(pid_b) and sigterms(control, pid_b) == []
        assert backend.daemons()[GPU_B].pid == pid_b
    finally:
        backend.close()


def test_cleanup_after_a_restart_stops_the_recorded_daemon_not_the_one_a_pid_file_names(
    tmp_path: Path, control: FakeControl, nvml: FakeNVML
) -> None:
    crashed = make_backend(tmp_path, control, nvml)
    crashed.acquire(share("claim-a"))
    crashed.acquire(share("claim-b", gpu=GPU_B, device="gpu-1"))
    pid_a, pid_b = crashed.daemons()[GPU_A].pid, crashed.daemons()[GPU_B].pid
    assert pid_a is not None and pid_b is not None
    crashed._stop.set()
    plant_pid_file(tmp_path, GPU_A, str(pid_b))  # claim-a was unprepared meanwhile; its tenant wrote this

    backend = make_backend(tmp_path, control, nvml)
    try:
        backend.acquire(share("claim-b", gpu=GPU_B, device="gpu-1"))
        assert backend.stop_unused_daemons() == (GPU_A,)
        assert wait_for(lambda: not alive(pid_a))  # found through the agent's own record
        assert alive(pid_b) and sigterms(control, pid_b) == []
        assert nvml.modes()[GPU_A] == FakeNVML.NVML_COMPUTEMODE_DEFAULT
        assert nvml.modes()[GPU_B] == FakeNVML.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    finally:
        backend.close()


@pytest.mark.parametrize("planted", [None, "not a pid\n", "1\n"])
def test_the_agents_own_record_finds_the_daemon_whatever_the_pid_file_says(
    tmp_path: Path, control: FakeControl, nvml: FakeNVML, planted: str | None
) -> None:
    crashed = make_backend(tmp_path, control, nvml)
    crashed.acquire(share("claim-a"))
    pid_a = crashed.daemons()[GPU_A].pid
    assert pid_a is not None
    crashed._stop.set()
    pid_file = pipe_dir(tmp_path, GPU_A) / "nvidia-cuda-mps-control.pid"
    if planted is None:
        pid_file.unlink()
    else:
        pid_file.write_text(planted)  # garbage, or pid 1 (init: not a control daemon)

    backend = make_backend(tmp_path, control, nvml)
    try:
        backend.acquire(share("claim-a"))
        assert backend.daemons()[GPU_A].pid == pid_a  # adopted, not started twice
        assert len(control.events("launch")) == 1
    finally:
        backend.close()
    assert wait_for(lambda: not alive(pid_a))

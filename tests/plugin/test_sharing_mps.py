"""The MPS backend's daemons, with a fake ``nvidia-cuda-mps-control`` and the fake NVML module.

The fake control binary is a Python script written into ``tmp_path``. ``-d`` forks a daemon (the
launcher exits once it is ready, like the real one) that writes
``$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid`` and reads commands from the FIFO
``$CUDA_MPS_PIPE_DIRECTORY/control`` until ``quit`` or SIGTERM. Without ``-d`` it writes stdin to
that FIFO (as ``echo quit | nvidia-cuda-mps-control`` does). Every invocation appends a JSON line
(event, pid, argv, CUDA_* environment) to a record file.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from driver.errors import ClaimError
from driver.plugin.sharing import MpsBackend, ShareSpec
from tests.plugin.fakes_nvml import FakeNVML

GIB = 1024**3
GPU_A = "GPU-aaaaaaaa-0000-4000-8000-000000000001"
GPU_B = "GPU-bbbbbbbb-0000-4000-8000-000000000002"
EXCLUSIVE_PROCESS = FakeNVML.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS

FAKE_CONTROL = r"""#!{python}
import json, os, signal, sys

RECORD = {record!r}
PIPE = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
CONTROL = os.path.join(PIPE, "control")
PID_FILE = os.path.join(PIPE, "nvidia-cuda-mps-control.pid")


def record(event, **extra):
    env = {{k: v for k, v in os.environ.items() if k.startswith("CUDA_")}}
    line = json.dumps(dict(event=event, pid=os.getpid(), argv=sys.argv[1:], env=env, **extra))
    with open(RECORD, "a") as handle:
        handle.write(line + "\n")


def cleanup():
    try:
        os.unlink(PID_FILE)
    except FileNotFoundError:
        pass


def on_sigterm(signum, frame):
    record("sigterm")
    cleanup()
    os._exit(0)


def serve(ready):
    signal.signal(signal.SIGTERM, on_sigterm)
    if not os.path.exists(CONTROL):
        os.mkfifo(CONTROL)
    fd = os.open(CONTROL, os.O_RDWR)
    with open(PID_FILE, "w") as handle:
        handle.write(str(os.getpid()) + "\n")
    record("daemon")
    os.write(ready, b"1")
    os.close(ready)
    buffer = b""
    while True:
        buffer += os.read(fd, 1024)
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            command = line.decode().strip()
            record("command", command=command)
            if command == "quit" and not os.path.exists(os.path.join(PIPE, "ignore-quit")):
                cleanup()
                os._exit(0)


if sys.argv[1:] == ["-d"]:
    record("launch")
    if os.path.exists(os.path.join(os.path.dirname(RECORD), "fail-launch")):
        sys.exit(3)
    ready_r, ready_w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.close(ready_r)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            serve(ready_w)
        os._exit(0)
    os.close(ready_w)
    sys.exit(0 if os.read(ready_r, 1) == b"1" else 1)
else:
    command = sys.stdin.read()
    record("client", command=command.strip())
    try:
        fd = os.open(CONTROL, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as error:
        print(error, file=sys.stderr)
        sys.exit(1)
    os.write(fd, command.encode() if command.endswith("\n") else (command + "\n").encode())
"""


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        pause.wait(0.02)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return True
    return state not in ("Z", "X")


class FakeControl:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.record = root / "record.jsonl"
        self.binary = root / "nvidia-cuda-mps-control"
        self.binary.write_text(FAKE_CONTROL.format(python=sys.executable, record=str(self.record)))
        self.binary.chmod(0o755)

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        rows = [json.loads(line) for line in self.record.read_text().splitlines() if line.strip()]
        return [row for row in rows if kind is None or row["event"] == kind]

    def fail_launches(self, fail: bool) -> None:
        marker = self.root / "fail-launch"
        if fail:
            marker.touch()
        else:
            marker.unlink(missing_ok=True)


@pytest.fixture
def control(tmp_path: Path) -> Iterator[FakeControl]:
    fake = FakeControl(tmp_path)
    yield fake
    for row in fake.events("daemon"):  # never leave a fake daemon behind
        if alive(row["pid"]):
            os.kill(row["pid"], signal.SIGKILL)


@pytest.fixture
def nvml() -> FakeNVML:
    return FakeNVML([GPU_A, GPU_B])


def make_backend(tmp_path: Path, control: FakeControl, nvml: FakeNVML | None) -> MpsBackend:
    return MpsBackend(
        plugin_dir=str(tmp_path / "plugin"),
        control=str(control.binary),
        nvml=nvml,
        supervise_seconds=0.05,
        start_timeout_seconds=15.0,
        stop_timeout_seconds=5.0,
    )


def share(claim: str, gpu: str = GPU_A, device: str = "gpu-0", share_id: str | None = "s-1") -> ShareSpec:
    return ShareSpec(
        claim_uid=claim,
        device=device,
        gpu_uuid=gpu,
        ordinal=0,
        share_id=share_id,
        memory_bytes=10 * GIB,
        compute_percent=25,
        whole_gpu=False,
    )


def test_one_daemon_for_two_shares_of_a_gpu_stopped_after_the_last_release(
    tmp_path: Path, control: FakeControl, nvml: FakeNVML
) -> None:
    backend = make_backend(tmp_path, control, nvml)
    first, second = share("claim-1"), share("claim-2", share_id="s-2")
    try:
        backend.acquire(first)
        backend.acquire(second)
        backend.acquire(first)  # a repeated prepare: idempotent
        assert len(control.events("launch")) == 1
        [launch] = control.events("launch")
        pipe = tmp_path / "plugin" / "mps" / GPU_A / "pipe"
        assert launch["argv"] == ["-d"]
        assert launch["env"] == {
            "CUDA_VISIBLE_DEVICES": GPU_A,
            "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "plugin" / "mps" / GPU_A / "log"),
        }
        status = backend.daemons()[GPU_A]
        assert status.shares == 2
        assert status.pid is not None and alive(status.pid)
        pid = status.pid

        backend.release(first)
        assert alive(pid)
        assert control.events("command") == []
        backend.release(second)
        assert wait_for(lambda: not alive(pid))
        assert [row["command"] for row in control.events("command")] == ["quit"]
        [client] = control.events("client")
        assert client["env"]["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
        assert not (pipe / "nvidia-cuda-mps-control.pid").exists()
        assert backend.daemons() == {}
        backend.release(second)  # already released: fine
    finally:
        backend.close()


def test_compute_mode_set_before_the_daemon_and_restored_after(
    tmp_path: Path, control: FakeControl, nvml: FakeNVML
) -> None:
    backend = make_backend(tmp_path, control, nvml)
    try:
        backend.acquire(share("claim-1"))
        assert nvml.compute_mode_calls == [(GPU_A, EXCLUSIVE_PROCESS)]
        state = json.loads((tmp_path / "plugin" / "mps" / GPU_A / "state.json").read_text())
        assert state["previousComputeMode"] == FakeNVML.NVML_COMPUTEMODE_DEFAULT
        backend.release(share("claim-1"))
        assert nvml.compute_mode_calls == [
            (GPU_A, EXCLUSIVE_PROCESS),
            (GPU_A, FakeNVML.NVML_COMPUTEMODE_DEFAULT),
        ]
        assert not (tmp_path / "plugin" / "mps" / GPU_A / "state.json").exists()
    finally:
        backend.close()


def test_a_gpu_already_exclusive_is_left_as_it_was(tmp_path: Path, control: FakeControl) -> None:
    nvml = FakeNVML([GPU_A], compute_mode=EXCLUSIVE_PROCESS)
    backend = make_backend(tmp_path, control, nvml)
    try:
        backend.acquire(share("claim-1"))
        backend.release(share("claim-1"))
        assert nvml.compute_mode_calls == []
    finally:
        backend.close()


def test_a_killed_daemon_is_restarted(tmp_path: Path, control: FakeControl, nvml: FakeNVML) -> None:
    backend = make_backend(tmp_path, control, nvml)
    try:
        backend.acquire(share("claim-1"))
        first_pid = backend.daemons()[GPU_A].pid
        assert first_pid is not None
        os.kill(first_pid, signal.SIGKILL)

        def restarted() -> bool:
            status = backend.daemons()[GPU_A]
            return status.restarts == 1 and status.pid not in (None, first_pid) and alive(status.pid)

        assert wait_for(restarted)
        assert len(control.events("launch")) == 2
        assert nvml.compute_mode_calls == [(GPU_A, EXCLUSIVE_PROCESS)]  # the mode is not touched again
    finally:
        backend.close()


def test_close_stops_every_daemon_and_the_supervisor(
    tmp_path: Path, control: FakeControl, nvml: FakeNVML
) -> None:
    backend = make_backend(tmp_path, control, nvml)
    backend.acquire(share("claim-1"))
    backend.acquire(share("claim-2", gpu=GPU_B, device="gpu-1"))
    pids = [status.pid for status in backend.daemons().values()]
    assert len(pids) == 2 and all(pid is not None and alive(pid) for pid in pids)
    backend.close()
    assert all(not alive(pid) for pid in pids if pid is not None)
    assert sorted(row["env"]["CUDA_VISIBLE_DEVICES"] for row in control.events("client")) == [GPU_A, GPU_B]
    assert nvml.modes() == {GPU_A: 0, GPU_B: 0}
    assert not any(t.name == "mps-supervisor" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(ClaimError, match=r"ResourceClaim ns/c3 \(claim-3\): sharing.mps: .*stopping"):
        backend.acquire(replace(share("claim-3"), claim_key="ns/c3"))  # named by namespace/name and UID


def test_a_daemon_ignoring_quit_is_terminated(tmp_path: Path, control: FakeControl) -> None:
    backend = MpsBackend(
        plugin_dir=str(tmp_path / "plugin"), control=str(control.binary), stop_timeout_seconds=0.5
    )
    backend.acquire(share("claim-1"))
    pid = backend.daemons()[GPU_A].pid
    assert pid is not None
    (tmp_path / "plugin" / "mps" / GPU_A / "pipe" / "ignore-quit").touch()
    backend.close()
    assert not alive(pid)
    assert [row["event"] for row in control.events() if row["pid"] == pid][-1] == "sigterm"


def test_a_restarted_agent_adopts_the_running_daemon(
    tmp_path: Path, control: FakeControl, nvml: FakeNVML
) -> None:
    crashed = make_backend(tmp_path, control, nvml)
    crashed.acquire(share("claim-1"))
    crashed.acquire(share("claim-2", gpu=GPU_B, device="gpu-1"))
    pid_a = crashed.daemons()[GPU_A].pid
    crashed._stop.set()  # white box: the crashed agent's supervisor is gone, its daemons are not

    backend = make_backend(tmp_path, control, nvml)
    try:
        backend.acquire(share("claim-1"))  # the core re-acquires every checkpointed share
        assert backend.daemons()[GPU_A].pid == pid_a
        assert len(control.events("launch")) == 2
        # claim-2 was unprepared while the agent was down: its daemon is cleaned up.
        assert backend.stop_unused_daemons() == (GPU_B,)
        assert backend.stop_unused_daemons() == ()
        assert nvml.modes()[GPU_B] == FakeNVML.NVML_COMPUTEMODE_DEFAULT
        backend.release(share("claim-1"))
        # The mode recorded by the first agent (DEFAULT), not the current one, is restored.
        assert nvml.modes()[GPU_A] == FakeNVML.NVML_COMPUTEMODE_DEFAULT
        assert pid_a is not None and wait_for(lambda: not alive(pid_a))
    finally:
        backend.close()


def test_a_failed_start_is_a_claim_error_and_undoes_the_compute_mode(
    tmp_path: Path, control: FakeControl, nvml: FakeNVML
) -> None:
    control.fail_launches(True)
    backend = make_backend(tmp_path, control, nvml)
    try:
        with pytest.raises(ClaimError, match=r"gpu-0: .* exited with status 3"):
            backend.acquire(share("claim-1"))
        assert nvml.modes()[GPU_A] == FakeNVML.NVML_COMPUTEMODE_DEFAULT
        assert backend.daemons() == {}
        assert not (tmp_path / "plugin" / "mps" / GPU_A / "state.json").exists()
        control.fail_launches(False)
        backend.acquire(share("claim-1"))  # the kubelet's retry works
        assert backend.daemons()[GPU_A].shares == 1
    finally:
        backend.close()


def test_a_compute_mode_failure_is_a_claim_error_and_starts_nothing(
    tmp_path: Path, control: FakeControl, nvml: FakeNVML
) -> None:
    nvml.fail_set_compute_mode = 4  # NO_PERMISSION
    backend = make_backend(tmp_path, control, nvml)
    try:
        with pytest.raises(ClaimError, match="EXCLUSIVE_PROCESS"):
            backend.acquire(share("claim-1"))
        assert control.events("launch") == []
        assert backend.daemons() == {}
    finally:
        backend.close()


def test_mps_shares_of_two_gpus_in_one_claim_are_refused(tmp_path: Path, control: FakeControl) -> None:
    backend = make_backend(tmp_path, control, None)
    try:
        backend.acquire(share("claim-1"))
        with pytest.raises(ClaimError, match="gpu-0 and gpu-1"):
            backend.acquire(share("claim-1", gpu=GPU_B, device="gpu-1", share_id="s-2"))
        assert list(backend.daemons()) == [GPU_A]
    finally:
        backend.close()


def test_whole_gpu_shares_start_no_daemon(tmp_path: Path, control: FakeControl, nvml: FakeNVML) -> None:
    backend = make_backend(tmp_path, control, nvml)
    whole = replace(share("claim-1"), share_id=None, whole_gpu=True, compute_percent=0)
    backend.acquire(whole)
    backend.release(whole)
    backend.close()
    assert control.events() == []
    assert nvml.compute_mode_calls == []

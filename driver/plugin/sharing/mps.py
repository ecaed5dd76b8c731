"""``mps``: classic CUDA MPS, one control daemon per shared GPU, run and watched by the node agent.

Per GPU that has at least one (non-whole) share:

1. through NVML (when given) the compute mode is set to EXCLUSIVE_PROCESS; the previous mode is
   first recorded in ``<plugin dir>/mps/<uuid>/state.json`` (so a crashed agent still restores it);
2. ``nvidia-cuda-mps-control -d`` starts with ``CUDA_VISIBLE_DEVICES=<uuid>``,
   ``CUDA_MPS_PIPE_DIRECTORY=<plugin dir>/mps/<uuid>/pipe`` and
   ``CUDA_MPS_LOG_DIRECTORY=<plugin dir>/mps/<uuid>/log``. ``-d`` forks: the launcher exits once
   the daemon listens, and the daemon's pid is read from ``<pipe>/nvidia-cuda-mps-control.pid``;
3. a supervisor thread (``mps-supervisor``) restarts a daemon that died, with backoff;
4. when the GPU's last share is released (or on ``close()``): ``echo quit |
   nvidia-cuda-mps-control`` with the same environment, wait, SIGTERM, SIGKILL; then the previous
   compute mode is restored and the state file removed.

Shares are reference-counted per GPU by ``(claim UID, device, shareID)``; ``acquire`` is idempotent.
After an agent restart the core calls ``acquire`` for every checkpointed share: a daemon still
running for that pipe directory is adopted (not restarted) and the recorded previous mode reused;
``stop_unused_daemons()`` then stops daemons that no prepared share needs any more.

Container edits per share: the GPU's pipe directory mounted on ``/tmp/nvidia-mps`` (the MPS
default, so clients that ignore the variable find it too), ``CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps``,
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=<uuid>=<MiB>M`` and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (the
share's ``compute``, else the GpuConfig's ``defaultActiveThreadPercentage``; omitted when 0).
An MPS client talks to one pipe directory only, so a claim may hold MPS shares of one GPU only;
a second GPU in the same claim is refused by ``acquire``. Whole-GPU shares get no edits, no daemon.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from driver.errors import ClaimError
from driver.plugin.sharing.base import ContainerEdits, Mount, ShareSpec

__all__ = ["MpsBackend", "MpsDaemonStatus", "PIPE_DIRECTORY_IN_CONTAINER"]

log = logging.getLogger(__name__)

MIB = 1024 * 1024
PIPE_DIRECTORY_IN_CONTAINER = "/tmp/nvidia-mps"
PID_FILE = "nvidia-cuda-mps-control.pid"
DAEMON_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
EXCLUSIVE_PROCESS = 3  # NVML_COMPUTEMODE_EXCLUSIVE_PROCESS (the module's own constant wins)

_ShareKey = tuple[str, str, str | None]
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class MpsDaemonStatus:
    gpu_uuid: str
    device: str
    pid: int | None
    shares: int
    restarts: int
    previous_compute_mode: int | None


@dataclass(slots=True)
class _Daemon:
    """Mutable bookkeeping of one GPU's daemon; only touched under ``MpsBackend._lock``."""

    gpu_uuid: str
    device: str
    pid: int | None
    previous_mode: int | None
    shares: set[_ShareKey] = field(default_factory=set)
    failures: int = 0
    restarts: int = 0
    next_start: float = 0.0


class _DaemonError(Exception):
    """The control daemon could not be started."""


class MpsBackend:
    """One MPS control daemon per shared GPU, reference-counted by share."""

    name = "mps"

    def __init__(
        self,
        *,
        plugin_dir: str,
        control: str = "nvidia-cuda-mps-control",
        nvml: ModuleType | Any | None = None,
        supervise_seconds: float = 1.0,
        start_timeout_seconds: float = 15.0,
        stop_timeout_seconds: float = 10.0,
        max_backoff_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._root = Path(plugin_dir) / "mps"
        self._control = control
        self._nvml = nvml
        self._supervise_seconds = supervise_seconds
        self._start_timeout = start_timeout_seconds
        self._stop_timeout = stop_timeout_seconds
        self._max_backoff = max_backoff_seconds
        self._clock = clock
        self._lock = threading.Lock()  # guards _daemons and every daemon start/stop
        self._daemons: dict[str, _Daemon] = {}
        self._stop = threading.Event()
        self._pause = threading.Event()  # never set: a sleep that is not time.sleep
        self._supervisor: threading.Thread | None = None
        self._closed = False

    # -- paths and environment -------------------------------------------------------------

    def gpu_dir(self, gpu_uuid: str) -> Path:
        return self._root / gpu_uuid

    def pipe_dir(self, gpu_uuid: str) -> Path:
        return self.gpu_dir(gpu_uuid) / "pipe"

    def log_dir(self, gpu_uuid: str) -> Path:
        return self.gpu_dir(gpu_uuid) / "log"

    def daemon_environment(self, gpu_uuid: str) -> dict[str, str]:
        """The whole environment of the daemon and of ``quit`` (nothing inherited from the agent)."""
        return {
            "PATH": DAEMON_PATH,
            "CUDA_VISIBLE_DEVICES": gpu_uuid,
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir(gpu_uuid)),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir(gpu_uuid)),
        }

    # -- SharingBackend --------------------------------------------------------------------

    def container_edits(self, share: ShareSpec) -> ContainerEdits:
        if share.whole_gpu:
            return ContainerEdits()
        env = [
            f"CUDA_MPS_PIPE_DIRECTORY={PIPE_DIRECTORY_IN_CONTAINER}",
            f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={share.gpu_uuid}={share.memory_bytes // MIB}M",
        ]
        percent = share.compute_percent or int(
            dict(share.backend_options).get("defaultActiveThreadPercentage", 0)
        )
        if percent > 0:
            env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={percent}")
        mount = Mount(str(self.pipe_dir(share.gpu_uuid)), PIPE_DIRECTORY_IN_CONTAINER, ("rbind", "rw"))
        return ContainerEdits(env=tuple(env), mounts=(mount,))

    def acquire(self, share: ShareSpec) -> None:
        """Count the share; the GPU's first share sets the compute mode and starts (or adopts) its daemon."""
        if share.whole_gpu:
            return
        key = (share.claim_uid, share.device, share.share_id)
        with self._lock:
            if self._closed:
                raise ClaimError(claim=share.claim, field="sharing.mps", problem="the node agent is stopping")
            for other in self._daemons.values():
                if other.gpu_uuid != share.gpu_uuid and any(k[0] == share.claim_uid for k in other.shares):
                    raise ClaimError(
                        claim=share.claim,
                        field="sharing.backend",
                        problem=(
                            f"MPS shares of {other.device} and {share.device} in one claim: an MPS client "
                            "talks to one GPU's control daemon only; use one GPU per claim, or hami/none"
                        ),
                    )
            daemon = self._daemons.get(share.gpu_uuid)
            if daemon is None:
                daemon = self._start_gpu(share)
                self._daemons[share.gpu_uuid] = daemon
                self._ensure_supervisor()
            elif daemon.pid is None or not self._is_running(daemon.pid):
                try:
                    daemon.pid = self._launch(share.gpu_uuid)
                except _DaemonError as error:
                    raise ClaimError(
                        claim=share.claim, field="sharing.mps", problem=f"{share.device}: {error}"
                    ) from error
                daemon.failures = 0
            daemon.shares.add(key)

    def release(self, share: ShareSpec) -> None:
        """Forget the share; the GPU's last share stops the daemon and restores the compute mode."""
        if share.whole_gpu:
            return
        key = (share.claim_uid, share.device, share.share_id)
        with self._lock:
            daemon = self._daemons.get(share.gpu_uuid)
            if daemon is None or key not in daemon.shares:
                return
            daemon.shares.discard(key)
            if daemon.shares:
                return
            del self._daemons[share.gpu_uuid]
            self._stop_gpu(daemon)

    def close(self) -> None:
        """Agent shutdown: stop the supervisor, then every daemon; restore compute modes."""
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=self._start_timeout + self._supervise_seconds + 5)
        with self._lock:
            self._closed = True
            daemons = list(self._daemons.values())
            self._daemons.clear()
            for daemon in daemons:
                self._stop_gpu(daemon)

    def describe(self) -> dict[str, str]:
        return {
            "backend": self.name,
            "enforcement": "cuda-mps",
            "control": self._control,
            "pipeDirectory": PIPE_DIRECTORY_IN_CONTAINER,
        }

    # -- extras for the core ---------------------------------------------------------------

    def daemons(self) -> dict[str, MpsDaemonStatus]:
        """GPU UUID -> its daemon, for metrics, logs and tests."""
        with self._lock:
            return {
                uuid: MpsDaemonStatus(
                    gpu_uuid=uuid,
                    device=d.device,
                    pid=d.pid,
                    shares=len(d.shares),
                    restarts=d.restarts,
                    previous_compute_mode=d.previous_mode,
                )
                for uuid, d in self._daemons.items()
            }

    def stop_unused_daemons(self) -> tuple[str, ...]:
        """After restart recovery: stop daemons left from an earlier run that no share needs.

        Call it once the checkpointed shares were acquired again. Returns the GPU UUIDs cleaned up.
        """
        cleaned: list[str] = []
        with self._lock:
            if not self._root.is_dir():
                return ()
            for gpu_dir in sorted(self._root.iterdir()):
                uuid = gpu_dir.name
                if uuid in self._daemons or not gpu_dir.is_dir():
                    continue
                state = self._read_state(uuid)
                pid = self._running_pid(uuid)
                if pid is None and state is None:
                    continue
                leftover = _Daemon(
                    gpu_uuid=uuid,
                    device=str((state or {}).get("device", uuid)),
                    pid=pid,
                    previous_mode=_optional_int((state or {}).get("previousComputeMode")),
                )
                self._stop_gpu(leftover)
                cleaned.append(uuid)
        return tuple(cleaned)

    # -- internals (called with _lock held) --------------------------------------------------

    def _start_gpu(self, share: ShareSpec) -> _Daemon:
        uuid = share.gpu_uuid
        try:
            self.pipe_dir(uuid).mkdir(parents=True, exist_ok=True)
            self.log_dir(uuid).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ClaimError(claim=share.claim, field="sharing.mps", problem=str(error)) from error
        state = self._read_state(uuid)
        previous = _optional_int(state.get("previousComputeMode")) if state else None
        if self._nvml is not None:
            try:
                handle = self._nvml.nvmlDeviceGetHandleByUUID(uuid)
                current = int(self._nvml.nvmlDeviceGetComputeMode(handle))
                if state is None:
                    previous = current
                    self._write_state(uuid, share.device, previous)  # recorded before the effect
                if current != self._exclusive_process:
                    self._nvml.nvmlDeviceSetComputeMode(handle, self._exclusive_process)
            except self._nvml.NVMLError as error:
                if state is None:
                    self._state_file(uuid).unlink(missing_ok=True)
                raise ClaimError(
                    claim=share.claim,
                    field="sharing.mps",
                    problem=f"{share.device}: cannot set compute mode EXCLUSIVE_PROCESS: {error}",
                ) from error
        elif state is None:
            self._write_state(uuid, share.device, None)
        pid = self._running_pid(uuid)
        if pid is not None:
            log.info("mps daemon adopted", extra={"device": share.device, "gpu_uuid": uuid, "pid": pid})
        else:
            try:
                pid = self._launch(uuid)
            except _DaemonError as error:  # nothing half-done: no daemon, so the old mode again
                self._restore_mode(uuid, share.device, previous)
                self._state_file(uuid).unlink(missing_ok=True)
                raise ClaimError(
                    claim=share.claim, field="sharing.mps", problem=f"{share.device}: {error}"
                ) from error
            log.info("mps daemon started", extra={"device": share.device, "gpu_uuid": uuid, "pid": pid})
        return _Daemon(gpu_uuid=uuid, device=share.device, pid=pid, previous_mode=previous)

    def _stop_gpu(self, daemon: _Daemon) -> None:
        uuid = daemon.gpu_uuid
        pid = daemon.pid if daemon.pid is not None else self._running_pid(uuid)
        if pid is not None and self._is_running(pid):
            self._quit(uuid, pid)
        (self.pipe_dir(uuid) / PID_FILE).unlink(missing_ok=True)
        self._restore_mode(uuid, daemon.device, daemon.previous_mode)
        self._state_file(uuid).unlink(missing_ok=True)
        log.info("mps daemon stopped", extra={"device": daemon.device, "gpu_uuid": uuid, "pid": pid})

    @property
    def _exclusive_process(self) -> int:
        return int(getattr(self._nvml, "NVML_COMPUTEMODE_EXCLUSIVE_PROCESS", EXCLUSIVE_PROCESS))

    def _restore_mode(self, uuid: str, device: str, previous: int | None) -> None:
        if self._nvml is None or previous is None or previous == self._exclusive_process:
            return
        try:
            handle = self._nvml.nvmlDeviceGetHandleByUUID(uuid)
            self._nvml.nvmlDeviceSetComputeMode(handle, previous)
        except self._nvml.NVMLError as error:
            log.error(
                "compute mode not restored", extra={"device": device, "mode": previous, "error": str(error)}
            )

    def _binary(self) -> str:
        return shutil.which(self._control) or self._control

    def _launch(self, uuid: str) -> int:
        """Run ``<control> -d``; return the daemon's pid once its pid file names a live process."""
        pid_file = self.pipe_dir(uuid) / PID_FILE
        pid_file.unlink(missing_ok=True)  # a killed daemon leaves it behind
        launcher_log = self.log_dir(uuid) / "launcher.log"
        try:
            with open(launcher_log, "ab") as output:
                launcher = subprocess.Popen(
                    [self._binary(), "-d"],
                    env=self.daemon_environment(uuid),
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # the agent's signals are not the daemon's
                    close_fds=True,
                )
        except OSError as error:
            raise _DaemonError(f"cannot run {self._control}: {error}") from error
        try:
            status = launcher.wait(timeout=self._start_timeout)
        except subprocess.TimeoutExpired as error:
            launcher.kill()
            launcher.wait()
            raise _DaemonError(f"{self._control} -d did not return within {self._start_timeout} s") from error
        if status != 0:
            raise _DaemonError(f"{self._control} -d exited with status {status} (see {launcher_log})")
        pid = self._wait_for(lambda: self._running_pid(uuid), self._start_timeout)
        if pid is None:
            raise _DaemonError(f"no running daemon in {pid_file} after {self._start_timeout} s")
        return pid

    def _quit(self, uuid: str, pid: int) -> None:
        try:
            subprocess.run(
                [self._binary()],
                input=b"quit\n",
                env=self.daemon_environment(uuid),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=self._stop_timeout,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            log.warning("mps quit failed", extra={"gpu_uuid": uuid, "error": str(error)})
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                log.warning(
                    "mps daemon did not quit, signalling", extra={"gpu_uuid": uuid, "signal": int(sig)}
                )
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    return
            if self._wait_for(lambda: None if self._is_running(pid) else True, self._stop_timeout):
                return

    def _wait_for(self, probe: Callable[[], _T | None], timeout: float) -> _T | None:
        deadline = time.monotonic() + timeout
        while True:
            value = probe()
            if value or time.monotonic() >= deadline:
                return value
            self._pause.wait(0.02)

    def _running_pid(self, uuid: str) -> int | None:
        """The pid in the pipe directory's pid file, if it is a live control daemon."""
        try:
            pid = int((self.pipe_dir(uuid) / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if pid > 0 and self._is_running(pid) and self._is_control(pid) else None

    def _is_running(self, pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:  # a zombie answers kill(0) until its parent reaps it
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        return stat.rpartition(")")[2].split()[:1] not in (["Z"], ["X"])

    def _is_control(self, pid: int) -> bool:
        """Guards against pid reuse: the process runs our control binary."""
        try:
            arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return True  # no /proc: trust the pid file
        name = os.path.basename(self._control).encode()
        return any(os.path.basename(argument) == name for argument in arguments)

    def _state_file(self, uuid: str) -> Path:
        return self.gpu_dir(uuid) / "state.json"

    def _read_state(self, uuid: str) -> dict[str, Any] | None:
        try:
            data = json.loads(self._state_file(uuid).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            log.warning("mps state file unreadable", extra={"gpu_uuid": uuid, "error": str(error)})
            return None
        return data if isinstance(data, dict) else None

    def _write_state(self, uuid: str, device: str, previous: int | None) -> None:
        path = self._state_file(uuid)
        temporary = path.with_name(path.name + ".tmp")
        with open(temporary, "w") as handle:
            json.dump({"version": 1, "device": device, "previousComputeMode": previous}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)

    # -- supervisor ----------------------------------------------------------------------------

    def _ensure_supervisor(self) -> None:
        if self._supervisor is None or not self._supervisor.is_alive():
            self._supervisor = threading.Thread(target=self._supervise, name="mps-supervisor", daemon=True)
            self._supervisor.start()

    def _supervise(self) -> None:
        while not self._stop.wait(self._supervise_seconds):
            try:
                self._restart_dead_daemons()
            except Exception:  # a bug here must not end supervision of the other GPUs
                log.exception("mps supervision failed")

    def _restart_dead_daemons(self) -> None:
        with self._lock:
            for daemon in self._daemons.values():
                if self._stop.is_set():
                    return
                if daemon.pid is not None and self._is_running(daemon.pid):
                    continue
                now = self._clock()
                if now < daemon.next_start:
                    continue
                log.warning("mps daemon died, restarting", extra={"device": daemon.device, "pid": daemon.pid})
                try:
                    daemon.pid = self._launch(daemon.gpu_uuid)
                except _DaemonError as error:
                    daemon.pid = None
                    daemon.failures += 1
                    delay = min(self._max_backoff, self._supervise_seconds * 2 ** (daemon.failures - 1))
                    daemon.next_start = now + delay
                    log.error(
                        "mps daemon restart failed",
                        extra={
                            "device": daemon.device,
                            "attempt": daemon.failures,
                            "retry_in_s": delay,
                            "error": str(error),
                        },
                    )
                    continue
                daemon.failures = 0
                daemon.restarts += 1
                log.info("mps daemon restarted", extra={"device": daemon.device, "pid": daemon.pid})


def _optional_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None

"""``mps``: classic CUDA MPS, one control daemon per shared GPU, run and watched by the node agent.

Per GPU that has at least one (non-whole) share:

1. through NVML (when given) the compute mode is set to EXCLUSIVE_PROCESS; the previous mode is
   first recorded in ``<plugin dir>/mps/<uuid>/state.json`` (so a crashed agent still restores it);
2. ``nvidia-cuda-mps-control -d`` starts with ``CUDA_VISIBLE_DEVICES=<uuid>``,
   ``CUDA_MPS_PIPE_DIRECTORY=<plugin dir>/mps/<uuid>/pipe`` and
   ``CUDA_MPS_LOG_DIRECTORY=<plugin dir>/mps/<uuid>/log``. ``-d`` forks: the launcher exits once
   the daemon listens, and the daemon's pid is read from ``<pipe>/nvidia-cuda-mps-control.pid``,
   checked (below) and recorded with its start time in the state file;
3. a supervisor thread (``mps-supervisor``) restarts a daemon that died, with backoff;
4. when the GPU's last share is released (or on ``close()``): ``echo quit |
   nvidia-cuda-mps-control`` with the same environment, wait, SIGTERM, SIGKILL; then the previous
   compute mode is restored and the state file removed.

Shares are reference-counted per GPU by ``(claim UID, device, shareID)``; ``acquire`` is idempotent.
After an agent restart the core calls ``acquire`` for every checkpointed share: a daemon still
running for that pipe directory is adopted (not restarted) and the recorded previous mode reused;
``stop_unused_daemons()`` then stops daemons that no prepared share needs any more.

Whom to trust. The pipe directory is mounted read-write into every client container, so its pid
file is a hint written by anyone, never a fact: a stale or planted pid there could name another
GPU's daemon (adopted for this GPU, nothing would serve it; releasing this GPU's last share would
kill that one under its running shares). What the agent trusts lives in ``<plugin dir>/mps/<uuid>/``
(``state.json``), which no container sees: the previous compute mode and the daemon's pid with its
start time (``/proc/<pid>/stat`` field 22). A pid is this GPU's daemon only when the process is
alive, runs the control binary (``/proc/<pid>/cmdline``), is in the agent's pid namespace, and its
environment (``/proc/<pid>/environ``) carries this GPU's ``CUDA_VISIBLE_DEVICES`` and pipe
directory; a recorded pid must also have the recorded start time (no pid reuse). The daemon is
adopted, signalled or counted alive only after that check; a pid that fails it is logged and left
alone. Files under ``mps/`` are opened without following links (``driver.plugin.atomic``).

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
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from driver.errors import ClaimError
from driver.plugin.atomic import (
    UnsafeEntryError,
    describe_entry,
    open_append,
    open_directory,
    read_regular_file,
    remove_entry,
    write_atomically,
)
from driver.plugin.sharing.base import ContainerEdits, Mount, ShareSpec

__all__ = ["MpsBackend", "MpsDaemonStatus", "PIPE_DIRECTORY_IN_CONTAINER"]

log = logging.getLogger(__name__)

MIB = 1024 * 1024
PIPE_DIRECTORY_IN_CONTAINER = "/tmp/nvidia-mps"
PID_FILE = "nvidia-cuda-mps-control.pid"
DAEMON_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
EXCLUSIVE_PROCESS = 3  # NVML_COMPUTEMODE_EXCLUSIVE_PROCESS (the module's own constant wins)
PROC_ROOT = Path("/proc")
MAX_PID_FILE_BYTES = 64
MAX_STATE_FILE_BYTES = 64 * 1024
PIPE_DIRECTORY_MODE = 0o755  # clients (any user) reach the daemon's sockets in it

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
    start_time: int | None = None  # of ``pid`` (/proc/<pid>/stat field 22), checked before trusting it
    shares: set[_ShareKey] = field(default_factory=set)
    failures: int = 0
    restarts: int = 0
    next_start: float = 0.0


@dataclass(frozen=True, slots=True)
class _Identity:
    """A process checked to be one GPU's control daemon."""

    pid: int
    start_time: int


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
        self._plugin_dir = Path(plugin_dir)
        self._root = self._plugin_dir / "mps"
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
            elif not self._alive(daemon):
                try:
                    self._relaunch(daemon)
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
            for uuid in self._gpu_directories():
                if uuid in self._daemons:
                    continue
                state = self._read_state(uuid)
                identity = self._find_daemon(uuid, state)
                if identity is None and state is None:
                    continue
                leftover = _Daemon(
                    gpu_uuid=uuid,
                    device=str((state or {}).get("device", uuid)),
                    pid=identity.pid if identity else None,
                    previous_mode=_optional_int((state or {}).get("previousComputeMode")),
                    start_time=identity.start_time if identity else None,
                )
                self._stop_gpu(leftover)
                cleaned.append(uuid)
        return tuple(cleaned)

    def _gpu_directories(self) -> list[str]:
        """The names of the real directories in ``mps/`` (a planted symlink is logged, skipped)."""
        try:
            with open_directory(self._plugin_dir, self._root.name) as root:
                names = sorted(os.listdir(root))
                found = []
                for name in names:
                    mode = os.lstat(name, dir_fd=root).st_mode
                    if stat.S_ISDIR(mode):
                        found.append(name)
                    elif stat.S_ISLNK(mode):
                        log.warning(
                            "planted entry in the mps directory ignored",
                            extra={"path": str(self._root / name), "entry": describe_entry(mode)},
                        )
                return found
        except FileNotFoundError:
            return []
        except UnsafeEntryError as error:
            log.warning("mps directory not used: a planted entry", extra={"reason": str(error)})
            return []

    # -- internals (called with _lock held) --------------------------------------------------

    def _start_gpu(self, share: ShareSpec) -> _Daemon:
        uuid = share.gpu_uuid
        try:
            for leaf, mode in (("pipe", PIPE_DIRECTORY_MODE), ("log", 0o755)):
                with open_directory(self._plugin_dir, self._root.name, uuid, leaf, create=True, mode=mode):
                    pass
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
        daemon = _Daemon(gpu_uuid=uuid, device=share.device, pid=None, previous_mode=previous)
        identity = self._find_daemon(uuid, state)
        if identity is not None:
            daemon.pid, daemon.start_time = identity.pid, identity.start_time
            self._record_daemon(daemon)
            log.info(
                "mps daemon adopted", extra={"device": share.device, "gpu_uuid": uuid, "pid": identity.pid}
            )
        else:
            try:
                self._relaunch(daemon)
            except _DaemonError as error:  # nothing half-done: no daemon, so the old mode again
                self._restore_mode(uuid, share.device, previous)
                self._state_file(uuid).unlink(missing_ok=True)
                raise ClaimError(
                    claim=share.claim, field="sharing.mps", problem=f"{share.device}: {error}"
                ) from error
            log.info(
                "mps daemon started", extra={"device": share.device, "gpu_uuid": uuid, "pid": daemon.pid}
            )
        return daemon

    def _relaunch(self, daemon: _Daemon) -> None:
        """Start the GPU's daemon and record who it is (the trusted record, outside the pipe dir)."""
        identity = self._launch(daemon.gpu_uuid)
        daemon.pid, daemon.start_time = identity.pid, identity.start_time
        self._record_daemon(daemon)

    def _stop_gpu(self, daemon: _Daemon) -> None:
        uuid = daemon.gpu_uuid
        pid = daemon.pid
        if pid is not None and daemon.start_time is not None:
            self._quit(uuid, _Identity(pid=pid, start_time=daemon.start_time))
        try:
            remove_entry(self.pipe_dir(uuid) / PID_FILE)
        except OSError as error:
            log.warning("mps pid file not removed", extra={"gpu_uuid": uuid, "error": str(error)})
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

    def _launch(self, uuid: str) -> _Identity:
        """Run ``<control> -d``; return the daemon once its pid file names this GPU's daemon."""
        pid_file = self.pipe_dir(uuid) / PID_FILE
        launcher_log = self.log_dir(uuid) / "launcher.log"
        try:
            remove_entry(pid_file)  # a killed daemon leaves it behind (or anyone put something there)
            with os.fdopen(open_append(launcher_log), "ab") as output:
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
        identity = self._wait_for(lambda: self._pid_file_daemon(uuid)[0], self._start_timeout)
        if identity is None:
            _, rejected = self._pid_file_daemon(uuid)
            raise _DaemonError(
                f"no running daemon in {pid_file} after {self._start_timeout} s"
                + (f" ({rejected})" if rejected else "")
            )
        return identity

    def _quit(self, uuid: str, daemon: _Identity) -> None:
        """``quit`` through the pipe directory, then SIGTERM, SIGKILL: each signal only after the
        pid is checked to be the daemon recorded (never a process that took its pid since)."""
        pid = daemon.pid
        problem = self._check_daemon(uuid, pid, daemon.start_time)
        if problem is not None:  # gone already, or the pid is another process's now
            if self._is_running(pid):
                log.warning(
                    "mps daemon not signalled: not the recorded daemon",
                    extra={"gpu_uuid": uuid, "pid": pid, "reason": problem},
                )
            return
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
                problem = self._check_daemon(uuid, pid, daemon.start_time)
                if problem is not None:
                    if self._is_running(pid):
                        log.warning(
                            "mps daemon not signalled: not the recorded daemon",
                            extra={"gpu_uuid": uuid, "pid": pid, "reason": problem},
                        )
                    return
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

    # -- who the daemon is (module docstring: "Whom to trust") ----------------------------------

    def _alive(self, daemon: _Daemon) -> bool:
        """The daemon recorded for this GPU still runs (its pid was not taken by another process)."""
        if daemon.pid is None or daemon.start_time is None:
            return False
        return self._check_daemon(daemon.gpu_uuid, daemon.pid, daemon.start_time) is None

    def _find_daemon(self, uuid: str, state: dict[str, Any] | None) -> _Identity | None:
        """This GPU's running daemon: the one the state file records, else (an agent without that
        record, or the daemon restarted meanwhile) the pid file's, checked; None when neither."""
        recorded = (state or {}).get("daemon")
        if isinstance(recorded, dict):
            pid, start_time = _optional_int(recorded.get("pid")), _optional_int(recorded.get("startTime"))
            if (
                pid is not None
                and start_time is not None
                and pid > 0
                and self._check_daemon(uuid, pid, start_time) is None
            ):
                return _Identity(pid=pid, start_time=start_time)
        identity, rejected = self._pid_file_daemon(uuid)
        if rejected is not None:
            log.warning(
                "mps pid file ignored: not this GPU's daemon",
                extra={"gpu_uuid": uuid, "path": str(self.pipe_dir(uuid) / PID_FILE), "reason": rejected},
            )
        return identity

    def _pid_file_daemon(self, uuid: str) -> tuple[_Identity | None, str | None]:
        """The daemon the pipe directory's pid file names, if it passes the check; else why not
        (None: no pid file, or it names no live process)."""
        path = self.pipe_dir(uuid) / PID_FILE
        try:
            text = read_regular_file(path, max_bytes=MAX_PID_FILE_BYTES).decode().strip()
        except FileNotFoundError:
            return None, None
        except UnsafeEntryError as error:
            return None, error.problem
        except (OSError, UnicodeDecodeError) as error:
            return None, f"unreadable: {error}"
        try:
            pid = int(text)
        except ValueError:
            return None, f"{text[:20]!r} is not a pid"
        if pid <= 0:
            return None, f"{pid} is not a pid"
        if not self._is_running(pid):
            return None, None  # stale: the daemon that wrote it is gone
        start_time = _start_time(pid)
        problem = self._check_daemon(uuid, pid, start_time)
        if problem is not None or start_time is None:
            return None, f"pid {pid} {problem or 'has no start time'}"
        return _Identity(pid=pid, start_time=start_time), None

    def _check_daemon(self, uuid: str, pid: int, start_time: int | None) -> str | None:
        """None when ``pid`` is this GPU's control daemon (and, with ``start_time``, the very
        process recorded); else what is wrong, in words."""
        if not self._is_running(pid):
            return "is not running"
        process = PROC_ROOT / str(pid)
        try:
            found_start = _start_time(pid)
            arguments = (process / "cmdline").read_bytes().split(b"\0")
            environment = _parse_environ((process / "environ").read_bytes())
            namespace = os.readlink(process / "ns" / "pid")
            own_namespace = os.readlink(PROC_ROOT / "self" / "ns" / "pid")
        except OSError as error:
            return f"cannot be checked: {error.strerror or error}"
        if start_time is not None and found_start != start_time:
            return f"started at tick {found_start}, the recorded daemon at {start_time} (pid reused)"
        name = os.path.basename(self._control).encode()
        if not any(os.path.basename(argument) == name for argument in arguments):
            command = b" ".join(arguments).decode(errors="replace")[:100]
            return f"runs {command!r}, not {self._control}"
        if namespace != own_namespace:
            return "is in another pid namespace than the agent"
        expected = {"CUDA_VISIBLE_DEVICES": uuid, "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir(uuid))}
        for variable, value in expected.items():
            if environment.get(variable) != value:
                return f"serves {variable}={environment.get(variable)!r}, not {value!r}"
        return None

    def _is_running(self, pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:  # a zombie answers kill(0) until its parent reaps it
            fields = _stat_fields(pid)
        except OSError:
            return True
        return fields[:1] not in (["Z"], ["X"])

    # -- the state file (the agent's own; no container sees it) ------------------------------------

    def _state_file(self, uuid: str) -> Path:
        return self.gpu_dir(uuid) / "state.json"

    def _read_state(self, uuid: str) -> dict[str, Any] | None:
        try:
            data = json.loads(read_regular_file(self._state_file(uuid), max_bytes=MAX_STATE_FILE_BYTES))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            log.warning("mps state file unreadable", extra={"gpu_uuid": uuid, "error": str(error)})
            return None
        return data if isinstance(data, dict) else None

    def _write_state(
        self, uuid: str, device: str, previous: int | None, daemon: _Identity | None = None
    ) -> None:
        state: dict[str, Any] = {"version": 1, "device": device, "previousComputeMode": previous}
        if daemon is not None:
            state["daemon"] = {"pid": daemon.pid, "startTime": daemon.start_time}
        write_atomically(self._state_file(uuid), json.dumps(state).encode(), fsync_directory=False)

    def _record_daemon(self, daemon: _Daemon) -> None:
        assert daemon.pid is not None and daemon.start_time is not None
        identity = _Identity(pid=daemon.pid, start_time=daemon.start_time)
        self._write_state(daemon.gpu_uuid, daemon.device, daemon.previous_mode, identity)

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
                if self._alive(daemon):
                    continue
                now = self._clock()
                if now < daemon.next_start:
                    continue
                log.warning("mps daemon died, restarting", extra={"device": daemon.device, "pid": daemon.pid})
                try:
                    self._relaunch(daemon)
                except _DaemonError as error:
                    daemon.pid = daemon.start_time = None
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


def _stat_fields(pid: int) -> list[str]:
    """``/proc/<pid>/stat`` after the command name: [state, ppid, ...] (field 3 onwards)."""
    return (PROC_ROOT / str(pid) / "stat").read_text().rpartition(")")[2].split()


def _start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks after boot (field 22); None when it is gone."""
    try:
        return int(_stat_fields(pid)[19])
    except (OSError, IndexError, ValueError):
        return None


def _parse_environ(data: bytes) -> dict[str, str]:
    environment = {}
    for entry in data.split(b"\0"):
        name, separator, value = entry.partition(b"=")
        if separator:
            environment[name.decode(errors="replace")] = value.decode(errors="replace")
    return environment

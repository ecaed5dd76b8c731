"""Processes the local cluster starts, recorded in a state file so another process can stop them.

Each process runs in its own session (a signal to the cluster never reaches the caller's shell),
writes to its own log file, and is recorded with its start time (a recycled pid is never killed).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["Process", "Processes", "mount_namespace_members", "process_start_time"]


def process_start_time(pid: int) -> str | None:
    """Its start time, or None when there is no such process or only its zombie is left (killed,
    not yet reaped by a parent that is not ours)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the comm in parentheses: field 3 on
    if fields[0] == "Z":
        return None
    return fields[19]  # field 22: starttime


@dataclass(frozen=True, slots=True)
class Process:
    name: str
    pid: int
    start_time: str
    log: str
    # How it was started, so that ``Processes.restart`` starts it again in place (the same flags,
    # environment and, for a node's kubelet or containerd, the same mount namespace).
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    cwd: str | None = None

    def alive(self) -> bool:
        return process_start_time(self.pid) == self.start_time


def mount_namespace_members(inode: str) -> list[int]:
    """Every process whose mount namespace is ``inode`` (``mnt:[N]``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "mnt") == inode:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


class Processes:
    """The processes of one cluster, in start order, persisted in ``state_file``."""

    def __init__(self, state_file: Path, log_dir: Path) -> None:
        self.state_file = state_file
        self.log_dir = log_dir
        self.entries: list[Process] = []
        self.extra: dict[str, object] = {}
        self._children: dict[int, subprocess.Popen[bytes]] = {}  # the ones this instance started
        if state_file.exists():
            data = json.loads(state_file.read_text(encoding="utf-8"))
            self.entries = [Process(**entry) for entry in data.get("processes", [])]
            self.extra = data.get("extra", {})

    def save(self) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        data = {"processes": [asdict(p) for p in self.entries], "extra": self.extra}
        temporary = self.state_file.with_suffix(".tmp")
        temporary.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        temporary.replace(self.state_file)

    def start(
        self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> Process:
        process = self._spawn(name, list(argv), env, str(cwd) if cwd is not None else None)
        self.entries.append(process)
        self.save()
        return process

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None, cwd: str | None) -> Process:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        with log.open("ab") as out:
            child = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=env, cwd=cwd, start_new_session=True,
            )  # fmt: skip
        start_time = None
        for _ in range(100):
            start_time = process_start_time(child.pid)
            if start_time is not None:
                break
            time.sleep(0.01)
        self._children[child.pid] = child
        return Process(name, child.pid, start_time or "", str(log), argv, env, cwd)

    def restart(
        self,
        name: str,
        *,
        down_seconds: float = 0.0,
        signum: int = signal.SIGKILL,
        argv: Sequence[str] | None = None,
    ) -> Process:
        """Stop ``name`` with ``signum`` (SIGKILL: a crash, no grace), leave it down for
        ``down_seconds``, then start it again exactly as it was started (or with ``argv``, its
        environment and directory kept), in its place in the start order. Its log goes on in the
        same file."""
        index = next((i for i, p in enumerate(self.entries) if p.name == name), None)
        if index is None:
            raise KeyError(name)
        process = self.entries[index]
        if not process.argv:
            raise ValueError(f"{name}: started without its command line recorded; bring the cluster up again")
        self._end(process, signum, grace_seconds=10.0)
        time.sleep(down_seconds)
        again = self._spawn(name, list(argv) if argv is not None else process.argv, process.env, process.cwd)
        self.entries[index] = again
        self.save()
        return again

    def get(self, name: str) -> Process | None:
        return next((p for p in self.entries if p.name == name), None)

    def stop(self, process: Process, *, grace_seconds: float = 10.0) -> None:
        self._end(process, signal.SIGTERM, grace_seconds=grace_seconds)
        self.entries = [p for p in self.entries if p is not process and p.pid != process.pid]
        self.save()

    def _end(self, process: Process, signum: int, *, grace_seconds: float) -> None:
        """Send ``signum``, wait up to ``grace_seconds`` for it to go, then SIGKILL; reap it when it
        is our own child (not left a zombie that looks alive)."""
        if process.alive():
            _signal(process.pid, signum)
            deadline = time.monotonic() + grace_seconds
            own = self._children.get(process.pid)
            while process.alive() and time.monotonic() < deadline:
                if own is not None and own.poll() is not None:
                    break  # our own child exited: reaped now
                time.sleep(0.05)
            if process.alive():
                _signal(process.pid, signal.SIGKILL)
        child = self._children.pop(process.pid, None)
        if child is not None:  # our own child: reap it
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=1)


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)

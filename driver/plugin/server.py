"""The one gRPC server factory and the unix-socket hygiene of the node agent.

Sockets (``listen_unix``): the server binds a hidden name in the same directory
(``.<name>.<random>``; the kubelet's plugin watcher ignores names starting with ``.``), the file
gets mode 0600 (0660 with ``--socket-group``), and only then is it renamed onto its real name: it
appears complete, with its final mode, and the rename replaces a stale socket a crashed agent left
(or a symlink planted there; a regular file or directory is refused). The device and inode bound
are recorded; ``remove_socket`` unlinks the path only while it still is that inode. So when two
agents use the same names (no pod UID: an old pod still stopping while the new one starts), the
old one never removes the new one's sockets: gRPC itself unlinks the path it bound when the
server stops, which is the hidden name, gone since the rename.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from driver.errors import ConfigError

__all__ = ["MAX_SOCKET_PATH_BYTES", "UnixSocket", "build_grpc_server", "listen_unix", "remove_socket"]

log = logging.getLogger(__name__)

MAX_SOCKET_PATH_BYTES = 107  # sun_path is 108 bytes including the terminating NUL
_TEMPORARY_SUFFIX_HEX = 3  # ".<name>.<6 hex>": the hidden name is 8 bytes longer than the real one
_TEMPORARY_EXTRA_BYTES = 2 + 2 * _TEMPORARY_SUFFIX_HEX
RPCS_PER_WORKER = 8

# Channel arguments, each for a reason:
_SERVER_OPTIONS = (
    # The kubelet and our own probes reconnect freely; keepalive pings from them are fine.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # Requests carry a few claim references; anything near 4 MiB is not a kubelet.
    ("grpc.max_receive_message_length", 4 * 1024 * 1024),
)


def build_grpc_server(*, max_workers: int, maximum_concurrent_rpcs: int | None = None) -> grpc.Server:
    """A thread-pool server: ``max_workers`` threads named ``grpc_*``.

    ``maximum_concurrent_rpcs`` (default ``8 * max_workers``) bounds queued plus running RPCs; beyond
    it callers get RESOURCE_EXHAUSTED and retry (the kubelet does) instead of piling up memory. A
    health stream holds a worker for its whole life, so ``max_workers`` must leave room for Prepare.
    """
    executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc")
    return grpc.server(
        executor,
        options=_SERVER_OPTIONS,
        maximum_concurrent_rpcs=maximum_concurrent_rpcs or RPCS_PER_WORKER * max_workers,
    )


@dataclass(frozen=True, slots=True)
class UnixSocket:
    """A socket file this process bound: its path and the (device, inode) it had then."""

    path: Path
    device: int
    inode: int


def _check_socket_path(path: Path, flag: str) -> None:
    if not path.is_absolute():
        raise ConfigError(field=flag, problem=f"socket path {path} is not absolute")
    limit = MAX_SOCKET_PATH_BYTES - _TEMPORARY_EXTRA_BYTES
    if len(os.fsencode(path)) > limit:
        raise ConfigError(
            field=flag,
            problem=f"socket path {path} is longer than {limit} bytes ({MAX_SOCKET_PATH_BYTES} for "
            f"the hidden name it is bound under first, {_TEMPORARY_EXTRA_BYTES} bytes longer)",
        )


def _check_replaceable(path: Path) -> bool:
    """True when a stale socket (or a planted symlink) is at ``path``; ``ConfigError`` for a file
    or directory there (an operator's mistake, never removed)."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return False
    if not (stat.S_ISSOCK(mode) or stat.S_ISLNK(mode)):
        raise ConfigError(field=str(path), problem="exists and is not a unix socket; refusing to replace it")
    return True


def _secure(path: Path, *, group: int | None) -> os.stat_result:
    """0600, or 0660 owned by ``group`` (``--socket-group``), on the socket bound at ``path``
    itself (an ``O_PATH | O_NOFOLLOW`` descriptor: a link put there meanwhile is not followed)."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        found = os.fstat(fd)
        if not stat.S_ISSOCK(found.st_mode):
            raise ConfigError(field=str(path), problem="the socket just bound is no socket any more")
        handle = f"/proc/self/fd/{fd}"  # chmod/chown of an O_PATH descriptor go through /proc
        if group is not None:
            os.chown(handle, -1, group)
        os.chmod(handle, 0o600 if group is None else 0o660)
        return found
    finally:
        os.close(fd)


def listen_unix(server: grpc.Server, path: Path, *, flag: str, group: int | None = None) -> UnixSocket:
    """Make ``server`` listen on ``path`` (before ``start``: connections wait in the backlog): bind
    a hidden name, set the mode, rename it onto ``path``. Returns what ``remove_socket`` needs."""
    _check_socket_path(path, flag)
    path.parent.mkdir(parents=True, exist_ok=True)
    stale = _check_replaceable(path)
    hidden = path.with_name(f".{path.name}.{secrets.token_hex(_TEMPORARY_SUFFIX_HEX)}")
    try:
        server.add_insecure_port(f"unix://{hidden}")
    except RuntimeError as error:
        raise ConfigError(field=flag, problem=f"cannot listen on {path}: {error}") from error
    try:
        bound = _secure(hidden, group=group)
        _check_replaceable(path)  # still nothing of an operator's there
        os.rename(hidden, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            hidden.unlink()
        raise
    if stale:
        log.info("stale socket replaced", extra={"path": str(path)})
    return UnixSocket(path=path, device=bound.st_dev, inode=bound.st_ino)


def remove_socket(socket: UnixSocket) -> bool:
    """Unlink ``socket.path`` if it still is the socket this process bound; True if removed. A
    socket another agent has bound there since is left alone (logged)."""
    try:
        found = socket.path.lstat()
    except FileNotFoundError:
        return False
    if (found.st_dev, found.st_ino) != (socket.device, socket.inode):
        log.info("socket belongs to another process now, left in place", extra={"path": str(socket.path)})
        return False
    with contextlib.suppress(FileNotFoundError):
        socket.path.unlink()
    return True

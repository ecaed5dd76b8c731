"""The one gRPC server factory and the unix-socket hygiene of the node agent.

Sockets: a stale file is removed before listening (a crashed agent leaves one behind); after
listening the file gets mode 0600, or 0660 with ``--socket-group``; closing the server and
``remove_socket`` delete it, so the kubelet deregisters the plugin.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from driver.errors import ConfigError

__all__ = ["MAX_SOCKET_PATH_BYTES", "build_grpc_server", "listen_unix", "remove_socket"]

log = logging.getLogger(__name__)

MAX_SOCKET_PATH_BYTES = 107  # sun_path is 108 bytes including the terminating NUL
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


def _check_socket_path(path: Path, flag: str) -> None:
    if not path.is_absolute():
        raise ConfigError(field=flag, problem=f"socket path {path} is not absolute")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise ConfigError(
            field=flag, problem=f"socket path {path} is longer than {MAX_SOCKET_PATH_BYTES} bytes"
        )


def remove_socket(path: Path) -> bool:
    """Unlink a socket file (stale or ours); True if something was removed. Refuses other file types."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(mode):
        raise ConfigError(field=str(path), problem="exists and is not a unix socket; refusing to remove it")
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return True


def listen_unix(server: grpc.Server, path: Path, *, flag: str) -> None:
    """Remove a stale socket at ``path`` and make ``server`` listen there (before ``start``)."""
    _check_socket_path(path, flag)
    path.parent.mkdir(parents=True, exist_ok=True)
    if remove_socket(path):
        log.info("stale socket removed", extra={"path": str(path)})
    try:
        server.add_insecure_port(f"unix://{path}")
    except RuntimeError as error:
        raise ConfigError(field=flag, problem=f"cannot listen on {path}: {error}") from error


def secure_socket(path: Path, *, group: int | None) -> None:
    """0600, or 0660 owned by ``group`` (``--socket-group``)."""
    if group is None:
        os.chmod(path, 0o600)
        return
    os.chown(path, -1, group)
    os.chmod(path, 0o660)

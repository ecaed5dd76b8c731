"""Sockets: an agent removes only the sockets it bound, and never follows what was planted there."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

from driver.cluster.kubelet import KubeletSimulator
from driver.plugin.agent import NodeAgent
from driver.plugin.server import build_grpc_server, listen_unix, remove_socket
from tests.plugin.conftest import NodeDirs

StartAgent = Callable[..., NodeAgent]


def test_an_old_agent_stopping_leaves_the_sockets_of_the_agent_that_replaced_it(
    start_agent: StartAgent, node_dirs: NodeDirs
) -> None:
    old = start_agent()  # no pod UID: both agents use the same socket names
    new = start_agent()
    bound = {path: path.lstat().st_ino for path in (new.paths.registration, new.paths.dra)}
    old.stop(grace=0)
    for path, inode in bound.items():
        assert stat.S_ISSOCK(path.lstat().st_mode) and path.lstat().st_ino == inode, path
    kubelet = KubeletSimulator(node_dirs.registry)
    try:
        assert kubelet.register(timeout=10).service == "v1.DRAPlugin"
        assert kubelet.prepare([]) == {}
    finally:
        kubelet.close()
    new.stop(grace=0)
    assert not new.paths.registration.exists() and not new.paths.dra.exists()


def test_remove_socket_leaves_a_socket_another_server_bound_there(short_dir: Path) -> None:
    path = short_dir / "x.sock"
    first, second = build_grpc_server(max_workers=1), build_grpc_server(max_workers=1)
    first_socket = listen_unix(first, path, flag="test")
    first.start()
    second_socket = listen_unix(second, path, flag="test")
    second.start()
    try:
        first.stop(0).wait()
        assert remove_socket(first_socket) is False
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))  # still the second server's
        assert remove_socket(second_socket) is True
        assert not path.exists()
    finally:
        second.stop(0).wait()
    assert sorted(os.listdir(short_dir)) == []  # no hidden name left behind either


def test_a_symlink_where_the_socket_goes_is_replaced_and_its_target_untouched(short_dir: Path) -> None:
    target = short_dir / "target"
    target.write_text("not yours\n")
    target.chmod(0o644)
    path = short_dir / "dra.sock"
    path.symlink_to(target)
    server = build_grpc_server(max_workers=1)
    try:
        listen_unix(server, path, flag="test")
        assert stat.S_ISSOCK(path.lstat().st_mode)
        assert stat.S_IMODE(path.lstat().st_mode) == 0o600
        assert target.read_text() == "not yours\n" and stat.S_IMODE(target.stat().st_mode) == 0o644
    finally:
        server.stop(0).wait()

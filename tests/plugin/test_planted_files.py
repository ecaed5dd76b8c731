"""Entries planted in the agent's directories (CDI root, plugin dir, ``mps/``, ``hami/``) are never
followed: a FIFO never blocks, a symlink never leads the agent to read, create, chmod or delete
anything outside. Each test plants what an attacker (or a tenant, where the directory is mounted
into containers) could, and checks what lies outside is untouched."""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from driver.inventory.model import NodeInventory
from driver.plugin import cdi
from driver.plugin.agent import NodeAgent
from driver.plugin.atomic import open_lock_file
from driver.plugin.sharing import HamiBackend, ShareSpec
from driver.plugin.state import recover_claims_from_cdi
from tests.plugin.conftest import Claims, NodeDirs, new_share_id, result
from tests.plugin.test_sharing_mps import GPU_A, FakeControl, control, make_backend, share

__all__ = ["control"]  # a fixture, imported for pytest

StartAgent = Callable[..., NodeAgent]
UID = "0b4f7c2e-5d1a-4e6b-9c3d-2a1f0e9d8c7b"
GIB = 1024**3


def spec_name(cdi_class: str, claim_uid: str) -> str:
    return f"k8s.fractional.dev-{cdi_class}_{claim_uid}.json"


# -- CDI root --------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_fifo_named_like_a_cdi_spec_is_not_read(
    tmp_path: Path, inventory: NodeInventory, caplog: pytest.LogCaptureFixture
) -> None:
    os.mkfifo(tmp_path / spec_name("gpu", UID))  # opening it for reading would block for ever
    with caplog.at_level(logging.WARNING, logger="driver.plugin.state"):
        assert recover_claims_from_cdi(tmp_path, inventory, pool="node-a", boot_id="b") == {}
    [skipped] = [r for r in caplog.records if r.getMessage() == "CDI spec not understood, not recovered"]
    assert "FIFO" in skipped.__dict__["reason"]


@pytest.mark.timeout(60)
def test_a_fifo_named_like_a_cdi_spec_does_not_hang_start_up(
    start_agent: StartAgent, node_dirs: NodeDirs
) -> None:
    node_dirs.cdi.mkdir(parents=True)
    fifo = node_dirs.cdi / spec_name("gpu", UID)
    os.mkfifo(fifo)
    agent = start_agent()
    assert agent.serving.is_set()
    assert not os.path.lexists(fifo)  # planted under our name: removed, never opened


def test_a_spec_replaced_by_a_symlink_is_written_again_at_restart(
    start_agent: StartAgent, node_dirs: NodeDirs, claims: Claims, tmp_path: Path
) -> None:
    from driver.cluster.kubelet import KubeletSimulator

    first = start_agent()
    kubelet = KubeletSimulator(node_dirs.registry)
    try:
        kubelet.register(timeout=10)
        ref = claims.create("c", [result("gpu-0", share_id=new_share_id(), memory="1Gi")])
        assert kubelet.prepare([ref])[ref["uid"]]["error"] == ""
    finally:
        kubelet.close()
    first.stop(grace=0)
    ours = node_dirs.cdi / spec_name("gpu", ref["uid"])
    content = ours.read_bytes()
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"cdiVersion": "0.3.0", "kind": "k8s.fractional.dev/gpu", "devices": []}))
    ours.unlink()
    ours.symlink_to(foreign)

    start_agent()  # the same boot: the claim is restored and its spec ensured
    assert stat.S_ISREG(ours.lstat().st_mode)
    assert ours.read_bytes() == content
    assert json.loads(foreign.read_text())["devices"] == []


def test_ensure_cdi_spec_replaces_a_symlink_and_keeps_our_file(tmp_path: Path) -> None:
    spec = cdi.render_claim_spec("gpu", [(f"{UID}-gpu-0", cdi.parse_container_edits({"env": ["A=1"]}))])
    foreign = tmp_path / "foreign.json"
    foreign.write_text("{}\n")
    root = tmp_path / "cdi"
    root.mkdir()
    path = root / spec_name("gpu", UID)
    path.symlink_to(foreign)
    assert cdi.ensure_cdi_spec(root, "gpu", UID, spec) is True
    assert stat.S_ISREG(path.lstat().st_mode) and json.loads(path.read_text()) == spec
    assert foreign.read_text() == "{}\n"
    assert cdi.ensure_cdi_spec(root, "gpu", UID, spec) is False  # ours: left as it is


# -- the lock file -------------------------------------------------------------------------------


def test_a_symlinked_lock_file_creates_nothing_outside(tmp_path: Path) -> None:
    outside = tmp_path / "outside" / "created-by-the-agent"
    outside.parent.mkdir()
    lock = tmp_path / "plugin" / "serialize.lock"
    lock.parent.mkdir()
    lock.symlink_to(outside)
    fd = open_lock_file(lock)
    os.close(fd)
    assert not os.path.lexists(outside)
    assert stat.S_ISREG(lock.lstat().st_mode) and stat.S_IMODE(lock.lstat().st_mode) == 0o600


# -- HAMi ------------------------------------------------------------------------------------------


def hami_share(claim_uid: str = UID) -> ShareSpec:
    return ShareSpec(
        claim_uid=claim_uid,
        device="gpu-0",
        gpu_uuid=GPU_A,
        ordinal=0,
        share_id="s-1",
        memory_bytes=10 * GIB,
        compute_percent=25,
        whole_gpu=False,
    )


def test_a_symlinked_hami_claims_directory_is_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / UID).mkdir(parents=True)
    (outside / UID / "precious").write_text("keep me\n")
    plugin = tmp_path / "plugin"
    (plugin / "hami").mkdir(parents=True)
    (plugin / "hami" / "claims").symlink_to(outside)
    backend = HamiBackend(plugin_dir=str(plugin))
    backend.acquire(hami_share())
    claims_dir = plugin / "hami" / "claims"
    assert stat.S_ISDIR(claims_dir.lstat().st_mode)  # the link was replaced by a directory
    assert (claims_dir / UID).is_dir()
    backend.release(hami_share())
    assert not (claims_dir / UID).exists()
    assert (outside / UID / "precious").read_text() == "keep me\n"


def test_a_symlink_planted_as_the_hami_claim_directory_is_unlinked_not_its_target(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me\n")
    plugin = tmp_path / "plugin"
    backend = HamiBackend(plugin_dir=str(plugin))
    backend.acquire(hami_share())
    claim_dir = plugin / "hami" / "claims" / UID
    claim_dir.rmdir()
    claim_dir.symlink_to(outside)  # swapped while the claim was prepared
    backend.release(hami_share())
    assert not os.path.lexists(claim_dir)
    assert (outside / "precious").read_text() == "keep me\n"


def test_hami_lock_directory_and_preload_file_symlinks_are_replaced(tmp_path: Path) -> None:
    library = tmp_path / "libvgpu.so"
    library.write_bytes(b"\x7fELF")
    outside_dir = tmp_path / "outside-dir"
    outside_dir.mkdir(mode=0o700)
    outside_dir.chmod(0o700)
    outside_file = tmp_path / "outside-preload"
    outside_file.write_text("/usr/local/vgpu/libvgpu.so\n")  # the very text we would write
    hami = tmp_path / "plugin" / "hami"
    hami.mkdir(parents=True)
    (hami / "vgpulock").symlink_to(outside_dir)
    (hami / "ld.so.preload").symlink_to(outside_file)
    backend = HamiBackend(plugin_dir=str(tmp_path / "plugin"), library=str(library))
    backend.acquire(hami_share())
    assert stat.S_IMODE(outside_dir.stat().st_mode) == 0o700  # not chmod-ed through the link
    assert stat.S_ISDIR((hami / "vgpulock").lstat().st_mode)
    assert stat.S_IMODE((hami / "vgpulock").lstat().st_mode) == 0o777
    assert stat.S_ISREG((hami / "ld.so.preload").lstat().st_mode)  # the runtime mounts our file
    backend.release(hami_share())


# -- MPS -------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_fifo_as_the_mps_pid_file_does_not_hang_acquire(tmp_path: Path, control: FakeControl) -> None:
    pipe = tmp_path / "plugin" / "mps" / GPU_A / "pipe"
    pipe.mkdir(parents=True)
    os.mkfifo(pipe / "nvidia-cuda-mps-control.pid")  # a tenant's, in the directory it mounts
    backend = make_backend(tmp_path, control, None)
    try:
        backend.acquire(share("claim-1"))
        assert backend.daemons()[GPU_A].pid is not None
    finally:
        backend.close()


def test_mps_files_of_the_agent_are_not_written_through_symlinks(
    tmp_path: Path, control: FakeControl
) -> None:
    from tests.plugin.fakes_nvml import FakeNVML

    gpu_dir = tmp_path / "plugin" / "mps" / GPU_A
    (gpu_dir / "log").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (gpu_dir / "state.json.tmp").symlink_to(outside / "state")
    (gpu_dir / "log" / "launcher.log").symlink_to(outside / "launcher.log")
    backend = make_backend(tmp_path, control, FakeNVML([GPU_A]))
    try:
        backend.acquire(share("claim-1"))
        assert sorted(os.listdir(outside)) == []  # nothing created through either link
        assert stat.S_ISREG((gpu_dir / "log" / "launcher.log").lstat().st_mode)
    finally:
        backend.close()

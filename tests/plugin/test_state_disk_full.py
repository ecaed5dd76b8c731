"""``DeviceState`` on a real full disk (a small tmpfs): every checkpoint and CDI write of prepare and
unprepare fails once with ENOSPC; what is left must be what the checkpoint file says, and the retry
once the disk has room must converge (the prepare completes, or the unprepare really releases)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from driver.inventory.model import NodeInventory
from driver.plugin import cdi
from driver.plugin.checkpoint import ClaimPhase, FileWriteError
from driver.plugin.state import DeviceState
from tests.plugin.conftest import new_share_id, result
from tests.plugin.test_state import Env, claim

DISK_BYTES = 256 * 1024
NO_SPACE = r"checkpoint\.json: not written: No space left on device"


@dataclass
class Disk:
    """A tmpfs of ``DISK_BYTES``; ``fill`` takes every free page, ``free`` gives them back."""

    root: Path

    @property
    def filler(self) -> Path:
        return self.root / "filler"

    def fill(self) -> None:
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while True:
                try:
                    os.write(fd, b"\0" * 4096)
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    return
        finally:
            os.close(fd)

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)


def _mount_tmpfs(directory: Path) -> None:
    directory.mkdir()
    mount = shutil.which("mount")
    if mount is None:
        pytest.skip("no mount command")
    done = subprocess.run(
        [mount, "-t", "tmpfs", "-o", f"size={DISK_BYTES},mode=0755", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip()[:200]}")


@dataclass
class Disks:
    """The plugin dir and the CDI root, each on its own small disk (as on a node: /var/lib/kubelet
    and the tmpfs /var/run/cdi)."""

    plugin: Disk
    cdi: Disk

    def fill(self) -> None:
        self.plugin.fill()
        self.cdi.fill()

    def free(self) -> None:
        self.plugin.free()
        self.cdi.free()


@pytest.fixture
def disks(tmp_path: Path) -> Iterator[Disks]:
    mounted: list[Path] = []
    try:
        for name in ("plugin", "cdi"):
            _mount_tmpfs(tmp_path / name)
            mounted.append(tmp_path / name)
        yield Disks(plugin=Disk(tmp_path / "plugin"), cdi=Disk(tmp_path / "cdi"))
    finally:
        for directory in mounted:
            subprocess.run(["umount", str(directory)], check=True)


@pytest.fixture
def env(disks: Disks, inventory: NodeInventory, tmp_path: Path) -> Env:
    env = Env(tmp_path, inventory)
    env.plugin_dir, env.cdi_root = disks.plugin.root, disks.cdi.root
    return env


def fill_after(disk: Disk | Disks, effect: str) -> Callable[[str, str], None]:
    def hook(name: str, uid: str) -> None:
        if name == effect:
            disk.fill()

    return hook


def assert_memory_is_the_file(env: Env, state: DeviceState) -> None:
    assert state.prepared_claims() == env.on_disk()


def test_full_disk_at_prepare_started_leaves_nothing(env: Env, disks: Disks) -> None:
    state = env.state()
    c = claim([result("gpu-0")])
    disks.plugin.fill()
    with pytest.raises(FileWriteError, match=NO_SPACE):
        state.prepare(c)
    assert state.prepared_claims() == {} == env.on_disk()
    assert env.spec_files() == [] and env.held() == set()
    disks.free()
    other = claim([result("gpu-0")])  # the failed prepare never took the GPU
    assert state.prepare(other)[0].device == "gpu-0"
    assert sorted(env.on_disk()) == [other.uid]


def test_full_disk_at_prepare_completed_is_undone_and_the_retry_completes(env: Env, disks: Disks) -> None:
    c = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")])
    state = env.state(on_effect=fill_after(disks.plugin, "shares-acquired"))
    with pytest.raises(FileWriteError, match=NO_SPACE):
        state.prepare(c)
    assert_memory_is_the_file(env, state)
    # Shares released; the entry that could not be removed says PrepareStarted, which is true.
    assert {uid: entry.phase for uid, entry in env.on_disk().items()} == {c.uid: ClaimPhase.STARTED}
    assert env.spec_files() == [] and env.held() == set()
    disks.free()
    retry = env.state()
    devices = retry.prepare(c)
    assert env.on_disk()[c.uid].phase is ClaimPhase.COMPLETED and env.on_disk()[c.uid].devices == devices
    assert env.spec_files() == [f"k8s.fractional.dev-gpu_{c.uid}.json"]
    assert env.held() == {(c.uid, "gpu-0", devices[0].share_id)}


def test_full_cdi_disk_at_cdi_write_undoes_the_prepare(env: Env, disks: Disks) -> None:
    c = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi"), result("nic-0", request="net")])
    state = env.state(on_effect=fill_after(disks.cdi, "checkpoint-completed"))
    with pytest.raises(FileWriteError, match=rf"k8s\.fractional\.dev-gpu_{c.uid}\.json: not written"):
        state.prepare(c)
    assert_memory_is_the_file(env, state)
    assert env.on_disk() == {} and env.spec_files() == [] and env.held() == set()
    disks.free()
    env.state().prepare(c)
    assert len(env.spec_files()) == 2 and env.on_disk()[c.uid].phase is ClaimPhase.COMPLETED


def test_both_disks_full_at_cdi_write_keeps_what_the_checkpoint_says(env: Env, disks: Disks) -> None:
    c = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")])
    state = env.state(on_effect=fill_after(disks, "checkpoint-completed"))
    with pytest.raises(FileWriteError, match=rf"k8s\.fractional\.dev-gpu_{c.uid}\.json: not written"):
        state.prepare(c)
    assert_memory_is_the_file(env, state)
    # The undo could not record anything: the claim keeps its shares and its PrepareCompleted entry.
    assert env.on_disk()[c.uid].phase is ClaimPhase.COMPLETED
    assert env.spec_files() == [] and len(env.held()) == 1
    # A restart while the disks are still full serves; the missing CDI file waits for the retry.
    env.new_process()
    restarted = env.state()
    assert restarted.restore() == 0
    assert len(env.held()) == 1 and env.spec_files() == []
    disks.free()
    devices = restarted.prepare(c)
    assert env.spec_files() == [f"k8s.fractional.dev-gpu_{c.uid}.json"]
    assert env.on_disk()[c.uid].devices == devices
    restarted.unprepare(c.ref)
    assert env.on_disk() == {} and env.held() == set() and env.spec_files() == []


def test_full_disk_at_unprepare_start_changes_nothing_and_the_retry_releases(env: Env, disks: Disks) -> None:
    state = env.state()
    c = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")])
    state.prepare(c)
    disks.plugin.fill()
    with pytest.raises(FileWriteError, match=NO_SPACE):
        state.unprepare(c.ref)
    assert_memory_is_the_file(env, state)
    assert env.on_disk()[c.uid].phase is ClaimPhase.COMPLETED
    assert len(env.spec_files()) == 1 and len(env.held()) == 1  # nothing was undone
    disks.free()
    assert state.unprepare(c.ref) is True  # the retry does the work, not just answers it
    assert env.on_disk() == {} and env.spec_files() == [] and env.held() == set()
    env.new_process()
    restarted = env.state()
    restarted.restore()
    assert env.spec_files() == [] and restarted.prepared_claims() == {} and env.held() == set()


def test_full_disk_at_unprepare_removal_resurrects_nothing(env: Env, disks: Disks) -> None:
    """The disk fills mid-unprepare: CDI file removed and share released, then the checkpoint write fails."""
    c = claim([result("gpu-0")])
    env.state().prepare(c)
    state = env.state(on_effect=fill_after(disks.plugin, "shares-released"))
    with pytest.raises(FileWriteError, match=NO_SPACE):
        state.unprepare(c.ref)
    assert_memory_is_the_file(env, state)
    assert env.on_disk()[c.uid].phase is ClaimPhase.STARTED  # no longer vouched for
    assert env.spec_files() == []
    # A restart (disk still full) brings nothing back: no CDI spec rewritten.
    env.new_process()
    restarted = env.state()
    assert restarted.restore() == 0
    assert env.spec_files() == []
    disks.free()
    assert restarted.unprepare(c.ref) is True
    assert env.on_disk() == {} and restarted.prepared_claims() == {}
    restarted.prepare(claim([result("gpu-0")]))  # the GPU is free for the next claim


def test_full_cdi_disk_when_recreating_a_missing_cdi_file(env: Env, disks: Disks) -> None:
    c = claim([result("gpu-0", share_id=new_share_id(), memory="1Gi")])
    devices = env.state().prepare(c)
    path = cdi.claim_spec_path(env.cdi_root, "gpu", c.uid)
    content = path.read_bytes()
    path.unlink()
    disks.cdi.fill()
    # The restart serves although the file cannot be re-created (it used to fail to start).
    env.new_process()
    restarted = env.state()
    assert restarted.restore() == 0
    assert len(env.held()) == 1
    with pytest.raises(FileWriteError, match=rf"k8s\.fractional\.dev-gpu_{c.uid}\.json: not written"):
        restarted.prepare(c)
    assert_memory_is_the_file(env, restarted)
    assert env.on_disk()[c.uid].phase is ClaimPhase.COMPLETED and len(env.held()) == 1
    disks.free()
    assert restarted.prepare(c) == devices
    assert path.read_bytes() == content

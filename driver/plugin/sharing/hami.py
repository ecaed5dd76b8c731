"""``hami``: HAMi-core (``libvgpu.so``) enforces the share inside the container.

HAMi-core intercepts CUDA and NVML calls in the container's processes and keeps its accounting in
a shared-memory file (``CUDA_DEVICE_MEMORY_SHARED_CACHE``) that every process of one claim maps,
so the limit holds across the claim's containers (Project-HAMi/HAMi-core ``src/multiprocess/``).
Per share:

- ``CUDA_DEVICE_MEMORY_LIMIT_<ordinal>=<MiB>m``; ``<ordinal>`` is the GPU's position among the
  claim's GPUs (``ShareSpec.ordinal``);
- when ``compute`` > 0: ``CUDA_DEVICE_SM_LIMIT_<ordinal>=<percent>`` and, for ordinal 0, the plain
  ``CUDA_DEVICE_SM_LIMIT=<percent>`` too (HAMi-core takes the plain variable as the default of
  every device without its own ``_<i>`` value: in a multi-GPU claim whose GPU 0 has a compute
  limit, a GPU without one inherits it, the same as HAMi's own device plugin does);
- ``CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/hami/<claimUID>.cache`` with the host directory
  ``<plugin dir>/hami/claims/<claimUID>`` mounted on ``/tmp/hami``;
- ``GpuConfig`` options (``coreUtilizationPolicy`` ...) as HAMi-core's variables.

When ``--hami-library`` names ``libvgpu.so`` on the host it is mounted read-only on
``/usr/local/vgpu/libvgpu.so``, a host file ``<plugin dir>/hami/ld.so.preload`` naming that path
is mounted read-only on ``/etc/ld.so.preload`` (so every process loads it, static binaries and
``env -i`` included), and HAMi-core's lock directory ``<plugin dir>/hami/vgpulock`` is mounted on
``/tmp/vgpulock``. Without it the image must bring HAMi-core itself.

Whole-GPU shares get no edits at all.

Files: nothing under ``<plugin dir>/hami`` is followed (``driver.plugin.atomic``). The claim
directories and the lock directory are mounted read-write into containers, and a symlink planted as
``hami``, ``claims``, ``vgpulock`` or ``ld.so.preload`` would make the agent create, chmod or delete
things outside: such an entry is removed and replaced by ours (logged), and a claim directory is
removed through its parent's descriptor, never through a link.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from pathlib import Path

from driver.errors import ClaimError
from driver.plugin.atomic import UnsafeEntryError, open_directory, read_regular_file, remove_tree
from driver.plugin.sharing.base import ContainerEdits, Mount, ShareSpec

__all__ = ["HamiBackend"]

log = logging.getLogger(__name__)

MIB = 1024 * 1024
CACHE_DIR_IN_CONTAINER = "/tmp/hami"
LIBRARY_IN_CONTAINER = "/usr/local/vgpu/libvgpu.so"
PRELOAD_IN_CONTAINER = "/etc/ld.so.preload"
LOCK_DIR_IN_CONTAINER = "/tmp/vgpulock"

# GpuConfig ``sharing.hami`` option -> (variable, value mapping)
_OPTION_VARIABLES = {
    "coreUtilizationPolicy": "GPU_CORE_UTILIZATION_POLICY",
    "activeOOMKiller": "ACTIVE_OOM_KILLER",
    "oversubscribe": "CUDA_OVERSUBSCRIBE",
    "taskPriority": "CUDA_TASK_PRIORITY",
    "logLevel": "LIBCUDA_LOG_LEVEL",
}

_ShareKey = tuple[str, str, str | None]


class HamiBackend:
    """HAMi-core variables and mounts; per-claim cache directories on the host."""

    name = "hami"

    def __init__(self, *, plugin_dir: str, library: str | None = None) -> None:
        self._plugin_dir = Path(plugin_dir)
        self._root = self._plugin_dir / "hami"
        self._library = library
        self._lock = threading.Lock()
        self._claims: dict[str, set[_ShareKey]] = {}  # claim UID -> acquired shares
        self._remove_leftover_temp_files()
        if library and not os.path.isfile(library):
            # The agent may see host paths elsewhere (a hostPath mount), so this is not fatal.
            log.warning("hami library not found from the agent", extra={"path": library})

    def claim_cache_dir(self, claim_uid: str) -> Path:
        return self._root / "claims" / claim_uid

    @property
    def preload_file(self) -> Path:
        return self._root / "ld.so.preload"

    @property
    def lock_dir(self) -> Path:
        return self._root / "vgpulock"

    def container_edits(self, share: ShareSpec) -> ContainerEdits:
        if share.whole_gpu:
            return ContainerEdits()
        env = [f"CUDA_DEVICE_MEMORY_LIMIT_{share.ordinal}={share.memory_bytes // MIB}m"]
        if share.compute_percent > 0:
            if share.ordinal == 0:
                env.append(f"CUDA_DEVICE_SM_LIMIT={share.compute_percent}")
            env.append(f"CUDA_DEVICE_SM_LIMIT_{share.ordinal}={share.compute_percent}")
        env.append(f"CUDA_DEVICE_MEMORY_SHARED_CACHE={CACHE_DIR_IN_CONTAINER}/{share.claim_uid}.cache")
        for key, value in share.backend_options:
            variable = _OPTION_VARIABLES.get(key)
            if variable is None:
                continue  # another backend's option
            env.append(f"{variable}={value.upper() if key == 'coreUtilizationPolicy' else value}")
        mounts = [Mount(str(self.claim_cache_dir(share.claim_uid)), CACHE_DIR_IN_CONTAINER, ("rbind", "rw"))]
        if self._library:
            mounts += [
                Mount(self._library, LIBRARY_IN_CONTAINER, ("rbind", "ro", "nosuid", "nodev")),
                Mount(str(self.preload_file), PRELOAD_IN_CONTAINER, ("bind", "ro", "nosuid", "nodev")),
                Mount(str(self.lock_dir), LOCK_DIR_IN_CONTAINER, ("rbind", "rw")),
            ]
        return ContainerEdits(env=tuple(env), mounts=tuple(mounts))

    def _remove_leftover_temp_files(self) -> None:
        """Temp files of a preload write a kill -9 interrupted; only inside a real ``hami`` dir."""
        prefix = f".{self.preload_file.name}."
        try:
            with open_directory(self._plugin_dir, self._root.name) as root:
                for name in os.listdir(root):
                    if name.startswith(prefix) and name.endswith(".tmp"):
                        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                            os.unlink(name, dir_fd=root)
        except FileNotFoundError:
            return
        except UnsafeEntryError as error:
            log.warning(
                "hami directory is a planted entry; replaced on first use", extra={"reason": str(error)}
            )

    def acquire(self, share: ShareSpec) -> None:
        """Create the claim's cache directory (and the preload file and lock directory)."""
        if share.whole_gpu:
            return
        key = (share.claim_uid, share.device, share.share_id)
        with self._lock:
            try:
                with open_directory(self._plugin_dir, "hami", "claims", share.claim_uid, create=True):
                    pass
                if self._library:
                    with open_directory(self._plugin_dir, "hami", "vgpulock", create=True) as lock_dir:
                        os.chmod(lock_dir, 0o777)  # shared by every container's user; the fd, not a path
                    _write_if_changed(self.preload_file, LIBRARY_IN_CONTAINER + "\n")
            except OSError as error:
                raise ClaimError(
                    claim=share.claim,
                    field="sharing.hami",
                    problem=f"cannot prepare {self._root}: {error}",
                ) from error
            self._claims.setdefault(share.claim_uid, set()).add(key)

    def release(self, share: ShareSpec) -> None:
        """Forget the share; the last share of a claim removes the claim's cache directory."""
        key = (share.claim_uid, share.device, share.share_id)
        with self._lock:
            keys = self._claims.get(share.claim_uid, set())
            keys.discard(key)
            if keys:
                return
            self._claims.pop(share.claim_uid, None)
            try:
                remove_tree(self._plugin_dir, "hami", "claims", share.claim_uid)
            except OSError as error:  # the directory stays behind; nothing else depends on it
                log.warning(
                    "hami claim directory not removed",
                    extra={
                        "claim_uid": share.claim_uid,
                        "path": str(self.claim_cache_dir(share.claim_uid)),
                        "error": str(error),
                    },
                )

    def close(self) -> None:
        return None  # nothing runs on the node; cache directories outlive a restart on purpose

    def describe(self) -> dict[str, str]:
        return {"backend": self.name, "enforcement": "hami-core", "library": self._library or ""}


def _write_if_changed(path: Path, text: str) -> None:
    """Keep our regular file when it already says ``text``; anything else there (another text, a
    symlink, a FIFO) is replaced by a regular file: the rename replaces the entry, not a target."""
    try:
        if read_regular_file(path, max_bytes=4096) == text.encode():
            return
    except FileNotFoundError:
        pass
    except UnsafeEntryError as error:  # a directory there fails the rename below: a ClaimError
        log.warning("planted entry replaced", extra={"path": str(path), "reason": str(error)})
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise

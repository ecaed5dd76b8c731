"""Atomic file replacement: what the runtime or a restarted agent reads is never half-written."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["write_atomically"]


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(
    path: Path, data: bytes, *, mode: int = 0o644, fsync_file: bool = True, fsync_directory: bool = True
) -> None:
    """Temp file in the same directory, fsync, rename over ``path``, fsync the directory.

    The rename alone makes the write atomic for readers and against a crash of this process (the
    page cache survives it); ``fsync_file`` keeps the content from being lost on power failure, and
    ``fsync_directory`` the rename itself. The temp name starts with ``.`` and ends with ``.tmp`` so
    that CDI caches never load it.
    """
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            if fsync_file:
                os.fsync(handle.fileno())
        os.replace(temp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp_name)
        raise
    if fsync_directory:
        _fsync_directory(path.parent)

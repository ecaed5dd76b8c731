"""The agent's own files: atomic replacement, and access that never follows what was planted.

Atomic replacement: what the runtime or a restarted agent reads is never half-written.

No-follow access. The agent's directories (the plugin dir with its ``mps/`` and ``hami/`` trees, the
CDI root) are trusted as configured; *below* them nothing is followed: an entry that is a symbolic
link, a FIFO, a device or a socket where the agent expects its own regular file or directory was
planted (partly tenant-writable: the MPS pipe directory and HAMi's claim and lock directories are
mounted into containers). Reads open with ``O_NOFOLLOW | O_NONBLOCK`` and then require a regular
file by ``fstat`` (a FIFO never blocks, a symlink never leads elsewhere); directories are walked one
component at a time with ``O_NOFOLLOW | O_DIRECTORY`` relative to the parent's descriptor; trees
are removed through that descriptor (``shutil.rmtree(dir_fd=...)``, which never follows links).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "UnsafeEntryError",
    "describe_entry",
    "open_append",
    "open_directory",
    "open_lock_file",
    "read_regular_file",
    "remove_entry",
    "remove_tree",
    "write_atomically",
]

log = logging.getLogger(__name__)

_NOFOLLOW_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeEntryError(OSError):
    """A path names something the agent did not put there (a symlink, a FIFO ...) or too much data.

    An ``OSError`` on purpose: every caller already treats an unreadable file as unreadable."""

    def __init__(self, *, path: Path | str, problem: str) -> None:
        super().__init__(errno.EPERM, f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


def describe_entry(mode: int) -> str:
    """``st_mode`` in words, for log lines and errors."""
    for test, name in (
        (stat.S_ISREG, "regular file"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISLNK, "symbolic link"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return "special file"


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
    that CDI caches never load it. Nothing is followed: the temp file is created with ``O_EXCL``
    and the rename replaces a symlink (or FIFO) at ``path`` itself, never its target.
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


def read_regular_file(path: Path, *, max_bytes: int, follow_symlinks: bool = False) -> bytes:
    """The content of the regular file ``path``, at most ``max_bytes``.

    ``FileNotFoundError`` when nothing is there; ``UnsafeEntryError`` for a symlink (unless
    ``follow_symlinks``: files in directories that are not ours), anything but a regular file
    (opening a FIFO does not block) or a file larger than ``max_bytes``."""
    flags = _NOFOLLOW_READ & ~os.O_NOFOLLOW if follow_symlinks else _NOFOLLOW_READ
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UnsafeEntryError(path=path, problem="is a symbolic link; not followed") from error
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnsafeEntryError(path=path, problem=f"is a {describe_entry(mode)}, not a regular file")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > max_bytes:
        raise UnsafeEntryError(path=path, problem=f"is larger than {max_bytes} bytes")
    return b"".join(chunks)


def remove_entry(path: Path) -> str | None:
    """Remove whatever is at ``path`` without following it: a symlink goes (its target stays), a
    directory goes with its contents (``rmtree`` never follows the links inside). Returns what
    was removed (``describe_entry``), None when nothing was there."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return None
    try:
        if stat.S_ISDIR(mode):
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        return None
    return describe_entry(mode)


def _replace_planted(path: Path, error: UnsafeEntryError | OSError) -> None:
    removed = remove_entry(path)
    log.warning(
        "planted entry replaced", extra={"path": str(path), "entry": removed, "reason": str(error)[:300]}
    )


def _open_regular(path: Path, flags: int, mode: int) -> int:
    """``os.open(path, flags | O_CREAT | O_NOFOLLOW)`` requiring a regular file; a symlink or
    special file in its place is removed (logged) and a fresh file created instead."""
    flags |= os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for attempt in (1, 2):
        try:
            fd = os.open(path, flags, mode)
        except OSError as error:
            if error.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO) or attempt == 2:
                raise
            _replace_planted(path, error)
            continue
        file_mode = os.fstat(fd).st_mode
        if stat.S_ISREG(file_mode):
            return fd
        os.close(fd)
        problem = UnsafeEntryError(path=path, problem=f"is a {describe_entry(file_mode)}")
        if attempt == 2:
            raise problem
        _replace_planted(path, problem)
    raise AssertionError("unreachable")


def open_lock_file(path: Path) -> int:
    """A descriptor of the lock file ``path`` (created 0600), for ``flock``; never the target of a
    symlink planted there (that would create or lock a file outside the directory)."""
    return _open_regular(path, os.O_RDWR, 0o600)


def open_append(path: Path, *, mode: int = 0o644) -> int:
    """A descriptor appending to the regular file ``path`` (a log), created when missing."""
    return _open_regular(path, os.O_WRONLY | os.O_APPEND, mode)


@contextlib.contextmanager
def open_directory(root: Path, *parts: str, create: bool = False, mode: int = 0o755) -> Iterator[int]:
    """A descriptor of ``root/parts...``: ``root`` is trusted as configured, each of ``parts`` must
    be a real directory (a symlink is never followed). ``create``: missing ones are made with
    ``mode`` (then chmod-ed, whatever the umask), and a symlink or non-directory in the way is
    removed (logged) and replaced by a directory. Without ``create`` a missing part raises
    ``FileNotFoundError`` and a planted one ``UnsafeEntryError``."""
    if create:
        root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        where = root
        for part in parts:
            if not part or part in (".", "..") or "/" in part:
                raise UnsafeEntryError(path=where / part, problem=f"{part!r} is not a plain name")
            where = where / part
            child = _open_child_directory(fd, part, where, create=create, mode=mode)
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _open_child_directory(parent: int, name: str, where: Path, *, create: bool, mode: int) -> int:
    for attempt in (1, 2):
        try:
            return os.open(name, _DIRECTORY_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
            with contextlib.suppress(FileExistsError):  # made meanwhile by another thread: fine
                os.mkdir(name, mode, dir_fd=parent)
                os.chmod(name, mode, dir_fd=parent)
        except OSError as error:
            if error.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            found = describe_entry(os.lstat(name, dir_fd=parent).st_mode)
            unsafe = UnsafeEntryError(path=where, problem=f"is a {found}, not a directory; not followed")
            if not create or attempt == 2:
                raise unsafe from error
            os.unlink(name, dir_fd=parent)
            log.warning("planted entry replaced", extra={"path": str(where), "entry": found})
    return os.open(name, _DIRECTORY_FLAGS, dir_fd=parent)


def remove_tree(root: Path, *parts: str) -> bool:
    """Remove the directory ``root/parts...`` and its contents, following no link on the way: a
    symlinked component (of ``parts``) makes it a no-op, logged; a symlink or file as the last
    part is unlinked (its target stays). True when something was removed."""
    if not parts:
        raise ValueError("remove_tree needs the name of the directory to remove")
    *parents, name = parts
    try:
        with open_directory(root, *parents) as parent:
            try:
                mode = os.lstat(name, dir_fd=parent).st_mode
            except FileNotFoundError:
                return False
            if stat.S_ISDIR(mode):
                shutil.rmtree(name, dir_fd=parent)
            else:
                os.unlink(name, dir_fd=parent)
                log.warning(
                    "planted entry removed",
                    extra={"path": str(root.joinpath(*parts)), "entry": describe_entry(mode)},
                )
            return True
    except FileNotFoundError:
        return False
    except UnsafeEntryError as error:
        log.warning("directory not removed: a planted entry on its path", extra={"reason": str(error)})
        return False

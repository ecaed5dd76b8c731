"""The node agent's checkpoint: which claims are prepared, and what preparing them computed.

A versioned JSON document in the plugin dir (``checkpoint.json``), written atomically, guarded by a
checksum, and stamped with the node's boot id::

    {"apiVersion": "checkpoint.fractional.dev/v2", "kind": "Checkpoint", "bootID": "...",
     "checksum": "sha256:<hex of the canonical JSON of everything else>",
     "preparedClaims": {"<claimUID>": {"namespace": ..., "name": ..., "phase": "PrepareStarted",
                                       "bootID": "...", "devices": [PreparedDevice.to_dict(), ...]}}}

Two phases per claim: ``PrepareStarted`` is written before any node-side effect, ``PrepareCompleted``
after them. An entry recorded under another boot id is *stale*: its effects (MPS daemons, CDI files
on tmpfs) did not survive the reboot, so the next Prepare redoes them. The checkpoint itself lives
on disk and survives. A missing file reads as empty; an unreadable one raises
``CheckpointCorruptError`` and ``CheckpointStore`` sets it aside, then asks its ``recover``
callback for what can be rebuilt (``DeviceState`` reads the CDI specs on disk, which name claim and
device: phase ``RecoveredFromCDI``), so the exclusivity guard survives a corrupt file.

Versions: ``v2`` (this one) adds the ``RecoveredFromCDI`` phase and ``share.claimKey``; a ``v1``
file (written by earlier agents) is read as is and rewritten as ``v2`` on the next change. Any other
version is treated like a corrupt file. A path that exists but is not a regular file (a directory)
is a ``ConfigError`` naming it: moving it aside could hide an operator's mistake.

A write that fails (a full disk, a read-only mount) raises ``FileWriteError`` and changes nothing:
``CheckpointStore`` keeps in memory only what the file holds, so a change the file does not have is
never seen by the next transaction (or answered to the kubelet's retry).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from driver.errors import ConfigError, FractionalError
from driver.plugin.atomic import UnsafeEntryError, read_regular_file, write_atomically
from driver.plugin.devices import PreparedDevice
from driver.plugin.metrics import CHECKPOINT_CORRUPT_TOTAL

__all__ = [
    "API_VERSION",
    "BOOT_ID_PATH",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointStore",
    "ClaimPhase",
    "FileWriteError",
    "PreparedClaim",
    "parse_checkpoint",
    "read_boot_id",
    "read_checkpoint",
    "render_checkpoint",
]

log = logging.getLogger(__name__)

MAX_CHECKPOINT_BYTES = 64 * 1024 * 1024  # far above any real node's; a larger file is not ours

API_VERSION = "checkpoint.fractional.dev/v2"
READABLE_VERSIONS = ("checkpoint.fractional.dev/v1", API_VERSION)  # older ones are migrated on read
KIND = "Checkpoint"
FILE_NAME = "checkpoint.json"
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


class ClaimPhase(StrEnum):
    STARTED = "PrepareStarted"
    COMPLETED = "PrepareCompleted"
    RECOVERED = "RecoveredFromCDI"  # rebuilt from a CDI spec after the checkpoint was lost (v2)


class CheckpointCorruptError(FractionalError):
    def __init__(self, *, path: Path, problem: str) -> None:
        super().__init__(f"checkpoint {path}: {problem}")
        self.path = path
        self.problem = problem


class FileWriteError(FractionalError):
    """A file the node agent must write (the checkpoint, a CDI spec) could not be written: the disk
    is full, the mount read-only. Nothing was changed; the RPC fails and the kubelet retries."""

    def __init__(self, *, path: Path, problem: str) -> None:
        super().__init__(f"{path}: not written: {problem}")
        self.path = path
        self.problem = problem


@dataclass(frozen=True, slots=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    phase: ClaimPhase
    boot_id: str
    devices: tuple[PreparedDevice, ...]

    def is_current(self, boot_id: str) -> bool:
        """Completed during this boot: its effects are in place."""
        return self.phase is ClaimPhase.COMPLETED and self.boot_id == boot_id


@dataclass(frozen=True, slots=True)
class Checkpoint:
    boot_id: str = ""
    claims: Mapping[str, PreparedClaim] = field(default_factory=dict)

    def with_claim(self, claim: PreparedClaim) -> Checkpoint:
        return replace(self, claims={**self.claims, claim.uid: claim})

    def without(self, claim_uid: str) -> Checkpoint:
        return replace(self, claims={uid: c for uid, c in self.claims.items() if uid != claim_uid})


def _checksum(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


def render_checkpoint(checkpoint: Checkpoint, boot_id: str) -> bytes:
    """Pure: the file content, stamped with the boot id of the writer."""
    body: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "bootID": boot_id,
        "preparedClaims": {
            uid: {
                "namespace": claim.namespace,
                "name": claim.name,
                "phase": str(claim.phase),
                "bootID": claim.boot_id,
                "devices": [device.to_dict() for device in claim.devices],
            }
            for uid, claim in sorted(checkpoint.claims.items())
        },
    }
    body["checksum"] = _checksum(body)
    # Compact on purpose: ``indent`` switches json to its pure-Python encoder (10x slower).
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def parse_checkpoint(data: bytes, path: Path) -> Checkpoint:
    """Pure inverse of ``render_checkpoint``; ``CheckpointCorruptError`` for anything else."""
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointCorruptError(path=path, problem=f"not JSON: {error}") from error
    if not isinstance(body, dict):
        raise CheckpointCorruptError(path=path, problem="not a JSON object")
    version = body.get("apiVersion")
    if version not in READABLE_VERSIONS or body.get("kind") != KIND:
        raise CheckpointCorruptError(
            path=path,
            problem=f"apiVersion/kind: expected one of {', '.join(READABLE_VERSIONS)}/{KIND}, "
            f"found {str(body.get('apiVersion'))[:80]}/{str(body.get('kind'))[:80]}",
        )
    checksum = body.pop("checksum", None)
    if checksum != _checksum(body):
        raise CheckpointCorruptError(path=path, problem="checksum: does not match the content")
    try:
        claims = {
            uid: PreparedClaim(
                uid=uid,
                namespace=str(raw["namespace"]),
                name=str(raw["name"]),
                phase=_phase(raw["phase"], version),
                boot_id=str(raw["bootID"]),
                devices=tuple(PreparedDevice.from_dict(device) for device in raw["devices"]),
            )
            for uid, raw in body["preparedClaims"].items()
        }
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointCorruptError(path=path, problem=f"preparedClaims: {error!r}") from error
    return Checkpoint(boot_id=str(body.get("bootID", "")), claims=claims)


def _phase(raw: str, version: str) -> ClaimPhase:
    phase = ClaimPhase(raw)
    if phase is ClaimPhase.RECOVERED and version != API_VERSION:
        raise ValueError(f"phase {phase} does not exist in {version}")
    return phase


def read_checkpoint(path: Path) -> Checkpoint:
    """A missing file reads as an empty checkpoint; a directory (or another non-file) in its place
    is a ``ConfigError`` naming the path; a file that cannot be read raises ``CheckpointCorruptError``."""
    try:
        data = read_regular_file(path, max_bytes=MAX_CHECKPOINT_BYTES)  # no link followed, no FIFO waited on
    except FileNotFoundError:
        return Checkpoint()
    except UnsafeEntryError as error:
        if stat.S_ISDIR(path.lstat().st_mode):
            raise ConfigError(
                field="--plugin-dir (FRACTIONAL_PLUGIN_DIR)",
                problem=f"{path} is a directory, not the checkpoint file; remove or rename it",
            ) from error
        raise CheckpointCorruptError(path=path, problem=error.problem) from error
    except OSError as error:
        raise CheckpointCorruptError(path=path, problem=f"unreadable: {error.strerror}") from error
    return parse_checkpoint(data, path)


def read_boot_id(path: str | Path = BOOT_ID_PATH) -> str:
    """The kernel's boot id; empty when unreadable (then every entry counts as this boot's)."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        log.warning("boot id unreadable", extra={"path": str(path)})
        return ""


class CheckpointStore:
    """Owns ``<plugin-dir>/checkpoint.json``: an in-memory checkpoint, changed in transactions and
    written with group commit.

    ``transaction()`` holds ``lock`` while the caller reads and checks the checkpoint and sets the
    new one; after the lock is released it returns only once a file containing that change is in
    place. One writer at a time renders and replaces the file with the newest checkpoint, so
    concurrent Prepares of different claims share writes instead of queueing for one each.
    Lock order: ``lock`` is never held while waiting for ``_write_lock``.

    Failed writes. A committed change is visible to later transactions before it reaches the file
    (so that concurrent Prepares check each other), but only until a write fails: then memory goes
    back to what the file holds, and every transaction whose change was not written (the failed
    one, those waiting on it, those that built on it) raises ``FileWriteError``. A transaction
    returns normally only once the file holds its change.

    Durability: every write is an atomic replace (temp file + rename), which survives a crash of
    the agent (the page cache survives it); the checkpoint is *not* fsynced. A power loss changes
    the boot id, which makes every entry stale and wipes every effect the entries guard (daemons,
    CDI files on tmpfs): they are redone from a recomputation, which is deterministic, and a file
    torn by the power loss is set aside as corrupt. An fsync would only cost a disk flush per write.

    ``cache=False`` (rolling updates: two agents share the file, every call is serialized by the
    ``serialize.lock`` flock) re-reads the file at the start of every transaction.
    """

    def __init__(
        self,
        plugin_dir: str | Path,
        *,
        boot_id: str,
        cache: bool = True,
        recover: Callable[[], Checkpoint] | None = None,
    ) -> None:
        self.path = Path(plugin_dir) / FILE_NAME
        self.boot_id = boot_id
        self._recover = recover  # what can be rebuilt when the file is corrupt (CDI specs)
        self.lock = threading.Lock()  # guards the fields below; never held across an API call
        self._write_lock = threading.Lock()  # one writer at a time
        self._cache = cache
        self._current: Checkpoint | None = None  # the file's content plus changes being written
        self._durable: Checkpoint | None = None  # the file's content
        self._version = 0  # changes made in memory, counted
        self._pending: set[int] = set()  # changes in memory, not yet in the file
        self._dropped: dict[int, str] = {}  # changes a failed write dropped -> the problem

    def _load_locked(self) -> Checkpoint:
        if self._cache and self._current is not None:
            return self._current
        try:
            checkpoint = read_checkpoint(self.path)
        except CheckpointCorruptError as error:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{time.time_ns()}")
            os.replace(self.path, aside)
            CHECKPOINT_CORRUPT_TOTAL.inc()
            checkpoint = self._recover() if self._recover is not None else Checkpoint()
            log.error(
                "checkpoint corrupt, set aside; claims rebuilt from CDI specs",
                extra={
                    "path": str(self.path),
                    "moved_to": str(aside),
                    "problem": error.problem[:300],
                    "recovered_claims": len(checkpoint.claims),
                },
            )
            if checkpoint.claims:  # write the rebuilt guard at once: the next load must find it
                self._save_recovered(checkpoint)
        else:
            if not checkpoint.claims and self._recover is not None and not self.path.exists():
                # Missing, though CDI specs may say otherwise: deleted, or set aside by an older
                # agent that cannot read this version (a rolling update). Rebuild what they say.
                recovered = self._recover()
                if recovered.claims:
                    log.warning(
                        "checkpoint missing; claims rebuilt from CDI specs",
                        extra={"path": str(self.path), "recovered_claims": len(recovered.claims)},
                    )
                    self._save_recovered(recovered)
                    checkpoint = recovered
        self._current = self._durable = checkpoint
        return checkpoint

    def _save_recovered(self, checkpoint: Checkpoint) -> None:
        """Under ``lock``, while loading (no change is pending then): write at once."""
        self._write(checkpoint)

    def load(self) -> Checkpoint:
        """The current checkpoint; a corrupt file is logged, counted, renamed aside and read as empty."""
        with self.lock:
            return self._load_locked()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[_Transaction]:
        """``with store.transaction() as tx: ... tx.checkpoint ...; tx.commit(new)`` (commit optional)."""
        with self.lock:
            tx = _Transaction(self._load_locked())
            yield tx
            if tx.result is None:
                return
            self._current = tx.result
            self._version += 1
            version = self._version
            self._pending.add(version)
        self._flush(version)

    def update(self, change: Callable[[Checkpoint], Checkpoint]) -> Checkpoint:
        with self.transaction() as tx:
            tx.commit(change(tx.checkpoint))
        assert tx.result is not None
        return tx.result

    def _flush(self, version: int) -> None:
        """Return once the file holds change ``version``; ``FileWriteError`` when a write failed
        before it got there (the change is then gone from memory too)."""
        with self._write_lock:
            with self.lock:
                problem = self._dropped.pop(version, None)
                if problem is not None:
                    raise FileWriteError(
                        path=self.path, problem=f"{problem} (while writing an earlier change)"
                    )
                if version not in self._pending:
                    return  # another writer's file already holds this change
                checkpoint, newest = self._current, self._version
            assert checkpoint is not None
            try:
                self._write(checkpoint)
            except FileWriteError as error:
                with self.lock:
                    # Every change not in the file goes, also those made since the snapshot: they
                    # were checked against it. Their transactions raise too.
                    self._current = self._durable
                    dropped = len(self._pending)
                    self._dropped.update(
                        (pending, error.problem) for pending in self._pending if pending != version
                    )
                    self._pending.clear()
                log.error(
                    "checkpoint not written; changes not in the file dropped",
                    extra={"path": str(self.path), "problem": error.problem, "changes": dropped},
                )
                raise
            with self.lock:
                self._pending = {pending for pending in self._pending if pending > newest}
                self._durable = checkpoint

    def _write(self, checkpoint: Checkpoint) -> None:
        """``FileWriteError`` when the file cannot be written; the old file is then left as it was."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(
                self.path,
                render_checkpoint(checkpoint, self.boot_id),
                mode=0o600,
                fsync_file=False,
                fsync_directory=False,
            )
        except OSError as error:
            raise FileWriteError(path=self.path, problem=error.strerror or repr(error)) from error


class _Transaction:
    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self.result: Checkpoint | None = None

    def commit(self, checkpoint: Checkpoint) -> None:
        self.result = checkpoint

"""``DeviceState``: prepare and unprepare claims on this node, crash-safe and idempotent.

Prepare = pure compute (``compute_prepared_devices``), then recorded effects: checkpoint
``PrepareStarted`` (with the computed devices) -> sharing backends' ``acquire`` -> checkpoint
``PrepareCompleted`` -> CDI spec files, last, because the runtime reads them. A claim found
completed during this boot answers the recorded devices (same CDI ids) and re-writes a missing CDI
file; one found started, or completed during an earlier boot, has its effects redone.
Unprepare never needs the API object: CDI files first, then ``release``, then the checkpoint entry;
unknown claims succeed.

Batches. ``prepare_many`` prepares the claims of one NodePrepareResources call together: one
checkpoint write records every claim's ``PrepareStarted``, one every ``PrepareCompleted`` (writes
render the whole checkpoint, so one write per claim made a 500-claim call quadratic). Each claim
still succeeds or fails alone: a claim that conflicts, or whose share cannot be acquired, gets its
``ClaimError`` and is undone; the others go on.

Lost checkpoint. When the checkpoint is corrupt (or missing while CDI specs exist), what the CDI
specs on disk say is rebuilt as ``RecoveredFromCDI`` entries (``recover_claims_from_cdi``): claim
UID, device, share-id prefix, backend and, for GPUs, the share's limits. They guard their devices
like any prepared claim; the kubelet's next Prepare of such a claim recomputes it.

Start-up hygiene: temp files left by a kill -9 in the middle of an atomic write
(``.checkpoint.json.*.tmp``, ``.k8s.fractional.dev-*.json.*.tmp``) are removed; the CDI root is
created with mode 0755 whatever the umask.

Concurrency. Lock order: per-claim lock -> ``serialize.lock`` flock (rolling updates only) ->
``CheckpointStore.lock``. Calls for different claims run concurrently and only meet on the short
checkpoint read-modify-write; calls for one claim are serialized by its lock. With rolling updates
two agents share the plugin dir, so a flock on ``<plugin-dir>/serialize.lock`` serializes every call
across both and the checkpoint is read from disk each time. No lock is held across an API call:
claims are fetched before ``prepare`` is called.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from driver.errors import ClaimError
from driver.inventory.model import NodeInventory
from driver.plugin import cdi
from driver.plugin.checkpoint import FILE_NAME, Checkpoint, CheckpointStore, ClaimPhase, PreparedClaim
from driver.plugin.claims import Claim, ClaimRef
from driver.plugin.devices import (
    MEMORY_STEP_BYTES,
    DeviceKind,
    PreparedDevice,
    PrepareSettings,
    compute_prepared_devices,
)
from driver.plugin.gpuconfig import check_backend_compatible
from driver.plugin.metrics import PREPARED_CLAIMS
from driver.plugin.sharing.base import ShareSpec

__all__ = [
    "SERIALIZE_LOCK_NAME",
    "DeviceState",
    "EffectHook",
    "PrepareOutcome",
    "recover_claims_from_cdi",
    "remove_leftover_temp_files",
]

PrepareOutcome = tuple[PreparedDevice, ...] | ClaimError
"""One claim's result in ``prepare_many``: its devices, or why it was not prepared."""

MAX_RECOVERED_SPEC_BYTES = 1024 * 1024  # our own spec files are a few KiB

log = logging.getLogger(__name__)

SERIALIZE_LOCK_NAME = "serialize.lock"

EffectHook = Callable[[str, str], None]
"""Called as ``hook(effect, claim_uid)`` right after each effect (crash tests stop the process there):
``checkpoint-started``, ``shares-acquired``, ``checkpoint-completed``, ``cdi-written``,
``cdi-removed``, ``shares-released``, ``checkpoint-removed``."""


class _ClaimLocks:
    """One lock per claim UID, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    @contextlib.contextmanager
    def hold(self, claim_uid: str) -> Iterator[None]:
        with self._guard:
            lock, users = self._locks.get(claim_uid, (threading.Lock(), 0))
            self._locks[claim_uid] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._locks[claim_uid]
                if users == 1:
                    del self._locks[claim_uid]
                else:
                    self._locks[claim_uid] = (lock, users - 1)


class DeviceState:
    def __init__(
        self,
        *,
        inventory: NodeInventory,
        settings: PrepareSettings,
        cdi_root: str | Path,
        plugin_dir: str | Path,
        boot_id: str,
        rolling_update: bool = False,
        effect_hook: EffectHook | None = None,
    ) -> None:
        self._inventory = inventory
        self._settings = settings
        self._cdi_root = Path(cdi_root)
        self._plugin_dir = Path(plugin_dir)
        self._plugin_dir.mkdir(parents=True, exist_ok=True)
        self._boot_id = boot_id
        self._store = CheckpointStore(
            plugin_dir, boot_id=boot_id, cache=not rolling_update, recover=self._recover_checkpoint
        )
        self._serialize_lock_path = self._plugin_dir / SERIALIZE_LOCK_NAME if rolling_update else None
        self._claim_locks = _ClaimLocks()
        self._effect_hook = effect_hook
        self._recovered_shares: dict[str, tuple[PreparedDevice, ...]] = {}  # under the claim's lock
        cdi.ensure_cdi_root(self._cdi_root)

    @property
    def inventory(self) -> NodeInventory:
        return self._inventory

    # -- locking -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _serialized(self, claim_uid: str) -> Iterator[None]:
        with self._claim_locks.hold(claim_uid):
            if self._serialize_lock_path is None:
                yield
                return
            fd = os.open(self._serialize_lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # blocks this worker thread only; the holder needs none
                yield
            finally:
                os.close(fd)  # releases the flock

    @contextlib.contextmanager
    def _serialized_many(self, claim_uids: Sequence[str]) -> Iterator[None]:
        """Every claim's lock, taken in sorted order (no two callers can wait on each other),
        then the flock once."""
        with contextlib.ExitStack() as stack:
            for uid in sorted(set(claim_uids)):
                stack.enter_context(self._claim_locks.hold(uid))
            if self._serialize_lock_path is not None:
                fd = os.open(self._serialize_lock_path, os.O_RDWR | os.O_CREAT, 0o600)
                stack.callback(os.close, fd)  # releases the flock
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield

    def _effect(self, effect: str, claim_uid: str) -> None:
        if self._effect_hook is not None:
            self._effect_hook(effect, claim_uid)

    def _update_checkpoint(self, change: Callable[[Checkpoint], Checkpoint]) -> None:
        checkpoint = self._store.update(change)
        PREPARED_CLAIMS.set(len(checkpoint.claims))

    # -- prepare -------------------------------------------------------------------------------

    def prepare(self, claim: Claim) -> tuple[PreparedDevice, ...]:
        """The claim's devices; ``ClaimError`` (nothing left behind) when it cannot be prepared."""
        outcome = self.prepare_many([claim])[claim.uid]
        if isinstance(outcome, ClaimError):
            raise outcome
        return outcome

    def prepare_many(self, claims: Sequence[Claim]) -> dict[str, PrepareOutcome]:
        """Prepare ``claims`` together (one NodePrepareResources call): claim UID -> its devices or
        its ``ClaimError``. A claim that fails leaves nothing behind and never fails the others; an
        unexpected error (a bug, a full disk) undoes every claim this call started, then propagates."""
        outcomes: dict[str, PrepareOutcome] = {}
        computed: dict[str, tuple[Claim, tuple[PreparedDevice, ...]]] = {}
        for claim in claims:
            if claim.uid in computed or claim.uid in outcomes:
                continue  # the same claim twice in one call: one answer
            try:
                computed[claim.uid] = (
                    claim,
                    compute_prepared_devices(claim, self._inventory, self._settings),
                )
            except ClaimError as error:
                outcomes[claim.uid] = error
        if not computed:
            return outcomes
        with self._serialized_many(list(computed)):
            started = self._record_started(computed, outcomes)
            if started:
                self._run_prepare_effects(started, outcomes)
        return outcomes

    def _record_started(
        self,
        computed: Mapping[str, tuple[Claim, tuple[PreparedDevice, ...]]],
        outcomes: dict[str, PrepareOutcome],
    ) -> dict[str, tuple[Claim, tuple[PreparedDevice, ...]]]:
        """One transaction: check every claim against the checkpoint (and the claims before it in
        this call) and record ``PrepareStarted``. Claims completed during this boot are answered
        from the checkpoint (a missing CDI file is re-created). Returns the claims to run."""
        started: dict[str, tuple[Claim, tuple[PreparedDevice, ...]]] = {}
        current: dict[str, tuple[PreparedDevice, ...]] = {}
        with self._store.transaction() as tx:
            claims = dict(tx.checkpoint.claims)
            held = _DeviceIndex(claims.values())
            for uid, (claim, devices) in computed.items():
                entry = claims.get(uid)
                if entry is not None and entry.is_current(self._boot_id):
                    current[uid] = entry.devices
                    continue
                if entry is not None and entry.phase is not ClaimPhase.RECOVERED:
                    devices = entry.devices  # recorded by an earlier attempt: redo exactly that
                try:
                    held.check_not_in_use(claim, devices)
                except ClaimError as error:
                    outcomes[uid] = error
                    continue
                record = PreparedClaim(
                    uid=uid,
                    namespace=claim.ref.namespace,
                    name=claim.ref.name,
                    phase=ClaimPhase.STARTED,
                    boot_id=self._boot_id,
                    devices=devices,
                )
                held.replace(entry, record)
                claims[uid] = record
                started[uid] = (claim, devices)
                if entry is not None and entry.phase is ClaimPhase.RECOVERED:
                    self._recovered_shares[uid] = entry.devices
            if started:
                tx.commit(Checkpoint(boot_id=tx.checkpoint.boot_id, claims=claims))
        for uid, devices in current.items():
            self._ensure_cdi_specs(uid, devices)
            outcomes[uid] = devices
        return started

    def _run_prepare_effects(
        self,
        started: Mapping[str, tuple[Claim, tuple[PreparedDevice, ...]]],
        outcomes: dict[str, PrepareOutcome],
    ) -> None:
        for uid in started:
            self._effect("checkpoint-started", uid)
        pending = dict(started)  # started here and not yet finished or undone
        try:
            failed: list[str] = []
            for uid, (_claim, devices) in started.items():
                try:
                    self._acquire(devices)
                except ClaimError as error:
                    outcomes[uid] = error
                    failed.append(uid)
                    continue
                self._effect("shares-acquired", uid)
            self._release_recovered(started)
            for uid in failed:
                cdi.remove_claim_specs(self._cdi_root, uid)
                self._release(uid, started[uid][1])
                del pending[uid]
            completed = {
                uid: PreparedClaim(
                    uid=uid,
                    namespace=claim.ref.namespace,
                    name=claim.ref.name,
                    phase=ClaimPhase.COMPLETED,
                    boot_id=self._boot_id,
                    devices=devices,
                )
                for uid, (claim, devices) in pending.items()
            }
            self._update_checkpoint(lambda checkpoint: _with_changes(checkpoint, completed, failed))
            for uid in completed:
                self._effect("checkpoint-completed", uid)
            for uid, record in completed.items():
                self._write_cdi_specs(uid, record.devices)
                self._effect("cdi-written", uid)
                outcomes[uid] = record.devices
                del pending[uid]
        except Exception:
            # Undo, then re-raise. A BaseException (exit, kill) is a crash: the restart recovers.
            self._release_recovered(started)
            for uid, (_claim, devices) in pending.items():
                cdi.remove_claim_specs(self._cdi_root, uid)
                self._release(uid, devices)
            self._update_checkpoint(lambda checkpoint: _with_changes(checkpoint, {}, list(pending)))
            raise

    def _release_recovered(self, claim_uids: Iterable[str]) -> None:
        """A recovered claim's shares were acquired at start-up under the share-id prefix its CDI
        spec kept; once the claim is prepared again (or undone), that hold goes."""
        for uid in claim_uids:
            recovered = self._recovered_shares.pop(uid, None)
            if recovered is not None:
                self._release(uid, recovered)

    def _acquire(self, devices: tuple[PreparedDevice, ...]) -> None:
        for device in devices:
            if device.share is not None and device.backend is not None:
                self._settings.backends[device.backend].acquire(device.share)

    def _write_cdi_specs(self, claim_uid: str, devices: tuple[PreparedDevice, ...]) -> None:
        for cdi_class, spec in _render_specs(devices).items():
            cdi.write_cdi_spec(self._cdi_root, cdi_class, claim_uid, spec)

    def _ensure_cdi_specs(self, claim_uid: str, devices: tuple[PreparedDevice, ...]) -> None:
        """Re-create spec files that disappeared (``/var/run/cdi`` is tmpfs, or someone deleted them)."""
        for cdi_class, spec in _render_specs(devices).items():
            if not cdi.claim_spec_path(self._cdi_root, cdi_class, claim_uid).exists():
                cdi.write_cdi_spec(self._cdi_root, cdi_class, claim_uid, spec)
                log.info("CDI spec re-created", extra={"claim_uid": claim_uid, "cdi_class": cdi_class})

    # -- unprepare -----------------------------------------------------------------------------

    def unprepare(self, ref: ClaimRef) -> bool:
        """Undo ``prepare``; unknown or already unprepared claims succeed. True when the claim was
        in the checkpoint (it had been prepared, or its prepare had started)."""
        outcome = self.unprepare_many([ref])[ref.uid]
        if isinstance(outcome, ClaimError):
            raise outcome
        return outcome

    def unprepare_many(self, refs: Sequence[ClaimRef]) -> dict[str, bool | ClaimError]:
        """``unprepare`` for the claims of one call, with one checkpoint write for all of them:
        claim UID -> whether it was in the checkpoint, or why it could not be undone."""
        uids: list[str] = list(dict.fromkeys(ref.uid for ref in refs))
        outcomes: dict[str, bool | ClaimError] = {}
        with self._serialized_many(uids):
            claims = self._store.load().claims
            removed: list[str] = []
            for uid in uids:
                entry = claims.get(uid)
                try:
                    cdi.remove_claim_specs(self._cdi_root, uid)
                    self._effect("cdi-removed", uid)
                    if entry is not None:
                        self._release(uid, entry.devices)
                        self._effect("shares-released", uid)
                        removed.append(uid)
                except ClaimError as error:
                    outcomes[uid] = error
                    continue
                outcomes[uid] = entry is not None
            if removed:
                self._update_checkpoint(lambda checkpoint: _with_changes(checkpoint, {}, removed))
                for removed_uid in removed:
                    self._effect("checkpoint-removed", removed_uid)
        return outcomes

    def _release(self, claim_uid: str, devices: tuple[PreparedDevice, ...]) -> None:
        for device in devices:
            if device.share is None or device.backend is None:
                continue
            backend = self._settings.backends.get(device.backend)
            if backend is None:  # the node's backends changed since the claim was prepared
                log.warning(
                    "sharing backend gone, nothing to release",
                    extra={"claim_uid": claim_uid, "device": device.device, "backend": device.backend},
                )
                continue
            backend.release(device.share)

    # -- start-up ------------------------------------------------------------------------------

    def restore(self) -> int:
        """At agent start: remove temp files a crash left, re-acquire the shares of claims completed
        during this boot (and of claims recovered from CDI specs) and re-create their missing CDI
        files. Specs on disk that the checkpoint does not know (it was lost) are adopted as
        recovered claims. Entries of earlier boots wait for the kubelet's next Prepare.
        Returns how many claims were restored; a claim that fails is logged and skipped."""
        with self._serialized_many([]):  # under rolling updates, no other agent is mid-write now
            remove_leftover_temp_files(self._plugin_dir, self._cdi_root)
        checkpoint = self._store.load()
        orphans = {
            uid: entry
            for uid, entry in self._recover_checkpoint().claims.items()
            if uid not in checkpoint.claims
        }
        if orphans:
            log.warning("CDI specs without checkpoint entries adopted", extra={"claims": len(orphans)})
            checkpoint = self._store.update(lambda current: _with_changes(current, orphans, []))
        PREPARED_CLAIMS.set(len(checkpoint.claims))
        restored = 0
        for uid, entry in sorted(checkpoint.claims.items()):
            recovered = entry.phase is ClaimPhase.RECOVERED and entry.boot_id == self._boot_id
            if not (entry.is_current(self._boot_id) or recovered):
                continue
            with self._serialized(uid):
                try:
                    self._acquire(entry.devices)
                    if not recovered:
                        self._ensure_cdi_specs(uid, entry.devices)
                except ClaimError as error:
                    log.error("prepared claim not restored", extra={"claim_uid": uid, "reason": str(error)})
                    continue
            restored += 1
        return restored

    def _recover_checkpoint(self) -> Checkpoint:
        claims = recover_claims_from_cdi(
            self._cdi_root,
            self._inventory,
            pool=self._settings.pool_name or self._inventory.node_name,
            boot_id=self._boot_id,
        )
        return Checkpoint(boot_id=self._boot_id, claims=claims)

    def prepared_claims(self) -> Mapping[str, PreparedClaim]:
        return dict(self._store.load().claims)


def _render_specs(devices: tuple[PreparedDevice, ...]) -> dict[str, dict[str, object]]:
    specs = {}
    for kind in DeviceKind:
        pairs = [(device.cdi_name, device.edits) for device in devices if device.kind is kind]
        if pairs:
            specs[str(kind)] = cdi.render_claim_spec(str(kind), pairs)
    return specs


def _with_changes(
    checkpoint: Checkpoint, records: Mapping[str, PreparedClaim], removed: Sequence[str]
) -> Checkpoint:
    claims = {uid: claim for uid, claim in checkpoint.claims.items() if uid not in removed}
    claims.update(records)
    return Checkpoint(boot_id=checkpoint.boot_id, claims=claims)


class _DeviceIndex:
    """Who holds each device, for the exclusivity check: (pool, device) -> [(claim, device)]."""

    def __init__(self, claims: Iterable[PreparedClaim]) -> None:
        self._held: dict[tuple[str, str], list[tuple[PreparedClaim, PreparedDevice]]] = {}
        for claim in claims:
            self._add(claim)

    def _add(self, claim: PreparedClaim) -> None:
        for device in claim.devices:
            if not device.admin_access:
                self._held.setdefault((device.pool, device.device), []).append((claim, device))

    def replace(self, old: PreparedClaim | None, new: PreparedClaim) -> None:
        if old is not None:
            for key, holders in self._held.items():
                self._held[key] = [(claim, device) for claim, device in holders if claim is not old]
        self._add(new)

    def check_not_in_use(self, claim: Claim, devices: tuple[PreparedDevice, ...]) -> None:
        """Last line of defence: a device held exclusively (or a share id) by another prepared claim,
        or a share whose sharing backend cannot live beside the device's other shares (MPS)."""
        for device in devices:
            if device.admin_access:
                continue
            for other, held in self._held.get((device.pool, device.device), ()):
                if other.uid == claim.uid:
                    continue
                if device.backend is not None:
                    check_backend_compatible(held.backend, device.backend, device.device, claim=claim.key)
                if device.share_id is None or held.share_id is None or _same_share(device, held, other):
                    if other.phase is ClaimPhase.RECOVERED:
                        holder = f"ResourceClaim with UID {other.uid} (recovered from its CDI spec)"
                    else:
                        holder = f"ResourceClaim {other.namespace}/{other.name} ({other.uid})"
                    raise ClaimError(
                        claim=claim.key,
                        field=f"device {device.pool}/{device.device}",
                        problem=f"already prepared for {holder}"
                        + (" exclusively" if held.share_id is None else f" with share {held.share_id}"),
                    )


def _same_share(device: PreparedDevice, held: PreparedDevice, holder: PreparedClaim) -> bool:
    assert device.share_id is not None and held.share_id is not None
    if holder.phase is ClaimPhase.RECOVERED:  # a CDI device name keeps only the share id's prefix
        return device.share_id.startswith(held.share_id)
    return device.share_id == held.share_id


# -- start-up hygiene and recovery ---------------------------------------------------------------


def remove_leftover_temp_files(plugin_dir: Path, cdi_root: Path) -> list[Path]:
    """Delete the temp files of atomic writes that a kill -9 interrupted: ``.checkpoint.json.*.tmp``
    in the plugin dir, ``.k8s.fractional.dev-*.json.*.tmp`` in the CDI root. Only our own names;
    the caller makes sure no write is in flight."""
    patterns = ((plugin_dir, f".{FILE_NAME}.*.tmp"), (cdi_root, f".{cdi.CDI_VENDOR}-*.json.*.tmp"))
    removed = []
    for directory, pattern in patterns:
        try:
            candidates = sorted(directory.glob(pattern))
        except OSError:
            continue
        for path in candidates:
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                path.unlink()
                removed.append(path)
    if removed:
        log.info("leftover temp files removed", extra={"files": [path.name for path in removed][:20]})
    return removed


def _env_list(env: Sequence[str], name: str) -> list[str]:
    prefix = f"{name}="
    for entry in env:
        if entry.startswith(prefix):
            return entry[len(prefix) :].split(",")
    return []


def _recover_spec(
    path: Path, claim_uid: str, cdi_class: str, inventory: NodeInventory, pool: str
) -> list[PreparedDevice]:
    """The devices one of our CDI spec files names (``<uid>-<device>[-<share-id prefix>]``)."""
    with path.open("rb") as handle:
        data = handle.read(MAX_RECOVERED_SPEC_BYTES + 1)
    if len(data) > MAX_RECOVERED_SPEC_BYTES:
        raise ValueError("larger than any spec we write")
    spec = json.loads(data)
    kind = DeviceKind(cdi_class)
    names = (
        [gpu.name for gpu in inventory.gpus] if kind is DeviceKind.GPU else [n.name for n in inventory.nics]
    )
    devices: list[PreparedDevice] = []
    for entry in spec.get("devices") or ():
        cdi_name = str(entry["name"])
        rest = cdi_name.removeprefix(f"{claim_uid}-")
        device = max(
            (name for name in names if rest == name or rest.startswith(f"{name}-")), key=len, default=None
        )
        if rest == cdi_name or device is None:
            raise ValueError(f"device {cdi_name!r} is not <claim UID>-<device of this node>")
        share_prefix = rest[len(device) + 1 :] or None
        edits = cdi.parse_container_edits(entry.get("containerEdits") or {})
        ordinal = len(devices)
        share = backend = None
        if kind is DeviceKind.GPU:
            backends = _env_list(edits.env, "FRACTIONAL_GPU_SHARING")
            memory = _env_list(edits.env, "FRACTIONAL_GPU_MEMORY_LIMIT")
            compute = _env_list(edits.env, "FRACTIONAL_GPU_COMPUTE_PERCENT")
            gpu = inventory.gpu(device)
            assert gpu is not None
            backend = backends[ordinal] if ordinal < len(backends) else None
            if backend is not None and ordinal < len(memory) and ordinal < len(compute):
                memory_bytes = int(memory[ordinal])
                share = ShareSpec(
                    claim_uid=claim_uid,
                    device=device,
                    gpu_uuid=gpu.uuid,
                    ordinal=ordinal,
                    share_id=share_prefix,
                    memory_bytes=memory_bytes,
                    compute_percent=int(compute[ordinal]),
                    whole_gpu=memory_bytes >= gpu.memory_bytes // MEMORY_STEP_BYTES * MEMORY_STEP_BYTES,
                )
        devices.append(
            PreparedDevice(
                kind=kind,
                request_names=(),
                pool=pool,
                device=device,
                share_id=share_prefix,
                cdi_name=cdi_name,
                cdi_device_ids=(cdi.qualified_device_id(cdi_class, cdi_name),),
                edits=edits,
                share=share,
                backend=backend,
            )
        )
    return devices


def recover_claims_from_cdi(
    cdi_root: Path, inventory: NodeInventory, *, pool: str, boot_id: str
) -> dict[str, PreparedClaim]:
    """What the CDI specs in ``cdi_root`` say is prepared, as ``RecoveredFromCDI`` checkpoint
    entries. Only reads files; a spec that cannot be understood is logged and skipped."""
    devices: dict[str, list[PreparedDevice]] = {}
    try:
        paths = sorted(cdi_root.glob(f"{cdi.CDI_VENDOR}-*_*.json"))
    except OSError:
        return {}
    for path in paths:
        cdi_class, _, claim_uid = (
            path.name.removeprefix(f"{cdi.CDI_VENDOR}-").removesuffix(".json").partition("_")
        )
        try:
            if cdi_class not in cdi.CDI_CLASSES:
                raise ValueError(f"class {cdi_class!r} is not one of {cdi.CDI_CLASSES}")
            cdi.check_name_part(claim_uid, claim=claim_uid, field="metadata.uid")
            devices.setdefault(claim_uid, []).extend(
                _recover_spec(path, claim_uid, cdi_class, inventory, pool)
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError, ClaimError) as error:
            log.warning(
                "CDI spec not understood, not recovered",
                extra={"path": str(path), "reason": str(error)[:300]},
            )
    return {
        uid: PreparedClaim(
            uid=uid, namespace="", name="", phase=ClaimPhase.RECOVERED, boot_id=boot_id, devices=tuple(found)
        )
        for uid, found in devices.items()
        if found
    }

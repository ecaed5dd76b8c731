"""``DeviceState``: prepare and unprepare claims on this node, crash-safe and idempotent.

Prepare = pure compute (``compute_prepared_devices``), then recorded effects: checkpoint
``PrepareStarted`` (with the computed devices) -> sharing backends' ``acquire`` -> checkpoint
``PrepareCompleted`` -> CDI spec files, last, because the runtime reads them. A claim found
completed during this boot answers the recorded devices (same CDI ids) and re-writes a missing CDI
file; one found started, or completed during an earlier boot, has its effects redone.
Unprepare never needs the API object: the entry goes back to ``PrepareStarted`` (its effects are no
longer vouched for), then CDI files, ``release``, and the entry is removed; unknown claims succeed.

Failed writes (a full disk, a read-only mount). The checkpoint in memory changes only once its file
holds the change (``CheckpointStore``); a write that fails raises ``FileWriteError``, which fails the
RPC, and the kubelet retries. What a failure leaves is always what the checkpoint says, and the
retry converges: a failed ``PrepareStarted`` leaves nothing; after a failed ``PrepareCompleted`` or
CDI write the call's claims are undone like an Unprepare as far as the disk lets that be recorded (a
claim whose demotion cannot be written keeps its effects and its ``PrepareCompleted`` entry, and the
retry re-creates its CDI file; one whose removal cannot be written stays ``PrepareStarted`` without
effects, and the retry redoes it). An Unprepare whose write fails is not answered: its retry
releases again (idempotent) and records it. A restart in between restores only ``PrepareCompleted``
entries, so nothing an Unprepare began comes back.

Capacity. Besides exclusivity (a device prepared whole, or one share id, for one claim only), a share
is refused when it would take its GPU past the capacity the agent publishes (``published_capacity``:
``memory`` and ``compute``), counting every other claim prepared (or started) on that GPU and the
claims before it in the same call; the claim's own earlier record is never counted. The refusal is
the claim's ``CapacityExceededError`` naming device, dimension, requested, already prepared and
capacity, one log line, and ``fractional_plugin_prepare_refused_total{reason="overcommit"}``. It and
the refusal of a share whose sharing backend cannot join the GPU's shares (MPS mixes with nothing
else) are ``ShareRefusedError``s: no retry helps, the claim needs a new allocation, and the DRA
service records the refusal on the claim (``status.devices``, reason ``ShareRefused``).

Re-allocation under the same UID (an Unprepare was missed, or a failed one retried no more). The
recomputed devices are compared with the recorded ones (``PreparedDevice.allocation_key``: device,
share, limits, backend; for ``RecoveredFromCDI`` entries what their CDI spec kept: device and share-id
prefix). When they differ the prepare is redone, never answered from the record and never refused:
the recorded preparation is undone first, exactly like an Unprepare (CDI files, shares, entry), then
the new allocation is prepared like a claim never seen (checked against the other claims like any).
The API's allocation is the truth: the old devices are the API's to give to other claims already,
and refusing would keep them blocked until the kubelet's Unprepare. Logged, and counted in
``fractional_plugin_prepares_redone_total{reason="reallocated"}``.

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
import dataclasses
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
from driver.plugin.atomic import open_lock_file
from driver.plugin.checkpoint import (
    FILE_NAME,
    Checkpoint,
    CheckpointStore,
    ClaimPhase,
    FileWriteError,
    PreparedClaim,
)
from driver.plugin.claims import Claim, ClaimRef
from driver.plugin.devices import (
    MEMORY_STEP_BYTES,
    DeviceCapacity,
    DeviceKind,
    PreparedDevice,
    PrepareSettings,
    compute_prepared_devices,
    published_capacity,
)
from driver.plugin.gpuconfig import check_backend_compatible
from driver.plugin.metrics import PREPARE_REFUSED_TOTAL, PREPARED_CLAIMS, PREPARES_REDONE_TOTAL
from driver.plugin.sharing.base import ShareSpec
from driver.slices import format_binary_quantity

__all__ = [
    "SERIALIZE_LOCK_NAME",
    "CapacityExceededError",
    "DeviceState",
    "EffectHook",
    "PrepareOutcome",
    "ShareRefusedError",
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
``checkpoint-unpreparing`` (the entry is back to ``PrepareStarted``), ``cdi-removed``,
``shares-released``, ``checkpoint-removed``."""


class ShareRefusedError(ClaimError):
    """A share of ``pool``/``device_name`` that this node refuses although the allocation names it:
    it would take the GPU past its published capacity, or its sharing backend cannot live beside the
    GPU's other shares. Retrying cannot help: the claim needs a new allocation (the agent records
    the refusal in the claim's ``status.devices``, ``driver.plugin.status``)."""

    def __init__(self, *, claim: str, field: str, problem: str, pool: str, device_name: str) -> None:
        super().__init__(claim=claim, field=field, problem=problem)
        self.pool = pool
        self.device_name = device_name


class CapacityExceededError(ShareRefusedError):
    """A share would take a device past its published capacity (one dimension: memory or compute)."""

    def __init__(
        self,
        *,
        claim: str,
        device: str,
        dimension: str,
        requested: int,
        prepared: int,
        capacity: int,
        holders: int,
    ) -> None:
        def amount(value: int) -> str:
            return (
                f"{format_binary_quantity(value)} ({value} bytes)" if dimension == "memory" else f"{value}%"
            )

        pool, _, device_name = device.rpartition("/")  # "pool/device": device names hold no slash
        super().__init__(
            claim=claim,
            field=f"device {device}",
            problem=f"{dimension}: requested {amount(requested)} with {amount(prepared)} already prepared "
            f"for {holders} other claim{'s' if holders != 1 else ''}: "
            f"over the capacity of {amount(capacity)}",
            pool=pool,
            device_name=device_name,
        )
        self.device = device
        self.dimension = dimension
        self.requested = requested
        self.prepared = prepared
        self.capacity = capacity


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
        self._capacities = {
            (settings.pool_name or inventory.node_name, gpu.name): published_capacity(gpu)
            for gpu in inventory.gpus
        }
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
            fd = open_lock_file(self._serialize_lock_path)
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
                fd = open_lock_file(self._serialize_lock_path)
                stack.callback(os.close, fd)  # releases the flock
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield

    def _effect(self, effect: str, claim_uid: str) -> None:
        if self._effect_hook is not None:
            self._effect_hook(effect, claim_uid)

    def _update_checkpoint(self, change: Callable[[Checkpoint], Checkpoint]) -> None:
        """Raises ``FileWriteError`` (and changes nothing) when the file cannot be written."""
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
        unexpected error (a bug, a full disk: ``FileWriteError``) undoes every claim this call
        started, as far as the checkpoint can record it, then propagates."""
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
            for uid, release_error in self._undo_reallocated(computed).items():
                outcomes[uid] = release_error
                del computed[uid]
            started, current = self._record_started(computed, outcomes)
            self._run_prepare_effects(started, current, outcomes)
        return outcomes

    def _undo_reallocated(
        self, computed: Mapping[str, tuple[Claim, tuple[PreparedDevice, ...]]]
    ) -> dict[str, ClaimError]:
        """Unprepare the recorded preparation of every claim the API has re-allocated since (other
        devices, shares or limits under the same UID); returns the claims whose old shares could
        not be released (they are not prepared again). ``FileWriteError`` propagates."""
        claims = self._store.load().claims
        stale: dict[str, PreparedClaim] = {}
        for uid, (claim, devices) in computed.items():
            entry = claims.get(uid)
            if entry is None or _same_allocation(entry, devices):
                continue
            stale[uid] = entry
            log.warning(
                "claim re-allocated since it was prepared; undoing the old preparation, preparing the new",
                extra={
                    "claim_uid": uid,
                    "claim": claim.key,
                    "phase": str(entry.phase),
                    "recorded_devices": [f"{d.pool}/{d.device}:{d.share_id}" for d in entry.devices][:8],
                    "allocated_devices": [f"{d.pool}/{d.device}:{d.share_id}" for d in devices][:8],
                },
            )
        if not stale:
            return {}
        errors = self._unprepare_entries(list(stale), stale)  # a recovered claim's start-up hold too
        PREPARES_REDONE_TOTAL.labels(reason="reallocated").inc(len(stale) - len(errors))
        return errors

    def _record_started(
        self,
        computed: Mapping[str, tuple[Claim, tuple[PreparedDevice, ...]]],
        outcomes: dict[str, PrepareOutcome],
    ) -> tuple[dict[str, tuple[Claim, tuple[PreparedDevice, ...]]], dict[str, tuple[PreparedDevice, ...]]]:
        """One transaction: check every claim against the checkpoint (and the claims before it in
        this call) and record ``PrepareStarted``. Returns the claims to run and the claims completed
        during this boot (answered from the checkpoint). ``FileWriteError``: nothing was recorded."""
        started: dict[str, tuple[Claim, tuple[PreparedDevice, ...]]] = {}
        current: dict[str, tuple[PreparedDevice, ...]] = {}
        recovered: dict[str, tuple[PreparedDevice, ...]] = {}
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
                    held.check_capacity(claim, devices, self._capacities)
                except CapacityExceededError as error:
                    outcomes[uid] = error
                    PREPARE_REFUSED_TOTAL.labels(reason="overcommit").inc()
                    log.warning(
                        "claim refused: device over capacity",
                        extra={
                            "claim_uid": uid,
                            "claim": claim.key,
                            "device": error.device,
                            "dimension": error.dimension,
                            "requested": error.requested,
                            "prepared": error.prepared,
                            "capacity": error.capacity,
                        },
                    )
                    continue
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
                    recovered[uid] = entry.devices
            if started:
                tx.commit(Checkpoint(boot_id=tx.checkpoint.boot_id, claims=claims))
        self._recovered_shares.update(recovered)  # only once the file says PrepareStarted
        return started, current

    def _run_prepare_effects(
        self,
        started: Mapping[str, tuple[Claim, tuple[PreparedDevice, ...]]],
        current: Mapping[str, tuple[PreparedDevice, ...]],
        outcomes: dict[str, PrepareOutcome],
    ) -> None:
        for uid in started:
            self._effect("checkpoint-started", uid)
        pending = dict(started)  # started here and not yet finished or undone
        try:
            for uid, devices in current.items():
                self._ensure_cdi_specs(uid, devices)
                outcomes[uid] = devices
            if not started:
                return
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
            self._undo_after_error(pending)
            raise

    def _undo_after_error(self, pending: Mapping[str, tuple[Claim, tuple[PreparedDevice, ...]]]) -> None:
        """Undo the claims of a prepare that failed midway, like an Unprepare of each; what the
        checkpoint cannot record (a full disk) is left as the checkpoint says, and logged."""
        if not pending:
            return
        claims = self._store.load().claims
        entries = {uid: claims[uid] for uid in pending if uid in claims}
        try:
            errors = self._unprepare_entries(list(pending), entries)
        except FileWriteError as error:
            log.error(
                "failed prepare not fully undone; the checkpoint says what is left",
                extra={"claims": sorted(pending)[:20], "reason": str(error)},
            )
            return
        for uid, claim_error in errors.items():
            log.error("failed prepare not undone", extra={"claim_uid": uid, "reason": str(claim_error)})

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

    def _write_cdi_spec(self, claim_uid: str, cdi_class: str, spec: Mapping[str, object]) -> None:
        try:
            cdi.write_cdi_spec(self._cdi_root, cdi_class, claim_uid, spec)
        except OSError as error:
            path = cdi.claim_spec_path(self._cdi_root, cdi_class, claim_uid)
            raise FileWriteError(path=path, problem=error.strerror or repr(error)) from error

    def _write_cdi_specs(self, claim_uid: str, devices: tuple[PreparedDevice, ...]) -> None:
        for cdi_class, spec in _render_specs(devices).items():
            self._write_cdi_spec(claim_uid, cdi_class, spec)

    def _ensure_cdi_specs(self, claim_uid: str, devices: tuple[PreparedDevice, ...]) -> None:
        """Re-create spec files that disappeared (``/var/run/cdi`` is tmpfs, or someone deleted them)."""
        for cdi_class, spec in _render_specs(devices).items():
            if not cdi.spec_in_place(cdi.claim_spec_path(self._cdi_root, cdi_class, claim_uid)):
                self._write_cdi_spec(claim_uid, cdi_class, spec)
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
        """``unprepare`` for the claims of one call, with two checkpoint writes for all of them:
        claim UID -> whether it was in the checkpoint, or why it could not be undone.
        ``FileWriteError`` (a full disk): not done; the retry does it."""
        uids: list[str] = list(dict.fromkeys(ref.uid for ref in refs))
        with self._serialized_many(uids):
            claims = self._store.load().claims
            entries = {uid: claims[uid] for uid in uids if uid in claims}
            errors = self._unprepare_entries(uids, entries)
        return {uid: errors.get(uid, uid in entries) for uid in uids}

    def _unprepare_entries(
        self, uids: Sequence[str], entries: Mapping[str, PreparedClaim]
    ) -> dict[str, ClaimError]:
        """Under the claims' locks: undo ``uids`` (``entries``: their checkpoint entries, where they
        have one). First every entry that vouches for its effects goes back to ``PrepareStarted``
        (if that write fails, nothing was changed), then CDI files go and shares are released, then
        the entries are removed (if that write fails, they stay ``PrepareStarted``: true, since
        their effects may be gone). Returns the claims whose shares could not be released (their
        entries stay); ``FileWriteError`` propagates."""
        vouching = {
            uid: dataclasses.replace(entry, phase=ClaimPhase.STARTED)
            for uid, entry in entries.items()
            if entry.phase is not ClaimPhase.STARTED
        }
        if vouching:
            self._update_checkpoint(lambda checkpoint: _with_changes(checkpoint, vouching, []))
            for uid in vouching:
                self._effect("checkpoint-unpreparing", uid)
        errors: dict[str, ClaimError] = {}
        removed: list[str] = []
        for uid in uids:
            entry = entries.get(uid)
            try:
                cdi.remove_claim_specs(self._cdi_root, uid)
                self._effect("cdi-removed", uid)
                if entry is not None:
                    self._release(uid, entry.devices)
                    self._effect("shares-released", uid)
                    removed.append(uid)
            except ClaimError as error:
                errors[uid] = error
        if removed:
            self._update_checkpoint(lambda checkpoint: _with_changes(checkpoint, {}, removed))
            for removed_uid in removed:
                self._effect("checkpoint-removed", removed_uid)
        return errors

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
        Returns how many claims were restored; a claim that fails (its CDI file cannot be written:
        the kubelet's next Prepare re-creates it) is logged and skipped."""
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
                except (ClaimError, FileWriteError) as error:
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


def _same_allocation(entry: PreparedClaim, devices: tuple[PreparedDevice, ...]) -> bool:
    """Whether ``entry`` records the allocation ``devices`` was computed from. A recovered entry
    knows only what its CDI spec kept (device, share-id prefix), in the spec's order."""
    if entry.phase is ClaimPhase.RECOVERED:

        def kept(device: PreparedDevice) -> tuple[str, str, str, str | None]:
            prefix = None if device.share_id is None else device.share_id[: cdi.SHARE_PREFIX_LENGTH]
            return (str(device.kind), device.pool, device.device, prefix)

        return sorted(map(kept, entry.devices), key=repr) == sorted(map(kept, devices), key=repr)
    return [device.allocation_key() for device in entry.devices] == [
        device.allocation_key() for device in devices
    ]


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
                    try:
                        check_backend_compatible(held.backend, device.backend, device.device, claim=claim.key)
                    except ClaimError as error:  # the GPU's other shares stay: this allocation cannot
                        raise ShareRefusedError(
                            claim=error.claim,
                            field=error.field,
                            problem=error.problem,
                            pool=device.pool,
                            device_name=device.device,
                        ) from error
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

    def check_capacity(
        self,
        claim: Claim,
        devices: tuple[PreparedDevice, ...],
        capacities: Mapping[tuple[str, str], DeviceCapacity],
    ) -> None:
        """``CapacityExceededError`` when the claim's shares of a GPU and the other claims' shares
        held on it together exceed the GPU's published memory or compute. Whole-GPU (exclusive)
        allocations are left to ``check_not_in_use``; admin access consumes nothing."""
        requested: dict[tuple[str, str], list[ShareSpec]] = {}
        for device in devices:
            if device.share is not None and device.share_id is not None and not device.admin_access:
                requested.setdefault((device.pool, device.device), []).append(device.share)
        for key, shares in requested.items():
            capacity = capacities.get(key)
            if capacity is None:
                continue
            others = [
                held.share
                for other, held in self._held.get(key, ())
                if other.uid != claim.uid and held.share is not None
            ]
            holders = len({other.uid for other, held in self._held.get(key, ()) if other.uid != claim.uid})
            for dimension, limit, amount in (
                ("memory", capacity.memory_bytes, _memory_bytes),
                ("compute", capacity.compute_percent, _compute_percent),
            ):
                wanted = sum(map(amount, shares))
                prepared = sum(map(amount, others))
                if wanted + prepared > limit:
                    raise CapacityExceededError(
                        claim=claim.key,
                        device=f"{key[0]}/{key[1]}",
                        dimension=dimension,
                        requested=wanted,
                        prepared=prepared,
                        capacity=limit,
                        holders=holders,
                    )


def _memory_bytes(share: ShareSpec) -> int:
    return share.memory_bytes


def _compute_percent(share: ShareSpec) -> int:
    return share.compute_percent


def _same_share(device: PreparedDevice, held: PreparedDevice, holder: PreparedClaim) -> bool:
    assert device.share_id is not None and held.share_id is not None
    if holder.phase is ClaimPhase.RECOVERED:  # a CDI device name keeps only the share id's prefix
        return device.share_id.startswith(held.share_id)
    return device.share_id == held.share_id


# -- start-up hygiene and recovery ---------------------------------------------------------------


def remove_leftover_temp_files(plugin_dir: Path, cdi_root: Path) -> list[Path]:
    """Delete the temp files of atomic writes that a kill -9 interrupted: ``.checkpoint.json.*.tmp``
    in the plugin dir, ``.k8s.fractional.dev-*.json.*.tmp`` in the CDI root. Only our own names;
    the caller makes sure no write is in flight. Also entries named like our CDI specs that are
    not regular files (a symlink to a foreign spec, a FIFO: planted, never ours) are unlinked
    (logged; never followed), so the specs are written again in their place; a directory so
    named is logged and left."""
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
    removed += cdi.remove_planted_specs(cdi_root)
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
    """The devices one of our CDI spec files names (``<uid>-<device>[-<share-id prefix>]``).
    Only a regular file counts (``UnsafeEntryError`` otherwise): a FIFO never blocks, a symlink
    to another spec is never read as ours."""
    spec = json.loads(cdi.read_claim_spec(path, max_bytes=MAX_RECOVERED_SPEC_BYTES))
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

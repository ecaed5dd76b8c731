"""``DeviceState``: prepare and unprepare claims on this node, crash-safe and idempotent.

Prepare = pure compute (``compute_prepared_devices``), then recorded effects: checkpoint
``PrepareStarted`` (with the computed devices) -> sharing backends' ``acquire`` -> checkpoint
``PrepareCompleted`` -> CDI spec files, last, because the runtime reads them. A claim found
completed during this boot answers the recorded devices (same CDI ids) and re-writes a missing CDI
file; one found started, or completed during an earlier boot, has its effects redone.
Unprepare never needs the API object: CDI files first, then ``release``, then the checkpoint entry;
unknown claims succeed.

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
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from driver.errors import ClaimError
from driver.inventory.model import NodeInventory
from driver.plugin import cdi
from driver.plugin.checkpoint import Checkpoint, CheckpointStore, ClaimPhase, PreparedClaim
from driver.plugin.claims import Claim, ClaimRef
from driver.plugin.devices import DeviceKind, PreparedDevice, PrepareSettings, compute_prepared_devices
from driver.plugin.gpuconfig import check_backend_compatible
from driver.plugin.metrics import PREPARED_CLAIMS

__all__ = ["SERIALIZE_LOCK_NAME", "DeviceState", "EffectHook"]

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
        self._store = CheckpointStore(plugin_dir, boot_id=boot_id, cache=not rolling_update)
        self._serialize_lock_path = self._plugin_dir / SERIALIZE_LOCK_NAME if rolling_update else None
        self._claim_locks = _ClaimLocks()
        self._effect_hook = effect_hook

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

    def _effect(self, effect: str, claim_uid: str) -> None:
        if self._effect_hook is not None:
            self._effect_hook(effect, claim_uid)

    def _update_checkpoint(self, change: Callable[[Checkpoint], Checkpoint]) -> None:
        checkpoint = self._store.update(change)
        PREPARED_CLAIMS.set(len(checkpoint.claims))

    # -- prepare -------------------------------------------------------------------------------

    def prepare(self, claim: Claim) -> tuple[PreparedDevice, ...]:
        """The claim's devices; ``ClaimError`` (nothing left behind) when it cannot be prepared."""
        computed = compute_prepared_devices(claim, self._inventory, self._settings)
        uid = claim.uid
        with self._serialized(uid):
            with self._store.transaction() as tx:  # check and record under one lock
                entry = tx.checkpoint.claims.get(uid)
                if entry is not None and entry.is_current(self._boot_id):
                    devices = entry.devices
                else:
                    devices = entry.devices if entry is not None else computed
                    _check_not_in_use(tx.checkpoint, claim, devices)
                    started = PreparedClaim(
                        uid=uid,
                        namespace=claim.ref.namespace,
                        name=claim.ref.name,
                        phase=ClaimPhase.STARTED,
                        boot_id=self._boot_id,
                        devices=devices,
                    )
                    tx.commit(tx.checkpoint.with_claim(started))
            if entry is not None and entry.is_current(self._boot_id):
                self._ensure_cdi_specs(uid, devices)
                return devices
            self._effect("checkpoint-started", uid)
            try:
                self._acquire(devices)
                self._effect("shares-acquired", uid)
                completed = PreparedClaim(
                    uid=uid,
                    namespace=claim.ref.namespace,
                    name=claim.ref.name,
                    phase=ClaimPhase.COMPLETED,
                    boot_id=self._boot_id,
                    devices=devices,
                )
                self._update_checkpoint(lambda checkpoint: checkpoint.with_claim(completed))
                self._effect("checkpoint-completed", uid)
                self._write_cdi_specs(uid, devices)
                self._effect("cdi-written", uid)
            except (
                Exception
            ):  # undo, then re-raise; a BaseException (exit, kill) is a crash: the restart recovers
                self._undo_prepare(uid, devices)
                raise
        return devices

    def _acquire(self, devices: tuple[PreparedDevice, ...]) -> None:
        for device in devices:
            if device.share is not None and device.backend is not None:
                self._settings.backends[device.backend].acquire(device.share)

    def _undo_prepare(self, claim_uid: str, devices: tuple[PreparedDevice, ...]) -> None:
        cdi.remove_claim_specs(self._cdi_root, claim_uid)
        self._release(claim_uid, devices)
        self._update_checkpoint(lambda checkpoint: checkpoint.without(claim_uid))

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
        uid = ref.uid
        with self._serialized(uid):
            entry = self._store.load().claims.get(uid)
            cdi.remove_claim_specs(self._cdi_root, uid)
            self._effect("cdi-removed", uid)
            if entry is None:
                return False
            self._release(uid, entry.devices)
            self._effect("shares-released", uid)
            self._update_checkpoint(lambda checkpoint: checkpoint.without(uid))
            self._effect("checkpoint-removed", uid)
        return True

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
        """At agent start: re-acquire the shares of claims completed during this boot and re-create
        their missing CDI files. Entries of earlier boots wait for the kubelet's next Prepare.
        Returns how many claims were restored; a claim that fails is logged and skipped."""
        checkpoint = self._store.load()
        PREPARED_CLAIMS.set(len(checkpoint.claims))
        restored = 0
        for uid, entry in sorted(checkpoint.claims.items()):
            if not entry.is_current(self._boot_id):
                continue
            with self._serialized(uid):
                try:
                    self._acquire(entry.devices)
                    self._ensure_cdi_specs(uid, entry.devices)
                except ClaimError as error:
                    log.error("prepared claim not restored", extra={"claim_uid": uid, "reason": str(error)})
                    continue
            restored += 1
        return restored

    def prepared_claims(self) -> Mapping[str, PreparedClaim]:
        return dict(self._store.load().claims)


def _render_specs(devices: tuple[PreparedDevice, ...]) -> dict[str, dict[str, object]]:
    specs = {}
    for kind in DeviceKind:
        pairs = [(device.cdi_name, device.edits) for device in devices if device.kind is kind]
        if pairs:
            specs[str(kind)] = cdi.render_claim_spec(str(kind), pairs)
    return specs


def _check_not_in_use(checkpoint: Checkpoint, claim: Claim, devices: tuple[PreparedDevice, ...]) -> None:
    """Last line of defence: a device held exclusively (or a share id) by another prepared claim,
    or a share whose sharing backend cannot live beside the device's other shares (MPS)."""
    for device in devices:
        if device.admin_access:
            continue
        for other in checkpoint.claims.values():
            if other.uid == claim.uid:
                continue
            for held in other.devices:
                if held.admin_access or (held.pool, held.device) != (device.pool, device.device):
                    continue
                if device.backend is not None:
                    check_backend_compatible(held.backend, device.backend, device.device, claim=claim.key)
                if device.share_id is None or held.share_id is None or device.share_id == held.share_id:
                    raise ClaimError(
                        claim=claim.key,
                        field=f"device {device.pool}/{device.device}",
                        problem=f"already prepared for ResourceClaim {other.namespace}/{other.name} "
                        f"({other.uid})"
                        + (" exclusively" if held.share_id is None else f" with share {held.share_id}"),
                    )

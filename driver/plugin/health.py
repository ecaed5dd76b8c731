"""Device health: a monitor thread on NVML events (or a health file for fake devices), and taints.

NVML mode (``nvml`` given, initialised by the caller): one event set, every GPU registered for
``XidCriticalError | DoubleBitEccError`` (as far as it supports them). The ``health-monitor``
thread waits on the set with a ``poll_seconds`` timeout, so ``stop`` is honoured quickly:

- a critical XID marks the GPU UNHEALTHY with the XID; XIDs in ``ignored_xids`` (informational:
  13, 31, 43, 45, 68, 109 by default) are logged and skipped;
- a double-bit ECC error marks it UNHEALTHY (reason ``double-bit-ecc``);
- ``NVML_ERROR_GPU_IS_LOST`` (from the wait or registration) marks every GPU UNHEALTHY (``gpu-lost``);
- recovery: for every UNHEALTHY GPU (not lost), once ``min_unhealthy_seconds`` have passed since
  its last fault, the recovery action is read each round (``nvmlDeviceGetGpuRecoveryAction``
  where the module has it, else the field value ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``); ``NONE``
  makes it HEALTHY again. Where the driver does not report it, the GPU stays UNHEALTHY until the
  agent restarts.

File mode (``health_file``, fake devices): a JSON object such as
``{"gpu-1": {"xid": 79, "message": "GPU has fallen off the bus"}}`` (``xid`` may be null); the
file is re-read when its mtime, size or inode changes; a device missing from it (or a missing
file) is HEALTHY. Ignored XIDs are skipped there too. A device is UNHEALTHY if any source says so.

``on_change`` gets the full snapshot (every device) after each change, from the monitor thread,
with no lock held. ``build_health_taints`` turns a snapshot into ResourceSlice device taints.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

from driver import DRIVER_NAME
from driver.inventory.model import NodeInventory

__all__ = [
    "DEFAULT_IGNORED_XIDS",
    "HEALTH_TAINT_KEY",
    "DeviceHealth",
    "HealthMonitor",
    "build_health_taints",
]

log = logging.getLogger(__name__)

MAX_FILE_MESSAGE_CHARS = 256  # of a health file entry's message (it is shown in events and logs)

DEFAULT_IGNORED_XIDS = (13, 31, 43, 45, 68, 109)
HEALTH_TAINT_KEY = f"{DRIVER_NAME}/unhealthy"
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
# Fallbacks for modules without the constants (pynvml's values).
_EVENT_XID = 8  # nvmlEventTypeXidCriticalError
_EVENT_DBE = 2  # nvmlEventTypeDoubleBitEccError
_ERROR_TIMEOUT = 10
_ERROR_GPU_IS_LOST = 15
_ERROR_NOT_SUPPORTED = 3
_FIELD_RECOVERY_ACTION = 230
_RECOVERY_NONE = 0


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    device: str  # "gpu-0"
    healthy: bool
    xid: int | None = None
    message: str = ""
    last_updated: float = 0.0  # unix seconds of the last change
    reason: str = ""  # "xid-79", "double-bit-ecc", "gpu-lost", "unhealthy"; "" when healthy


@dataclass(frozen=True, slots=True)
class _Fault:
    xid: int | None
    message: str
    reason: str
    raised_at: float = 0.0  # time.monotonic()


def build_health_taints(snapshot: Mapping[str, DeviceHealth]) -> dict[str, list[dict[str, str]]]:
    """Pure: unhealthy device name -> its taints (``fractional.dev/unhealthy``, NoSchedule).

    Healthy devices are absent. The value (``xid-79``, ``gpu-lost``, ...) is a valid label value.
    """
    taints: dict[str, list[dict[str, str]]] = {}
    for name in sorted(snapshot):
        health = snapshot[name]
        if health.healthy:
            continue
        value = health.reason or (f"xid-{health.xid}" if health.xid is not None else "unhealthy")
        taints[name] = [{"key": HEALTH_TAINT_KEY, "value": _label_value(value), "effect": "NoSchedule"}]
    return taints


def _label_value(text: str) -> str:
    value = re.sub(r"[^-A-Za-z0-9_.]+", "-", text)[:63].strip("-_.")
    return value if _LABEL_VALUE.fullmatch(value) else "unhealthy"


class HealthMonitor:
    """Watches the node's GPUs; ``start()`` then ``snapshot()``; ends when ``stop`` is set."""

    def __init__(
        self,
        inventory: NodeInventory,
        *,
        on_change: Callable[[Mapping[str, DeviceHealth]], None],
        stop: threading.Event,
        nvml: ModuleType | Any | None = None,
        health_file: str | None = None,
        ignored_xids: Iterable[int] = DEFAULT_IGNORED_XIDS,
        poll_seconds: float = 0.2,
        min_unhealthy_seconds: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._devices = tuple(gpu.name for gpu in inventory.gpus)
        self._uuids = {gpu.uuid: gpu.name for gpu in inventory.gpus}
        self._on_change = on_change
        self._stop = stop
        self._nvml = nvml
        self._health_file = health_file
        self._ignored = frozenset(ignored_xids)
        self._poll_seconds = poll_seconds
        self._min_unhealthy_seconds = min_unhealthy_seconds
        self._clock = clock
        self._lock = threading.Lock()  # guards _snapshot; never held while calling on_change
        started = clock()
        self._snapshot = {name: DeviceHealth(name, True, last_updated=started) for name in self._devices}
        # Owned by the monitor thread (and start() before the thread runs).
        self._nvml_faults: dict[str, _Fault] = {}
        self._file_faults: dict[str, _Fault] = {}
        self._file_signature: tuple[int, int, int] | None = None
        self._event_set: Any = None
        self._handles: dict[str, Any] = {}
        self._thread: threading.Thread | None = None

    # -- public --------------------------------------------------------------------------------

    def start(self) -> None:
        """Register for NVML events (synchronously, so errors show now) and start the thread."""
        if self._nvml is not None:
            self._register_events()
        if self._event_set is None and self._health_file is None:
            log.info("health monitoring off", extra={"devices": len(self._devices)})
            return
        self._thread = threading.Thread(target=self._run, name="health-monitor", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def snapshot(self) -> dict[str, DeviceHealth]:
        with self._lock:
            return dict(self._snapshot)

    # -- loop ----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._check_file()
            self._publish()
            while not self._stop.is_set():
                try:
                    self._round()
                except Exception:  # a bug in one round must not end health monitoring
                    log.exception("health round failed")
                    self._stop.wait(max(self._poll_seconds, 1.0))
                self._publish()
        finally:
            self._free_event_set()

    def _round(self) -> None:
        if self._event_set is not None:
            self._check_recovery()
            self._wait_for_event()
        else:
            self._stop.wait(self._poll_seconds)
        self._check_file()

    def _publish(self) -> None:
        """Merge the sources; on a change, store the new snapshot and call ``on_change``."""
        now = self._clock()
        changed = False
        with self._lock:
            for name in self._devices:
                fault = self._nvml_faults.get(name) or self._file_faults.get(name)
                old = self._snapshot[name]
                if fault is None:
                    new = DeviceHealth(name, True, last_updated=old.last_updated)
                    if not old.healthy:
                        new = replace(new, last_updated=now)
                else:
                    new = DeviceHealth(name, False, fault.xid, fault.message, old.last_updated, fault.reason)
                    if old.healthy or (old.xid, old.message, old.reason) != (
                        fault.xid,
                        fault.message,
                        fault.reason,
                    ):
                        new = replace(new, last_updated=now)
                if new != old:
                    self._snapshot[name] = new
                    changed = True
                    log.warning(
                        "device health changed",
                        extra={"device": name, "healthy": new.healthy, "xid": new.xid, "reason": new.reason},
                    )
            snapshot = dict(self._snapshot)
        if changed:
            self._on_change(snapshot)

    # -- NVML ----------------------------------------------------------------------------------

    def _const(self, name: str, default: int) -> int:
        return int(getattr(self._nvml, name, default))

    def _register_events(self) -> None:
        nvml = self._nvml
        assert nvml is not None
        try:
            event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as error:
            log.warning("nvml events unavailable, health not monitored", extra={"error": str(error)})
            return
        wanted = self._const("nvmlEventTypeXidCriticalError", _EVENT_XID) | self._const(
            "nvmlEventTypeDoubleBitEccError", _EVENT_DBE
        )
        for uuid, name in self._uuids.items():
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
                mask = wanted
                try:
                    mask &= int(nvml.nvmlDeviceGetSupportedEventTypes(handle))
                except nvml.NVMLError as error:
                    if getattr(error, "value", None) != self._const(
                        "NVML_ERROR_NOT_SUPPORTED", _ERROR_NOT_SUPPORTED
                    ):
                        raise
                if not mask:
                    log.warning("device health not monitored", extra={"device": name, "reason": "no events"})
                    continue
                nvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
                self._handles[name] = handle
            except nvml.NVMLError as error:
                if getattr(error, "value", None) == self._const("NVML_ERROR_GPU_IS_LOST", _ERROR_GPU_IS_LOST):
                    self._nvml_faults[name] = _Fault(None, "GPU is lost", "gpu-lost")
                    continue
                log.warning("device health not monitored", extra={"device": name, "error": str(error)})
        self._event_set = event_set

    def _free_event_set(self) -> None:
        if self._event_set is None or self._nvml is None:
            return
        try:
            self._nvml.nvmlEventSetFree(self._event_set)
        except self._nvml.NVMLError as error:
            log.warning("nvml event set not freed", extra={"error": str(error)})
        self._event_set = None

    def _wait_for_event(self) -> None:
        nvml = self._nvml
        assert nvml is not None
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        try:
            data = wait(self._event_set, max(1, int(self._poll_seconds * 1000)))
        except nvml.NVMLError as error:
            code = getattr(error, "value", None)
            if code == self._const("NVML_ERROR_TIMEOUT", _ERROR_TIMEOUT):
                return
            if code == self._const("NVML_ERROR_GPU_IS_LOST", _ERROR_GPU_IS_LOST):
                for device in self._devices:
                    self._nvml_faults[device] = _Fault(None, "GPU is lost", "gpu-lost")
                self._stop.wait(self._poll_seconds)  # the wait keeps failing: do not spin
                return
            raise
        try:
            name = self._uuids.get(str(nvml.nvmlDeviceGetUUID(data.device)))
        except nvml.NVMLError as error:
            log.warning("nvml event for an unknown device", extra={"error": str(error)})
            return
        if name is None:
            return
        event_type = int(data.eventType)
        if event_type & self._const("nvmlEventTypeXidCriticalError", _EVENT_XID):
            xid = int(data.eventData)
            if xid in self._ignored:
                log.info("informational xid ignored", extra={"device": name, "xid": xid})
                return
            self._record_fault(name, _Fault(xid, f"XID {xid}", f"xid-{xid}", time.monotonic()))
        elif event_type & self._const("nvmlEventTypeDoubleBitEccError", _EVENT_DBE):
            self._record_fault(name, _Fault(None, "double-bit ECC error", "double-bit-ecc", time.monotonic()))

    def _record_fault(self, name: str, fault: _Fault) -> None:
        current = self._nvml_faults.get(name)
        if current is not None and current.reason == "gpu-lost":
            return  # lost stays lost: only a restart (a reset GPU) clears it
        self._nvml_faults[name] = fault

    def _check_recovery(self) -> None:
        now = time.monotonic()
        for name, fault in list(self._nvml_faults.items()):
            if fault.reason == "gpu-lost" or name not in self._handles:
                continue
            if now - fault.raised_at < self._min_unhealthy_seconds:
                continue  # the driver may publish the recovery action after the event
            action = self._recovery_action(self._handles[name])
            if action == self._const("NVML_GPU_RECOVERY_ACTION_NONE", _RECOVERY_NONE):
                log.info("device recovered", extra={"device": name, "xid": fault.xid})
                del self._nvml_faults[name]

    def _recovery_action(self, handle: Any) -> int | None:
        nvml = self._nvml
        assert nvml is not None
        try:
            if hasattr(nvml, "nvmlDeviceGetGpuRecoveryAction"):
                return int(nvml.nvmlDeviceGetGpuRecoveryAction(handle))
            field = self._const("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", _FIELD_RECOVERY_ACTION)
            value = nvml.nvmlDeviceGetFieldValues(handle, [field])[0]
        except nvml.NVMLError:
            return None  # not reported by this driver: stays unhealthy
        if int(value.nvmlReturn) != self._const("NVML_SUCCESS", 0):
            return None
        return int(value.value.uiVal)

    # -- health file ---------------------------------------------------------------------------

    def _check_file(self) -> None:
        if self._health_file is None:
            return
        try:
            stat = os.stat(self._health_file)
        except FileNotFoundError:
            self._file_signature = None
            self._file_faults = {}
            return
        except OSError as error:  # EACCES, ENOTDIR, ...: like an unreadable file, retried next round
            log.warning("health file unreadable, kept the last state", extra={"error": str(error)})
            return
        signature = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if signature == self._file_signature:
            return
        try:
            with open(self._health_file) as handle:
                data = json.load(handle)
        except (OSError, ValueError, RecursionError) as error:  # RecursionError: nested too deep
            log.warning("health file unreadable, kept the last state", extra={"error": str(error)[:300]})
            return  # retried next round: the signature is not recorded
        self._file_signature = signature
        if not isinstance(data, dict):
            log.warning("health file is not an object, ignored", extra={"path": self._health_file})
            self._file_faults = {}
            return
        self._file_faults = self._parse_file(data)

    def _parse_file(self, data: Mapping[str, Any]) -> dict[str, _Fault]:
        faults: dict[str, _Fault] = {}
        for name, entry in data.items():
            if name not in self._devices:
                log.warning("health file names an unknown device", extra={"device": str(name)[:64]})
                continue
            entry = entry if isinstance(entry, dict) else {}
            xid = entry.get("xid")
            xid = xid if isinstance(xid, int) and not isinstance(xid, bool) else None
            message = str(entry.get("message", ""))[:MAX_FILE_MESSAGE_CHARS]
            if xid is not None and xid in self._ignored:
                log.info("informational xid ignored", extra={"device": name, "xid": xid})
                continue
            reason = f"xid-{xid}" if xid is not None else "unhealthy"
            faults[name] = _Fault(xid, message or (f"XID {xid}" if xid is not None else "unhealthy"), reason)
        return faults

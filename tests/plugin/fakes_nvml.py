"""A fake pynvml module for the sharing and health tests (only NVML is mocked).

``FakeNVML(["GPU-a", "GPU-b"])`` behaves like the parts of ``pynvml`` the node agent uses for
compute modes and health events, with the same names, constants and error class (an
``NVMLError`` carrying ``.value``). Test hooks: ``inject_xid``, ``inject_double_bit_ecc``,
``inject_gpu_lost``, ``set_recovery_action``; ``compute_mode_calls`` records every
``nvmlDeviceSetComputeMode``.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class FakeHandle:
    uuid: str
    compute_mode: int = 0
    recovery_action: int = 0
    supported_events: int = 0xFFFF
    registered: int = 0


@dataclass
class FakeEventSet:
    events: queue.Queue[Any] = field(default_factory=queue.Queue)
    freed: bool = False


class FakeNVML:
    NVML_SUCCESS = 0
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_COMPUTEMODE_DEFAULT = 0
    NVML_COMPUTEMODE_EXCLUSIVE_THREAD = 1
    NVML_COMPUTEMODE_PROHIBITED = 2
    NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = 3
    nvmlEventTypeSingleBitEccError = 1
    nvmlEventTypeDoubleBitEccError = 2
    nvmlEventTypeXidCriticalError = 8
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
    NVML_GPU_RECOVERY_ACTION_NONE = 0
    NVML_GPU_RECOVERY_ACTION_GPU_RESET = 1
    NVML_GPU_RECOVERY_ACTION_NODE_REBOOT = 2
    NVMLError = NVMLError

    def __init__(self, uuids: list[str], *, compute_mode: int = 0) -> None:
        self.handles = {uuid: FakeHandle(uuid, compute_mode=compute_mode) for uuid in uuids}
        self.compute_mode_calls: list[tuple[str, int]] = []
        self.event_sets: list[FakeEventSet] = []
        self.lost = False
        self.fail_set_compute_mode: int | None = None  # an NVML error code to raise
        self._lock = threading.Lock()

    # -- pynvml surface ----------------------------------------------------------------------

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeHandle:
        if uuid not in self.handles:
            raise NVMLError(6)  # NOT_FOUND
        return self.handles[uuid]

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        return handle.uuid

    def nvmlDeviceGetComputeMode(self, handle: FakeHandle) -> int:
        return handle.compute_mode

    def nvmlDeviceSetComputeMode(self, handle: FakeHandle, mode: int) -> None:
        if self.fail_set_compute_mode is not None:
            raise NVMLError(self.fail_set_compute_mode)
        with self._lock:
            self.compute_mode_calls.append((handle.uuid, mode))
            handle.compute_mode = mode

    def nvmlEventSetCreate(self) -> FakeEventSet:
        event_set = FakeEventSet()
        self.event_sets.append(event_set)
        return event_set

    def nvmlDeviceGetSupportedEventTypes(self, handle: FakeHandle) -> int:
        return handle.supported_events

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, mask: int, event_set: FakeEventSet) -> None:
        if self.lost:
            raise NVMLError(self.NVML_ERROR_GPU_IS_LOST)
        handle.registered |= mask

    def nvmlEventSetWait_v2(self, event_set: FakeEventSet, timeout_ms: int) -> Any:
        try:
            item = event_set.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise NVMLError(self.NVML_ERROR_TIMEOUT) from None
        if isinstance(item, NVMLError):
            raise item
        return item

    def nvmlEventSetFree(self, event_set: FakeEventSet) -> None:
        event_set.freed = True

    def nvmlDeviceGetFieldValues(self, handle: FakeHandle, field_ids: list[int]) -> list[Any]:
        values = []
        for field_id in field_ids:
            if field_id == self.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
                value = SimpleNamespace(uiVal=handle.recovery_action, ullVal=handle.recovery_action)
                values.append(SimpleNamespace(fieldId=field_id, nvmlReturn=0, value=value))
            else:
                values.append(
                    SimpleNamespace(fieldId=field_id, nvmlReturn=self.NVML_ERROR_NOT_SUPPORTED, value=None)
                )
        return values

    # -- test hooks --------------------------------------------------------------------------

    def _emit(self, item: Any) -> None:
        for event_set in self.event_sets:
            if not event_set.freed:
                event_set.events.put(item)

    def inject_xid(self, uuid: str, xid: int, *, recovery_action: int = 1) -> None:
        handle = self.handles[uuid]
        handle.recovery_action = recovery_action
        self._emit(
            SimpleNamespace(device=handle, eventType=self.nvmlEventTypeXidCriticalError, eventData=xid)
        )

    def inject_double_bit_ecc(self, uuid: str, *, recovery_action: int = 1) -> None:
        handle = self.handles[uuid]
        handle.recovery_action = recovery_action
        self._emit(SimpleNamespace(device=handle, eventType=self.nvmlEventTypeDoubleBitEccError, eventData=0))

    def inject_gpu_lost(self) -> None:
        self.lost = True
        self._emit(NVMLError(self.NVML_ERROR_GPU_IS_LOST))

    def set_recovery_action(self, uuid: str, action: int) -> None:
        self.handles[uuid].recovery_action = action

    def modes(self) -> dict[str, int]:
        return {uuid: handle.compute_mode for uuid, handle in self.handles.items()}

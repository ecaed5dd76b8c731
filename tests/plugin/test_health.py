"""The health monitor (NVML events through the fake NVML module; the fake health file) and taints."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from driver.inventory.model import GPU, NodeInventory
from driver.plugin.health import HEALTH_TAINT_KEY, DeviceHealth, HealthMonitor, build_health_taints
from tests.plugin.fakes_nvml import FakeNVML

UUIDS = ["GPU-00000000-0000-4000-8000-000000000000", "GPU-11111111-1111-4111-8111-111111111111"]
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def make_inventory() -> NodeInventory:
    gpus = tuple(
        GPU(
            name=f"gpu-{i}",
            uuid=uuid,
            product_name="NVIDIA H200",
            brand="Tesla",
            architecture="Hopper",
            cuda_compute_capability="9.0.0",
            memory_bytes=140 * 1024**3,
            multiprocessors=132,
            pci_bus_id=f"0000:{i + 1:02x}:00.0",
        )
        for i, uuid in enumerate(UUIDS)
    )
    return NodeInventory(node_name="node-a", gpus=gpus)


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        pause.wait(0.01)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[dict[str, DeviceHealth]] = []
        self.lock = threading.Lock()

    def __call__(self, snapshot: Mapping[str, DeviceHealth]) -> None:
        with self.lock:
            self.calls.append(dict(snapshot))

    def last(self) -> dict[str, DeviceHealth]:
        with self.lock:
            return self.calls[-1] if self.calls else {}

    def count(self) -> int:
        with self.lock:
            return len(self.calls)


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()


def start_monitor(stop: threading.Event, recorder: Recorder, **kwargs: Any) -> HealthMonitor:
    kwargs.setdefault("poll_seconds", 0.02)
    monitor = HealthMonitor(make_inventory(), on_change=recorder, stop=stop, **kwargs)
    monitor.start()
    return monitor


def unhealthy(recorder: Recorder, device: str, xid: int | None = None) -> bool:
    health = recorder.last().get(device)
    return health is not None and not health.healthy and (xid is None or health.xid == xid)


def healthy(recorder: Recorder, device: str) -> bool:
    health = recorder.last().get(device)
    return health is not None and health.healthy


# -- NVML mode ---------------------------------------------------------------------------------


def test_a_critical_xid_marks_the_device_unhealthy_then_recovery_none_clears_it(
    stop: threading.Event,
) -> None:
    nvml = FakeNVML(UUIDS)
    recorder = Recorder()
    monitor = start_monitor(stop, recorder, nvml=nvml, min_unhealthy_seconds=0)
    registered = nvml.handles[UUIDS[1]].registered
    assert registered == nvml.nvmlEventTypeXidCriticalError | nvml.nvmlEventTypeDoubleBitEccError

    nvml.inject_xid(UUIDS[1], 79, recovery_action=nvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    assert wait_for(lambda: unhealthy(recorder, "gpu-1", 79))
    state = monitor.snapshot()
    assert state["gpu-1"].reason == "xid-79" and state["gpu-1"].last_updated > 0
    assert state["gpu-0"].healthy

    nvml.set_recovery_action(UUIDS[1], nvml.NVML_GPU_RECOVERY_ACTION_NONE)
    assert wait_for(lambda: healthy(recorder, "gpu-1"))
    recovered = monitor.snapshot()["gpu-1"]
    assert (recovered.xid, recovered.message, recovered.reason) == (None, "", "")
    assert recovered.last_updated >= state["gpu-1"].last_updated
    stop.set()
    monitor.join(5)
    assert nvml.event_sets[0].freed


def test_an_ignored_xid_changes_nothing(stop: threading.Event) -> None:
    nvml = FakeNVML(UUIDS)
    recorder = Recorder()
    monitor = start_monitor(stop, recorder, nvml=nvml, min_unhealthy_seconds=0)
    nvml.inject_xid(UUIDS[0], 43)  # informational
    nvml.inject_xid(UUIDS[0], 13, recovery_action=nvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    nvml.inject_xid(UUIDS[1], 48)  # a marker that the two above were consumed first
    assert wait_for(lambda: unhealthy(recorder, "gpu-1", 48))
    assert monitor.snapshot()["gpu-0"].healthy
    assert all(call["gpu-0"].healthy for call in recorder.calls)


def test_double_bit_ecc_and_gpu_lost(stop: threading.Event) -> None:
    nvml = FakeNVML(UUIDS)
    recorder = Recorder()
    monitor = start_monitor(stop, recorder, nvml=nvml, min_unhealthy_seconds=0)
    nvml.inject_double_bit_ecc(UUIDS[0])
    assert wait_for(lambda: unhealthy(recorder, "gpu-0"))
    assert monitor.snapshot()["gpu-0"].reason == "double-bit-ecc"
    nvml.inject_gpu_lost()
    assert wait_for(lambda: all(not h.healthy and h.reason == "gpu-lost" for h in recorder.last().values()))
    # A lost GPU does not come back through the recovery action (only a restart clears it).
    nvml.set_recovery_action(UUIDS[0], nvml.NVML_GPU_RECOVERY_ACTION_NONE)
    nvml.inject_xid(UUIDS[1], 48)
    count = recorder.count()
    assert not wait_for(lambda: recorder.count() > count, timeout=0.3)


def test_recovery_waits_for_min_unhealthy_seconds(stop: threading.Event) -> None:
    nvml = FakeNVML(UUIDS)
    recorder = Recorder()
    start_monitor(stop, recorder, nvml=nvml, min_unhealthy_seconds=3600)
    nvml.inject_xid(UUIDS[0], 79, recovery_action=nvml.NVML_GPU_RECOVERY_ACTION_NONE)
    assert wait_for(lambda: unhealthy(recorder, "gpu-0", 79))
    assert not wait_for(lambda: healthy(recorder, "gpu-0"), timeout=0.3)


def test_stop_ends_the_thread_quickly(stop: threading.Event) -> None:
    nvml = FakeNVML(UUIDS)
    monitor = start_monitor(stop, Recorder(), nvml=nvml, poll_seconds=0.05)
    assert monitor.is_running()
    assert any(t.name == "health-monitor" for t in threading.enumerate())
    stop.set()
    monitor.join(5)
    assert not monitor.is_running()


# -- file mode ---------------------------------------------------------------------------------


def write_json(path: Path, data: Any) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(data))
    os.replace(temporary, path)


def test_the_health_file_marks_and_clears_devices(tmp_path: Path, stop: threading.Event) -> None:
    health_file = tmp_path / "health.json"
    recorder = Recorder()
    monitor = start_monitor(stop, recorder, health_file=str(health_file))
    assert monitor.snapshot()["gpu-1"].healthy

    write_json(health_file, {"gpu-1": {"xid": 79, "message": "GPU has fallen off the bus"}})
    assert wait_for(lambda: unhealthy(recorder, "gpu-1", 79))
    assert recorder.last()["gpu-1"].message == "GPU has fallen off the bus"
    assert recorder.last()["gpu-0"].healthy

    write_json(health_file, {"gpu-1": {"xid": 31}, "gpu-0": {"xid": 63, "message": "row remap"}})
    assert wait_for(lambda: healthy(recorder, "gpu-1") and unhealthy(recorder, "gpu-0", 63))

    health_file.unlink()
    assert wait_for(lambda: healthy(recorder, "gpu-0"))
    calls = recorder.count()
    assert not wait_for(lambda: recorder.count() > calls, timeout=0.2)  # no change, no call


def test_a_broken_health_file_keeps_the_last_state(tmp_path: Path, stop: threading.Event) -> None:
    health_file = tmp_path / "health.json"
    write_json(health_file, {"gpu-0": {"xid": 79}, "gpu-9": {"xid": 79}})
    recorder = Recorder()
    start_monitor(stop, recorder, health_file=str(health_file))
    assert wait_for(lambda: unhealthy(recorder, "gpu-0", 79))
    assert "gpu-9" not in recorder.last()
    health_file.write_text('{"gpu-0": ')
    write_json(health_file.with_name("marker.json"), {})
    assert not wait_for(lambda: healthy(recorder, "gpu-0"), timeout=0.2)
    write_json(health_file, {"gpu-0": {"message": "lost"}})
    assert wait_for(
        lambda: recorder.last()["gpu-0"].reason == "unhealthy" and recorder.last()["gpu-0"].xid is None
    )


def test_a_hostile_health_file_does_not_end_the_monitor(tmp_path: Path, stop: threading.Event) -> None:
    health_file = tmp_path / "health.json"
    health_file.write_text('{"gpu-0": ' + "[" * 100_000 + "]" * 100_000 + "}")  # RecursionError in json
    recorder = Recorder()
    monitor = start_monitor(stop, recorder, health_file=str(health_file))
    write_json(health_file, {"gpu-0": {"xid": 79, "message": "m" * 1_000_000}, "x" * 1_000_000: {}})
    assert wait_for(lambda: unhealthy(recorder, "gpu-0", 79))  # the monitor survived the deep file
    assert len(monitor.snapshot()["gpu-0"].message) <= 256


def test_an_unreachable_health_file_does_not_end_the_monitor(
    tmp_path: Path, stop: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    """A stat error other than "missing" (here ENOTDIR) at start must not kill the monitor thread."""
    parent = tmp_path / "health"
    parent.write_text("not a directory\n")
    recorder = Recorder()
    monitor = start_monitor(stop, recorder, health_file=str(parent / "health.json"))
    assert wait_for(
        lambda: any(r.getMessage() == "health file unreadable, kept the last state" for r in caplog.records)
    )
    parent.unlink()
    parent.mkdir()
    write_json(parent / "health.json", {"gpu-1": {"xid": 79}})
    assert wait_for(lambda: unhealthy(recorder, "gpu-1", 79))
    assert monitor.is_running()


def test_no_source_means_no_thread() -> None:
    stop = threading.Event()
    monitor = HealthMonitor(make_inventory(), on_change=Recorder(), stop=stop)
    monitor.start()
    assert all(h.healthy for h in monitor.snapshot().values())
    assert not monitor.is_running()


# -- taints ------------------------------------------------------------------------------------


def test_build_health_taints() -> None:
    snapshot = {
        "gpu-0": DeviceHealth("gpu-0", True),
        "gpu-1": DeviceHealth("gpu-1", False, 79, "fell off the bus", 1.0, "xid-79"),
        "gpu-2": DeviceHealth("gpu-2", False, None, "GPU is lost", 1.0, "gpu-lost"),
        "gpu-3": DeviceHealth("gpu-3", False, 48, "", 1.0),
        "gpu-4": DeviceHealth("gpu-4", False, None, "weird", 1.0, "--Bad Value!! " + "x" * 80),
    }
    taints = build_health_taints(snapshot)
    assert sorted(taints) == ["gpu-1", "gpu-2", "gpu-3", "gpu-4"]
    assert taints["gpu-1"] == [{"key": HEALTH_TAINT_KEY, "value": "xid-79", "effect": "NoSchedule"}]
    assert taints["gpu-2"][0]["value"] == "gpu-lost"
    assert taints["gpu-3"][0]["value"] == "xid-48"
    for entries in taints.values():
        for taint in entries:
            assert taint["key"] == "fractional.dev/unhealthy"
            assert len(taint["value"]) <= 63 and LABEL_VALUE.match(taint["value"])
    assert build_health_taints({"gpu-0": DeviceHealth("gpu-0", True)}) == {}

"""Time and peak memory of building and publishing a node's ResourceSlices.

Scenarios: the shipped 8-GPU profile (``h100-8x``, 16 devices, 1 slice) and a synthetic
1,000-device node (8 slices). For each: build (pure), first publish (creates), and no-op
republish (list + compare, zero writes). The API emulator runs in a separate process
(``fractional apiserver``) so its validation work does not share this process's GIL or memory.
Peak memory: ``tracemalloc`` peak of Python allocations during one call, and ``ru_maxrss`` of a
fresh child process that imports, builds and publishes once (minus an import-only child).

Run: ``.venv/bin/python bench/bench_publish.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import summary, write_result  # noqa: E402
from kubernetes import client  # noqa: E402

from driver.inventory.discover import discover_inventory  # noqa: E402
from driver.inventory.model import NodeInventory  # noqa: E402
from driver.kube.client import load_configuration  # noqa: E402
from driver.publisher import SlicePublisher  # noqa: E402
from driver.slices import build_resource_slices  # noqa: E402


def synthetic_node(devices: int, node_name: str) -> NodeInventory:
    """``devices`` GPUs-and-NICs (3 GPUs : 1 NIC) cloned from the h100-8x profile."""
    base = discover_inventory(backend="fake", profile="h100-8x", node_name=node_name)
    gpu_count = devices * 3 // 4
    gpus = tuple(
        replace(
            base.gpus[i % 8],
            name=f"gpu-{i}",
            uuid=f"GPU-{i:08x}-0000-4000-8000-000000000000",
            pci_bus_id=f"{1 + i // 256:04x}:{i % 256:02x}:00.0",
        )
        for i in range(gpu_count)
    )
    nics = tuple(
        replace(
            base.nics[i % 8],
            name=f"nic-{i}",
            if_name=f"ib{i}",
            pci_bus_id=f"{0x100 + i // 256:04x}:{i % 256:02x}:00.0",
        )
        for i in range(devices - gpu_count)
    )
    return replace(base, gpus=gpus, nics=nics)


def inventory_for(scenario: str, node_name: str) -> NodeInventory:
    if scenario == "h100-8x":
        return discover_inventory(backend="fake", profile="h100-8x", node_name=node_name)
    return synthetic_node(int(scenario.removeprefix("synthetic-")), node_name)


@contextmanager
def emulator() -> Iterator[Path]:
    """``fractional apiserver`` in a child process; yields its kubeconfig."""
    with tempfile.TemporaryDirectory() as tmp:
        kubeconfig = Path(tmp) / "kubeconfig"
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "driver",
                "apiserver",
                "--port",
                "0",
                "--write-kubeconfig",
                str(kubeconfig),
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 30
            while not kubeconfig.exists() or not kubeconfig.read_text():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the API emulator did not start")
                threading.Event().wait(0.05)
            yield kubeconfig
        finally:
            process.terminate()
            process.wait(10)


def timed(function: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = function()
    return (time.perf_counter() - start) * 1000, result


def traced_peak_kib(function: Callable[[], Any]) -> float:
    tracemalloc.start()
    try:
        function()
        return tracemalloc.get_traced_memory()[1] / 1024
    finally:
        tracemalloc.stop()


def child_rss_kib(kubeconfig: Path, scenario: str, publish: bool) -> int:
    """Peak RSS of a fresh process that imports (and, with ``publish``, builds + publishes once)."""
    completed = subprocess.run(
        [sys.executable, __file__, "--child", scenario, str(kubeconfig), "1" if publish else "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return int(json.loads(completed.stdout)["maxrss_kib"])


def run_child(scenario: str, kubeconfig: str, publish: bool) -> None:
    if publish:
        configuration = load_configuration(kubeconfig)
        node = f"rss-{scenario}-{time.monotonic_ns()}"
        create_node(configuration, node)
        with SlicePublisher(configuration, node) as publisher:
            publisher.publish(inventory_for(scenario, publisher.node_name))
    print(json.dumps({"maxrss_kib": peak_rss_kib()}))


def peak_rss_kib() -> int:
    """This process's peak RSS. ``VmHWM`` belongs to the process's own address space; ``ru_maxrss``
    of a child started from a big parent can carry the parent's peak across fork+exec."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def create_node(configuration: Any, name: str) -> None:
    with client.ApiClient(configuration) as api_client:
        client.CoreV1Api(api_client).create_node({"metadata": {"name": name}}, _request_timeout=10)


def bench_scenario(kubeconfig: Path, scenario: str, repeats: int) -> dict[str, Any]:
    configuration = load_configuration(str(kubeconfig))
    warm = f"bench-warmup-{scenario}-{time.monotonic_ns()}"
    create_node(configuration, warm)
    with SlicePublisher(configuration, warm) as publisher:  # the emulator compiles its schemas once
        publisher.publish(inventory_for(scenario, warm))
    inventory = inventory_for(scenario, "bench-build")
    build_ms = [timed(lambda: build_resource_slices(inventory))[0] for _ in range(max(repeats * 3, 10))]
    build_peak = traced_peak_kib(lambda: build_resource_slices(inventory))

    first_ms, noop_ms, first_peak, noop_peak = [], [], [], []
    slices = devices = 0
    for attempt in range(repeats):
        node = f"bench-{scenario}-{attempt}-{time.monotonic_ns()}"
        node_inventory = inventory_for(scenario, node)
        create_node(configuration, node)
        with SlicePublisher(configuration, node) as publisher:
            elapsed, result = timed(lambda: publisher.publish(node_inventory))  # noqa: B023
            assert result.created == result.slice_count and result.updated == 0, result
            first_ms.append(elapsed)
            for _ in range(3):
                elapsed, again = timed(lambda: publisher.publish(node_inventory))  # noqa: B023
                assert again.writes == 0, again
                noop_ms.append(elapsed)
            if attempt == 0:
                noop_peak.append(traced_peak_kib(lambda: publisher.publish(node_inventory)))  # noqa: B023
        if attempt == 0:
            fresh = f"bench-{scenario}-traced-{time.monotonic_ns()}"
            fresh_inventory = inventory_for(scenario, fresh)
            create_node(configuration, fresh)
            with SlicePublisher(configuration, fresh) as publisher:
                first_peak.append(traced_peak_kib(lambda: publisher.publish(fresh_inventory)))  # noqa: B023
        slices, devices = result.slice_count, len(node_inventory.gpus) + len(node_inventory.nics)

    import_rss = child_rss_kib(kubeconfig, scenario, publish=False)
    publish_rss = child_rss_kib(kubeconfig, scenario, publish=True)
    first, noop, build = summary(first_ms), summary(noop_ms), summary(build_ms)
    return {
        "scenario": scenario,
        "devices": devices,
        "slices": slices,
        "build_ms_median": build["median"],
        "build_ms_p99": build["p99"],
        "build_peak_kib": build_peak,
        "first_publish_ms_median": first["median"],
        "first_publish_ms_p99": first["p99"],
        "first_publish_ms_iqr": first["iqr"],
        "first_publish_peak_kib": statistics.median(first_peak),
        "noop_republish_ms_median": noop["median"],
        "noop_republish_ms_p99": noop["p99"],
        "noop_republish_ms_iqr": noop["iqr"],
        "noop_republish_peak_kib": statistics.median(noop_peak),
        "noop_vs_first_ratio": noop["median"] / first["median"],
        "child_maxrss_mib_import_only": import_rss / 1024,
        "child_maxrss_mib_publish": publish_rss / 1024,
        "repeats": repeats,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="fresh pools per scenario (first publishes)")
    parser.add_argument(
        "--child", nargs=3, metavar=("SCENARIO", "KUBECONFIG", "PUBLISH"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        run_child(args.child[0], args.child[1], args.child[2] == "1")
        return 0
    rows = []
    with emulator() as kubeconfig:
        for scenario, repeats in (("h100-8x", args.repeats), ("synthetic-1000", max(3, args.repeats // 3))):
            rows.append(bench_scenario(kubeconfig, scenario, repeats))
    baseline = rows[0]
    for row in rows:
        row["first_publish_vs_h100"] = row["first_publish_ms_median"] / baseline["first_publish_ms_median"]
        row["noop_vs_h100"] = row["noop_republish_ms_median"] / baseline["noop_republish_ms_median"]
    columns = [
        ("scenario", "scenario"),
        ("devices", "devices"),
        ("slices", "slices"),
        ("build ms", "build_ms_median"),
        ("build peak KiB", "build_peak_kib"),
        ("first publish ms (p99)", "first_publish_ms_median"),
        ("first peak KiB", "first_publish_peak_kib"),
        ("no-op republish ms (p99)", "noop_republish_ms_median"),
        ("no-op peak KiB", "noop_republish_peak_kib"),
        ("RSS MiB import/publish", "child_maxrss_mib_publish"),
    ]
    print("| " + " | ".join(title for title, _ in columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = []
        for _, key in columns:
            value = row[key]
            if key == "first_publish_ms_median":
                cells.append(f"{value:.1f} ({row['first_publish_ms_p99']:.1f})")
            elif key == "noop_republish_ms_median":
                cells.append(f"{value:.1f} ({row['noop_republish_ms_p99']:.1f})")
            elif key == "child_maxrss_mib_publish":
                cells.append(f"{row['child_maxrss_mib_import_only']:.0f} / {value:.0f}")
            elif isinstance(value, float):
                cells.append(f"{value:.2f}" if value < 100 else f"{value:.0f}")
            else:
                cells.append(str(value))
        print("| " + " | ".join(cells) + " |")
    path = write_result(
        "publish",
        rows,
        title="ResourceSlice build and publish (node agent)",
        notes=(
            "Emulator in a separate process on 127.0.0.1 (its schema validation is in each write's latency). "
            "Peaks: tracemalloc of the publishing process during one call; RSS: ru_maxrss of a fresh child "
            "that imports only vs. imports + builds + publishes once. Ratios vs. the h100-8x row."
        ),
    )
    print(f"\nwrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

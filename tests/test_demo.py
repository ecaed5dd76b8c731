"""`fractional demo` end to end, checked from the API, not from its text."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from driver.kube import as_dict, load_configuration, new_api_client

REPO = Path(__file__).resolve().parent.parent


def _reader(stream: Any, lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line)
    lines.put("")


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry.name))
    return found


@pytest.mark.timeout(300)
def test_demo_small_scenario_outcome_in_the_api(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FRACTIONAL_")}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "driver",
            "demo",
            "--scenario",
            "small",
            "--keep-running",
            "--output-dir",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=_reader, args=(process.stdout, lines), daemon=True)
    reader.start()
    output: list[str] = []
    kubeconfig: str | None = None
    api_client: client.ApiClient | None = None
    deadline = time.monotonic() + 240
    try:
        while kubeconfig is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if line == "":
                break
            output.append(line)
            if line.strip().startswith("kubeconfig:"):
                kubeconfig = line.split(":", 1)[1].strip()
        assert kubeconfig, "demo did not reach --keep-running:\n" + "".join(output)

        api_client = new_api_client(load_configuration(kubeconfig))
        resource = client.ResourceV1Api(api_client)
        core = client.CoreV1Api(api_client)
        claims = {
            c["metadata"]["name"]: c
            for c in (
                api_client.sanitize_for_serialization(x)
                for x in resource.list_namespaced_resource_claim("demo").items
            )
        }
        slices = [api_client.sanitize_for_serialization(s) for s in resource.list_resource_slice().items]
        attributes = {
            (s["spec"]["pool"]["name"], d["name"]): d.get("attributes", {})
            for s in slices
            for d in s["spec"].get("devices", [])
        }

        def results(name: str) -> list[dict[str, Any]]:
            allocation = (claims[name].get("status") or {}).get("allocation") or {}
            return list((allocation.get("devices") or {}).get("results") or [])

        inference = [n for n in claims if n.startswith("infer-")]
        assert len(inference) == 6  # 6 created, one deleted and one new: infer-0, infer-2..infer-6
        assert "infer-1-claim" not in claims
        gpus = set()
        for name in inference:
            (result,) = results(name)
            assert result["shareID"] and result["consumedCapacity"]["memory"] in ("12Gi", str(12 * 1024**3))
            gpus.add((result["pool"], result["device"]))
        assert len(gpus) < len(inference)  # shares packed: fewer GPUs than pods

        for name in ("train-0-claim", "train-1-claim"):
            gpu, nic = sorted(results(name), key=lambda r: r["request"])
            assert (
                attributes[(gpu["pool"], gpu["device"])]["resource.kubernetes.io/pcieRoot"]
                == attributes[(nic["pool"], nic["device"])]["resource.kubernetes.io/pcieRoot"]
            )
            assert "shareID" not in gpu or gpu.get("consumedCapacity", {}).get("memory") is not None

        big = [n for n in claims if n.startswith("big-")]
        assert big and all(not results(n) for n in big)  # the gang that cannot fit has nothing
        events = core.list_namespaced_event("demo").items
        assert any(e.reason == "GangUnschedulable" for e in events)
        big_pod = core.read_namespaced_pod("big-0", "demo")
        assert big_pod.spec.scheduling_gates
        # the preemption scene: research shares preempted, the high-priority gang placed
        preempted = {e.involved_object.name for e in events if e.reason == "Preempted"}
        assert preempted and all(name.startswith("research-") for name in preempted)
        for index in range(2):
            assert results(f"urgent-{index}-claim")
            assert not core.read_namespaced_pod(f"urgent-{index}", "demo").spec.scheduling_gates
        # the consolidation scene: one replica of Deployment 'web' moved beside the other, 'solo' on
        # the GPU it left, the ReplicaSet's replacement in the room kept for it
        (moved,) = [e.involved_object.name for e in events if e.reason == "Consolidated"]
        (consolidating,) = [e for e in events if e.reason == "Consolidating"]
        assert consolidating.involved_object.name == "solo" and moved in consolidating.message
        web = [as_dict(p) for p in core.list_namespaced_pod("demo", label_selector="app=web").items]
        assert len(web) == 2 and moved not in {p["metadata"]["name"] for p in web}
        web_gpus = set()
        for pod in web:
            (entry,) = pod["status"]["resourceClaimStatuses"]
            (result,) = results(entry["resourceClaimName"])
            web_gpus.add((result["pool"], result["device"]))
        (solo,) = results("solo-claim")
        assert len(web_gpus) == 1 and (solo["pool"], solo["device"]) not in web_gpus  # packed; solo whole
        # the moved pod's claim released (the garbage collector deletes it soon after, as its owner is gone)
        assert all(not results(name) for name in claims if name.startswith(moved))
        # the batch pods finished: the README's kubectl walk-through after --keep-running (a share
        # Deployment, a whole-GPU pod) has free GPUs to land on (the demo once left none)
        held = {(r["pool"], r["device"]) for name in claims for r in results(name)}
        gpus_free = [key for key, attrs in attributes.items() if key not in held and "productName" in attrs]
        assert not [n for n in claims if n.startswith("batch-")] and len(gpus_free) >= 2, gpus_free
        assert (tmp_path / "out" / "packing.png").stat().st_size > 0
    finally:
        if api_client is not None:
            api_client.close()
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        finally:
            reader.join(timeout=10)
            assert process.stdout is not None
            process.stdout.close()
    assert process.returncode == 0
    while not lines.empty():
        output.append(lines.get())
    assert "Traceback" not in "".join(output), "the demo logged an error:\n" + "".join(output)
    assert kubeconfig is not None
    runtime_dir = Path(kubeconfig).parent
    assert not runtime_dir.exists(), "runtime dir (sockets, CDI files) left behind"
    assert _processes_mentioning(str(runtime_dir)) == []


@pytest.mark.timeout(180)
def test_demo_interrupted_mid_scenario_leaves_nothing_behind(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FRACTIONAL_")}
    # The demo's runtime directory (sockets, CDI files) goes under TMPDIR; a short path keeps the
    # unix socket paths under their 108-byte limit.
    runtime_parent = Path(tempfile.mkdtemp(prefix="fd-", dir="/tmp"))
    env["TMPDIR"] = str(runtime_parent)
    command = [sys.executable, "-m", "driver", "demo", "--scenario", "small"]
    process = subprocess.Popen(
        [*command, "--output-dir", str(tmp_path / "out")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=_reader, args=(process.stdout, lines), daemon=True)
    reader.start()
    output: list[str] = []
    runtime_dirs: list[Path] = []
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            output.append(line)
            if line == "" or "allocation controller started" in line:
                break
        assert any("allocation controller started" in line for line in output), "".join(output)
        runtime_dirs[:] = runtime_parent.glob("fractional-demo-*")
        assert len(runtime_dirs) == 1 and any(runtime_dirs[0].rglob("*.sock"))
        process.send_signal(signal.SIGINT)  # Ctrl-C while the scenario runs
        assert process.wait(timeout=60) == 130
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        reader.join(timeout=10)
        assert process.stdout is not None
        process.stdout.close()
    assert not runtime_dirs[0].exists(), "runtime dir (sockets, CDI files) left behind"
    assert _processes_mentioning(str(runtime_dirs[0])) == []
    runtime_parent.rmdir()  # empty: nothing else was left there either

"""Node agent metrics benchmark: one /metrics scrape with 64 shares prepared, and the agent's RSS.

A child process runs one node agent (fake backend, ``h100-8x``: 8 GPUs) against the embedded API,
with the fake backend's NVML stand-in told about 64 GPU processes, one per share, and a fake
``/proc`` tree mapping each to its pod's container (what ``--proc-root`` reads on a real node).
The kubelet simulator prepares 64 claims (8 shares per GPU, each reserved for its own pod)
over the agent's unix socket; then:

- ``scrape /metrics, 64 shares`` (the default, then with ``--dcgm-metrics``): wall time of an
  HTTP GET of the agent's ``/metrics`` (every series of the agent: per GPU, per share, the
  plugin's own, and the dcgm-exporter twins when on), repeated, checked to hold the 64 shares'
  allocated and used series; and the agent's CPU time per scrape (utime + stime of the child
  over all scrapes), which a loaded machine disturbs less than the wall time;
- ``agent RSS, 64 shares``: the child's ``VmRSS`` after the scrapes and its peak (``VmHWM``).

Targets: one scrape < 50 ms, RSS < 80 MiB with 64 shares.

Usage: .venv/bin/python bench/bench_metrics.py [--scrapes N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import summary, write_result  # noqa: E402

NODE = "bench-node"
PROFILE = "h100-8x"
NAMESPACE = "default"
SHARES = 64
TARGET_SCRAPE_MS = 50.0
TARGET_RSS_MIB = 80.0


def _child(spec: dict[str, Any]) -> int:
    """The agent process: a NodeAgent whose NVML stand-in runs the given processes."""
    from driver.config import PluginConfig
    from driver.inventory.fake_nvml import FakeNVML, FakeProcess
    from driver.kube.client import load_configuration
    from driver.plugin.agent import NodeAgent
    from driver.plugin.memory import limit_malloc_arenas

    limit_malloc_arenas()  # as run_agent (fractional plugin) does
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    agent = NodeAgent(
        PluginConfig(**spec["config"]), kube_configuration=load_configuration(spec["kubeconfig"])
    )
    agent.start()
    assert agent.gpu_metrics is not None and isinstance(agent.gpu_metrics.nvml, FakeNVML)
    for process in spec["processes"]:
        agent.gpu_metrics.nvml.start_process(FakeProcess(**process))
    stop.wait()
    agent.stop()
    return 0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _create_claim(api: Any, name: str, device: str, pod: str, pod_uid: str) -> dict[str, str]:
    from kubernetes import client

    from driver import DRIVER_NAME

    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.fractional.dev"}}]}
        },
    }
    created = api.create_namespaced_resource_claim(NAMESPACE, body)
    raw = client.ApiClient().sanitize_for_serialization(created)
    result = {
        "request": "gpu",
        "driver": DRIVER_NAME,
        "pool": NODE,
        "device": device,
        "shareID": str(uuid.uuid4()),
        "consumedCapacity": {"memory": "8Gi", "compute": "10"},
    }
    selector = {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}]
    }
    raw["status"] = {
        "allocation": {"devices": {"results": [result]}, "nodeSelector": selector},
        "reservedFor": [{"resource": "pods", "name": pod, "uid": pod_uid}],
    }
    api.replace_namespaced_resource_claim_status(name, NAMESPACE, raw)
    return {"namespace": NAMESPACE, "name": name, "uid": created.metadata.uid}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text(encoding="utf-8").splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def bench(scrapes: int, *, dcgm: bool) -> list[dict[str, Any]]:
    from kubernetes import client

    from driver.cluster.apiserver import APIServer
    from driver.cluster.kubelet import KubeletSimulator
    from driver.inventory.fake import load_profile, resolve_profile

    root = Path(tempfile.mkdtemp(prefix="fdm-", dir="/tmp"))
    api_server = APIServer(host="127.0.0.1", port=0)
    api_server.start()
    process: subprocess.Popen[bytes] | None = None
    kubelet: KubeletSimulator | None = None
    try:
        kubeconfig = root / "kubeconfig"
        api_server.write_kubeconfig(str(kubeconfig))
        api = client.ResourceV1Api(client.ApiClient(api_server.configuration()))
        gpus = load_profile(resolve_profile(PROFILE), node_name=NODE).gpus
        proc = root / "proc"
        refs, processes = [], []
        for index in range(SHARES):
            gpu = gpus[index % len(gpus)]
            pod_uid = str(uuid.uuid4())
            refs.append(_create_claim(api, f"share-{index}", gpu.name, f"pod-{index}", pod_uid))
            pid = 10_000 + index
            (proc / str(pid)).mkdir(parents=True)
            (proc / str(pid) / "cgroup").write_text(
                "0::/kubepods.slice/kubepods-besteffort.slice/"
                f"kubepods-besteffort-pod{pod_uid.replace('-', '_')}.slice/"
                f"cri-containerd-{uuid.uuid4().hex}{uuid.uuid4().hex}.scope\n"
            )
            processes.append({"pid": pid, "gpu_uuid": gpu.uuid, "memory_bytes": 6 * 1024**3, "sm_percent": 9})
        port = _free_port()
        (root / "reg").mkdir()
        spec = {
            "kubeconfig": str(kubeconfig),
            "processes": processes,
            "config": {
                "node_name": NODE,
                "backend": "fake",
                "profile": PROFILE,
                "registry_dir": str(root / "reg"),
                "plugin_dir": str(root / "plugin"),
                "cdi_root": str(root / "cdi"),
                "metrics_port": port,
                "metrics_host": "127.0.0.1",
                "proc_root": str(proc),
                "dcgm_metrics": dcgm,
            },
        }
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)], cwd=ROOT, env=env
        )
        kubelet = KubeletSimulator(root / "reg", kubelet_version="1.35")
        kubelet.register(timeout=60)
        time.sleep(1.0)  # the publisher's first sync and the API client are in place
        idle_rss_mib = _status_kib(process.pid, "VmRSS") / 1024
        answer = kubelet.prepare(refs)
        errors = [entry["error"] for entry in answer.values() if entry["error"]]
        if errors:
            raise RuntimeError(f"prepare failed: {errors[0]}")
        prepared_rss_mib = _status_kib(process.pid, "VmRSS") / 1024
        url = f"http://127.0.0.1:{port}/metrics"
        times, body = [], b""
        deadline = time.monotonic() + 30
        while b'container="' not in body or body.count(b"fractional_share_memory_used_bytes{") < SHARES:
            if time.monotonic() > deadline:  # the child starts its processes after its sockets
                raise RuntimeError("the scrape never showed the 64 shares' processes")
            with urllib.request.urlopen(url, timeout=10) as reply:
                body = reply.read()
        cpu_before = _cpu_seconds(process.pid)
        for _ in range(scrapes):
            started = time.perf_counter()
            with urllib.request.urlopen(url, timeout=10) as reply:
                body = reply.read()
            times.append((time.perf_counter() - started) * 1000)
        cpu_ms = (_cpu_seconds(process.pid) - cpu_before) / scrapes * 1000
        allocated = body.count(b"fractional_share_memory_allocated_bytes{")
        used = body.count(b"fractional_share_memory_used_bytes{")
        if allocated != SHARES or used != SHARES:
            raise RuntimeError(
                f"scrape holds {allocated} allocated and {used} used share series, not {SHARES}"
            )
        rss_mib = _status_kib(process.pid, "VmRSS") / 1024
        peak_mib = _status_kib(process.pid, "VmHWM") / 1024
        series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    finally:
        if kubelet is not None:
            kubelet.close()
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
        api_server.stop()
        shutil.rmtree(root, ignore_errors=True)
    s = summary(times)
    twins = ", dcgm-exporter twins" if dcgm else ""
    return [
        {
            "case": f"scrape /metrics, {SHARES} shares{twins} (ms)",
            "n": s["n"],
            "series": series,
            "bytes": len(body),
            "median_ms": s["median"],
            "p99_ms": s["p99"],
            "iqr_ms": s["iqr"],
            "agent_cpu_ms": cpu_ms,
            "target_ms": TARGET_SCRAPE_MS,
            "p99_to_target": s["p99"] / TARGET_SCRAPE_MS,
        },
        {
            "case": f"agent RSS, {SHARES} shares{twins} (MiB)",
            "rss_before_prepare_mib": idle_rss_mib,
            "rss_prepared_mib": prepared_rss_mib,
            "rss_mib": rss_mib,
            "peak_mib": peak_mib,
            "target_mib": TARGET_RSS_MIB,
            "peak_to_target": peak_mib / TARGET_RSS_MIB,
        },
    ]


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return _child(json.loads(sys.argv[2]))
    parser = argparse.ArgumentParser(description="node agent metrics benchmark")
    parser.add_argument("--scrapes", type=int, default=100, help="scrapes to time")
    args = parser.parse_args()
    rows = bench(args.scrapes, dcgm=False) + bench(args.scrapes, dcgm=True)
    for row in rows:
        print(row)
    write_result(
        "metrics",
        rows,
        title="Node agent metrics: one scrape and RSS with 64 shares",
        notes="64 shares of 8 GPUs (h100-8x), one GPU process per share mapped through a fake /proc; "
        "the default configuration, then with --dcgm-metrics. Targets: scrape < 50 ms, "
        "RSS < 80 MiB.",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

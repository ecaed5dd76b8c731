#!/usr/bin/env python3
"""One prepared check for a machine with a real NVIDIA GPU; nothing here runs in CI.

    python3 hack/gpu_check.py [--gpu gpu-0] [--memory-limit-mib 1024] [--site DIR]

1. discovery: ``driver.inventory.discover_inventory(backend="nvml")`` (pynvml + sysfs); prints the
   inventory table and the ResourceSlices the agent would publish;
2. baseline: a CUDA client process (ctypes on ``libcuda.so.1``: cuInit, cuCtxCreate, cuMemAlloc; no
   torch) allocates below and above the limit without MPS: both should succeed;
3. MPS, when ``nvidia-cuda-mps-control`` is on the PATH: our ``MpsBackend`` starts a real control
   daemon for one share of the GPU with ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` = the limit (first
   with compute mode EXCLUSIVE_PROCESS through NVML; if NVML refuses, again without changing the
   mode); the same client runs with the share's container environment (the pipe directory mapped
   to its host path) and should get the allocation below the limit and CUDA_ERROR_OUT_OF_MEMORY
   above it; then the share is released: the daemon quits and the compute mode is restored.

It always cleans up, prints a summary and writes it to ``$OUT/gpu_check.json`` when ``OUT`` is set,
and exits 0 when it ran to the end (the verdicts are in the summary: ``discovery.ok``,
``mps.verdict`` = enforced | not-enforced | skipped | error); 1 only when the discovery itself fails.

Needs Python 3.11+, ``nvidia-ml-py`` (``pynvml``) and ``PyYAML``, not the kubernetes client. On a bare
machine, copy ``pynvml.py`` and ``yaml/`` from the project's virtual environment into a folder and
pass it as ``--site``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
CLIENT_TIMEOUT_SECONDS = 120
CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2


# -- pure pieces (tested in tests/plugin/test_enforcement_gpu_check.py) ---------------------------


def client_environment(
    env_entries: Sequence[str], mounts: Sequence[tuple[str, str]], base: Mapping[str, str]
) -> dict[str, str]:
    """The environment a host process needs to act like a container with these CDI edits:
    ``base`` plus every ``NAME=value`` entry, where a value naming a mount's container path (or a
    path below it) is rewritten to the host path. ``mounts``: (host path, container path)."""
    env = dict(base)
    for entry in env_entries:
        name, _, value = entry.partition("=")
        for host_path, container_path in mounts:
            if value == container_path or value.startswith(container_path.rstrip("/") + "/"):
                value = host_path + value[len(container_path.rstrip("/")) :]
                break
        env[name] = value
    return env


def judge_mps(limit_mib: int, attempts: Sequence[Mapping[str, Any]]) -> str:
    """``enforced`` when every allocation within the limit succeeded and every one above it failed
    with CUDA_ERROR_OUT_OF_MEMORY; ``not-enforced`` when one above it succeeded; else ``error``."""
    if not attempts:
        return "error"
    for attempt in attempts:
        within = int(attempt["mib"]) <= limit_mib
        code = int(attempt["result"])
        if within and code != CUDA_SUCCESS:
            return "error"
        if not within and code == CUDA_SUCCESS:
            return "not-enforced"
        if not within and code != CUDA_ERROR_OUT_OF_MEMORY:
            return "error"
    return "enforced"


def allocation_sizes_mib(limit_mib: int) -> tuple[int, int]:
    """One allocation well below the limit (a quarter; a CUDA context costs some memory too) and one
    clearly above it (twice)."""
    return max(1, limit_mib // 4), limit_mib * 2


def parse_client_report(stdout: str) -> dict[str, Any] | None:
    """The last JSON object line the client printed, or None."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                report = json.loads(line)
            except ValueError:
                continue
            if isinstance(report, dict):
                return report
    return None


# -- the CUDA client (runs in its own process: MPS is chosen at cuInit from the environment) -----


def _cuda_client(sizes_mib: Sequence[int]) -> int:
    report: dict[str, Any] = {"attempts": []}
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        print(json.dumps({"error": f"libcuda.so.1: {error}"}))
        return 0

    def name(code: int) -> str:
        text = ctypes.c_char_p()
        if cuda.cuGetErrorName(code, ctypes.byref(text)) == CUDA_SUCCESS and text.value:
            return text.value.decode()
        return str(code)

    def call(what: str, code: int) -> bool:
        if code != CUDA_SUCCESS:
            report["error"] = f"{what}: {name(code)}"
            return False
        return True

    device, context = ctypes.c_int(), ctypes.c_void_p()
    if not (
        call("cuInit", cuda.cuInit(0))
        and call("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(device), 0))
        and call("cuCtxCreate", cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device))
    ):
        print(json.dumps(report))
        return 0
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == CUDA_SUCCESS:
        report["memGetInfo"] = {"freeMiB": free.value // MIB, "totalMiB": total.value // MIB}
    for mib in sizes_mib:
        pointer = ctypes.c_uint64()
        code = int(cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(mib * MIB)))
        report["attempts"].append({"mib": mib, "result": code, "name": name(code)})
        if code == CUDA_SUCCESS:
            cuda.cuMemFree_v2(pointer)
    cuda.cuCtxDestroy_v2(context)
    print(json.dumps(report))
    return 0


def run_client(sizes_mib: Sequence[int], env: Mapping[str, str]) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--cuda-client", *map(str, sizes_mib)]
    started = time.monotonic()
    try:
        done = subprocess.run(
            command,
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"the CUDA client did not finish within {CLIENT_TIMEOUT_SECONDS} s"}
    report = parse_client_report(done.stdout) or {"error": "no report", "stderr": done.stderr[-2000:]}
    report["exitCode"] = done.returncode
    report["seconds"] = round(time.monotonic() - started, 3)
    return report


# -- steps -----------------------------------------------------------------------------------


def discover(node_name: str) -> tuple[Any, dict[str, Any]]:
    from driver.inventory import discover_inventory, render_inventory_table
    from driver.slices import build_resource_slices, render_slices

    inventory = discover_inventory(backend="nvml", node_name=node_name)
    print(render_inventory_table(inventory))
    slices = build_resource_slices(inventory)
    print(render_slices(slices, "yaml"))
    summary = {
        "ok": True,
        "driverVersion": inventory.driver_version,
        "cudaDriverVersion": inventory.cuda_driver_version,
        "gpus": [
            {"name": gpu.name, "uuid": gpu.uuid, "product": gpu.product_name, "memoryBytes": gpu.memory_bytes}
            for gpu in inventory.gpus
        ],
        "nics": [nic.name for nic in inventory.nics],
        "slices": len(slices),
        "devicesPublished": sum(len(item["spec"]["devices"]) for item in slices),
    }
    return inventory, summary


def check_mps(gpu: Any, limit_mib: int, plugin_dir: Path) -> dict[str, Any]:
    import pynvml

    from driver.errors import ClaimError
    from driver.plugin.sharing.base import ShareSpec
    from driver.plugin.sharing.mps import MpsBackend

    below, above = allocation_sizes_mib(limit_mib)
    share = ShareSpec(
        claim_uid="gpu-check",
        device=gpu.name,
        gpu_uuid=gpu.uuid,
        ordinal=0,
        share_id="00000000-0000-4000-8000-000000000001",
        memory_bytes=limit_mib * MIB,
        compute_percent=50,
        whole_gpu=False,
    )
    result: dict[str, Any] = {"limitMiB": limit_mib, "control": shutil.which("nvidia-cuda-mps-control")}
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
        result["computeModeBefore"] = int(pynvml.nvmlDeviceGetComputeMode(handle))
        backend: MpsBackend | None = None
        for nvml in (pynvml, None):  # NVML may refuse the compute mode (no permission in a container)
            candidate = MpsBackend(plugin_dir=str(plugin_dir), nvml=nvml, start_timeout_seconds=30.0)
            try:
                candidate.acquire(share)
            except ClaimError as error:
                result.setdefault("acquireErrors", []).append(str(error))
                candidate.close()
                continue
            backend = candidate
            result["computeModeChanged"] = nvml is not None
            break
        if backend is None:
            result["verdict"] = "error"
            return result
        try:
            daemons = backend.daemons()
            result["daemonPid"] = daemons[gpu.uuid].pid if gpu.uuid in daemons else None
            result["computeModeDuring"] = int(pynvml.nvmlDeviceGetComputeMode(handle))
            edits = backend.container_edits(share)
            result["containerEnv"] = list(edits.env)
            env = client_environment(
                edits.env,
                [(mount.host_path, mount.container_path) for mount in edits.mounts],
                {key: value for key, value in os.environ.items() if not key.startswith("CUDA_")},
            )
            report = run_client((below, above), env)
            result["client"] = report
            result["verdict"] = judge_mps(limit_mib, report.get("attempts") or [])
        finally:
            backend.release(share)
            backend.close()
        result["daemonGoneAfterRelease"] = gpu.uuid not in backend.daemons()
        result["computeModeAfter"] = int(pynvml.nvmlDeviceGetComputeMode(handle))
        log_dir = backend.log_dir(gpu.uuid)
        control_log = log_dir / "control.log"
        if control_log.exists():
            result["controlLogTail"] = control_log.read_text(errors="replace")[-2000:]
    finally:
        pynvml.nvmlShutdown()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--node-name", default=os.uname().nodename)
    parser.add_argument("--gpu", default="gpu-0", help="device name of the GPU to share (default gpu-0)")
    parser.add_argument("--memory-limit-mib", type=int, default=1024)
    parser.add_argument("--site", help="a folder holding pynvml.py and yaml/ (put first on sys.path)")
    parser.add_argument("--cuda-client", nargs="*", type=int, metavar="MIB", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cuda_client is not None:
        return _cuda_client(args.cuda_client)
    if args.site:
        sys.path.insert(0, args.site)
    sys.path.insert(0, str(REPO_ROOT))

    summary: dict[str, Any] = {"node": args.node_name, "python": sys.version.split()[0]}
    exit_code = 0
    try:
        inventory, summary["discovery"] = discover(args.node_name)
    except Exception as error:  # the one report of the whole run: say what failed, exit 1
        summary["discovery"] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        inventory, exit_code = None, 1
    gpu = inventory.gpu(args.gpu) if inventory is not None else None
    if gpu is None:
        summary["baseline"] = summary["mps"] = {"verdict": "skipped", "reason": f"no GPU {args.gpu}"}
    else:
        baseline_env = {key: value for key, value in os.environ.items() if not key.startswith("CUDA_MPS")}
        summary["baseline"] = run_client(allocation_sizes_mib(args.memory_limit_mib), baseline_env)
        if shutil.which("nvidia-cuda-mps-control") is None:
            summary["mps"] = {"verdict": "skipped", "reason": "nvidia-cuda-mps-control is not on the PATH"}
        else:
            plugin_dir = Path(tempfile.mkdtemp(prefix="gpuchk-", dir="/tmp"))  # short: MPS pipe sockets
            try:
                summary["mps"] = check_mps(gpu, args.memory_limit_mib, plugin_dir)
            except Exception as error:  # reported, not raised: the summary must still be written
                summary["mps"] = {"verdict": "error", "error": f"{type(error).__name__}: {error}"}
            finally:
                shutil.rmtree(plugin_dir, ignore_errors=True)
    text = json.dumps(summary, indent=2, sort_keys=True)
    print(text)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_check.json").write_text(text + "\n")
    return exit_code


if __name__ == "__main__":
    sys.exit(main())

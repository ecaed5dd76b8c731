"""The pure pieces of ``hack/gpu_check.py`` (the script itself needs a real GPU), and its client's
answer on a machine without ``libcuda``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from driver.plugin.sharing import MpsBackend, ShareSpec

SCRIPT = Path(__file__).resolve().parents[2] / "hack" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_client_environment_maps_the_pipe_directory_to_the_host(
    gpu_check: ModuleType, tmp_path: Path
) -> None:
    backend = MpsBackend(plugin_dir=str(tmp_path))
    share = ShareSpec(
        claim_uid="c",
        device="gpu-0",
        gpu_uuid="GPU-1",
        ordinal=0,
        share_id="s",
        memory_bytes=1024 * 1024 * 1024,
        compute_percent=50,
        whole_gpu=False,
    )
    edits = backend.container_edits(share)
    env = gpu_check.client_environment(
        edits.env,
        [(mount.host_path, mount.container_path) for mount in edits.mounts],
        {"PATH": "/bin", "CUDA_MPS_PIPE_DIRECTORY": "/elsewhere"},
    )
    assert env == {
        "PATH": "/bin",
        "CUDA_MPS_PIPE_DIRECTORY": str(backend.pipe_dir("GPU-1")),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "GPU-1=1024M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
    }
    nested = gpu_check.client_environment(
        ["X=/tmp/nvidia-mps/log", "Y=/tmp/nvidia-mpsx"], [("/h", "/tmp/nvidia-mps")], {}
    )
    assert nested == {"X": "/h/log", "Y": "/tmp/nvidia-mpsx"}


@pytest.mark.parametrize(
    ("attempts", "verdict"),
    [
        ([{"mib": 256, "result": 0}, {"mib": 2048, "result": 2}], "enforced"),
        ([{"mib": 256, "result": 0}, {"mib": 2048, "result": 0}], "not-enforced"),
        ([{"mib": 256, "result": 2}, {"mib": 2048, "result": 2}], "error"),  # nothing fits: not a limit
        ([{"mib": 256, "result": 0}, {"mib": 2048, "result": 999}], "error"),
        ([], "error"),
    ],
)
def test_judge_mps(gpu_check: ModuleType, attempts: list[dict[str, int]], verdict: str) -> None:
    assert gpu_check.judge_mps(1024, attempts) == verdict


def test_sizes_and_report_parsing(gpu_check: ModuleType) -> None:
    assert gpu_check.allocation_sizes_mib(1024) == (256, 2048)
    assert gpu_check.allocation_sizes_mib(2) == (1, 4)
    assert gpu_check.parse_client_report('noise\n{"attempts": []}\n{broken\n') == {"attempts": []}
    assert gpu_check.parse_client_report("no json here") is None


def test_client_without_libcuda_reports_instead_of_crashing() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cuda-client", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" in report or report["attempts"][0]["mib"] == 1  # a machine with a GPU allocates

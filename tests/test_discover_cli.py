"""``fractional discover``: the inventory table and the slices it would publish, through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pynvml
import pytest
import yaml

from driver.cli import main
from tests.inventory.fake_pynvml import FakeGPU, FakeNVML

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_table_for_the_h100_profile(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["discover", "--profile", "h100-8x", "--node-name", "gpu-node-7"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("node gpu-node-7  backend fake  driver 550.54.15  CUDA 12.4.0  8 GPUs  8 NICs")
    assert lines[1].split() == [
        "DEVICE",
        "TYPE",
        "PRODUCT",
        "MEMORY",
        "(GiB)",
        "COMPUTE",
        "NUMA",
        "PCIE",
        "ROOT",
        "PAIRED",
    ]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert sorted(rows) == sorted([f"gpu-{i}" for i in range(8)] + [f"nic-{i}" for i in range(8)])
    assert rows["gpu-0"].split() == [
        "gpu-0", "gpu", "NVIDIA", "H100", "80GB", "HBM3", "79.00", "132", "SMs", "0", "pci0000:15", "nic-0",
    ]  # fmt: skip
    assert rows["gpu-7"].split()[-3:] == ["1", "pci0000:dc", "nic-7"]
    assert rows["nic-3"].split() == [
        "nic-3",
        "nic",
        "ibp96s0/mlx5_3",
        "400",
        "Gb/s",
        "-",
        "-",
        "0",
        "pci0000:5d",
        "gpu-3",
    ]


def test_yaml_output_is_the_slices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["discover", "--profile", "a100-pcie-4x", "-o", "yaml"]) == 0
    documents = list(yaml.safe_load_all(capsys.readouterr().out))
    assert len(documents) == 1
    (item,) = documents
    assert item["kind"] == "ResourceSlice" and item["spec"]["nodeName"] == "node-1"
    assert [d["name"] for d in item["spec"]["devices"]] == [
        "gpu-0",
        "gpu-1",
        "gpu-2",
        "gpu-3",
        "nic-0",
        "nic-1",
    ]
    kubernetes_validate.validate(item, "1.35.0", strict=True)


def test_json_output_in_a_subprocess() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "driver", "discover", "--profile", "l4-2x", "-o", "json"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    document = json.loads(completed.stdout)
    assert document["kind"] == "List"
    assert [d["name"] for d in document["items"][0]["spec"]["devices"]] == ["gpu-0", "gpu-1", "nic-0"]


def test_profile_file_path_and_a_bad_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        (REPO_ROOT / "fake_devices" / "l4-2x.yaml").read_text().replace("numaNode: 0\n", "numaNode: 4\n", 1)
    )
    assert main(["discover", "--profile", str(bad)]) == 1
    error = capsys.readouterr().err
    assert str(bad) in error and "gpus[0] (0000:01:00.0)" in error and "numaNode" in error


def test_unknown_profile_name(capsys: pytest.CaptureFixture[str]) -> None:
    # A configuration error, exit 2, like every other bad flag (it used to be 1)
    assert main(["discover", "--profile", "b200-8x"]) == 2
    assert "h100-8x" in capsys.readouterr().err


class _NoNVML:
    """pynvml as it is on a machine without the NVIDIA driver: importable, nvmlInit fails."""

    NVMLError = pynvml.NVMLError

    def __init__(self, code: int) -> None:
        self.code = code

    def nvmlInit(self) -> None:
        raise pynvml.NVMLError(self.code)


@pytest.mark.parametrize(
    ("code", "why"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1 not found"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "the NVIDIA driver is not loaded"),
    ],
)
def test_no_flags_and_no_nvml_says_what_to_pass(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], code: int, why: str
) -> None:
    monkeypatch.delenv("FRACTIONAL_BACKEND", raising=False)
    monkeypatch.delenv("FRACTIONAL_PROFILE", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", _NoNVML(code))
    assert main(["discover"]) == 2
    error = capsys.readouterr().err
    assert f"--backend (FRACTIONAL_BACKEND): no NVML on this machine ({why}); pass --profile NAME" in error
    assert "a100-pcie-4x, h100-8x, l4-2x" in error
    assert main(["discover", "--profile", "l4-2x"]) == 0  # as it says: a profile alone means fake devices
    assert "backend fake" in capsys.readouterr().out.splitlines()[0]


def test_no_flags_chooses_nvml_when_it_answers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.delenv("FRACTIONAL_BACKEND", raising=False)
    monkeypatch.delenv("FRACTIONAL_PROFILE", raising=False)
    nvml = FakeNVML([FakeGPU(uuid="GPU-a", bus_id="00000000:1B:00.0")])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert main(["discover", "--sysfs-root", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("node node-1  backend nvml  driver 550.54.15")
    assert lines[2].split()[:2] == ["gpu-0", "gpu"]
    assert nvml.initialized == 2 and nvml.shutdowns == 2  # the probe, then the discovery

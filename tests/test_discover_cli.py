"""``fractional discover``: the inventory table and the slices it would publish, through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from driver.cli import main

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
    # A configuration error, exit 2, like every other bad flag (it was 1: issue 28)
    assert main(["discover", "--profile", "b200-8x"]) == 2
    assert "h100-8x" in capsys.readouterr().err

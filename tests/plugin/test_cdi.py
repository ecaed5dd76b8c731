"""CDI names, minimum versions, rendering and atomic writes."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from driver.errors import ClaimError
from driver.plugin import cdi
from driver.plugin.sharing.base import ContainerEdits, DeviceNode, Mount

UID = "0b4f7c2e-5d1a-4e6b-9c3d-2a1f0e9d8c7b"


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        (UID, True),
        ("gpu-0", True),
        ("a.b_c-d", True),
        ("", False),
        ("../etc", False),
        ("a/b", False),
        ("a..b", False),
        (".hidden", False),
        ("-dash", False),
        ("dash-", False),  # a CDI name ends with an alphanumeric
        ("dot.", False),
        ("x", True),
        ("sp ace", False),
        ("colon:x", False),
        ("x" * 128, True),
        ("x" * 129, False),
        ("gpu-0\n", False),  # "$" would match before a final newline
        (UID + "\n", False),
    ],
)
def test_check_name_part(value: str, ok: bool) -> None:
    if ok:
        assert cdi.check_name_part(value, claim="ns/c", field="metadata.uid") == value
    else:
        with pytest.raises(ClaimError, match=r"ResourceClaim ns/c: metadata.uid: "):
            cdi.check_name_part(value, claim="ns/c", field="metadata.uid")


def test_names_and_paths(tmp_path: Path) -> None:
    assert cdi.device_name(UID, "gpu-3", None) == f"{UID}-gpu-3"
    assert cdi.device_name(UID, "gpu-3", "1234567890ab") == f"{UID}-gpu-3-12345678"
    # cut after a separator, the prefix drops it: containerd refuses a device name ending in one
    assert cdi.device_name(UID, "gpu-3", "abcdefg-rest") == f"{UID}-gpu-3-abcdefg"
    assert cdi.device_name(UID, "gpu-3", "abc.._--xyz") == f"{UID}-gpu-3-abc"
    assert cdi.qualified_device_id("gpu", "x") == "k8s.fractional.dev/gpu=x"
    assert cdi.claim_spec_path(tmp_path, "nic", UID) == tmp_path / f"k8s.fractional.dev-nic_{UID}.json"
    with pytest.raises(ClaimError):
        cdi.claim_spec_path(tmp_path, "gpu", "../../x")
    with pytest.raises(ValueError, match="CDI class"):
        cdi.claim_spec_path(tmp_path, "tpu", UID)


def _spec(name: str = "gpu-0", kind: str = "k8s.fractional.dev/gpu", **edits: Any) -> dict[str, Any]:
    return {"kind": kind, "devices": [{"name": name, "containerEdits": {"env": ["A=1"], **edits}}]}


@pytest.mark.parametrize(
    ("spec", "version"),
    [
        (_spec(), "0.3.0"),
        (_spec(mounts=[{"hostPath": "/a", "containerPath": "/a", "type": "bind"}]), "0.4.0"),
        (_spec(mounts=[{"hostPath": "/a", "containerPath": "/a"}]), "0.3.0"),
        (_spec(name="0abc-gpu-0"), "0.5.0"),
        (_spec(deviceNodes=[{"path": "/dev/x", "hostPath": "/dev/y"}]), "0.5.0"),
        (_spec(deviceNodes=[{"path": "/dev/x"}]), "0.3.0"),
        ({**_spec(), "annotations": {"a": "b"}}, "0.6.0"),
        (_spec(kind="k8s.fractional.dev/gpu.v2"), "0.6.0"),
    ],
)
def test_minimum_cdi_version(spec: dict[str, Any], version: str) -> None:
    assert cdi.minimum_cdi_version(spec) == version


def test_render_and_write(tmp_path: Path, check_cdi: Callable[[Path], dict[str, Any]]) -> None:
    edits = ContainerEdits(
        env=("FRACTIONAL_CLAIM_UID=" + UID,),
        mounts=(Mount(host_path="/run/mps", container_path="/run/mps", type="bind"),),
        device_nodes=(
            DeviceNode(path="/dev/infiniband/uverbs0"),
            DeviceNode(path="/dev/x", host_path="/dev/y"),
        ),
    )
    spec = cdi.render_claim_spec(
        "gpu", [(f"{UID}-gpu-0", edits), (f"{UID}-gpu-0", edits), (f"{UID}-gpu-1", edits)]
    )
    assert [device["name"] for device in spec["devices"]] == [f"{UID}-gpu-0", f"{UID}-gpu-1"]
    assert spec["cdiVersion"] == "0.5.0"  # a device name starting with a digit, and a hostPath
    path = cdi.write_cdi_spec(tmp_path, "gpu", UID, spec)
    assert check_cdi(path) == spec
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind
    assert cdi.parse_container_edits(cdi.render_container_edits(edits)) == edits
    assert cdi.remove_claim_specs(tmp_path, UID) == [path]
    assert cdi.remove_claim_specs(tmp_path, UID) == []


def test_failed_write_leaves_the_old_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = cdi.render_claim_spec("gpu", [(f"{UID}-gpu-0", ContainerEdits(env=("A=1",)))])
    path = cdi.write_cdi_spec(tmp_path, "gpu", UID, spec)
    before = path.read_bytes()

    def broken_fsync(fd: int) -> None:
        raise OSError(5, "I/O error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="I/O error"):
        cdi.write_cdi_spec(tmp_path, "gpu", UID, {**spec, "devices": spec["devices"] * 2})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_render_needs_a_device() -> None:
    with pytest.raises(ValueError, match="at least one device"):
        cdi.render_claim_spec("gpu", [])

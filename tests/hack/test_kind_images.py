"""hack/images/kind_images.py: the control-plane images of our kind node image, under the names
kubeadm expects, each with its binary where kubeadm's manifests run it."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

IMAGES = Path(__file__).resolve().parents[2] / "hack" / "images"
if str(IMAGES) not in sys.path:
    sys.path.insert(0, str(IMAGES))

import kind_images  # noqa: E402


@pytest.fixture
def binaries(tmp_path: Path) -> dict[str, Path]:
    dirs = {name: tmp_path / name for name in ("kube", "etcd", "coredns")}
    for directory in dirs.values():
        directory.mkdir()
    for name in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kube-proxy"):
        (dirs["kube"] / name).write_bytes(f"#!{name}\n".encode())
    (dirs["etcd"] / "etcd").write_bytes(b"#!etcd\n")
    (dirs["coredns"] / "coredns").write_bytes(b"#!coredns\n")
    return dirs


def _specs(binaries: dict[str, Path], base_layer: Path | None = None) -> tuple[kind_images.ImageSpec, ...]:
    return kind_images.control_plane_specs(
        kube_bin=binaries["kube"],
        etcd_bin=binaries["etcd"],
        coredns_bin=binaries["coredns"],
        kubernetes_version="v1.37.2",
        etcd_tag="3.7.0-0",
        coredns_tag="v1.14.6",
        base_layer=base_layer,
    )


def test_the_references_are_kubeadms_for_the_release(binaries: dict[str, Path]) -> None:
    # `kubeadm config images list --kubernetes-version v1.37.2`, less pause (containerd's sandbox
    # image is hack/images/build.py's).
    assert {s.reference for s in _specs(binaries)} == {
        "registry.k8s.io/kube-apiserver:v1.37.2",
        "registry.k8s.io/kube-controller-manager:v1.37.2",
        "registry.k8s.io/kube-scheduler:v1.37.2",
        "registry.k8s.io/kube-proxy:v1.37.2",
        "registry.k8s.io/etcd:3.7.0-0",
        "registry.k8s.io/coredns/coredns:v1.14.6",
    }


def _read(archive: Path) -> tuple[dict[str, object], dict[str, object], list[set[str]]]:
    with tarfile.open(archive) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    index = json.loads(members["index.json"])
    manifest = json.loads(members["blobs/sha256/" + index["manifests"][0]["digest"].split(":")[1]])
    config = json.loads(members["blobs/sha256/" + manifest["config"]["digest"].split(":")[1]])
    layers = []
    for layer in manifest["layers"]:
        with tarfile.open(
            fileobj=io.BytesIO(members["blobs/sha256/" + layer["digest"].split(":")[1]])
        ) as tar:
            layers.append({m.name.rstrip("/") for m in tar.getmembers()})
    return index, config, layers


def test_an_apiserver_image_runs_kube_apiserver_from_path(binaries: dict[str, Path], tmp_path: Path) -> None:
    spec = next(s for s in _specs(binaries) if s.name == "kube-apiserver")
    archive, rebuilt = kind_images.build_archive(spec, tmp_path / "out")
    assert rebuilt
    index, config, layers = _read(archive)
    assert index["manifests"][0]["annotations"]["io.containerd.image.name"] == spec.reference  # type: ignore[index]
    assert "usr/local/bin/kube-apiserver" in layers[0] and "tmp" in layers[0]
    assert "/usr/local/bin" in config["config"]["Env"][0]  # type: ignore[index]
    assert kind_images.build_archive(spec, tmp_path / "out") == (archive, False)  # the stamp matches


def test_coredns_has_its_entrypoint_and_kube_proxy_its_base(
    binaries: dict[str, Path], tmp_path: Path
) -> None:
    base = tmp_path / "base.tar"
    with tarfile.open(base, "w") as tar:
        info = tarfile.TarInfo("usr/sbin/iptables")
        tar.addfile(info, io.BytesIO(b""))
    specs = {s.name: s for s in _specs(binaries, base)}
    _, config, _ = _read(kind_images.build_archive(specs["coredns"], tmp_path / "out")[0])
    assert config["config"]["Entrypoint"] == ["/coredns"]  # type: ignore[index]
    _, _, layers = _read(kind_images.build_archive(specs["kube-proxy"], tmp_path / "out")[0])
    assert "usr/sbin/iptables" in layers[0] and "usr/local/bin/kube-proxy" in layers[1]

#!/usr/bin/env python3
"""The control-plane images a kind node image pre-loads, built here from our own binaries, as the
OCI archives `ctr -n k8s.io images import` loads (the writer of hack/images/build.py).

kubeadm 1.37 expects these references (`kubeadm config images list`); each image holds the one
upstream binary that hack/upstream-build.sh built from the release's Go module:

    registry.k8s.io/kube-apiserver:v1.37.2           /usr/local/bin/kube-apiserver
    registry.k8s.io/kube-controller-manager:v1.37.2  /usr/local/bin/kube-controller-manager
    registry.k8s.io/kube-scheduler:v1.37.2           /usr/local/bin/kube-scheduler
    registry.k8s.io/kube-proxy:v1.37.2               /usr/local/bin/kube-proxy over a Debian base
                                                     (--base-layer: iptables, nftables, conntrack)
    registry.k8s.io/etcd:3.7.0-0                     /usr/local/bin/etcd (etcd v3.7.0)
    registry.k8s.io/coredns/coredns:v1.14.6          /coredns (Entrypoint)

The static pods that kubeadm writes name the command (`kube-apiserver ...`, `etcd ...`), so the
binaries sit on the image's PATH; coredns's Deployment passes only arguments, so its image has
the Entrypoint. The pause image is hack/images/build.py's (containerd's sandbox image is set to it).

    python hack/images/kind_images.py --out DIR --kube-bin D --etcd-bin D --coredns-bin D \
        --kubernetes-version v1.37.2 --etcd-tag 3.7.0-0 --coredns-tag v1.14.6 --base-layer TAR

prints one line per archive: "<archive> <reference>". Layers are stored uncompressed (the node's
containerd keeps them as blobs; compressing 300 MB of Go binaries costs minutes on 2 cores).
A stamp beside each archive (its inputs' sizes and mtimes) skips a rebuild when nothing changed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build import (
    PATH_ENV,
    Entry,
    deterministic_tar,
    oci_archive_members,
    write_archive,
)

__all__ = ["ImageSpec", "build_archive", "control_plane_specs", "main"]

REGISTRY = "registry.k8s.io"


@dataclass(frozen=True, slots=True)
class ImageSpec:
    name: str  # archive file stem
    reference: str
    binary: Path
    path_in_image: str  # relative, no leading slash
    entrypoint: tuple[str, ...] = ()
    base_layer: Path | None = None


def control_plane_specs(
    *,
    kube_bin: Path,
    etcd_bin: Path,
    coredns_bin: Path,
    kubernetes_version: str,
    etcd_tag: str,
    coredns_tag: str,
    base_layer: Path | None,
) -> tuple[ImageSpec, ...]:
    """The images kubeadm's static pods and addons run, under the names kubeadm expects."""
    specs = [
        ImageSpec(name, f"{REGISTRY}/{name}:{kubernetes_version}", kube_bin / name, f"usr/local/bin/{name}")
        for name in ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
    ]
    specs.append(
        ImageSpec(
            "kube-proxy",
            f"{REGISTRY}/kube-proxy:{kubernetes_version}",
            kube_bin / "kube-proxy",
            "usr/local/bin/kube-proxy",
            base_layer=base_layer,
        )
    )
    specs.append(ImageSpec("etcd", f"{REGISTRY}/etcd:{etcd_tag}", etcd_bin / "etcd", "usr/local/bin/etcd"))
    specs.append(
        ImageSpec(
            "coredns",
            f"{REGISTRY}/coredns/coredns:{coredns_tag}",
            coredns_bin / "coredns",
            "coredns",
            entrypoint=("/coredns",),
        )
    )
    return tuple(specs)


def _binary_layer(spec: ImageSpec) -> bytes:
    parts = spec.path_in_image.split("/")
    entries = [Entry("/".join(parts[: i + 1]), "dir") for i in range(len(parts) - 1)]
    entries.append(Entry(spec.path_in_image, "file", 0o755, spec.binary.read_bytes()))
    if spec.base_layer is None:  # a base layer has its own /tmp and /etc
        entries += [Entry("tmp", "dir", 0o1777), Entry("etc", "dir")]
        entries.append(Entry("etc/passwd", "file", 0o644, b"root:x:0:0:root:/root:/sbin/nologin\n"))
        entries.append(Entry("etc/group", "file", 0o644, b"root:x:0:\n"))
    return deterministic_tar(entries)


def _inputs(spec: ImageSpec) -> dict[str, object]:
    files = [spec.binary] + ([spec.base_layer] if spec.base_layer else [])
    return {
        "reference": spec.reference,
        "entrypoint": list(spec.entrypoint),
        "files": [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files],
        "script": Path(__file__).stat().st_mtime_ns,
    }


def build_archive(spec: ImageSpec, out_dir: Path) -> tuple[Path, bool]:
    """Write OUT/<name>.tar for spec unless its stamp says it is current; (archive, rebuilt)."""
    archive = out_dir / f"{spec.name}.tar"
    stamp = out_dir / f"{spec.name}.stamp.json"
    inputs = _inputs(spec)
    if archive.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == inputs:
        return archive, False
    layers = [spec.base_layer.read_bytes()] if spec.base_layer else []
    layers.append(_binary_layer(spec))
    config: dict[str, object] = {"Env": [PATH_ENV], "WorkingDir": "/"}
    if spec.entrypoint:
        config["Entrypoint"] = list(spec.entrypoint)
    write_archive(archive, oci_archive_members(spec.reference, layers, {"config": config}, compress=False))
    stamp.write_text(json.dumps(inputs, indent=2) + "\n")
    return archive, True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kube-bin", type=Path, required=True)
    parser.add_argument("--etcd-bin", type=Path, required=True)
    parser.add_argument("--coredns-bin", type=Path, required=True)
    parser.add_argument("--kubernetes-version", required=True)
    parser.add_argument("--etcd-tag", required=True)
    parser.add_argument("--coredns-tag", required=True)
    parser.add_argument("--base-layer", type=Path, help="a rootfs tar under kube-proxy (iptables, conntrack)")
    args = parser.parse_args(argv)
    specs = control_plane_specs(
        kube_bin=args.kube_bin,
        etcd_bin=args.etcd_bin,
        coredns_bin=args.coredns_bin,
        kubernetes_version=args.kubernetes_version,
        etcd_tag=args.etcd_tag,
        coredns_tag=args.coredns_tag,
        base_layer=args.base_layer,
    )
    missing = [str(s.binary) for s in specs if not s.binary.is_file()]
    if missing:
        print(
            f"kind_images: missing binaries: {', '.join(missing)} (run hack/upstream-build.sh)",
            file=sys.stderr,
        )
        return 3
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        archive, rebuilt = build_archive(spec, args.out)
        print(f"kind_images: {spec.reference} {'built' if rebuilt else 'up to date'}", file=sys.stderr)
        print(f"{archive} {spec.reference}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

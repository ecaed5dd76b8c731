"""The images every node needs, made here and imported into each node's containerd: no registry.

- the pause (sandbox) image and the test workload image: ``hack/images/build.py`` writes them
  as image archives from a static ``pause`` of our own and Debian's static busybox;
- the driver's image: what ``make image`` builds into podman's store, saved with ``podman save``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from localcluster.cluster import REPO_ROOT, Binaries, ClusterError, LocalCluster, NodeSpec

__all__ = [
    "DRIVER_IMAGE",
    "EXAMPLES_IMAGES",
    "PAUSE_IMAGE",
    "WORKLOAD_IMAGE",
    "build_archives",
    "load_images",
]

DRIVER_IMAGE = "localhost/fractional-dra:dev"
WORKLOAD_IMAGE = "localhost/fractional-e2e-workload:1"
PAUSE_IMAGE = "localhost/fractional-pause:3.10-local"
EXAMPLES_IMAGES = {  # ours -> the names examples/*.yaml use
    WORKLOAD_IMAGE: "docker.io/library/busybox:1.36",
    PAUSE_IMAGE: "registry.k8s.io/pause:3.10",
}


def _cache_dir() -> Path:
    root = Path(os.environ.get("FRACTIONAL_CACHE", Path.home() / ".cache" / "fractional-dra"))
    return root / "images"


def build_archives(*, with_driver: bool) -> list[Path]:
    out = _cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    archives = []
    for kind in ("pause", "workload"):
        result = subprocess.run(
            [sys.executable, str(REPO_ROOT / "hack" / "images" / "build.py"), kind, "--out", str(out)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if result.returncode != 0:
            raise ClusterError(f"hack/images/build.py {kind} failed:\n{result.stderr[-2000:]}")
        archives.append(out / f"{kind}.tar")
    if with_driver:
        archives.append(_driver_archive(out))
    return archives


def _driver_archive(out: Path) -> Path:
    """``make image`` (docker where its daemon answers, else podman, installed from Debian when
    missing: hack/container-lib.sh), so the cluster runs the code of this checkout (about 40 s
    when nothing changed; IMAGE_REBUILD=0 keeps an image that is already there); then a
    docker-archive of it named ``localhost/fractional-dra:dev``."""
    archive = out / "fractional-dra.tar"
    archive.unlink(missing_ok=True)
    script = f"""
set -euo pipefail
source hack/container-lib.sh
container_install
container_detect
image="$(local_image_name fractional-dra:dev)"
if [[ "${{IMAGE_REBUILD:-1}}" != 0 ]] || ! "${{CTR[@]}}" image inspect "$image" > /dev/null 2>&1; then
  make image
fi
if [[ "$image" != {DRIVER_IMAGE} ]]; then "${{CTR[@]}}" tag "$image" {DRIVER_IMAGE}; fi
"${{CTR[@]}}" save -o {archive} {DRIVER_IMAGE}
"""
    result = subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, check=False)
    if result.returncode != 0 or not archive.is_file():
        raise ClusterError(f"the driver's image {DRIVER_IMAGE} could not be built or saved (output above)")
    return archive


def built_archives(*, with_driver: bool) -> list[Path] | None:
    """The archives an earlier ``build_archives`` wrote, when they are all there (a node that joins
    later gets the same images as the others, not a rebuild)."""
    out = _cache_dir()
    names = ["pause.tar", "workload.tar", *(["fractional-dra.tar"] if with_driver else [])]
    archives = [out / name for name in names]
    return archives if all(a.is_file() for a in archives) else None


def load_images(
    cluster: LocalCluster,
    binaries: Binaries,
    nodes: tuple[NodeSpec, ...],
    *,
    with_driver: bool = True,
    reuse: bool = False,
) -> None:
    """Import the images into ``nodes``' containerd (``reuse``: the archives built last, if any)."""
    from localcluster.node import run_dir

    archives = (reuse and built_archives(with_driver=with_driver)) or build_archives(with_driver=with_driver)
    for node in nodes:
        socket_path = run_dir(node) / "containerd.sock"
        for archive in archives:
            result = subprocess.run(
                [str(binaries.containerd / "ctr"), "-a", str(socket_path), "-n", "k8s.io", "images", "import",
                 "--all-platforms", str(archive)],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            if result.returncode != 0:
                raise ClusterError(
                    f"{node.name}: ctr images import {archive.name}: {result.stderr.strip()[-1000:]}"
                )
        # The examples name busybox:1.36 and registry.k8s.io/pause:3.10; here those names are our
        # static busybox and our own pause (there is no registry to pull them from).
        ctr = [str(binaries.containerd / "ctr"), "-a", str(socket_path), "-n", "k8s.io", "images"]
        for source, alias in EXAMPLES_IMAGES.items():
            subprocess.run([*ctr, "rm", alias], capture_output=True, check=False)
            tagged = subprocess.run([*ctr, "tag", source, alias], capture_output=True, text=True)
            if tagged.returncode != 0:
                raise ClusterError(f"{node.name}: ctr images tag {alias}: {tagged.stderr.strip()[-500:]}")

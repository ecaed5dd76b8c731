"""hack/images/build.py: the pause and e2e workload image archives for `ctr images import`.

Builds both with the CLI into a temporary folder, then reads the archives on their own terms (no
code shared with the builder): every blob's sha256 is its name, the index, manifest and config
agree, diff_ids are the uncompressed layers' sha256, the index names the image; /pause is a static
ELF that blocks, reaps and exits 0 on SIGTERM; the workload's bin/sh is busybox and runs
`sh -c 'env | grep FRACTIONAL_'`. When hack/upstream-build.sh has built containerd (and we are
root), a throwaway containerd imports both archives with `ctr images import` and lists them by name.

Skipped only when the toolchain is missing (build.py exits 3): gcc with the static libc
(apt-get install gcc libc6-dev) or a static busybox (apt-get install busybox-static; build.py also
fetches it itself with `apt-get download busybox-static` when the apt lists are there).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import platform
import shutil
import signal
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_PY = REPO_ROOT / "hack" / "images" / "build.py"
EXIT_TOOLCHAIN = 3
INSTALL_HINT = {"pause": "apt-get install gcc libc6-dev", "workload": "apt-get install busybox-static"}

IMAGES = {
    "pause": "localhost/fractional-pause:3.10-local",
    "workload": "localhost/fractional-e2e-workload:1",
}
REQUIRED_APPLETS = ("sh", "env", "cat", "ls", "sleep", "echo", "test", "grep")
GO_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}

# A cold build may apt-get download busybox-static (bounded at 120 s in build.py).
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="builds and runs Linux ELF binaries"),
]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BUILD_PY), *args], capture_output=True, text=True, timeout=280, check=False
    )


def load_json(data: bytes) -> dict[str, Any]:
    obj = json.loads(data)
    assert isinstance(obj, dict)
    return obj


@dataclass
class Archive:
    path: Path
    ref: str
    members: dict[str, bytes]
    infos: list[tarfile.TarInfo]

    def json(self, name: str) -> dict[str, Any]:
        return load_json(self.members[name])

    def blob(self, digest: str) -> bytes:
        algo, _, hexdigest = digest.partition(":")
        assert algo == "sha256", digest
        return self.members[f"blobs/sha256/{hexdigest}"]

    def manifest(self) -> dict[str, Any]:
        index = self.json("index.json")
        assert len(index["manifests"]) == 1
        return load_json(self.blob(index["manifests"][0]["digest"]))

    def config(self) -> dict[str, Any]:
        return load_json(self.blob(self.manifest()["config"]["digest"]))

    def layer(self) -> tuple[tarfile.TarFile, bytes]:
        layers = self.manifest()["layers"]
        assert len(layers) == 1
        raw = gzip.decompress(self.blob(layers[0]["digest"]))
        return tarfile.open(fileobj=io.BytesIO(raw)), raw


def read_archive(path: Path, ref: str) -> Archive:
    members: dict[str, bytes] = {}
    with tarfile.open(path) as tar:
        infos = tar.getmembers()
        for info in infos:
            if info.isfile():
                f = tar.extractfile(info)
                assert f is not None
                members[info.name] = f.read()
    return Archive(path, ref, members, infos)


def build(name: str, out: Path, *extra: str) -> tuple[Path, str, str]:
    proc = run_cli(name, "--out", str(out), *extra)
    if proc.returncode == EXIT_TOOLCHAIN:
        pytest.skip(f"toolchain missing for the {name} image ({INSTALL_HINT[name]}): {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    path_s, ref = proc.stdout.split()
    return Path(path_s), ref, proc.stderr


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("images")


@pytest.fixture(scope="module", params=sorted(IMAGES))
def archive(request: pytest.FixtureRequest, out_dir: Path) -> Archive:
    path, ref, _ = build(request.param, out_dir)
    return read_archive(path, ref)


@pytest.fixture(scope="module")
def pause(out_dir: Path) -> Archive:
    path, ref, _ = build("pause", out_dir)
    return read_archive(path, ref)


@pytest.fixture(scope="module")
def workload(out_dir: Path) -> Archive:
    path, ref, _ = build("workload", out_dir)
    return read_archive(path, ref)


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def elf_has_interp(data: bytes) -> bool:
    """Whether the ELF (64- or 32-bit, either byte order) has a PT_INTERP (3) program header."""
    assert data[:4] == b"\x7fELF", "not an ELF file"
    order = "<" if data[5] == 1 else ">"
    if data[4] == 2:
        (phoff,) = struct.unpack_from(order + "Q", data, 0x20)
        phentsize, phnum = struct.unpack_from(order + "HH", data, 0x36)
    else:
        (phoff,) = struct.unpack_from(order + "I", data, 0x1C)
        phentsize, phnum = struct.unpack_from(order + "HH", data, 0x2A)
    assert phnum > 0, "no program headers"
    types = [struct.unpack_from(order + "I", data, phoff + i * phentsize)[0] for i in range(phnum)]
    return 3 in types


# -- archive structure ----------------------------------------------------------------------------


def test_cli_prints_path_and_reference(archive: Archive) -> None:
    assert archive.path.is_file()
    assert archive.path.name in {"pause.tar", "workload.tar"}
    assert archive.ref == IMAGES[archive.path.stem]


def test_every_blob_is_named_by_its_sha256(archive: Archive) -> None:
    blobs = {n: d for n, d in archive.members.items() if n.startswith("blobs/")}
    assert len(blobs) == 3  # manifest, config, one layer
    for name, data in blobs.items():
        assert name == "blobs/sha256/" + hashlib.sha256(data).hexdigest()
    assert set(archive.members) == {*blobs, "index.json", "manifest.json", "oci-layout"}


def test_index_names_the_image(archive: Archive) -> None:
    assert archive.json("oci-layout") == {"imageLayoutVersion": "1.0.0"}
    index = archive.json("index.json")
    assert index["schemaVersion"] == 2
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    (desc,) = index["manifests"]
    assert desc["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    data = archive.blob(desc["digest"])
    assert desc["size"] == len(data) and desc["digest"] == sha256(data)
    assert desc["annotations"]["io.containerd.image.name"] == archive.ref
    assert desc["annotations"]["org.opencontainers.image.ref.name"] == archive.ref.rsplit(":", 1)[1]
    assert desc["platform"]["os"] == "linux"
    machine = platform.machine().lower()
    if machine in GO_ARCH:
        assert desc["platform"]["architecture"] == GO_ARCH[machine]


def test_manifest_config_and_layers_agree(archive: Archive) -> None:
    manifest = archive.manifest()
    assert manifest["schemaVersion"] == 2
    assert manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    cdesc = manifest["config"]
    assert cdesc["mediaType"] == "application/vnd.oci.image.config.v1+json"
    cdata = archive.blob(cdesc["digest"])
    assert cdesc["size"] == len(cdata) and cdesc["digest"] == sha256(cdata)
    config = json.loads(cdata)
    index_platform = archive.json("index.json")["manifests"][0]["platform"]
    assert config["architecture"] == index_platform["architecture"]
    assert config["os"] == "linux"
    assert "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" in config["config"]["Env"]
    diff_ids = []
    for ldesc in manifest["layers"]:
        assert ldesc["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
        blob = archive.blob(ldesc["digest"])
        assert ldesc["size"] == len(blob) and ldesc["digest"] == sha256(blob)
        diff_ids.append(sha256(gzip.decompress(blob)))
    assert config["rootfs"] == {"type": "layers", "diff_ids": diff_ids}


def test_docker_manifest_points_at_the_same_blobs(archive: Archive) -> None:
    (entry,) = json.loads(archive.members["manifest.json"])
    manifest = archive.manifest()
    assert entry["RepoTags"] == [archive.ref]
    assert entry["Config"] == "blobs/sha256/" + manifest["config"]["digest"].split(":")[1]
    assert entry["Layers"] == ["blobs/sha256/" + d["digest"].split(":")[1] for d in manifest["layers"]]


def test_tars_are_deterministic(archive: Archive) -> None:
    layer, _ = archive.layer()
    for infos in (archive.infos, layer.getmembers()):
        names = [i.name.rstrip("/") for i in infos]
        assert names == sorted(names)
        for i in infos:
            assert (i.mtime, i.uid, i.gid) == (0, 0, 0), i.name


def test_rebuild_gives_identical_bytes(archive: Archive, tmp_path: Path) -> None:
    again, ref, _ = build(archive.path.stem, tmp_path, "--force")
    assert ref == archive.ref
    assert again.read_bytes() == archive.path.read_bytes()


def test_stamp_skips_an_unchanged_rebuild(archive: Archive, tmp_path: Path) -> None:
    name = archive.path.stem
    path, _, err = build(name, tmp_path)
    assert "built in" in err
    first = path.stat().st_mtime_ns
    _, _, err = build(name, tmp_path)
    assert "up to date" in err
    assert path.stat().st_mtime_ns == first
    # A changed archive (or stamp) is rebuilt.
    path.write_bytes(b"garbage")
    _, _, err = build(name, tmp_path)
    assert "built in" in err
    assert path.read_bytes() == archive.path.read_bytes()


# -- pause ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pause_binary(pause: Archive, tmp_path_factory: pytest.TempPathFactory) -> Path:
    layer, _ = pause.layer()
    (info,) = layer.getmembers()
    assert info.name == "pause" and info.isfile()
    assert info.mode & 0o777 == 0o755
    f = layer.extractfile(info)
    assert f is not None
    path = tmp_path_factory.mktemp("pause") / "pause"
    path.write_bytes(f.read())
    path.chmod(0o755)
    return path


def test_pause_layer_is_one_static_executable(pause_binary: Path) -> None:
    assert not elf_has_interp(pause_binary.read_bytes()), "/pause has a PT_INTERP: not static"


def test_pause_config(pause: Archive) -> None:
    cfg = pause.config()["config"]
    assert cfg["Entrypoint"] == ["/pause"]
    assert "Cmd" not in cfg


def test_pause_prints_its_version(pause_binary: Path) -> None:
    proc = subprocess.run([str(pause_binary), "-v"], capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0
    assert "3.10-local" in proc.stdout


def _state(pid: int) -> str | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1]
    except FileNotFoundError:
        return None
    return None


def _wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_pause_blocks_reaps_and_exits_zero_on_signal(pause_binary: Path, sig: signal.Signals) -> None:
    # sh starts a short child, then execs pause: the child becomes pause's and must not stay a zombie.
    proc = subprocess.Popen(
        ["/bin/sh", "-c", f'sleep 0.3 & echo "$!"; exec "{pause_binary}"'],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        assert _wait_for(lambda: _state(child) is None), f"child {child} not reaped: {_state(child)}"
        time.sleep(0.2)
        assert proc.poll() is None, "pause exited on its own"
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


# -- workload -------------------------------------------------------------------------------------


def test_workload_has_static_busybox_and_applet_links(workload: Archive) -> None:
    layer, _ = workload.layer()
    infos = {i.name.rstrip("/"): i for i in layer.getmembers()}
    bb = infos["bin/busybox"]
    assert bb.isfile() and bb.mode & 0o111
    f = layer.extractfile(bb)
    assert f is not None
    assert not elf_has_interp(f.read()), "bin/busybox has a PT_INTERP: not static"
    for applet in REQUIRED_APPLETS:
        link = infos[f"bin/{applet}"]
        assert link.issym() and link.linkname == "busybox", applet
    cfg = workload.config()["config"]
    assert cfg["Cmd"] == ["sh"]
    assert "Entrypoint" not in cfg


def test_workload_shell_runs_the_e2e_command(workload: Archive, tmp_path: Path) -> None:
    layer, _ = workload.layer()
    layer.extractall(tmp_path, filter="data")
    bin_dir = tmp_path / "bin"
    env = {"PATH": str(bin_dir), "FRACTIONAL_SLICE": "gpu-0/1g.10gb"}
    script = "env | grep FRACTIONAL_; cat /dev/null; ls / >/dev/null; test -n x && echo done; sleep 0"
    proc = subprocess.run(
        [str(bin_dir / "sh"), "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=20,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["FRACTIONAL_SLICE=gpu-0/1g.10gb", "done"]


# -- check, driver --------------------------------------------------------------------------------


def test_check_only_verifies() -> None:
    proc = run_cli("--check")
    assert proc.returncode in (0, EXIT_TOOLCHAIN), proc.stderr
    lines = proc.stdout.splitlines()
    assert [ln.split(":", 1)[0] for ln in lines] == ["pause", "workload", "driver"]


def test_driver_save_command(tmp_path: Path) -> None:
    proc = run_cli("driver", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    archive = tmp_path.resolve() / "driver.tar"
    assert proc.stdout.strip() == (
        f"podman save --format docker-archive -o {archive} localhost/fractional-dra:dev"
    )
    assert not archive.exists()


# -- a real import, when hack/upstream-build.sh has built containerd --------------------------------


def containerd_bin_dir() -> Path | None:
    cache = Path(os.environ.get("FRACTIONAL_CACHE") or Path.home() / ".cache" / "fractional-dra")
    for d in sorted((cache / "bin").glob("containerd-v*"), reverse=True):
        if (d / "containerd").is_file() and (d / "ctr").is_file():
            return d
    return None


# Only the image store, content, snapshotters and the transfer service: no CRI, and no NRI (whose
# socket, /var/run/nri/nri.sock, a real node's containerd owns).
THROWAWAY_CONFIG = """version = 3
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime",
  "io.containerd.cri.v1.images", "io.containerd.nri.v1.nri"]
"""


def test_ctr_imports_both_archives(pause: Archive, workload: Archive) -> None:
    bin_dir = containerd_bin_dir()
    if bin_dir is None:
        pytest.skip("no containerd built (hack/upstream-build.sh puts it in ~/.cache/fractional-dra/bin)")
    if os.geteuid() != 0:
        pytest.skip("a throwaway containerd that unpacks layers needs root")
    # A short path: unix socket paths are limited to 108 bytes.
    tmp = Path(tempfile.mkdtemp(prefix="ctr-", dir="/tmp"))
    sock = tmp / "c.sock"
    (tmp / "config.toml").write_text(THROWAWAY_CONFIG)
    log = (tmp / "containerd.log").open("wb")
    daemon = subprocess.Popen(
        [str(bin_dir / "containerd"), "--config", str(tmp / "config.toml"), "--root", str(tmp / "root"),
         "--state", str(tmp / "state"), "--address", str(sock)],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        assert _wait_for(lambda: sock.exists() or daemon.poll() is not None, 30)
        assert daemon.poll() is None, (tmp / "containerd.log").read_text()[-3000:]
        ctr = [str(bin_dir / "ctr"), "-a", str(sock), "-n", "k8s.io"]
        for archive in (pause, workload):
            proc = subprocess.run(
                [*ctr, "images", "import", str(archive.path)], capture_output=True, text=True, timeout=60
            )
            assert proc.returncode == 0, proc.stderr
        proc = subprocess.run([*ctr, "images", "ls", "-q"], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        assert set(proc.stdout.split()) == {pause.ref, workload.ref}
        proc = subprocess.run([*ctr, "images", "check"], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        for archive in (pause, workload):
            (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith(archive.ref + " ")]
            assert "complete" in line and line.split()[-1] == "true", line  # all blobs, unpacked
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)

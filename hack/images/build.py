#!/usr/bin/env python3
"""Build the cluster's small images as archives `ctr -n k8s.io images import` loads, with no
registry, no container engine and nothing pulled: Python's stdlib writes every byte.

    python hack/images/build.py pause --out DIR      # DIR/pause.tar     localhost/fractional-pause:3.10-local
    python hack/images/build.py workload --out DIR   # DIR/workload.tar  localhost/fractional-e2e-workload:1
    python hack/images/build.py --check              # only verify the toolchain (gcc -static, busybox)
    python hack/images/build.py driver --out DIR     # the command that saves `make image`'s image

Each build prints one line on stdout, "<archive path> <image reference>", and a note on stderr.

The archive is an OCI image layout (oci-layout, index.json, blobs/sha256/...), whose index names
the image with the annotation io.containerd.image.name (the full reference, which containerd uses
as is) and org.opencontainers.image.ref.name (the tag, as the OCI spec and containerd's own exporter
have it). It also carries a Docker manifest.json over the same blobs, like `docker save` since
Docker 25, so that `docker load` and `podman load` take it too; containerd prefers the OCI layout
when both are present (core/images/archive/importer.go). Everything is deterministic: sorted tar
entries, mtime 0, uid/gid 0, gzip without name or time, fixed JSON key order, the epoch as the
creation time; the same inputs give the same bytes.

Cache: DIR/<name>.stamp.json records the inputs (this script's and pause.c's sha256, the compiler,
busybox's version and sha256, the architecture) and the archive's sha256; when they all still match,
the build is skipped. --force rebuilds.

busybox comes from, in this order: --busybox PATH (or $FRACTIONAL_BUSYBOX); the installed Debian
package busybox-static; this script's cache, CACHE/busybox-static/<arch>/ where CACHE is
$FRACTIONAL_CACHE (as for hack/upstream-build.sh), else ${XDG_CACHE_HOME:-~/.cache}/fractional-dra;
else `apt-get download busybox-static` and `dpkg-deb -x` into that cache (--no-download forbids
it). It must be statically linked (no PT_INTERP).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import platform
import shlex
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PAUSE_SOURCE = HERE / "pause.c"

PAUSE_VERSION = "3.10-local"
PAUSE_IMAGE = f"localhost/fractional-pause:{PAUSE_VERSION}"
WORKLOAD_IMAGE = "localhost/fractional-e2e-workload:1"
# `make image` (hack/image-build.sh) stores the driver's image in podman as localhost/fractional-dra:dev.
DRIVER_IMAGE = "localhost/fractional-dra:dev"

PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
EPOCH = "1970-01-01T00:00:00Z"
# The applets the e2e pods use (`sh -c 'env | grep FRACTIONAL_; sleep 3600'`), then a few handy
# ones for debugging a pod; an extra one busybox lacks is left out, a required one is an error.
REQUIRED_APPLETS = ("sh", "env", "cat", "ls", "sleep", "echo", "test", "grep")
EXTRA_APPLETS = (
    "[", "cp", "cut", "date", "df", "false", "find", "head", "hostname", "id", "kill", "mkdir",
    "mv", "nproc", "printenv", "printf", "ps", "pwd", "rm", "sed", "tail", "tee", "touch", "tr",
    "true", "uname", "wc",
)  # fmt: skip

MT_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MT_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MT_OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
ANNOTATION_IMAGE_NAME = "io.containerd.image.name"
ANNOTATION_REF_NAME = "org.opencontainers.image.ref.name"

EXIT_TOOLCHAIN = 3  # a tool or input is missing: the message says how to install it
APT_TIMEOUT_S = 120


class ToolchainError(RuntimeError):
    """A tool or input the build needs is missing or unusable; the message says how to fix it."""


# -- platform, ELF --------------------------------------------------------------------------------

_GO_ARCH = {
    "x86_64": ("amd64", ""),
    "amd64": ("amd64", ""),
    "aarch64": ("arm64", "v8"),
    "arm64": ("arm64", "v8"),
    "armv7l": ("arm", "v7"),
    "ppc64le": ("ppc64le", ""),
    "s390x": ("s390x", ""),
    "riscv64": ("riscv64", ""),
}


def image_platform() -> dict[str, str]:
    """The OCI platform of this machine (what gcc and the Debian package build for)."""
    machine = platform.machine().lower()
    if machine not in _GO_ARCH:
        raise ToolchainError(f"unsupported architecture {machine!r}")
    arch, variant = _GO_ARCH[machine]
    plat = {"architecture": arch, "os": "linux"}
    if variant:
        plat["variant"] = variant
    return plat


PT_INTERP = 3


def elf_is_static(data: bytes) -> bool:
    """True when the ELF executable has no PT_INTERP program header (no dynamic loader)."""
    if len(data) < 52 or data[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    elf_class, endian = data[4], data[5]
    order = "<" if endian == 1 else ">"
    if elf_class == 2:  # 64-bit
        (phoff,) = struct.unpack_from(order + "Q", data, 0x20)
        phentsize, phnum = struct.unpack_from(order + "HH", data, 0x36)
    elif elf_class == 1:
        (phoff,) = struct.unpack_from(order + "I", data, 0x1C)
        phentsize, phnum = struct.unpack_from(order + "HH", data, 0x2A)
    else:
        raise ValueError(f"unknown ELF class {elf_class}")
    for i in range(phnum):
        (p_type,) = struct.unpack_from(order + "I", data, phoff + i * phentsize)
        if p_type == PT_INTERP:
            return False
    return True


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# -- layers and archives --------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One file system entry of a layer; name is relative ("bin/sh"), no leading slash."""

    name: str
    kind: str  # "file" | "dir" | "symlink"
    mode: int = 0o755
    data: bytes = b""
    target: str = ""


def _tarinfo(name: str, kind: bytes, mode: int, size: int = 0, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.size = size
    info.linkname = linkname
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def deterministic_tar(entries: Sequence[Entry]) -> bytes:
    """An uncompressed tar of entries, sorted by name, owned by 0:0, mtime 0 (PAX for long names)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in sorted(entries, key=lambda e: e.name):
            if e.kind == "dir":
                tar.addfile(_tarinfo(e.name.rstrip("/") + "/", tarfile.DIRTYPE, e.mode))
            elif e.kind == "symlink":
                tar.addfile(_tarinfo(e.name, tarfile.SYMTYPE, 0o777, linkname=e.target))
            elif e.kind == "file":
                tar.addfile(_tarinfo(e.name, tarfile.REGTYPE, e.mode, len(e.data)), io.BytesIO(e.data))
            else:
                raise ValueError(f"unknown entry kind {e.kind!r} for {e.name}")
    return buf.getvalue()


def gzip_deterministic(data: bytes) -> bytes:
    """gzip with no file name and mtime 0, so equal input gives equal output."""
    return gzip.compress(data, compresslevel=9, mtime=0)


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _tag_of(ref: str) -> str:
    last = ref.rsplit("/", 1)[-1]
    if ":" not in last:
        raise ValueError(f"image reference {ref!r} has no tag")
    return last.split(":", 1)[1]


def oci_archive_members(
    ref: str, layer_tars: Sequence[bytes], config: dict[str, Any], *, compress: bool = True
) -> list[tuple[str, bytes]]:
    """The files of an OCI image-layout archive for one image (plus Docker's manifest.json).

    config is the image config without rootfs and history: both are filled in here.
    """
    plat = image_platform()
    blobs: dict[str, bytes] = {}

    def store(blob: bytes) -> str:
        """Keep ``blob`` under its digest; returns the digest."""
        digest = "sha256:" + sha256_hex(blob)
        blobs[digest] = blob
        return digest

    layer_descs: list[dict[str, Any]] = []
    diff_ids: list[str] = []
    for raw in layer_tars:
        diff_ids.append("sha256:" + sha256_hex(raw))
        blob = gzip_deterministic(raw) if compress else raw
        digest = store(blob)
        media_type = MT_OCI_LAYER_GZIP if compress else MT_OCI_LAYER
        layer_descs.append({"mediaType": media_type, "digest": digest, "size": len(blob)})
    full_config = {
        **plat,
        "created": EPOCH,
        **config,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [{"created": EPOCH, "created_by": f"hack/images/build.py ({ref})"}],
    }
    config_blob = canonical_json(full_config)
    config_digest = store(config_blob)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MT_OCI_MANIFEST,
        "config": {"mediaType": MT_OCI_CONFIG, "digest": config_digest, "size": len(config_blob)},
        "layers": layer_descs,
    }
    manifest_blob = canonical_json(manifest)
    manifest_digest = store(manifest_blob)
    index = {
        "schemaVersion": 2,
        "mediaType": MT_OCI_INDEX,
        "manifests": [
            {
                "mediaType": MT_OCI_MANIFEST,
                "digest": manifest_digest,
                "size": len(manifest_blob),
                "platform": plat,
                "annotations": {ANNOTATION_IMAGE_NAME: ref, ANNOTATION_REF_NAME: _tag_of(ref)},
            }
        ],
    }

    def blob_path(digest: str) -> str:
        return "blobs/sha256/" + digest.removeprefix("sha256:")

    docker_manifest = [
        {
            "Config": blob_path(config_digest),
            "RepoTags": [ref],
            "Layers": [blob_path(d["digest"]) for d in layer_descs],
        }
    ]
    members = [(blob_path(d), b) for d, b in blobs.items()]
    members += [
        ("index.json", canonical_json(index)),
        ("manifest.json", canonical_json(docker_manifest)),
        ("oci-layout", canonical_json({"imageLayoutVersion": "1.0.0"})),
    ]
    return sorted(members)


def write_archive(path: Path, members: Sequence[tuple[str, bytes]]) -> None:
    """Write the archive tar atomically (a temporary file in the same folder, then rename)."""
    entries = [Entry("blobs", "dir"), Entry("blobs/sha256", "dir")]
    entries += [Entry(name, "file", 0o644, data) for name, data in members]
    data = deterministic_tar(entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -- stamps ---------------------------------------------------------------------------------------


def _stamp_path(archive: Path) -> Path:
    return archive.with_name(archive.stem + ".stamp.json")


def up_to_date(archive: Path, inputs: dict[str, str]) -> bool:
    stamp = _stamp_path(archive)
    if not archive.is_file() or not stamp.is_file():
        return False
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return bool(recorded.get("inputs") == inputs and recorded.get("archive_sha256") == file_sha256(archive))


def write_stamp(archive: Path, inputs: dict[str, str]) -> None:
    record = {"inputs": inputs, "archive_sha256": file_sha256(archive)}
    _stamp_path(archive).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


# -- pause ----------------------------------------------------------------------------------------


def _cc() -> str:
    cc = os.environ.get("CC", "gcc")
    path = shutil.which(cc)
    if path is None:
        raise ToolchainError(f"no C compiler {cc!r}; install it: apt-get install gcc libc6-dev")
    return path


def _run(argv: Sequence[str], *, timeout: float = 120, cwd: Path | None = None) -> str:
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ToolchainError(f"{shlex.join(argv)}: {exc}") from exc
    if proc.returncode != 0:
        raise ToolchainError(f"{shlex.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def compiler_id() -> str:
    cc = _cc()
    return f"{Path(cc).name} {_run([cc, '-dumpfullversion']).strip()} {_run([cc, '-dumpmachine']).strip()}"


def compile_static(source: Path, output: Path, defines: Sequence[str] = ()) -> None:
    """gcc -static -Os (stripped); the result must have no PT_INTERP."""
    cc = _cc()
    argv = [cc, "-static", "-Os", "-s", "-Wall", "-Wextra", "-Werror", *defines]
    argv += ["-o", str(output), str(source)]
    try:
        _run(argv)
    except ToolchainError as exc:
        raise ToolchainError(
            f"{exc}\n`gcc -static` needs the static C library: apt-get install gcc libc6-dev"
        ) from exc
    if not elf_is_static(output.read_bytes()):
        raise ToolchainError(f"{output} is not statically linked although built with -static")


def check_gcc_static() -> str:
    with tempfile.TemporaryDirectory(prefix="fractional-cc-check-") as tmp:
        src = Path(tmp) / "t.c"
        src.write_text('#include <stdio.h>\nint main(void) { puts("ok"); return 0; }\n')
        out = Path(tmp) / "t"
        compile_static(src, out)
        got = _run([str(out)]).strip()
        if got != "ok":
            raise ToolchainError(f"a static test program printed {got!r}, not 'ok'")
    return compiler_id()


def _script_sha256() -> str:
    return file_sha256(Path(__file__).resolve())


def build_pause(out_dir: Path, *, force: bool = False) -> tuple[Path, str, bool]:
    """Build DIR/pause.tar; returns (archive, reference, rebuilt)."""
    archive = out_dir / "pause.tar"
    inputs = {
        "image": PAUSE_IMAGE,
        "pause.c": file_sha256(PAUSE_SOURCE),
        "build.py": _script_sha256(),
        "compiler": compiler_id(),
        "platform": json.dumps(image_platform(), sort_keys=True),
    }
    if not force and up_to_date(archive, inputs):
        return archive, PAUSE_IMAGE, False
    with tempfile.TemporaryDirectory(prefix="fractional-pause-") as tmp:
        binary = Path(tmp) / "pause"
        compile_static(PAUSE_SOURCE, binary, [f'-DPAUSE_VERSION="{PAUSE_VERSION}"'])
        data = binary.read_bytes()
    layer = deterministic_tar([Entry("pause", "file", 0o755, data)])
    config = {
        "config": {
            "Entrypoint": ["/pause"],
            "Env": [PATH_ENV],
            # As upstream's registry.k8s.io/pause: the sandbox holder needs no privilege.
            "User": "65535:65535",
            "WorkingDir": "/",
        }
    }
    write_archive(archive, oci_archive_members(PAUSE_IMAGE, [layer], config))
    write_stamp(archive, inputs)
    return archive, PAUSE_IMAGE, True


# -- busybox, workload ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Busybox:
    path: Path
    version: str  # the Debian package version, or busybox's own banner
    source: str  # where it was found
    copyright: Path | None = None


def cache_root() -> Path:
    """$FRACTIONAL_CACHE (as hack/upstream-build.sh), else $XDG_CACHE_HOME or ~/.cache, /fractional-dra."""
    if os.environ.get("FRACTIONAL_CACHE"):
        return Path(os.environ["FRACTIONAL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fractional-dra"


def _busybox_cache_dir() -> Path:
    return cache_root() / "busybox-static" / image_platform()["architecture"]


def _validate_busybox(path: Path, version: str, source: str, copyright: Path | None = None) -> Busybox:
    if not path.is_file():
        raise ToolchainError(f"busybox {path} ({source}) is not a file")
    try:
        static = elf_is_static(path.read_bytes())
    except ValueError as exc:
        raise ToolchainError(f"busybox {path} ({source}): {exc}") from exc
    if not static:
        raise ToolchainError(
            f"busybox {path} ({source}) is dynamically linked; the image needs busybox-static "
            "(apt-get install busybox-static, or leave it to this script's apt-get download)"
        )
    return Busybox(path, version, source, copyright if copyright and copyright.is_file() else None)


def _busybox_banner(path: Path) -> str:
    proc = subprocess.run([str(path)], capture_output=True, text=True, timeout=30, check=False)
    first = (proc.stdout or proc.stderr).splitlines()
    return first[0].strip() if first else "unknown"


def _installed_busybox() -> Busybox | None:
    if shutil.which("dpkg-query") is None:
        return None
    proc = subprocess.run(
        ["dpkg-query", "-W", "-f", "${db:Status-Status} ${Version}", "busybox-static"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    status, _, version = proc.stdout.strip().partition(" ")
    if proc.returncode != 0 or status != "installed":
        return None
    files = _run(["dpkg-query", "-L", "busybox-static"]).splitlines()
    binaries = [f for f in files if f.endswith("/bin/busybox")]
    copyrights = [f for f in files if f.endswith("/copyright")]
    if not binaries:
        return None
    return _validate_busybox(
        Path(binaries[0]), version, "Debian package busybox-static (installed)",
        Path(copyrights[0]) if copyrights else None,
    )  # fmt: skip


def _cached_busybox() -> Busybox | None:
    d = _busybox_cache_dir()
    binary, version = d / "busybox", d / "version"
    if not binary.is_file() or not version.is_file():
        return None
    return _validate_busybox(binary, version.read_text().strip(), f"cache {d}", d / "copyright")


def download_busybox() -> Busybox:
    """apt-get download busybox-static, dpkg-deb -x, into the cache (no root needed)."""
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise ToolchainError(
                f"no {tool}: get a static busybox by hand and pass --busybox PATH "
                "(Debian/Ubuntu: apt-get install busybox-static)"
            )
    with tempfile.TemporaryDirectory(prefix="fractional-busybox-") as tmp:
        os.chmod(tmp, 0o755)  # apt's _apt sandbox user may write here then
        try:
            _run(["apt-get", "download", "-q", "busybox-static"], timeout=APT_TIMEOUT_S, cwd=Path(tmp))
        except ToolchainError as exc:
            raise ToolchainError(
                f"{exc}\nno busybox-static: apt-get update && apt-get install busybox-static "
                "(or pass --busybox PATH to a static busybox)"
            ) from exc
        debs = sorted(Path(tmp).glob("busybox-static_*.deb"))
        if not debs:
            raise ToolchainError("apt-get download busybox-static left no .deb")
        deb = debs[-1]
        version = _run(["dpkg-deb", "-f", str(deb), "Version"]).strip()
        root = Path(tmp) / "root"
        _run(["dpkg-deb", "-x", str(deb), str(root)])
        found = [p for p in (root / "bin" / "busybox", root / "usr" / "bin" / "busybox") if p.is_file()]
        if not found:
            raise ToolchainError(f"{deb.name} holds no bin/busybox")
        _validate_busybox(found[0], version, f"downloaded {deb.name}")
        cache = _busybox_cache_dir()
        cache.mkdir(parents=True, exist_ok=True)
        shutil.copy2(found[0], cache / "busybox.tmp")
        os.replace(cache / "busybox.tmp", cache / "busybox")
        copyrights = sorted(root.glob("usr/share/doc/busybox*/copyright"))
        if copyrights:
            shutil.copyfile(copyrights[0], cache / "copyright")
        (cache / "version").write_text(version + "\n")
    cached = _cached_busybox()
    assert cached is not None
    return cached


def find_busybox(explicit: Path | None = None, *, download: bool = True) -> Busybox:
    if explicit is None and os.environ.get("FRACTIONAL_BUSYBOX"):
        explicit = Path(os.environ["FRACTIONAL_BUSYBOX"])
    if explicit is not None:
        return _validate_busybox(explicit, _busybox_banner(explicit), f"given {explicit}")
    for finder in (_installed_busybox, _cached_busybox):
        found = finder()
        if found is not None:
            return found
    if not download:
        raise ToolchainError(
            "no static busybox: apt-get install busybox-static, or run without --no-download "
            "(apt-get download busybox-static into the cache), or pass --busybox PATH"
        )
    return download_busybox()


def busybox_applets(busybox: Busybox) -> list[str]:
    return sorted(_run([str(busybox.path), "--list"]).split())


_PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
_GROUP = "root:x:0:\nnogroup:x:65534:\n"


def workload_entries(busybox: Busybox) -> list[Entry]:
    have = set(busybox_applets(busybox))
    missing = [a for a in REQUIRED_APPLETS if a not in have]
    if missing:
        raise ToolchainError(f"busybox {busybox.path} lacks the applets {missing}")
    applets = sorted({*REQUIRED_APPLETS, *(a for a in EXTRA_APPLETS if a in have)} - {"busybox"})
    entries = [
        Entry("bin", "dir"),
        Entry("bin/busybox", "file", 0o755, busybox.path.read_bytes()),
        Entry("etc", "dir"),
        Entry("etc/group", "file", 0o644, _GROUP.encode()),
        Entry("etc/passwd", "file", 0o644, _PASSWD.encode()),
        Entry("tmp", "dir", 0o1777),
    ]
    entries += [Entry(f"bin/{a}", "symlink", target="busybox") for a in applets]
    if busybox.copyright is not None:
        entries += [
            Entry("usr", "dir"),
            Entry("usr/share", "dir"),
            Entry("usr/share/doc", "dir"),
            Entry("usr/share/doc/busybox", "dir"),
            Entry("usr/share/doc/busybox/copyright", "file", 0o644, busybox.copyright.read_bytes()),
        ]
    return entries


def build_workload(
    out_dir: Path, *, force: bool = False, busybox_path: Path | None = None, download: bool = True
) -> tuple[Path, str, bool]:
    """Build DIR/workload.tar; returns (archive, reference, rebuilt)."""
    archive = out_dir / "workload.tar"
    busybox = find_busybox(busybox_path, download=download)
    inputs = {
        "image": WORKLOAD_IMAGE,
        "busybox.version": busybox.version,
        "busybox.sha256": file_sha256(busybox.path),
        "copyright.sha256": file_sha256(busybox.copyright) if busybox.copyright else "",
        "build.py": _script_sha256(),
        "platform": json.dumps(image_platform(), sort_keys=True),
    }
    if not force and up_to_date(archive, inputs):
        return archive, WORKLOAD_IMAGE, False
    layer = deterministic_tar(workload_entries(busybox))
    config = {"config": {"Cmd": ["sh"], "Env": [PATH_ENV], "WorkingDir": "/"}}
    write_archive(archive, oci_archive_members(WORKLOAD_IMAGE, [layer], config))
    write_stamp(archive, inputs)
    return archive, WORKLOAD_IMAGE, True


def check_busybox(busybox_path: Path | None) -> str:
    try:
        bb = find_busybox(busybox_path, download=False)
    except ToolchainError:
        if shutil.which("apt-get") and shutil.which("dpkg-deb") and shutil.which("apt-cache"):
            out = _run(["apt-cache", "policy", "busybox-static"])
            cand = [ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Candidate:" in ln]
            if cand and cand[0] != "(none)":
                return f"busybox-static {cand[0]} not here yet: the first build runs apt-get download"
        raise
    return f"busybox {bb.version} from {bb.source} ({bb.path})"


# -- driver image ---------------------------------------------------------------------------------


def driver_save_command(archive: Path, image: str = DRIVER_IMAGE, runtime: str = "podman") -> list[str]:
    """The command that writes `make image`'s image as a docker-archive `ctr images import` loads.

    podman (what hack/image-build.sh uses without a Docker daemon) stores it as
    localhost/fractional-dra:dev; its docker-archive has that RepoTag, which containerd's importer
    normalizes to the same reference. With Docker the image is fractional-dra:dev, which
    containerd would read as docker.io/library/fractional-dra:dev: `docker tag` it to the
    localhost/ name first, then `docker save -o ARCHIVE localhost/fractional-dra:dev`.
    """
    if runtime == "podman":
        return ["podman", "save", "--format", "docker-archive", "-o", str(archive), image]
    if runtime == "docker":
        return ["docker", "save", "-o", str(archive), image]
    raise ValueError(f"runtime must be podman or docker, not {runtime!r}")


# -- CLI ------------------------------------------------------------------------------------------


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="build.py",
        description="Build fractional-dra's pause and e2e workload images as OCI archives for "
        "`ctr -n k8s.io images import`, with no registry and no container engine.",
    )
    p.add_argument("target", nargs="?", choices=("pause", "workload", "driver"))
    p.add_argument("--out", type=Path, help="folder for <target>.tar and its stamp")
    p.add_argument("--check", action="store_true", help="only verify the toolchain (all if no target)")
    p.add_argument("--force", action="store_true", help="rebuild even when the stamp says up to date")
    p.add_argument("--busybox", type=Path, help="a static busybox to use (default: see the module doc)")
    p.add_argument("--no-download", action="store_true", help="never apt-get download busybox-static")
    p.add_argument("--runtime", choices=("podman", "docker"), default="podman", help="driver: the engine")
    p.add_argument("--run", action="store_true", help="driver: run the save command, not only print it")
    args = p.parse_args(argv)
    if args.target is None and not args.check:
        p.error("give a target (pause, workload, driver) or --check")
    if args.target is not None and not args.check and args.out is None:
        p.error("--out DIR is required")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    out = sys.stdout.write
    err = sys.stderr.write
    try:
        if args.check:
            targets = [args.target] if args.target else ["pause", "workload", "driver"]
            failed = False
            for t in targets:
                try:
                    if t == "pause":
                        detail = f"{check_gcc_static()}, -static works"
                    elif t == "workload":
                        detail = check_busybox(args.busybox)
                    else:
                        engine = shutil.which(args.runtime)
                        detail = f"{args.runtime} at {engine}" if engine else f"no {args.runtime} (for --run)"
                    out(f"{t}: ok: {detail}\n")
                except ToolchainError as exc:
                    failed = True
                    out(f"{t}: MISSING: {exc}\n")
            return EXIT_TOOLCHAIN if failed else 0

        if args.target == "driver":
            archive = (args.out / "driver.tar").resolve()
            cmd = driver_save_command(archive, runtime=args.runtime)
            if not args.run:
                out(shlex.join(cmd) + "\n")
                return 0
            if shutil.which(cmd[0]) is None:
                raise ToolchainError(f"no {cmd[0]}; build the image first with `make image`")
            archive.parent.mkdir(parents=True, exist_ok=True)
            _run(cmd, timeout=600)
            out(f"{archive} {DRIVER_IMAGE}\n")
            return 0

        started = time.monotonic()
        if args.target == "pause":
            archive, ref, rebuilt = build_pause(args.out, force=args.force)
        else:
            archive, ref, rebuilt = build_workload(
                args.out, force=args.force, busybox_path=args.busybox, download=not args.no_download
            )
        elapsed = time.monotonic() - started
        size = archive.stat().st_size
        state = f"built in {elapsed:.2f} s" if rebuilt else "up to date (stamp matches), not rebuilt"
        err(f"build.py: {archive.name}: {state}, {size} bytes\n")
        out(f"{archive.resolve()} {ref}\n")
        return 0
    except ToolchainError as exc:
        err(f"build.py: {exc}\n")
        return EXIT_TOOLCHAIN


if __name__ == "__main__":
    sys.exit(main())

"""Every CDI name, and the one renderer and writer of CDI spec files.

Layout (docs/architecture.md: Names): vendor ``k8s.fractional.dev``, classes ``gpu`` and ``nic``; one
transient spec file per claim **and class**, ``<cdi-root>/k8s.fractional.dev-<class>_<claimUID>.json``.
A claim with GPUs and NICs therefore gets two files (kinds ``k8s.fractional.dev/gpu`` and
``.../nic``): the kind names the class, and each file keeps the name docs/architecture.md fixes.
Device names are ``<claimUID>-<device>[-<first 8 chars of shareID>]``: unique per claim, never
reused (runtimes cache specs). Files are written atomically (temp file, fsync, rename, fsync of the
directory) with the minimum ``cdiVersion`` their content needs (``MinimumRequiredVersion`` in
cncf-tags/container-device-interface ``specs-go/version.go``).

Every value that ends up in a file name passes ``check_name_part`` first: a ``/``, ``..``, an
unexpected character or an over-long value is a per-claim ``ClaimError``, never a path outside
the CDI root.

Entries planted under our names are never followed: a symlink, FIFO or anything but a regular file
where a claim's spec should be is not "the spec": ``ensure_cdi_spec`` removes it and writes ours
(the atomic rename replaces the entry itself), ``remove_claim_specs`` unlinks a link, not its
target. Reading other runtimes' specs (``find_spec_for_kind``) never blocks on a FIFO.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from driver.errors import ClaimError
from driver.plugin.atomic import UnsafeEntryError, describe_entry, read_regular_file, write_atomically
from driver.plugin.sharing.base import ContainerEdits, DeviceNode, Mount

__all__ = [
    "CDI_CLASSES",
    "CDI_VENDOR",
    "MAX_NAME_PART_LENGTH",
    "check_name_part",
    "claim_spec_path",
    "device_name",
    "ensure_cdi_root",
    "ensure_cdi_spec",
    "find_spec_for_kind",
    "minimum_cdi_version",
    "parse_container_edits",
    "qualified_device_id",
    "read_claim_spec",
    "remove_claim_specs",
    "remove_planted_specs",
    "spec_in_place",
    "render_claim_spec",
    "render_container_edits",
    "spec_kind",
    "toolkit_device_id",
    "write_cdi_spec",
]

CDI_VENDOR = "k8s.fractional.dev"
CDI_CLASSES = ("gpu", "nic")
NVIDIA_TOOLKIT_KIND = "nvidia.com/gpu"  # the NVIDIA container toolkit's own CDI devices
STANDARD_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")  # where runtimes look for CDI specs by default
_SPEC_SUFFIXES = (".json", ".yaml", ".yml")
MAX_NAME_PART_LENGTH = 128  # a UUID is 36; file names stay far below NAME_MAX (255)
SHARE_PREFIX_LENGTH = 8

# A CDI device name starts and ends with an alphanumeric and has alphanumerics and "_-.:" between
# (the CDI specification; containerd's parser refuses anything else). File names must not contain
# ":" on every filesystem we care about, so the stricter set is used for both.
_NAME_PART = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?")
_NOT_ALNUM_END = "_.-"

BASE_CDI_VERSION = "0.3.0"
MAX_FOREIGN_SPEC_BYTES = 64 * 1024 * 1024  # the NVIDIA toolkit's spec of a big node is a few MiB

log = logging.getLogger(__name__)


def check_name_part(value: str, *, claim: str, field: str) -> str:
    """``value`` unchanged if it is safe inside a file or CDI device name, else ``ClaimError``."""
    if not value:
        problem = "is empty"
    elif len(value) > MAX_NAME_PART_LENGTH:
        problem = f"is {len(value)} characters long, more than {MAX_NAME_PART_LENGTH}"
    elif "/" in value or ".." in value:
        problem = f"{value!r} contains '/' or '..'"
    elif not _NAME_PART.fullmatch(value):
        problem = (
            f"{value!r} has characters outside [A-Za-z0-9_.-] or does not start and end with one of "
            "[A-Za-z0-9]"
        )
    else:
        return value
    raise ClaimError(claim=claim, field=field, problem=problem)


def spec_kind(cdi_class: str) -> str:
    return f"{CDI_VENDOR}/{cdi_class}"


def device_name(claim_uid: str, device: str, share_id: str | None) -> str:
    """``<claimUID>-<device>[-<shareID prefix>]`` (callers have checked the parts). The prefix ends
    with an alphanumeric as a CDI name must: a separator it was cut after is dropped."""
    name = f"{claim_uid}-{device}"
    if share_id:
        name += "-" + share_id[:SHARE_PREFIX_LENGTH].rstrip(_NOT_ALNUM_END)
    return name


def qualified_device_id(cdi_class: str, name: str) -> str:
    """The fully-qualified id the kubelet hands to the runtime: ``vendor/class=name``."""
    return f"{spec_kind(cdi_class)}={name}"


def toolkit_device_id(gpu_uuid: str) -> str:
    return f"{NVIDIA_TOOLKIT_KIND}={gpu_uuid}"


def claim_spec_path(cdi_root: str | Path, cdi_class: str, claim_uid: str) -> Path:
    """``<cdi-root>/k8s.fractional.dev-<class>_<claimUID>.json`` (transient spec name)."""
    if cdi_class not in CDI_CLASSES:
        raise ValueError(f"CDI class {cdi_class!r} is not one of {CDI_CLASSES}")
    check_name_part(claim_uid, claim=claim_uid, field="metadata.uid")
    return Path(cdi_root) / f"{CDI_VENDOR}-{cdi_class}_{claim_uid}.json"


def render_container_edits(edits: ContainerEdits) -> dict[str, Any]:
    """CDI ``containerEdits`` (camelCase keys, empty lists left out)."""
    rendered: dict[str, Any] = {}
    if edits.env:
        rendered["env"] = list(edits.env)
    if edits.device_nodes:
        nodes = []
        for node in edits.device_nodes:
            item: dict[str, Any] = {"path": node.path}
            if node.host_path:
                item["hostPath"] = node.host_path
            if node.permissions:
                item["permissions"] = node.permissions
            nodes.append(item)
        rendered["deviceNodes"] = nodes
    if edits.mounts:
        mounts = []
        for mount in edits.mounts:
            item = {"hostPath": mount.host_path, "containerPath": mount.container_path}
            if mount.options:
                item["options"] = list(mount.options)
            if mount.type:
                item["type"] = mount.type
            mounts.append(item)
        rendered["mounts"] = mounts
    return rendered


def parse_container_edits(raw: Mapping[str, Any]) -> ContainerEdits:
    """Inverse of ``render_container_edits`` (checkpoint round trip)."""
    return ContainerEdits(
        env=tuple(str(value) for value in raw.get("env", ())),
        device_nodes=tuple(
            DeviceNode(path=item["path"], host_path=item.get("hostPath"), permissions=item.get("permissions"))
            for item in raw.get("deviceNodes", ())
        ),
        mounts=tuple(
            Mount(
                host_path=item["hostPath"],
                container_path=item["containerPath"],
                options=tuple(item.get("options", ())),
                type=item.get("type"),
            )
            for item in raw.get("mounts", ())
        ),
    )


def minimum_cdi_version(spec: Mapping[str, Any]) -> str:
    """The lowest ``cdiVersion`` whose rules admit ``spec`` (CDI specs-go ``MinimumRequiredVersion``).

    Writing the minimum keeps older runtimes (which reject versions they do not know) working.
    """
    kind = str(spec.get("kind", ""))
    cdi_class = kind.split("/", 1)[1] if "/" in kind else ""
    devices = list(spec.get("devices", ()))
    all_edits = [spec.get("containerEdits") or {}] + [
        device.get("containerEdits") or {} for device in devices
    ]
    if spec.get("annotations") or "." in cdi_class or any(device.get("annotations") for device in devices):
        return "0.6.0"
    if any(str(device.get("name", ""))[:1].isdigit() for device in devices) or any(
        node.get("hostPath") for edits in all_edits for node in edits.get("deviceNodes", ())
    ):
        return "0.5.0"
    if any(mount.get("type") for edits in all_edits for mount in edits.get("mounts", ())):
        return "0.4.0"
    return BASE_CDI_VERSION


def render_claim_spec(cdi_class: str, devices: Iterable[tuple[str, ContainerEdits]]) -> dict[str, Any]:
    """One claim's spec for one class from ``(device name, edits)`` pairs; duplicates collapse."""
    rendered: dict[str, dict[str, Any]] = {}
    for name, edits in devices:
        rendered.setdefault(name, {"name": name, "containerEdits": render_container_edits(edits)})
    if not rendered:
        raise ValueError("a CDI spec needs at least one device")
    spec: dict[str, Any] = {"cdiVersion": BASE_CDI_VERSION, "kind": spec_kind(cdi_class)}
    spec["devices"] = list(rendered.values())
    spec["cdiVersion"] = minimum_cdi_version(spec)
    return spec


CDI_ROOT_MODE = 0o755  # runtimes (often another user) read the specs; only we write them


def ensure_cdi_root(cdi_root: str | Path) -> None:
    """Create the CDI root (and missing parents) with mode 0755 whatever the umask: ``mkdir``
    applies the umask (0777 under umask 000), so each directory created here is chmod-ed.
    An existing directory is left as it is (the operator's choice)."""
    root = Path(cdi_root)
    missing = []
    for directory in (root, *root.parents):
        if directory.exists():
            break
        missing.append(directory)
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=CDI_ROOT_MODE)
        except FileExistsError:
            continue  # created meanwhile by someone else: theirs
        os.chmod(directory, CDI_ROOT_MODE)


def write_cdi_spec(cdi_root: str | Path, cdi_class: str, claim_uid: str, spec: Mapping[str, Any]) -> Path:
    path = claim_spec_path(cdi_root, cdi_class, claim_uid)
    ensure_cdi_root(path.parent)
    write_atomically(path, json.dumps(spec, indent=2, sort_keys=True).encode() + b"\n")
    return path


def spec_in_place(path: Path) -> bool:
    """True when our spec file is at ``path``: a regular file, checked without following a link.
    A symlink (say, to another claim's spec), FIFO or other entry there is not ours: logged, False
    (writing the spec replaces the entry itself; a directory makes that write fail)."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISREG(mode):
        return True
    log.warning(
        "planted entry in place of a CDI spec", extra={"path": str(path), "entry": describe_entry(mode)}
    )
    return False


def ensure_cdi_spec(cdi_root: str | Path, cdi_class: str, claim_uid: str, spec: Mapping[str, Any]) -> bool:
    """Write the claim's spec unless our regular file is already there (``spec_in_place``); True
    when written. Whatever else was there is replaced, never followed or read."""
    if spec_in_place(claim_spec_path(cdi_root, cdi_class, claim_uid)):
        return False
    write_cdi_spec(cdi_root, cdi_class, claim_uid, spec)
    return True


def remove_claim_specs(cdi_root: str | Path, claim_uid: str) -> list[Path]:
    """Delete every spec file of the claim (all classes); missing files are fine. A symlink in
    place of a spec is unlinked (never its target); a directory there is logged and left."""
    removed = []
    for cdi_class in CDI_CLASSES:
        path = claim_spec_path(cdi_root, cdi_class, claim_uid)
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except IsADirectoryError:
            log.warning("directory in place of a CDI spec left alone", extra={"path": str(path)})
            continue
        removed.append(path)
    return removed


def read_claim_spec(path: Path, *, max_bytes: int) -> bytes:
    """The bytes of one of our spec files: a regular file only, never through a symlink, never
    blocking on a FIFO (``UnsafeEntryError``, an ``OSError``, otherwise)."""
    return read_regular_file(path, max_bytes=max_bytes)


def remove_planted_specs(cdi_root: str | Path) -> list[Path]:
    """Start-up hygiene: entries named like our specs (``k8s.fractional.dev-*_*.json``) that are
    not regular files (a symlink to a foreign spec, a FIFO: planted, never ours) are unlinked,
    never followed, so that ours are written again in their place; a directory so named is left.
    Each one is logged. Returns the removed paths."""
    try:
        paths = sorted(Path(cdi_root).glob(f"{CDI_VENDOR}-*_*.json"))
    except OSError:
        return []
    removed = []
    for path in paths:
        try:
            mode = path.lstat().st_mode
            if stat.S_ISREG(mode):
                continue
            if not stat.S_ISDIR(mode):
                path.unlink()
                removed.append(path)
        except FileNotFoundError:
            continue
        log.warning(
            "planted entry named like a CDI spec " + ("left alone" if stat.S_ISDIR(mode) else "removed"),
            extra={"path": str(path), "entry": describe_entry(mode)},
        )
    return removed


def find_spec_for_kind(directories: Iterable[str | Path], kind: str) -> Path | None:
    """The first CDI spec file (``*.json``/``*.yaml``/``*.yml``, directories in order, names sorted)
    whose ``kind`` is ``kind``, e.g. the NVIDIA toolkit's ``nvidia.com/gpu``; None when there is none.

    Missing directories and unreadable or malformed files are skipped (the runtime would skip them
    too), and so are FIFOs and other special files (opened non-blocking, then checked: a FIFO named
    like a spec never hangs start-up). Symlinks are followed (the runtimes follow them too), to
    regular files only. Only reads files.
    """
    import yaml  # JSON is YAML too; only the nvml start-up check calls this

    seen: set[Path] = set()
    for directory in directories:
        try:
            paths = sorted(Path(directory).iterdir())
        except OSError:
            continue
        for path in paths:
            if path.suffix not in _SPEC_SUFFIXES or path in seen:
                continue
            seen.add(path)
            try:
                text = read_regular_file(path, max_bytes=MAX_FOREIGN_SPEC_BYTES, follow_symlinks=True)
                spec = yaml.safe_load(text.decode())
            except UnsafeEntryError as error:
                log.info(
                    "CDI spec directory entry skipped", extra={"path": str(path), "reason": error.problem}
                )
                continue
            except (OSError, UnicodeDecodeError, yaml.YAMLError):
                continue
            if isinstance(spec, Mapping) and spec.get("kind") == kind:
                return path
    return None

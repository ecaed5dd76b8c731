#!/usr/bin/env python3
"""What hack/kind-up.sh decides about the machine it runs on, as pure functions (unit-tested in
tests/hack/test_kind_settings.py) and a small CLI that gathers the facts and prints the result.

    python hack/kind_settings.py env      # shell lines: KIND_PROVIDER=..., KIND_LOAD=..., ...
    python hack/kind_settings.py config   # the kind Cluster config (YAML) for this machine

Decisions:
- provider: ``KIND_PROVIDER`` (or kind's own ``KIND_EXPERIMENTAL_PROVIDER``) when set; otherwise
  docker when its daemon answers, else podman when installed.
- loading our image: ``kind load docker-image`` with docker; with podman, that command would still
  call docker, so the image is saved to an archive and loaded with ``kind load image-archive``.
- node image: ``KIND_NODE_IMAGE`` when set; with docker, the kindest/node image that the pinned kind
  release was published with; with podman, ours (hack/kind-node-image.sh), as no registry is
  assumed reachable from a podman machine.
- the Kubernetes release (for the feature gates): ``K8S_VERSION`` when set, else the node image's tag.
- cgroup v1 (the engine's, ``docker info`` / ``podman info``): from 1.35 the kubelet refuses it
  unless its configuration says ``failCgroupV1: false`` (KEP-5573).
- containerd's ``restrict_oom_score_adj``: when the node cannot raise an OOM score adjustment, that is
  when the engine is rootless or the host's capability bounding set lacks CAP_SYS_RESOURCE (a
  container never gets more than that set).
- feature gates and runtime config per release: those of the local cluster (hack/localcluster),
  so that both clusters serve the same APIs.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HACK = Path(__file__).resolve().parent
if str(HACK) not in sys.path:
    sys.path.insert(0, str(HACK))

import yaml  # noqa: E402  (the venv's; kind-up runs with it)
from localcluster.cluster import RELEASES  # noqa: E402

__all__ = [
    "KIND_VERSION",
    "LoadMethod",
    "Provider",
    "Settings",
    "SettingsError",
    "cap_sys_resource_in",
    "choose_node_image",
    "choose_provider",
    "decide",
    "feature_gates",
    "load_method",
    "parse_cgroup_version",
    "release_of",
    "render_kind_config",
    "restrict_oom_score_adj",
    "runtime_config",
]

KIND_VERSION = "v0.33.0"
# The node image kind v0.33.0 was released with (sigs.k8s.io/kind pkg/apis/config/defaults/image.go).
STOCK_NODE_IMAGE = (
    "kindest/node:v1.37.0@sha256:a1ed56cfb0e7b93589bdf97c8cd566405a265939e3620fc4f5de89adff580ae5"
)
# hack/kind-node-image.sh's default name for K8S_VERSION.
OUR_NODE_IMAGE = "localhost/fractional-kind-node:v{version}"
DEFAULT_K8S_VERSION = "1.37.2"
CAP_SYS_RESOURCE = 24  # linux/capability.h
BASE_CONFIG = HACK / "kind-config.yaml"


class SettingsError(Exception):
    """A setting cannot be decided; the message names the variable and what was found."""


class Provider(enum.StrEnum):
    DOCKER = "docker"
    PODMAN = "podman"


class LoadMethod(enum.StrEnum):
    DOCKER_IMAGE = "docker-image"  # kind load docker-image NAME (reads docker's store)
    IMAGE_ARCHIVE = "image-archive"  # <engine> save -o TAR NAME; kind load image-archive TAR


def choose_provider(requested: str, *, docker_works: bool, podman_installed: bool) -> Provider:
    """The engine kind runs the nodes in: the one asked for, else docker when it answers, else podman."""
    if requested:
        try:
            return Provider(requested.strip().lower())
        except ValueError:
            raise SettingsError(f"KIND_PROVIDER={requested!r}: expected docker or podman") from None
    if docker_works:
        return Provider.DOCKER
    if podman_installed:
        return Provider.PODMAN
    raise SettingsError("no container engine: docker's daemon does not answer and podman is not installed")


def load_method(provider: Provider) -> LoadMethod:
    """`kind load docker-image` always calls docker, whatever the provider: podman needs an archive."""
    return LoadMethod.DOCKER_IMAGE if provider is Provider.DOCKER else LoadMethod.IMAGE_ARCHIVE


def choose_node_image(requested: str, *, provider: Provider, k8s_version: str) -> str:
    if requested:
        return requested
    if provider is Provider.DOCKER:
        return STOCK_NODE_IMAGE
    return OUR_NODE_IMAGE.format(version=k8s_version.removeprefix("v"))


def release_of(version_or_image: str) -> str:
    """'1.37' from '1.37.2', 'v1.36.3' or an image reference tagged v1.35.0 (with or without digest)."""
    text = version_or_image.split("@", 1)[0]
    if "/" in text or ":" in text:
        text = text.rsplit(":", 1)[-1] if ":" in text.rsplit("/", 1)[-1] else ""
    parts = text.removeprefix("v").split(".")
    if len(parts) < 2 or parts[0] != "1" or not parts[1].isdigit():
        raise SettingsError(
            f"cannot tell the Kubernetes release from {version_or_image!r}: set K8S_VERSION (e.g. 1.37.2)"
        )
    return f"1.{int(parts[1])}"


def feature_gates(release: str) -> dict[str, bool]:
    try:
        return dict(RELEASES[release][0])
    except KeyError:
        raise SettingsError(
            f"Kubernetes {release}: no feature gates known (known: {', '.join(RELEASES)})"
        ) from None


def runtime_config(release: str) -> dict[str, str]:
    try:
        entries = RELEASES[release][1]
    except KeyError:
        raise SettingsError(
            f"Kubernetes {release}: no runtime config known (known: {', '.join(RELEASES)})"
        ) from None
    return dict(entry.split("=", 1) for entry in entries)


def parse_cgroup_version(text: str) -> int:
    """1 or 2, as docker ({{.CgroupVersion}}: "1") or podman ({{.Host.CgroupsVersion}}: "v1") say it."""
    value = text.strip().lower().removeprefix("v")
    if value not in ("1", "2"):
        raise SettingsError(f"cgroup version {text.strip()!r}: expected 1, 2, v1 or v2")
    return int(value)


def cap_sys_resource_in(proc_status: str) -> bool:
    """Whether the CapBnd line of /proc/self/status includes CAP_SYS_RESOURCE."""
    for line in proc_status.splitlines():
        if line.startswith("CapBnd:"):
            return bool(int(line.split(":", 1)[1].strip(), 16) >> CAP_SYS_RESOURCE & 1)
    raise SettingsError("no CapBnd line in /proc/self/status")


def restrict_oom_score_adj(*, rootless: bool, cap_sys_resource: bool) -> bool:
    return rootless or not cap_sys_resource


@dataclass(frozen=True, slots=True)
class Settings:
    provider: Provider
    load: LoadMethod
    node_image: str
    release: str
    cgroup_version: int
    restrict_oom_score_adj: bool
    cluster_name: str

    def shell_lines(self) -> list[str]:
        values = {
            "KIND_PROVIDER": self.provider.value,
            "KIND_LOAD": self.load.value,
            "KIND_NODE_IMAGE": self.node_image,
            "KIND_K8S_RELEASE": self.release,
            "KIND_CGROUP_VERSION": str(self.cgroup_version),
            "KIND_RESTRICT_OOM_SCORE_ADJ": str(self.restrict_oom_score_adj).lower(),
            "KIND_VERSION": KIND_VERSION,
        }
        return [f"{k}={shlex.quote(v)}" for k, v in values.items()] + ["export " + " ".join(values)]


def decide(
    env: Mapping[str, str],
    *,
    docker_works: bool,
    podman_installed: bool,
    cgroup_version_text: str,
    rootless: bool,
    proc_status: str,
) -> Settings:
    provider = choose_provider(
        env.get("KIND_PROVIDER") or env.get("KIND_EXPERIMENTAL_PROVIDER", ""),
        docker_works=docker_works,
        podman_installed=podman_installed,
    )
    k8s_version = env.get("K8S_VERSION", "")
    image = choose_node_image(
        env.get("KIND_NODE_IMAGE", ""), provider=provider, k8s_version=k8s_version or DEFAULT_K8S_VERSION
    )
    release = release_of(k8s_version or image)
    feature_gates(release)  # known, or say so now
    return Settings(
        provider=provider,
        load=load_method(provider),
        node_image=image,
        release=release,
        cgroup_version=parse_cgroup_version(cgroup_version_text),
        restrict_oom_score_adj=restrict_oom_score_adj(
            rootless=rootless, cap_sys_resource=cap_sys_resource_in(proc_status)
        ),
        cluster_name=env.get("KIND_CLUSTER_NAME", "") or "fractional-dra",
    )


def render_kind_config(settings: Settings, base: Mapping[str, Any]) -> str:
    """The kind Cluster config: base (hack/kind-config.yaml: nodes, CDI) plus what this machine needs."""
    config = dict(base)
    config["name"] = settings.cluster_name
    config["featureGates"] = {**feature_gates(settings.release), **dict(base.get("featureGates") or {})}
    runtime = runtime_config(settings.release)
    if runtime:
        config["runtimeConfig"] = {**runtime, **dict(base.get("runtimeConfig") or {})}
    patches = list(base.get("containerdConfigPatches") or [])
    if settings.restrict_oom_score_adj:
        # The node cannot raise oom_score_adj (no CAP_SYS_RESOURCE): containerd must not try.
        patches.append('[plugins."io.containerd.grpc.v1.cri"]\n  restrict_oom_score_adj = true\n')
    if patches:
        config["containerdConfigPatches"] = patches
    kubeadm_patches = list(base.get("kubeadmConfigPatches") or [])
    if settings.cgroup_version == 1:
        # From 1.35 the kubelet refuses a cgroup v1 host unless told otherwise (KEP-5573).
        kubeadm_patches.append("kind: KubeletConfiguration\nfailCgroupV1: false\n")
    if kubeadm_patches:
        config["kubeadmConfigPatches"] = kubeadm_patches
    header = (
        f"# Generated by hack/kind_settings.py for {settings.provider.value}, Kubernetes {settings.release},"
        f" cgroup v{settings.cgroup_version}.\n"
    )
    return header + yaml.dump(config, Dumper=_BlockDumper, sort_keys=False, default_flow_style=False)


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the TOML and YAML patches) as literal blocks, as one writes them by hand."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _represent_str)


# -- facts of this machine (the CLI) ------------------------------------------------------------------


def _output(argv: Sequence[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        return None
    return done.stdout if done.returncode == 0 else None


def gather(env: Mapping[str, str]) -> Settings:
    requested = env.get("KIND_PROVIDER") or env.get("KIND_EXPERIMENTAL_PROVIDER", "")
    docker_works = (
        False
        if requested == "podman"
        else _output(["docker", "info", "-f", "{{.ServerVersion}}"]) is not None
    )
    podman_installed = shutil.which("podman") is not None
    provider = choose_provider(requested, docker_works=docker_works, podman_installed=podman_installed)
    if provider is Provider.DOCKER:
        info = _output(["docker", "info", "-f", "{{json .}}"]) or "{}"
        facts = json.loads(info)
        cgroup = str(facts.get("CgroupVersion") or "")
        rootless = any("rootless" in option for option in facts.get("SecurityOptions") or [])
    else:
        info = _output(["podman", "info", "-f", "json"]) or "{}"
        host = json.loads(info).get("host") or {}
        cgroup = str(host.get("cgroupVersion") or "")
        rootless = bool((host.get("security") or {}).get("rootless"))
    if not cgroup:
        raise SettingsError(f"{provider.value} info did not say the cgroup version (is the engine working?)")
    return decide(
        env,
        docker_works=docker_works,
        podman_installed=podman_installed,
        cgroup_version_text=cgroup,
        rootless=rootless,
        proc_status=Path("/proc/self/status").read_text(encoding="utf-8"),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kind settings for this machine")
    parser.add_argument("what", choices=("env", "config"))
    args = parser.parse_args(argv)
    try:
        settings = gather(os.environ)
    except SettingsError as error:
        print(f"kind-settings: {error}", file=sys.stderr)
        return 2
    if args.what == "env":
        print("\n".join(settings.shell_lines()))
    else:
        base = yaml.safe_load(BASE_CONFIG.read_text(encoding="utf-8")) or {}
        sys.stdout.write(render_kind_config(settings, base))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""hack/kind_settings.py: what hack/kind-up.sh decides about the machine (provider, loading method,
node image, cgroup version, OOM score setting, feature gates per release) and the config it renders."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

HACK = Path(__file__).resolve().parents[2] / "hack"
if str(HACK) not in sys.path:
    sys.path.insert(0, str(HACK))

import kind_settings as ks  # noqa: E402

# CapBnd of a root shell with every capability, and of this project's VM (no CAP_SYS_RESOURCE, bit 24).
FULL_CAPS = "Name:\tbash\nCapInh:\t0000000000000000\nCapBnd:\t000001ffffffffff\n"
NO_SYS_RESOURCE = "Name:\tbash\nCapBnd:\t000001fffeffffff\n"


@pytest.mark.parametrize(
    ("requested", "docker_works", "podman_installed", "expected"),
    [
        ("", True, True, ks.Provider.DOCKER),  # docker first, as users have it
        ("", True, False, ks.Provider.DOCKER),
        ("", False, True, ks.Provider.PODMAN),  # this machine: no docker engine
        ("podman", True, True, ks.Provider.PODMAN),  # asked for wins
        ("Docker", False, True, ks.Provider.DOCKER),  # asked for, even when it does not answer
    ],
)
def test_the_provider_is_the_one_asked_for_else_docker_else_podman(
    requested: str, docker_works: bool, podman_installed: bool, expected: ks.Provider
) -> None:
    assert (
        ks.choose_provider(requested, docker_works=docker_works, podman_installed=podman_installed)
        is expected
    )


def test_no_engine_or_an_unknown_one_is_an_error_that_says_so() -> None:
    with pytest.raises(ks.SettingsError, match="no container engine"):
        ks.choose_provider("", docker_works=False, podman_installed=False)
    with pytest.raises(ks.SettingsError, match="KIND_PROVIDER='nerdctl'"):
        ks.choose_provider("nerdctl", docker_works=True, podman_installed=True)


def test_podman_loads_an_archive_because_kind_load_docker_image_always_calls_docker() -> None:
    assert ks.load_method(ks.Provider.DOCKER) is ks.LoadMethod.DOCKER_IMAGE
    assert ks.load_method(ks.Provider.PODMAN) is ks.LoadMethod.IMAGE_ARCHIVE


@pytest.mark.parametrize(
    ("requested", "provider", "expected"),
    [
        ("", ks.Provider.DOCKER, ks.STOCK_NODE_IMAGE),
        ("", ks.Provider.PODMAN, "localhost/fractional-kind-node:v1.37.2"),
        ("kindest/node:v1.36.1", ks.Provider.PODMAN, "kindest/node:v1.36.1"),
    ],
)
def test_the_node_image_is_the_stock_one_for_docker_and_ours_for_podman(
    requested: str, provider: ks.Provider, expected: str
) -> None:
    assert ks.choose_node_image(requested, provider=provider, k8s_version="1.37.2") == expected


def test_the_stock_image_is_the_one_the_pinned_kind_was_released_with() -> None:
    assert ks.KIND_VERSION == "v0.33.0"
    assert ks.release_of(ks.STOCK_NODE_IMAGE) == "1.37"


@pytest.mark.parametrize(
    ("text", "release"),
    [
        ("1.37.2", "1.37"),
        ("v1.36.3", "1.36"),
        ("kindest/node:v1.35.0", "1.35"),
        ("localhost/fractional-kind-node:v1.37.2", "1.37"),
        ("registry.local:5000/kindest/node:v1.36.1@sha256:" + "0" * 64, "1.36"),
    ],
)
def test_the_release_comes_from_a_version_or_an_image_tag(text: str, release: str) -> None:
    assert ks.release_of(text) == release


@pytest.mark.parametrize("text", ["kindest/node", "registry.local:5000/node", "latest", "2.0.0"])
def test_a_release_that_cannot_be_told_asks_for_k8s_version(text: str) -> None:
    with pytest.raises(ks.SettingsError, match="K8S_VERSION"):
        ks.release_of(text)


@pytest.mark.parametrize(
    ("release", "gates", "runtime"),
    [
        # 1.37: GenericWorkload is beta but off; its API needs the runtime config.
        ("1.37", {"GenericWorkload": True}, {"scheduling.k8s.io/v1beta1": "true"}),
        ("1.36", {"GenericWorkload": True, "GangScheduling": True, "DRADeviceTaintRules": True},
         {"scheduling.k8s.io/v1alpha2": "true", "resource.k8s.io/v1beta2": "true"}),
        # 1.35: consumable capacity (the GPU shares) and device taints are alpha.
        ("1.35", {"DRAConsumableCapacity": True, "DRADeviceTaints": True, "DRADeviceTaintRules": True,
                  "GenericWorkload": True, "GangScheduling": True},
         {"scheduling.k8s.io/v1alpha1": "true", "resource.k8s.io/v1alpha3": "true"}),
    ],
)  # fmt: skip
def test_feature_gates_and_runtime_config_per_release(
    release: str, gates: dict[str, bool], runtime: dict[str, str]
) -> None:
    assert ks.feature_gates(release) == gates
    assert ks.runtime_config(release) == runtime


def test_an_unknown_release_is_an_error() -> None:
    with pytest.raises(ks.SettingsError, match=r"1\.34"):
        ks.feature_gates("1.34")


@pytest.mark.parametrize(("text", "version"), [("1", 1), ("2\n", 2), ("v1", 1), ("v2", 2)])
def test_the_cgroup_version_as_docker_and_podman_say_it(text: str, version: int) -> None:
    assert ks.parse_cgroup_version(text) == version


def test_an_unreadable_cgroup_version_is_an_error() -> None:
    with pytest.raises(ks.SettingsError, match="cgroup version"):
        ks.parse_cgroup_version("")


def test_cap_sys_resource_is_read_from_the_bounding_set() -> None:
    assert ks.cap_sys_resource_in(FULL_CAPS) is True
    assert ks.cap_sys_resource_in(NO_SYS_RESOURCE) is False
    with pytest.raises(ks.SettingsError):
        ks.cap_sys_resource_in("Name:\tbash\n")


@pytest.mark.parametrize(
    ("rootless", "cap", "restrict"), [(False, True, False), (True, True, True), (False, False, True)]
)
def test_oom_score_adj_is_restricted_when_rootless_or_without_cap_sys_resource(
    rootless: bool, cap: bool, restrict: bool
) -> None:
    assert ks.restrict_oom_score_adj(rootless=rootless, cap_sys_resource=cap) is restrict


def _decide(env: dict[str, str], **facts: object) -> ks.Settings:
    defaults: dict[str, object] = {
        "docker_works": False,
        "podman_installed": True,
        "cgroup_version_text": "v1",
        "rootless": False,
        "proc_status": NO_SYS_RESOURCE,
    }
    defaults.update(facts)
    return ks.decide(env, **defaults)  # type: ignore[arg-type]


def test_this_machine_podman_cgroup_v1_without_cap_sys_resource() -> None:
    settings = _decide({})
    assert settings.provider is ks.Provider.PODMAN
    assert settings.load is ks.LoadMethod.IMAGE_ARCHIVE
    assert settings.node_image == "localhost/fractional-kind-node:v1.37.2"
    assert (settings.release, settings.cgroup_version, settings.restrict_oom_score_adj) == ("1.37", 1, True)
    lines = settings.shell_lines()
    assert "KIND_LOAD=image-archive" in lines and lines[-1].startswith("export KIND_PROVIDER ")


def test_a_docker_user_gets_kinds_defaults_and_nothing_extra() -> None:
    settings = _decide({}, docker_works=True, cgroup_version_text="2", proc_status=FULL_CAPS)
    assert (settings.provider, settings.node_image) == (ks.Provider.DOCKER, ks.STOCK_NODE_IMAGE)
    assert (settings.cgroup_version, settings.restrict_oom_score_adj) == (2, False)
    config = yaml.safe_load(
        ks.render_kind_config(settings, {"kind": "Cluster", "nodes": [{"role": "control-plane"}]})
    )
    assert "kubeadmConfigPatches" not in config and "containerdConfigPatches" not in config
    assert config["featureGates"] == {"GenericWorkload": True}
    assert config["name"] == "fractional-dra"


def test_kinds_own_provider_variable_and_k8s_version_are_honoured() -> None:
    settings = _decide(
        {
            "KIND_EXPERIMENTAL_PROVIDER": "podman",
            "KIND_NODE_IMAGE": "kindest/node:v1.36.1",
            "K8S_VERSION": "1.35.4",
        },
        docker_works=True,
    )
    assert settings.provider is ks.Provider.PODMAN
    assert settings.release == "1.35"  # K8S_VERSION wins over the tag


def test_the_rendered_config_keeps_the_base_and_adds_what_the_machine_needs() -> None:
    base = yaml.safe_load((HACK / "kind-config.yaml").read_text(encoding="utf-8"))
    config = yaml.safe_load(ks.render_kind_config(_decide({"KIND_CLUSTER_NAME": "other"}), base))
    assert config["name"] == "other"
    assert [n["role"] for n in config["nodes"]] == ["control-plane", "worker", "worker"]
    assert config["runtimeConfig"] == {"scheduling.k8s.io/v1beta1": "true"}
    patches = config["containerdConfigPatches"]
    assert any("enable_cdi = true" in p for p in patches)
    assert any("restrict_oom_score_adj = true" in p for p in patches)
    (kubelet,) = [yaml.safe_load(p) for p in config["kubeadmConfigPatches"]]
    assert kubelet == {"kind": "KubeletConfiguration", "failCgroupV1": False}

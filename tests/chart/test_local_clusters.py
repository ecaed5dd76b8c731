"""Local clusters without kube-proxy or a pod network (docs/install.md): fakeDevices.profileNodeLabel,
agent.hostNetwork / controller.hostNetwork and apiServer.host / apiServer.port."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from chart_support import (
    CHART_DIR,
    KUBE_VERSIONS,
    NAMESPACE,
    object_id,
    render_chart,
    rendered_for,
    validate_strict,
)
from test_chart_render import agent_pod, container, env_of, one, parse_cli_env

from driver.cli import build_controller_config, build_plugin_config
from driver.config import PluginConfig

LABEL = "fractional.dev/fake-profile"
PROFILES_DIR = "/etc/fractional-dra/profiles"
SERVICE_VARIABLES = ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")

# Everything on: what a cluster of upstream binaries on one machine installs.
LOCAL: dict[str, Any] = {
    "fakeDevices": {"enabled": True, "profileNodeLabel": LABEL},
    "agent": {"hostNetwork": True},
    "controller": {"hostNetwork": True},
    "apiServer": {"host": "192.168.1.10", "port": 6443},
}


def fake(**sections: dict[str, Any]) -> dict[str, Any]:
    return {"fakeDevices": {"enabled": True}, **sections}


def controller_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "Deployment", "-controller")["spec"]["template"]["spec"]


def pods(objects: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """component -> (pod spec, its container)."""
    agent, controller = agent_pod(objects), controller_pod(objects)
    return {
        "agent": (agent, container(agent, "agent")),
        "controller": (controller, container(controller, "controller")),
    }


@pytest.fixture(scope="module")
def local() -> list[dict[str, Any]]:
    return render_chart(LOCAL)


@pytest.fixture(scope="module")
def defaults() -> list[dict[str, Any]]:
    return render_chart(fake())


# -- all three together: lint, strict schemas, the CLI ----------------------------------------------


def test_lint_is_clean() -> None:
    report = helm.lint(str(CHART_DIR), LOCAL, strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_object_validates_strictly(local: list[dict[str, Any]], version: str) -> None:
    for obj in (o for o in local if rendered_for(o, version)):
        try:
            validate_strict(obj, version)
        except Exception as error:
            raise AssertionError(f"{object_id(obj)} ({version}): {error}") from error


def test_the_environment_is_understood_by_the_cli(
    local: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    downward = {
        "spec.nodeName": "node-a",
        "metadata.uid": "0d7f9b8e-uid",
        "metadata.namespace": NAMESPACE,
        "metadata.name": "fractional-dra-controller-abc",
        "status.hostIP": "192.168.1.21",
        "status.podIP": "192.168.1.21",  # hostNetwork: the pod's IP is the node's
    }

    def parse(command: str, env: dict[str, Any]) -> argparse.Namespace:
        return parse_cli_env(monkeypatch, command, env, downward)

    components = pods(local)
    plugin = build_plugin_config(parse("plugin", env_of(components["agent"][1])))
    assert plugin.profile_node_label == LABEL and plugin.profile == f"{PROFILES_DIR}/h100-8x.yaml"
    assert plugin.metrics_host == "192.168.1.21"
    controller = build_controller_config(parse("controller", env_of(components["controller"][1])))
    assert controller.metrics_host == "192.168.1.21"


# -- fakeDevices.profileNodeLabel -------------------------------------------------------------------


def test_profile_node_label_is_the_agents_flag(
    local: list[dict[str, Any]], defaults: list[dict[str, Any]]
) -> None:
    env = env_of(container(agent_pod(local), "agent"))
    assert env["FRACTIONAL_PROFILE_NODE_LABEL"] == LABEL
    # The label's value names a file of the profiles ConfigMap, mounted beside --profile.
    assert env["FRACTIONAL_PROFILE"].rsplit("/", 1)[0] == PROFILES_DIR
    assert "FRACTIONAL_PROFILE_NODE_LABEL" not in env_of(container(agent_pod(defaults), "agent"))
    assert "FRACTIONAL_PROFILE_NODE_LABEL" not in env_of(container(agent_pod(render_chart(None)), "agent"))


def test_profile_node_label_needs_fake_devices() -> None:
    with pytest.raises(
        helm.HelmRenderError, match=r"fakeDevices\.profileNodeLabel needs fakeDevices\.enabled"
    ):
        render_chart({"fakeDevices": {"profileNodeLabel": LABEL}})


def test_notes_name_the_label() -> None:
    from chart_support import render_notes

    assert f"or the one named by node label {LABEL}" in render_notes(LOCAL)
    assert "node label" not in render_notes(fake())


# -- hostNetwork ------------------------------------------------------------------------------------


def test_host_network_is_off_by_default(defaults: list[dict[str, Any]]) -> None:
    for component, (pod, spec) in pods(defaults).items():
        assert "hostNetwork" not in pod and "dnsPolicy" not in pod, component
        assert "FRACTIONAL_METRICS_HOST" not in env_of(spec), component
    assert "strategy" not in one(defaults, "Deployment", "-controller")["spec"]
    rolling = one(defaults, "DaemonSet", "-agent")["spec"]["updateStrategy"]["rollingUpdate"]
    assert rolling == {"maxSurge": 1, "maxUnavailable": 0}


@pytest.mark.parametrize("component", ["agent", "controller"])
def test_host_network_serves_on_the_node_ip(component: str) -> None:
    objects = render_chart(fake(**{component: {"hostNetwork": True}}))
    for name, (pod, spec) in pods(objects).items():
        env = env_of(spec)
        if name != component:  # each component has its own value
            assert "hostNetwork" not in pod and "FRACTIONAL_METRICS_HOST" not in env
            continue
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        # The node's IP, not 0.0.0.0: nodes that share one host's network each keep their port.
        assert env["FRACTIONAL_METRICS_HOST"] == ("fieldRef", "status.hostIP")
        # Probes still reach it: the kubelet probes the pod IP, which is the node's.
        port = spec["ports"][0]
        assert spec["livenessProbe"]["httpGet"]["port"] == port["name"] == "metrics"
        # The controller's allocation guard listens on the same address (--metrics-host), and the
        # leader publishes its pod IP, the node's, in the guard's EndpointSlice.
        assert [p["name"] for p in spec["ports"][1:]] == (["guard"] if name == "controller" else [])


def test_host_network_updates_replace_pods_one_by_one(local: list[dict[str, Any]]) -> None:
    """The port is taken on the node: a surge pod could not be scheduled next to the old one."""
    daemonset = one(local, "DaemonSet", "-agent")["spec"]["updateStrategy"]
    assert daemonset == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    deployment = one(local, "Deployment", "-controller")["spec"]["strategy"]
    assert deployment == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


# -- apiServer --------------------------------------------------------------------------------------


def service_env(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        component: {k: v for k, v in env_of(spec).items() if k in SERVICE_VARIABLES}
        for component, (_, spec) in pods(objects).items()
    }


def test_no_api_server_by_default(defaults: list[dict[str, Any]]) -> None:
    assert service_env(defaults) == {"agent": {}, "controller": {}}
    assert service_env(render_chart(None)) == {"agent": {}, "controller": {}}


@pytest.mark.parametrize(
    ("api_server", "port"),
    [
        ({"host": "192.168.1.10", "port": 6443}, "6443"),
        ({"host": "192.168.1.10", "port": "6443"}, "6443"),
        ({"host": "192.168.1.10"}, "443"),
        ({"host": "192.168.1.10", "port": ""}, "443"),
        ({"host": "api.local.example", "port": 8443}, "8443"),
        ({"host": "fd00::10", "port": 6443}, "6443"),
    ],
)
def test_api_server_reaches_both_components(api_server: dict[str, Any], port: str) -> None:
    expected = {"KUBERNETES_SERVICE_HOST": api_server["host"], "KUBERNETES_SERVICE_PORT": port}
    assert service_env(render_chart(fake(apiServer=api_server))) == {
        "agent": expected,
        "controller": expected,
    }


def test_api_server_port_needs_a_host() -> None:
    with pytest.raises(helm.HelmRenderError, match=r"apiServer\.port needs apiServer\.host"):
        render_chart(fake(apiServer={"port": 6443}))


@pytest.mark.parametrize("component", ["agent", "controller"])
def test_in_cluster_configuration_uses_the_rendered_address(
    local: list[dict[str, Any]], component: str, tmp_path: Path
) -> None:
    """The kubernetes client's in-cluster loader (driver.kube.client) reads exactly these variables;
    the token and CA still come from the service account volume."""
    from kubernetes import client
    from kubernetes.config import incluster_config

    (tmp_path / "token").write_text("token\n")
    (tmp_path / "ca.crt").write_text("ca\n")
    configuration = client.Configuration()
    incluster_config.InClusterConfigLoader(
        token_filename=str(tmp_path / "token"),
        cert_filename=str(tmp_path / "ca.crt"),
        environ=service_env(local)[component],
    ).load_and_set(configuration)
    assert configuration.host == "https://192.168.1.10:6443"
    assert configuration.ssl_ca_cert == str(tmp_path / "ca.crt")


# -- the schema -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"apiServer": {"hots": "10.0.0.1"}}, "additional properties 'hots' not allowed"),
        ({"apiServer": {"host": "https://10.0.0.1"}}, "apiServer/host"),
        ({"apiServer": {"host": "10.0.0.1:6443"}}, "apiServer/host"),
        ({"apiServer": {"host": "[fd00::10]"}}, "apiServer/host"),
        ({"apiServer": {"host": "10.0.0.1", "port": 0}}, "apiServer/port"),
        ({"apiServer": {"host": "10.0.0.1", "port": 70000}}, "apiServer/port"),
        ({"apiServer": {"host": "10.0.0.1", "port": "https"}}, "apiServer/port"),
        ({"agent": {"hostNetwork": "true"}}, "agent/hostNetwork"),
        ({"agent": {"hostNetwrok": True}}, "additional properties 'hostNetwrok' not allowed"),
        ({"controller": {"hostNetwork": 1}}, "controller/hostNetwork"),
        ({"fakeDevices": {"enabled": True, "profileNodeLabel": "a/b/c"}}, "fakeDevices/profileNodeLabel"),
        ({"fakeDevices": {"enabled": True, "profileNodeLable": LABEL}}, "'profileNodeLable' not allowed"),
    ],
)
def test_a_typo_fails_install_and_lint(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError, match="don't meet the specifications") as raised:
        render_chart(values)
    assert message in str(raised.value)
    report = helm.lint(str(CHART_DIR), values, strict=True, namespace=NAMESPACE)
    assert any(message in error for error in report["errors"]), report


@pytest.mark.parametrize("key", [LABEL, "kubernetes.io/hostname", "profile", "a.b/C_d.e"])
def test_the_schema_takes_the_label_keys_the_agent_takes(key: str) -> None:
    render_chart(fake(fakeDevices={"enabled": True, "profileNodeLabel": key}))
    assert PluginConfig(node_name="n", profile="l4-2x", profile_node_label=key).profile_node_label == key

"""``--profile-node-label``: a fake node's profile named by a label of its own Node.

The agent reads its Node at start (the embedded API here), waits while the Node does not exist
yet, and loads ``<value>.yaml`` beside the ``--profile`` file, else the shipped profile
``<value>``; no label means ``--profile``; a value that names no profile is a configuration error.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from driver.cli import _build_parser, build_plugin_config
from driver.cluster.apiserver import APIServer
from driver.config import PluginConfig
from driver.errors import ConfigError
from driver.inventory.fake import PROFILE_DIR
from driver.plugin import agent as agent_module
from driver.plugin.agent import NodeAgent, choose_fake_profile, read_node_labels
from tests.plugin.conftest import NODE, REPO_ROOT, NodeDirs, wait_for

LABEL = "fractional.dev/fake-profile"
FLAG = "--profile-node-label (FRACTIONAL_PROFILE_NODE_LABEL)"


@pytest.fixture
def profiles(tmp_path: Path) -> Path:
    """A profiles directory as the chart mounts it: base.yaml (2 L4s) is --profile, big.yaml (8 H100s)."""
    directory = tmp_path / "profiles"
    directory.mkdir()
    shutil.copy(PROFILE_DIR / "l4-2x.yaml", directory / "base.yaml")
    shutil.copy(PROFILE_DIR / "h100-8x.yaml", directory / "big.yaml")
    return directory


def create_node(configuration: client.Configuration, labels: dict[str, str] | None = None) -> None:
    metadata: dict[str, Any] = {"name": NODE, "labels": labels or {}}
    with client.ApiClient(configuration) as api_client:
        client.CoreV1Api(api_client).create_node({"metadata": metadata}, _request_timeout=10)


def chosen(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [vars(r) for r in caplog.records if r.getMessage() == "fake profile chosen"]


@pytest.fixture(autouse=True)
def _fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_module, "NODE_RETRY_SECONDS", 0.02)


# -- the choice -----------------------------------------------------------------------------------


def test_without_the_flag_the_profile_is_the_flags(profiles: Path) -> None:
    choice = choose_fake_profile(profile=str(profiles / "base.yaml"), label=None, labels={}, node=NODE)
    assert (choice.path, choice.reason, choice.label_value) == (profiles / "base.yaml", "--profile", None)
    shipped = choose_fake_profile(profile="l4-2x", label=None, labels={LABEL: "big"}, node=NODE)
    assert shipped.path == PROFILE_DIR / "l4-2x.yaml"


def test_a_node_without_the_label_gets_the_default(profiles: Path) -> None:
    choice = choose_fake_profile(
        profile=str(profiles / "base.yaml"), label=LABEL, labels={"other": "big"}, node=NODE
    )
    assert (choice.path, choice.reason) == (profiles / "base.yaml", "node has no label")


def test_the_label_names_a_file_beside_the_profile_then_a_shipped_profile(profiles: Path) -> None:
    base = str(profiles / "base.yaml")
    beside = choose_fake_profile(profile=base, label=LABEL, labels={LABEL: "big"}, node=NODE)
    assert (beside.path, beside.reason, beside.label_value) == (profiles / "big.yaml", "node label", "big")
    shipped = choose_fake_profile(profile=base, label=LABEL, labels={LABEL: "a100-pcie-4x"}, node=NODE)
    assert shipped.path == PROFILE_DIR / "a100-pcie-4x.yaml"
    # A file of the directory wins over a shipped profile of the same name.
    shutil.copy(PROFILE_DIR / "h100-8x.yaml", profiles / "l4-2x.yaml")
    assert choose_fake_profile(profile=base, label=LABEL, labels={LABEL: "l4-2x"}, node=NODE).path == (
        profiles / "l4-2x.yaml"
    )


@pytest.mark.parametrize("value", ["nope", "", "..", "big.yaml"])
def test_a_value_naming_no_profile_is_a_configuration_error(profiles: Path, value: str) -> None:
    with pytest.raises(ConfigError) as raised:
        choose_fake_profile(
            profile=str(profiles / "base.yaml"), label=LABEL, labels={LABEL: value}, node=NODE
        )
    assert raised.value.field == FLAG
    message = str(raised.value)
    assert f"Node {NODE!r}" in message and f"{LABEL}={value!r}" in message
    # The known names: the directory's files and the shipped profiles.
    assert "known: a100-pcie-4x, base, big, h100-8x, l4-2x" in message


# -- reading the Node -----------------------------------------------------------------------------


def test_labels_are_read_once_the_node_exists(
    api_server: APIServer, kube_configuration: client.Configuration, caplog: pytest.LogCaptureFixture
) -> None:
    create_node(kube_configuration, {LABEL: "big"})
    stop = threading.Event()
    with caplog.at_level(logging.INFO, logger="driver.plugin.agent"):
        labels = read_node_labels(kube_configuration, NODE, stop)
    assert labels == {LABEL: "big"}
    assert api_server.request_count("get", "nodes") == 1
    assert not [r for r in caplog.records if r.getMessage().startswith("waiting")]


def test_an_api_error_is_retried_and_logged_once(
    api_server: APIServer, kube_configuration: client.Configuration, caplog: pytest.LogCaptureFixture
) -> None:
    create_node(kube_configuration, {LABEL: "big"})
    api_server.inject_fault("get", "nodes", 503, times=3)
    with caplog.at_level(logging.INFO, logger="driver.plugin.agent"):
        labels = read_node_labels(kube_configuration, NODE, threading.Event())
    assert labels == {LABEL: "big"}
    assert api_server.request_count("get", "nodes") == 4
    (waiting,) = [r for r in caplog.records if r.getMessage().startswith("waiting for the Node")]
    assert waiting.levelno == logging.WARNING and "503" in vars(waiting)["error"]
    assert [r.getMessage() for r in caplog.records].count("node found") == 1


def test_a_node_that_never_appears_names_the_node_flag(kube_configuration: client.Configuration) -> None:
    with pytest.raises(ConfigError) as raised:
        read_node_labels(kube_configuration, NODE, threading.Event(), timeout_seconds=0.1)
    assert raised.value.field == "--node-name (FRACTIONAL_NODE_NAME)"
    assert f"no Node {NODE!r} appeared within 0.1 s" in str(raised.value)


# -- the agent ------------------------------------------------------------------------------------


@pytest.fixture
def agents() -> Iterator[list[NodeAgent]]:
    started: list[NodeAgent] = []
    yield started
    for agent in started:
        agent.stop(grace=0)


def new_agent(
    dirs: NodeDirs, configuration: client.Configuration, profiles: Path, agents: list[NodeAgent]
) -> NodeAgent:
    config = dirs.config(profile=str(profiles / "base.yaml"), profile_node_label=LABEL)
    agent = NodeAgent(
        config, kube_configuration=configuration, boot_id_path=dirs.boot_id, publish_slices=False
    )
    agents.append(agent)
    return agent


@pytest.mark.parametrize(
    ("labels", "gpus", "reason", "path"),
    [
        ({LABEL: "big"}, 8, "node label", "big.yaml"),
        ({LABEL: "a100-pcie-4x"}, 4, "node label", str(PROFILE_DIR / "a100-pcie-4x.yaml")),
        ({}, 2, "node has no label", "base.yaml"),
    ],
)
def test_the_agent_loads_the_profile_its_node_names(
    labels: dict[str, str],
    gpus: int,
    reason: str,
    path: str,
    node_dirs: NodeDirs,
    kube_configuration: client.Configuration,
    profiles: Path,
    agents: list[NodeAgent],
    caplog: pytest.LogCaptureFixture,
) -> None:
    create_node(kube_configuration, labels)
    agent = new_agent(node_dirs, kube_configuration, profiles, agents)
    with caplog.at_level(logging.INFO, logger="driver.plugin.agent"):
        agent.start()
    assert agent.serving.is_set()
    assert len(agent.inventory.gpus) == gpus and agent.inventory.node_name == NODE
    (line,) = chosen(caplog)
    assert (line["reason"], line["label"], line["node"]) == (reason, LABEL, NODE)
    assert line["profile"] == str(profiles / path)
    assert line["label_value"] == labels.get(LABEL)


def test_without_the_flag_the_agent_never_reads_the_node(
    api_server: APIServer, start_agent: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="driver.plugin.agent"):
        agent = start_agent()
    assert len(agent.inventory.gpus) == 2
    (line,) = chosen(caplog)
    assert line["reason"] == "--profile" and line["label"] is None
    assert api_server.request_count("get", "nodes") == 0


def test_the_agent_waits_for_its_node(
    api_server: APIServer,
    node_dirs: NodeDirs,
    kube_configuration: client.Configuration,
    profiles: Path,
    agents: list[NodeAgent],
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = new_agent(node_dirs, kube_configuration, profiles, agents)
    errors: list[BaseException] = []

    def start() -> None:
        try:
            agent.start()
        except BaseException as error:  # reported by the assertion below
            errors.append(error)

    with caplog.at_level(logging.INFO, logger="driver.plugin.agent"):
        thread = threading.Thread(target=start)
        thread.start()
        wait_for(lambda: api_server.request_count("get", "nodes") >= 3, what="the agent retrying its Node")
        assert not agent.serving.is_set()
        create_node(kube_configuration, {LABEL: "big"})
        thread.join(timeout=30)
    assert not thread.is_alive() and errors == []
    assert agent.serving.is_set() and len(agent.inventory.gpus) == 8
    messages = [r.getMessage() for r in caplog.records]
    assert messages.count("waiting for the Node: its labels choose the fake profile") == 1
    assert messages.count("node found") == 1 and messages.count("fake profile chosen") == 1


def test_a_stop_while_waiting_ends_start_without_serving(
    api_server: APIServer,
    node_dirs: NodeDirs,
    kube_configuration: client.Configuration,
    profiles: Path,
    agents: list[NodeAgent],
) -> None:
    agent = new_agent(node_dirs, kube_configuration, profiles, agents)
    thread = threading.Thread(target=agent.start)
    thread.start()
    wait_for(lambda: api_server.request_count("get", "nodes") >= 1, what="the agent reading its Node")
    agent.stop_event.set()
    thread.join(timeout=30)
    assert not thread.is_alive() and not agent.serving.is_set()
    assert not list(node_dirs.registry.iterdir())  # no registration socket


def test_an_unknown_value_fails_start_before_any_socket(
    node_dirs: NodeDirs, kube_configuration: client.Configuration, profiles: Path, agents: list[NodeAgent]
) -> None:
    create_node(kube_configuration, {LABEL: "h200-16x"})
    agent = new_agent(node_dirs, kube_configuration, profiles, agents)
    with pytest.raises(ConfigError, match=r"names no profile.*known: a100-pcie-4x, base, big"):
        agent.start()
    assert not agent.serving.is_set() and not list(node_dirs.registry.iterdir())


# -- configuration and the command ----------------------------------------------------------------


@pytest.mark.parametrize("key", ["x", LABEL, "a.b/C_d.e", "kubernetes.io/hostname", "x" * 63])
def test_label_keys(key: str) -> None:
    assert PluginConfig(node_name=NODE, profile="l4-2x", profile_node_label=key).profile_node_label == key


@pytest.mark.parametrize("key", ["", "a/b/c", "-x", "Fractional.dev/x", "x" * 64, "/x", "a/", "a b"])
def test_bad_label_keys_are_refused(key: str) -> None:
    with pytest.raises(ConfigError) as raised:
        PluginConfig(node_name=NODE, profile="l4-2x", profile_node_label=key)
    assert raised.value.field == FLAG and "is not a label key" in str(raised.value)


def test_only_with_the_fake_backend() -> None:
    with pytest.raises(ConfigError, match="only with --backend fake") as raised:
        PluginConfig(node_name=NODE, backend="nvml", profile_node_label=LABEL)
    assert raised.value.field == FLAG


def test_flag_and_env_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["plugin", "--node-name", NODE, "--profile", "l4-2x"]
    monkeypatch.setenv("FRACTIONAL_PROFILE_NODE_LABEL", LABEL)
    assert build_plugin_config(_build_parser().parse_args(argv)).profile_node_label == LABEL
    flagged = [*argv, "--profile-node-label", "other"]
    assert build_plugin_config(_build_parser().parse_args(flagged)).profile_node_label == "other"
    monkeypatch.setenv("FRACTIONAL_PROFILE_NODE_LABEL", "")  # the chart leaves it out; empty = unset
    assert build_plugin_config(_build_parser().parse_args(argv)).profile_node_label is None


def _command(dirs: NodeDirs, kubeconfig: Path, profiles: Path) -> list[str]:
    command = [sys.executable, "-m", "driver", "plugin", "--node-name", NODE, "--backend", "fake"]
    command += ["--profile", str(profiles / "base.yaml"), "--profile-node-label", LABEL]
    command += ["--registry-dir", str(dirs.registry), "--plugin-dir", str(dirs.plugin)]
    command += ["--cdi-root", str(dirs.cdi), "--kubeconfig", str(kubeconfig), "--metrics-port", "0"]
    return command


def _env() -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("FRACTIONAL_")}
    return {**env, "PYTHONPATH": str(REPO_ROOT)}


def test_the_command_exits_2_naming_node_label_value_and_known_names(
    node_dirs: NodeDirs, kubeconfig_file: Path, kube_configuration: client.Configuration, profiles: Path
) -> None:
    create_node(kube_configuration, {LABEL: "nope"})
    done = subprocess.run(
        _command(node_dirs, kubeconfig_file, profiles),
        cwd=REPO_ROOT,
        env=_env(),
        capture_output=True,
        timeout=60,
    )
    stderr = done.stderr.decode()
    assert done.returncode == 2, stderr[-3000:]
    assert "Traceback" not in stderr
    (line,) = [text for text in stderr.splitlines() if "configuration error" in text]
    for part in (FLAG, f"Node {NODE!r}", f"{LABEL}='nope'", "known: a100-pcie-4x, base, big, h100-8x, l4-2x"):
        assert part in line, line


def test_sigterm_while_waiting_for_the_node_exits_0(
    api_server: APIServer, node_dirs: NodeDirs, kubeconfig_file: Path, profiles: Path
) -> None:
    process = subprocess.Popen(
        _command(node_dirs, kubeconfig_file, profiles), cwd=REPO_ROOT, env=_env(), stderr=subprocess.PIPE
    )
    try:
        wait_for(lambda: api_server.request_count("get", "nodes") >= 2, timeout=60, what="the agent waiting")
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    text = stderr.decode()
    assert process.returncode == 0, text[-3000:]
    assert text.count("waiting for the Node") == 1
    assert not list(node_dirs.registry.iterdir())

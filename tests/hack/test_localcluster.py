"""The local cluster's harness (hack/localcluster) without starting a cluster: the certificates it
makes, the configurations it writes for containerd, the CNI and the kubelet, and its process
bookkeeping. ``make e2e`` runs the real thing."""

from __future__ import annotations

import ipaddress
import json
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "hack"))

from localcluster.cluster import DEFAULT_NODES, RELEASES, LocalCluster  # noqa: E402
from localcluster.node import _cni_config, _containerd_config, _kubelet_config  # noqa: E402
from localcluster.pki import make_pki  # noqa: E402
from localcluster.procs import Processes  # noqa: E402


@pytest.fixture
def cluster(tmp_path: Path) -> LocalCluster:
    made = LocalCluster(state_dir=tmp_path / "state")
    made.ports = {"apiserver": 6443}
    return made


def test_node_names_are_their_addresses_and_not_loopback_ones() -> None:
    """A node's name is its IP (the kubelet takes a --hostname-override that is an IP as the node's
    InternalIP), and no loopback one: kube-apiserver refuses loopback EndpointSlice addresses
    ("may not be in the loopback range", seen on 1.37.2 when the allocation guard's Service pointed
    at a controller on a 127.0.0.x node), and the kubelet a loopback --node-ip."""
    for node in DEFAULT_NODES:
        address = ipaddress.ip_address(node.ip)
        assert node.name == node.ip and not address.is_loopback and not address.is_link_local
        assert address in ipaddress.ip_network("198.18.0.0/15")  # RFC 2544: routed by no real network
    assert len({n.pod_cidr for n in DEFAULT_NODES}) == len(DEFAULT_NODES)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command (Debian: openssl)")
def test_the_pki_signs_what_each_component_needs(tmp_path: Path) -> None:
    pki = make_pki(
        tmp_path,
        clients={
            "admin": "/CN=kubernetes-admin/O=system:masters",
            "node-127.0.0.2": "/CN=system:node:127.0.0.2/O=system:nodes",
        },
        node_ips=["127.0.0.2"],
    )

    def text(cert: Path) -> str:
        return subprocess.run(
            ["openssl", "x509", "-in", str(cert), "-noout", "-text"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    serving = text(pki.serving.cert)
    for name in (
        "IP Address:127.0.0.1",
        "IP Address:127.0.0.2",
        "DNS:kubernetes.default.svc",
        "TLS Web Server",
    ):
        assert name in serving
    node = text(pki.client("node-127.0.0.2").cert)
    assert "system:node:127.0.0.2" in node and "system:nodes" in node and "TLS Web Client" in node
    for cert in (pki.serving.cert, pki.client("admin").cert, tmp_path / "kubelet-127.0.0.2.crt"):
        verified = subprocess.run(
            ["openssl", "verify", "-CAfile", str(pki.ca_cert), str(cert)], capture_output=True, text=True
        )
        assert verified.returncode == 0, verified.stderr
    assert pki.sa_pub.read_text().startswith("-----BEGIN PUBLIC KEY-----")


def test_containerd_runs_cdi_our_pause_image_and_its_own_paths(cluster: LocalCluster) -> None:
    from localcluster.cluster import Binaries

    binaries = Binaries(Path("/k"), Path("/e"), Path("/c"), Path("/cni"), Path("/kueue"))
    configs = [tomllib.loads(_containerd_config(cluster, node, binaries)) for node in cluster.nodes]
    for config in configs:
        runtime = config["plugins"]["io.containerd.cri.v1.runtime"]
        assert runtime["enable_cdi"] is True and "/var/run/cdi" in runtime["cdi_spec_dirs"]
        assert runtime["cni"]["bin_dirs"] == ["/cni"]
        assert config["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"].startswith(
            "localhost/"
        )
        assert config["plugins"]["io.containerd.nri.v1.nri"]["disable"] is True  # one NRI socket per host
    sockets = [c["grpc"]["address"] for c in configs]
    assert len(set(sockets)) == len(sockets) and all(len(s) < 108 for s in sockets)
    assert len({c["root"] for c in configs}) == len(configs)


def test_each_node_has_its_own_bridge_and_pod_range(cluster: LocalCluster) -> None:
    plugins = [_cni_config(cluster, node)["plugins"][0] for node in cluster.nodes]  # type: ignore[index]
    assert len({p["bridge"] for p in plugins}) == len(plugins)
    ranges = [p["ipam"]["ranges"][0][0]["subnet"] for p in plugins]
    assert ranges == [node.pod_cidr for node in cluster.nodes]
    assert all(p["ipMasq"] is False for p in plugins)  # nothing leaves the machine


def test_the_kubelet_config_suits_this_machine(cluster: LocalCluster) -> None:
    node = cluster.nodes[0]
    config = _kubelet_config(cluster, node)
    assert config["address"] == node.ip and config["readOnlyPort"] == 0
    assert config["cgroupsPerQOS"] is False and config["enforceNodeAllocatable"] == []
    assert config["failCgroupV1"] is False and config["failSwapOn"] is False
    assert config["authentication"]["anonymous"] == {"enabled": False}  # type: ignore[index]
    gates, _ = RELEASES[cluster.release]
    assert config["featureGates"] == gates
    json.dumps(config)  # written as JSON, which the kubelet reads as YAML


def test_processes_are_recorded_and_stopped_across_instances(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    first = Processes(state, tmp_path / "logs")
    started = first.start("sleeper", ["sleep", "30"])
    assert started.alive()
    second = Processes(state, tmp_path / "logs")  # another process reads the same state (make cluster-down)
    (recorded,) = second.entries
    assert recorded.pid == started.pid and recorded.alive()
    second.stop(recorded, grace_seconds=5)
    first.stop(started)  # the parent reaps its child (a stopped process is left alone)
    assert not started.alive()
    assert Processes(state, tmp_path / "logs").entries == []


def test_a_restart_starts_the_same_command_again_in_its_place_from_another_instance(tmp_path: Path) -> None:
    """A fault from another process (the e2e suite): the recorded command line, environment and
    directory start it again, in its place in the start order, its log appended to."""
    state, logs = tmp_path / "state.json", tmp_path / "logs"
    first = Processes(state, logs)
    work = tmp_path / "work"
    work.mkdir()
    script = 'echo "$MARK $(pwd)"; exec sleep 30'
    a = first.start("a", ["sleep", "30"])
    original = first.start(
        "b", ["sh", "-c", script], env={"MARK": "started", "PATH": "/usr/bin:/bin"}, cwd=work
    )
    c = first.start("c", ["sleep", "30"])

    def lines() -> int:
        return (logs / "b.log").read_text().count("started")

    # Killed before its shell ran the echo (a loaded make test), the first one never writes its
    # line: wait for it first.
    deadline = time.monotonic() + 30
    while lines() < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    second = Processes(state, logs)
    again = second.restart("b", down_seconds=0.2)
    assert again.pid != original.pid and again.alive() and not original.alive()
    assert [p.name for p in Processes(state, logs).entries] == ["a", "b", "c"]
    deadline = time.monotonic() + 30
    while lines() < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (logs / "b.log").read_text().splitlines() == [f"started {work}"] * 2
    second.stop(again, grace_seconds=2)
    for process in (a, original, c):  # the parent reaps its own children
        first.stop(process, grace_seconds=2)
    with pytest.raises(KeyError):
        second.restart("b")

"""A Kubernetes cluster of upstream binaries on this machine, on loopback (``make cluster-up``).

The control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) runs as plain
processes on 127.0.0.1. Each node is a real kubelet with its own containerd, in a mount namespace
of its own where its directories are bind-mounted over ``/var/lib/kubelet`` and ``/var/run/cdi``,
so the chart's hostPath volumes mean the same on every node, as on separate machines.

A node's name is its address, 198.18.0.2, 198.18.0.3, ... (RFC 2544's benchmarking range, which no
real network routes), each added to the host's ``lo`` interface while the cluster is up. Not loopback
addresses: the kubelet refuses a loopback ``--node-ip`` and kube-apiserver a loopback EndpointSlice
address (so a webhook Service could never reach a pod on such a node's host network). Given an IP as
``--hostname-override``, the kubelet takes it as the node's InternalIP. So two kubelets, their pods on
the host network (the driver's agent and controller) and the apiserver's connections to the kubelets
and to the controller's allocation guard all stay on this machine.

Pods get a network from the CNI bridge plugin (one bridge and /24 per node, no masquerade, no
kube-proxy): enough to start the README's workloads; our own pods use the host network and reach
the apiserver at 127.0.0.1 (the chart's ``apiServer.host``). Without kube-proxy the apiserver calls
webhooks named by a Service at that Service's endpoints (``--enable-aggregator-routing``): the
controller's allocation guard, at the leading replica's node address.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from localcluster.pki import Pki, make_pki
from localcluster.procs import Processes, mount_namespace_members

__all__ = ["RELEASES", "ClusterError", "LocalCluster", "NodeSpec"]

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_ROOT = Path("/run/fractional-cluster")  # short paths: a unix socket path has at most 107 bytes

# Feature gates and API versions per release, the same on every component (a gate off on the
# apiserver drops the fields; the scheduler allocates; the controller-manager runs the DRA controllers).
RELEASES: dict[str, tuple[dict[str, bool], tuple[str, ...]]] = {
    # GenericWorkload is beta but off (GangScheduling merged into it); DeviceTaintRule is GA in v1.
    "1.37": ({"GenericWorkload": True}, ("scheduling.k8s.io/v1beta1=true",)),
    # DeviceTaintRule is beta and off, served in v1beta2 only.
    "1.36": (
        {"GenericWorkload": True, "GangScheduling": True, "DRADeviceTaintRules": True},
        ("scheduling.k8s.io/v1alpha2=true", "resource.k8s.io/v1beta2=true"),
    ),
    # Consumable capacity, device taints and DeviceTaintRule (v1alpha3) are alpha.
    "1.35": (
        {
            "DRAConsumableCapacity": True,
            "DRADeviceTaints": True,
            "DRADeviceTaintRules": True,
            "GenericWorkload": True,
            "GangScheduling": True,
        },
        ("scheduling.k8s.io/v1alpha1=true", "resource.k8s.io/v1alpha3=true"),
    ),
}
DEFAULT_VERSION = "1.37.2"
SERVICE_CIDR = "10.0.0.0/24"


# Each control-plane component's health check: its port's name in ``ports``, the path, and TLS.
CONTROL_PLANE_HEALTH = {
    "etcd": ("etcd", "/health", False),
    "kube-apiserver": ("apiserver", "/readyz", True),
    "kube-controller-manager": ("controller-manager", "/healthz", True),
    "kube-scheduler": ("scheduler", "/healthz", True),
}


class ClusterError(RuntimeError):
    """The cluster could not be started; the message says which component and where its log is."""


@dataclass(frozen=True, slots=True)
class NodeSpec:
    ip: str  # also the node's name (see the module docstring)
    profile: str  # fake device profile, published through the node label fractional.dev/fake-profile
    pod_cidr: str
    provider_id: str = ""  # spec.providerID (a node of a node group: nodegroups.py)
    labels: tuple[tuple[str, str], ...] = ()  # more labels the kubelet registers with
    taints: tuple[tuple[str, str, str], ...] = ()  # (key, value, effect) it registers with

    @property
    def name(self) -> str:
        return self.ip

    @property
    def key(self) -> str:  # a file-name-safe id
        return "node-" + self.ip.replace(".", "-")


DEFAULT_NODES = (
    NodeSpec("198.18.0.2", "h100-8x", "10.244.2.0/24"),
    NodeSpec("198.18.0.3", "a100-pcie-4x", "10.244.3.0/24"),
)
PROFILE_LABEL = "fractional.dev/fake-profile"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Binaries:
    kube: Path
    etcd: Path
    containerd: Path
    cni: Path
    kueue: Path  # the directory of Kueue's manager (built with COMPONENTS naming kueue, or all)

    @classmethod
    def build(cls, version: str, components: str) -> Binaries:
        """The binaries of ``version``: found cached (``--print-env``, which takes no lock, so a
        build of another release running meanwhile does not hold us up), else built."""
        found = _upstream_paths(dict(os.environ, K8S_VERSION=version, COMPONENTS=components))
        return cls(
            Path(found["KUBE_BIN"]),
            Path(found["ETCD_BIN"]),
            Path(found["CONTAINERD_BIN"]),
            Path(found["CNI_BIN"]),
            Path(found["KUEUE_BIN"]),
        )

    @staticmethod
    def kwok() -> Path:
        """kwok's binary (``COMPONENTS=kwok``: never part of a cluster's own build), built when missing."""
        return Path(_upstream_paths(dict(os.environ, COMPONENTS="kwok"))["KWOK_BIN"]) / "kwok"


def _upstream_paths(env: dict[str, str]) -> dict[str, str]:
    """hack/upstream-build.sh's environment lines (NAME=path) for ``env``'s components: found
    cached (``--print-env``, which takes no lock, so a build of another release running meanwhile
    does not hold us up), else built."""
    script = str(REPO_ROOT / "hack" / "upstream-build.sh")
    result = subprocess.run([script, "--print-env"], env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        result = subprocess.run([script], env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ClusterError(f"hack/upstream-build.sh failed:\n{result.stderr[-3000:]}")
    found: dict[str, str] = {}
    for line in result.stdout.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.endswith("_BIN"):
            found[name] = value.strip().strip("'\"")
    return found


@dataclass
class LocalCluster:
    state_dir: Path = REPO_ROOT / ".cluster"
    version: str = DEFAULT_VERSION
    nodes: tuple[NodeSpec, ...] = DEFAULT_NODES
    ports: dict[str, int] = field(default_factory=dict)
    # More client certificates (name: subject), e.g. a benchmark's own user, each with a kubeconfig
    # <state_dir>/<name>.kubeconfig; and more flags per component (its name: the flags).
    clients: dict[str, str] = field(default_factory=dict)
    extra_args: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.processes = Processes(self.state_dir / "state.json", self.state_dir / "logs")
        saved = self.processes.extra
        if saved:
            self.version = str(saved.get("version", self.version))
            self.ports = {k: int(v) for k, v in dict(saved.get("ports", {})).items()}  # type: ignore[call-overload]
            added = [_node_from_saved(n) for n in list(saved.get("added_nodes", []))]  # type: ignore[call-overload]
            self.nodes = (*self.nodes, *(n for n in added if n not in self.nodes))
        self.release = ".".join(self.version.split(".")[:2])
        if self.release not in RELEASES:
            raise ClusterError(f"K8S_VERSION {self.version}: not one of {', '.join(RELEASES)}")

    # ------------------------------------------------------------------ paths and settings
    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    @property
    def apiserver_url(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    @property
    def gates(self) -> dict[str, bool]:
        """The release's feature gates, the same on every component (the kubelet's config too)."""
        return dict(RELEASES[self.release][0])

    def feature_gates(self) -> str:
        return ",".join(f"{name}={str(value).lower()}" for name, value in sorted(self.gates.items()))

    def _remember(self) -> None:
        self.processes.extra.update({"version": self.version, "ports": self.ports})
        self.processes.save()

    # ------------------------------------------------------------------ control plane
    def up_control_plane(
        self,
        binaries: Binaries,
        components: tuple[str, ...] = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"),
    ) -> None:
        """Start the control plane; ``components`` leaves some out (the tests' real backend runs
        no scheduler, as the emulator has none). etcd and kube-apiserver are always started."""
        if self.processes.get("kube-apiserver") is not None:
            raise ClusterError(f"a cluster is already up ({self.state_dir}); run make cluster-down first")
        _claim_machine(self.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        for name in ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler"):
            self.ports[name] = free_port()
        self._remember()
        pki = make_pki(
            self.pki_dir,
            clients={
                "admin": "/CN=kubernetes-admin/O=system:masters",
                "controller-manager": "/CN=system:kube-controller-manager",
                "scheduler": "/CN=system:kube-scheduler",
                "apiserver-kubelet-client": "/CN=kube-apiserver-kubelet-client/O=system:masters",
                **{f"node-{n.ip}": f"/CN=system:node:{n.name}/O=system:nodes" for n in self.nodes},
                **self.clients,
            },
            node_ips=[n.ip for n in self.nodes],
        )
        self.write_kubeconfig(self.kubeconfig, "admin", embed=True)
        for name in ("controller-manager", "scheduler", *self.clients):
            self.write_kubeconfig(self.state_dir / f"{name}.kubeconfig", name, embed=False)
        self._start_etcd(binaries)
        self._start_apiserver(binaries, pki)
        if "kube-controller-manager" in components:
            self._start_controller_manager(binaries, pki)
        if "kube-scheduler" in components:
            self._start_scheduler(binaries)

    def write_kubeconfig(self, path: Path, user: str, *, embed: bool) -> None:
        """A kubeconfig for the client certificate ``<pki>/<user>.crt``: with the certificates in
        it (``embed``, the admin's, to copy elsewhere) or pointing at the files (components)."""
        ca_cert = self.pki_dir / "ca.crt"
        cert, key = self.pki_dir / f"{user}.crt", self.pki_dir / f"{user}.key"
        if embed:
            cluster = {"server": self.apiserver_url, "certificate-authority-data": _b64(ca_cert)}
            credentials = {"client-certificate-data": _b64(cert), "client-key-data": _b64(key)}
        else:
            cluster = {"server": self.apiserver_url, "certificate-authority": str(ca_cert)}
            credentials = {"client-certificate": str(cert), "client-key": str(key)}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "local", "cluster": cluster}],
            "users": [{"name": user, "user": credentials}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
            "current-context": "local",
        }
        path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        path.chmod(0o600)

    def _start_etcd(self, binaries: Binaries) -> None:
        client = f"http://127.0.0.1:{self.ports['etcd']}"
        self.processes.start(
            "etcd",
            [
                str(binaries.etcd / "etcd"), "--name", "local", "--data-dir", str(self.state_dir / "etcd"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", f"http://127.0.0.1:{self.ports['etcd-peer']}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.ports['etcd-peer']}",
                "--initial-cluster", f"local=http://127.0.0.1:{self.ports['etcd-peer']}",
                "--listen-metrics-urls", "", "--log-level", "warn", "--quota-backend-bytes", str(2 * 1024**3),
                "--unsafe-no-fsync",  # a throwaway cluster on a shared disk: durability is not the point
            ],
        )  # fmt: skip
        self._wait_healthy("etcd")

    def _start_apiserver(self, binaries: Binaries, pki: Pki) -> None:
        _, runtime_config = RELEASES[self.release]
        kubelet_client = pki.client("apiserver-kubelet-client")
        self.processes.start(
            "kube-apiserver",
            [
                str(binaries.kube / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
                "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                f"--secure-port={self.ports['apiserver']}",
                f"--tls-cert-file={pki.serving.cert}", f"--tls-private-key-file={pki.serving.key}",
                f"--client-ca-file={pki.ca_cert}",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--endpoint-reconciler-type=none",  # 127.0.0.1 is no valid Endpoints address
                # No kube-proxy: webhooks named by a Service (the driver's allocation guard) are
                # called at the Service's endpoint, not its ClusterIP.
                "--enable-aggregator-routing=true",
                "--allow-privileged=true",
                f"--kubelet-client-certificate={kubelet_client.cert}",
                f"--kubelet-client-key={kubelet_client.key}",
                f"--kubelet-certificate-authority={pki.ca_cert}",
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                f"--feature-gates={self.feature_gates()}",
                f"--runtime-config={','.join(runtime_config)}",
                f"--cert-dir={self.state_dir / 'apiserver-certs'}",
                "--profiling=false",
                *self.extra_args.get("kube-apiserver", ()),
            ],
        )  # fmt: skip
        self._wait_healthy("kube-apiserver")

    def _start_controller_manager(self, binaries: Binaries, pki: Pki) -> None:
        kubeconfig = str(self.state_dir / "controller-manager.kubeconfig")
        self.processes.start(
            "kube-controller-manager",
            [
                str(binaries.kube / "kube-controller-manager"),
                f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                f"--service-account-private-key-file={pki.sa_key}", f"--root-ca-file={pki.ca_cert}",
                "--use-service-account-credentials=true", "--leader-elect=false",
                "--bind-address=127.0.0.1", f"--secure-port={self.ports['controller-manager']}",
                f"--cluster-signing-cert-file={pki.ca_cert}", f"--cluster-signing-key-file={pki.ca_key}",
                f"--feature-gates={self.feature_gates()}",
                *self.extra_args.get("kube-controller-manager", ()),
            ],
        )  # fmt: skip
        self._wait_healthy("kube-controller-manager")

    def _start_scheduler(self, binaries: Binaries) -> None:
        kubeconfig = str(self.state_dir / "scheduler.kubeconfig")
        self.processes.start(
            "kube-scheduler",
            [
                str(binaries.kube / "kube-scheduler"),
                f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}", "--leader-elect=false",
                "--bind-address=127.0.0.1", f"--secure-port={self.ports['scheduler']}",
                f"--feature-gates={self.feature_gates()}", *self.extra_args.get("kube-scheduler", ()),
            ],
        )  # fmt: skip
        self._wait_healthy("kube-scheduler")

    def restart_scheduler(self, binaries: Binaries) -> None:
        """kube-scheduler stopped and started again with the ``extra_args`` as they are now (a
        benchmark changes its client limits between two cases)."""
        process = self.processes.get("kube-scheduler")
        if process is not None:
            self.processes.stop(process)
        self._start_scheduler(binaries)

    def restart(
        self,
        name: str,
        *,
        down_seconds: float = 0.0,
        signum: int = signal.SIGKILL,
        argv: list[str] | None = None,
    ) -> float:
        """A fault: the component ``name`` (``etcd``, ``kube-apiserver``, ``kube-scheduler``,
        ``kube-controller-manager``, or a node's ``<key>-kubelet`` / ``<key>-containerd``) killed
        with ``signum``, left down ``down_seconds``, and started again in place with its data and
        flags (``argv``: another command line, e.g. the fleet's flags). Returns the time.monotonic()
        at which it answered its health check again (for a node's process: at which it was
        started; the kubelet's readiness is the Node's)."""
        try:
            self.processes.restart(name, down_seconds=down_seconds, signum=signum, argv=argv)
        except ValueError as error:
            raise ClusterError(str(error)) from error
        if name in CONTROL_PLANE_HEALTH:
            self._wait_healthy(name)
        return time.monotonic()

    def _wait_healthy(self, name: str) -> None:
        """Until the control-plane component ``name`` answers its health check."""
        port, path, tls = CONTROL_PLANE_HEALTH[name]
        self._wait(f"{'https' if tls else 'http'}://127.0.0.1:{self.ports[port]}{path}", name, tls=tls)

    def _wait(self, url: str, name: str, *, tls: bool, timeout_seconds: float = 90.0) -> None:
        context = None
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE  # the components' own serving certs are self-signed
            context.load_cert_chain(str(self.pki_dir / "admin.crt"), str(self.pki_dir / "admin.key"))
        process = self.processes.get(name)
        deadline = time.monotonic() + timeout_seconds
        last = ""
        while time.monotonic() < deadline:
            if process is not None and not process.alive():
                raise ClusterError(f"{name} exited; its log: {process.log}\n{_tail(Path(process.log))}")
            try:
                with urllib.request.urlopen(url, timeout=5, context=context) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError) as error:
                last = str(error)
            time.sleep(0.5)
        log = process.log if process else "?"
        raise ClusterError(f"{name} not healthy at {url} after {timeout_seconds:.0f}s ({last}); log: {log}")

    def add_nodes(self, nodes: list[NodeSpec]) -> None:
        """Nodes joined after ``up`` (a node group grown), remembered so that ``down`` stops them."""
        self.nodes = (*self.nodes, *nodes)
        added = list(self.processes.extra.get("added_nodes", []))  # type: ignore[call-overload]
        added += [_node_to_saved(n) for n in nodes]
        self.processes.extra["added_nodes"] = added
        self.processes.save()

    def forget_node(self, node: NodeSpec) -> None:
        """A node removed (stopped, its Node deleted): no longer the cluster's."""
        self.nodes = tuple(n for n in self.nodes if n != node)
        added = list(self.processes.extra.get("added_nodes", []))  # type: ignore[call-overload]
        self.processes.extra["added_nodes"] = [a for a in added if a.get("ip") != node.ip]
        self.processes.save()

    # ------------------------------------------------------------------ teardown
    def down(self) -> list[str]:
        """Stop everything this cluster started (nodes first) and remove what it wrote."""
        said: list[str] = []
        from localcluster.node import remove_node_addresses, stop_node  # the node module needs this one

        for node in self.nodes:
            said.extend(stop_node(self, node))
        said.extend(remove_node_addresses(self))
        for process in reversed(list(self.processes.entries)):
            self.processes.stop(process)
            said.append(f"stopped {process.name} (pid {process.pid})")
        for inode in dict(self.processes.extra.get("namespaces", {})).values():  # type: ignore[call-overload]
            for pid in mount_namespace_members(str(inode)):
                os.kill(pid, 9)
                said.append(f"killed pid {pid} left in a node's mount namespace")
        shutil.rmtree(self.state_dir, ignore_errors=True)
        shutil.rmtree(RUN_ROOT, ignore_errors=True)
        return said


def _node_to_saved(node: NodeSpec) -> dict[str, object]:
    return {"ip": node.ip, "profile": node.profile, "pod_cidr": node.pod_cidr,
            "provider_id": node.provider_id, "labels": [list(pair) for pair in node.labels],
            "taints": [list(taint) for taint in node.taints]}  # fmt: skip


def _node_from_saved(saved: dict[str, object]) -> NodeSpec:
    labels = tuple((str(k), str(v)) for k, v in saved.get("labels") or ())  # type: ignore[attr-defined]
    taints = tuple((str(k), str(v), str(e)) for k, v, e in saved.get("taints") or ())  # type: ignore[attr-defined]
    provider = str(saved.get("provider_id") or "")
    return NodeSpec(str(saved["ip"]), str(saved["profile"]), str(saved["pod_cidr"]), provider_id=provider,
                    labels=labels, taints=taints)  # fmt: skip


def _claim_machine(state_dir: Path) -> None:
    """One local cluster per machine: the node addresses, kubelet ports, bridges and
    /run/fractional-cluster are the machine's. Refuse while another checkout's cluster runs."""
    owner_file = RUN_ROOT / "owner"
    if owner_file.exists():
        other = Path(owner_file.read_text(encoding="utf-8").strip())
        live = other != state_dir and any(p.alive() for p in Processes(other / "state.json", other).entries)
        if live:
            raise ClusterError(f"another local cluster runs on this machine ({other}); stop it there first")
    RUN_ROOT.mkdir(parents=True, exist_ok=True)
    owner_file.write_text(f"{state_dir}\n", encoding="utf-8")


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""

"""One node of the local cluster: a mount namespace, a containerd, a kubelet.

The namespace is held by a small ``sleep`` process started with ``unshare --mount``; inside it the
node's own directories are bind-mounted over ``/var/lib/kubelet`` and ``/var/run/cdi``, and
containerd and the kubelet are started in it with ``nsenter``. Everything else (the network, the
cgroups, the other paths) is the host's, shared by both nodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from localcluster.cluster import PROFILE_LABEL, RUN_ROOT, Binaries, ClusterError, LocalCluster, NodeSpec
from localcluster.procs import mount_namespace_members

__all__ = ["add_node_address", "node_dir", "remove_node_addresses", "start_nodes", "stop_node", "up_nodes"]

KUBELET_DIR = Path("/var/lib/kubelet")
CDI_DIR = Path("/run/cdi")  # /var/run is /run
PAUSE_IMAGE = "localhost/fractional-pause:3.10-local"
KUBELET_PORT = 10250
KUBELET_HEALTHZ_PORT = 10248


def node_dir(cluster: LocalCluster, node: NodeSpec) -> Path:
    return cluster.state_dir / "nodes" / node.key


def run_dir(node: NodeSpec) -> Path:
    return RUN_ROOT / node.key


def _containerd_config(cluster: LocalCluster, node: NodeSpec, binaries: Binaries) -> str:
    base, run = node_dir(cluster, node), run_dir(node)
    return f"""version = 3
root = "{base / "containerd"}"
state = "{run / "containerd"}"
[grpc]
  address = "{run / "containerd.sock"}"
[ttrpc]
  address = "{run / "containerd.sock.ttrpc"}"
[plugins.'io.containerd.nri.v1.nri']
  disable = true
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  restrict_oom_score_adj = {str(not _has_sys_resource()).lower()}
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{binaries.cni}"]
    conf_dir = "{base / "cni" / "net.d"}"
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
      BinaryName = "/usr/bin/runc"
      Root = "{run / "runc"}"
      SystemdCgroup = false
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "{node.ip}"
  stream_server_port = "0"
"""


def _has_sys_resource() -> bool:
    """Whether this process may lower an oom_score_adj (CAP_SYS_RESOURCE). Sandboxed machines may
    lack it; then runc fails every pod sandbox ("failed to update /proc/self/oom_score_adj:
    Permission denied", shown by kubelet as "can't get final child's PID from pipe: EOF"), because
    kubelet asks for -998. containerd's restrict_oom_score_adj then keeps each value at or above its own."""
    for line in Path("/proc/self/status").read_text(encoding="utf-8").splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 24 & 1)
    return True


def bridge_name(cluster: LocalCluster, node: NodeSpec) -> str:
    """The node's CNI bridge: by its place among the first nodes, by its address for a node that
    joined a node group later (a place would shift when one of those leaves)."""
    if node.provider_id:
        return "frng" + node.ip.rsplit(".", 1)[1]
    return f"frbr{cluster.nodes.index(node)}"


def _cni_config(cluster: LocalCluster, node: NodeSpec) -> dict[str, object]:
    return {
        "cniVersion": "1.0.0",
        "name": "fractional-local",
        "plugins": [
            {
                "type": "bridge",
                "bridge": bridge_name(cluster, node),
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": False,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": node.pod_cidr}]],
                    "dataDir": str(node_dir(cluster, node) / "cni" / "ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def _kubelet_config(cluster: LocalCluster, node: NodeSpec) -> dict[str, object]:
    pki = cluster.pki_dir
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": node.ip,
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": node.ip,
        "healthzPort": KUBELET_HEALTHZ_PORT,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": str(pki / f"kubelet-{node.ip}.crt"),
        "tlsPrivateKeyFile": str(pki / f"kubelet-{node.ip}.key"),
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        "failSwapOn": False,
        "failCgroupV1": False,
        "containerRuntimeEndpoint": f"unix://{run_dir(node) / 'containerd.sock'}",
        "podLogsDir": str(node_dir(cluster, node) / "pod-logs"),
        "evictionHard": {"imagefs.available": "0%", "nodefs.available": "0%", "nodefs.inodesFree": "0%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "localStorageCapacityIsolation": False,
        "serializeImagePulls": False,
        "maxPods": 110,
        "featureGates": cluster.gates,
        "podCIDR": node.pod_cidr,
        "resolvConf": "/etc/resolv.conf",
        "shutdownGracePeriod": "0s",
        **({"providerID": node.provider_id} if node.provider_id else {}),
        **(
            {"registerWithTaints": [{"key": k, "value": v, "effect": e} for k, v, e in node.taints]}
            if node.taints
            else {}
        ),
    }


def _namespace(cluster: LocalCluster, node: NodeSpec) -> int:
    """Start the process that holds the node's mount namespace; return its pid."""
    base = node_dir(cluster, node)
    for path in (base / "kubelet", base / "cdi"):
        path.mkdir(parents=True, exist_ok=True)
    for target in (KUBELET_DIR, CDI_DIR):
        target.mkdir(parents=True, exist_ok=True)
    script = (
        f"mount --bind {base / 'kubelet'} {KUBELET_DIR} && mount --make-rshared {KUBELET_DIR} && "
        f"mount --bind {base / 'cdi'} {CDI_DIR} && exec sleep infinity"
    )
    holder = cluster.processes.start(
        f"{node.key}-namespace", ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script]
    )
    for _ in range(100):
        try:
            inode = os.readlink(f"/proc/{holder.pid}/ns/mnt")
            if inode != os.readlink("/proc/self/ns/mnt") and _mounted(holder.pid, KUBELET_DIR):
                namespaces = dict(cluster.processes.extra.get("namespaces", {}))  # type: ignore[call-overload]
                namespaces[node.key] = inode
                cluster.processes.extra["namespaces"] = namespaces
                cluster.processes.save()
                return holder.pid
        except OSError:
            pass
        time.sleep(0.05)
    raise ClusterError(f"{node.name}: the mount namespace did not come up; log: {holder.log}")


def _mounted(pid: int, path: Path) -> bool:
    try:
        return any(
            line.split()[4] == str(path) for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        )
    except OSError:
        return False


def _in_namespace(holder_pid: int, argv: list[str]) -> list[str]:
    return ["nsenter", f"--target={holder_pid}", "--mount", "--", *argv]


def add_node_address(cluster: LocalCluster, node: NodeSpec) -> None:
    """The node's address on the host's ``lo`` (see cluster.py), recorded so that ``down`` removes it."""
    shown = subprocess.run(
        ["ip", "-o", "addr", "show", "dev", "lo"], capture_output=True, text=True, check=False
    )
    if f" {node.ip}/" not in shown.stdout:
        added = subprocess.run(
            ["ip", "addr", "add", f"{node.ip}/32", "dev", "lo"], capture_output=True, text=True, check=False
        )
        if added.returncode != 0:
            raise ClusterError(
                f"{node.name}: cannot add its address to lo (needs root): {added.stderr.strip()}"
            )
    addresses = list(cluster.processes.extra.get("node_addresses", []))  # type: ignore[call-overload]
    if node.ip not in addresses:
        cluster.processes.extra["node_addresses"] = [*addresses, node.ip]
        cluster.processes.save()


def remove_node_addresses(cluster: LocalCluster) -> list[str]:
    said = []
    for address in list(cluster.processes.extra.get("node_addresses", [])):  # type: ignore[call-overload]
        subprocess.run(["ip", "addr", "del", f"{address}/32", "dev", "lo"], capture_output=True, check=False)
        said.append(f"removed {address} from lo")
    cluster.processes.extra["node_addresses"] = []
    return said


def kubelet_node_labels(node: NodeSpec) -> dict[str, str]:
    """The labels a real node's kubelet registers with: its fake profile (never the fleet's label,
    which is kwok's to manage: fleet.py)."""
    return {PROFILE_LABEL: node.profile, **dict(node.labels)}


def up_nodes(cluster: LocalCluster, binaries: Binaries, *, with_driver_image: bool = True) -> None:
    start_nodes(cluster, binaries, cluster.nodes, with_driver_image=with_driver_image)
    wait_for_nodes_ready(cluster)
    wait_for_default_service_account(cluster)


def start_nodes(
    cluster: LocalCluster,
    binaries: Binaries,
    nodes: tuple[NodeSpec, ...],
    *,
    with_driver_image: bool = True,
    reuse_images: bool = False,
) -> None:
    """Start ``nodes`` (of ``cluster.nodes``): each one's containerd, the images (``reuse_images``:
    those built for the nodes before, when there), its kubelet."""
    env = dict(os.environ, PATH=f"{binaries.containerd}:{binaries.cni}:{os.environ.get('PATH', '')}")
    cluster.processes.extra["containerd_bin"] = str(binaries.containerd)
    for node in nodes:
        add_node_address(cluster, node)
    for node in nodes:
        base = node_dir(cluster, node)
        (base / "cni" / "net.d").mkdir(parents=True, exist_ok=True)
        run_dir(node).mkdir(parents=True, exist_ok=True)
        (base / "containerd.toml").write_text(_containerd_config(cluster, node, binaries), encoding="utf-8")
        (base / "cni" / "net.d" / "10-fractional.conflist").write_text(
            json.dumps(_cni_config(cluster, node), indent=2) + "\n", encoding="utf-8"
        )
        (base / "kubelet.yaml").write_text(
            json.dumps(_kubelet_config(cluster, node), indent=2), encoding="utf-8"
        )
        cluster.write_kubeconfig(base / "kubeconfig", f"node-{node.ip}", embed=False)
        holder = _namespace(cluster, node)
        containerd = cluster.processes.start(
            f"{node.key}-containerd",
            _in_namespace(
                holder, [str(binaries.containerd / "containerd"), "--config", str(base / "containerd.toml")]
            ),
            env=env,
        )
        _wait_for_socket(run_dir(node) / "containerd.sock", containerd.log, node)
    from localcluster.images import load_images

    load_images(cluster, binaries, nodes, with_driver=with_driver_image, reuse=reuse_images)
    for node in nodes:
        base = node_dir(cluster, node)
        holder_process = cluster.processes.get(f"{node.key}-namespace")
        assert holder_process is not None
        cluster.processes.start(
            f"{node.key}-kubelet",
            _in_namespace(
                holder_process.pid,
                [
                    str(binaries.kube / "kubelet"), f"--config={base / 'kubelet.yaml'}",
                    f"--kubeconfig={base / 'kubeconfig'}", f"--hostname-override={node.name}",
                    f"--root-dir={KUBELET_DIR}",
                    "--node-labels=" + ",".join(f"{k}={v}" for k, v in kubelet_node_labels(node).items()),
                    "--v=2",
                ],
            ),
            env=env,
        )  # fmt: skip


def wait_for_default_service_account(cluster: LocalCluster, timeout_seconds: float = 60.0) -> None:
    """Pods are refused until the controller-manager made the namespace's service account."""
    kubectl = kubectl_command(cluster)
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        got = subprocess.run(
            [*kubectl, "get", "serviceaccount", "default", "-n", "default"], capture_output=True
        )
        if got.returncode == 0:
            return
        time.sleep(0.5)
    raise ClusterError("no default service account after 60s; see logs/kube-controller-manager.log")


def _wait_for_socket(path: Path, log: str, node: NodeSpec, timeout_seconds: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if path.is_socket():
            return
        time.sleep(0.2)
    raise ClusterError(f"{node.name}: containerd did not open {path}; log: {log}")


def wait_for_nodes_ready(cluster: LocalCluster, timeout_seconds: float = 180.0) -> None:
    kubectl = kubectl_command(cluster)
    deadline = time.monotonic() + timeout_seconds
    last = ""
    while time.monotonic() < deadline:
        result = subprocess.run(
            [*kubectl, "get", "nodes", "-o", "json"], capture_output=True, text=True, check=False
        )
        if result.returncode == 0:
            items = json.loads(result.stdout)["items"]
            ready = {
                item["metadata"]["name"]
                for item in items
                for condition in item.get("status", {}).get("conditions", [])
                if condition["type"] == "Ready" and condition["status"] == "True"
            }
            if ready >= {n.name for n in cluster.nodes}:
                return
            last = f"ready: {sorted(ready)}"
        for node in cluster.nodes:
            kubelet = cluster.processes.get(f"{node.key}-kubelet")
            if kubelet is not None and not kubelet.alive():
                raise ClusterError(f"{node.name}: the kubelet exited; its log: {kubelet.log}")
        time.sleep(1)
    raise ClusterError(
        f"nodes not Ready after {timeout_seconds:.0f}s ({last}); logs in {cluster.state_dir / 'logs'}"
    )


def kubectl_command(cluster: LocalCluster) -> list[str]:
    venv_kubectl = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "kubectl"
    binary = str(venv_kubectl) if venv_kubectl.exists() else "kubectl"
    return [binary, f"--kubeconfig={cluster.kubeconfig}"]


def stop_node(cluster: LocalCluster, node: NodeSpec) -> list[str]:
    """The kubelet first, then every container of the node (so runc removes their cgroups), then
    containerd, then whatever is left in the namespace."""
    said: list[str] = []
    kubelet = cluster.processes.get(f"{node.key}-kubelet")
    if kubelet is not None:
        cluster.processes.stop(kubelet)
        said.append(f"stopped {node.name}'s kubelet")
    containerd = cluster.processes.get(f"{node.key}-containerd")
    holder = cluster.processes.get(f"{node.key}-namespace")
    socket_path = run_dir(node) / "containerd.sock"
    if containerd is not None and containerd.alive() and holder is not None and socket_path.is_socket():
        binaries = str(cluster.processes.extra.get("containerd_bin", ""))
        ctr = str(Path(binaries) / "ctr") if binaries else "ctr"
        base = [
            "nsenter",
            f"--target={holder.pid}",
            "--mount",
            "--",
            ctr,
            "-a",
            str(socket_path),
            "-n",
            "k8s.io",
        ]

        def tasks() -> list[str]:
            return subprocess.run([*base, "tasks", "ls", "-q"], capture_output=True, text=True).stdout.split()

        killed = tasks()
        for task in killed:
            subprocess.run([*base, "tasks", "kill", "-s", "SIGKILL", task], capture_output=True, check=False)
        deadline = time.monotonic() + 15
        while (left := tasks()) and time.monotonic() < deadline:
            for task in left:
                subprocess.run([*base, "tasks", "delete", "-f", task], capture_output=True, check=False)
            time.sleep(0.5)
        said.append(f"killed {len(killed)} containers of {node.name}")
    if containerd is not None:
        cluster.processes.stop(containerd)
        said.append(f"stopped {node.name}'s containerd")
    inode = dict(cluster.processes.extra.get("namespaces", {})).get(node.key)  # type: ignore[call-overload]
    if inode:
        for pid in mount_namespace_members(str(inode)):
            if holder is None or pid != holder.pid:
                os.kill(pid, 9)
                said.append(f"killed pid {pid} in {node.name}'s namespace")
    if holder is not None:
        cluster.processes.stop(holder, grace_seconds=2)
    _remove_bridge(cluster, node)
    return said


def _remove_bridge(cluster: LocalCluster, node: NodeSpec) -> None:
    subprocess.run(["ip", "link", "del", bridge_name(cluster, node)], capture_output=True, check=False)

"""``python hack/localcluster up|down|status``: the local cluster of upstream binaries (cluster.py).

up [--control-plane-only] [--no-driver]
        start it (K8S_VERSION picks the release, default 1.37.2): the control plane, two
        kubelet nodes with their containerd, then `helm install` of the driver; prints the
        admin kubeconfig's path (.cluster/kubeconfig)
down    stop everything it started and remove what it wrote (.cluster/, /run/fractional-cluster)
fleet up N [--profile P] [--cpu C] [--memory M] [--pods P]
        N fake GPU nodes kept by kwok on the running cluster, each with the ResourceSlices its
        agent would publish (fleet.py); `fleet down` removes them
nodegroup grow GROUP N [--profile P] [--max M]
        N more real kubelet nodes in node group GROUP (providerID fractional-local://GROUP/<ip>,
        label fractional.dev/node-group), started as a cloud provider would (nodegroups.py); waits
        until each is Ready with our ResourceSlices published and prints how long that took
nodegroup delete GROUP NODE...
        stop those nodes of the group and delete their Nodes
restart COMPONENT [--down SECONDS] [--signal KILL|TERM]
        a fault: kill one component (etcd, kube-apiserver, kube-scheduler,
        kube-controller-manager, node-<ip with dashes>-kubelet or -containerd), keep it down,
        start it again in place with its data and flags
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localcluster.cluster import DEFAULT_VERSION, Binaries, ClusterError, LocalCluster


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="localcluster", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up")
    up.add_argument(
        "--control-plane-only", action="store_true", help="etcd, apiserver, controller-manager, scheduler"
    )
    up.add_argument("--no-driver", action="store_true", help="nodes, but no helm install of the driver")
    sub.add_parser("down")
    sub.add_parser("reload")
    fleet = sub.add_parser("fleet")
    fleet.add_argument("action", choices=("up", "down"))
    fleet.add_argument("nodes", type=int, nargs="?", default=0, help="how many fake nodes (fleet up)")
    fleet.add_argument("--profile", default="h100-8x", help="a shipped fake profile, or a profile file")
    fleet.add_argument("--cpu", default="224", help="each node's allocatable CPU")
    fleet.add_argument("--memory", default="2000Gi", help="each node's allocatable memory")
    fleet.add_argument("--pods", default="110", help="each node's pod slots")
    groups = sub.add_parser("nodegroup")
    groups.add_argument("action", choices=("grow", "delete"))
    groups.add_argument("group")
    groups.add_argument("targets", nargs="+", help="grow: how many nodes; delete: the nodes' names")
    groups.add_argument("--profile", default="l4-2x", help="the group's fake GPU profile")
    groups.add_argument("--max", type=int, default=4, help="the group's maximum size")
    restart = sub.add_parser("restart")
    restart.add_argument("component")
    restart.add_argument("--down", type=float, default=0.0, metavar="SECONDS", help="how long it stays down")
    restart.add_argument("--signal", choices=("KILL", "TERM"), default="KILL")
    args = parser.parse_args(argv)
    version = os.environ.get("K8S_VERSION", DEFAULT_VERSION).lstrip("v")
    try:
        cluster = LocalCluster(version=version)
        if args.command == "reload":
            from localcluster.driver import reload_driver

            reload_driver(cluster, Binaries.build(cluster.version, "node"))
            print("cluster-reload: the driver runs the image just built")
            return 0
        if args.command == "fleet":
            from localcluster.fleet import FleetError, down_fleet, up_fleet

            try:
                if args.action == "down":
                    down_fleet(cluster)
                else:
                    up_fleet(cluster, args.nodes, profile=args.profile, cpu=args.cpu, memory=args.memory,
                             pods=args.pods)  # fmt: skip
            except FleetError as error:
                print(f"cluster-fleet: {error}", file=sys.stderr)
                return 1
            return 0
        if args.command == "nodegroup":
            return _nodegroup(cluster, version, args)
        if args.command == "restart":
            if cluster.processes.get(args.component) is None:
                names = ", ".join(p.name for p in cluster.processes.entries) or "none: no cluster is up"
                print(f"cluster-restart: no component {args.component!r} ({names})", file=sys.stderr)
                return 1
            signum = signal.SIGKILL if args.signal == "KILL" else signal.SIGTERM
            cluster.restart(args.component, down_seconds=args.down, signum=signum)
            print(f"cluster-restart: {args.component} down {args.down:g}s, answering again")
            return 0
        if args.command == "down":
            for line in cluster.down():
                print(f"cluster-down: {line}")
            return 0
        components = "control-plane" if args.control_plane_only else "all"
        binaries = Binaries.build(version, components)
        try:
            cluster.up_control_plane(binaries)
            if not args.control_plane_only:
                from localcluster.node import up_nodes

                up_nodes(cluster, binaries, with_driver_image=not args.no_driver)
                if not args.no_driver:
                    from localcluster.driver import install_driver

                    install_driver(cluster)
        except BaseException:
            print("cluster-up: failed; stopping what was started", file=sys.stderr)
            cluster.down()
            raise
    except ClusterError as error:
        print(f"cluster-up: {error}", file=sys.stderr)
        return 1
    print(
        f"cluster-up: Kubernetes v{version} at {cluster.apiserver_url}; {len(cluster.nodes)} nodes"
        if not args.control_plane_only
        else f"cluster-up: Kubernetes v{version} control plane at {cluster.apiserver_url}"
    )
    print(f"cluster-up: export KUBECONFIG={cluster.kubeconfig}")
    return 0


def _nodegroup(cluster: LocalCluster, version: str, args: argparse.Namespace) -> int:
    from localcluster.nodegroups import NodeGroup, NodeGroupError, NodeGroupProvider, wait_joined

    group = NodeGroup(args.group, args.profile, max_size=args.max)
    provider = NodeGroupProvider(cluster, Binaries.build(cluster.version, "node"), [group])
    try:
        if args.action == "delete":
            provider.delete_nodes(args.group, args.targets)
            print(f"cluster-nodegroup: deleted {', '.join(args.targets)} from {args.group}")
            return 0
        added = provider.increase_size(args.group, int(args.targets[0]))
        try:
            joined = wait_joined(provider, args.group, added)
        except NodeGroupError:
            provider.delete_nodes(args.group, [i.node.name for i in added])  # nothing left half-joined
            raise
        for node, seconds in sorted(joined.items()):
            print(f"cluster-nodegroup: {node} joined {args.group} with its ResourceSlices in {seconds:.1f}s")
    except NodeGroupError as error:
        print(f"cluster-nodegroup: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

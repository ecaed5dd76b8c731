"""fractional: discover, plugin, controller, plan, status, why, apiserver, demo.

The only module that reads ``os.environ``, configures logging handlers and prints.
Every flag has an environment twin ``FRACTIONAL_<FLAG>`` (e.g. ``FRACTIONAL_NODE_NAME``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

from driver.config import (
    DEFAULT_IGNORED_XIDS,
    DEFAULT_POLICY,
    ApiServerConfig,
    ControllerConfig,
    DemoConfig,
    DiscoverConfig,
    PlanConfig,
    PluginConfig,
    StatusConfig,
    WhyConfig,
    check_profile,
    env_name,
)
from driver.errors import ConfigError, FractionalError

__all__ = ["build_controller_config", "build_plugin_config", "main"]

log = logging.getLogger(__name__)

_STANDARD_RECORD_KEYS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class _JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD_RECORD_KEYS})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = {k: v for k, v in vars(record).items() if k not in _STANDARD_RECORD_KEYS}
        if extra:
            line += " " + " ".join(f"{k}={v}" for k, v in extra.items())
        return line


def _configure_logging(log_format: str, level: str) -> None:
    if log_format not in ("text", "json"):  # argparse does not check an environment default
        raise ConfigError(
            field="--log-format (FRACTIONAL_LOG_FORMAT)", problem=f"{log_format!r} is not one of text, json"
        )
    if not isinstance(logging.getLevelName(level.upper()), int):
        raise ConfigError(
            field="--log-level (FRACTIONAL_LOG_LEVEL)",
            problem=f"{level!r} is not one of debug, info, warning, error, critical",
        )
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(_JSONFormatter())
    else:
        handler.setFormatter(_TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _env(flag: str, default: Any) -> Any:
    return os.environ.get(env_name(flag), default)


def _switch(flag: str) -> Callable[[str], bool]:
    """A switch that also takes a value (``--preemption=false``), read like its env twin."""

    def parse(raw: str) -> bool:
        value = raw.strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        raise argparse.ArgumentTypeError(f"{flag}: {raw!r} is not true or false")

    return parse


def _add_backend_override(p: argparse.ArgumentParser) -> None:
    """The same switch on the agent and the controller (the chart sets both from one value)."""
    flag = "--allow-claim-backend-override"
    p.add_argument(
        flag, nargs="?", const=True, type=_switch(flag), default=_env_bool(flag, True),
        help="let a claim's own GpuConfig pick the sharing backend (sharing.backend); false: only the node's "
        "--sharing and the DeviceClass's config decide, and such a claim is refused naming the field",
    )  # fmt: skip


def _add_policy(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--policy",
        default=_env("--policy", DEFAULT_POLICY),
        help="fragmentation (the default) | best-fit | first-fit",
    )


def _env_bool(flag: str, default: bool = False) -> bool:
    raw = os.environ.get(env_name(flag))
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    # A typo must not silently turn a switch such as --leader-elect off.
    raise ConfigError(field=f"{flag} ({env_name(flag)})", problem=f"{raw!r} is not true or false")


def _env_int(flag: str, default: int | None) -> int | None:
    raw = os.environ.get(env_name(flag))
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(field=f"{flag} ({env_name(flag)})", problem=f"{raw!r} is not an integer") from None


def _env_float(flag: str, default: float) -> float:
    raw = os.environ.get(env_name(flag))
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(field=f"{flag} ({env_name(flag)})", problem=f"{raw!r} is not a number") from None


def _env_list(flag: str) -> list[str]:
    raw = os.environ.get(env_name(flag), "")
    return [part for part in raw.split(",") if part]


def _add_common(parser: argparse.ArgumentParser, *, default_level: str = "info") -> None:
    parser.add_argument(
        "--log-format", choices=("text", "json"), default=_env("--log-format", "text"),
        help="one line per event: text, or JSON with the values as fields",
    )  # fmt: skip
    parser.add_argument(
        "--log-level", default=_env("--log-level", default_level), help="debug | info | warning | error"
    )


def _add_backend_flags(
    parser: argparse.ArgumentParser,
    *,
    default_backend: str | None = "fake",
    backend_help: str = "fake | nvml",
) -> None:
    parser.add_argument("--backend", default=_env("--backend", default_backend), help=backend_help)
    parser.add_argument(
        "--profile", default=_env("--profile", None), help="fake node profile: file or shipped name"
    )
    parser.add_argument(
        "--sysfs-root",
        default=_env("--sysfs-root", "/sys"),
        help="nvml backend: where NUMA, PCIe roots and NICs are read",
    )


def _add_kubeconfig(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kubeconfig", default=_env("--kubeconfig", None),
        help="kubeconfig file; default KUBECONFIG, ~/.kube/config, or the pod's service account",
    )  # fmt: skip


def _version() -> str:
    """The installed distribution's version (pyproject.toml's), else the package's own."""
    try:
        return metadata.version("fractional-dra")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        from driver import __version__

        return __version__


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fractional", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("discover", help="print the node's inventory (or the ResourceSlices it would publish)")
    _add_backend_flags(
        p, default_backend=None,
        backend_help="fake | nvml; default: fake with --profile, else nvml when NVML answers on this machine",
    )  # fmt: skip
    p.add_argument("--node-name", default=_env("--node-name", "node-1"), help="the node the slices are for")
    p.add_argument("-o", "--output", default=_env("--output", "table"), help="table | yaml | json")
    _add_common(p)

    p = sub.add_parser("plugin", help="run the node agent (kubelet plugin + slice publisher)")
    _add_backend_flags(p)
    _add_kubeconfig(p)
    p.add_argument("--node-name", default=_env("--node-name", None), help="this node's name (required)")
    p.add_argument(
        "--registry-dir", default=_env("--registry-dir", "/var/lib/kubelet/plugins_registry"),
        help="the kubelet's plugin registry (registration socket)",
    )  # fmt: skip
    p.add_argument(
        "--plugin-dir", default=_env("--plugin-dir", "/var/lib/kubelet/plugins/fractional.dev"),
        help="the DRA socket, checkpoint and lock",
    )  # fmt: skip
    p.add_argument(
        "--cdi-root", default=_env("--cdi-root", "/var/run/cdi"), help="where CDI specs are written"
    )
    p.add_argument("--sharing", default=_env("--sharing", "none"), help="mps | hami | none")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=_env_int("--metrics-port", 8080),
        help="/metrics, /healthz, /readyz; 0: off",
    )
    p.add_argument("--metrics-host", default=_env("--metrics-host", "0.0.0.0"), help="address they listen on")
    p.add_argument("--proc-root", default=_env("--proc-root", "/proc"), help="the host's /proc")
    p.add_argument(
        "--dcgm-metrics",
        action="store_true",
        default=_env_bool("--dcgm-metrics"),
        help="also emit GPU metrics under dcgm-exporter's names",
    )
    p.add_argument("--pod-uid", default=_env("--pod-uid", None), help="enables rolling-update socket names")
    p.add_argument(
        "--socket-group",
        type=int,
        default=_env_int("--socket-group", None),
        help="gid of the kubelet sockets (mode 0660); default 0600, root only",
    )
    p.add_argument(
        "--hami-library",
        default=_env("--hami-library", None),
        help="host path of HAMi-core's libvgpu.so, mounted into HAMi shares",
    )
    p.add_argument(
        "--mps-control",
        default=_env("--mps-control", "nvidia-cuda-mps-control"),
        help="the nvidia-cuda-mps-control binary",
    )
    p.add_argument(
        "--health-file",
        default=_env("--health-file", None),
        help="fake backend: a JSON file of GPU health events (tests)",
    )
    p.add_argument(
        "--profile-node-label", default=_env("--profile-node-label", None), metavar="KEY",
        help="fake backend: the label of this Node whose value names its profile (<value>.yaml beside "
        "--profile, else a shipped profile); --profile when the Node has no such label",
    )  # fmt: skip
    p.add_argument(
        "--max-workers", type=int, default=_env_int("--max-workers", 16), help="gRPC worker threads"
    )
    p.add_argument(
        "--ignored-xids",
        default=_env("--ignored-xids", ",".join(str(x) for x in DEFAULT_IGNORED_XIDS)),
        help="comma-separated XIDs that do not make a GPU unhealthy",
    )
    p.add_argument(
        "--health-resend-seconds",
        type=float,
        default=_env_float("--health-resend-seconds", 10.0),
        help="resend the health stream's state this often",
    )
    p.add_argument(
        "--resync-seconds",
        type=float,
        default=_env_float("--resync-seconds", 30.0),
        help="republish the slices this often",
    )
    p.add_argument(
        "--withhold-claimed-gpus", nargs="?", const=True, type=_switch("--withhold-claimed-gpus"),
        default=_env_bool("--withhold-claimed-gpus", True),
        help="leave out of the ResourceSlices the GPUs also handed out by NVIDIA's device plugin (the Node "
        "advertises nvidia.com/gpu) or another DRA driver (same UUID); false: publish them and only warn",
    )  # fmt: skip
    _add_backend_override(p)
    _add_common(p)

    p = sub.add_parser("controller", help="run the allocation controller")
    _add_kubeconfig(p)
    _add_policy(p)
    p.add_argument(
        "--leader-elect",
        action="store_true",
        default=_env_bool("--leader-elect"),
        help="take a Lease before acting (two replicas or more)",
    )
    p.add_argument(
        "--lease-name", default=_env("--lease-name", "fractional-dra-controller"), help="the Lease's name"
    )
    p.add_argument(
        "--lease-namespace", default=_env("--lease-namespace", "default"), help="the Lease's namespace"
    )
    p.add_argument(
        "--identity",
        default=_env("--identity", os.environ.get("HOSTNAME", "")),
        help="this replica's holder identity (default: the hostname)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=_env_int("--metrics-port", 8081),
        help="/metrics and /healthz; 0: off",
    )
    p.add_argument("--metrics-host", default=_env("--metrics-host", "0.0.0.0"), help="address they listen on")
    p.add_argument(
        "--provisioning-requests", action="store_true", default=_env_bool("--provisioning-requests"),
        help="publish scale-up hints as autoscaling.x-k8s.io/v1 ProvisioningRequests",
    )  # fmt: skip
    p.add_argument(
        "--provisioning-class",
        default=_env("--provisioning-class", "best-effort-atomic-scale-up.autoscaling.x-k8s.io"),
        help="their provisioningClassName",
    )
    p.add_argument(
        "--provisioning-retry-seconds", type=float, default=_env_float("--provisioning-retry-seconds", 30.0),
        help="after a gang's request ended (Failed, BookingExpired): ask again this long after, doubling",
    )  # fmt: skip
    p.add_argument(
        "--provisioning-max-retry-seconds", type=float,
        default=_env_float("--provisioning-max-retry-seconds", 600.0), help="the longest of those waits",
    )  # fmt: skip
    p.add_argument(
        "--kueue-admission-check", action="store_true", default=_env_bool("--kueue-admission-check"),
        help="answer Kueue AdmissionChecks whose controllerName is fractional.dev/placement",
    )  # fmt: skip
    p.add_argument(
        "--hint-profile",
        action="append",
        default=None,  # flags replace FRACTIONAL_HINT_PROFILE (comma-separated) rather than add to it
        help="node profile (file or shipped name) for scale-up hints; repeatable",
    )
    p.add_argument(
        "--topology-label",
        default=_env("--topology-label", "topology.kubernetes.io/zone"),
        help="node label grouping nodes for gang placement",
    )
    p.add_argument(
        "--preemption", nargs="?", const=True, type=_switch("--preemption"),
        default=_env_bool("--preemption", True),
        help="evict lower-priority pods for a gated gang with a PriorityClass that does not fit",
    )  # fmt: skip
    p.add_argument(
        "--consolidation", nargs="?", const=True, type=_switch("--consolidation"),
        default=_env_bool("--consolidation", False),
        help="move running pods that opted in (label fractional.dev/movable=true on the pod, its namespace "
        "or its DeviceClass) so that a gated gang fits when no preemption serves it; off by default",
    )  # fmt: skip
    p.add_argument(
        "--consolidation-min-runtime", type=float, default=_env_float("--consolidation-min-runtime", 600.0),
        help="seconds a pod must have run before consolidation may move it",
    )  # fmt: skip
    p.add_argument(
        "--consolidation-cooldown", type=float, default=_env_float("--consolidation-cooldown", 1800.0),
        help="seconds after a move during which no other pod of the same owner is moved",
    )  # fmt: skip
    p.add_argument(
        "--consolidation-max-moves", type=int, default=_env_int("--consolidation-max-moves", 16),
        help="most pods one consolidation plan moves",
    )  # fmt: skip
    p.add_argument(
        "--consolidation-search-ms", type=float, default=_env_float("--consolidation-search-ms", 250.0),
        help="time budget of one plan search in milliseconds (also at most 64 allocator fit checks)",
    )  # fmt: skip
    p.add_argument(
        "--consolidation-retry", type=float, default=_env_float("--consolidation-retry", 30.0),
        help="seconds before a gang that consolidation could not serve (no plan, a refused move) is tried "
        "again; doubling, up to 600",
    )  # fmt: skip
    p.add_argument(
        "--consolidation-schedule", nargs="?", const=True, type=_switch("--consolidation-schedule"),
        default=_env_bool("--consolidation-schedule", False),
        help="with --consolidation: also a scheduled pass that frees a whole GPU by moving its shares beside "
        "others, when stranded GPU memory reaches --consolidation-schedule-stranded-ratio",
    )  # fmt: skip
    p.add_argument(
        "--consolidation-schedule-window", default=_env("--consolidation-schedule-window", ""),
        help="when the scheduled pass may run, HH:MM-HH:MM in UTC (e.g. 01:00-05:00); empty: any time",
    )  # fmt: skip
    p.add_argument(
        "--consolidation-schedule-stranded-ratio", type=float,
        default=_env_float("--consolidation-schedule-stranded-ratio", 0.25),
        help="free GPU memory stranded on partly used GPUs, as a share of all GPU memory, that starts "
        "the scheduled pass",
    )  # fmt: skip
    p.add_argument(
        "--consolidation-schedule-max-moves-per-gpu", type=int,
        default=_env_int("--consolidation-schedule-max-moves-per-gpu", 1),
        help="most pods the scheduled pass moves to free one GPU (a GPU holding more is left as it is)",
    )  # fmt: skip
    p.add_argument(
        "--consolidation-schedule-interval", type=float,
        default=_env_float("--consolidation-schedule-interval", 300.0),
        help="seconds between two scheduled passes",
    )  # fmt: skip
    p.add_argument(
        "--gang-sources", default=_env("--gang-sources", "auto"),
        help="where gangs are read from: comma list of podgroup, workload, fractional, coscheduling, kueue, "
        "lws, volcano (or upstream, markers, all); auto: upstream, ours and the markers the cluster serves",
    )  # fmt: skip
    p.add_argument(
        "--allocation-guard-port", type=int, default=_env_int("--allocation-guard-port", 0),
        help="serve the allocation guard (the validating webhook that refuses an allocation another "
        "allocator writes past a device's capacity) over HTTPS on this port, on --metrics-host; 0: off",
    )  # fmt: skip
    p.add_argument(
        "--allocation-guard-cert-dir",
        default=_env("--allocation-guard-cert-dir", "/etc/fractional/allocation-guard"),
        help="its serving certificate and key: tls.crt and tls.key in this directory",
    )
    p.add_argument(
        "--allocation-guard-service", default=_env("--allocation-guard-service", ""),
        help="the webhook's Service (in --lease-namespace): while leading, point its EndpointSlice "
        "<service>-leader at --allocation-guard-address",
    )  # fmt: skip
    p.add_argument(
        "--allocation-guard-address", default=_env("--allocation-guard-address", ""),
        help="this replica's address for that EndpointSlice (the pod IP)",
    )  # fmt: skip
    p.add_argument(
        "--kube-api-qps", type=float, default=_env_float("--kube-api-qps", 50.0),
        help="requests per second to kube-apiserver, every thread of the process together (a token "
        "bucket, as kube-scheduler's --kube-api-qps); 0: no limit",
    )  # fmt: skip
    p.add_argument(
        "--kube-api-burst", type=int, default=_env_int("--kube-api-burst", 100),
        help="requests that may go at once before --kube-api-qps paces them (the bucket's size)",
    )  # fmt: skip
    _add_backend_override(p)
    _add_common(p)

    p = sub.add_parser("plan", help="how many nodes of a profile a set of claims/gangs needs")
    p.add_argument(
        "--profile", default=_env("--profile", None), required=env_name("--profile") not in os.environ,
        help="the node profile to count in: file or shipped name (h100-8x, a100-pcie-4x, l4-2x)",
    )  # fmt: skip
    p.add_argument(
        "--claims", default=_env("--claims", None), required=env_name("--claims") not in os.environ,
        help="YAML: a gangs document, or ResourceClaims/templates with the workloads that use them",
    )  # fmt: skip
    _add_policy(p)
    p.add_argument("-o", "--output", default=_env("--output", "table"), help="table | yaml | json")
    p.add_argument(
        "--kueue", action="store_true", default=_env_bool("--kueue"),
        help="also print what Kueue v0.19 charges each gang (deviceClassMappings of docs/kueue.md)",
    )  # fmt: skip
    _add_common(p)

    p = sub.add_parser("apiserver", help="run the embedded API emulator on 127.0.0.1 (a test double)")
    p.add_argument("--port", type=int, default=_env_int("--port", 0), help="0: a free port")
    p.add_argument(
        "--write-kubeconfig",
        default=_env("--write-kubeconfig", None),
        help="write a kubeconfig for this API here",
    )
    p.add_argument("--write-delay-ms", type=int, default=_env_int("--write-delay-ms", 0),
                   help="added to every write, as etcd would (e.g. 10)")  # fmt: skip
    p.add_argument("--kubernetes-version", default=_env("--kubernetes-version", "1.37"),
                   help="the release emulated: 1.35 | 1.36 | 1.37 (its gang API versions)")  # fmt: skip
    _add_common(p)

    p = sub.add_parser("demo", help="the whole system on one machine: no cluster, no GPU")
    p.add_argument("--scenario", default=_env("--scenario", "full"), help="full | small")
    p.add_argument(
        "--keep-running",
        action="store_true",
        default=_env_bool("--keep-running"),
        help="leave the API up afterwards and print its kubeconfig",
    )
    p.add_argument(
        "--output-dir", default=_env("--output-dir", "demo-output"), help="where the demo writes its picture"
    )
    p.add_argument("--write-delay-ms", type=int, default=_env_int("--write-delay-ms", 0),
                   help="the embedded API adds it to every write, as etcd would")  # fmt: skip
    _add_common(p, default_level="warning")  # the demo talks through its progress lines

    p = sub.add_parser("status", help="the cluster's GPUs: shares, memory and compute allocated, which pods")
    _add_kubeconfig(p)
    p.add_argument("-n", "--namespace", default=_env("--namespace", None), help="claims of one namespace")
    p.add_argument("--watch", action="store_true", default=_env_bool("--watch"), help="redraw until Ctrl-C")
    p.add_argument("--interval", type=float, default=_env_float("--interval", 2.0), help="seconds")
    _add_common(p, default_level="warning")

    p = sub.add_parser("why", help="why a pod is still gated or pending")
    p.add_argument("pod", metavar="NAMESPACE/POD")
    _add_kubeconfig(p)
    _add_policy(p)
    _add_common(p, default_level="warning")
    return parser


def _stop_event_on_signals() -> threading.Event:
    stop = threading.Event()

    def _handler(signum: int, _frame: object) -> None:
        log.info("signal received, stopping", extra={"signal": signal.Signals(signum).name})
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    return stop


def _discover_backend(backend: str | None, profile: str | None) -> str:
    """``--backend`` as given; else fake with a ``--profile``, else nvml when NVML answers here."""
    if backend:
        return backend
    if profile:
        return "fake"
    from driver.inventory.discover import probe_nvml
    from driver.inventory.fake import list_profiles

    problem = probe_nvml()
    if problem is None:
        return "nvml"
    raise ConfigError(
        field="--backend (FRACTIONAL_BACKEND)",
        problem=f"no NVML on this machine ({problem}); pass --profile NAME for fake devices: "
        f"{', '.join(list_profiles())} (or a profile file)",
    )


def _run_discover(args: argparse.Namespace) -> int:
    from driver.inventory.discover import discover_inventory, render_inventory_table
    from driver.slices import build_resource_slices, render_slices

    config = DiscoverConfig(
        backend=_discover_backend(args.backend, args.profile),
        profile=args.profile,
        sysfs_root=args.sysfs_root,
        node_name=args.node_name,
        output=args.output,
    )
    if config.backend == "fake":
        check_profile(config.profile)
    inventory = discover_inventory(
        backend=config.backend,
        profile=config.profile,
        sysfs_root=config.sysfs_root,
        node_name=config.node_name,
    )
    if config.output == "table":
        print(render_inventory_table(inventory))
    else:
        print(render_slices(build_resource_slices(inventory), config.output))
    return 0


def _parse_xids(raw: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in raw.split(",") if part.strip())
    except ValueError:
        raise ConfigError(
            field="--ignored-xids (FRACTIONAL_IGNORED_XIDS)", problem=f"{raw!r} is not a list of integers"
        ) from None


def build_plugin_config(args: argparse.Namespace) -> PluginConfig:
    """``fractional plugin``'s flags (and their FRACTIONAL_* twins) as its configuration."""
    return PluginConfig(
        node_name=args.node_name or "",
        backend=args.backend,
        profile=args.profile,
        sysfs_root=args.sysfs_root,
        registry_dir=args.registry_dir,
        plugin_dir=args.plugin_dir,
        cdi_root=args.cdi_root,
        sharing=args.sharing,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        proc_root=args.proc_root,
        dcgm_metrics=args.dcgm_metrics,
        kubeconfig=args.kubeconfig,
        pod_uid=args.pod_uid or None,
        socket_group=args.socket_group,
        hami_library=args.hami_library,
        mps_control=args.mps_control,
        health_file=args.health_file,
        profile_node_label=args.profile_node_label or None,
        max_workers=args.max_workers,
        ignored_xids=_parse_xids(args.ignored_xids),
        health_resend_seconds=args.health_resend_seconds,
        resync_seconds=args.resync_seconds,
        withhold_claimed_gpus=args.withhold_claimed_gpus,
        allow_claim_backend_override=args.allow_claim_backend_override,
    )


def build_controller_config(args: argparse.Namespace) -> ControllerConfig:
    """``fractional controller``'s flags (and their FRACTIONAL_* twins) as its configuration."""
    return ControllerConfig(
        kubeconfig=args.kubeconfig,
        policy=args.policy,
        leader_elect=args.leader_elect,
        lease_name=args.lease_name,
        lease_namespace=args.lease_namespace,
        identity=args.identity,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        provisioning_requests=args.provisioning_requests,
        provisioning_class=args.provisioning_class,
        provisioning_retry_seconds=args.provisioning_retry_seconds,
        provisioning_max_retry_seconds=args.provisioning_max_retry_seconds,
        kueue_admission_check=args.kueue_admission_check,
        hint_profiles=tuple(args.hint_profile or _env_list("--hint-profile")),
        topology_label=args.topology_label,
        preemption=args.preemption,
        consolidation=args.consolidation,
        consolidation_min_runtime_seconds=args.consolidation_min_runtime,
        consolidation_cooldown_seconds=args.consolidation_cooldown,
        consolidation_max_moves=args.consolidation_max_moves,
        consolidation_search_ms=args.consolidation_search_ms,
        consolidation_retry_seconds=args.consolidation_retry,
        consolidation_schedule=args.consolidation_schedule,
        consolidation_schedule_window=args.consolidation_schedule_window,
        consolidation_schedule_stranded_ratio=args.consolidation_schedule_stranded_ratio,
        consolidation_schedule_max_moves_per_gpu=args.consolidation_schedule_max_moves_per_gpu,
        consolidation_schedule_interval_seconds=args.consolidation_schedule_interval,
        gang_sources=args.gang_sources,
        allow_claim_backend_override=args.allow_claim_backend_override,
        allocation_guard_port=args.allocation_guard_port,
        allocation_guard_cert_dir=args.allocation_guard_cert_dir,
        allocation_guard_service=args.allocation_guard_service,
        allocation_guard_address=args.allocation_guard_address,
        kube_api_qps=args.kube_api_qps,
        kube_api_burst=args.kube_api_burst,
    )


def _run_plugin(args: argparse.Namespace) -> int:
    from driver.plugin.agent import run_agent

    config = build_plugin_config(args)
    if config.backend == "fake":
        check_profile(config.profile)
    return run_agent(config, _stop_event_on_signals())


def _run_controller(args: argparse.Namespace) -> int:
    from driver.controller import run_controller

    return run_controller(build_controller_config(args), _stop_event_on_signals())


def _run_plan(args: argparse.Namespace) -> int:
    from driver.controller.diagnosis.plan import run_plan

    config = PlanConfig(
        profile=args.profile, claims=args.claims, policy=args.policy, output=args.output, kueue=args.kueue
    )
    check_profile(config.profile)
    print(run_plan(config))
    return 0


def _require_demo_extra(command: str) -> None:
    """The embedded cluster and the demo need the ``demo`` extra; the product image leaves it out."""
    import importlib.util

    extra = ("kubernetes_validate", "matplotlib")
    missing = [name for name in extra if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            field=command,
            problem=f"needs the demo extra ({', '.join(missing)} not installed): "
            "pip install 'fractional-dra[demo]'",
        )


def _run_apiserver(args: argparse.Namespace) -> int:
    _require_demo_extra("apiserver")
    from driver.cluster.apiserver import APIServer

    config = ApiServerConfig(
        port=args.port,
        write_kubeconfig=args.write_kubeconfig,
        write_delay_ms=args.write_delay_ms,
        kubernetes_version=args.kubernetes_version,
    )
    stop = _stop_event_on_signals()
    server = APIServer(
        host=config.host,
        port=config.port,
        write_delay_ms=config.write_delay_ms,
        kubernetes_version=config.kubernetes_version,
    )
    server.start()
    try:
        print(f"embedded API serving on {server.url}", flush=True)
        if config.write_kubeconfig:
            server.write_kubeconfig(config.write_kubeconfig)
            print(f"kubeconfig written to {config.write_kubeconfig}", flush=True)
        stop.wait()
    finally:
        server.stop()
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    _require_demo_extra("demo")
    from driver.demo import run_demo

    config = DemoConfig(
        scenario=args.scenario, keep_running=args.keep_running, output_dir=args.output_dir,
        write_delay_ms=args.write_delay_ms,
    )  # fmt: skip
    return run_demo(config, _stop_event_on_signals(), out=sys.stdout)


def _run_status(args: argparse.Namespace) -> int:
    from driver.status import run_status

    config = StatusConfig(
        kubeconfig=args.kubeconfig, namespace=args.namespace, watch=args.watch, interval_seconds=args.interval
    )
    return run_status(config, _stop_event_on_signals(), out=sys.stdout)


def _run_why(args: argparse.Namespace) -> int:
    from driver.why import run_why

    for line in run_why(WhyConfig(pod=args.pod, kubeconfig=args.kubeconfig, policy=args.policy)):
        print(line)
    return 0


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "discover": _run_discover,
    "plugin": _run_plugin,
    "controller": _run_controller,
    "plan": _run_plan,
    "apiserver": _run_apiserver,
    "demo": _run_demo,
    "status": _run_status,
    "why": _run_why,
}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = _build_parser()
        args = parser.parse_args(argv)
        _configure_logging(args.log_format, args.log_level)
        return _COMMANDS[args.command](args)
    except BrokenPipeError:
        # The reader went away (`fractional plan ... | head`): nothing more to say, and no
        # traceback. Python's own advice: point stdout at devnull so its flush at exit is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except ConfigError as error:
        print(f"fractional: configuration error: {error}", file=sys.stderr)
        return 2
    except FractionalError as error:
        print(f"fractional: {error}", file=sys.stderr)
        return 1

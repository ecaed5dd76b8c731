"""One frozen configuration dataclass per command, built by ``cli.py`` and passed down.

``__post_init__`` raises ``ConfigError`` naming the flag and its environment twin.
Nothing below ``cli.py`` reads ``os.environ``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from driver.errors import ConfigError
from driver.gang_sources import parse_gang_sources

__all__ = [
    "DEFAULT_POLICY",
    "check_profile",
    "ApiServerConfig",
    "ControllerConfig",
    "DemoConfig",
    "DiscoverConfig",
    "PlanConfig",
    "PluginConfig",
    "StatusConfig",
    "WhyConfig",
    "env_name",
]

BACKENDS = ("fake", "nvml")
SHARING_BACKENDS = ("mps", "hami", "none")
POLICIES = ("fragmentation", "best-fit", "first-fit")
# The controller's placement policy unless --policy says otherwise (docs/architecture.md, Packing).
DEFAULT_POLICY = "fragmentation"
DEFAULT_IGNORED_XIDS = (13, 31, 43, 45, 68, 109)


def env_name(flag: str) -> str:
    """``--node-name`` -> ``FRACTIONAL_NODE_NAME``."""
    return "FRACTIONAL_" + flag.lstrip("-").replace("-", "_").upper()


def parse_window(text: str) -> tuple[int, int] | None:
    """ "HH:MM-HH:MM" (UTC) as minutes of the day; "" for any time. ValueError naming the problem."""
    if not text.strip():
        return None
    try:
        start, end = (part.strip() for part in text.split("-"))
        minutes = []
        for part in (start, end):
            hours, mins = part.split(":")
            if not (hours.isdigit() and mins.isdigit() and int(hours) < 24 and int(mins) < 60):
                raise ValueError
            minutes.append(int(hours) * 60 + int(mins))
    except ValueError:
        raise ValueError(f"{text!r} is not HH:MM-HH:MM (UTC), e.g. 01:00-05:00") from None
    if minutes[0] == minutes[1]:
        raise ValueError(f"{text!r} is an empty window (leave it empty for any time)")
    return minutes[0], minutes[1]


def _check_choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(
            field=f"{flag} ({env_name(flag)})", problem=f"{value!r} is not one of {', '.join(choices)}"
        )


def _check_positive(flag: str, value: float) -> None:
    if not value > 0:  # also rejects NaN
        raise ConfigError(field=f"{flag} ({env_name(flag)})", problem=f"{value} is not a positive number")


def _check_write_delay(flag: str, value: int) -> None:
    if not 0 <= value <= 60_000:
        raise ConfigError(field=f"{flag} ({env_name(flag)})", problem=f"{value} is outside 0..60000 ms")


def _check_port(flag: str, value: int) -> None:
    if not 0 <= value <= 65535:
        raise ConfigError(field=f"{flag} ({env_name(flag)})", problem=f"{value} is outside 0..65535")


_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _check_label_key(flag: str, value: str) -> None:
    """A Kubernetes label key: ``[prefix/]name``, the prefix a DNS subdomain of at most 253."""
    prefix, slash, name = value.rpartition("/")
    bad_prefix = bool(slash) and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix))
    if not _LABEL_NAME.fullmatch(name) or bad_prefix:
        raise ConfigError(
            field=f"{flag} ({env_name(flag)})",
            problem=f"{value!r} is not a label key ([prefix/]name, e.g. fractional.dev/fake-profile)",
        )


def check_profile(profile: str | None) -> None:
    """A --profile that names no file and no shipped profile is a configuration error (exit 2).
    Called where the command runs (the file may exist only there, e.g. in the agent's container)."""
    if not profile:
        return
    from driver.errors import InventoryError
    from driver.inventory.fake import resolve_profile

    try:
        resolve_profile(profile)
    except InventoryError as error:
        raise ConfigError(field="--profile (FRACTIONAL_PROFILE)", problem=error.problem) from error


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscoverConfig:
    backend: str = "fake"
    profile: str | None = None  # a file, or the name of a profile shipped in fake_devices/
    sysfs_root: str = "/sys"
    node_name: str = "node-1"
    output: str = "table"

    def __post_init__(self) -> None:
        _check_choice("--backend", self.backend, BACKENDS)
        _check_choice("--output", self.output, ("table", "yaml", "json"))
        if self.backend == "fake" and not self.profile:
            raise ConfigError(field="--profile (FRACTIONAL_PROFILE)", problem="required with --backend fake")


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginConfig:
    node_name: str
    backend: str = "fake"
    profile: str | None = None
    sysfs_root: str = "/sys"
    registry_dir: str = "/var/lib/kubelet/plugins_registry"
    plugin_dir: str = "/var/lib/kubelet/plugins/fractional.dev"
    cdi_root: str = "/var/run/cdi"
    sharing: str = "none"
    metrics_port: int = 8080  # /metrics, /healthz, /readyz; 0 = off
    metrics_host: str = "0.0.0.0"
    kubeconfig: str | None = None
    pod_uid: str | None = None  # rolling updates: per-pod socket names and a file lock
    socket_group: int | None = None  # sockets 0660 with this gid, else 0600
    hami_library: str | None = None  # host path of libvgpu.so
    mps_control: str = "nvidia-cuda-mps-control"
    health_file: str | None = None  # fake backend: a JSON file the tests write
    ignored_xids: tuple[int, ...] = DEFAULT_IGNORED_XIDS
    health_resend_seconds: float = 10.0
    resync_seconds: float = 30.0
    max_workers: int = 16
    cdi_spec_check: bool = True  # real GPUs: warn when no nvidia.com/gpu CDI spec exists
    proc_root: str = "/proc"  # the host's /proc: GPU processes -> pods (per-share memory used)
    dcgm_metrics: bool = False  # also emit GPU figures under dcgm-exporter's names and labels
    # fake backend: a label of the agent's own Node whose value names the profile to use
    # (``<value>.yaml`` beside the --profile file, else a shipped profile); --profile without it
    profile_node_label: str | None = None
    # leave out of the slices the GPUs also handed out by NVIDIA's device plugin (the Node advertises
    # nvidia.com/gpu) or published by another DRA driver (same UUID); detected and reported either way
    withhold_claimed_gpus: bool = True
    # a claim's own GpuConfig may pick the sharing backend; false: refused at prepare, naming the field
    allow_claim_backend_override: bool = True

    def __post_init__(self) -> None:
        if not self.node_name:
            raise ConfigError(field="--node-name (FRACTIONAL_NODE_NAME)", problem="required")
        _check_choice("--backend", self.backend, BACKENDS)
        _check_choice("--sharing", self.sharing, SHARING_BACKENDS)
        _check_port("--metrics-port", self.metrics_port)
        if self.backend == "fake" and not self.profile:
            raise ConfigError(field="--profile (FRACTIONAL_PROFILE)", problem="required with --backend fake")
        if self.profile_node_label is not None:
            _check_label_key("--profile-node-label", self.profile_node_label)
            if self.backend != "fake":
                raise ConfigError(
                    field="--profile-node-label (FRACTIONAL_PROFILE_NODE_LABEL)",
                    problem=f"only with --backend fake (the backend is {self.backend!r})",
                )
        if self.max_workers < 2:
            raise ConfigError(field="--max-workers (FRACTIONAL_MAX_WORKERS)", problem="must be at least 2")
        _check_positive("--health-resend-seconds", self.health_resend_seconds)
        _check_positive("--resync-seconds", self.resync_seconds)


@dataclass(frozen=True, slots=True, kw_only=True)
class ControllerConfig:
    kubeconfig: str | None = None
    policy: str = DEFAULT_POLICY
    leader_elect: bool = False
    lease_name: str = "fractional-dra-controller"
    lease_namespace: str = "default"
    identity: str = ""
    lease_duration_seconds: float = 15.0
    renew_deadline_seconds: float = 10.0
    retry_period_seconds: float = 2.0
    metrics_port: int = 8081
    metrics_host: str = "0.0.0.0"
    provisioning_requests: bool = False
    provisioning_class: str = "best-effort-atomic-scale-up.autoscaling.x-k8s.io"
    provisioning_retry_seconds: float = 30.0  # after a gang's request ended; doubling
    provisioning_max_retry_seconds: float = 600.0
    kueue_admission_check: bool = False  # serve the Kueue AdmissionCheck fractional.dev/placement
    hint_profiles: tuple[str, ...] = ()  # profile files/names for scale-up hints; empty = all shipped
    topology_label: str = "topology.kubernetes.io/zone"
    preemption: bool = True  # evict lower-priority pods for a gang that does not fit
    # Move pods that opted in so that a gang fits when no preemption serves it (off by default).
    consolidation: bool = False
    consolidation_min_runtime_seconds: float = 600.0
    consolidation_cooldown_seconds: float = 1800.0
    consolidation_max_moves: int = 16
    consolidation_search_ms: float = 250.0
    consolidation_retry_seconds: float = 30.0  # after no plan or a refused move; doubling to 600
    # The scheduled pass: free a GPU when stranded memory reaches the ratio, in the UTC window.
    consolidation_schedule: bool = False
    consolidation_schedule_window: str = ""  # "HH:MM-HH:MM" UTC; empty: any time
    consolidation_schedule_stranded_ratio: float = 0.25
    consolidation_schedule_max_moves_per_gpu: int = 1  # a GPU holding more pods is not emptied
    consolidation_schedule_interval_seconds: float = 300.0
    gang_sources: str = "auto"  # comma list (driver.gang_sources); auto: upstream, ours, markers
    allow_claim_backend_override: bool = True  # false: a claim naming its own backend is not allocated
    # The allocation guard (driver/controller/guard): the webhook kube-apiserver calls before it stores
    # an allocation another allocator wrote. Port 0: off. It listens on metrics_host.
    allocation_guard_port: int = 0
    allocation_guard_cert_dir: str = "/etc/fractional/allocation-guard"  # tls.crt and tls.key
    allocation_guard_service: str = ""  # the webhook's Service: the leader writes its EndpointSlice
    allocation_guard_address: str = ""  # this replica's address in that EndpointSlice (the pod IP)
    # Client-side rate limit of every request to kube-apiserver, the whole process together
    # (driver/kube/ratelimit.py; kube-scheduler's --kube-api-qps and --kube-api-burst and their
    # defaults). A qps of 0 or less: no limit.
    kube_api_qps: float = 50.0
    kube_api_burst: int = 100

    def __post_init__(self) -> None:
        _check_choice("--policy", self.policy, POLICIES)
        if not math.isfinite(self.kube_api_qps):
            raise ConfigError(
                field="--kube-api-qps (FRACTIONAL_KUBE_API_QPS)",
                problem=f"{self.kube_api_qps} is not a finite number (0: no limit)",
            )
        if self.kube_api_qps > 0 and self.kube_api_burst < 1:
            raise ConfigError(
                field="--kube-api-burst (FRACTIONAL_KUBE_API_BURST)",
                problem=f"{self.kube_api_burst} is less than 1 (with --kube-api-qps {self.kube_api_qps:g}, "
                "no request could ever be sent)",
            )
        _check_port("--metrics-port", self.metrics_port)
        _check_port("--allocation-guard-port", self.allocation_guard_port)
        for flag, value in (
            ("--consolidation-min-runtime", self.consolidation_min_runtime_seconds),
            ("--consolidation-cooldown", self.consolidation_cooldown_seconds),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(
                    field=f"{flag} ({env_name(flag)})",
                    problem=f"{value} is not a number of seconds, 0 or more",
                )
        _check_positive("--consolidation-max-moves", self.consolidation_max_moves)
        _check_positive("--consolidation-search-ms", self.consolidation_search_ms)
        _check_positive("--consolidation-retry", self.consolidation_retry_seconds)
        _check_positive("--consolidation-schedule-interval", self.consolidation_schedule_interval_seconds)
        _check_positive(
            "--consolidation-schedule-max-moves-per-gpu", self.consolidation_schedule_max_moves_per_gpu
        )
        if not 0 < self.consolidation_schedule_stranded_ratio <= 1:
            flag = "--consolidation-schedule-stranded-ratio"
            raise ConfigError(
                field=f"{flag} ({env_name(flag)})",
                problem=f"{self.consolidation_schedule_stranded_ratio} is not a share in (0, 1]",
            )
        try:
            parse_window(self.consolidation_schedule_window)
        except ValueError as error:
            raise ConfigError(
                field=f"--consolidation-schedule-window ({env_name('--consolidation-schedule-window')})",
                problem=str(error),
            ) from None
        if self.allocation_guard_port and self.allocation_guard_port == self.metrics_port:
            raise ConfigError(
                field="--allocation-guard-port (FRACTIONAL_ALLOCATION_GUARD_PORT)",
                problem=f"{self.allocation_guard_port} is --metrics-port too",
            )
        if self.allocation_guard_port and self.allocation_guard_service and not self.allocation_guard_address:
            raise ConfigError(
                field="--allocation-guard-address (FRACTIONAL_ALLOCATION_GUARD_ADDRESS)",
                problem="required with --allocation-guard-service (the pod IP the Service points at)",
            )
        parse_gang_sources(self.gang_sources)  # raises ConfigError naming the flag
        if self.leader_elect and not self.identity:
            raise ConfigError(
                field="--identity (FRACTIONAL_IDENTITY)", problem="required with --leader-elect"
            )
        # client-go's rules: the leader must give up (renew deadline) before a candidate may take
        # over (lease duration), and must get several renewal tries within its deadline.
        for name, value in (
            ("lease_duration_seconds", self.lease_duration_seconds),
            ("renew_deadline_seconds", self.renew_deadline_seconds),
            ("retry_period_seconds", self.retry_period_seconds),
        ):
            if not value > 0:
                raise ConfigError(
                    field=f"ControllerConfig.{name}", problem=f"{value} is not a positive number"
                )
        if not self.renew_deadline_seconds < self.lease_duration_seconds:
            raise ConfigError(
                field="ControllerConfig.renew_deadline_seconds",
                problem=f"{self.renew_deadline_seconds} must be less than lease_duration_seconds "
                f"({self.lease_duration_seconds})",
            )
        if not self.retry_period_seconds < self.renew_deadline_seconds:
            raise ConfigError(
                field="ControllerConfig.retry_period_seconds",
                problem=f"{self.retry_period_seconds} must be less than renew_deadline_seconds "
                f"({self.renew_deadline_seconds})",
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanConfig:
    profile: str
    claims: str
    policy: str = DEFAULT_POLICY
    output: str = "table"
    kueue: bool = False  # also print what Kueue charges per claim and what a node counts

    def __post_init__(self) -> None:
        _check_choice("--policy", self.policy, POLICIES)
        _check_choice("--output", self.output, ("table", "yaml", "json"))


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    write_kubeconfig: str | None = None
    write_delay_ms: int = 0  # added to every write, as etcd would
    kubernetes_version: str = "1.37"  # the release emulated: its Workload/PodGroup versions and pod schema

    def __post_init__(self) -> None:
        _check_port("--port", self.port)
        _check_write_delay("--write-delay-ms", self.write_delay_ms)
        _check_choice("--kubernetes-version", self.kubernetes_version, ("1.35", "1.36", "1.37"))


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoConfig:
    scenario: str = "full"  # "full" or "small" (tests)
    keep_running: bool = False
    output_dir: str = "demo-output"
    write_delay_ms: int = 0  # the embedded API adds it to every write, as etcd would

    def __post_init__(self) -> None:
        _check_choice("--scenario", self.scenario, ("full", "small"))
        _check_write_delay("--write-delay-ms", self.write_delay_ms)


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusConfig:
    kubeconfig: str | None = None
    namespace: str | None = None  # claims of one namespace; None = all
    watch: bool = False
    interval_seconds: float = 2.0

    def __post_init__(self) -> None:
        _check_positive("--interval", self.interval_seconds)


@dataclass(frozen=True, slots=True, kw_only=True)
class WhyConfig:
    pod: str  # "namespace/name"
    kubeconfig: str | None = None
    policy: str = DEFAULT_POLICY

    def __post_init__(self) -> None:
        namespace, _, name = self.pod.partition("/")
        if not namespace or not name or "/" in name:
            raise ConfigError(field="NAMESPACE/POD", problem=f"{self.pod!r} is not namespace/name")
        _check_choice("--policy", self.policy, POLICIES)

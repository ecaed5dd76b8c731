"""The node agent: inventory, slices, the kubelet plugin sockets, probes, and a clean shutdown.

Start-up order (``NodeAgent.start``):
 0. fake backend: choose the profile (``choose_fake_profile``). With ``--profile-node-label KEY`` the
    API client is loaded first and the agent's own Node read: its label KEY names the profile
    (``<value>.yaml`` in the directory of the ``--profile`` file, else a shipped profile), no such
    label means ``--profile``. A Node that does not exist yet (the kubelet registers it) is read
    again every second, logged once, for at most ``NODE_WAIT_SECONDS``; a stop meanwhile ends
    ``start`` without serving. A value that names no profile is a ``ConfigError`` (exit 2). One
    log line says which profile was chosen and why;
 1. discover the inventory; build the sharing backends; ``DeviceState`` restores what the
    checkpoint says is prepared (re-acquire shares, re-create missing CDI files); then MPS control
    daemons that no restored share needs (left by a crash mid-prepare) are stopped. With real GPUs
    (nvml) the agent checks once that the NVIDIA toolkit's ``nvidia.com/gpu`` CDI spec exists in
    ``/etc/cdi``, ``/var/run/cdi`` or ``--cdi-root`` and logs a warning when it does not (prepared
    claims name ``nvidia.com/gpu=<uuid>``, which the runtime could not resolve);
 2. DRA server (v1 + v1beta1 [+ health]) on ``<plugin-dir>/dra[-<podUID>].sock``: bound under a
    hidden name, 0600 (0660 with ``--socket-group``), then renamed over a stale file
    (``driver.plugin.server``); the plugin dir is 0750;
 3. registration server on ``<registry-dir>/fractional.dev[-<podUID>]-reg.sock``, last, because the
    kubelet calls the DRA socket as soon as it has registered us;
 4. the API client: the ``kubernetes`` package is imported only now (about 1 s and 25 MiB), so
    the kubelet can register the plugin meanwhile; a Prepare arriving before it is ready waits
    for it. A bad kubeconfig still fails ``start`` (exit 2), after the sockets are removed again;
 5. the ``slice-publisher`` thread (with the coexistence check, ``driver.plugin.coexistence``:
    GPUs also handed out by NVIDIA's device plugin or another DRA driver) and the health monitor;
    the ``probe-http`` thread on ``--metrics-port`` (``/metrics``, ``/healthz``, ``/readyz``;
    0 = off); the ``claim-status`` thread that writes ``status.devices`` (``driver.plugin.status``).

Health: the monitor's ``on_change`` stores the new taints and asks the publisher for an immediate
publish (``SlicePublisher.request_sync``; its loop notices within a quarter second) and wakes the
v1alpha1 health streams, so a change does not wait for the periodic resync.

Shutdown (``stop``): the registration server goes first (its socket disappears, the kubelet
deregisters us), then the DRA server with a grace period for in-flight calls; threads are joined,
sharing backends closed. Each socket is unlinked only while it still is the one this agent bound: a
second agent with the same socket names (no pod UID) that started meanwhile keeps its sockets.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import grpc

from driver.config import PluginConfig
from driver.errors import ConfigError, FractionalError, NotFoundError
from driver.inventory.discover import discover_inventory
from driver.inventory.fake import PROFILE_DIR, list_profiles, resolve_profile
from driver.inventory.model import NodeInventory
from driver.plugin.cdi import NVIDIA_TOOLKIT_KIND, STANDARD_SPEC_DIRS, ensure_cdi_root, find_spec_for_kind
from driver.plugin.checkpoint import BOOT_ID_PATH, read_boot_id
from driver.plugin.claims import ClaimReader
from driver.plugin.devices import PrepareSettings
from driver.plugin.dra_service import ClaimFetcher, ClaimSource, add_dra_services
from driver.plugin.gpu_metrics import GPU_METRICS, GpuMetricsSource
from driver.plugin.health import HealthMonitor, build_health_taints
from driver.plugin.health_service import HealthStreamer
from driver.plugin.memory import limit_malloc_arenas
from driver.plugin.metrics import HEALTH_CHANGES_TOTAL
from driver.plugin.proto_gen import (
    dra_health_v1alpha1_pb2_grpc,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    pluginregistration_pb2,
    pluginregistration_pb2_grpc,
)
from driver.plugin.registration import RegistrationServicer, RegistrationStatus, SocketPaths, socket_paths
from driver.plugin.server import UnixSocket, build_grpc_server, listen_unix, remove_socket
from driver.plugin.sharing.base import DeviceNode, SharingBackend
from driver.plugin.sharing.factory import build_sharing_backends
from driver.plugin.sharing.mps import MpsBackend
from driver.plugin.state import DeviceState, EffectHook
from driver.plugin.status import ClaimStatusWriter
from driver.plugin.usage import PodIndex, RecordingClaimSource, learn_reserved_pods
from driver.probes import ProbeServer
from driver.slices import Taints

if TYPE_CHECKING:
    from kubernetes import client

    from driver.publisher import SlicePublisher

__all__ = [
    "NodeAgent",
    "ProfileChoice",
    "check_toolkit_cdi_spec",
    "choose_fake_profile",
    "read_node_labels",
    "run_agent",
]

log = logging.getLogger(__name__)

STOP_GRACE_SECONDS = 5.0
PROBE_TIMEOUT_SECONDS = 1.0
REGISTRATION_WORKERS = 2
NODE_RETRY_SECONDS = 1.0  # --profile-node-label: one GET of the Node a second while it is missing
NODE_WAIT_SECONDS = 300.0  # ... and no longer: a Node that never appears is a wrong --node-name

_PROFILE_LABEL_FLAG = "--profile-node-label (FRACTIONAL_PROFILE_NODE_LABEL)"
_PROFILE_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")  # a label value, never a path


def rdma_device_nodes(sysfs_root: str | Path, inventory: NodeInventory) -> dict[str, tuple[DeviceNode, ...]]:
    """RDMA device -> its ``/dev/infiniband/uverbsN`` node(s), from ``<sysfs>/class/infiniband``."""
    nodes: dict[str, tuple[DeviceNode, ...]] = {}
    for nic in inventory.nics:
        if not nic.rdma_device:
            continue
        verbs = Path(sysfs_root) / "class" / "infiniband" / nic.rdma_device / "device" / "infiniband_verbs"
        try:
            names = sorted(entry.name for entry in verbs.iterdir() if entry.name.startswith("uverbs"))
        except OSError:
            continue
        nodes[nic.rdma_device] = tuple(DeviceNode(path=f"/dev/infiniband/{name}") for name in names)
    return nodes


def check_toolkit_cdi_spec(directories: Sequence[str | Path]) -> Path | None:
    """Start-up check with real GPUs: the NVIDIA toolkit's ``nvidia.com/gpu`` CDI spec, which every
    prepared GPU names (``nvidia.com/gpu=<uuid>``), should exist in one of ``directories``.
    Logs one line (a warning when it is missing: containers of prepared claims would not start)
    and returns the spec found; never fails the start (the spec may be generated later)."""
    searched = [str(directory) for directory in dict.fromkeys(str(d) for d in directories)]
    found = find_spec_for_kind(searched, NVIDIA_TOOLKIT_KIND)
    if found is None:
        log.warning(
            "no nvidia.com/gpu CDI spec found: containers using prepared GPUs will fail to start until "
            "one exists; generate it with 'nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml' "
            "or enable CDI in the GPU operator",
            extra={"searched": searched, "kind": NVIDIA_TOOLKIT_KIND},
        )
    else:
        log.info("nvidia.com/gpu CDI spec found", extra={"path": str(found)})
    return found


@dataclass(frozen=True, slots=True)
class ProfileChoice:
    """The fake profile the agent loads and why: ``reason`` is ``--profile`` (no
    ``--profile-node-label``), ``node has no label`` or ``node label`` (``label_value`` names it)."""

    path: Path
    reason: str
    label_value: str | None = None


def choose_fake_profile(
    *, profile: str, label: str | None, labels: Mapping[str, str], node: str
) -> ProfileChoice:
    """The profile of a fake node (pure but for looking at files): with ``label`` set and present
    in the Node's ``labels``, ``<value>.yaml`` in the directory of the ``profile`` file, else the
    shipped profile ``<value>``; otherwise ``profile`` (a file or a shipped name).

    Raises ``ConfigError`` naming the node, the label, the value and the known names when the
    value names no profile, ``InventoryError`` when ``profile`` itself names none."""
    default = resolve_profile(profile)
    if label is None:
        return ProfileChoice(path=default, reason="--profile")
    value = labels.get(label)
    if value is None:
        return ProfileChoice(path=default, reason="node has no label")
    directory = default.parent
    if _PROFILE_NAME.fullmatch(value):
        for candidate in (directory / f"{value}.yaml", PROFILE_DIR / f"{value}.yaml"):
            if candidate.is_file():
                return ProfileChoice(path=candidate, reason="node label", label_value=value)
    known = sorted({path.stem for path in directory.glob("*.yaml") if path.is_file()} | set(list_profiles()))
    raise ConfigError(
        field=_PROFILE_LABEL_FLAG,
        problem=f"Node {node!r} has label {label}={value!r}, which names no profile: neither "
        f"{directory}/{value}.yaml nor a shipped profile of that name exists "
        f"(known: {', '.join(known) or 'none'})",
    )


def read_node_labels(
    configuration: client.Configuration,
    node: str,
    stop: threading.Event,
    *,
    retry_seconds: float | None = None,
    timeout_seconds: float | None = None,
) -> dict[str, str] | None:
    """The labels of Node ``node``; None when ``stop`` is set first.

    While the Node does not exist yet (the kubelet registers it) or cannot be read (the API not
    up, RBAC not bound yet), it is read again every ``retry_seconds`` (``NODE_RETRY_SECONDS``),
    logged once, for at most ``timeout_seconds`` (``NODE_WAIT_SECONDS``); then a Node still
    missing is a ``ConfigError`` naming ``--node-name``, another failure is raised as it is."""
    from driver.kube.client import get_json, new_api_client
    from driver.kube.errors import api_errors

    retry = NODE_RETRY_SECONDS if retry_seconds is None else retry_seconds
    timeout = NODE_WAIT_SECONDS if timeout_seconds is None else timeout_seconds
    deadline = time.monotonic() + timeout
    waited = False
    with new_api_client(configuration) as api_client:
        while not stop.is_set():
            try:
                with api_errors(f"get Node {node}"):
                    found = get_json(api_client, f"/api/v1/nodes/{node}", what=f"get Node {node}")
            except FractionalError as error:
                if not waited:
                    waited = True
                    log.log(
                        logging.INFO if isinstance(error, NotFoundError) else logging.WARNING,
                        "waiting for the Node: its labels choose the fake profile",
                        extra={"node": node, "error": str(error), "retry_seconds": retry},
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if isinstance(error, NotFoundError):
                        raise ConfigError(
                            field="--node-name (FRACTIONAL_NODE_NAME)",
                            problem=f"no Node {node!r} appeared within {timeout:g} s "
                            f"(--profile-node-label reads its labels)",
                        ) from error
                    raise
                stop.wait(min(retry, remaining))
                continue
            if waited:
                log.info("node found", extra={"node": node})
            labels = (found.get("metadata") or {}).get("labels") or {}
            return {str(key): str(value) for key, value in labels.items()}
    return None


def _open_nvml() -> ModuleType:
    import pynvml

    pynvml.nvmlInit()
    module: ModuleType = pynvml
    return module


class NodeAgent:
    """One node's agent, in-process (tests, the demo) or behind ``fractional plugin``.

    ``kube_configuration``: the API to use (default: from ``config.kubeconfig``). ``claims``:
    replaces the API read of claims (benchmarks). ``effect_hook``: see ``DeviceState``.
    ``publish_slices=False`` skips the slice publisher (tests of the kubelet side only).
    ``write_claim_status``: write ``status.devices`` after prepare; default: as ``publish_slices``
    (an agent that publishes nothing, in tests of the kubelet side and benchmarks, reads claims
    but writes nothing to the API). ``stop_event``: the event that stops the agent's threads and
    ends a wait in ``start`` (``fractional plugin`` passes its SIGTERM event); default: its own.
    """

    def __init__(
        self,
        config: PluginConfig,
        *,
        kube_configuration: client.Configuration | None = None,
        inventory: NodeInventory | None = None,
        claims: ClaimSource | None = None,
        boot_id_path: str | Path = BOOT_ID_PATH,
        effect_hook: EffectHook | None = None,
        publish_slices: bool = True,
        write_claim_status: bool | None = None,
        stop_event: threading.Event | None = None,
    ) -> None:
        self.config = config
        self.paths: SocketPaths = socket_paths(
            registry_dir=config.registry_dir, plugin_dir=config.plugin_dir, pod_uid=config.pod_uid
        )
        self.registration = RegistrationStatus()
        self.stop_event = threading.Event() if stop_event is None else stop_event
        self._kube_configuration = kube_configuration
        self._inventory = inventory
        self._claims = claims
        self._boot_id_path = boot_id_path
        self._effect_hook = effect_hook
        self._publish_slices = publish_slices
        self._write_claim_status = publish_slices if write_claim_status is None else write_claim_status
        self._status_writer: ClaimStatusWriter | None = None
        self._nvml: ModuleType | None = None
        self._backends: dict[str, SharingBackend] = {}
        self._dra_server: grpc.Server | None = None
        self._claim_fetcher: ClaimFetcher | None = None
        self._registration_server: grpc.Server | None = None
        self._dra_socket: UnixSocket | None = None  # the sockets this agent bound (and only those
        self._registration_socket: UnixSocket | None = None  # it removes: another may have replaced them)
        self._probe: ProbeServer | None = None
        self._publisher: SlicePublisher | None = None
        self._health: HealthMonitor | None = None
        self._streamer: HealthStreamer | None = None
        self._threads: list[threading.Thread] = []
        self._taints: Taints | None = None
        self._taints_lock = threading.Lock()
        self.slices_published = threading.Event()
        self.serving = threading.Event()
        self.state: DeviceState | None = None
        self.gpu_metrics: GpuMetricsSource | None = None  # GPU and per-share series

    # -- start ---------------------------------------------------------------------------------

    @property
    def inventory(self) -> NodeInventory:
        if self._inventory is None:
            raise FractionalError("the agent has not discovered its inventory yet")
        return self._inventory

    @property
    def http_port(self) -> int | None:
        return self._probe.port if self._probe is not None else None

    def start(self) -> None:
        """Everything up to a serving registration socket; raises (after cleaning up) on failure.
        Returns without serving when the stop event is set while it waits for the Node
        (``--profile-node-label``)."""
        try:
            self._start()
        except BaseException:
            self.stop(grace=0)
            raise

    def _start(self) -> None:
        config = self.config
        started = time.perf_counter()
        if self._inventory is None:
            profile = config.profile
            if config.backend == "fake":
                choice = self._choose_fake_profile()
                if choice is None:
                    return  # stopped while waiting for the Node
                profile = str(choice.path)
            self._inventory = discover_inventory(
                backend=config.backend,
                profile=profile,
                sysfs_root=config.sysfs_root,
                node_name=config.node_name,
            )
        inventory = self._inventory
        if config.backend == "nvml":
            self._nvml = _open_nvml()
        self._backends = build_sharing_backends(config, nvml=self._nvml)
        plugin_dir = Path(config.plugin_dir)
        plugin_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(plugin_dir, 0o750)
        ensure_cdi_root(config.cdi_root)  # 0755 whatever the umask
        settings = PrepareSettings(
            default_backend=config.sharing,
            allow_claim_backend_override=config.allow_claim_backend_override,
            backends=self._backends,
            pool_name=inventory.node_name,
            toolkit_cdi=inventory.backend == "nvml",
            rdma_device_nodes=rdma_device_nodes(config.sysfs_root, inventory)
            if inventory.backend == "nvml"
            else {},
        )
        self.state = DeviceState(
            inventory=inventory,
            settings=settings,
            cdi_root=config.cdi_root,
            plugin_dir=plugin_dir,
            boot_id=read_boot_id(self._boot_id_path),
            rolling_update=bool(config.pod_uid),
            effect_hook=self._effect_hook,
        )
        restored = self.state.restore()
        self._stop_unused_mps_daemons()
        if inventory.backend == "nvml" and config.cdi_spec_check:
            check_toolkit_cdi_spec([*STANDARD_SPEC_DIRS, config.cdi_root])
        reader = ClaimReader() if self._claims is None else None
        claims: ClaimSource = reader if reader is not None else self._claims  # type: ignore[assignment]
        self.gpu_metrics = _build_gpu_metrics(config, inventory, self._nvml, self.state)
        claims = RecordingClaimSource(claims, self.gpu_metrics.pods)

        self._health = HealthMonitor(
            inventory,
            on_change=self._on_health_change,
            stop=self.stop_event,
            nvml=self._nvml,
            health_file=config.health_file,
            ignored_xids=config.ignored_xids,
        )
        self._streamer = HealthStreamer(
            pool=inventory.node_name,
            snapshot=self._health.snapshot,
            resend_seconds=config.health_resend_seconds,
        )

        if self._write_claim_status:
            self._status_writer = ClaimStatusWriter(
                node=inventory.node_name, nics={nic.name: nic for nic in inventory.nics}
            )
            self._status_writer.start()  # waits for connect(); prepares meanwhile only enqueue
        dra = build_grpc_server(max_workers=config.max_workers)
        self._claim_fetcher = add_dra_services(
            dra, state=self.state, claims=claims, status=self._status_writer
        )
        dra_health_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server(  # type: ignore[no-untyped-call]
            self._streamer, dra
        )
        self._dra_socket = listen_unix(
            dra, self.paths.dra, flag="--plugin-dir (FRACTIONAL_PLUGIN_DIR)", group=config.socket_group
        )
        dra.start()
        self._dra_server = dra

        registration = build_grpc_server(max_workers=REGISTRATION_WORKERS)
        pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(  # type: ignore[no-untyped-call]
            RegistrationServicer(endpoint=self.paths.dra, status=self.registration), registration
        )
        self._registration_socket = listen_unix(
            registration,
            self.paths.registration,
            flag="--registry-dir (FRACTIONAL_REGISTRY_DIR)",
            group=config.socket_group,
        )
        registration.start()
        self._registration_server = registration
        self.serving.set()
        log.info(
            "kubelet plugin serving",
            extra={
                "registration_socket": str(self.paths.registration),
                "dra_socket": str(self.paths.dra),
                "restored_claims": restored,
                "startup_seconds": round(time.perf_counter() - started, 3),
            },
        )

        needs_api = reader is not None or self._publish_slices or self._status_writer is not None
        if needs_api:
            self._load_configuration()
        if reader is not None:
            reader.connect(self._require_configuration())
        if self._status_writer is not None:
            self._status_writer.connect(self._require_configuration())
        prepared = self.state.prepared_claims()
        if prepared:  # restored claims: learn their pods for the per-share series
            thread = threading.Thread(
                target=learn_reserved_pods,
                args=(claims, prepared, self.stop_event),
                name="pod-index",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)

        self._health.start()
        if self._publish_slices:
            from driver.plugin.coexistence import CoexistenceMonitor
            from driver.publisher import SlicePublisher

            self._publisher = SlicePublisher(
                self._require_configuration(),
                inventory.node_name,
                resync_seconds=config.resync_seconds,
                # the device plugin, another DRA driver (driver.plugin.coexistence); the publisher closes it
                coexistence=CoexistenceMonitor(
                    self._require_configuration(), inventory.node_name, withhold=config.withhold_claimed_gpus
                ),
            )
            thread = threading.Thread(target=self._run_publisher, name="slice-publisher", daemon=True)
            thread.start()
            self._threads.append(thread)
        if config.metrics_port:
            self._probe = ProbeServer(
                host=config.metrics_host,
                port=config.metrics_port,
                checks={"/healthz": self.check_liveness, "/readyz": self.check_readiness},
            )
            self._probe.start()

    def _choose_fake_profile(self) -> ProfileChoice | None:
        """The profile to load (None: stopped while waiting for the Node), logged in one line."""
        config = self.config
        assert config.profile is not None  # PluginConfig requires it with --backend fake
        labels: dict[str, str] = {}
        if config.profile_node_label is not None:
            read = read_node_labels(self._load_configuration(), config.node_name, self.stop_event)
            if read is None:
                return None
            labels = read
        choice = choose_fake_profile(
            profile=config.profile, label=config.profile_node_label, labels=labels, node=config.node_name
        )
        log.info(
            "fake profile chosen",
            extra={
                "node": config.node_name,
                "profile": str(choice.path),
                "reason": choice.reason,
                "label": config.profile_node_label,
                "label_value": choice.label_value,
            },
        )
        return choice

    def _load_configuration(self) -> client.Configuration:
        """The cluster configuration, loaded the usual way (``--kubeconfig``, ``KUBECONFIG``,
        in-cluster) the first time the agent needs the API."""
        if self._kube_configuration is None:
            from driver.kube.client import load_configuration

            self._kube_configuration = load_configuration(self.config.kubeconfig)
        return self._kube_configuration

    def _require_configuration(self) -> client.Configuration:
        if self._kube_configuration is None:
            raise ConfigError(
                field="--kubeconfig (FRACTIONAL_KUBECONFIG)", problem="no cluster configuration"
            )
        return self._kube_configuration

    # -- start-up checks ------------------------------------------------------------------------

    def _stop_unused_mps_daemons(self) -> None:
        """After the restore: an MPS daemon no restored share needs (an agent killed between
        starting it and completing the prepare) would hold its GPU in EXCLUSIVE_PROCESS mode."""
        mps = self._backends.get("mps")
        if not isinstance(mps, MpsBackend):
            return
        stopped = mps.stop_unused_daemons()
        if stopped:
            log.info("unused mps daemons stopped", extra={"gpu_uuids": list(stopped)})

    # -- slices and health ---------------------------------------------------------------------

    def _inventory_source(self) -> tuple[NodeInventory, Taints | None]:
        with self._taints_lock:
            return self.inventory, self._taints

    def _run_publisher(self) -> None:
        publisher = self._publisher
        assert publisher is not None
        try:
            publisher.publish(*self._inventory_source())
            self.slices_published.set()
            log.info("resource slices published", extra={"node": self.config.node_name})
        except FractionalError as error:  # transient or refused (403 before RBAC is bound): the loop retries
            log.warning(
                "first slice publish failed", extra={"node": self.config.node_name, "error": str(error)}
            )
        except Exception:  # a bug must not end the thread either: logged once, the loop retries
            log.exception("first slice publish failed unexpectedly", extra={"node": self.config.node_name})
        publisher.run(
            self.stop_event, self._inventory_source, on_published=lambda _: self.slices_published.set()
        )

    def _on_health_change(self, snapshot: Any) -> None:
        HEALTH_CHANGES_TOTAL.inc()
        if self.gpu_metrics is not None:
            self.gpu_metrics.xids.observe(snapshot)
        taints = build_health_taints(snapshot)
        with self._taints_lock:
            self._taints = taints or None
        if self._streamer is not None:
            self._streamer.notify()
        if self._publisher is not None:
            self._publisher.request_sync()

    # -- probes --------------------------------------------------------------------------------

    def check_liveness(self) -> tuple[bool, str]:
        """Both sockets answer: GetInfo on the registration socket, an empty Prepare on the DRA socket."""
        try:
            with grpc.insecure_channel(f"unix://{self.paths.registration}") as channel:
                pluginregistration_pb2_grpc.RegistrationStub(channel).GetInfo(  # type: ignore[no-untyped-call]
                    pluginregistration_pb2.InfoRequest(), timeout=PROBE_TIMEOUT_SECONDS
                )
            with grpc.insecure_channel(f"unix://{self.paths.dra}") as channel:
                dra_v1_pb2_grpc.DRAPluginStub(channel).NodePrepareResources(  # type: ignore[no-untyped-call]
                    dra_v1_pb2.NodePrepareResourcesRequest(), timeout=PROBE_TIMEOUT_SECONDS
                )
        except grpc.RpcError as error:
            return False, f"gRPC probe failed: {error}"
        return True, "registration and DRA sockets answer"

    def check_readiness(self) -> tuple[bool, str]:
        if self.registration.registered.is_set():
            return True, "registered with the kubelet"
        if self.serving.is_set() and (self.slices_published.is_set() or not self._publish_slices):
            return True, "serving; slices published"
        return False, "not registered, and not yet serving with published slices"

    # -- stop ----------------------------------------------------------------------------------

    @staticmethod
    def _remove_own_socket(socket: UnixSocket | None) -> None:
        """Unlink a socket this agent bound, unless another agent's socket took its place."""
        if socket is not None:
            remove_socket(socket)

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """Idempotent: deregister, drain, join, unlink, close."""
        self.stop_event.set()
        self.serving.clear()
        if self._streamer is not None:
            self._streamer.close()  # ends the health streams, which would hold the DRA server's stop
        if self._registration_server is not None:
            self._registration_server.stop(0).wait()
            self._registration_server = None
        self._registration_socket = self._remove_own_socket(self._registration_socket)
        if self._dra_server is not None:
            self._dra_server.stop(grace).wait()
            self._dra_server = None
        self._dra_socket = self._remove_own_socket(self._dra_socket)
        if self._claim_fetcher is not None:
            self._claim_fetcher.close()
            self._claim_fetcher = None
        if self._status_writer is not None:  # after the DRA server: nothing enqueues any more
            self._status_writer.close(timeout=grace + 5.0)
            self._status_writer = None
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        if self.gpu_metrics is not None:
            GPU_METRICS.remove_source(self.gpu_metrics)
        if self._health is not None:
            self._health.join()
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        for backend in self._backends.values():
            backend.close()
        self._backends = {}
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None
        log.info("node agent stopped", extra={"node": self.config.node_name})


def _build_gpu_metrics(
    config: PluginConfig, inventory: NodeInventory, nvml: ModuleType | None, state: DeviceState
) -> GpuMetricsSource:
    """The agent's GPU and per-share series: NVML on real GPUs, the fake backend's stand-in else."""
    if nvml is None:
        from driver.inventory.fake_nvml import FakeNVML

        source_nvml: Any = FakeNVML(inventory)
    else:
        source_nvml = nvml
    source = GpuMetricsSource(
        inventory=inventory,
        nvml=source_nvml,
        prepared_claims=state.prepared_claims,
        pods=PodIndex(),
        proc_root=config.proc_root,
        dcgm_names=config.dcgm_metrics,
    )
    GPU_METRICS.add_source(source)
    return source


def run_agent(config: PluginConfig, stop: threading.Event) -> int:
    """``fractional plugin``: run until ``stop`` (SIGTERM/SIGINT), then shut down cleanly; 0."""
    limit_malloc_arenas()
    agent = NodeAgent(config, stop_event=stop)  # SIGTERM also ends a wait for the Node in start
    agent.start()
    try:
        stop.wait()
    finally:
        agent.stop()
    return 0

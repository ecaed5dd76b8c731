"""A kubelet simulator: the kubelet's side of plugin registration and DRA calls, over real sockets.

A test double for tests and the demo (no kubelet runs here). It does what the kubelet's plugin
manager does (kubernetes ``pkg/kubelet/pluginmanager/`` and ``pkg/kubelet/cm/dra/plugin/``): find
the registration socket in the registry directory, ``GetInfo`` with a 1 s timeout, pick the DRA
service version as the given kubelet version would, ``NotifyRegistrationStatus``; then
``prepare``/``unprepare`` with the kubelet's 45 s deadline on the chosen version, and
``watch_health`` on the v1alpha1 stream.

``NodeStatusReporter`` is the kubelet's other half towards the API: its node status manager and
node lease controller (``pkg/kubelet/kubelet_node_status.go``, ``pkg/kubelet/nodelease``). It posts
the Node's conditions (``Ready`` True, the pressure conditions False), ``nodeInfo`` and addresses,
and renews the Node's Lease in ``kube-node-lease``, every ``heartbeat_seconds``; so ``kubectl get
nodes`` shows STATUS Ready and a VERSION.

    kubelet = KubeletSimulator(registry_dir, kubelet_version="1.35")
    kubelet.register()
    answer = kubelet.prepare([{"namespace": "ns", "name": "c", "uid": "..."}])
    # -> {"<uid>": {"error": "", "devices": [{"request_names": [...], "pool_name": ..., "device_name": ...,
    #                                          "cdi_device_ids": [...], "share_id": ... or None}]}}
"""

from __future__ import annotations

import datetime
import logging
import platform
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc
from kubernetes import client

from driver.errors import FractionalError, NotFoundError, TransientError
from driver.kube import REQUEST_TIMEOUT_SECONDS, api_errors, as_dict, new_api_client
from driver.kube.client import get_json
from driver.kube.transport import JsonSender
from driver.plugin.proto_gen import (
    dra_health_v1alpha1_pb2,
    dra_health_v1alpha1_pb2_grpc,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    pluginregistration_pb2,
    pluginregistration_pb2_grpc,
)

__all__ = [
    "HostFacts",
    "KubeletSimulator",
    "NodeStatusReporter",
    "Registration",
    "RegistrationRefused",
    "build_node_lease",
    "build_node_status",
    "choose_service",
    "kubelet_git_version",
    "pod_status",
    "read_host_facts",
]

log = logging.getLogger(__name__)

GET_INFO_TIMEOUT_SECONDS = 1.0
NOTIFY_TIMEOUT_SECONDS = 5.0
CALL_TIMEOUT_SECONDS = 45.0  # defaultClientCallTimeout
DRA_PLUGIN_TYPE = "DRAPlugin"
HEALTH_SERVICE = "v1alpha1.DRAResourceHealth"

HEARTBEAT_SECONDS = 10.0  # nodeStatusUpdateFrequency, and the node lease's renew interval
NODE_LEASE_NAMESPACE = "kube-node-lease"
NODE_LEASE_DURATION_SECONDS = 40  # the kubelet's nodeLeaseDurationSeconds
# The four conditions a kubelet posts, in its order: (type, status, reason, message).
_NODE_CONDITIONS = (
    ("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
    ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
    ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
    ("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
)
_GOARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}

_SERVICES = {
    "v1.DRAPlugin": (dra_v1_pb2, dra_v1_pb2_grpc),
    "v1beta1.DRAPlugin": (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc),
}


def pod_status(pod: Mapping[str, Any], *, started: bool, now: str, node_ip: str = "") -> dict[str, Any]:
    """The status the kubelet reports for a pod it has admitted: ``Running`` with the conditions
    ``kubectl wait --for=condition=Ready`` reads (PodReadyToStartContainers, Initialized, Ready,
    ContainersReady, PodScheduled) and one running, ready status per container; or, when
    ``started`` is false (preparing its resources failed: the kubelet tries again), ``Pending`` with
    Ready ``False`` and every container waiting in ContainerCreating."""
    spec = pod.get("spec") or {}
    ready = "True" if started else "False"
    reason = {} if started else {"reason": "ContainersNotReady"}
    conditions = [
        {"type": "PodReadyToStartContainers", "status": ready, "lastTransitionTime": now},
        {"type": "Initialized", "status": "True", "lastTransitionTime": now},
        {"type": "Ready", "status": ready, "lastTransitionTime": now, **reason},
        {"type": "ContainersReady", "status": ready, "lastTransitionTime": now, **reason},
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
    ]
    state: dict[str, Any] = (
        {"running": {"startedAt": now}} if started else {"waiting": {"reason": "ContainerCreating"}}
    )
    containers = [
        {"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": started, "started": started,
         "restartCount": 0, "state": state}
        for c in spec.get("containers") or []
    ]  # fmt: skip
    status: dict[str, Any] = {
        "phase": "Running" if started else "Pending",
        "conditions": conditions,
        "containerStatuses": containers,
        "startTime": now,
    }
    if node_ip:
        status["hostIP"] = node_ip
        status["hostIPs"] = [{"ip": node_ip}]
    return status


def kubelet_git_version(kubelet_version: str) -> str:
    """``nodeInfo.kubeletVersion`` of a simulated kubelet of ``kubelet_version``: ``"1.35"`` ->
    ``"v1.35.0-fractional-simulator"`` (a real kubelet's shape, marked as this double's the way the
    emulator marks its own ``gitVersion``)."""
    return f"v1.{_minor(kubelet_version)}.0-fractional-simulator"


@dataclass(frozen=True, slots=True)
class HostFacts:
    """What a kubelet reads from its machine for ``nodeInfo``."""

    kernel_version: str
    os_image: str
    operating_system: str  # GOOS: linux
    architecture: str  # GOARCH: amd64, arm64


def read_host_facts() -> HostFacts:
    """This machine's kernel, OS image (``PRETTY_NAME`` of os-release), OS and architecture."""
    try:
        os_image = platform.freedesktop_os_release().get("PRETTY_NAME") or "unknown"
    except OSError:
        os_image = "unknown"
    machine = platform.machine().lower()
    return HostFacts(
        kernel_version=platform.release(),
        os_image=os_image,
        operating_system=platform.system().lower(),
        architecture=_GOARCH.get(machine, machine),
    )


def build_node_status(
    node: Mapping[str, Any],
    *,
    kubelet_version: str,
    facts: HostFacts,
    boot_id: str,
    node_ip: str,
    now: str,
) -> dict[str, Any]:
    """The status a kubelet posts for ``node``: its capacity and allocatable as they are, the four
    conditions (heartbeat ``now``; a transition time kept while a condition's status is unchanged),
    ``InternalIP`` and ``Hostname`` addresses and ``nodeInfo``. The machine and system IDs follow
    from the node's name, so a restarted simulator keeps them; ``boot_id`` is new per start."""
    status = dict(node.get("status") or {})
    before = {condition.get("type"): condition for condition in status.get("conditions") or ()}
    conditions = []
    for kind, value, reason, message in _NODE_CONDITIONS:
        previous = before.get(kind) or {}
        since = previous.get("lastTransitionTime") if previous.get("status") == value else None
        conditions.append(
            {
                "type": kind,
                "status": value,
                "lastHeartbeatTime": now,
                "lastTransitionTime": since or now,
                "reason": reason,
                "message": message,
            }
        )
    name = node["metadata"]["name"]
    identity = uuid.uuid5(uuid.NAMESPACE_DNS, f"{name}.nodes.fractional.dev")
    status["conditions"] = conditions
    status["addresses"] = [{"type": "InternalIP", "address": node_ip}, {"type": "Hostname", "address": name}]
    status["nodeInfo"] = {
        "machineID": identity.hex,
        "systemUUID": str(identity),
        "bootID": boot_id,
        "kernelVersion": facts.kernel_version,
        "osImage": facts.os_image,
        "containerRuntimeVersion": "simulated://none",  # no runtime: the demo's binder stands in
        "kubeletVersion": kubelet_git_version(kubelet_version),
        "kubeProxyVersion": "",  # not reported since 1.31 (DisableNodeKubeProxyVersion)
        "operatingSystem": facts.operating_system,
        "architecture": facts.architecture,
    }
    return status


def build_node_lease(
    node: Mapping[str, Any], *, renew_time: str, previous: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The Node's Lease in ``kube-node-lease`` (the kubelet's heartbeat since 1.17), renewed at
    ``renew_time`` (a MicroTime); owned by the Node, as the kubelet makes it."""
    name = node["metadata"]["name"]
    lease: dict[str, Any] = dict(previous) if previous else {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": name,
            "namespace": NODE_LEASE_NAMESPACE,
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node["metadata"]["uid"]}
            ],
        },
    }  # fmt: skip
    lease["spec"] = {
        **(lease.get("spec") or {}),
        "holderIdentity": name,
        "leaseDurationSeconds": NODE_LEASE_DURATION_SECONDS,
        "renewTime": renew_time,
    }
    return lease


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class NodeStatusReporter:
    """One simulated kubelet's heartbeat: ``start()`` posts the Node's status and renews its Lease
    once (the node is Ready when it returns), then again every ``heartbeat_seconds`` on a named
    thread until ``stop()``. A failed round is logged and retried at the next beat."""

    def __init__(
        self,
        configuration: client.Configuration,
        node_name: str,
        *,
        kubelet_version: str = "1.35",
        node_ip: str = "127.0.0.1",
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
        clock: Callable[[], datetime.datetime] = _utc_now,
        facts: HostFacts | None = None,
    ) -> None:
        _minor(kubelet_version)
        self.node_name = node_name
        self._configuration = configuration
        self._kubelet_version = kubelet_version
        self._node_ip = node_ip
        self._heartbeat_seconds = heartbeat_seconds
        self._clock = clock
        self._facts = facts or read_host_facts()
        self._boot_id = str(uuid.uuid4())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        api_client = new_api_client(self._configuration)
        try:
            self.report_once(api_client)
        except BaseException:
            api_client.close()  # type: ignore[no-untyped-call]  # the client ships no hints
            raise
        # the first round ran here; the thread owns the client from now on
        self._thread = threading.Thread(
            target=self._run, args=(api_client,), name=f"kubelet-status-{self.node_name}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(REQUEST_TIMEOUT_SECONDS)
            self._thread = None

    def report_once(self, api_client: client.ApiClient) -> None:
        core = client.CoreV1Api(api_client)
        now = self._clock()
        with api_errors(f"get Node {self.node_name}"):
            node = as_dict(core.read_node(self.node_name, _request_timeout=REQUEST_TIMEOUT_SECONDS))
        status = build_node_status(
            node,
            kubelet_version=self._kubelet_version,
            facts=self._facts,
            boot_id=self._boot_id,
            node_ip=self._node_ip,
            now=now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        with api_errors(f"update status of Node {self.node_name}"):
            core.replace_node_status(
                self.node_name,
                cast(Any, {**node, "status": status}),
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            )
        self._renew_lease(api_client, node, now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"))

    def _renew_lease(self, api_client: client.ApiClient, node: dict[str, Any], renew_time: str) -> None:
        """Read and write the Lease as JSON: the typed client would turn its MicroTimes into
        datetimes and back with isoformat(), dropping a zero microsecond part, which
        kube-apiserver refuses."""
        what = f"Lease {NODE_LEASE_NAMESPACE}/{self.node_name}"
        sender = JsonSender(api_client)
        leases = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        params = {"namespace": NODE_LEASE_NAMESPACE, "name": self.node_name}
        try:
            try:
                previous = get_json(api_client, (leases + "/{name}").format(**params), what=f"get {what}")
            except NotFoundError:
                lease = build_node_lease(node, renew_time=renew_time)
                sender.send_json("POST", leases, params, lease, what=f"create {what}")
                return
            lease = build_node_lease(node, renew_time=renew_time, previous=previous)
            sender.send_json("PUT", leases + "/{name}", params, lease, what=f"renew {what}")
        finally:
            sender.close()

    def _run(self, api_client: client.ApiClient) -> None:
        try:
            while not self._stop.wait(self._heartbeat_seconds):
                try:
                    self.report_once(api_client)
                except (TransientError, NotFoundError) as error:  # a conflict, the API away, the Node deleted
                    log.warning(
                        "node status not posted", extra={"node": self.node_name, "reason": str(error)}
                    )
        finally:
            api_client.close()  # type: ignore[no-untyped-call]  # the client ships no hints


class RegistrationRefused(FractionalError):
    """The simulated kubelet rejected the plugin (what ValidatePlugin would refuse)."""


def _minor(kubelet_version: str) -> int:
    parts = kubelet_version.lstrip("v").split(".")
    if len(parts) < 2 or parts[0] != "1" or not parts[1].isdigit():
        raise ValueError(f"kubelet_version {kubelet_version!r} is not 1.<minor>")
    return int(parts[1])


def choose_service(kubelet_version: str, supported_versions: Iterable[str]) -> str:
    """The DRA service a kubelet of ``kubelet_version`` uses with a plugin advertising ``supported_versions``.

    1.34+: the first entry of the plugin's list the kubelet supports (v1, v1beta1); none is a refusal.
    1.32/1.33: the kubelet walks its own list (v1beta1, then the v1alpha3 fallback, not simulated).
    """
    offered = list(supported_versions)
    if _minor(kubelet_version) >= 34:
        for service in offered:
            if service in ("v1.DRAPlugin", "v1beta1.DRAPlugin"):
                return service
        raise RegistrationRefused(f"none of {offered} is supported by kubelet {kubelet_version}")
    if "v1beta1.DRAPlugin" in offered:
        return "v1beta1.DRAPlugin"
    raise RegistrationRefused(f"kubelet {kubelet_version} needs v1beta1.DRAPlugin, plugin offers {offered}")


@dataclass(frozen=True, slots=True)
class Registration:
    socket: Path
    driver_name: str
    endpoint: Path
    supported_versions: tuple[str, ...]
    service: str  # the chosen DRA service, e.g. "v1.DRAPlugin"
    get_info_seconds: float


def _device_dict(device: Any) -> dict[str, Any]:
    share_id = None
    if "share_id" in device.DESCRIPTOR.fields_by_name and device.HasField("share_id"):
        share_id = device.share_id
    return {
        "request_names": list(device.request_names),
        "pool_name": device.pool_name,
        "device_name": device.device_name,
        "cdi_device_ids": list(device.cdi_device_ids),
        "share_id": share_id,
    }


def _claim_messages(pb: Any, claims: Iterable[Mapping[str, str]]) -> list[Any]:
    return [pb.Claim(namespace=c["namespace"], name=c["name"], uid=c["uid"]) for c in claims]


def _check_answer(method: str, requested: Iterable[Any], answered: Iterable[str]) -> None:
    """What the kubelet enforces on a response (``manager.go``): an entry for a claim it did not
    ask about is an error, and so is a missing one (the whole call is then retried)."""
    asked = {claim.uid for claim in requested}
    unknown = sorted(set(answered) - asked)
    if unknown:
        raise FractionalError(f"{method} returned result for unknown claim UID {unknown[0]}")
    skipped = len(asked - set(answered))
    if skipped:
        raise FractionalError(f"{method} skipped {skipped} ResourceClaims")


class KubeletSimulator:
    def __init__(self, registry_dir: str | Path, kubelet_version: str = "1.35") -> None:
        _minor(kubelet_version)
        self.registry_dir = Path(registry_dir)
        self.kubelet_version = kubelet_version
        self.registration: Registration | None = None
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self._pb: Any = None
        self._lock = threading.Lock()

    # -- registration --------------------------------------------------------------------------

    def find_socket(self, timeout: float = 10.0) -> Path:
        """The first unix socket in the registry dir (names starting with ``.`` are ignored)."""
        deadline = time.monotonic() + timeout
        waiter = threading.Event()
        while True:
            for path in sorted(self.registry_dir.rglob("*")):
                try:
                    is_socket = stat.S_ISSOCK(path.lstat().st_mode)
                except FileNotFoundError:
                    continue
                if is_socket and not path.name.startswith("."):
                    return path
            if time.monotonic() >= deadline:
                raise FractionalError(f"no registration socket in {self.registry_dir} after {timeout} s")
            waiter.wait(0.01)  # the plugin watcher would get an fsnotify event; polling stands in

    def register(self, socket: str | Path | None = None, *, timeout: float = 10.0) -> Registration:
        """GetInfo -> version choice -> NotifyRegistrationStatus; raises ``RegistrationRefused``."""
        path = Path(socket) if socket is not None else self.find_socket(timeout)
        with grpc.insecure_channel(f"unix://{path}") as channel:
            grpc.channel_ready_future(channel).result(timeout=timeout)  # the kubelet's blocking dial
            stub = pluginregistration_pb2_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
            started = time.perf_counter()
            info = stub.GetInfo(pluginregistration_pb2.InfoRequest(), timeout=GET_INFO_TIMEOUT_SECONDS)
            get_info_seconds = time.perf_counter() - started
            try:
                if info.type != DRA_PLUGIN_TYPE:
                    raise RegistrationRefused(f"plugin type {info.type!r} is not {DRA_PLUGIN_TYPE}")
                if not info.name:
                    raise RegistrationRefused("plugin name is empty")
                service = choose_service(self.kubelet_version, info.supported_versions)
            except RegistrationRefused as error:
                stub.NotifyRegistrationStatus(
                    pluginregistration_pb2.RegistrationStatus(plugin_registered=False, error=str(error)),
                    timeout=NOTIFY_TIMEOUT_SECONDS,
                )
                raise
            endpoint = Path(info.endpoint) if info.endpoint else path
            registration = Registration(
                socket=path,
                driver_name=info.name,
                endpoint=endpoint,
                supported_versions=tuple(info.supported_versions),
                service=service,
                get_info_seconds=get_info_seconds,
            )
            self._connect(registration)
            stub.NotifyRegistrationStatus(
                pluginregistration_pb2.RegistrationStatus(plugin_registered=True),
                timeout=NOTIFY_TIMEOUT_SECONDS,
            )
        return registration

    def _connect(self, registration: Registration) -> None:
        pb, pb_grpc = _SERVICES[registration.service]
        channel = grpc.insecure_channel(f"unix://{registration.endpoint}")
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = channel
            self._stub = pb_grpc.DRAPluginStub(channel)
            self._pb = pb
            self.registration = registration

    def _service(self) -> tuple[Any, Any]:
        with self._lock:
            if self._stub is None:
                raise FractionalError("the simulated kubelet has not registered a plugin")
            return self._pb, self._stub

    # -- DRA calls -----------------------------------------------------------------------------

    def prepare(
        self, claims: Iterable[Mapping[str, str]], *, timeout: float = CALL_TIMEOUT_SECONDS
    ) -> dict[str, Any]:
        """NodePrepareResources; ``grpc.RpcError`` when the whole call fails, ``FractionalError`` when
        the answer leaves out a requested claim or names one not asked about (the kubelet's checks)."""
        pb, stub = self._service()
        messages = _claim_messages(pb, claims)
        response = stub.NodePrepareResources(pb.NodePrepareResourcesRequest(claims=messages), timeout=timeout)
        _check_answer("NodePrepareResources", messages, response.claims)
        return {
            uid: {"error": result.error, "devices": [_device_dict(device) for device in result.devices]}
            for uid, result in response.claims.items()
        }

    def unprepare(
        self, claims: Iterable[Mapping[str, str]], *, timeout: float = CALL_TIMEOUT_SECONDS
    ) -> dict[str, Any]:
        pb, stub = self._service()
        messages = _claim_messages(pb, claims)
        response = stub.NodeUnprepareResources(
            pb.NodeUnprepareResourcesRequest(claims=messages), timeout=timeout
        )
        _check_answer("NodeUnprepareResources", messages, response.claims)
        return {uid: {"error": result.error} for uid, result in response.claims.items()}

    def watch_health(self, *, timeout: float | None = None) -> Iterator[list[dict[str, Any]]]:
        """The v1alpha1 ``NodeWatchResources`` stream: one list of device dicts per message.

        Closing the generator (or ``close()``) cancels the stream; ``timeout`` bounds its lifetime.
        """
        with self._lock:
            if self.registration is None or self._channel is None:
                raise FractionalError("the simulated kubelet has not registered a plugin")
            channel = self._channel
        stub = dra_health_v1alpha1_pb2_grpc.DRAResourceHealthStub(channel)  # type: ignore[no-untyped-call]
        call = stub.NodeWatchResources(dra_health_v1alpha1_pb2.NodeWatchResourcesRequest(), timeout=timeout)
        try:
            for message in call:
                yield [
                    {
                        "pool_name": health.device.pool_name,
                        "device_name": health.device.device_name,
                        "health": dra_health_v1alpha1_pb2.HealthStatus.Name(health.health),
                        "last_updated_time": health.last_updated_time,
                        "health_check_timeout_seconds": health.health_check_timeout_seconds,
                        "message": health.message,
                    }
                    for health in message.devices
                ]
        finally:
            call.cancel()

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = None
            self._stub = None
            self.registration = None

"""Stands in for what a real cluster does after our controller ungates a pod.

kube-scheduler binds the pod to the node its claims were allocated on and reserves the claims
for it; the kubelet then calls the node agent's NodePrepareResources over its socket. When the
pod is deleted, the kubelet calls NodeUnprepareResources and the resourceclaim controller drops
the reservation. The demo has no kube-scheduler and no kubelet, so this thread does those steps
against the embedded API and the per-node kubelet simulators (real gRPC over unix sockets).

A pod whose claims cannot be allocated, or are bad (an unknown class, a CEL error, a claim that
does not exist), gets what kube-scheduler gives it: a ``FailedScheduling`` Warning Event from
``default-scheduler`` and the condition ``PodScheduled=False`` (reason ``Unschedulable``), with the
message in kube-scheduler's shape (``render_unschedulable_message``); said once per message, not on
every round, and again only when the reason changes.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from kubernetes import client

from driver.allocator import AllocationError, allocate
from driver.cluster.apiserver.store import new_timestamp
from driver.cluster.kubelet import pod_status
from driver.errors import ConflictError, FractionalError, NotFoundError
from driver.kube import REQUEST_TIMEOUT_SECONDS, api_errors, as_dict, new_api_client
from driver.kube.transport import JsonSender

__all__ = [
    "CANNOT_ALLOCATE",
    "BoundPod",
    "PodBinder",
    "build_failed_scheduling_event",
    "container_cdi_devices",
    "render_unschedulable_message",
]

log = logging.getLogger(__name__)

CDI_ANNOTATION = "fractional.dev/demo-cdi-devices"
SCHEDULER_NAME = "default-scheduler"
# What kube-scheduler's DynamicResources plugin says of each node where the pod's claims do not fit.
CANNOT_ALLOCATE = "cannot allocate all claims"


def render_unschedulable_message(reason: str, *, node_count: int, per_node: bool) -> str:
    """kube-scheduler's FitError text (``pkg/scheduler/framework/types.go``) for a pod the
    DynamicResources plugin turns away as UnschedulableAndUnresolvable, so that preemption does not
    help either. ``per_node``: ``reason`` is each node's Filter verdict, counted (``2 cannot
    allocate all claims``); otherwise it is PreFilter's, said once for the pod (a bad claim). E.g.
    ``0/2 nodes are available: 2 cannot allocate all claims. preemption: 0/2 nodes are available:
    2 Preemption is not helpful for scheduling.``"""
    available = f"0/{node_count} nodes are available"
    verdict = f"{node_count} {reason}" if per_node else reason
    return (
        f"{available}: {verdict}. preemption: {available}: "
        f"{node_count} Preemption is not helpful for scheduling."
    )


def build_failed_scheduling_event(
    pod: dict[str, Any], message: str, *, now: datetime.datetime, reporting_instance: str
) -> dict[str, Any]:
    """The events.k8s.io/v1 Event kube-scheduler records for a pod it could not schedule
    (``reportingController`` default-scheduler, action Scheduling, reason FailedScheduling)."""
    metadata = pod["metadata"]
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {
            # the recorder's name: the object's, then the time in hex nanoseconds
            "name": f"{metadata['name']}.{int(now.timestamp() * 1e9):x}",
            "namespace": metadata["namespace"],
        },
        "eventTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "reportingController": SCHEDULER_NAME,
        "reportingInstance": reporting_instance,
        "action": "Scheduling",
        "reason": "FailedScheduling",
        "regarding": {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": metadata["namespace"],
            "name": metadata["name"],
            "uid": metadata["uid"],
            "resourceVersion": metadata.get("resourceVersion", ""),
        },
        "note": message[:1024],
        "type": "Warning",
    }


class Kubelet(Protocol):
    def prepare(self, claims: list[dict[str, str]]) -> dict[str, Any]: ...

    def unprepare(self, claims: list[dict[str, str]]) -> dict[str, Any]: ...


@dataclass
class BoundPod:
    name: str
    uid: str
    node: str
    claims: list[dict[str, str]] = field(default_factory=list)  # {namespace, name, uid}
    cdi_devices: list[str] = field(default_factory=list)
    error: str | None = None
    # What the kubelet hands each container: the CDI devices of the claims it lists in
    # resources.claims, and nothing of the pod's other claims.
    container_cdi_devices: dict[str, list[str]] = field(default_factory=dict)
    namespace: str = ""


def _allocation_node(allocation: dict[str, Any]) -> str | None:
    for term in (allocation.get("nodeSelector") or {}).get("nodeSelectorTerms") or []:
        for field_req in term.get("matchFields") or []:
            if field_req.get("key") == "metadata.name" and field_req.get("values"):
                return str(field_req["values"][0])
    return None


def container_cdi_devices(pod: dict[str, Any], by_claim: dict[str, list[str]]) -> dict[str, list[str]]:
    """Per container (init containers too), the CDI device IDs the kubelet passes to the runtime:
    those of the claims the container lists in ``resources.claims``, looked up through the pod's
    ``spec.resourceClaims`` (pod-level name -> ResourceClaim name). ``by_claim``: ResourceClaim
    name -> its prepared devices' CDI IDs."""
    spec = pod.get("spec") or {}
    claim_of = {ref["name"]: ref.get("resourceClaimName") or "" for ref in spec.get("resourceClaims") or ()}
    devices: dict[str, list[str]] = {}
    for container in [*(spec.get("initContainers") or ()), *(spec.get("containers") or ())]:
        listed = ((container.get("resources") or {}).get("claims")) or ()
        devices[container["name"]] = [
            device for entry in listed for device in by_claim.get(claim_of.get(entry["name"], ""), [])
        ]
    return devices


class PodBinder:
    def __init__(
        self, configuration: client.Configuration, namespace: str, kubelets: dict[str, Kubelet]
    ) -> None:
        self._configuration = configuration
        self._namespace = namespace
        self._kubelets = kubelets
        self._lock = threading.Lock()
        self._bound: dict[str, BoundPod] = {}
        # bound pods whose claims the node agent refused to prepare: (monotonic time of the next try,
        # tries); only the syncing thread touches it
        self._preparing: dict[str, tuple[float, int]] = {}
        self._thread: threading.Thread | None = None
        # pod UID -> the FailedScheduling message last said (used by the one thread that syncs)
        self._unschedulable: dict[str, str] = {}
        self._reporting_instance = f"{SCHEDULER_NAME}-{socket.gethostname()}"[:128]

    def bound(self) -> dict[str, BoundPod]:
        with self._lock:
            return dict(self._bound)

    def start(self, stop: threading.Event) -> None:
        self._thread = threading.Thread(target=self._run, args=(stop,), name="demo-binder", daemon=True)
        self._thread.start()

    def join(self, timeout: float = 5.0) -> None:
        if self._thread:
            self._thread.join(timeout)

    def _run(self, stop: threading.Event) -> None:
        api_client = new_api_client(self._configuration)
        core = client.CoreV1Api(api_client)
        resource = client.ResourceV1Api(api_client)
        while not stop.wait(0.05):
            try:
                self.sync_once(core, resource)
            except Exception:  # one commented catch-all per loop: log, back off, go on
                log.exception("binder sync failed")
                stop.wait(0.5)

    def _key(self, namespace: str, name: str) -> str:
        """Pods of the binder's namespace by name; those of other namespaces (a user's ``kubectl
        apply`` into ``default``) as ``namespace/name``."""
        return name if namespace == self._namespace else f"{namespace}/{name}"

    def sync_once(self, core: client.CoreV1Api, resource: client.ResourceV1Api) -> None:
        with api_errors("list pods"):
            pods = core.list_pod_for_all_namespaces(_request_timeout=REQUEST_TIMEOUT_SECONDS)
        present: dict[str, dict[str, Any]] = {}
        node_count = 0
        for pod in (as_dict(item) for item in pods.items):
            key = self._key(pod["metadata"]["namespace"], pod["metadata"]["name"])
            present[key] = pod
            spec = pod.get("spec") or {}
            if key in self._preparing and not pod["metadata"].get("deletionTimestamp"):
                self._prepare_again(core, key, pod)
                continue
            if (
                spec.get("schedulingGates")
                or spec.get("nodeName")
                or pod["metadata"].get("deletionTimestamp")
            ):
                continue
            if not node_count:
                with api_errors("list nodes"):
                    node_count = len(core.list_node(_request_timeout=REQUEST_TIMEOUT_SECONDS).items)
            try:
                unschedulable = self._schedule(resource, pod, node_count)
                if unschedulable is not None:
                    self._report_unschedulable(core, pod, unschedulable)
                    continue
                self._unschedulable.pop(pod["metadata"]["uid"], None)
                self._bind(core, resource, pod)
            except FractionalError as error:  # this pod's namespace going away, a conflict: the others go on
                where = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
                log.warning("pod not bound this pass", extra={"pod": where, "error": str(error)[:300]})
        for key in [k for k in self._preparing if k not in present]:
            del self._preparing[key]
        uids = {pod["metadata"]["uid"] for pod in present.values()}
        for uid in [uid for uid in self._unschedulable if uid not in uids]:
            del self._unschedulable[uid]
        with self._lock:
            gone = [
                b
                for name, b in self._bound.items()
                if name not in present or present[name]["metadata"]["uid"] != b.uid
            ]
        for bound in gone:
            self._release(resource, bound)

    def _prepare_again(self, core: client.CoreV1Api, key: str, pod: dict[str, Any]) -> None:
        with self._lock:
            bound = self._bound.get(key)
        if bound is None or bound.uid != pod["metadata"]["uid"]:
            self._preparing.pop(key, None)
            return
        if self._preparing[key][0] <= time.monotonic():
            try:
                self._prepare(core, pod, bound)
            except FractionalError as error:
                log.warning("prepare not retried this pass", extra={"pod": key, "error": str(error)[:300]})

    def _schedule(self, resource: client.ResourceV1Api, pod: dict[str, Any], node_count: int) -> str | None:
        """kube-scheduler's DRA plugin, for an ungated pod outside our controller's gangs: allocate its
        claims together on one node with the structured allocator, as the scheduler would. The
        FailedScheduling message when they cannot be, else None (allocated, or nothing to do yet)."""
        namespace = pod["metadata"]["namespace"]
        generated = {
            entry.get("name"): entry.get("resourceClaimName")
            for entry in (pod.get("status") or {}).get("resourceClaimStatuses") or []
        }
        names = [
            ref.get("resourceClaimName") or generated.get(ref["name"])
            for ref in (pod.get("spec") or {}).get("resourceClaims") or []
        ]
        if not names or not all(names):
            return None
        claims = []
        for name in names:
            try:
                with api_errors(f"get ResourceClaim {namespace}/{name}"):
                    claims.append(
                        as_dict(
                            resource.read_namespaced_resource_claim(
                                str(name), namespace, _request_timeout=REQUEST_TIMEOUT_SECONDS
                            )
                        )
                    )
            except NotFoundError:
                # the lister's answer in PreFilter; the claim may still be on its way
                problem = f'resourceclaim.resource.k8s.io "{name}" not found'
                return render_unschedulable_message(problem, node_count=node_count, per_node=False)
        pending = [c for c in claims if not (c.get("status") or {}).get("allocation")]
        if not pending:
            return None
        with api_errors("list ResourceClaims"):
            every_claim = [
                as_dict(c)
                for c in resource.list_resource_claim_for_all_namespaces(
                    _request_timeout=REQUEST_TIMEOUT_SECONDS
                ).items
            ]
        with api_errors("list ResourceSlices and DeviceClasses"):
            slices = [
                as_dict(s)
                for s in resource.list_resource_slice(_request_timeout=REQUEST_TIMEOUT_SECONDS).items
            ]
            classes = [
                as_dict(c) for c in resource.list_device_class(_request_timeout=REQUEST_TIMEOUT_SECONDS).items
            ]
        allocated = [c for c in every_claim if (c.get("status") or {}).get("allocation")]
        try:
            allocations = allocate(
                pending,
                slices=slices,
                classes=classes,
                allocated=allocated,
                pod_groups=[list(range(len(pending)))],
            )
        except AllocationError as error:  # a bad claim: what upstream's allocator treats as fatal
            return render_unschedulable_message(str(error), node_count=node_count, per_node=False)
        if allocations is None:  # the real scheduler retries as the cluster changes; so does this loop
            return render_unschedulable_message(CANNOT_ALLOCATE, node_count=node_count, per_node=True)
        for claim, allocation in zip(pending, allocations, strict=True):
            # kube-scheduler stamps the allocations it makes (DRADeviceBindingConditions, 1.37)
            allocation = {**allocation, "allocationTimestamp": new_timestamp()}
            claim["status"] = {**(claim.get("status") or {}), "allocation": allocation}
            with api_errors(f"allocate ResourceClaim {namespace}/{claim['metadata']['name']}"):
                resource.replace_namespaced_resource_claim_status(
                    claim["metadata"]["name"],
                    namespace,
                    cast(Any, claim),
                    _request_timeout=REQUEST_TIMEOUT_SECONDS,
                )
        return None

    def _report_unschedulable(self, core: client.CoreV1Api, pod: dict[str, Any], message: str) -> None:
        """What kube-scheduler's failure handler does: ``PodScheduled=False`` (Unschedulable) on the
        pod and a FailedScheduling Event; only when ``message`` is new for this pod."""
        metadata = pod["metadata"]
        namespace, name, uid = metadata["namespace"], metadata["name"], metadata["uid"]
        if self._unschedulable.get(uid) == message:
            return
        now = datetime.datetime.now(datetime.UTC)
        condition = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": message,
            "lastProbeTime": None,
            "lastTransitionTime": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        with api_errors(f"update status of Pod {namespace}/{name}"):
            core.patch_namespaced_pod_status(
                name,
                namespace,
                {"status": {"conditions": [condition]}},
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            )
        event = build_failed_scheduling_event(
            pod, message, now=now, reporting_instance=self._reporting_instance
        )
        # As JSON: the typed client would write eventTime back through isoformat(), dropping a zero
        # microsecond part, and kube-apiserver refuses a MicroTime without one.
        sender = JsonSender(core.api_client)
        try:
            path = "/apis/events.k8s.io/v1/namespaces/{namespace}/events"
            what = f"create Event for Pod {namespace}/{name}"
            sender.send_json("POST", path, {"namespace": namespace}, event, what=what)
        finally:
            sender.close()
        self._unschedulable[uid] = message
        log.info("pod unschedulable", extra={"pod": f"{namespace}/{name}", "reason": message})

    def _bind(self, core: client.CoreV1Api, resource: client.ResourceV1Api, pod: dict[str, Any]) -> None:
        metadata = pod["metadata"]
        namespace, name, pod_uid = metadata["namespace"], metadata["name"], metadata["uid"]
        claims = []
        node = None
        if not pod["spec"].get("resourceClaims"):
            node = next(iter(sorted(self._kubelets)), None)  # no claim: any node will do
        generated = {
            entry.get("name"): entry.get("resourceClaimName")
            for entry in (pod.get("status") or {}).get("resourceClaimStatuses") or []
        }
        for ref in pod["spec"].get("resourceClaims") or []:
            claim_name = ref.get("resourceClaimName") or generated.get(ref["name"])
            if not claim_name:
                return  # the resourceclaim controller has not made the template's claim yet
            with api_errors(f"get ResourceClaim {namespace}/{claim_name}"):
                claim = resource.read_namespaced_resource_claim(
                    claim_name, namespace, _request_timeout=REQUEST_TIMEOUT_SECONDS
                )
            raw = as_dict(claim)
            allocation = (raw.get("status") or {}).get("allocation")
            if not allocation:
                return  # not ours to allocate (yet)
            node = node or _allocation_node(allocation)
            claims.append(raw)
        if node is None or node not in self._kubelets:
            return
        refs = []
        for raw in claims:
            self._reserve(resource, raw, name, pod_uid)
            refs.append(
                {"namespace": namespace, "name": raw["metadata"]["name"], "uid": raw["metadata"]["uid"]}
            )
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": namespace},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        try:
            with api_errors(f"bind Pod {namespace}/{name}"):
                core.create_namespaced_pod_binding(
                    name,
                    namespace,
                    cast(Any, binding),
                    _request_timeout=REQUEST_TIMEOUT_SECONDS,
                    _preload_content=False,  # the client cannot decode the Status the server answers with
                )
        except NotFoundError:  # deleted meanwhile: what was reserved for it is given back
            log.info("pod gone before it was bound", extra={"pod": f"{namespace}/{name}"})
            self._release(resource, BoundPod(name, pod_uid, node, refs, namespace=namespace))
            return
        self._prepare(core, pod, BoundPod(name, pod_uid, node, refs, namespace=namespace))

    def _prepare(self, core: client.CoreV1Api, pod: dict[str, Any], bound: BoundPod) -> None:
        """NodePrepareResources for a bound pod, then its status: Running, or (a claim refused) Pending
        with its containers waiting in ContainerCreating, prepared again on a later pass with backoff,
        as the kubelet retries (e.g. while a share released a moment ago is still prepared for the pod
        that held it: the node agent refuses the overcommit until the kubelet unprepares it)."""
        namespace, name, refs = bound.namespace, bound.name, bound.claims
        where = f"{namespace}/{name}"
        answer = self._kubelets[bound.node].prepare(refs) if refs else {}
        cdi_devices: list[str] = []
        by_claim: dict[str, list[str]] = {}
        errors = []
        for ref in refs:
            result = answer.get(ref["uid"]) or {}
            if result.get("error"):
                errors.append(f"{ref['name']}: {result['error']}")
            for device in result.get("devices", []):
                cdi_devices.extend(device.get("cdi_device_ids", []))
                by_claim.setdefault(ref["name"], []).extend(device.get("cdi_device_ids", []))
        bound.cdi_devices, bound.error = cdi_devices, "; ".join(errors) or None
        bound.container_cdi_devices = container_cdi_devices(pod, by_claim)
        status = pod_status(pod, started=not errors, now=new_timestamp())
        phase = status["phase"]
        key = self._key(namespace, name)
        # Recorded before its status is written: a pod deleted from here on (seen: a Job's pod, in
        # the namespace a test deletes) is released by the next pass, its claims unprepared and
        # unreserved, and the namespace can go.
        with self._lock:
            self._bound[key] = bound
        if errors:
            tries = self._preparing.get(key, (0.0, 0))[1] + 1
            self._preparing[key] = (time.monotonic() + min(10.0, 0.25 * 2**tries), tries)
            log.info("prepare refused, retrying", extra={"pod": where, "error": bound.error})
        else:
            self._preparing.pop(key, None)
        try:
            with api_errors(f"update status of Pod {where}"):
                core.patch_namespaced_pod(
                    name,
                    namespace,
                    {"metadata": {"annotations": {CDI_ANNOTATION: ",".join(cdi_devices)}}},
                    _request_timeout=REQUEST_TIMEOUT_SECONDS,
                )
                core.patch_namespaced_pod_status(
                    name, namespace, {"status": status}, _request_timeout=REQUEST_TIMEOUT_SECONDS
                )
        except NotFoundError:
            log.info("pod gone before its status was written", extra={"pod": where})
            return
        log.info("pod bound and prepared", extra={"pod": where, "node": bound.node, "phase": phase})

    def _reserve(
        self, resource: client.ResourceV1Api, raw: dict[str, Any], pod_name: str, pod_uid: str
    ) -> None:
        entry = {"resource": "pods", "name": pod_name, "uid": pod_uid}
        name, namespace = raw["metadata"]["name"], raw["metadata"]["namespace"]
        for _attempt in range(5):
            reserved = raw.setdefault("status", {}).setdefault("reservedFor", [])
            if any(r.get("uid") == pod_uid for r in reserved):
                return
            reserved.append(entry)
            # As kube-scheduler's PreBind does (1.37, DRADeviceBindingConditions on): an allocation
            # that carries no allocationTimestamp gets one in the same status update; the server
            # then refuses it (an allocation is immutable) unless whoever allocated stamped it.
            allocation = raw["status"].get("allocation")
            if allocation is not None and "allocationTimestamp" not in allocation:
                allocation["allocationTimestamp"] = new_timestamp()
            try:
                with api_errors(f"reserve ResourceClaim {namespace}/{name}"):
                    resource.replace_namespaced_resource_claim_status(
                        name, namespace, cast(Any, raw), _request_timeout=REQUEST_TIMEOUT_SECONDS
                    )
                return
            except ConflictError:
                with api_errors(f"get ResourceClaim {namespace}/{name}"):
                    fresh = resource.read_namespaced_resource_claim(
                        name, namespace, _request_timeout=REQUEST_TIMEOUT_SECONDS
                    )
                raw.clear()
                raw.update(as_dict(fresh))

    def _release(self, resource: client.ResourceV1Api, bound: BoundPod) -> None:
        self._kubelets[bound.node].unprepare(bound.claims)
        for ref in bound.claims:
            for _attempt in range(5):
                try:
                    with api_errors(f"get ResourceClaim {ref['name']}"):
                        claim = resource.read_namespaced_resource_claim(
                            ref["name"], ref["namespace"], _request_timeout=REQUEST_TIMEOUT_SECONDS
                        )
                    raw = as_dict(claim)
                    status = raw.get("status") or {}
                    reserved = [r for r in status.get("reservedFor") or [] if r.get("uid") != bound.uid]
                    if reserved == (status.get("reservedFor") or []):
                        break
                    if reserved:
                        status["reservedFor"] = reserved
                    else:
                        status.pop("reservedFor", None)
                    with api_errors(f"unreserve ResourceClaim {ref['name']}"):
                        resource.replace_namespaced_resource_claim_status(
                            ref["name"],
                            ref["namespace"],
                            cast(Any, raw),
                            _request_timeout=REQUEST_TIMEOUT_SECONDS,
                        )
                    break
                except NotFoundError:
                    break
                except ConflictError:
                    continue
        with self._lock:
            self._bound.pop(self._key(bound.namespace or self._namespace, bound.name), None)
        log.info("pod released", extra={"pod": bound.name, "node": bound.node})

"""What the controller tells people and autoscalers about a gang that does not fit: one core v1
Event per gang (on its first pod, re-emitted only when the message changes), the scale-up hint
annotation on each pod, and optionally a ProvisioningRequest with one PodTemplate per pod shape.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from datetime import UTC, datetime
from typing import Any

from kubernetes import client

from driver.controller.model.decode import bounded
from driver.controller.model.objects import HINT_ANNOTATION, GangKey
from driver.errors import ConflictError, NamespaceTerminatingError
from driver.kube import REQUEST_TIMEOUT_SECONDS, api_errors

__all__ = [
    "COMPONENT",
    "REASON_FAILED",
    "REASON_REJECTED",
    "REASON_UNSCHEDULABLE",
    "EventMemory",
    "EventRecorder",
    "build_pod_template",
    "build_provisioning_request",
    "provisioning_request_name",
]

log = logging.getLogger(__name__)

COMPONENT = "fractional-dra-controller"
REASON_UNSCHEDULABLE = "GangUnschedulable"
REASON_FAILED = "AllocationFailed"
REASON_REJECTED = "ObjectRejected"
MAX_EVENT_MESSAGE_CHARS = 1024  # kube-apiserver truncates longer Event messages the same way
PROVISIONING_ANNOTATION = "cluster-autoscaler.kubernetes.io/consume-provisioning-request"
PROVISIONING_CLASS_ANNOTATION = "cluster-autoscaler.kubernetes.io/provisioning-class-name"
_NAME_LIMIT = 253
_INVOLVED_API_VERSIONS = {"Pod": "v1", "ResourceClaim": "resource.k8s.io/v1"}


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _gang_name(gang: GangKey) -> str:
    return gang.split("/", 1)[1].replace("pod:", "pod-")


def provisioning_request_name(gang: GangKey) -> str:
    """A DNS-subdomain name for the gang's ProvisioningRequest (hash-suffixed, stable)."""
    digest = hashlib.sha256(gang.encode()).hexdigest()[:8]
    base = "".join(ch if ch.isalnum() or ch in "-." else "-" for ch in _gang_name(gang).lower()).strip("-.")
    return f"{base[: _NAME_LIMIT - 20]}-scale-up-{digest}"


def _pod_shape(pod: dict[str, Any]) -> dict[str, Any]:
    """The scheduler-relevant part of a pod (what a PodTemplate for the autoscaler needs)."""
    spec = pod.get("spec") or {}
    keep = ("containers", "initContainers", "nodeSelector", "affinity", "tolerations", "resourceClaims",
            "priorityClassName", "overhead", "topologySpreadConstraints")  # fmt: skip
    shape = {k: spec[k] for k in keep if k in spec}
    shape["containers"] = [
        {k: c[k] for k in ("name", "image", "resources") if k in c} for c in spec.get("containers") or ()
    ]
    return shape


def build_pod_template(gang: GangKey, pod: dict[str, Any], index: int) -> dict[str, Any]:
    namespace = pod["metadata"]["namespace"]
    return {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": f"{provisioning_request_name(gang)[:240]}-{index}", "namespace": namespace},
        "template": {
            "metadata": {"labels": dict(pod["metadata"].get("labels") or {})},
            "spec": _pod_shape(pod),
        },
    }


def build_provisioning_request(
    gang: GangKey, pods: list[dict[str, Any]], *, provisioning_class: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ProvisioningRequest and the PodTemplates it references (one per distinct pod shape)."""
    shapes: dict[str, tuple[dict[str, Any], int]] = {}
    for pod in pods:
        shape = _pod_shape(pod)
        # Each pod of a gang names its own claims; pods alike but for those names share a pod set
        # (their claims come from one template or one spec), the template keeps the first pod's.
        shape["resourceClaims"] = [entry.get("name") for entry in shape.get("resourceClaims") or ()]
        key = json.dumps(shape, sort_keys=True)
        template, count = shapes.get(key, (pod, 0))
        shapes[key] = (template, count + 1)
    templates = [build_pod_template(gang, pod, i) for i, (pod, _) in enumerate(shapes.values())]
    request = {
        "apiVersion": "autoscaling.x-k8s.io/v1",
        "kind": "ProvisioningRequest",
        "metadata": {"name": provisioning_request_name(gang), "namespace": pods[0]["metadata"]["namespace"]},
        "spec": {
            "provisioningClassName": provisioning_class,
            "podSets": [
                {"podTemplateRef": {"name": t["metadata"]["name"]}, "count": count}
                for t, (_, count) in zip(templates, shapes.values(), strict=True)
            ],
        },
    }
    return request, templates


class EventMemory:
    """The last message said about each gang or object, shared by every writer thread's recorder
    (owns its lock): the same message is said once, whichever writer says it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, str] = {}

    def claim(self, key: str, message: str) -> bool:
        """True (and remembered) when ``message`` is new for ``key``."""
        with self._lock:
            if self._last.get(key) == message:
                return False
            self._last[key] = message
            return True

    def forget(self, key: str, message: str | None = None) -> None:
        with self._lock:
            if message is None or self._last.get(key) == message:
                self._last.pop(key, None)


class EventRecorder:
    """Runs on a writer thread with that thread's ``ApiClient``; ``memory`` is shared by all."""

    def __init__(
        self, api_client: client.ApiClient, *, identity: str, memory: EventMemory | None = None
    ) -> None:
        self._core: Any = client.CoreV1Api(
            api_client
        )  # Any: we send dicts and read raw JSON (_preload_content=False)
        self._custom: Any = client.CustomObjectsApi(api_client)
        self._identity = identity or COMPONENT
        self._memory = memory or EventMemory()
        self.emitted = 0

    def forget(self, gang: GangKey) -> None:
        self._memory.forget(f"gang:{gang}")

    def gang_unschedulable(
        self,
        gang: GangKey,
        pod: dict[str, Any],
        message: str,
        *,
        reason: str = REASON_UNSCHEDULABLE,
        also: dict[str, Any] | None = None,
    ) -> bool:
        """Emit the gang's Event unless the same message was the last one; True when emitted.
        ``also``: the gang's PodGroup (or Workload) as an object reference; it gets the Event too."""
        if not self._memory.claim(f"gang:{gang}", message):
            return False
        try:
            if not self._emit(pod, reason=reason, message=message):
                return False
            if also is not None and also.get("name") and also.get("kind"):
                target = {"metadata": {"name": also["name"], "namespace": also.get("namespace") or
                                       pod["metadata"]["namespace"], "uid": also.get("uid")}}  # fmt: skip
                self._emit(target, reason=reason, message=message, kind=str(also["kind"]),
                           api_version=str(also.get("apiVersion") or ""))  # fmt: skip
        except BaseException:
            self._memory.forget(f"gang:{gang}", message)  # not said: say it next time
            raise
        log.info(
            "gang event emitted", extra={"gang": gang, "reason": reason, "event_message": bounded(message)}
        )
        return True

    def object_rejected(self, resource: str, obj: dict[str, Any], problem: str) -> bool:
        """A Warning Event on an object the controller will not act on (``problem`` names the field);
        emitted once per object UID and message. True when emitted."""
        meta = obj.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        what = "ResourceClaim" if resource == "resourceclaims" else "Pod"
        message = (
            f"{what} {meta.get('namespace')}/{meta.get('name')}: {problem}; the controller leaves it alone"
        )
        if not self._memory.claim(f"uid:{uid}", message):
            return False
        try:
            self._emit(obj, reason=REASON_REJECTED, message=message, kind=what)
        except BaseException:
            self._memory.forget(f"uid:{uid}", message)
            raise
        log.warning("object rejected", extra={"resource": resource, "object": f"{meta.get('namespace')}/"
                    f"{meta.get('name')}", "reason": bounded(problem)})  # fmt: skip
        return True

    def _emit(
        self, obj: dict[str, Any], *, reason: str, message: str, kind: str = "Pod", api_version: str = ""
    ) -> bool:
        """Create the Event; False when its namespace is being deleted (nothing to tell there)."""
        meta = obj["metadata"]
        now = _now()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name'][:200]}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": api_version or _INVOLVED_API_VERSIONS[kind],
                "kind": kind,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "reason": reason,
            "message": bounded(message, MAX_EVENT_MESSAGE_CHARS - 40),
            "type": "Warning",
            "source": {"component": COMPONENT},
            "reportingComponent": "fractional.dev/controller",
            "reportingInstance": self._identity,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            with api_errors(f"create Event for {kind} {meta['namespace']}/{meta['name']}"):
                self._core.create_namespaced_event(
                    meta["namespace"], body, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS
                )
        except NamespaceTerminatingError:
            # Nothing can be created there any more, and its pods are going: the Event is moot. Seen
            # on kube-apiserver 1.37.2: retrying it kept a gang's key in the queue at ~5 passes/s.
            log.info("event dropped: namespace terminating", extra={"namespace": meta["namespace"]})
            return False
        self.emitted += 1
        return True

    def publish_provisioning_request(
        self, gang: GangKey, pods: list[dict[str, Any]], provisioning_class: str
    ) -> str:
        """Create the PodTemplates and the ProvisioningRequest (both kept if they exist already)."""
        request, templates = build_provisioning_request(gang, pods, provisioning_class=provisioning_class)
        namespace = request["metadata"]["namespace"]
        for template in templates:
            try:
                with api_errors(f"create PodTemplate {namespace}/{template['metadata']['name']}"):
                    self._core.create_namespaced_pod_template(
                        namespace, template, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS
                    )
            except ConflictError:
                pass  # already there from an earlier pass: the spec is derived from the same pods
        try:
            with api_errors(f"create ProvisioningRequest {namespace}/{request['metadata']['name']}"):
                self._custom.create_namespaced_custom_object(
                    "autoscaling.x-k8s.io", "v1", namespace, "provisioningrequests", request,
                    _request_timeout=REQUEST_TIMEOUT_SECONDS,
                )  # fmt: skip
        except ConflictError:
            pass  # the spec is immutable; the one we made earlier stands
        return str(request["metadata"]["name"])

    @staticmethod
    def hint_annotations(
        hint_json: str | None, provisioning: tuple[str, str] | None
    ) -> dict[str, str | None]:
        annotations: dict[str, str | None] = {HINT_ANNOTATION: hint_json}
        if provisioning is not None:
            annotations[PROVISIONING_ANNOTATION] = provisioning[0]
            annotations[PROVISIONING_CLASS_ANNOTATION] = provisioning[1]
        return annotations

"""Every API write the controller makes, each one guarded by the object's resourceVersion.

Order for a gang (the worker drives it): each claim's ``status.allocation`` (and, for a claim that
serves one pod alone, ``status.reservedFor`` naming it, in the same write), then the gate off each
pod (with ``PLACED_ANNOTATION`` in the same write). Two writes per pod and no finalizer: with
kube-scheduler's three (a pod status patch, the binding, its Event) that makes five requests per
bound pod, as many as kube-scheduler's own allocation takes (docs/architecture.md). A crash at any
point leaves a state the next controller converges from: allocations of a gang whose pods are all
still gated are released and redone (or, when complete, the pods are ungated). Removing a gate
cannot be undone, so ungating is the commit point.

A 409 surfaces as ``ConflictError``; callers re-read and re-decide.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubernetes import client

from driver.controller.model.decode import MAX_OBJECT_DEPTH, decode_json, format_field_path
from driver.controller.model.objects import FIELD_MANAGER, FINALIZER, GATE, object_key
from driver.errors import FractionalError
from driver.kube import REQUEST_TIMEOUT_SECONDS, api_errors
from driver.kube.transport import JsonSender

__all__ = ["ApiWriter", "HaltWrites", "RejectedObjectError", "WriteHook", "WriteRecord", "format_time"]

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
# Written with JsonSender.send_json (our dicts as they are); tests/chart/test_rbac.py reads these.
CLAIM_PATH = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"
CLAIM_STATUS_PATH = CLAIM_PATH + "/status"
POD_PATH = "/api/v1/namespaces/{namespace}/pods/{name}"
_AS_OURS = (("fieldManager", FIELD_MANAGER),)


def _without_managed_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """A replace body without ``metadata.managedFields``: left out, the server keeps its own; sent
    (the cache keeps one entry of them), it would take them as the object's new ones."""
    if "managedFields" not in (obj.get("metadata") or {}):
        return obj
    body = dict(obj)
    body["metadata"] = {k: v for k, v in obj["metadata"].items() if k != "managedFields"}
    return body


class HaltWrites(Exception):
    """Raised by a write hook (tests), or before a write once leadership is lost: the worker stops on
    the spot without undoing anything, as if the process had been killed after the last write."""


@dataclass(frozen=True, slots=True)
class WriteRecord:
    action: str  # remove-finalizer | allocate | deallocate | ungate | annotate
    key: str


WriteHook = Callable[[WriteRecord], None]


class RejectedObjectError(FractionalError):
    """The server answered with an object the bounded decoder had to cut (nested too deep)."""


def _body(response: Any) -> dict[str, Any]:
    return _decode(response.data)


def _decode(data: bytes) -> dict[str, Any]:
    decoded = decode_json(data, max_depth=MAX_OBJECT_DEPTH)
    if decoded.too_deep:
        raise RejectedObjectError(
            f"{format_field_path(decoded.too_deep[0])}: nested deeper than {MAX_OBJECT_DEPTH} levels"
        )
    result: dict[str, Any] = decoded.value
    return result


def format_time(moment: datetime) -> str:
    """A ``metav1.Time`` as the API writes it: RFC 3339, UTC, whole seconds."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiWriter:
    """Owns the worker thread's ``ApiClient``; every method returns the object as the server stored it."""

    def __init__(
        self,
        api_client: client.ApiClient,
        *,
        hook: WriteHook | None = None,
        fence: threading.Event | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._resource: Any = client.ResourceV1Api(
            api_client
        )  # Any: we send dicts and read raw JSON (_preload_content=False)
        self._core: Any = client.CoreV1Api(api_client)
        self._sender = JsonSender(api_client)  # writes: our dicts as they are, on a lean connection
        self._hook = hook
        self._fence = fence
        self._now = now
        self.writes = 0

    def close(self) -> None:
        """Close the writer's own connection (its thread is done)."""
        self._sender.close()

    def _check_fence(self) -> None:
        """Once the fence is set (leadership lost), no further write may go out, not even an undo."""
        if self._fence is not None and self._fence.is_set():
            raise HaltWrites()

    def _done(self, action: str, key: str) -> None:
        self.writes += 1
        if self._hook is not None:
            try:
                self._hook(WriteRecord(action=action, key=key))
            except HaltWrites:
                if self._fence is not None:
                    self._fence.set()  # a simulated crash stops every writer at once, as a kill would
                raise

    # -- claims -------------------------------------------------------------------------------------

    def read_claim(self, namespace: str, name: str) -> dict[str, Any]:
        with api_errors(f"get ResourceClaim {namespace}/{name}"):
            return _body(
                self._resource.read_namespaced_resource_claim(
                    name, namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS
                )
            )

    def _send(
        self,
        method: str,
        path: str,
        meta: dict[str, Any],
        body: dict[str, Any],
        *,
        what: str,
        content_type: str = "application/json",
    ) -> bytes:
        """Every write names our field manager, so that the server records what we changed under
        it (``model.objects.allocated_by_us`` reads it back)."""
        return self._sender.send_json(
            method, path, meta, body, what=what, content_type=content_type, query=_AS_OURS
        )  # fmt: skip

    def _replace_claim(self, claim: dict[str, Any], what: str) -> dict[str, Any]:
        meta = claim["metadata"]
        what = f"{what} ResourceClaim {meta['namespace']}/{meta['name']}"
        return _decode(self._send("PUT", CLAIM_PATH, meta, _without_managed_fields(claim), what=what))

    def _replace_claim_status(self, claim: dict[str, Any], what: str) -> dict[str, Any]:
        meta = claim["metadata"]
        what = f"{what} ResourceClaim {meta['namespace']}/{meta['name']} status"
        return _decode(self._send("PUT", CLAIM_STATUS_PATH, meta, _without_managed_fields(claim), what=what))

    def remove_finalizer(self, claim: dict[str, Any]) -> dict[str, Any]:
        """Remove our finalizer, which earlier versions of the controller wrote (model.FINALIZER)."""
        finalizers = list(claim["metadata"].get("finalizers") or ())
        if FINALIZER not in finalizers:
            return claim
        body = copy.deepcopy(claim)
        body["metadata"]["finalizers"] = [f for f in finalizers if f != FINALIZER]
        self._check_fence()
        stored = self._replace_claim(body, "remove finalizer from")
        self._done("remove-finalizer", object_key(claim))
        return stored

    def write_allocation(
        self,
        claim: dict[str, Any],
        allocation: dict[str, Any],
        *,
        reserved_for: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Write ``status.allocation``, stamped with ``allocationTimestamp`` (when it was allocated)
        unless it carries one. kube-scheduler stamps an allocation it finds without one when it
        reserves the claim for the pod (DRADeviceBindingConditions, on by default from 1.37), and
        an allocation is immutable: the server refused that write, and the pod never started.

        ``reserved_for``: the one pod the claim serves (``pod_consumer``), written as the claim's
        ``status.reservedFor`` in the same write. kube-scheduler's PreBind skips a claim already
        reserved for the pod it binds (upstream ``resourceclaim.IsReservedForPod``), so the claim
        costs it no status update of its own."""
        body = copy.deepcopy(claim)
        stamped = dict(allocation)
        stamped.setdefault("allocationTimestamp", format_time(self._now()))
        status = body.setdefault("status", {})
        status["allocation"] = stamped
        if reserved_for is not None:
            status["reservedFor"] = [dict(reserved_for)]
        self._check_fence()
        stored = self._replace_claim_status(body, "allocate")
        self._done("allocate", object_key(claim))
        return stored

    def clear_allocation(self, claim: dict[str, Any]) -> dict[str, Any]:
        """Clear ``status.allocation``, with the reservation (the API allows ``reservedFor`` only
        while allocated; callers clear only a reservation for a pod never bound, or one gone) and
        the device status (its entries must match an allocated result)."""
        body = copy.deepcopy(claim)
        status = body.setdefault("status", {})
        status.pop("allocation", None)
        status.pop("reservedFor", None)
        status.pop("devices", None)
        self._check_fence()
        stored = self._replace_claim_status(body, "deallocate")
        self._done("deallocate", object_key(claim))
        return stored

    # -- pods ---------------------------------------------------------------------------------------

    def read_pod(self, namespace: str, name: str) -> dict[str, Any]:
        with api_errors(f"get Pod {namespace}/{name}"):
            return _body(
                self._core.read_namespaced_pod(
                    name, namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS
                )
            )

    def ungate_pod(
        self,
        pod: dict[str, Any],
        *,
        pin: tuple[str, str] | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> dict[str, Any]:
        """Remove our scheduling gate (others stay), guarded by the pod's resourceVersion. ``pin``: a
        nodeSelector entry (the node's hostname label) added in the same write, for a pod without
        devices whose node we chose (a gated pod may narrow where it runs; nothing else may).
        ``annotations``: ours, merged in the same write (None removes one)."""
        gates = list((pod.get("spec") or {}).get("schedulingGates") or ())
        remaining = [g for g in gates if g.get("name") != GATE]
        if len(remaining) == len(gates):
            return pod
        meta = pod["metadata"]
        # A merge patch guarded by the resourceVersion (a stale one gets 409, as a replace would), not
        # a replace: the client's models refuse pod fields they do not know (1.35's spec.workloadRef).
        spec: dict[str, Any] = {"schedulingGates": remaining}
        if pin is not None:
            spec["nodeSelector"] = {pin[0]: pin[1]}
        metadata: dict[str, Any] = {"resourceVersion": meta.get("resourceVersion")}
        if annotations:
            metadata["annotations"] = dict(annotations)
        body = {"metadata": metadata, "spec": spec}
        self._check_fence()
        what = f"remove scheduling gate from Pod {meta['namespace']}/{meta['name']}"
        stored = _decode(self._send("PATCH", POD_PATH, meta, body, what=what, content_type=MERGE_PATCH))
        self._done("ungate", object_key(pod))
        return stored

    def annotate_pod(self, pod: dict[str, Any], annotations: dict[str, str | None]) -> dict[str, Any]:
        """Merge-patch annotations (None removes one); annotations are ours alone, no version guard."""
        meta = pod["metadata"]
        self._check_fence()
        what = f"annotate Pod {meta['namespace']}/{meta['name']}"
        body = {"metadata": {"annotations": annotations}}
        stored = _decode(self._send("PATCH", POD_PATH, meta, body, what=what, content_type=MERGE_PATCH))
        self._done("annotate", object_key(pod))
        return stored

"""The Kueue admission check's I/O: one named thread that reads the cluster, decides with
``driver.controller.kueue.check`` and writes Workload and AdmissionCheck status (each write carries the
object's resourceVersion; a 409 is simply retried on the next pass), and places the pods of the
workloads it admitted when they arrive gated.

A pass (on every Workload event, see ``driver.controller.kueue.watch``, and every ``resync_seconds``):
1. ``Active=True`` on each AdmissionCheck whose ``spec.controllerName`` is ours;
2. per Workload whose entry for one of those checks is ``Pending`` while quota is reserved: plan it
   against the slices, the allocations and the reservations held, and answer Ready / Retry / Rejected;
3. per admitted Workload (our entry ``Ready``): once all its pods exist, carry our gate and no Kueue
   gate, and have their claims, write the planned allocations (a claim made from a pod's template
   reserved for that pod in the same write) and remove our gate; until then check
   that the reservation still holds and has not expired, else set ``Retry`` (Kueue evicts it and
   frees the quota rather than leaving pods gated forever).
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from driver.config import DEFAULT_POLICY
from driver.controller.kueue.check import (
    CONTROLLER_NAME,
    POD_SET_ANNOTATION,
    RESERVATION_ANNOTATION,
    Reservation,
    WorkloadProblem,
    build_active_condition,
    build_check_status,
    build_pod_set_updates,
    build_workload_claims,
    compute_backoff_seconds,
    decide_workload,
    find_check,
    foreign_gates,
    quota_reserved,
    reservation_problem,
)
from driver.controller.model.objects import (
    GATE,
    PLACED_ANNOTATION,
    allocation_node,
    is_deleting,
    object_key,
    pod_claim_refs,
    pod_consumer,
)
from driver.controller.sizing.hints import profile_shapes
from driver.controller.writes.writer import ApiWriter, HaltWrites
from driver.errors import ConflictError, FractionalError
from driver.kube import REQUEST_TIMEOUT_SECONDS, api_errors

__all__ = ["KueueAdmissionCheck", "KueueCheckSettings", "start_admission_check"]

log = logging.getLogger(__name__)

KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"


@dataclass(frozen=True, slots=True)
class KueueCheckSettings:
    policy: str = DEFAULT_POLICY
    topology_label: str = "topology.kubernetes.io/zone"
    hint_profiles: tuple[str, ...] = ()  # shapes for "would fit on more nodes"; empty: the cluster's own
    reservation_seconds: float = 600.0  # how long an admitted workload's placement is held for its pods
    resync_seconds: float = 5.0
    backoff_base_seconds: int = 15
    backoff_max_seconds: int = 600


def _json(response: Any) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(response.data)
    return loaded


class KueueAdmissionCheck:
    """Runs the check on a thread named ``kueue-check`` until ``stop`` is set."""

    def __init__(
        self,
        api_client: client.ApiClient,
        settings: KueueCheckSettings,
        *,
        stop: threading.Event,
        monotonic: Callable[[], float] = time.monotonic,
        now: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
        fence: threading.Event | None = None,
    ) -> None:
        self._api = api_client
        self._custom: Any = client.CustomObjectsApi(api_client)
        self._resource: Any = client.ResourceV1Api(api_client)
        self._core: Any = client.CoreV1Api(api_client)
        self._writer = ApiWriter(api_client, fence=fence)
        self._fence = fence  # set once leadership is lost: nothing more is written
        self._settings = settings
        self._stop = stop
        self._monotonic = monotonic
        self._now = now
        self.wake = threading.Event()
        self._reservations: dict[str, Reservation] = {}  # only the worker thread touches it
        self._shapes = profile_shapes(settings.hint_profiles) if settings.hint_profiles else []
        self._thread: threading.Thread | None = None
        self.passes = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kueue-check", daemon=True)
        self._thread.start()

    def join(self, timeout_seconds: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_seconds)

    def reservations(self) -> dict[str, Reservation]:
        return dict(self._reservations)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._writer.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.wake.clear()
            try:
                self.run_once()
            except HaltWrites:  # leadership lost mid-pass: the process is on its way out
                log.info("kueue check fenced")
            except FractionalError as error:  # API trouble: try again on the next pass
                log.warning("kueue check pass failed", extra={"reason": str(error)})
            except Exception:  # a bug: logged once here, the loop backs off and goes on
                log.exception("kueue check pass crashed")
            self.passes += 1
            self.wake.wait(self._settings.resync_seconds)

    # -- reads --------------------------------------------------------------------------------------

    def _list_custom(self, plural: str) -> list[dict[str, Any]]:
        with api_errors(f"list {plural}.{KUEUE_GROUP}"):
            if plural == "admissionchecks":
                response = self._custom.list_cluster_custom_object(
                    KUEUE_GROUP, KUEUE_VERSION, "admissionchecks",
                    _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS,
                )  # fmt: skip
            else:
                response = self._custom.list_cluster_custom_object(
                    KUEUE_GROUP, KUEUE_VERSION, "workloads",
                    _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS,
                )  # fmt: skip
        items: list[dict[str, Any]] = _json(response).get("items") or []
        return items

    def _cluster(self) -> tuple[list[dict[str, Any]], ...]:
        timeout = REQUEST_TIMEOUT_SECONDS
        with api_errors("list ResourceSlices"):
            slices = _json(
                self._resource.list_resource_slice(_preload_content=False, _request_timeout=timeout)
            )
        with api_errors("list DeviceClasses"):
            classes = _json(
                self._resource.list_device_class(_preload_content=False, _request_timeout=timeout)
            )
        with api_errors("list ResourceClaims"):
            claims = _json(
                self._resource.list_resource_claim_for_all_namespaces(
                    _preload_content=False, _request_timeout=timeout
                )
            )
        with api_errors("list Nodes"):
            nodes = _json(self._core.list_node(_preload_content=False, _request_timeout=timeout))
        with api_errors("list Pods"):
            pods = _json(
                self._core.list_pod_for_all_namespaces(_preload_content=False, _request_timeout=timeout)
            )
        return (
            slices.get("items") or [],
            classes.get("items") or [],
            claims.get("items") or [],
            nodes.get("items") or [],
            pods.get("items") or [],
        )

    def _templates(self, namespace: str) -> dict[str, dict[str, Any]]:
        with api_errors(f"list ResourceClaimTemplates in {namespace}"):
            listed = _json(
                self._resource.list_namespaced_resource_claim_template(
                    namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS
                )
            )
        return {str(t["metadata"]["name"]): t for t in listed.get("items") or ()}

    # -- the pass -----------------------------------------------------------------------------------

    def run_once(self) -> None:
        if self._fence is not None and self._fence.is_set():
            return
        checks = self._activate_checks()
        if not checks:
            return
        workloads = self._list_custom("workloads")
        slices, classes, claims, nodes, pods = self._cluster()
        live = {str(object_key(w)) for w in workloads}
        for key in [k for k in self._reservations if k not in live]:
            del self._reservations[key]  # the workload is gone
        for workload in workloads:
            entry = find_check(workload, checks)
            if entry is None or is_deleting(workload):
                continue
            key = str(object_key(workload))
            if entry.get("state") != "Ready":
                self._reservations.pop(key, None)  # evicted, requeued or refused: nothing held for it
            if entry.get("state") == "Pending" and quota_reserved(workload):
                self._plan(workload, str(entry["name"]), slices, classes, claims, nodes)
            elif entry.get("state") == "Ready":
                self._follow(workload, entry, slices, classes, claims, nodes, pods)

    def _activate_checks(self) -> set[str]:
        names = set()
        for check in self._list_custom("admissionchecks"):
            if (check.get("spec") or {}).get("controllerName") != CONTROLLER_NAME:
                continue
            names.add(str(check["metadata"]["name"]))
            conditions = build_active_condition(check, self._now())
            if conditions is None:
                continue
            body = {**check, "status": {**(check.get("status") or {}), "conditions": conditions}}
            try:
                with api_errors(f"update AdmissionCheck {check['metadata']['name']} status"):
                    self._custom.replace_cluster_custom_object_status(
                        KUEUE_GROUP, KUEUE_VERSION, "admissionchecks", check["metadata"]["name"], body,
                        _request_timeout=REQUEST_TIMEOUT_SECONDS,
                    )  # fmt: skip
                log.info("admission check active", extra={"admission_check": check["metadata"]["name"]})
            except ConflictError:
                self.wake.set()  # changed meanwhile: again on the next pass
        return names

    def _held(self, skip: str, claims: list[dict[str, Any]]) -> list[dict[str, Any]]:
        held = list(claims)
        for key, reservation in self._reservations.items():
            if key != skip:
                held.extend(reservation.as_claims())
        return held

    def _write_check(
        self, workload: dict[str, Any], check_name: str, state: str, message: str, **extra: Any
    ) -> bool:
        if self._fence is not None and self._fence.is_set():
            return False
        entries = build_check_status(
            workload, check_name, state=state, message=message, now=self._now(), **extra
        )
        body = {**workload, "status": {**(workload.get("status") or {}), "admissionChecks": entries}}
        meta = workload["metadata"]
        try:
            with api_errors(f"update Workload {meta['namespace']}/{meta['name']} status"):
                self._custom.replace_namespaced_custom_object_status(
                    KUEUE_GROUP, KUEUE_VERSION, meta["namespace"], "workloads", meta["name"], body,
                    _request_timeout=REQUEST_TIMEOUT_SECONDS,
                )  # fmt: skip
        except ConflictError:
            self.wake.set()
            return False
        log.info(
            "admission check state written",
            extra={
                "workload": f"{meta['namespace']}/{meta['name']}",
                "state": state,
                "reason": message[:300],
            },
        )
        return True

    def _plan(
        self,
        workload: dict[str, Any],
        check_name: str,
        slices: list[dict[str, Any]],
        classes: list[dict[str, Any]],
        claims: list[dict[str, Any]],
        nodes: list[dict[str, Any]],
    ) -> None:
        key = str(object_key(workload))
        started = time.perf_counter()
        try:
            wanted = build_workload_claims(workload, self._templates(workload["metadata"]["namespace"]))
        except WorkloadProblem as problem:
            self._write_check(workload, check_name, "Rejected", str(problem))
            return
        decision = decide_workload(
            wanted, slices=slices, classes=classes, allocated=self._held(key, claims), nodes=nodes,
            shapes=self._shapes, policy=self._settings.policy, topology_label=self._settings.topology_label,
        )  # fmt: skip
        log.info(
            "workload planned",
            extra={
                "workload": key,
                "state": decision.state,
                "seconds": round(time.perf_counter() - started, 4),
            },
        )
        if decision.state == "Ready":
            reservation = Reservation(
                workload=key, uid=str(workload["metadata"].get("uid", "")), pods=decision.pods,
                allocations=decision.allocations,
                expires_at=self._monotonic() + self._settings.reservation_seconds,
            )  # fmt: skip
            self._reservations[key] = reservation  # held before Kueue can act on Ready
            updates = build_pod_set_updates(workload, wanted.size)
            if not self._write_check(
                workload, check_name, "Ready", decision.message, pod_set_updates=updates
            ):
                del self._reservations[key]
            return
        if decision.state == "Retry":
            retries = int(find_check(workload, [check_name]).get("retryCount", 0) or 0)  # type: ignore[union-attr]
            delay = compute_backoff_seconds(
                retries,
                base_seconds=self._settings.backoff_base_seconds,
                max_seconds=self._settings.backoff_max_seconds,
            )
            self._write_check(workload, check_name, "Retry", decision.message, requeue_after_seconds=delay)
            return
        self._write_check(workload, check_name, "Rejected", decision.message)

    def _follow(
        self,
        workload: dict[str, Any],
        entry: dict[str, Any],
        slices: list[dict[str, Any]],
        classes: list[dict[str, Any]],
        claims: list[dict[str, Any]],
        nodes: list[dict[str, Any]],
        pods: list[dict[str, Any]],
    ) -> None:
        """An admitted workload: place its pods when all have arrived, else keep its reservation honest."""
        key = str(object_key(workload))
        mine = [
            p
            for p in pods
            if ((p.get("metadata") or {}).get("annotations") or {}).get(RESERVATION_ANNOTATION) == key
            and not is_deleting(p)
        ]
        reservation = self._reservations.get(key)
        size = sum(int(s.get("count", 1)) for s in (workload.get("spec") or {}).get("podSets") or ())
        if len(mine) >= size and not any(_has_our_gate(p) for p in mine):
            self._reservations.pop(key, None)  # placed (or placed by an earlier pass): nothing held
            return
        if reservation is None:
            if any(not _has_our_gate(p) and pod_claim_refs(p) for p in mine):
                return  # committed earlier (ungating is the commit point)
            # A restart lost it, or it was never ours in memory: plan again with what is free now.
            try:
                wanted = build_workload_claims(workload, self._templates(workload["metadata"]["namespace"]))
            except WorkloadProblem as error:
                self._retry(workload, entry, f"the reservation cannot be rebuilt: {error}")
                return
            decision = decide_workload(
                wanted, slices=slices, classes=classes, allocated=self._held(key, claims), nodes=nodes,
                shapes=self._shapes, policy=self._settings.policy,
                topology_label=self._settings.topology_label,
            )  # fmt: skip
            if decision.state != "Ready":
                self._retry(workload, entry, f"the reservation can no longer be honoured: {decision.message}")
                return
            reservation = Reservation(
                workload=key, uid=str(workload["metadata"].get("uid", "")), pods=decision.pods,
                allocations=decision.allocations,
                expires_at=self._monotonic() + self._settings.reservation_seconds,
            )  # fmt: skip
            self._reservations[key] = reservation
        own = {
            f"{p['metadata']['namespace']}/{ref.claim_name}"
            for p in mine
            for ref in pod_claim_refs(p)
            if ref.claim_name
        }  # claims a half-done placement of this very reservation already wrote
        others = [c for c in claims if str(object_key(c)) not in own]
        problem = reservation_problem(reservation, slices=slices, allocated=self._held(key, others))
        if problem:
            self._retry(workload, entry, f"the reservation can no longer be honoured: {problem}")
            return
        if len(mine) < len(reservation.pods) or any(foreign_gates(p) for p in mine):
            if self._monotonic() > reservation.expires_at:  # not all here, or Kueue still gates some
                self._retry(workload, entry, "the pods did not arrive while the reservation was held")
            return
        self._place(reservation, mine, claims)

    def _retry(self, workload: dict[str, Any], entry: dict[str, Any], message: str) -> None:
        key = str(object_key(workload))
        delay = compute_backoff_seconds(
            int(entry.get("retryCount", 0) or 0),
            base_seconds=self._settings.backoff_base_seconds,
            max_seconds=self._settings.backoff_max_seconds,
        )
        self._reservations.pop(key, None)  # not honoured: held for nobody from now on
        self._write_check(workload, str(entry["name"]), "Retry", message, requeue_after_seconds=delay)

    def _place(
        self, reservation: Reservation, arrived: list[dict[str, Any]], claims: list[dict[str, Any]]
    ) -> None:
        """Write the planned allocations onto the arrived pods' claims, then remove our gates."""
        by_key = {str(object_key(c)): c for c in claims}
        slots: dict[str, list[int]] = {}
        for index, planned in enumerate(reservation.pods):
            slots.setdefault(planned.pod_set, []).append(index)
        assignments: list[tuple[dict[str, Any], int]] = []
        for pod in sorted(arrived, key=lambda p: str(p["metadata"]["name"])):
            pod_set = ((pod["metadata"].get("annotations") or {}).get(POD_SET_ANNOTATION)) or ""
            free = slots.get(pod_set) or []
            if not free:
                log.warning("pod has no slot in the reservation", extra={"pod": str(object_key(pod))})
                return
            assignments.append((pod, free.pop(0)))
        writes: list[tuple[dict[str, Any], dict[str, Any], dict[str, str] | None]] = []
        placed_on: dict[str, str] = {}
        for pod, index in assignments:
            planned = reservation.pods[index]
            refs = {ref.entry: ref for ref in pod_claim_refs(pod)}
            for entry, allocation in zip(planned.entries, reservation.allocations[index], strict=True):
                ref = refs.get(entry)
                if ref is None or ref.claim_name is None:
                    return  # the claim is not created yet: the next pass
                claim = by_key.get(f"{pod['metadata']['namespace']}/{ref.claim_name}")
                if claim is None:
                    return
                writes.append((claim, allocation, _own_claim_consumer(pod, claim)))
                placed_on.setdefault(str(object_key(pod)), allocation_node(allocation) or "")
        try:
            for claim, allocation, consumer in writes:
                if (claim.get("status") or {}).get("allocation"):
                    continue  # written by an earlier pass
                self._writer.write_allocation(claim, allocation, reserved_for=consumer)
            for pod, _ in assignments:
                node = placed_on.get(str(object_key(pod)), "")
                self._writer.ungate_pod(pod, annotations={PLACED_ANNOTATION: node})
        except ConflictError:
            self.wake.set()  # changed meanwhile: re-read and carry on next pass
            return
        log.info(
            "reserved workload placed", extra={"workload": reservation.workload, "pods": len(assignments)}
        )
        self._reservations.pop(reservation.workload, None)


def _own_claim_consumer(pod: dict[str, Any], claim: dict[str, Any]) -> dict[str, str] | None:
    """The pod's ``status.reservedFor`` entry when the claim is the pod's own (made from its
    template: its controller owner is this pod), written with the allocation so that
    kube-scheduler's PreBind has nothing to write; None for any other claim (kube-scheduler
    reserves it)."""
    uid = (pod.get("metadata") or {}).get("uid")
    owner = next((o for o in claim["metadata"].get("ownerReferences") or () if o.get("controller")), None)
    if uid and owner is not None and owner.get("kind") == "Pod" and owner.get("uid") == uid:
        return pod_consumer(pod)
    return None


def _has_our_gate(pod: dict[str, Any]) -> bool:
    return any(g.get("name") == GATE for g in (pod.get("spec") or {}).get("schedulingGates") or ())


def start_admission_check(
    configuration: client.Configuration, settings: KueueCheckSettings, *, fence: threading.Event | None = None
) -> Callable[[float], None]:
    """Start the check and its Workload watch on their own ``ApiClient``; returns ``close(timeout)``.
    ``fence``: the controller's; once set (leadership lost) the check writes nothing more."""
    from driver.controller.kueue.watch import WorkloadWatch  # the watch module imports nothing of ours
    from driver.kube import new_api_client

    api = new_api_client(configuration)
    stop = threading.Event()
    check = KueueAdmissionCheck(api, settings, stop=stop, fence=fence)
    workload_watch = WorkloadWatch(api, wake=check.wake, stop=stop)
    check.start()
    workload_watch.start()
    log.info("kueue admission check started", extra={"controller_name": CONTROLLER_NAME})

    def close(timeout_seconds: float) -> None:
        stop.set()
        check.wake.set()
        workload_watch.interrupt()
        check.join(timeout_seconds)
        workload_watch.join(timeout_seconds)
        api.close()  # type: ignore[no-untyped-call]  # the client is untyped

    return close

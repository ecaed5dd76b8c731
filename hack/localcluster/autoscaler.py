"""A stand-in for cluster-autoscaler's ProvisioningRequest processing (test infrastructure): what it
does with a ``best-effort-atomic-scale-up.autoscaling.x-k8s.io`` request, read in its source at tag
``cluster-autoscaler-1.36.1``, with a node group provider (``nodegroups.py``, or a test's) to grow.

Each scan (its ``--scan-interval``, 10 s there) looks at the requests of that class and, for one
that is available for provisioning (no ``Provisioned`` condition yet, or ``Provisioned=False``
and its backoff over; never one ``Failed`` or ``Provisioned=True``):

- writes ``Accepted=True`` (``injector.go`` MarkAsAccepted);
- a PodTemplate it names is missing: ``Failed=True``, ``FailedToCreatePods``, for good;
- makes the pods (each podSet's template ``count`` times), reads the claims they name by
  ``resourceClaimName`` (a ``resourceClaimTemplateName`` is never resolved: such a pod fits nowhere,
  kubernetes/autoscaler#10065) and simulates them with our allocator, which follows
  kube-scheduler's rules, as its simulator runs kube-scheduler's plugins:
  - every pod fits on the nodes there and those coming (asked for, not Ready yet):
    ``Provisioned=True``, ``CapacityIsFound``;
  - else every remaining pod must fit on new nodes of **one** node group, copies of one of that
    group's Ready nodes with its ResourceSlices (a group without one shows no devices: #10277);
    within the group's maximum, the group is asked to grow: ``Provisioned=True``,
    ``CapacityIsProvisioned``, at once, before any node exists;
  - else ``Provisioned=False``, ``CapacityIsNotFound``, tried again after a backoff (1 minute,
    doubling to 10 there; ``initial_backoff``/``max_backoff`` here).
- ``booking_seconds`` (10 minutes there, hard-coded) after ``Provisioned=True``:
  ``BookingExpired=True``, ``CapacityReservationTimeExpired``.

A group's nodes asked for count as coming only while its scale-up is active: until each is Ready
with its ResourceSlices (a Ready node without them is unready to its DRA processor), or until
``max_node_provision_seconds`` (``--max-node-provision-time``, 15 minutes there) have passed. Then,
as seen with the real cluster-autoscaler 1.36.1 and a node whose agent never published, the
scale-up times out: the group is backed off (``group_backoff_seconds``,
``--initial-node-group-backoff-duration``, 5 minutes there), its target size is decreased by the
nodes still missing (a provider refuses that for a node that registered; it is only logged), and
the node no longer counts as coming: the next request that needs the room grows the group again.

It never writes ``CapacityRevoked`` (1.36 does not). What it leaves out: scale-down, the booking's
weight in other simulations, pods that are not in a request (gated pods never trigger a scale-up).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol, cast

from kubernetes import client

from driver.allocator import allocate
from driver.controller.gangs.nodefit import node_rejection
from driver.controller.sizing.hints import build_template, compute_hint, existing_node_shapes
from driver.kube import as_dict

__all__ = ["BEST_EFFORT_ATOMIC", "AutoscalerDouble", "GroupProvider"]

log = logging.getLogger(__name__)

BEST_EFFORT_ATOMIC = "best-effort-atomic-scale-up.autoscaling.x-k8s.io"
GROUP_LABEL = "fractional.dev/node-group"
REQUESTS = ("autoscaling.x-k8s.io", "v1")


class GroupProvider(Protocol):
    """What the double needs of a node group provider (cluster-autoscaler's CloudProvider)."""

    def groups(self) -> Sequence[Any]: ...  # each with .name and .max_size

    def target_size(self, group: str) -> int: ...

    def increase_size(self, group: str, delta: int) -> Any: ...

    def decrease_target_size(self, group: str, delta: int) -> None: ...


@dataclass
class _Seen:
    failures: int = 0
    retry_at: float = 0.0
    provisioned_at: float | None = None


@dataclass
class AutoscalerDouble:
    configuration: client.Configuration
    provider: GroupProvider
    scan_seconds: float = 1.0
    booking_seconds: float = 600.0
    initial_backoff: float = 60.0
    max_backoff: float = 600.0
    max_node_provision_seconds: float = 900.0
    group_backoff_seconds: float = 300.0
    clock: Callable[[], float] = time.monotonic
    scans: int = 0
    errors: list[str] = field(default_factory=list)
    timed_out: list[str] = field(default_factory=list)  # the groups whose scale-up timed out, in order
    _seen: dict[str, _Seen] = field(default_factory=dict)
    _scale_ups: dict[str, float] = field(default_factory=dict)  # group: when it was last asked to grow
    _backoff_until: dict[str, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> AutoscalerDouble:
        self._thread = threading.Thread(target=self._run, name="autoscaler-double", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        with client.ApiClient(self.configuration) as api:
            while not self._stop.is_set():
                try:
                    self.scan(api)
                except Exception as error:  # a scan that failed is logged and tried again, as it does
                    log.exception("autoscaler double: scan failed")
                    self.errors.append(str(error))
                self._stop.wait(self.scan_seconds)

    # -- one loop ----------------------------------------------------------------------------------

    def scan(self, api: client.ApiClient) -> None:
        self.scans += 1
        self._end_scale_ups(api)
        custom = client.CustomObjectsApi(api)
        listed = cast(dict[str, Any], custom.list_cluster_custom_object(*REQUESTS, "provisioningrequests"))
        for request in listed.get("items") or ():
            if (request.get("spec") or {}).get("provisioningClassName") != BEST_EFFORT_ATOMIC:
                continue  # another class: not ours to answer (no condition written)
            self._step(api, request)

    def _step(self, api: client.ApiClient, request: dict[str, Any]) -> None:
        meta = request["metadata"]
        key = str(meta["uid"])
        seen = self._seen.setdefault(key, _Seen())
        conditions = {c["type"]: c for c in (request.get("status") or {}).get("conditions") or ()}
        now = self.clock()
        if _true(conditions, "Failed") or _true(conditions, "BookingExpired"):
            return
        if _true(conditions, "Provisioned"):
            if seen.provisioned_at is not None and now - seen.provisioned_at >= self.booking_seconds:
                expired = ("CapacityReservationTimeExpired", "Capacity reservation time expired")
                self._write(api, request, conditions, "BookingExpired", "True", *expired)
            return
        if "Provisioned" in conditions and now < seen.retry_at:
            return  # Provisioned=False: its backoff is not over
        self._write(api, request, conditions, "Accepted", "True", "Accepted",
                    "ProvisioningRequest is accepted by ClusterAutoscaler")  # fmt: skip
        pods = self._pods(api, request)
        if pods is None:
            self._write(api, request, conditions, "Failed", "True", "FailedToCreatePods",
                        "Provisioning Request's pods cannot be created: missing pod templates")  # fmt: skip
            return
        found, group, nodes = self._simulate(api, pods)
        if found:
            seen.provisioned_at = now
            self._write(api, request, conditions, "Provisioned", "True", "CapacityIsFound",
                        "Capacity is found in the cluster")  # fmt: skip
            return
        if group is not None:
            self.provider.increase_size(group, nodes)
            self._scale_ups[group] = now
            seen.provisioned_at = now
            log.info(
                "autoscaler double: grew %s by %d for %s/%s", group, nodes, meta["namespace"], meta["name"]
            )
            self._write(api, request, conditions, "Provisioned", "True", "CapacityIsProvisioned",
                        "Capacity is found in the cluster")  # fmt: skip
            return
        seen.failures += 1
        seen.retry_at = now + min(self.max_backoff, self.initial_backoff * 2 ** (seen.failures - 1))
        self._write(api, request, conditions, "Provisioned", "False", "CapacityIsNotFound",
                    "Capacity is not found, CA will try to find it later.")  # fmt: skip

    def _end_scale_ups(self, api: client.ApiClient) -> None:
        """A scale-up ends when its nodes are all Ready with their slices, or times out."""
        if not self._scale_ups:
            return
        nodes = [as_dict(n) for n in client.CoreV1Api(api).list_node().items]
        slices = [as_dict(s) for s in client.ResourceV1Api(api).list_resource_slice().items]
        now = self.clock()
        for group, asked_at in list(self._scale_ups.items()):
            missing = self.provider.target_size(group) - len(_ready_with_slices(group, nodes, slices))
            if missing <= 0:
                del self._scale_ups[group]
            elif now - asked_at >= self.max_node_provision_seconds:
                del self._scale_ups[group]
                self._backoff_until[group] = now + self.group_backoff_seconds
                self.timed_out.append(group)
                log.warning("autoscaler double: scale-up of %s timed out, %d node(s) missing", group, missing)
                try:
                    self.provider.decrease_target_size(group, -missing)
                except Exception as error:  # logged, as it logs a provider's refusal
                    log.info("autoscaler double: %s refused to decrease its target size: %s", group, error)

    # -- the simulation ----------------------------------------------------------------------------

    def _pods(self, api: client.ApiClient, request: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The request's pods, each podSet's template ``count`` times (None: a template is missing)."""
        core = client.CoreV1Api(api)
        namespace = request["metadata"]["namespace"]
        pods = []
        for index, pod_set in enumerate(request["spec"].get("podSets") or ()):
            name = pod_set["podTemplateRef"]["name"]
            try:
                template = as_dict(core.read_namespaced_pod_template(name, namespace))
            except client.ApiException as error:
                if error.status == 404:
                    return None
                raise
            for replica in range(int(pod_set.get("count") or 1)):
                spec = template["template"].get("spec") or {}
                pods.append({"metadata": {"name": f"{request['metadata']['name']}-{index}-{replica}",
                                          "namespace": namespace}, "spec": spec})  # fmt: skip
        return pods

    def _simulate(self, api: client.ApiClient, pods: list[dict[str, Any]]) -> tuple[bool, str | None, int]:
        """(fits on the nodes there; else the group to grow and by how many nodes, or None)."""
        core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
        namespace = pods[0]["metadata"]["namespace"]
        listed = [as_dict(c) for c in resource.list_namespaced_resource_claim(namespace).items]
        claims_by_name = {c["metadata"]["name"]: c for c in listed}
        claims: list[dict[str, Any]] = []
        index_of: dict[str, int] = {}
        pod_groups: list[list[int]] = []
        for pod in pods:
            group = []
            for entry in pod["spec"].get("resourceClaims") or ():
                name = entry.get("resourceClaimName")
                if not name or name not in claims_by_name:
                    return False, None, 0  # a template it cannot resolve, or no such claim: fits nowhere
                if name not in index_of:
                    index_of[name] = len(claims)
                    claims.append(claims_by_name[name])
                group.append(index_of[name])
            pod_groups.append(group)
        pending = [i for i, c in enumerate(claims) if not (c.get("status") or {}).get("allocation")]
        if not pending:
            return True, None, 0
        nodes = [as_dict(n) for n in core.list_node().items]
        slices = [as_dict(s) for s in resource.list_resource_slice().items]
        classes = [as_dict(c) for c in resource.list_device_class().items]
        allocated = [as_dict(c) for c in resource.list_resource_claim_for_all_namespaces().items
                     if c.status and c.status.allocation]  # fmt: skip
        # Each group's template: a copy of one of its Ready nodes with its slices (none: no devices
        # seen in that group, as from zero: #10277). Its upcoming nodes (asked for, not Ready yet)
        # count as capacity there already, as cluster-autoscaler's simulation counts them.
        # Its scheduler filters (NodeAffinity, TaintToleration): a node that refuses one of the pods
        # takes none of them; a group whose template node refuses one is no option, nor are its
        # coming nodes (copies of that node).
        refused = {str(n["metadata"]["name"]) for n in nodes if any(node_rejection(pod, n) for pod in pods)}
        templates: dict[str, Any] = {}
        for group in self.provider.groups():
            # Ready with its slices: a Ready node without them is unready to cluster-autoscaler
            # (its DRA processor), so neither a template nor capacity, only still coming, and that
            # only while the group's scale-up is active ("no active scale-up request" there).
            ready = _ready_with_slices(group.name, nodes, slices)
            shapes = existing_node_shapes(slices, ready[:1])
            if not shapes or str(ready[0]["metadata"]["name"]) in refused:
                continue
            templates[group.name] = shapes[0]
            active = group.name in self._scale_ups
            upcoming = self.provider.target_size(group.name) - len(ready) if active else 0
            log.info("autoscaler double: group %s: %d node(s) Ready with slices, %d coming (scale-up %s)",
                     group.name, len(ready), max(0, upcoming), "active" if active else "none")  # fmt: skip
            for index in range(max(0, upcoming)):
                name = f"upcoming-{group.name}-{index}"
                extra, labels = build_template(shapes[0], name)
                slices = [*slices, *extra]
                nodes = [*nodes, {"metadata": {"name": name, "labels": labels}}]
        # First the nodes there and those coming, with no new node (its filterOutSchedulable): the
        # search below may prefer a new node to a coming one, which would grow the group twice.
        labels = {str(n["metadata"]["name"]): dict(n["metadata"].get("labels") or {}) for n in nodes}
        placed = allocate(claims, slices=slices, classes=classes, allocated=allocated, nodes=labels,
                          pod_groups=pod_groups, exclude_nodes=refused)  # fmt: skip
        if placed is not None:
            return True, None, 0
        best: tuple[int, str] | None = None
        for group in self.provider.groups():
            if group.name not in templates or self._backoff_until.get(group.name, 0.0) > self.clock():
                continue  # no template, or backed off after a scale-up that timed out
            hint = compute_hint(
                claims, pod_groups=pod_groups, shapes=[templates[group.name]], cluster_slices=slices,
                classes=classes, allocated_claims=allocated, nodes=nodes, exclude_nodes=frozenset(refused),
                max_nodes=group.max_size,
            )  # fmt: skip
            if hint is None:
                continue
            if not hint.node_names:
                return True, None, 0  # all of it fits on the nodes there and those coming
            count = len(hint.node_names)
            if self.provider.target_size(group.name) + count > group.max_size:
                continue  # the all-or-nothing scale-up would be capped by the maximum: not an option
            if best is None or count < best[0]:
                best = (count, group.name)
        return (False, best[1], best[0]) if best else (False, None, 0)

    def _write(self, api: client.ApiClient, request: dict[str, Any], conditions: dict[str, dict[str, Any]],
               kind: str, status: str, reason: str, message: str) -> None:  # fmt: skip
        """Set one condition (its transition time kept while its status stays) in the status."""
        old = conditions.get(kind)
        stamp = (
            old["lastTransitionTime"]
            if old and old.get("status") == status
            else datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        )
        conditions[kind] = {"type": kind, "status": status, "reason": reason, "message": message,
                            "lastTransitionTime": stamp}  # fmt: skip
        meta = request["metadata"]
        client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
            *REQUESTS, meta["namespace"], "provisioningrequests", meta["name"],
            {"status": {"conditions": list(conditions.values())}},
        )  # fmt: skip


def _true(conditions: dict[str, dict[str, Any]], kind: str) -> bool:
    return (conditions.get(kind) or {}).get("status") == "True"


def _ready(node: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (node.get("status") or {}).get("conditions") or ()
    )


def _ready_with_slices(
    group: str, nodes: Sequence[dict[str, Any]], slices: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The group's nodes that are Ready and have published ResourceSlices."""
    with_slices = {s["spec"].get("nodeName") for s in slices}
    return [
        n for n in nodes
        if (n["metadata"].get("labels") or {}).get(GROUP_LABEL) == group and _ready(n)
        and n["metadata"]["name"] in with_slices
    ]  # fmt: skip

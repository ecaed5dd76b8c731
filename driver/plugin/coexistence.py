"""Coexistence with NVIDIA's device plugin and NVIDIA's DRA driver (docs/install.md, "Coexistence
with NVIDIA's device plugin and DRA driver").

One GPU handed out by two allocators is given out twice: a pod of ``nvidia.com/gpu: 1`` and a
share of ours land on the same device, neither knowing of the other. The publisher asks this
module, on every sync (its periodic relist: the Node it already reads, and every ResourceSlice of
the node), which of our GPUs are claimed elsewhere:

- **the device plugin**: the Node advertises ``nvidia.com/gpu`` (or the plugin's renamed
  ``nvidia.com/gpu.shared`` and MIG ``nvidia.com/mig-<profile>`` resources) with a capacity above
  0. The capacity is only a count and does not say which GPUs the plugin hands out, so every GPU
  of the node counts as claimed;
- **another DRA driver**: a ResourceSlice of this node from any other driver has a device with a
  string attribute ``uuid`` or ``parentUUID`` (unqualified, or qualified by any domain, such as
  ``gpu.nvidia.com/uuid``) equal to one of our GPU UUIDs. NVIDIA's DRA driver publishes ``uuid``
  on its ``gpu`` devices and, on MIG devices, the MIG UUID as ``uuid`` and the GPU's as
  ``parentUUID``: a MIG device of our GPU claims the GPU too. UUIDs compare case-insensitively and
  without NVML's ``GPU-`` prefix (the dra-example-driver writes ``gpu-<uuid>``).

Each change of the answer is said loudly, once: one log line, one Event on the Node (Warning
``GPUsClaimedElsewhere`` while a conflict stands, Normal ``GPUsNoLongerClaimedElsewhere`` when it is
gone) and the gauge ``fractional_plugin_gpus_claimed_elsewhere{node,claimed_by}``. With
``withhold`` (the chart's ``agent.coexistence.withholdClaimedGPUs``, on by default) the claimed
GPUs are left out of the pool until the conflict clears; the next sync then publishes them again.

``compute_conflicts`` and the builders are pure; ``CoexistenceMonitor`` is the adapter that logs,
sets the gauge and writes the Events.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from enum import StrEnum
from typing import Any

from kubernetes import client
from kubernetes.utils.quantity import parse_quantity

from driver import DRIVER_NAME
from driver.errors import FractionalError
from driver.inventory.model import NodeInventory
from driver.kube.client import REQUEST_TIMEOUT_SECONDS, new_api_client
from driver.kube.errors import api_errors
from driver.plugin.metrics import GPUS_CLAIMED_ELSEWHERE

__all__ = [
    "REASON_CLAIMED_ELSEWHERE",
    "REASON_NO_LONGER_CLAIMED",
    "ClaimedBy",
    "CoexistenceMonitor",
    "CoexistenceReport",
    "Conflict",
    "build_conflict_message",
    "build_node_event",
    "compute_conflicts",
    "compute_report",
    "parse_device_plugin_capacity",
]

log = logging.getLogger(__name__)

REASON_CLAIMED_ELSEWHERE = "GPUsClaimedElsewhere"
REASON_NO_LONGER_CLAIMED = "GPUsNoLongerClaimedElsewhere"
COMPONENT = "fractional-dra-agent"
EVENT_NAMESPACE = "default"  # where the kubelet records Node events too (a Node has no namespace)
MAX_EVENT_MESSAGE_CHARS = 1000  # kube-apiserver truncates Event messages at 1024 characters
_UUID_ATTRIBUTES = frozenset({"uuid", "parentuuid"})  # compared lower-case, domain stripped


class ClaimedBy(StrEnum):
    """Who else hands out our GPUs (the gauge's ``claimed_by`` label)."""

    DEVICE_PLUGIN = "device-plugin"
    DRA_DRIVER = "dra-driver"


@dataclass(frozen=True, slots=True)
class Conflict:
    """Our GPUs (device names, sorted) also handed out by ``claimed_by``; ``source`` says where that
    was seen: the Node's resources (``nvidia.com/gpu=8``) or another driver's pool
    (``driver gpu.nvidia.com, pool node-1``). Pools, not slice names, so that the other driver
    rewriting its slices is not a new conflict."""

    claimed_by: ClaimedBy
    source: str
    gpus: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CoexistenceReport:
    """Every conflict of one node, and the GPUs (device names) left out of the pool for them."""

    node_name: str
    conflicts: tuple[Conflict, ...] = ()
    withheld: tuple[str, ...] = ()

    @property
    def gpus(self) -> tuple[str, ...]:
        """Our GPUs claimed elsewhere, by any source."""
        return tuple(sorted({gpu for conflict in self.conflicts for gpu in conflict.gpus}))

    def count(self, claimed_by: ClaimedBy) -> int:
        return len({gpu for c in self.conflicts if c.claimed_by is claimed_by for gpu in c.gpus})


# -- pure -----------------------------------------------------------------------------------------


def _is_device_plugin_resource(name: str) -> bool:
    # NVIDIA's device plugin: nvidia.com/gpu; with sharing renamed, nvidia.com/gpu.shared; with the
    # mixed MIG strategy, nvidia.com/mig-<profile>[.shared]. nvidia.com/gpu.present and friends are
    # labels, never resources.
    return name == "nvidia.com/gpu" or name.startswith(("nvidia.com/gpu.", "nvidia.com/mig-"))


def parse_device_plugin_capacity(node: Mapping[str, Any] | None) -> dict[str, int]:
    """The device plugin's resources in the Node's ``status.capacity`` with a count above 0.

    A plugin that went away leaves its resource at 0 until the kubelet restarts: no conflict."""
    capacity = ((node or {}).get("status") or {}).get("capacity") or {}
    found: dict[str, int] = {}
    for name, quantity in capacity.items():
        if not _is_device_plugin_resource(str(name)):
            continue
        try:
            count = int(Decimal(parse_quantity(quantity)))  # type: ignore[no-untyped-call]
        except (ValueError, ArithmeticError, InvalidOperation):
            continue  # not a quantity: the server validates capacity, nothing to say about it
        if count > 0:
            found[str(name)] = count
    return found


def _normalize_uuid(value: str) -> str:
    text = value.strip().lower()
    return text.removeprefix("gpu-")


def compute_conflicts(
    *,
    node: Mapping[str, Any] | None,
    slices: Sequence[Mapping[str, Any]],
    inventory: NodeInventory,
    driver: str = DRIVER_NAME,
) -> tuple[Conflict, ...]:
    """Which of ``inventory``'s GPUs are also handed out by the device plugin (per ``node``) or by
    another driver (per ``slices``, ResourceSlices of any driver; ours are skipped). Sorted."""
    if not inventory.gpus:
        return ()
    conflicts: list[Conflict] = []
    plugin = parse_device_plugin_capacity(node)
    if plugin:
        source = ", ".join(f"{name}={count}" for name, count in sorted(plugin.items()))
        all_gpus = tuple(sorted(gpu.name for gpu in inventory.gpus))
        conflicts.append(Conflict(claimed_by=ClaimedBy.DEVICE_PLUGIN, source=source, gpus=all_gpus))
    ours = {_normalize_uuid(gpu.uuid): gpu.name for gpu in inventory.gpus if gpu.uuid}
    by_pool: dict[str, set[str]] = {}
    for item in slices:
        spec = item.get("spec") or {}
        other = str(spec.get("driver") or "")
        if not other or other == driver:
            continue
        pool = str((spec.get("pool") or {}).get("name") or "")
        for device in spec.get("devices") or ():
            for key, value in (device.get("attributes") or {}).items():
                if str(key).rsplit("/", 1)[-1].lower() not in _UUID_ATTRIBUTES:
                    continue
                text = value.get("string") if isinstance(value, Mapping) else None
                if isinstance(text, str) and (name := ours.get(_normalize_uuid(text))) is not None:
                    by_pool.setdefault(f"driver {other}, pool {pool}", set()).add(name)
    for source, names in sorted(by_pool.items()):
        conflicts.append(Conflict(claimed_by=ClaimedBy.DRA_DRIVER, source=source, gpus=tuple(sorted(names))))
    return tuple(conflicts)


def compute_report(
    *,
    node: Mapping[str, Any] | None,
    slices: Sequence[Mapping[str, Any]],
    inventory: NodeInventory,
    withhold: bool,
    driver: str = DRIVER_NAME,
) -> CoexistenceReport:
    """The conflicts and, with ``withhold``, every GPU they name as withheld."""
    conflicts = compute_conflicts(node=node, slices=slices, inventory=inventory, driver=driver)
    claimed = tuple(sorted({gpu for conflict in conflicts for gpu in conflict.gpus}))
    return CoexistenceReport(
        node_name=inventory.node_name, conflicts=conflicts, withheld=claimed if withhold else ()
    )


def build_conflict_message(report: CoexistenceReport, inventory: NodeInventory) -> str:
    """What the Event and the log say: the GPUs (name and UUID), who else hands them out, and what
    the agent does about it."""
    uuids = {gpu.name: gpu.uuid for gpu in inventory.gpus}
    if not report.conflicts:
        return (
            "no GPU of this node is handed out by NVIDIA's device plugin or another DRA driver any more; "
            "all of them are published"
        )
    parts = []
    for conflict in report.conflicts:
        gpus = ", ".join(f"{name} ({uuids.get(name, '?')})" for name in conflict.gpus)
        if conflict.claimed_by is ClaimedBy.DEVICE_PLUGIN:
            parts.append(
                f"the Node advertises {conflict.source} (NVIDIA's device plugin), which does not say "
                f"which GPUs it hands out, so all of them count: {gpus}"
            )
        else:
            parts.append(f"{conflict.source} publishes {gpus}")
    action = (
        f"{DRIVER_NAME} does not publish {', '.join(report.withheld)} until the conflict clears"
        if report.withheld
        else f"{DRIVER_NAME} still publishes them (withholding is off): one GPU can be given out twice"
    )
    return f"GPUs claimed elsewhere: {'; '.join(parts)}; {action}. See docs/install.md, Coexistence"


def build_node_event(
    *, node_name: str, reason: str, message: str, warning: bool, now: datetime
) -> dict[str, Any]:
    """A core v1 Event about the Node, as the kubelet records its own: in namespace ``default``,
    ``involvedObject.uid`` the node's name (what ``kubectl describe node`` searches for)."""
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if len(message) > MAX_EVENT_MESSAGE_CHARS:
        message = message[: MAX_EVENT_MESSAGE_CHARS - 3] + "..."
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{node_name[:200]}.", "namespace": EVENT_NAMESPACE},
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_name},
        "reason": reason,
        "message": message,
        "type": "Warning" if warning else "Normal",
        "source": {"component": COMPONENT, "host": node_name},
        "reportingComponent": "fractional.dev/agent",
        "reportingInstance": node_name,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


# -- the adapter ----------------------------------------------------------------------------------


class CoexistenceMonitor:
    """The publisher's coexistence check (``driver.publisher.CoexistenceCheck``) for one node.

    ``review`` runs on the publisher's thread, once per sync attempt: it computes the report, and
    when it differs from the last one logs one line, sets the gauge and writes one Event. An Event
    that could not be written is written at the next review (the log line is not repeated). Its
    ``ApiClient`` is built from ``configuration`` on first use; ``close()`` closes it.
    """

    def __init__(
        self,
        configuration: client.Configuration,
        node_name: str,
        *,
        withhold: bool = True,
        driver: str = DRIVER_NAME,
    ) -> None:
        self._configuration = configuration
        self.node_name = node_name
        self.withhold = withhold
        self.driver = driver
        self._lock = threading.Lock()  # guards the fields below; never held across an API call
        self._api_client: Any = None  # client.ApiClient (its close() is untyped)
        self._last: CoexistenceReport = CoexistenceReport(node_name=node_name)
        self._pending_event: dict[str, Any] | None = None
        self.events_written = 0

    @property
    def report(self) -> CoexistenceReport:
        """The last report reviewed."""
        with self._lock:
            return self._last

    def review(
        self,
        *,
        node: Mapping[str, Any] | None,
        slices: Sequence[Mapping[str, Any]],
        inventory: NodeInventory,
    ) -> frozenset[str]:
        """The GPUs (device names) to leave out of the pool now; says so when that changed."""
        report = compute_report(
            node=node, slices=slices, inventory=inventory, withhold=self.withhold, driver=self.driver
        )
        for claimed_by in ClaimedBy:
            GPUS_CLAIMED_ELSEWHERE.labels(node=self.node_name, claimed_by=claimed_by.value).set(
                report.count(claimed_by)
            )
        with self._lock:
            changed = report != self._last
            self._last = report
            if changed:
                message = build_conflict_message(report, inventory)
                self._pending_event = build_node_event(
                    node_name=self.node_name,
                    reason=REASON_CLAIMED_ELSEWHERE if report.conflicts else REASON_NO_LONGER_CLAIMED,
                    message=message,
                    warning=bool(report.conflicts),
                    now=datetime.now(UTC),
                )
            event = self._pending_event
        if changed:
            extra = {
                "node": self.node_name,
                "gpus": list(report.gpus),
                "withheld": list(report.withheld),
                "claimed_by": [f"{c.claimed_by.value}: {c.source}" for c in report.conflicts],
            }
            if report.conflicts:
                log.warning("gpus claimed elsewhere", extra=extra)
            else:
                log.info("gpus no longer claimed elsewhere", extra=extra)
        if event is not None:
            self._write_event(event)
        return frozenset(report.withheld)

    def close(self) -> None:
        with self._lock:
            api_client, self._api_client = self._api_client, None
        if api_client is not None:
            api_client.close()

    def _write_event(self, event: dict[str, Any]) -> None:
        with self._lock:
            if self._api_client is None:
                self._api_client = new_api_client(self._configuration)
            core: Any = client.CoreV1Api(self._api_client)  # Any: we send a dict, read nothing back
        try:
            with api_errors(f"create Event for Node {self.node_name}"):
                core.create_namespaced_event(
                    EVENT_NAMESPACE, event, _request_timeout=REQUEST_TIMEOUT_SECONDS, _preload_content=False
                )
        except FractionalError as error:  # transient, or refused (RBAC): the next review tries again
            log.warning(
                "node event not written; retrying at the next sync",
                extra={"node": self.node_name, "reason": event["reason"], "error": str(error)},
            )
            return
        with self._lock:
            if self._pending_event is event:  # not replaced by a newer review meanwhile
                self._pending_event = None
            self.events_written += 1

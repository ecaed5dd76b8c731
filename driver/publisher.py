"""Keeps the node's ResourceSlice pool equal to its inventory (the upstream Go ``resourceslice``
controller's semantics, ``dynamic-resource-allocation/resourceslice/resourceslicecontroller.go``).

Per sync: list this node's slices of our driver; slices of older generations (or other pools) are
obsolete; existing slices are matched to desired ones by their set of device names; the pool
generation is kept when nothing new is created and at most one matched slice changed, otherwise it
is bumped and every slice rewritten. Nothing is written when nothing changed. Every write is read
back: if the server dropped ``allowMultipleAllocations`` (DRAConsumableCapacity off) one warning
is logged and ``sharing_enabled`` turns False. A 409 re-lists and retries (bounded).

Coexistence: the list is of every driver's slices of the node. With a ``coexistence`` check (the
agent's ``driver.plugin.coexistence.CoexistenceMonitor``) each sync hands it the Node read for the
owner reference and the other drivers' slices; the GPUs it names are left out of the pool, and come
back at the first sync after it stops naming them (docs/install.md, Coexistence).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Protocol

from kubernetes import client
from kubernetes.utils.quantity import parse_quantity

from driver import DRIVER_NAME
from driver.errors import ConflictError, FractionalError, NotFoundError
from driver.inventory.model import NodeInventory
from driver.kube.client import REQUEST_TIMEOUT_SECONDS, get_json, new_api_client
from driver.kube.errors import api_errors
from driver.slices import (
    MAX_DEVICES_PER_SLICE,
    Taints,
    build_device_chunks,
    build_devices,
    build_pool_slices,
    slice_device_names,
)

__all__ = ["SHARING_OFF_WARNING", "CoexistenceCheck", "PublishResult", "SlicePublisher"]

log = logging.getLogger(__name__)

Obj = dict[str, Any]
InventorySource = Callable[[], tuple[NodeInventory, Taints | None]]

SHARING_OFF_WARNING = (
    "sharing is off on this cluster: the DRAConsumableCapacity feature gate is disabled; "
    "devices are published as exclusive"
)
_SHARING = "allowMultipleAllocations"
_TAINTS = "taints"
_WAKE_POLL_SECONDS = 0.25  # how often the loop notices request_sync() while it waits on stop


class CoexistenceCheck(Protocol):
    """Which GPUs to leave out of the pool because something else hands them out."""

    def review(
        self,
        *,
        node: Mapping[str, Any] | None,
        slices: Sequence[Mapping[str, Any]],
        inventory: NodeInventory,
    ) -> frozenset[str]:
        """Device names to withhold, given the Node (None: not found) and the other drivers'
        ResourceSlices of the node; called once per sync attempt, on the publishing thread."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class PublishResult:
    """What one ``publish`` did; ``writes`` is created + updated + deleted; ``withheld``: GPUs left out
    of the pool by the coexistence check (device names)."""

    created: int
    updated: int
    deleted: int
    unchanged: int
    generation: int
    slice_count: int
    sharing_enabled: bool
    attempts: int = 1
    withheld: tuple[str, ...] = ()

    @property
    def writes(self) -> int:
        return self.created + self.updated + self.deleted


@dataclass(frozen=True, slots=True)
class _Plan:
    generation: int
    desired: list[Obj]  # in chunk order
    updates: list[tuple[Obj, Obj]]  # (existing, desired)
    creates: list[Obj]
    deletes: list[Obj]  # obsolete first, then surplus
    unchanged: int
    withheld: tuple[str, ...] = ()


class SlicePublisher:
    """Publishes one node's pool. ``publish`` runs on the caller's thread; ``run`` is the resync loop.

    Each thread gets its own ``ApiClient`` built from ``configuration``; ``close()`` closes them
    (and the ``coexistence`` check, which it owns from then on).
    """

    def __init__(
        self,
        configuration: client.Configuration,
        node_name: str,
        *,
        driver: str = DRIVER_NAME,
        resync_seconds: float = 30.0,
        max_devices_per_slice: int = MAX_DEVICES_PER_SLICE,
        max_attempts: int = 5,
        retry_seconds: float = 1.0,
        coexistence: CoexistenceCheck | None = None,
    ) -> None:
        self._configuration = configuration
        self.node_name = node_name
        self.driver = driver
        self.resync_seconds = resync_seconds
        self.max_devices_per_slice = max_devices_per_slice
        self.max_attempts = max_attempts
        self.retry_seconds = retry_seconds
        self._coexistence = coexistence
        self._local = threading.local()
        self._lock = threading.Lock()  # guards the fields below; never held across an API call
        self._clients: list[Any] = []  # client.ApiClient (its close() is untyped)
        self._dropped: frozenset[str] = frozenset()
        self._warned: set[str] = set()
        self._node_missing_warned = False
        self._wake = threading.Event()

    # -- public ---------------------------------------------------------------------------------

    @property
    def sharing_enabled(self) -> bool:
        with self._lock:
            return _SHARING not in self._dropped

    def publish(self, inventory: NodeInventory, taints: Taints | None = None) -> PublishResult:
        """Make the pool match ``inventory`` (+ device taints); re-lists and retries on 409."""
        if inventory.node_name != self.node_name:
            raise ValueError(
                f"inventory is for node {inventory.node_name!r}, publisher for {self.node_name!r}"
            )
        node = self._read_node()
        for attempt in range(1, self.max_attempts + 1):
            try:
                plan = self._sync(inventory, taints, node)
            except ConflictError as error:
                log.info(
                    "slice write conflicted; re-listing",
                    extra={
                        "node": self.node_name,
                        "attempt": f"{attempt}/{self.max_attempts}",
                        "error": str(error),
                    },
                )
                if attempt == self.max_attempts:
                    raise
                continue
            return PublishResult(
                created=len(plan.creates),
                updated=len(plan.updates),
                deleted=len(plan.deletes),
                unchanged=plan.unchanged,
                generation=plan.generation,
                slice_count=len(plan.desired),
                sharing_enabled=self.sharing_enabled,
                attempts=attempt,
                withheld=plan.withheld,
            )
        raise AssertionError("unreachable: the loop returns or raises")

    def request_sync(self) -> None:
        """Ask the ``run`` loop to publish now (e.g. a device's health changed)."""
        self._wake.set()

    def run(
        self,
        stop: threading.Event,
        inventory_source: InventorySource,
        on_published: Callable[[PublishResult], None] | None = None,
    ) -> None:
        """Publish now, then every ``resync_seconds`` (slices deleted behind our back come back),
        sooner after ``request_sync()``; failures back off up to ``resync_seconds``. Returns on ``stop``.
        ``on_published`` is called after each successful publish (the agent's readiness)."""
        delay = self.retry_seconds
        while not stop.is_set():
            self._wake.clear()
            try:
                inventory, taints = inventory_source()
                result = self.publish(inventory, taints)
                if on_published is not None:
                    on_published(result)
                wait = self.resync_seconds
                delay = self.retry_seconds
            except FractionalError as error:  # transient (connection, 409, 5xx) or refused: back off
                log.warning(
                    "slice publish failed; retrying", extra={"node": self.node_name, "error": str(error)}
                )
                wait, delay = delay, min(delay * 2, self.resync_seconds)
            except Exception:  # the loop's one catch-all: a bug is logged once and retried after backoff
                log.exception("slice publish failed unexpectedly", extra={"node": self.node_name})
                wait, delay = delay, min(delay * 2, self.resync_seconds)
            self._wait(stop, wait)
        self.close()

    def start(self, stop: threading.Event, inventory_source: InventorySource) -> threading.Thread:
        """``run`` on a named thread."""
        thread = threading.Thread(
            target=self.run,
            args=(stop, inventory_source),
            name=f"slice-publisher-{self.node_name}",
            daemon=True,
        )
        thread.start()
        return thread

    def close(self) -> None:
        """Close the ``ApiClient`` of every thread that used this publisher, and the coexistence check."""
        with self._lock:
            clients, self._clients = self._clients, []
        for api_client in clients:
            api_client.close()
        if self._coexistence is not None:
            self._coexistence.close()

    def __enter__(self) -> SlicePublisher:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- sync -----------------------------------------------------------------------------------

    def _sync(self, inventory: NodeInventory, taints: Taints | None, node: Obj | None) -> _Plan:
        existing = self._list()
        ours = [item for item in existing if (item.get("spec") or {}).get("driver") == self.driver]
        withheld: frozenset[str] = frozenset()
        if self._coexistence is not None:
            others = [item for item in existing if (item.get("spec") or {}).get("driver") != self.driver]
            withheld = self._coexistence.review(node=node, slices=others, inventory=inventory)
        devices = [
            device for device in build_devices(inventory, taints=taints) if device["name"] not in withheld
        ]
        chunks = build_device_chunks(devices, max_devices_per_slice=self.max_devices_per_slice)
        plan = self._plan(ours, chunks, _node_uid(node), withheld=tuple(sorted(withheld)))
        for obsolete in plan.deletes:
            self._delete(obsolete)
        for current, desired in plan.updates:
            self._write_back(desired, self._replace(current, desired))
        for desired in plan.creates:
            self._write_back(desired, self._create(desired))
        if plan.updates or plan.creates or plan.deletes:
            log.info(
                "slices published",
                extra={
                    "node": self.node_name,
                    "generation": plan.generation,
                    "slices_created": len(plan.creates),  # not "created": a reserved LogRecord attribute
                    "slices_updated": len(plan.updates),
                    "slices_deleted": len(plan.deletes),
                },
            )
        return plan

    def _plan(
        self, existing: list[Obj], chunks: list[list[Obj]], node_uid: str | None, *, withheld: tuple[str, ...]
    ) -> _Plan:
        ours = [item for item in existing if _pool(item).get("name") == self.node_name]
        foreign = [item for item in existing if _pool(item).get("name") != self.node_name]
        current_generation = max((int(_pool(item).get("generation") or 0) for item in ours), default=0)
        obsolete = [item for item in ours if int(_pool(item).get("generation") or 0) < current_generation]
        current = [item for item in ours if int(_pool(item).get("generation") or 0) == current_generation]

        matches: dict[int, Obj] = {}
        if len(current) == 1 and len(chunks) == 1:
            matches[0] = current[0]
        else:
            by_names: dict[frozenset[str], list[Obj]] = {}
            for item in current:
                by_names.setdefault(slice_device_names(item), []).append(item)
            for index, chunk in enumerate(chunks):
                candidates = by_names.get(frozenset(device["name"] for device in chunk))
                if candidates:
                    matches[index] = candidates.pop(0)
        matched_ids = {id(item) for item in matches.values()}
        surplus = [item for item in current if id(item) not in matched_ids]

        def desired_at(generation: int) -> list[Obj]:
            return build_pool_slices(
                chunks, node_name=self.node_name, generation=generation, driver=self.driver, node_uid=node_uid
            )

        generation = current_generation or 1
        desired = desired_at(generation)
        with self._lock:
            dropped = self._dropped
        changed = [index for index, item in matches.items() if not _same(desired[index], item, dropped)]
        new = [index for index in range(len(chunks)) if index not in matches]
        if current and (new or len(changed) > 1):
            generation = current_generation + 1
            desired = desired_at(generation)
            changed = list(matches)
        return _Plan(
            generation=generation,
            desired=desired,
            updates=[(matches[index], desired[index]) for index in sorted(changed)],
            creates=[desired[index] for index in new],
            deletes=foreign + obsolete + surplus,
            unchanged=len(matches) - len(changed),
            withheld=withheld,
        )

    # -- API calls ------------------------------------------------------------------------------

    def _api(self) -> Any:  # client.ResourceV1Api; Any because raw (_preload_content=False) results are read
        api = getattr(self._local, "resource_api", None)
        if api is None:
            api_client = new_api_client(self._configuration)
            with self._lock:
                self._clients.append(api_client)
            self._local.api_client = api_client
            api = self._local.resource_api = client.ResourceV1Api(api_client)
        return api

    def _list(self) -> list[Obj]:
        """Every driver's slices of this node: ours to sync, the others for the coexistence check
        (one list either way; a node has a handful of slices)."""
        selector = f"spec.nodeName={self.node_name}"
        with api_errors(f"list ResourceSlices of node {self.node_name}"):
            response = self._api().list_resource_slice(
                field_selector=selector, _request_timeout=REQUEST_TIMEOUT_SECONDS, _preload_content=False
            )
        items: list[Obj] = _body(response).get("items") or []
        # A server without the field selector would return everything: filter again, cheaply.
        return [item for item in items if (item.get("spec") or {}).get("nodeName") == self.node_name]

    def _create(self, desired: Obj) -> Obj:
        with api_errors(f"create ResourceSlice for node {self.node_name}"):
            response = self._api().create_resource_slice(
                body=desired, _request_timeout=REQUEST_TIMEOUT_SECONDS, _preload_content=False
            )
        return _body(response)

    def _replace(self, current: Obj, desired: Obj) -> Obj:
        name = current["metadata"]["name"]
        metadata = {
            key: value
            for key, value in current["metadata"].items()
            if key in ("name", "resourceVersion", "labels", "annotations", "finalizers", "ownerReferences")
        }
        if "ownerReferences" in desired["metadata"]:
            metadata["ownerReferences"] = desired["metadata"]["ownerReferences"]
        body = {**desired, "metadata": metadata}
        try:
            with api_errors(f"update ResourceSlice {name}"):
                response = self._api().replace_resource_slice(
                    name=name, body=body, _request_timeout=REQUEST_TIMEOUT_SECONDS, _preload_content=False
                )
        except NotFoundError as error:
            # Deleted since we listed it: by the garbage collector when it belonged to an earlier
            # Node of this name (a node replaced under the same name), or by another writer. A
            # conflict like any other: re-list and plan again.
            raise ConflictError(f"update ResourceSlice {name}: deleted meanwhile ({error})") from error
        return _body(response)

    def _delete(self, item: Obj) -> None:
        name = item["metadata"]["name"]
        options = client.V1DeleteOptions(
            preconditions=client.V1Preconditions(
                uid=item["metadata"].get("uid"), resource_version=item["metadata"].get("resourceVersion")
            )
        )
        try:
            with api_errors(f"delete ResourceSlice {name}"):
                self._api().delete_resource_slice(
                    name=name, body=options, _request_timeout=REQUEST_TIMEOUT_SECONDS, _preload_content=False
                )
        except NotFoundError:
            pass  # already gone: that is what we wanted

    def _read_node(self) -> Obj | None:
        """The Node, for its UID (``ownerReferences``) and the coexistence check (its capacity),
        read on every publish (one GET per sync); None when it does not exist.

        Never cached: a Node deleted and re-created (or an API server that restarted empty) has a
        new UID, and slices owned by the old one would be garbage-collected, re-created, and
        collected again. A Node missing now may exist at the next sync: the slices then get
        their owner. The warning is logged once per disappearance, not on every sync.
        """
        api_client = self._api().api_client
        try:
            with api_errors(f"get Node {self.node_name}"):
                node = get_json(
                    api_client, f"/api/v1/nodes/{self.node_name}", what=f"get Node {self.node_name}"
                )
        except NotFoundError:
            with self._lock:
                warn, self._node_missing_warned = not self._node_missing_warned, True
            if warn:
                log.warning(
                    "node not found; slices are published without an owner reference",
                    extra={"node": self.node_name},
                )
            return None
        with self._lock:
            self._node_missing_warned = False
        return node

    # -- read-back ------------------------------------------------------------------------------

    def _write_back(self, written: Obj, returned: Obj) -> None:
        """Compare what we wrote with what the server kept; note (and warn once about) dropped fields."""
        kept = {device.get("name"): device for device in (returned.get("spec") or {}).get("devices") or []}
        sent = (written.get("spec") or {}).get("devices") or []
        lost: set[str] = set()
        seen: set[str] = set()
        for device in sent:
            back = kept.get(device["name"], {})
            for field in (_SHARING, _TAINTS):
                if device.get(field):
                    seen.add(field)
                    if not back.get(field):
                        lost.add(field)
        with self._lock:
            before = self._dropped
            self._dropped = frozenset((before - seen) | lost)
            warn = [field for field in lost if field not in self._warned]
            self._warned.update(warn)
            back_on = _SHARING in before and _SHARING in seen and _SHARING not in lost
        if _SHARING in warn:
            log.warning(SHARING_OFF_WARNING, extra={"node": self.node_name})
        if _TAINTS in warn:
            log.warning(
                "device taints are off on this cluster: the DRADeviceTaints feature gate is disabled",
                extra={"node": self.node_name},
            )
        if back_on:
            log.info("sharing is on again: allowMultipleAllocations was kept", extra={"node": self.node_name})

    def _wait(self, stop: threading.Event, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not stop.is_set() and not self._wake.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            stop.wait(min(remaining, _WAKE_POLL_SECONDS))


# -- comparison -----------------------------------------------------------------------------------


def _body(response: Any) -> Obj:
    """The JSON body of a raw (``_preload_content=False``) response: exactly what the server sent."""
    document: Obj = json.loads(response.data)
    return document


def _node_uid(node: Mapping[str, Any] | None) -> str | None:
    uid = ((node or {}).get("metadata") or {}).get("uid")
    return str(uid) if uid else None


def _pool(item: Mapping[str, Any]) -> Mapping[str, Any]:
    return (item.get("spec") or {}).get("pool") or {}


def _same(desired: Obj, existing: Obj, dropped: frozenset[str]) -> bool:
    """Equal in content: spec (quantities compared by value, server-filled fields ignored, fields the
    server is known to drop left out) and, when we set them, owner references."""
    wanted, found = _strip(desired["spec"], dropped), existing.get("spec") or {}
    # Fast path: the server usually returns exactly what we wrote (plain dict equality runs in C).
    if wanted != found and _comparable(wanted) != _comparable(found):
        return False
    wanted_owners = desired["metadata"].get("ownerReferences")
    if wanted_owners is None:
        return True
    return _owners(wanted_owners) == _owners(existing.get("metadata", {}).get("ownerReferences") or [])


def _owners(references: Sequence[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    return sorted(
        (ref.get("apiVersion"), ref.get("kind"), ref.get("name"), ref.get("uid"), bool(ref.get("controller")))
        for ref in references
    )


def _strip(spec: Obj, dropped: frozenset[str]) -> Obj:
    if not dropped:
        return spec
    devices = []
    for device in spec.get("devices") or []:
        device = dict(device)
        if _SHARING in dropped:
            device.pop(_SHARING, None)
            device["capacity"] = {
                key: {k: v for k, v in capacity.items() if k != "requestPolicy"}
                for key, capacity in (device.get("capacity") or {}).items()
            }
        if _TAINTS in dropped:
            device.pop(_TAINTS, None)
        devices.append(device)
    return {**spec, "devices": devices}


def _comparable(value: Any, key: str = "") -> Any:
    """Drop empty/None values and taints' ``timeAdded``; quantities under ``capacity`` by value."""
    if isinstance(value, dict):  # JSON values: plain dicts and lists (cheaper than the Mapping ABC)
        out = {}
        for child_key, child in value.items():
            if child_key == "timeAdded":
                continue
            normalized = _comparable(
                child, "capacity" if key == "capacity" or child_key == "capacity" else child_key
            )
            if normalized in (None, [], {}):
                continue
            out[child_key] = normalized
        return out
    if isinstance(value, list):
        return [_comparable(item, key) for item in value]
    if key == "capacity" and isinstance(value, str):
        try:
            return Decimal(parse_quantity(value)).normalize()  # type: ignore[no-untyped-call]
        except (ValueError, ArithmeticError):
            return value
    return value

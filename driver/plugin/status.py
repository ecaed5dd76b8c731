"""``ResourceClaim.status.devices`` (KEP-4817): what this node prepared, written back to the claim.

Pure part: ``build_device_statuses`` turns prepared devices into ``AllocatedDeviceStatus`` dicts
(driver, pool, device, shareID; a ``Ready=True`` condition; ``data`` with the share's limits and
sharing backend for GPUs; ``networkData.interfaceName`` for NICs), ``merge_device_statuses`` puts
them beside the entries other drivers wrote, ``without_driver_statuses`` takes ours out again.
``build_refused_statuses`` turns a refused share (``ShareRefusal``: over the GPU's capacity, or a
sharing backend that cannot join its shares) into entries for the refused device with a
``Ready=False`` condition, reason ``ShareRefused`` and the claim's error as message: the allocation
controller, which watches claims, replaces the pod so that its claim is allocated anew.

Adapter: ``ClaimStatusWriter`` runs the writes on its own thread (``claim-status``), off the kubelet's
RPC path and outside every ``DeviceState`` lock. Decision: **a status write never fails a prepare or
an unprepare.** The kubelet does not read ``status.devices``; it is information for users and
tools. So the DRA service only enqueues an intent ("these devices are prepared" / "unprepared") and
answers the kubelet at once; the writer then GETs the claim, merges, and replaces the status with
the claim's ``resourceVersion``. A 409 is retried at once with a fresh GET, a transient error
(connection, 429, 5xx) after a backoff, both up to ``max_attempts``; then the intent is dropped and
counted (``fractional_plugin_claim_status_writes_total{result="failed"}``) and logged once. A claim
that is gone (404), replaced (other UID) or no longer allocated is skipped. Intents for one claim
coalesce: only the latest one is written (an unprepare right after a prepare writes nothing if the
prepare's write had not happened yet). Removal after unprepare is a JSON merge patch of
``status.devices`` carrying the ``resourceVersion`` (only the list is sent; an empty list removes the
field). Intents still queued when the agent stops are dropped (logged): the status is best effort,
and the next prepare of the claim writes it again.

Refusals are written once: the kubelet retries a refused prepare for as long as the pod exists, and
a refusal equal to the one last written for that claim UID (same device, share ids and message) is
not queued again. A later prepare of the claim that succeeds replaces the refusal with its ``Ready``
entries; an unprepare removes it with the rest of ours.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from driver import DRIVER_NAME
from driver.errors import ConflictError, FractionalError, NotFoundError, TransientError
from driver.inventory.model import NIC
from driver.plugin.claims import ClaimRef, decode_claim_json
from driver.plugin.devices import DeviceKind, PreparedDevice
from driver.plugin.metrics import CLAIM_STATUS_WRITES_TOTAL

if TYPE_CHECKING:
    from kubernetes import client

__all__ = [
    "READY_REASON",
    "REFUSED_REASON",
    "ClaimStatusWriter",
    "ShareRefusal",
    "build_device_statuses",
    "build_refused_statuses",
    "merge_device_statuses",
    "without_driver_statuses",
]

log = logging.getLogger(__name__)

READY_REASON = "Prepared"
REFUSED_REASON = "ShareRefused"  # the allocation controller acts on it (driver.controller.preemption.refusal)
MAX_REFUSALS_REMEMBERED = 4096  # claim UIDs whose refusal was written (kubelet retries write nothing)
MAX_CONDITION_MESSAGE_CHARS = 1024
MIB = 1024 * 1024

Obj = dict[str, Any]
StatusKey = tuple[str | None, str | None, str | None, str | None]


def _status_key(entry: Mapping[str, Any]) -> StatusKey:
    """The list-map key of ``status.devices``: (driver, pool, device, shareID)."""
    return (entry.get("driver"), entry.get("pool"), entry.get("device"), entry.get("shareID"))


def _timestamp(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _message(device: PreparedDevice, node: str) -> str:
    share = device.share
    if device.kind is DeviceKind.NIC or share is None:
        text = f"prepared on node {node}"
    elif share.whole_gpu:
        text = f"prepared on node {node}: whole GPU {share.gpu_uuid}"
    else:
        text = (
            f"prepared on node {node}: {share.memory_bytes // MIB} MiB and {share.compute_percent}% compute "
            f"of {share.gpu_uuid}, enforced by {device.backend or 'none'}"
        )
    return text[:MAX_CONDITION_MESSAGE_CHARS]


def _data(device: PreparedDevice, nic: NIC | None) -> Obj | None:
    share = device.share
    if share is not None:
        return {
            "uuid": share.gpu_uuid,
            "memoryLimitBytes": share.memory_bytes,
            "computePercent": share.compute_percent,
            "wholeGPU": share.whole_gpu,
            "backend": device.backend or "none",
        }
    if nic is not None and nic.rdma_device:
        return {"rdmaDevice": nic.rdma_device}
    return None


def _network_data(nic: NIC | None) -> Obj | None:
    if nic is None or not nic.if_name:
        return None
    data: Obj = {"interfaceName": nic.if_name}
    if nic.mac_address:
        data["hardwareAddress"] = nic.mac_address
    return data


def build_device_statuses(
    devices: Sequence[PreparedDevice],
    *,
    node: str,
    now: datetime,
    generation: int | None = None,
    nics: Mapping[str, NIC] | None = None,
    previous: Sequence[Mapping[str, Any]] = (),
    driver: str = DRIVER_NAME,
) -> list[Obj]:
    """Pure: one ``AllocatedDeviceStatus`` per prepared device, in the devices' order.

    ``nics``: the node's NICs by device name (``networkData``: interface name and MAC; ``data``:
    the RDMA device). ``previous``: the claim's current ``status.devices``; a ``Ready`` condition
    that was already ``True`` keeps its ``lastTransitionTime`` (metav1.Condition: it changes only
    when the status does), so a repeated prepare builds the same entries and needs no write.
    """
    nics = nics or {}
    earlier: dict[StatusKey, str] = {}
    for old in previous:
        for old_condition in old.get("conditions") or ():
            if old_condition.get("type") == "Ready" and old_condition.get("status") == "True":
                earlier[_status_key(old)] = str(old_condition.get("lastTransitionTime"))
    statuses: list[Obj] = []
    seen: set[StatusKey] = set()
    for device in devices:
        entry: Obj = {"driver": driver, "pool": device.pool, "device": device.device}
        if device.share_id is not None:
            entry["shareID"] = device.share_id
        key = _status_key(entry)
        if key in seen:
            continue
        seen.add(key)
        condition: Obj = {
            "type": "Ready",
            "status": "True",
            "reason": READY_REASON,
            "message": _message(device, node),
            "lastTransitionTime": earlier.get(key) or _timestamp(now),
        }
        if generation is not None:
            condition["observedGeneration"] = generation
        entry["conditions"] = [condition]
        nic = nics.get(device.device) if device.kind is DeviceKind.NIC else None
        data = _data(device, nic)
        if data is not None:
            entry["data"] = data
        network = _network_data(nic)
        if network is not None:
            entry["networkData"] = network
        statuses.append(entry)
    return statuses


@dataclass(frozen=True, slots=True)
class ShareRefusal:
    """A share this node refused to prepare: the device (``pool``/``device``), the share ids of the
    claim's results on it (the status entries' keys; None for a whole device) and the claim's error."""

    pool: str
    device: str
    share_ids: tuple[str | None, ...]
    message: str


def build_refused_statuses(
    refusal: ShareRefusal,
    *,
    now: datetime,
    generation: int | None = None,
    previous: Sequence[Mapping[str, Any]] = (),
    driver: str = DRIVER_NAME,
) -> list[Obj]:
    """Pure: one ``AllocatedDeviceStatus`` per refused result, each with ``Ready=False`` (reason
    ``ShareRefused``, the claim's error as message). A ``Ready=False`` condition already there keeps
    its ``lastTransitionTime``, so the same refusal builds the same entries."""
    earlier: dict[StatusKey, str] = {}
    for old in previous:
        for old_condition in old.get("conditions") or ():
            if old_condition.get("type") == "Ready" and old_condition.get("status") == "False":
                earlier[_status_key(old)] = str(old_condition.get("lastTransitionTime"))
    statuses: list[Obj] = []
    for share_id in dict.fromkeys(refusal.share_ids):
        entry: Obj = {"driver": driver, "pool": refusal.pool, "device": refusal.device}
        if share_id is not None:
            entry["shareID"] = share_id
        condition: Obj = {
            "type": "Ready",
            "status": "False",
            "reason": REFUSED_REASON,
            "message": refusal.message[:MAX_CONDITION_MESSAGE_CHARS],
            "lastTransitionTime": earlier.get(_status_key(entry)) or _timestamp(now),
        }
        if generation is not None:
            condition["observedGeneration"] = generation
        entry["conditions"] = [condition]
        statuses.append(entry)
    return statuses


def merge_device_statuses(
    existing: Sequence[Mapping[str, Any]], ours: Sequence[Mapping[str, Any]], *, driver: str = DRIVER_NAME
) -> list[Obj]:
    """Pure: other drivers' entries as they were (same order), then ours replacing all of ours."""
    return [dict(entry) for entry in existing if entry.get("driver") != driver] + [dict(e) for e in ours]


def without_driver_statuses(existing: Sequence[Mapping[str, Any]], *, driver: str = DRIVER_NAME) -> list[Obj]:
    """Pure: ``existing`` without ``driver``'s entries."""
    return [dict(entry) for entry in existing if entry.get("driver") != driver]


def _allocated_keys(body: Mapping[str, Any]) -> set[StatusKey]:
    allocation = (body.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    return {_status_key(result) for result in results if isinstance(result, Mapping)}


@dataclass(frozen=True, slots=True)
class _Intent:
    ref: ClaimRef
    devices: tuple[PreparedDevice, ...] | None  # None: unprepared (or refused), remove our entries
    refusal: ShareRefusal | None = None  # refused: our entries become the refusal's

    @property
    def operation(self) -> str:
        if self.refusal is not None:
            return "refuse"
        return "remove" if self.devices is None else "write"


class ClaimStatusWriter:
    """Writes ``status.devices`` for prepared claims and removes it after unprepare (see module doc).

    ``start()`` the ``claim-status`` thread; ``prepared``/``unprepared`` only enqueue and never block
    on the API; ``close()`` ends the thread. ``connect`` gives it the API configuration (the agent
    loads the client after its sockets serve); intents wait in the queue until then.
    """

    def __init__(
        self,
        *,
        node: str,
        nics: Mapping[str, NIC] | None = None,
        configuration: client.Configuration | None = None,
        max_attempts: int = 5,
        retry_seconds: float = 0.2,
        max_retry_seconds: float = 5.0,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        driver: str = DRIVER_NAME,
    ) -> None:
        self._node = node
        self._nics = dict(nics or {})
        self._configuration = configuration
        self._max_attempts = max_attempts
        self._retry_seconds = retry_seconds
        self._max_retry_seconds = max_retry_seconds
        self._clock = clock
        self._driver = driver
        self._changed = threading.Condition()  # guards the fields below
        self._pending: dict[str, _Intent] = {}  # claim UID -> latest intent
        self._order: collections.deque[str] = collections.deque()
        self._busy = False
        self._closed = False
        self._refusals: collections.OrderedDict[str, ShareRefusal] = collections.OrderedDict()  # written
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._api: Any = None

    # -- public --------------------------------------------------------------------------------

    def connect(self, configuration: client.Configuration) -> None:
        with self._changed:
            self._configuration = configuration
            self._changed.notify_all()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="claim-status", daemon=True)
        self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        with self._changed:
            self._closed = True
            self._stop.set()
            dropped = len(self._pending)
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        if dropped:
            log.info("claim status writes dropped at shutdown", extra={"claims": dropped})

    def prepared(self, ref: ClaimRef, devices: tuple[PreparedDevice, ...]) -> None:
        self._enqueue(_Intent(ref, devices))

    def unprepared(self, ref: ClaimRef) -> None:
        self._enqueue(_Intent(ref, None))

    def refused(self, ref: ClaimRef, refusal: ShareRefusal) -> None:
        """Record the refusal on the claim, unless it is the one last written (a kubelet retry)."""
        with self._changed:
            if self._refusals.get(ref.uid) == refusal and ref.uid not in self._pending:
                return
        self._enqueue(_Intent(ref, None, refusal))

    def wait_idle(self, timeout: float) -> bool:
        """True once nothing is queued or being written (tests, benchmarks)."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._pending and not self._busy, timeout)

    # -- queue ---------------------------------------------------------------------------------

    def _enqueue(self, intent: _Intent) -> None:
        with self._changed:
            if self._closed:
                return
            if intent.ref.uid not in self._pending:
                self._order.append(intent.ref.uid)
            self._pending[intent.ref.uid] = intent
            self._changed.notify_all()

    def _next(self) -> _Intent | None:
        with self._changed:
            self._busy = False
            self._changed.notify_all()
            self._changed.wait_for(
                lambda: self._closed or (bool(self._order) and self._configuration is not None)
            )
            if self._closed:
                return None
            uid = self._order.popleft()
            self._busy = True
            return self._pending.pop(uid)

    def _run(self) -> None:
        while (intent := self._next()) is not None:
            try:
                result = self._write(intent)
            except Exception:  # the loop's one catch-all: a bug must not end status writing
                log.exception("claim status write failed unexpectedly", extra={"claim": intent.ref.key})
                result = "failed"
            self._remember(intent, result)
            CLAIM_STATUS_WRITES_TOTAL.labels(operation=intent.operation, result=result).inc()
        if self._api is not None:
            self._api.api_client.close()
            self._api = None
        with self._changed:
            self._busy = False
            self._changed.notify_all()

    def _remember(self, intent: _Intent, result: str) -> None:
        """Which refusal the claim now shows: the one just written, or none after any other intent
        (a prepare or an unprepare replaced ours) or a refusal that was not written."""
        with self._changed:
            uid = intent.ref.uid
            self._refusals.pop(uid, None)
            if intent.refusal is not None and result in ("ok", "unchanged"):
                self._refusals[uid] = intent.refusal
                while len(self._refusals) > MAX_REFUSALS_REMEMBERED:
                    self._refusals.popitem(last=False)

    # -- one intent ----------------------------------------------------------------------------

    def _write(self, intent: _Intent) -> str:
        """``ok`` | ``unchanged`` | ``gone`` | ``failed`` (logged here)."""
        delay = self._retry_seconds
        error: FractionalError | None = None
        for attempt in range(1, self._max_attempts + 1):
            try:
                return self._attempt(intent)
            except NotFoundError:
                return "gone"
            except ConflictError as conflict:  # someone wrote the claim in between: GET again now
                error = conflict
            except TransientError as transient:
                error = transient
                log.info(
                    "claim status write retried",
                    extra={"claim": intent.ref.key, "attempt": attempt, "error": str(transient)},
                )
                if self._stop.wait(delay):
                    break
                delay = min(delay * 2, self._max_retry_seconds)
            except FractionalError as refused:  # 4xx: the API refuses the object; retrying cannot help
                error = refused
                break
        log.warning(
            "claim status not written",
            extra={"claim": intent.ref.key, "operation": intent.operation, "error": str(error)},
        )
        return "failed"

    def _attempt(self, intent: _Intent) -> str:
        ref = intent.ref
        body = self._get(ref)
        if (body.get("metadata") or {}).get("uid") != ref.uid:
            return "gone"  # replaced by a new claim of the same name: not ours to touch
        status = body.get("status") or {}
        existing = [entry for entry in status.get("devices") or [] if isinstance(entry, Mapping)]
        if intent.refusal is not None:
            allocated = _allocated_keys(body)
            ours = build_refused_statuses(
                intent.refusal,
                now=self._clock(),
                generation=(body.get("metadata") or {}).get("generation"),
                previous=existing,
                driver=self._driver,
            )
            ours = [entry for entry in ours if _status_key(entry) in allocated]
            if not ours:
                return "gone"  # deallocated (or reallocated) since the refused prepare
            wanted = merge_device_statuses(existing, ours, driver=self._driver)
        elif intent.devices is None:
            wanted = without_driver_statuses(existing, driver=self._driver)
        else:
            allocated = _allocated_keys(body)
            ours = build_device_statuses(
                intent.devices,
                node=self._node,
                now=self._clock(),
                generation=(body.get("metadata") or {}).get("generation"),
                nics=self._nics,
                previous=existing,
                driver=self._driver,
            )
            ours = [entry for entry in ours if _status_key(entry) in allocated]
            if not ours:
                return "gone"  # deallocated (or reallocated) since the prepare
            wanted = merge_device_statuses(existing, ours, driver=self._driver)
        if wanted == existing:
            return "unchanged"
        if intent.devices is None and intent.refusal is None:
            self._patch(ref, body, wanted)
        else:
            self._replace(ref, body, wanted)
        return "ok"

    # -- API (the only calls) ------------------------------------------------------------------

    def _client(self) -> Any:
        """A ``ResourceV1Api`` on this thread's own ``ApiClient`` (only the writer thread calls it)."""
        if self._api is None:
            from kubernetes import client

            from driver.kube.client import new_api_client

            assert self._configuration is not None  # _next() waits for connect()
            self._api = client.ResourceV1Api(new_api_client(self._configuration))
        return self._api

    def _get(self, ref: ClaimRef) -> Obj:
        from driver.kube.client import REQUEST_TIMEOUT_SECONDS
        from driver.kube.errors import api_errors

        with api_errors(f"get ResourceClaim {ref.key}"):
            response = self._client().read_namespaced_resource_claim(
                ref.name, ref.namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS
            )
            data = response.data
        return dict(decode_claim_json(data, ref.key))  # bounded like every read of a claim

    def _replace(self, ref: ClaimRef, body: Obj, devices: list[Obj]) -> None:
        from driver.kube.client import REQUEST_TIMEOUT_SECONDS
        from driver.kube.errors import api_errors

        status = dict(body.get("status") or {})
        if devices:
            status["devices"] = devices
        else:
            status.pop("devices", None)
        updated = {**body, "status": status}  # carries metadata.resourceVersion: a stale one gets 409
        with api_errors(f"update ResourceClaim {ref.key} status.devices"):
            response = self._client().replace_namespaced_resource_claim_status(
                ref.name,
                ref.namespace,
                updated,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            )
            written = len(response.data)  # read the body: the connection goes back to the pool
        log.debug("claim status written", extra={"claim": ref.key, "response_bytes": written})

    def _patch(self, ref: ClaimRef, body: Obj, devices: list[Obj]) -> None:
        from driver.kube.client import REQUEST_TIMEOUT_SECONDS
        from driver.kube.errors import api_errors

        patch = {
            "metadata": {"resourceVersion": (body.get("metadata") or {}).get("resourceVersion")},
            "status": {"devices": devices or None},  # null removes the field (RFC 7386)
        }
        with api_errors(f"patch ResourceClaim {ref.key} status.devices"):
            response = self._client().patch_namespaced_resource_claim_status(
                ref.name,
                ref.namespace,
                patch,
                _content_type="application/merge-patch+json",
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            )
            written = len(response.data)  # read the body: the connection goes back to the pool
        log.debug("claim status written", extra={"claim": ref.key, "response_bytes": written})

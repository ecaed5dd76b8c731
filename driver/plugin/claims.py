"""ResourceClaims as the node agent sees them: a pure parser and the one API read.

The kubelet only sends ``{namespace, uid, name}``; the plugin GETs the claim (resource.k8s.io/v1)
itself, outside any lock, and checks that it is the same object (UID) and allocated. Parsing is a
pure function of the API-shaped dict, so tests and the checkpoint logic never need the API.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType

from driver import DRIVER_NAME
from driver.errors import ClaimError, NotFoundError, TransientError

if TYPE_CHECKING:
    from kubernetes import client

__all__ = [
    "AllocationResult",
    "Claim",
    "ClaimReader",
    "ClaimRef",
    "ClaimUID",
    "base_request_name",
    "parse_claim",
]

ClaimUID = NewType("ClaimUID", str)


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """What the kubelet sends for one claim."""

    namespace: str
    name: str
    uid: ClaimUID

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class AllocationResult:
    """One ``status.allocation.devices.results[index]`` entry."""

    index: int
    request: str
    driver: str
    pool: str
    device: str
    share_id: str | None = None
    admin_access: bool = False
    consumed_capacity: tuple[tuple[str, str], ...] = ()  # (name, quantity string)

    @property
    def field(self) -> str:
        return f"status.allocation.devices.results[{self.index}]"

    def consumed(self, name: str) -> str | None:
        return next((value for key, value in self.consumed_capacity if key == name), None)


@dataclass(frozen=True, slots=True, eq=False)
class Claim:
    """An allocated claim; ``results`` holds only this driver's results, in API order."""

    ref: ClaimRef
    results: tuple[AllocationResult, ...]
    body: Mapping[str, Any]  # the API object, for opaque-config decoding (driver.plugin.gpuconfig)

    @property
    def uid(self) -> ClaimUID:
        return self.ref.uid

    @property
    def key(self) -> str:
        return self.ref.key


def base_request_name(request: str) -> str:
    """``req/sub`` -> ``req``: the kubelet wants the claim's request, not the subrequest."""
    return request.split("/", 1)[0]


def _parse_result(index: int, raw: Mapping[str, Any], claim_key: str) -> AllocationResult:
    field = f"status.allocation.devices.results[{index}]"
    missing = [name for name in ("request", "driver", "pool", "device") if not raw.get(name)]
    if missing:
        raise ClaimError(claim=claim_key, field=f"{field}.{missing[0]}", problem="required but missing")
    consumed = raw.get("consumedCapacity") or {}
    if not isinstance(consumed, Mapping):
        raise ClaimError(claim=claim_key, field=f"{field}.consumedCapacity", problem="must be a map")
    return AllocationResult(
        index=index,
        request=str(raw["request"]),
        driver=str(raw["driver"]),
        pool=str(raw["pool"]),
        device=str(raw["device"]),
        share_id=str(raw["shareID"]) if raw.get("shareID") else None,
        admin_access=bool(raw.get("adminAccess")),
        consumed_capacity=tuple(sorted((str(key), str(value)) for key, value in consumed.items())),
    )


def parse_claim(body: Mapping[str, Any], ref: ClaimRef, *, driver: str = DRIVER_NAME) -> Claim:
    """Check the fetched object against the kubelet's reference and keep ``driver``'s results.

    Raises ``ClaimError`` when the claim was replaced (other UID), is not allocated, or has no
    result for ``driver`` (the kubelet batches claims per driver, so it should never send one).
    """
    metadata = body.get("metadata") or {}
    uid = metadata.get("uid")
    if uid != ref.uid:
        raise ClaimError(
            claim=ref.key,
            field="metadata.uid",
            problem=f"expected {ref.uid}, found {uid} (the claim was replaced)",
        )
    allocation = (body.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(claim=ref.key, field="status.allocation", problem="the claim is not allocated")
    raw_results = (allocation.get("devices") or {}).get("results") or []
    results = tuple(
        _parse_result(index, raw, ref.key)
        for index, raw in enumerate(raw_results)
        if isinstance(raw, Mapping) and raw.get("driver") == driver
    )
    if not results:
        drivers = sorted({str(raw.get("driver")) for raw in raw_results if isinstance(raw, Mapping)})
        raise ClaimError(
            claim=ref.key,
            field="status.allocation.devices.results",
            problem=f"no device of driver {driver} (allocated drivers: {drivers or 'none'})",
        )
    return Claim(ref=ref, results=results, body=body)


class ClaimReader:
    """GETs ResourceClaims (resource.k8s.io/v1) with one ``ApiClient`` per calling thread.

    The agent serves the kubelet before the ``kubernetes`` package (slow to import) is loaded:
    it creates the reader unconnected and calls ``connect`` once the client is ready. A read
    before that waits up to ``connect_timeout`` seconds, then fails the RPC (the kubelet retries).
    """

    def __init__(
        self, configuration: client.Configuration | None = None, *, connect_timeout: float = 30.0
    ) -> None:
        self._configuration = configuration
        self._connected = threading.Event()
        self._connect_timeout = connect_timeout
        self._local = threading.local()
        if configuration is not None:
            self._connected.set()

    def connect(self, configuration: client.Configuration) -> None:
        self._configuration = configuration
        self._connected.set()

    def _api(self) -> client.ResourceV1Api:
        from kubernetes import client

        from driver.kube.client import new_api_client

        api = getattr(self._local, "api", None)
        if api is None:
            assert self._configuration is not None  # read() waited for connect()
            api = client.ResourceV1Api(new_api_client(self._configuration))
            self._local.api = api
        return api

    def read(self, ref: ClaimRef) -> Claim:
        """The parsed claim. ``ClaimError`` when missing, replaced or unallocated; ``TransientError``
        (connection, 429, 5xx, client not ready) propagates so that the RPC fails and the kubelet retries."""
        if not self._connected.wait(self._connect_timeout):
            raise TransientError(f"get ResourceClaim {ref.key}: the API client is not ready yet")
        from driver.kube.client import REQUEST_TIMEOUT_SECONDS
        from driver.kube.errors import api_errors

        try:
            with api_errors(f"get ResourceClaim {ref.key}"):
                response = self._api().read_namespaced_resource_claim(
                    ref.name, ref.namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS
                )
                body = json.loads(response.data)  # type: ignore[attr-defined]  # raw urllib3 response
        except NotFoundError as error:
            raise ClaimError(claim=ref.key, field="metadata.name", problem="not found") from error
        return parse_claim(body, ref)

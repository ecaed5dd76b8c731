"""ResourceClaims as the node agent sees them: a pure parser and the one API read.

The kubelet only sends ``{namespace, uid, name}``; the plugin GETs the claim (resource.k8s.io/v1)
itself, outside any lock, and checks that it is the same object (UID) and allocated. Parsing is a
pure function of the API-shaped dict, so tests and the checkpoint logic never need the API.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType

from driver import DRIVER_NAME
from driver.errors import ClaimError, NotFoundError, TransientError
from driver.jsondepth import json_depth

if TYPE_CHECKING:
    from kubernetes import client

__all__ = [
    "MAX_CLAIM_BYTES",
    "MAX_CLAIM_DEPTH",
    "MAX_ECHO_CHARS",
    "AllocationResult",
    "Claim",
    "ClaimReader",
    "ClaimRef",
    "ClaimUID",
    "base_request_name",
    "bounded",
    "check_node_selector",
    "decode_claim_json",
    "parse_claim",
    "quoted",
]

ClaimUID = NewType("ClaimUID", str)

# Everything in a claim is written by a tenant; these bounds keep one claim from costing the agent
# more than a bad answer for that claim.
MAX_CLAIM_BYTES = 3 * 1024 * 1024  # kube-apiserver refuses request bodies over 3 MiB (etcd: 1.5 MiB)
MAX_CLAIM_DEPTH = 64  # real claims nest about 15 levels; Python's json gives up near 1,000
MAX_RESULTS = 32  # resource.k8s.io/v1 AllocationResultsMaxSize
MAX_CONFIGS = 64  # 32 claim entries (DeviceConfigMaxSize) + 32 class entries
MAX_FIELD_CHARS = 253  # pool and request names (DNS subdomain / "req/sub" of DNS labels)
MAX_QUANTITY_CHARS = 64  # a consumed quantity ("80Gi", "100"); longer is no quantity
MAX_SELECTOR_TERMS = 64  # nodeSelector terms (and requirements per term) we evaluate
MAX_ECHO_CHARS = 200  # how much of any tenant-written value an error or log line quotes


def bounded(text: object, limit: int = MAX_ECHO_CHARS) -> str:
    """``str(text)``, cut to ``limit`` characters and saying how many were left out."""
    value = str(text)
    if len(value) <= limit:
        return value
    return f"{value[:limit]}... ({len(value) - limit} more characters)"


def quoted(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """``repr(value)`` for an error message, at most about ``limit`` characters of it."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value) - limit} more characters)"
    return bounded(repr(value), limit)


def json_depth_exceeds(text: str | bytes, limit: int) -> bool:
    """True when ``text`` (well-formed JSON) nests arrays/objects more than ``limit`` deep."""
    return json_depth(text) > limit


def decode_claim_json(data: bytes, claim_key: str) -> Mapping[str, Any]:
    """The claim object from the API's answer, decoded defensively: ``ClaimError`` (this claim
    only) for a body over ``MAX_CLAIM_BYTES``, nested over ``MAX_CLAIM_DEPTH``, or not a JSON object."""
    if len(data) > MAX_CLAIM_BYTES:
        raise ClaimError(
            claim=claim_key, field="(object)", problem=f"larger than {MAX_CLAIM_BYTES} bytes; not read"
        )
    try:
        text = data.decode("utf-8")
        if json_depth_exceeds(text, MAX_CLAIM_DEPTH):
            raise ClaimError(
                claim=claim_key,
                field="(object)",
                problem=f"nested more than {MAX_CLAIM_DEPTH} levels deep (opaque parameters?); not decoded",
            )
        body = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ClaimError(claim=claim_key, field="(object)", problem=f"not JSON: {bounded(error)}") from error
    if not isinstance(body, Mapping):
        raise ClaimError(claim=claim_key, field="(object)", problem="not a JSON object")
    return body


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


def _short_string(raw: Mapping[str, Any], name: str, field: str, claim_key: str, limit: int) -> str:
    value = raw.get(name)
    if not isinstance(value, str):
        raise ClaimError(
            claim=claim_key, field=f"{field}.{name}", problem=f"must be a string, found {quoted(value)}"
        )
    if len(value) > limit:
        raise ClaimError(
            claim=claim_key,
            field=f"{field}.{name}",
            problem=f"{quoted(value)} is {len(value)} characters long, more than {limit}",
        )
    return value


def _parse_result(index: int, raw: Mapping[str, Any], claim_key: str) -> AllocationResult:
    field = f"status.allocation.devices.results[{index}]"
    missing = [name for name in ("request", "driver", "pool", "device") if not raw.get(name)]
    if missing:
        raise ClaimError(claim=claim_key, field=f"{field}.{missing[0]}", problem="required but missing")
    consumed = raw.get("consumedCapacity") or {}
    if not isinstance(consumed, Mapping):
        raise ClaimError(claim=claim_key, field=f"{field}.consumedCapacity", problem="must be a map")
    if len(consumed) > MAX_RESULTS:
        raise ClaimError(
            claim=claim_key,
            field=f"{field}.consumedCapacity",
            problem=f"{len(consumed)} entries, more than {MAX_RESULTS}",
        )
    capacity = []
    for key, value in consumed.items():
        if not isinstance(value, str | int) or len(str(key)) > MAX_FIELD_CHARS:
            raise ClaimError(
                claim=claim_key, field=f"{field}.consumedCapacity", problem=f"bad entry {quoted(key)}"
            )
        if len(str(value)) > MAX_QUANTITY_CHARS:
            raise ClaimError(
                claim=claim_key,
                field=f"{field}.consumedCapacity.{bounded(key)}",
                problem=f"{quoted(str(value))} is longer than {MAX_QUANTITY_CHARS} characters",
            )
        capacity.append((str(key), str(value)))
    share_id = raw.get("shareID")
    return AllocationResult(
        index=index,
        request=_short_string(raw, "request", field, claim_key, MAX_FIELD_CHARS),
        driver=str(raw["driver"]),
        pool=_short_string(raw, "pool", field, claim_key, MAX_FIELD_CHARS),
        device=_short_string(raw, "device", field, claim_key, MAX_FIELD_CHARS),
        share_id=_short_string(raw, "shareID", field, claim_key, MAX_FIELD_CHARS) if share_id else None,
        admin_access=raw.get("adminAccess") is True,
        consumed_capacity=tuple(sorted(capacity)),
    )


def parse_claim(body: Mapping[str, Any], ref: ClaimRef, *, driver: str = DRIVER_NAME) -> Claim:
    """Check the fetched object against the kubelet's reference and keep ``driver``'s results.

    Raises ``ClaimError`` when the claim was replaced (other UID), is not allocated, or has no
    result for ``driver`` (the kubelet batches claims per driver, so it should never send one).
    """
    metadata = _mapping(body.get("metadata"), ref.key, "metadata")
    uid = metadata.get("uid")
    if uid != ref.uid:
        raise ClaimError(
            claim=ref.key,
            field="metadata.uid",
            problem=f"expected {ref.uid}, found {quoted(uid)} (the claim was replaced)",
        )
    allocation = _mapping(
        _mapping(body.get("status"), ref.key, "status").get("allocation"), ref.key, "status.allocation"
    )
    if not allocation:
        raise ClaimError(claim=ref.key, field="status.allocation", problem="the claim is not allocated")
    devices = _mapping(allocation.get("devices"), ref.key, "status.allocation.devices")
    raw_results = devices.get("results") or []
    if not isinstance(raw_results, Sequence) or isinstance(raw_results, str):
        raise ClaimError(claim=ref.key, field="status.allocation.devices.results", problem="must be a list")
    if len(raw_results) > MAX_RESULTS:
        raise ClaimError(
            claim=ref.key,
            field="status.allocation.devices.results",
            problem=f"{len(raw_results)} results, more than {MAX_RESULTS}",
        )
    configs = devices.get("config") or []
    if not isinstance(configs, Sequence) or isinstance(configs, str) or len(configs) > MAX_CONFIGS:
        raise ClaimError(
            claim=ref.key,
            field="status.allocation.devices.config",
            problem=f"must be a list of at most {MAX_CONFIGS} entries",
        )
    results = tuple(
        _parse_result(index, raw, ref.key)
        for index, raw in enumerate(raw_results)
        if isinstance(raw, Mapping) and raw.get("driver") == driver
    )
    if not results:
        drivers = sorted({bounded(raw.get("driver"), 64) for raw in raw_results if isinstance(raw, Mapping)})
        raise ClaimError(
            claim=ref.key,
            field="status.allocation.devices.results",
            problem=f"no device of driver {driver} (allocated drivers: {drivers or 'none'})",
        )
    return Claim(ref=ref, results=results, body=body)


def _mapping(value: object, claim_key: str, field: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ClaimError(claim=claim_key, field=field, problem="must be an object")
    return value


def _selector_values(requirement: object) -> tuple[str, frozenset[str]] | None:
    """``(operator, values)`` of a ``metadata.name`` field requirement; None for anything else."""
    if not isinstance(requirement, Mapping) or requirement.get("key") != "metadata.name":
        return None
    values = requirement.get("values") or []
    if not isinstance(values, Sequence) or isinstance(values, str):
        return None
    return str(requirement.get("operator")), frozenset(str(value) for value in values)


def check_node_selector(body: Mapping[str, Any], node_name: str, claim_key: str) -> None:
    """Refuse a claim whose ``status.allocation.nodeSelector`` does not select ``node_name``.

    Pure. No selector: the devices are reachable from every node. Terms are ORed, requirements in
    a term ANDed. This agent cannot see its Node's labels, so a term with ``matchExpressions``
    (label requirements) is taken as possibly selecting this node; a term's ``matchFields`` on
    ``metadata.name`` (``In``/``NotIn``, what the scheduler writes for node-local pools) is
    decided exactly, and any other field requirement selects no node (the API defines no other
    field). Refused only when every term certainly leaves this node out.
    """
    allocation = (body.get("status") or {}).get("allocation") or {}
    selector = allocation.get("nodeSelector") if isinstance(allocation, Mapping) else None
    if selector is None:
        return
    field = "status.allocation.nodeSelector"
    terms = selector.get("nodeSelectorTerms") if isinstance(selector, Mapping) else None
    if not isinstance(terms, Sequence) or isinstance(terms, str) or len(terms) > MAX_SELECTOR_TERMS:
        raise ClaimError(
            claim=claim_key,
            field=f"{field}.nodeSelectorTerms",
            problem=f"must be a list of at most {MAX_SELECTOR_TERMS} terms",
        )
    named: list[str] = []
    for term in terms:
        if not isinstance(term, Mapping) or not (term.get("matchFields") or term.get("matchExpressions")):
            continue  # an empty (or malformed) term selects no node
        fields = term.get("matchFields") or []
        if not isinstance(fields, Sequence) or isinstance(fields, str) or len(fields) > MAX_SELECTOR_TERMS:
            continue  # malformed: selects nothing
        selects = True
        for requirement in fields:
            parsed = _selector_values(requirement)
            if parsed is None:
                selects = False
                break
            operator, values = parsed
            named.extend(sorted(values)[:3])
            if (operator == "In" and node_name not in values) or (
                operator == "NotIn" and node_name in values
            ):
                selects = False
                break
            if operator not in ("In", "NotIn"):
                selects = False
                break
        if selects:
            return
    raise ClaimError(
        claim=claim_key,
        field=field,
        problem=f"allocated for another node ({bounded(', '.join(named) or 'none', 100)}), not {node_name}",
    )


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
                response: Any = self._api().read_namespaced_resource_claim(
                    ref.name, ref.namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS
                )  # a raw urllib3 response: read at most one byte more than any claim may be
                data = response.read(MAX_CLAIM_BYTES + 1)
                if len(data) > MAX_CLAIM_BYTES:
                    response.close()  # the rest stays unread: the connection is dropped, not pooled
                else:
                    response.release_conn()
        except NotFoundError as error:
            raise ClaimError(claim=ref.key, field="metadata.name", problem="not found") from error
        return parse_claim(decode_claim_json(data, ref.key), ref)

"""The DRA gRPC service (``...dra.v1.DRAPlugin`` and ``...dra.v1beta1.DRAPlugin``): thin adapters.

Both versions share one implementation; v1 also reports ``share_id``. Prepare: check every
reference, GET the claims concurrently (``ClaimFetcher``: a bounded pool, outside every lock), then
``DeviceState.prepare_many`` prepares them together, and each result is mapped. A ``ClaimError``
becomes that claim's ``error`` string and never touches the other claims of the call; every
requested UID gets an entry. A GET that fails transiently (connection, 429, 5xx) is also that
claim's error: the kubelet retries the pod either way, and one claim the API cannot serve must not
stop the rest. After a successful prepare (and an unprepare of a claim that was prepared) the
optional ``ClaimStatusSink`` is told; it only enqueues (``driver.plugin.status``), so
``status.devices`` never delays or fails the answer to the kubelet. A claim refused because its
share cannot be prepared here (``ShareRefusedError``: over the GPU's capacity, or a sharing backend
that cannot join its shares) is reported too (``refused``), with the error the kubelet gets: no
retry of the kubelet's can succeed, and the allocation controller replaces the pod.

Deadline: the kubelet gives each call 45 s. When the call's deadline (``time_remaining``) passes
while claims are being read, the call answers DEADLINE_EXCEEDED at once, reads not yet started are
cancelled, and nothing is prepared: the kubelet has stopped waiting, and its retry finds the claims
it did get prepared already (prepare is idempotent).

Echoes are bounded: an error string or log line quotes at most ``MAX_ERROR_CHARS`` of it.
Any other ``FractionalError`` fails the whole RPC with UNAVAILABLE so the kubelet retries; a bug
propagates and gRPC logs it and answers UNKNOWN.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any, NoReturn, Protocol

import grpc

from driver.errors import ClaimError, FractionalError, TransientError
from driver.plugin.claims import Claim, ClaimRef, bounded
from driver.plugin.devices import PreparedDevice, make_claim_ref
from driver.plugin.metrics import CLAIM_OPERATIONS_TOTAL, RPC_SECONDS
from driver.plugin.proto_gen import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from driver.plugin.state import DeviceState, ShareRefusedError
from driver.plugin.status import ShareRefusal

__all__ = [
    "FETCH_WORKERS",
    "MAX_ERROR_CHARS",
    "ClaimFetcher",
    "ClaimSource",
    "ClaimStatusSink",
    "DRAServicer",
    "DeadlineExceeded",
    "add_dra_services",
]

log = logging.getLogger(__name__)

FETCH_WORKERS = 8  # concurrent claim GETs per agent (all calls together)
DEADLINE_MARGIN_SECONDS = 0.5  # answer this long before the kubelet's deadline
MAX_ERROR_CHARS = 1000  # of an error string sent to the kubelet or logged
MAX_UID_LOG_CHARS = 64


class ClaimSource(Protocol):
    def read(self, ref: ClaimRef) -> Claim: ...


class ClaimStatusSink(Protocol):
    """Where prepared/unprepared claims are reported (``ClaimStatusWriter``); must not block."""

    def prepared(self, ref: ClaimRef, devices: tuple[PreparedDevice, ...]) -> None: ...

    def unprepared(self, ref: ClaimRef) -> None: ...

    def refused(self, ref: ClaimRef, refusal: ShareRefusal) -> None: ...


class DeadlineExceeded(Exception):
    """The call's deadline passed while its claims were being read."""


class ClaimFetcher:
    """Reads claims concurrently on a bounded pool (``FETCH_WORKERS`` threads ``claim-get_*``,
    shared by every call), waiting no longer than the call's deadline."""

    def __init__(self, claims: ClaimSource, *, workers: int = FETCH_WORKERS) -> None:
        self._claims = claims
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="claim-get"
        )

    def fetch(self, refs: Sequence[ClaimRef], *, deadline: float | None) -> dict[str, Claim | ClaimError]:
        """Claim UID -> the claim, or why it could not be read (``ClaimError``; a ``TransientError``
        becomes one too). ``DeadlineExceeded`` when ``deadline`` (``time.monotonic``) passes first;
        reads not yet started are then cancelled."""
        futures = {ref.uid: (ref, self._pool.submit(self._claims.read, ref)) for ref in refs}
        results: dict[str, Claim | ClaimError] = {}
        try:
            for uid, (ref, future) in futures.items():
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    results[uid] = future.result(timeout=timeout)
                except ClaimError as error:
                    results[uid] = error
                except TransientError as error:
                    results[uid] = ClaimError(
                        claim=ref.key,
                        field="(read from the API)",
                        problem=f"{bounded(error, MAX_ERROR_CHARS)} (temporary; the kubelet retries)",
                    )
        except concurrent.futures.TimeoutError as error:
            for _, future in futures.values():
                future.cancel()
            raise DeadlineExceeded(
                f"read {len(results)} of {len(futures)} claims before the deadline"
            ) from error
        return results

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class DRAServicer:
    """Implements ``DRAPlugin`` for one proto version (``pb`` = its ``*_pb2`` module)."""

    def __init__(
        self,
        *,
        state: DeviceState,
        claims: ClaimSource,
        pb: ModuleType,
        version: str,
        status: ClaimStatusSink | None = None,
        fetcher: ClaimFetcher | None = None,
    ) -> None:
        self._state = state
        self._claims = claims
        self._fetcher = fetcher if fetcher is not None else ClaimFetcher(claims)
        self._status = status
        self._pb = pb
        self._version = version
        self._share_ids = "share_id" in pb.Device.DESCRIPTOR.fields_by_name

    def _device(self, device: PreparedDevice) -> Any:
        message = self._pb.Device(
            request_names=list(device.request_names),
            pool_name=device.pool,
            device_name=device.device,
            cdi_device_ids=list(device.cdi_device_ids),
        )
        if self._share_ids and device.share_id is not None:
            message.share_id = device.share_id
        return message

    def _fail(self, context: grpc.ServicerContext, method: str, error: FractionalError) -> NoReturn:
        reason = bounded(error, MAX_ERROR_CHARS)
        log.warning("rpc failed, kubelet will retry", extra={"method": method, "reason": reason})
        context.abort(grpc.StatusCode.UNAVAILABLE, reason)
        raise AssertionError("context.abort returned")  # it always raises

    def _claim_failed(self, operation: str, uid: str, error: ClaimError) -> str:
        reason = bounded(error, MAX_ERROR_CHARS)
        log.warning(
            f"claim not {operation}d",
            extra={"claim_uid": bounded(uid, MAX_UID_LOG_CHARS), "reason": reason},
        )
        CLAIM_OPERATIONS_TOTAL.labels(operation=operation, result="error").inc()
        return reason

    def _report_refusal(self, claim: Claim, error: ShareRefusedError, reason: str) -> None:
        if self._status is None:
            return
        share_ids = tuple(
            result.share_id
            for result in claim.results
            if result.pool == error.pool and result.device == error.device_name
        )
        refusal = ShareRefusal(pool=error.pool, device=error.device_name, share_ids=share_ids, message=reason)
        self._status.refused(claim.ref, refusal)

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        started = time.perf_counter()
        results: dict[str, Any] = {}
        try:
            remaining = context.time_remaining()
            deadline = None if remaining is None else time.monotonic() + remaining - DEADLINE_MARGIN_SECONDS
            refs: dict[str, ClaimRef] = {}
            for reference in request.claims:
                if reference.uid in refs or reference.uid in results:
                    continue  # named twice: one answer
                try:
                    refs[reference.uid] = make_claim_ref(
                        namespace=reference.namespace, name=reference.name, uid=reference.uid
                    )
                except ClaimError as error:
                    reason = self._claim_failed("prepare", reference.uid, error)
                    results[reference.uid] = self._pb.NodePrepareResourceResponse(error=reason)
            try:
                fetched = self._fetcher.fetch(list(refs.values()), deadline=deadline)  # outside every lock
                if deadline is not None and time.monotonic() > deadline:
                    raise DeadlineExceeded(f"read all {len(refs)} claims, too late to prepare them")
            except DeadlineExceeded as error:
                log.warning(
                    "rpc deadline passed, nothing prepared",
                    extra={"method": "NodePrepareResources", "claims": len(refs), "reason": str(error)},
                )
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline passed: {error}")
                raise AssertionError("context.abort returned") from error
            claims = [claim for claim in fetched.values() if isinstance(claim, Claim)]
            outcomes: Mapping[str, Any] = {
                **{uid: error for uid, error in fetched.items() if isinstance(error, ClaimError)},
                **self._state.prepare_many(claims),
            }
            for uid, ref in refs.items():
                outcome = outcomes[uid]
                if isinstance(outcome, ClaimError):
                    reason = self._claim_failed("prepare", uid, outcome)
                    claim = fetched.get(uid)
                    if isinstance(outcome, ShareRefusedError) and isinstance(claim, Claim):
                        self._report_refusal(claim, outcome, reason)
                    results[uid] = self._pb.NodePrepareResourceResponse(error=reason)
                    continue
                CLAIM_OPERATIONS_TOTAL.labels(operation="prepare", result="ok").inc()
                if self._status is not None:
                    self._status.prepared(ref, outcome)
                log.debug("claim prepared", extra={"claim_uid": uid, "devices": len(outcome)})
                results[uid] = self._pb.NodePrepareResourceResponse(
                    devices=[self._device(device) for device in outcome]
                )
        except FractionalError as error:
            self._fail(context, "NodePrepareResources", error)
        finally:
            RPC_SECONDS.labels(service=self._version, method="NodePrepareResources").observe(
                time.perf_counter() - started
            )
        return self._pb.NodePrepareResourcesResponse(claims=results)

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        started = time.perf_counter()
        results: dict[str, Any] = {}
        try:
            refs: dict[str, ClaimRef] = {}
            for reference in request.claims:
                if reference.uid in refs or reference.uid in results:
                    continue  # named twice: one answer
                try:
                    refs[reference.uid] = make_claim_ref(
                        namespace=reference.namespace, name=reference.name, uid=reference.uid
                    )
                except ClaimError as error:
                    reason = self._claim_failed("unprepare", reference.uid, error)
                    results[reference.uid] = self._pb.NodeUnprepareResourceResponse(error=reason)
            # Never GETs the claims: they may be gone.
            outcomes = self._state.unprepare_many(list(refs.values()))
            for uid, ref in refs.items():
                outcome = outcomes[uid]
                if isinstance(outcome, ClaimError):
                    reason = self._claim_failed("unprepare", uid, outcome)
                    results[uid] = self._pb.NodeUnprepareResourceResponse(error=reason)
                    continue
                CLAIM_OPERATIONS_TOTAL.labels(operation="unprepare", result="ok").inc()
                if outcome and self._status is not None:
                    self._status.unprepared(ref)
                results[uid] = self._pb.NodeUnprepareResourceResponse()
        except FractionalError as error:
            self._fail(context, "NodeUnprepareResources", error)
        finally:
            RPC_SECONDS.labels(service=self._version, method="NodeUnprepareResources").observe(
                time.perf_counter() - started
            )
        return self._pb.NodeUnprepareResourcesResponse(claims=results)


def add_dra_services(
    server: grpc.Server, *, state: DeviceState, claims: ClaimSource, status: ClaimStatusSink | None = None
) -> ClaimFetcher:
    """Serve ``v1.DRAPlugin`` and ``v1beta1.DRAPlugin`` on ``server``; returns their shared
    ``ClaimFetcher``, to ``close()`` once the server has stopped."""
    fetcher = ClaimFetcher(claims)
    # The generated *_pb2_grpc modules are untyped.
    dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(  # type: ignore[no-untyped-call]
        DRAServicer(state=state, claims=claims, pb=dra_v1_pb2, version="v1", status=status, fetcher=fetcher),
        server,
    )
    dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(  # type: ignore[no-untyped-call]
        DRAServicer(
            state=state, claims=claims, pb=dra_v1beta1_pb2, version="v1beta1", status=status, fetcher=fetcher
        ),
        server,
    )
    return fetcher

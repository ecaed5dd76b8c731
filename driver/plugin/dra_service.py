"""The DRA gRPC service (``...dra.v1.DRAPlugin`` and ``...dra.v1beta1.DRAPlugin``): thin adapters.

Both versions share one implementation; v1 also reports ``share_id``. Per claim: check the
reference, GET the claim (outside every lock), ``DeviceState.prepare``, and map the result. A
``ClaimError`` becomes that claim's ``error`` string; every requested UID gets an entry. After a
successful prepare (and an unprepare of a claim that was prepared) the optional ``ClaimStatusSink``
is told; it only enqueues (``driver.plugin.status``), so ``status.devices`` never delays or fails
the answer to the kubelet.
``TransientError`` (and any other ``FractionalError``) fails the whole RPC with UNAVAILABLE so the
kubelet retries; a bug propagates and gRPC logs it and answers UNKNOWN.
"""

from __future__ import annotations

import logging
import time
from types import ModuleType
from typing import Any, NoReturn, Protocol

import grpc

from driver.errors import ClaimError, FractionalError
from driver.plugin.claims import Claim, ClaimRef
from driver.plugin.devices import PreparedDevice, make_claim_ref
from driver.plugin.metrics import CLAIM_OPERATIONS_TOTAL, RPC_SECONDS
from driver.plugin.proto_gen import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from driver.plugin.state import DeviceState

__all__ = ["ClaimSource", "ClaimStatusSink", "DRAServicer", "add_dra_services"]

log = logging.getLogger(__name__)


class ClaimSource(Protocol):
    def read(self, ref: ClaimRef) -> Claim: ...


class ClaimStatusSink(Protocol):
    """Where prepared/unprepared claims are reported (``ClaimStatusWriter``); must not block."""

    def prepared(self, ref: ClaimRef, devices: tuple[PreparedDevice, ...]) -> None: ...

    def unprepared(self, ref: ClaimRef) -> None: ...


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
    ) -> None:
        self._state = state
        self._claims = claims
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
        log.warning("rpc failed, kubelet will retry", extra={"method": method, "reason": str(error)})
        context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        raise AssertionError("context.abort returned")  # it always raises

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        started = time.perf_counter()
        results = {}
        try:
            for reference in request.claims:
                try:
                    ref = make_claim_ref(
                        namespace=reference.namespace, name=reference.name, uid=reference.uid
                    )
                    claim = self._claims.read(ref)  # API GET, outside every lock
                    devices = self._state.prepare(claim)
                except ClaimError as error:
                    log.warning(
                        "claim not prepared", extra={"claim_uid": reference.uid, "reason": str(error)}
                    )
                    CLAIM_OPERATIONS_TOTAL.labels(operation="prepare", result="error").inc()
                    results[reference.uid] = self._pb.NodePrepareResourceResponse(error=str(error))
                    continue
                CLAIM_OPERATIONS_TOTAL.labels(operation="prepare", result="ok").inc()
                if self._status is not None:
                    self._status.prepared(ref, devices)
                log.debug("claim prepared", extra={"claim_uid": ref.uid, "devices": len(devices)})
                results[reference.uid] = self._pb.NodePrepareResourceResponse(
                    devices=[self._device(device) for device in devices]
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
        results = {}
        try:
            for reference in request.claims:
                try:
                    ref = make_claim_ref(
                        namespace=reference.namespace, name=reference.name, uid=reference.uid
                    )
                    was_prepared = self._state.unprepare(ref)  # never GETs the claim: it may be gone
                except ClaimError as error:
                    log.warning(
                        "claim not unprepared", extra={"claim_uid": reference.uid, "reason": str(error)}
                    )
                    CLAIM_OPERATIONS_TOTAL.labels(operation="unprepare", result="error").inc()
                    results[reference.uid] = self._pb.NodeUnprepareResourceResponse(error=str(error))
                    continue
                CLAIM_OPERATIONS_TOTAL.labels(operation="unprepare", result="ok").inc()
                if was_prepared and self._status is not None:
                    self._status.unprepared(ref)
                results[reference.uid] = self._pb.NodeUnprepareResourceResponse()
        except FractionalError as error:
            self._fail(context, "NodeUnprepareResources", error)
        finally:
            RPC_SECONDS.labels(service=self._version, method="NodeUnprepareResources").observe(
                time.perf_counter() - started
            )
        return self._pb.NodeUnprepareResourcesResponse(claims=results)


def add_dra_services(
    server: grpc.Server, *, state: DeviceState, claims: ClaimSource, status: ClaimStatusSink | None = None
) -> None:
    """Serve ``v1.DRAPlugin`` and ``v1beta1.DRAPlugin`` on ``server``."""
    # The generated *_pb2_grpc modules are untyped.
    dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(  # type: ignore[no-untyped-call]
        DRAServicer(state=state, claims=claims, pb=dra_v1_pb2, version="v1", status=status), server
    )
    dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(  # type: ignore[no-untyped-call]
        DRAServicer(state=state, claims=claims, pb=dra_v1beta1_pb2, version="v1beta1", status=status),
        server,
    )

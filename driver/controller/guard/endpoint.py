"""Points the allocation guard's Service at the leading replica: an EndpointSlice we write ourselves.

The guard must be answered by the replica that decides (its cache holds our allocations in flight);
a standby knows nothing of them. So the chart's Service has no selector, and the leader writes the
one EndpointSlice behind it (``<service>-leader``: its pod's address and the guard's port), when it
takes over and again whenever it finds the slice changed. kube-apiserver resolves the webhook's
Service through that slice (``--enable-aggregator-routing``, or kube-proxy on the ClusterIP).

A replica that stops cleanly withdraws the slice, only if it is still the version it wrote: a
successor that wrote its own meanwhile keeps it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kubernetes import client

from driver.controller.model.decode import bounded
from driver.errors import ConflictError, NotFoundError
from driver.kube.client import get_json
from driver.kube.transport import JsonSender

__all__ = ["MANAGED_BY", "GuardEndpoint", "build_endpoint_slice"]

log = logging.getLogger(__name__)

MANAGED_BY = "fractional.dev-controller"
PORT_NAME = "https"
SLICES_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
SLICE_PATH = SLICES_PATH + "/{name}"


def build_endpoint_slice(
    *, namespace: str, service: str, address: str, port: int, pod_name: str
) -> dict[str, Any]:
    """The EndpointSlice that sends ``service``'s port ``https`` to ``address:port``."""
    endpoint: dict[str, Any] = {
        "addresses": [address],
        "conditions": {"ready": True, "serving": True, "terminating": False},
    }
    if pod_name:
        endpoint["targetRef"] = {"kind": "Pod", "namespace": namespace, "name": pod_name}
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service}-leader",
            "namespace": namespace,
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": MANAGED_BY,
            },
        },
        "addressType": "IPv6" if ":" in address else "IPv4",
        "endpoints": [endpoint],
        "ports": [{"name": PORT_NAME, "port": port, "protocol": "TCP"}],
    }


def _content(slice_: dict[str, Any]) -> tuple[Any, ...]:
    labels = (slice_.get("metadata") or {}).get("labels") or {}
    return (
        json.dumps(labels, sort_keys=True),
        slice_.get("addressType"),
        json.dumps(slice_.get("endpoints"), sort_keys=True),
        json.dumps(slice_.get("ports"), sort_keys=True),
    )


class GuardEndpoint:
    """Writes and withdraws the leader's EndpointSlice. One thread (run.py's loop) uses it."""

    def __init__(
        self, api_client: client.ApiClient, *, namespace: str, service: str, address: str, port: int,
        pod_name: str,
    ) -> None:  # fmt: skip
        self._api_client = api_client
        self._sender = JsonSender(api_client)
        self._wanted = build_endpoint_slice(
            namespace=namespace, service=service, address=address, port=port, pod_name=pod_name
        )
        self._namespace = namespace
        self._name = str(self._wanted["metadata"]["name"])
        self._written_version: str | None = None

    @property
    def name(self) -> str:
        return self._name

    def ensure(self) -> bool:
        """Make the slice send the Service to this replica; True when it was written now. Errors
        raise (FractionalError): the caller tries again on its next pass."""
        path_params = {"namespace": self._namespace, "name": self._name}
        what = f"EndpointSlice {self._namespace}/{self._name}"
        for _attempt in range(3):
            try:
                current = get_json(
                    self._api_client,
                    f"/apis/discovery.k8s.io/v1/namespaces/{self._namespace}/endpointslices/{self._name}",
                    what=f"read {what}",
                )
            except NotFoundError:
                current = None
            if current is not None and _content(current) == _content(self._wanted):
                self._written_version = str(current["metadata"].get("resourceVersion") or "")
                return False
            try:
                if current is None:
                    data = self._sender.send_json(
                        "POST", SLICES_PATH, path_params, self._wanted, what=f"create {what}"
                    )
                else:
                    body = {**self._wanted, "metadata": {**self._wanted["metadata"],
                            "resourceVersion": current["metadata"].get("resourceVersion")}}  # fmt: skip
                    data = self._sender.send_json("PUT", SLICE_PATH, path_params, body, what=f"update {what}")
            except ConflictError:
                continue  # someone wrote it meanwhile (created, or another version): read it again
            stored = json.loads(data or b"{}")
            self._written_version = str((stored.get("metadata") or {}).get("resourceVersion") or "")
            log.info("allocation guard endpoint published", extra={"endpointslice": self._name,
                     "address": bounded(self._wanted["endpoints"][0]["addresses"][0])})  # fmt: skip
            return True
        raise ConflictError(f"{what}: kept changing while being written")

    def withdraw(self) -> None:
        """Delete the slice if it is still the version this replica wrote (best effort)."""
        if not self._written_version:
            return
        body = {"apiVersion": "v1", "kind": "DeleteOptions",
                "preconditions": {"resourceVersion": self._written_version}}  # fmt: skip
        try:
            self._sender.send_json(
                "DELETE", SLICE_PATH, {"namespace": self._namespace, "name": self._name}, body,
                what=f"delete EndpointSlice {self._namespace}/{self._name}",
            )  # fmt: skip
            log.info("allocation guard endpoint withdrawn", extra={"endpointslice": self._name})
        except (ConflictError, NotFoundError):
            pass  # a successor's version, or already gone
        finally:
            self._written_version = None

    def close(self) -> None:
        self._sender.close()

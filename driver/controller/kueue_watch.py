"""Wakes the Kueue admission check on every Workload event: a watch of ``workloads.kueue.x-k8s.io``
(v1beta2) on a thread named ``kueue-watch``, resumed from the last resourceVersion, relisted on 410.
It only sets an Event; the check's own pass reads what it needs."""

from __future__ import annotations

import logging
import threading
from typing import Any

from kubernetes import client, watch

from driver.errors import FractionalError
from driver.kube import REQUEST_TIMEOUT_SECONDS, api_errors

__all__ = ["WorkloadWatch"]

log = logging.getLogger(__name__)

WATCH_TIMEOUT_SECONDS = 60
RETRY_SECONDS = 1.0


class WorkloadWatch:
    def __init__(
        self,
        api_client: client.ApiClient,
        *,
        wake: threading.Event,
        stop: threading.Event,
        timeout_seconds: int = WATCH_TIMEOUT_SECONDS,
    ) -> None:
        self._custom: Any = client.CustomObjectsApi(api_client)
        self._timeout_seconds = timeout_seconds  # a stop is noticed when the current watch ends
        self._wake = wake
        self._stop = stop
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kueue-watch", daemon=True)
        self._thread.start()

    def join(self, timeout_seconds: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_seconds)

    def _run(self) -> None:
        resource_version: str | None = None
        while not self._stop.is_set():
            try:
                with api_errors("watch workloads.kueue.x-k8s.io"):
                    if resource_version is None:
                        listed = self._custom.list_cluster_custom_object(
                            "kueue.x-k8s.io", "v1beta2", "workloads", _request_timeout=REQUEST_TIMEOUT_SECONDS
                        )
                        resource_version = str(listed["metadata"]["resourceVersion"])
                        self._wake.set()
                    stream: Any = watch.Watch()  # type: ignore[no-untyped-call]  # the client is untyped
                    for event in stream.stream(
                        self._custom.list_cluster_custom_object, "kueue.x-k8s.io", "v1beta2", "workloads",
                        resource_version=resource_version, timeout_seconds=self._timeout_seconds,
                        allow_watch_bookmarks=True,
                    ):  # fmt: skip
                        if self._stop.is_set():
                            stream.stop()
                            break
                        obj = event.get("object") or {}
                        if event.get("type") == "ERROR":
                            resource_version = None  # 410 Gone: list again
                            break
                        resource_version = str(
                            (obj.get("metadata") or {}).get("resourceVersion") or resource_version
                        )
                        if event.get("type") != "BOOKMARK":
                            self._wake.set()
            except FractionalError as error:
                log.warning("workload watch failed", extra={"reason": str(error)})
                resource_version = None
                self._stop.wait(RETRY_SECONDS)

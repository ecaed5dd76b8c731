"""Wakes the Kueue admission check on every Workload event: a watch of ``workloads.kueue.x-k8s.io``
(v1beta2) on a thread named ``kueue-watch``, resumed from the last resourceVersion, relisted on 410.
It only sets an Event; the check's own pass reads what it needs. ``interrupt()`` (after ``stop``)
shuts the open response so the thread ends at once."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

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
        self._wake = wake
        self._stop = stop
        self._timeout_seconds = timeout_seconds
        self._response_lock = threading.Lock()
        self._response: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kueue-watch", daemon=True)
        self._thread.start()

    def interrupt(self) -> None:
        """Unblock the watch read so the thread sees ``stop`` (call after setting it)."""
        with self._response_lock:
            response = self._response
        if response is not None:
            with contextlib.suppress(OSError):
                response.shutdown()

    def join(self, timeout_seconds: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_seconds)

    def _list(self, **kwargs: Any) -> Any:
        return self._custom.list_cluster_custom_object(
            "kueue.x-k8s.io", "v1beta2", "workloads", _preload_content=False, **kwargs
        )

    def _run(self) -> None:
        resource_version: str | None = None
        while not self._stop.is_set():
            try:
                if resource_version is None:
                    with api_errors("list workloads.kueue.x-k8s.io"):
                        listed = json.loads(self._list(_request_timeout=REQUEST_TIMEOUT_SECONDS).data)
                    resource_version = str(listed["metadata"]["resourceVersion"])
                    self._wake.set()
                resource_version = self._watch(resource_version)
            except FractionalError as error:
                if self._stop.is_set():
                    break
                log.warning("workload watch failed", extra={"reason": str(error)[:300]})
                resource_version = None
                self._stop.wait(RETRY_SECONDS)

    def _watch(self, resource_version: str) -> str | None:
        with api_errors("watch workloads.kueue.x-k8s.io"):
            response = self._list(
                watch=True, resource_version=resource_version, allow_watch_bookmarks=True,
                timeout_seconds=self._timeout_seconds,
                _request_timeout=(REQUEST_TIMEOUT_SECONDS, self._timeout_seconds + 30),
            )  # fmt: skip
        with self._response_lock:
            self._response = response
        try:
            for line in iter_resp_lines(response):  # type: ignore[no-untyped-call]  # the client is untyped
                if self._stop.is_set():
                    break
                if not line:
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    return None  # 410 Gone or another failure: list again
                resource_version = str((obj.get("metadata") or {}).get("resourceVersion") or resource_version)
                if event.get("type") != "BOOKMARK":
                    self._wake.set()
        except (urllib3.exceptions.HTTPError, OSError, ValueError) as error:
            if not self._stop.is_set():
                log.warning("workload watch broke", extra={"reason": str(error)[:300]})
                return None
        finally:
            with self._response_lock:
                self._response = None
            response.release_conn()
        return resource_version

"""The worker never holds the cache lock across an API call (watchers would stall behind it)."""

from __future__ import annotations

import threading
from typing import Any

from driver.controller.loop.reconcile import Reconciler, ReconcilerSettings
from driver.controller.metrics import ControllerMetrics
from driver.controller.model.objects import GangKey, gang_key_of
from driver.controller.view.cache import ClusterCache, Kind
from driver.controller.writes.pipeline import Job, Writers
from tests.controller.conftest import gated_pod, gpu_claim


class _Recorder:
    """Stands in for EventRecorder: notes whether another thread could take the cache lock."""

    def __init__(self, cache: ClusterCache) -> None:
        self._cache = cache
        self.lock_free: list[bool] = []

    def gang_unschedulable(self, gang: GangKey, pod: dict[str, Any], message: str, **_: Any) -> None:
        result: list[bool] = []

        def probe() -> None:
            acquired = self._cache.lock.acquire(timeout=2)
            if acquired:
                self._cache.lock.release()
            result.append(acquired)

        thread = threading.Thread(target=probe, name="test-lock-probe")
        thread.start()
        thread.join()
        self.lock_free.extend(result)


def test_allocation_error_event_is_written_outside_the_cache_lock() -> None:
    cache = ClusterCache(topology_label="topology.kubernetes.io/zone")
    claim = gpu_claim("c")  # its DeviceClass does not exist: a fatal AllocationError
    claim["metadata"].update({"namespace": "default", "uid": "u1", "resourceVersion": "1"})
    pod = gated_pod("p", ["c"])
    pod["metadata"].update({"namespace": "default", "uid": "u2", "resourceVersion": "2"})
    cache.apply(Kind.CLAIM, "ADDED", claim)
    cache.apply(Kind.POD, "ADDED", pod)
    recorder = _Recorder(cache)
    jobs: list[Job] = []
    reconciler = Reconciler(
        cache=cache, metrics=ControllerMetrics(), settings=ReconcilerSettings(),
        capacity_generation=lambda: 0, submit=lambda job: jobs.append(job) is None,
        requeue=lambda key: None, requeue_later=lambda key: 0.0,
    )  # fmt: skip
    reconciler.reconcile_gangs([gang_key_of(pod)])
    (job,) = jobs  # the Event is a write: it went to the writers
    job(Writers(writer=None, recorder=recorder))  # type: ignore[arg-type]
    assert recorder.lock_free == [True]

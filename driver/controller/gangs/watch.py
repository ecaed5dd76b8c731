"""Watch the gang objects at the version the server serves, and follow it when that changes.

At start and on each resync ``GangWatches`` reads discovery (``discover_gang_api``): the
``scheduling.k8s.io`` version in use (its Workload/PodGroup), and the coscheduling and Volcano
PodGroup custom resources when served. It logs the choice and sets
``fractional_controller_gang_api_info``; when the choice changes it stops the old watchers and
starts new ones. A change of a gang object queues the gangs it sizes (a PodGroup created after its
pods, a ``minCount`` scaled on 1.37). With ``--gang-sources auto`` the sources follow discovery too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes import client

from driver.controller.gangs.api import GangApi, discover_gang_api
from driver.controller.metrics import ControllerMetrics
from driver.controller.model.decode import bounded
from driver.controller.model.gang_identity import GangSource, default_sources, gangs_of_object
from driver.controller.view.cache import ClusterCache, Kind
from driver.controller.view.watch import Watcher
from driver.errors import FractionalError
from driver.kube import new_api_client

__all__ = ["GangWatches"]

log = logging.getLogger(__name__)


class GangWatches:
    def __init__(
        self,
        *,
        configuration: client.Configuration,
        cache: ClusterCache,
        metrics: ControllerMetrics,
        enqueue_gang: Callable[[str], None],
        sources: frozenset[GangSource] | None,  # None: auto (upstream, ours, markers served)
        stop: threading.Event,
        watch_timeout_seconds: int = 60,
    ) -> None:
        self._configuration = configuration
        self._cache = cache
        self._metrics = metrics
        self._enqueue_gang = enqueue_gang
        self._sources = sources
        self._stop = stop
        self._watch_timeout_seconds = watch_timeout_seconds
        self._lock = threading.Lock()
        self.api: GangApi | None = None
        self._watchers: list[Watcher] = []
        self._watch_stop = threading.Event()

    def watchers(self) -> list[Watcher]:
        with self._lock:
            return list(self._watchers)

    def refresh(self) -> bool:
        """Discover; on a change (or the first time) watch what is served now. False when discovery
        failed (the last choice stays)."""
        api_client = new_api_client(self._configuration)
        try:
            api = discover_gang_api(api_client)
        except FractionalError as error:
            log.warning("gang API discovery failed", extra={"error": bounded(error)})
            return False
        finally:
            api_client.close()  # type: ignore[no-untyped-call]
        with self._lock:
            if api == self.api:
                return True
            previous, self.api = self.api, api
            old, old_stop = self._watchers, self._watch_stop
            self._watch_stop = threading.Event()
            self._watchers = [
                Watcher(
                    kind=kind,
                    configuration=self._configuration,
                    cache=self._cache,
                    on_event=self._on_event,
                    stop=self._watch_stop,
                    watch_timeout_seconds=self._watch_timeout_seconds,
                    resource=resource,
                )
                for kind, resource in api.resources
            ]
            new = list(self._watchers)
        old_stop.set()
        for watcher in old:
            watcher.interrupt()
        gone = {kind for kind, _ in (previous.resources if previous else ())} - {k for k, _ in api.resources}
        for kind in gone:  # no longer served: forget its objects (their gangs wait, as with none)
            for event_type, obj in self._cache.replace(kind, []):
                self._on_event(kind, event_type, obj, None)
        sources = self._sources if self._sources is not None else default_sources(api.groups)
        if sources != self._cache.gang_sources:
            self._cache.set_gang_sources(sources)
        self._metrics.gang_api.clear()
        self._metrics.gang_api.labels(version=api.version or "none").set(1)
        log.info(
            "gang API in use",
            extra={
                "gang_api": api.describe(),
                "sources": ",".join(sorted(s.value for s in sources)),
                "previous": previous.describe() if previous else "",
            },
        )
        for watcher in new:
            if not self._stop.is_set():
                watcher.start()
        return True

    def stop(self) -> None:
        self._watch_stop.set()
        for watcher in self.watchers():
            watcher.interrupt()

    def _on_event(self, kind: Kind, event_type: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        for gang in gangs_of_object(kind.value, obj, self._cache.gated_gangs()):
            # Its claims may resolve through the PodGroup now; a basic policy makes each pod its own.
            for now in sorted(self._cache.reindex_gang(gang) | {gang}):
                self._enqueue_gang(now)

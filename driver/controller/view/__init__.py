"""What the controller knows of the cluster: the cache and the watchers that fill it.

Owns ``cache`` (the objects last seen, per kind, plus the allocator's incremental
``ClusterState`` and what the controller itself just wrote, assumed until the server echoes it)
and ``watch`` (list + watch of one kind into the cache, resumed from the last resourceVersion,
re-listed on 410 Gone).

May import: ``driver.allocator``, ``driver.kube``, ``driver.errors`` and
``driver.controller.model``. Nothing here decides or writes.
"""

from __future__ import annotations

from driver.controller.view.cache import ClusterCache, Kind
from driver.controller.view.watch import Watcher

__all__ = ["ClusterCache", "Kind", "Watcher"]

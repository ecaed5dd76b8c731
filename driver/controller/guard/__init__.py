"""The allocation guard: a validating admission webhook that keeps two allocators from booking one
device twice.

Owns ``review`` (the decision on one allocation another allocator wrote, under the cache's lock, so
it is ordered with our own decisions), ``server`` (the HTTPS endpoint kube-apiserver calls) and
``endpoint`` (the EndpointSlice that points the webhook's Service at the leading replica).

May import: ``driver.allocator``, ``driver.kube``, ``driver.errors`` and, of the controller,
``model``, ``view`` and ``metrics``.
"""

from __future__ import annotations

from driver.controller.guard.endpoint import GuardEndpoint, build_endpoint_slice
from driver.controller.guard.review import AllocationGuard, GuardSettings, ReviewError
from driver.controller.guard.server import GUARD_PATH, GuardServer

__all__ = [
    "GUARD_PATH",
    "AllocationGuard",
    "GuardEndpoint",
    "GuardServer",
    "GuardSettings",
    "ReviewError",
    "build_endpoint_slice",
]

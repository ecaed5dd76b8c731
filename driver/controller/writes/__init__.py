"""Every write the controller makes, and the pool of threads that makes them.

Owns ``writer`` (claim finalizers, ``status.allocation``, gates and annotations on pods, each
guarded by the object's resourceVersion, fenced by leadership), ``events`` (the Events, scale-up
hint annotations and ProvisioningRequests people and autoscalers read) and ``pipeline`` (the
bounded pool of writer threads: a gang's writes stay in order, different gangs go side by side).

May import: ``driver.kube``, ``driver.errors`` and ``driver.controller.model``.
"""

from __future__ import annotations

from driver.controller.writes.events import EventRecorder
from driver.controller.writes.pipeline import Job, WritePool, Writers
from driver.controller.writes.writer import ApiWriter, HaltWrites, WriteHook, WriteRecord

__all__ = [
    "ApiWriter",
    "EventRecorder",
    "HaltWrites",
    "Job",
    "WriteHook",
    "WritePool",
    "WriteRecord",
    "Writers",
]

"""The Kueue admission check ``fractional.dev/placement``: Kueue asks, our allocator answers.

Owns the pure decisions (``check``: can the whole Workload be placed now, Ready or Retry with a
message; ``quota``: what Kueue charges a claim against a ClusterQueue; ``plan``: the
``fractional plan --kueue`` report) and their I/O (``watch``: wakes the check on Workload events;
``worker``: the thread that reads the cluster, writes Workload and AdmissionCheck status, and places
the pods of the workloads it admitted).

May import: ``driver.allocator``, ``driver.kube``, ``driver.errors``, ``driver.controller.model``,
``driver.controller.sizing`` and ``driver.controller.writes``. Never the gangs or the loop.
"""

from __future__ import annotations

from driver.controller.kueue.check import CONTROLLER_NAME, KUEUE_GATES, reservation_wait_reason
from driver.controller.kueue.worker import KueueAdmissionCheck, KueueCheckSettings, start_admission_check

__all__ = [
    "CONTROLLER_NAME",
    "KUEUE_GATES",
    "KueueAdmissionCheck",
    "KueueCheckSettings",
    "reservation_wait_reason",
    "start_admission_check",
]

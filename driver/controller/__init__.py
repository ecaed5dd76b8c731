"""Allocation controller: gated pods and gangs in, claim allocations and removed gates out.

``run_controller(config, stop)`` is what ``fractional controller`` runs; ``Controller`` is the
in-process object tests and the demo may drive; ``driver.controller.plan.run_plan`` is
``fractional plan``.
"""

from __future__ import annotations

from driver.controller.controller import Controller
from driver.controller.objects import FINALIZER, GANG_LABEL, GANG_SIZE_ANNOTATION, GATE, HINT_ANNOTATION
from driver.controller.reconcile import ReconcilerSettings
from driver.controller.run import run_controller
from driver.controller.writer import HaltWrites, WriteRecord

__all__ = [
    "FINALIZER",
    "GANG_LABEL",
    "GANG_SIZE_ANNOTATION",
    "GATE",
    "HINT_ANNOTATION",
    "Controller",
    "HaltWrites",
    "ReconcilerSettings",
    "WriteRecord",
    "run_controller",
]

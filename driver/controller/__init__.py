"""Allocation controller: gated pods and gangs in, claim allocations and removed gates out.

``run_controller(config, stop)`` is what ``fractional controller`` runs; ``Controller`` is the
in-process object tests and the demo may drive; ``driver.controller.diagnosis.plan.run_plan`` is
``fractional plan``.

One subpackage per concern, each importing only those listed before it (``tests/test_layers.py``
checks it; ``docs/architecture.md`` tells the whole story):

- ``model``: the vocabulary (names, pure readers of API dicts, gang identity, bounded decoding);
- ``sizing``: what fits where (scale-up hints, fragmentation); pure;
- ``view``: what the controller knows (the cache, the watchers);
- ``writes``: every write it makes (claims, pods, Events) and the writer pool;
- ``metrics`` (a module): its Prometheus series;
- ``kueue``: the Kueue admission check;
- ``gangs``: which pods go together and where they all fit (gang APIs, plans, decisions, topology);
- ``preemption``: victims and evictions;
- ``diagnosis``: ``explain`` and ``fractional plan``, shared with the CLI;
- ``guard``: the allocation guard, the webhook that orders other allocators' writes with ours;
- ``loop``: the process: the Controller, the decider, the work queue, leader election.
"""

from __future__ import annotations

from driver.controller.loop.controller import Controller
from driver.controller.loop.reconcile import ReconcilerSettings
from driver.controller.loop.run import run_controller
from driver.controller.model.objects import FINALIZER, GANG_LABEL, GANG_SIZE_ANNOTATION, GATE, HINT_ANNOTATION
from driver.controller.writes.writer import HaltWrites, WriteRecord

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

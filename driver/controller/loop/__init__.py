"""The controller's own loop: the process, its threads and its one decider.

Owns ``controller`` (the ``Controller``: watchers fill the cache and enqueue keys, one decider
decides, a pool of writers writes), ``reconcile`` (the decider: gang and claim keys in, decisions
and writer jobs out), ``workqueue`` (de-duplicating keys with backoff), ``elector`` (a Lease elector
with an injected clock) and ``run`` (``fractional controller``: metrics server, leader election,
exit codes).

May import any other part of ``driver.controller`` (it wires them together); nothing below it
imports the loop.
"""

from __future__ import annotations

from driver.controller.loop.controller import Controller
from driver.controller.loop.reconcile import ReconcilerSettings
from driver.controller.loop.run import run_controller

__all__ = ["Controller", "ReconcilerSettings", "run_controller"]

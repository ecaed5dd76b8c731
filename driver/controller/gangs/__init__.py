"""Gangs: which gated pods go together, and where they all fit, or none of them.

Owns, in the order a decision runs: ``api`` (which ``scheduling.k8s.io`` version of Workload and
PodGroup the server serves) and ``watch`` (watching those objects at that version); ``plan`` (what
a gang needs next: wait, release a half-done allocation, allocate, or only ungate; its minCount);
``decide`` (one gang: one allocator call for its claims, then kube-scheduler's node-fit checks of
``nodefit``); ``topology`` (one topology domain at a time); ``burst`` (the ready gangs of one pass
decided together). Which gang a pod is in is the vocabulary of ``driver.controller.model``
(``gang_identity``), since the cache indexes pods by it.

May import: ``driver.allocator``, ``driver.kube``, ``driver.errors``, ``driver.controller.model``,
``driver.controller.view``, ``driver.controller.metrics`` and ``driver.controller.kueue`` (a pod
Kueue still holds waits). Decides under ``cache.lock`` and never writes.
"""

from __future__ import annotations

from driver.controller.gangs.burst import decide_all
from driver.controller.gangs.decide import Decision, decide
from driver.controller.gangs.plan import GangPlan, PodGroup, plan_gang
from driver.controller.gangs.topology import decide_in_domains
from driver.controller.gangs.watch import GangWatches

__all__ = [
    "Decision",
    "GangPlan",
    "GangWatches",
    "PodGroup",
    "decide",
    "decide_all",
    "decide_in_domains",
    "plan_gang",
]

"""Priority preemption for the pods we place, with kube-scheduler's rules.

Owns ``victims`` (pure: who may preempt whom, and the cheapest set of victims that lets a whole
gang fit, PodDisruptionBudgets counted) and ``preemptor`` (that search wired to the cache, the
nominations that keep freed devices for the preemptor, and the effects: evictions through
``pods/eviction``, the ``DisruptionTarget`` condition, Events), and ``refusal`` (pods whose share a
node refused at prepare: the pure decision, the eviction or the advice, the ``ShareRefused`` Event).

May import: ``driver.kube``, ``driver.errors``, ``driver.controller.model``,
``driver.controller.view``, ``driver.controller.writes``, ``driver.controller.metrics`` and
``driver.controller.gangs``.
"""

from __future__ import annotations

from driver.controller.preemption.preemptor import Nomination, Preemptor
from driver.controller.preemption.victims import choose_victims

__all__ = ["Nomination", "Preemptor", "choose_victims"]

"""Consolidation: move pods that opted in so that a gang that does not fit, and that no
preemption serves, fits; with a place kept for every moved pod's replacement.

- ``movers``: which running pods may move (opt-in, owner, guards), pure;
- ``search``: the plan with the fewest moves, then the least disruption, in a bounded search, pure;
- ``consolidator``: the fit check on the cache, the holds (the gang's nomination, the
  replacements' reservations, kept by the preemptor) and the effects (Eviction API, a
  Deployment's rollout for make before break, Events).

May import: ``driver.kube``, ``driver.errors``, ``driver.controller.model``,
``driver.controller.view``, ``driver.controller.writes``, ``driver.controller.metrics``,
``driver.controller.gangs`` and ``driver.controller.preemption`` (whose holds it shares).
"""

from driver.controller.consolidation.consolidator import ConsolidationSettings, Consolidator
from driver.controller.consolidation.movers import MOVABLE_LABEL, Mover, MoverRules, build_movers
from driver.controller.consolidation.search import Budget, MovePlan, find_plan

__all__ = [
    "MOVABLE_LABEL",
    "Budget",
    "ConsolidationSettings",
    "Consolidator",
    "MovePlan",
    "Mover",
    "MoverRules",
    "build_movers",
    "find_plan",
]

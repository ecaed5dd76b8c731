"""Planning and diagnosis for people, shared by the controller and the CLI.

Owns ``explain`` (why a gang does not fit, in words: what it asks for and what the best single node
offers; used in the controller's Events and by ``fractional why`` and ``fractional status``) and
``plan`` (``fractional plan``: how many nodes of a profile a set of claims and gangs needs, offline,
with the controller's own allocator and hint search; ``workloads``: the pods a Deployment, Job,
JobSet, LeaderWorkerSet... stamps, as the controller would see them).

May import: ``driver.allocator``, ``driver.config``, ``driver.slices``, ``driver.errors``,
``driver.controller.model``, ``driver.controller.sizing``, ``driver.controller.kueue`` and
``driver.controller.gangs`` (types only). No I/O beyond reading the files it is given.
"""

from __future__ import annotations

from driver.controller.diagnosis.explain import best_node_offer, describe_demand, format_bytes
from driver.controller.diagnosis.plan import run_plan

__all__ = ["best_node_offer", "describe_demand", "format_bytes", "run_plan"]

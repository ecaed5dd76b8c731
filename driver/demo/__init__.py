"""`fractional demo`: the whole system on one machine, no cluster, no GPU."""

from __future__ import annotations

from driver.demo.scenario import SCENARIOS, run_demo

__all__ = ["SCENARIOS", "run_demo"]

"""Re-plan loop: when the EfficientMoE planner is asked for a new plan.

The first plan is free (nothing is compiled yet); then a check every ``check_rows`` trace
rows after it, and as soon as the drop monitor (:class:`~ms_efficient.efficientmoe.
schedule.DropMonitor`) fires. A check asks the planner for a candidate and the re-plan
decision (:meth:`~ms_efficient.efficientmoe.planner.EfficientMoEPlanner.check`). The
trainer, the ``EfficientMoECallback`` and the replay of ``bench moe`` all drive the planner
through this loop, so they check at the same rows.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from ms_efficient.efficientmoe.forecaster import Forecaster
from ms_efficient.efficientmoe.planner import EfficientMoEPlanner, Proposal
from ms_efficient.efficientmoe.schedule import DropMonitor, ReplanDecision
from ms_efficient.moe.plan import ExpertPlan

__all__ = ["ReplanLoop"]


class ReplanLoop:
    """When the planner is asked: the first plan (free, nothing compiled yet), then a check
    every ``check_rows`` rows after it, and as soon as the drop monitor fires (the current
    plan dropped more than ``max_drop_rate`` of the tokens over >= ``monitor_rows`` rows)."""

    def __init__(self, planner: EfficientMoEPlanner, monitor_rows: int):
        self.planner = planner
        self.monitor = DropMonitor(max(1, monitor_rows), planner.config.max_drop_rate)
        self.first_row: Optional[int] = None

    def observe(self, dropped, routed) -> None:
        """Drops the current plan had on one row: per layer (int [L]) or summed."""
        self.monitor.record(dropped, routed)

    def poll(self, row: int, counts_TLRE: np.ndarray, current: Optional[Sequence[ExpertPlan]],
             compiled: bool = True, forecaster: Optional[Forecaster] = None,
             max_horizon_steps: Optional[int] = None
             ) -> Optional[Tuple[Optional[ReplanDecision], Proposal]]:
        """At ``row`` (before it runs): None when no check is due; else (decision, candidate),
        decision None for a first plan (``current`` None or not ``compiled``), which is
        adopted as is. The first poll of a network already compiled with ``current`` (e.g.
        after warm-up steps at a static capacity) checks at once."""
        first = self.first_row is None
        if first or current is None or not compiled:
            self.first_row = row
        if current is None or not compiled:
            self.monitor.reset()
            return None, self.planner.propose(counts_TLRE, None, forecaster, max_horizon_steps)
        fired = self.monitor.fired()
        due = first or (row - self.first_row) % self.planner.check_rows == 0
        if not (due or fired):
            return None
        observed = self.monitor.rate() if fired else None
        self.monitor.reset()
        return self.planner.check(counts_TLRE, current, observed, forecaster,
                                  max_horizon_steps)

"""EfficientMoE: per-step expert-load sampling, load prediction, hot-expert replication and
placement, and static per-replica capacities planned before compilation.

Read in this order: ``predictor`` (forecast next window's tokens per expert) -> ``capacity``
(static rows per slot from a forecast) -> ``cost`` (one MoE layer's step time under a plan)
-> ``placement`` (replicate and place experts) -> ``schedule`` (adopt a new plan only when it
pays) -> ``planner`` (the online loop: sample, predict, re-plan) -> ``callback`` (the sampler
as a MindSpore callback). ``baselines`` (Switch, dropless, FasterMoE, EPLB, MindSpeed, oracles)
and ``replay`` (a trace replayed on a simulated cluster) feed ``bench``; ``commands`` holds
``plan moe`` / ``bench moe``. Everything but ``callback`` (and the measured rows of ``bench``)
is numpy.
"""

"""EfficientMoE: per-step expert-load sampling, load prediction, hot-expert replication and
placement, and static per-replica capacities planned before compilation.

Read in this order: ``sampler`` (the per-step routing counts every planner reads) ->
``predictor`` (forecast next window's tokens per expert) -> ``forecaster`` (the planner's
forecast and the errors of past forecasts) -> ``capacity`` (static rows per slot from a
forecast) -> ``levels`` (few distinct capacities per device) -> ``cost`` (one MoE layer's step
time under a plan) -> ``placement`` (replicate and place experts) -> ``schedule`` (adopt a new
plan only when it pays for migration and recompilation; the recompile-cost model) ->
``planner`` (the one planner: forecast, place, size, decide; the trainer, the callback, the
``efficientmoe`` pass and the replay all call it) -> ``replan_loop`` (when the planner is
asked) -> ``apply`` (the sampler and the planner as MindSpore callbacks, and the pass).
``baselines`` (Switch, dropless, FasterMoE, EPLB, MindSpeed, oracles) and ``replay`` (a trace
replayed on a simulated cluster) feed ``bench``; ``commands`` holds ``plan moe`` /
``bench moe``. Everything but ``apply`` (and the measured rows of ``bench``) is numpy.
"""

"""EfficientMoE: expert-load sampling and forecast, hot-expert replication and placement, and
buffers fixed before compilation, balanced every step from the step's exact counts.

Two levels (the default, ``efficientmoe`` in ``bench moe``): ``planner`` (the slow level's
layout: home placement from the forecast, spare slots, receive buffers priced from the trace;
fixed shapes, re-planned as data) -> ``balance`` (the fast level: every step and layer, water-fill
each expert's tokens over its holders, copy hot experts into spare slots, fit the buffers,
cut the per-pair rows) -> ``balanced_cost`` (what a balanced step costs) -> ``two_level``
(the trace replayed under the two levels and every baseline row, one vectorised path:
MoonEP, EPLB, FasterMoE, Switch, dropless; ``baselines`` holds the baselines' per-step rules).

Around them: ``sampler`` (per-step routing counts), ``cost`` (the cluster's cost model),
``ep_replanner`` (the slow level's re-plans during a run), ``apply`` (the trace and
EfficientMoE callbacks, and the ``efficientmoe`` pass, which sizes a one-process network's
static capacities from a trace with ``capacity``), ``replay`` (a trace replayed on a
simulated cluster) feeding ``bench``, and ``commands`` (``plan moe`` / ``bench moe``).
Everything but ``apply`` and ``ep_replanner`` (and the measured rows of ``bench``) is numpy.
"""

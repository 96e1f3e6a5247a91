"""EfficientMoE: expert-load sampling and forecast, hot-expert replication and placement, and
buffers fixed before compilation, balanced every step from the step's exact counts.

Two levels (the default, ``efficientmoe`` in ``bench moe``): ``layout`` (the slow level: home
placement from the forecast, spare slots, receive buffers priced from the trace; fixed
shapes, re-planned as data) -> ``balance`` (the fast level: every step and layer, water-fill
each expert's tokens over its holders, copy hot experts into spare slots, fit the buffers,
cut the per-pair rows) -> ``balanced_cost`` (what a balanced step costs) -> ``two_level``
(the trace replayed under the two levels and every baseline row, one vectorised path:
MoonEP, EPLB, FasterMoE, Switch, dropless; ``baselines`` holds the baselines' per-step rules).

The one-level planner, still what the ``grouped``/``counts``/``static`` layers and the
one-process trainer's online capacities run (forecast-sized static blocks): ``sampler``
(per-step routing counts) -> ``predictor`` (forecasts and their past errors, ``Forecaster``)
-> ``capacity`` (static rows per slot from a forecast) -> ``cost`` (one MoE layer's step time
under a plan) -> ``placement`` (replicate and place experts) -> ``schedule`` (adopt a new plan
only when it pays for migration and recompilation) -> ``planner`` (forecast, place, size,
decide, and ``ReplanLoop``: when it is asked) -> ``apply`` (the sampler and the planners as
MindSpore callbacks, and the pass). ``replay`` (a trace replayed on a simulated cluster)
feeds ``bench``; ``commands`` holds ``plan moe`` / ``bench moe``. Everything but ``apply``
and ``ep_replanner`` (and the measured rows of ``bench``) is numpy.
"""

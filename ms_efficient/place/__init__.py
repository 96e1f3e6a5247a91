"""TGA: a dual-population genetic algorithm that partitions a graph into pipeline stages and
places them on devices.

Read in this order: ``problem`` (OpGraph + ClusterSpec as arrays) -> ``cost`` (makespan and
memory of a placement on the shared simulator; the counted, cached ``Evaluator`` every search
scores with) -> ``operators`` (genetic operators, repair) -> ``local`` (local search) ->
``planner`` (TGA and the single-population GA). ``baselines`` (contiguous, round-robin, Baechi
m-TOPO/m-ETF/m-SCT) and ``hierarchical`` (Mirhoseini et al.'s RL placer) are compared in
``bench`` on the graphs of ``workloads``; ``stages`` plans pipeline stages of a network's
repeated blocks, ``same_devices`` prices the same devices without a pipeline (data parallel,
ZeRO) and chooses pp x dp against that or refuses; ``apply`` writes the plan
and sets ``pipeline_stage``; ``commands`` holds ``plan place`` / ``bench place``.
"""

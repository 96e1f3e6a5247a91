"""MoE runtime: the Cells and the formats they execute (no planning here).

``layer`` (router + top-k MoE FFN: static per-expert capacities, or padding-free grouped
compute), ``ep_layer`` and ``ep_routing`` (expert-parallel layer over replicas, static or
grouped dispatch, and its tables), ``ep_migration`` and ``ep_replan`` (what a re-plan
moves, numpy, and moving those rows with their optimizer state), ``alltoall`` (All-to-All /
AlltoAllV and the count exchange: native on Ascend, exact emulation elsewhere), ``kernels``
(padding-free permute / combine, ``ops.Custom`` aot on CPU), ``grouped_matmul`` (the grouped
matmul whose group sizes are data: aot over OpenBLAS on CPU, ``GroupedMatmul`` on Ascend),
``plan`` (the ``ExpertPlan`` format: slots, devices, capacities, row buffers), ``split`` (the
dispatch rule that splits a rank's tokens over an expert's replicas) and ``trace`` (the
routing-trace ``.npz`` format).
"""

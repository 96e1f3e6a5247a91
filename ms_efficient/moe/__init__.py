"""MoE runtime: the Cells and the formats they execute (no planning here).

``layer`` (router + top-k MoE FFN with static per-expert capacity), ``ep_layer`` and
``ep_routing`` (expert-parallel layer over replicas and its static dispatch tables),
``alltoall`` (All-to-All / AlltoAllV: native on Ascend, exact emulation elsewhere),
``kernels`` (padding-free permute / combine, ``ops.Custom`` aot on CPU), ``plan`` (the
``ExpertPlan`` format: slots, devices, capacities), ``split`` (the dispatch rule that splits a
rank's tokens over an expert's replicas) and ``trace`` (the routing-trace ``.npz`` format).
"""

"""MPipeMoE: overlap the All-to-All of one token chunk with the expert compute of another.

``planner`` chooses the chunk count online and the activation-reuse strategy by cost (numpy
and the shared simulator); ``layer`` is the ``PipelinedMoE`` Cell that runs an MoE layer in
chunks; ``bench`` replays chunk policies (fixed, Tutel-style adaptive, ours); ``commands``
holds ``plan mpipe`` / ``bench mpipe``.
"""

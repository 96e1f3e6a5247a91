"""Minimal-redundancy sharding: an ILP (PuLP/CBC) picks one sharding strategy per operator to
minimise per-device memory within a communication budget.

Read in this order: ``strategies`` (operators as einsum-like specs, the dp x mp mesh, candidate
strategies) -> ``cost`` (per-device memory and communication of a strategy, resharding on an
edge) -> ``ilp`` (the integer program) -> ``planner`` (request -> plan -> YAML). ``workloads``
are the GPT operator templates, ``baselines`` Megatron TP/SP, DP and ZeRO costed by the same
model, ``apply`` sets ``Primitive.shard`` and writes strategy JSON, ``commands`` holds
``plan shard`` / ``bench shard``.
"""

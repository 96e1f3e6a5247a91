"""Reference networks (``gpt_moe``) and the exported graphs of real networks the benchmarks
plan (``zoo``: the reference model and mindcv vision models, exported to MINDIR and cached)."""

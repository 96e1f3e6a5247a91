"""MemOpt: per-layer keep/recompute/swap planning with a dual-agent RL planner and baselines."""

"""Mixture-of-Experts building blocks: the MoE layer Cell, All-to-All backends and routing traces."""

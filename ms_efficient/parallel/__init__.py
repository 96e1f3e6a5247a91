"""Parallel plans: minimal-redundancy sharding (ILP) and TGA partitioning/placement."""

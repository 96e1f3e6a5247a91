"""Shared foundations every capability builds on; nothing here imports another part of the
package (only other ``core`` modules).

- ``config``: typed run configuration from YAML, validated once where it is built.
- ``cluster``: devices, memory, peak FLOP/s and alpha-beta links; the Ascend 910B presets.
- ``collectives``: alpha-beta cost of ring / pairwise collectives over one link kind.
- ``registry``: the name -> pass table behind :func:`ms_efficient.optimize`.
- ``backend``: the one place where code paths are chosen per MindSpore device target.
- ``fileio``: atomic file writes; ``benchio``: the table + JSON every benchmark prints.
"""

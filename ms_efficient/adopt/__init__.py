"""Adopt a network's own MoE blocks: recognise them (``blocks``: the documented block
contract as code) and replace each with the package's layer, keeping the user's weights and
parameter names (``replace``: :func:`adopt_moe`), so every MoE pass and callback plans them.

Above ``moe`` (it builds the package's layer) and beside the capabilities (the MoE passes
point to it when a network holds MoE blocks they cannot plan yet).
"""
from ms_efficient.adopt.blocks import find_moe_blocks
from ms_efficient.adopt.replace import AdoptedBlock, adopt_hint, adopt_moe

__all__ = ["adopt_moe", "find_moe_blocks", "adopt_hint", "AdoptedBlock"]

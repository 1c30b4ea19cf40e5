"""IRModule-level helpers shared across amp's CUDA backend (graph rewrites, kernels, pipeline)."""
from __future__ import annotations


def replace_functions(mod, updates: dict):
    """``mod`` with the functions in ``updates`` ({GlobalVar: function}) replaced; ``mod`` itself
    when there is nothing to replace."""
    if not updates:
        return mod
    out = mod.clone()
    for gv, func in updates.items():
        out[gv] = func
    return out

"""IRModule helpers every layer shares (TVM-free: they use only the module's own methods)."""
from __future__ import annotations


def replace_functions(mod, updates: dict):
    """``mod`` with the functions in ``updates`` ({GlobalVar: function}) replaced; ``mod`` itself
    when there is nothing to replace (a clone otherwise: the caller's module is never changed)."""
    if not updates:
        return mod
    out = mod.clone()
    for gv, func in updates.items():
        out[gv] = func
    return out


def replace_main(mod, main):
    """``mod`` with its ``main`` replaced; every other function keeps its GlobalVar (call_tir
    refers to PrimFuncs by GlobalVar, not by name)."""
    return replace_functions(mod, {mod.get_global_var("main"): main})

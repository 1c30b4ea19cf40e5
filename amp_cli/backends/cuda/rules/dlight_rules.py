"""dlight's own GPU rules that amp keeps, registered in amp's order (after amp's GEMM rule)."""
from __future__ import annotations

from .... import tvm_compat
from ..registry import register


@register("gemv", "rule", 20)
def make_gemv(_ctx):
    return tvm_compat.dlight().gpu.GEMV()


@register("reduction", "rule", 30)
def make_reduction(_ctx):
    return tvm_compat.dlight().gpu.Reduction()


@register("general_reduction", "rule", 40)
def make_general_reduction(_ctx):
    return tvm_compat.dlight().gpu.GeneralReduction()

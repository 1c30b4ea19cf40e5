"""The index width of kernels over symbolic extents: tir/index32.py's marking pass, registered as
a "tir" stage pass of the CUDA pipeline (it needs the build's ranges; the TIR pipeline then
narrows the kernels it marked)."""
from __future__ import annotations

from ..registry import register
from ..tir import index32


@register("index32", "tir", 90, switch="index32",
          labels={"index32_kernels": "kernels over symbolic extents with 32-bit indices"})
def make_pass(ctx):
    return index32.mark_pass(ctx.ranges, ctx.stats) if ctx.ranges else None

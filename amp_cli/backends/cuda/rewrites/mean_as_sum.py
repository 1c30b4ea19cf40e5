"""fp32 means as ``sum(x) * (1 / n)``, so the cast that feeds them fuses into the reduction.

A mixed-precision model keeps its reductions in fp32: a squeeze-excitation block's global
average pool over an fp16 activation becomes ``mean(astype(x, float32), [H, W])``. TOPI
legalizes ``mean`` as a sum block and a divide block in one PrimFunc, which TVM's
AnnotateTIROpPattern marks ``kOutEWiseFusable`` -- and FuseOps fuses no producer into that
pattern. The cast then runs as a kernel of its own that writes the whole activation in fp32
(twice the bytes it read) for the mean to read again: ``cast39`` 0.042 ms x4 in
efficientnet_b0's profile on the H100, as long as the mean itself. ``sum`` legalizes to one
reduction block (``kCommReduce``), into which FuseOps fuses injective producers, so the cast
is read inside the reduction's loads and the fp32 copy never exists.

The scale is a multiply by the fp32 constant ``1 / n`` (within an ulp of the divide). Only
fp32 means with static reduced extents are rewritten (an fp16 sum could overflow where the
mean does not).
"""
from __future__ import annotations

import math

from .... import tvm_compat
from ..registry import register
from .base import add_counts, module_pass, op_name, rewrite_calls, shape_of


def _reduced_count(call) -> int | None:
    """Elements averaged per output of ``mean`` (None when a reduced extent is symbolic)."""
    shape = shape_of(call.args[0])
    if shape is None:
        return None
    axes = call.attrs.axis
    axes = range(len(shape)) if axes is None else [int(a) % len(shape) for a in axes]
    sizes = [shape[a] for a in axes]
    return math.prod(sizes) if all(isinstance(s, int) for s in sizes) else None


def mean_as_sum(mod):
    """``mod`` with every fp32 ``mean`` over static extents as ``sum * (1 / n)``; returns
    (module, count)."""
    relax = tvm_compat.relax()
    count = 0

    def rewrite(bb, call, lookup):  # noqa: ARG001
        nonlocal count
        if op_name(call) != "relax.mean" or call.ty.dtype != "float32":
            return None
        n = _reduced_count(call)
        if not n:
            return None
        count += 1
        a = call.attrs
        total = bb.emit(relax.op.sum(call.args[0], a.axis, a.keepdims))
        return relax.op.multiply(total, relax.const(1.0 / n, "float32"))

    new, _ = rewrite_calls(mod, rewrite)
    return new, count


@register("mean_as_sum", "graph", 18, switch="mean_as_sum",
          labels={"means_as_sums": "fp32 means as a sum and a scale (their cast fuses in)"})
def make_pass(ctx):
    def run(mod):
        new, count = mean_as_sum(mod)
        add_counts(ctx.stats, means_as_sums=count)
        return new

    return module_pass(run, "AmpMeanAsSum")

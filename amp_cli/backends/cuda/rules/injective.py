"""amp's CUDA schedule for large injective kernels (gathers, layout changes, casts).

dlight's ``Fallback`` rule gives every output element its own thread (1024 per CTA). For a
gather such as ResNet-50's stem im2col (8x112x112x147 outputs, each a predicated load from the
NCHW fp32 image behind a chain of index divisions) each thread then has one load in flight, so
the kernel runs ~54 waves of latency-bound threads: 0.080 ms synced in the H200 profile, the
largest non-GEMM kernel of resnet50.

This rule gives each thread ``UNROLL`` elements, ``THREADS`` apart (so a warp's accesses stay as
coalesced as before), in an unrolled loop: the loads of all ``UNROLL`` elements can be issued
before the first store. It takes only PrimFuncs that reduce to one spatial block after inlining,
with at least ``MIN_ELEMENTS`` outputs; anything else is left to the next rule. A symbolic
extent (a dynamic batch) is counted at the ranges' optima (``dims``); the last CTA's threads
past the end are predicated off. Without an optimum for it, the kernel is left to dlight.
"""
from __future__ import annotations

import math

from .... import tvm_compat
from ..kernels.analysis import size_at_optimum
from ..registry import register

THREADS = 256
UNROLL = 4
MIN_ELEMENTS = 1 << 20


def _make_rule():
    tvm = tvm_compat.tvm()
    dl = tvm_compat.dlight()
    normalize_prim_func = tvm_compat.dlight_analysis().normalize_prim_func
    try_inline = tvm_compat.dlight_base().try_inline

    class AmpInjective(dl.ScheduleRule):
        """Large injective kernels: ``UNROLL`` elements per thread (module doc)."""

        def __init__(self, dims: dict | None = None):
            super().__init__()
            self.dims = dict(dims or {})

        def apply(self, func, target, tunable):
            if not isinstance(func, tvm_compat.prim_func_class()) or target.kind.name != "cuda":
                return None
            sch = tvm.s_tir.Schedule(func)
            infos = normalize_prim_func(sch)
            if infos is None:
                return None
            infos = try_inline(sch, infos)
            if len(infos) != 1 or any(kind != "S" for kind in infos[0].dom_kind()):
                return None
            block = infos[0].block_rv
            loops = sch.get_loops(block)
            # a symbolic extent at the optima (0: unknown, declined)
            sizes = [int(e.value) if hasattr(e, "value") else size_at_optimum(e, self.dims, 0)
                     for e in (sch.get(loop).extent for loop in loops)]
            if not loops or min(sizes) < 1 or math.prod(sizes) < MIN_ELEMENTS:
                return None
            bx, unroll, tx = sch.split(sch.fuse(*loops), [None, UNROLL, THREADS])
            sch.bind(bx, "blockIdx.x")
            sch.bind(tx, "threadIdx.x")
            sch.unroll(unroll)
            return sch

    return AmpInjective


def AmpInjective(dims: dict | None = None):  # noqa: N802 - a rule instance, like dlight's
    """amp's large-injective-kernel rule (an instance of a dlight ``ScheduleRule``);
    ``dims``: {symbolic dim: optimum} of a dynamic module."""
    return _make_rule()(dims)


@register("unroll_injective", "rule", 50, switch="unroll_injective")
def make_rule(ctx):
    return AmpInjective(ctx.dims)

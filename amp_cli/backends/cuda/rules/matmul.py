"""amp's default GEMM rule for CUDA: dlight's Matmul, with tensor cores in two more cases.

dlight's ``Matmul`` hands a GEMM to its wmma rule (``MatmulTensorization``) only when the inputs
are fp16 and *every* static M/N/K extent is > 64. Two gaps matter for amp's models:

- sides of 64 or less (ResNet-50's stem and layer-1 convolutions as GEMMs have N=64 or K=64,
  BERT's attention has K=64 or N=64, a detector's early convs N=16 or 32) fall back to SIMT
  code. ``AmpMatmul`` uses tensor cores when every extent is >= 32 (>= 16 with ``narrow``,
  YAML ``cuda.narrow_gemm``: amp's ``tc_gemm`` then takes a tile as narrow as N for N <= 32);
  ``MatmulTensorization`` pads M/N/K up to its 128x128x64 tile itself (``pad_einsum``).
- bf16 has no rule at all. The wmma intrinsic *generators* in tvm.s_tir.tensor_intrin.cuda are
  dtype-generic and CUDA's ``nvcuda::wmma`` has bf16 16x16x16 fragments on sm_80+, but TVM
  registers only f16/s8 variants and ``MatmulTensorization`` asks for f16 by name. amp registers
  the bf16 variants (``amp_wmma_*_bf16*``) and runs ``MatmulTensorization`` with its intrinsic
  lookup pointed at them (bf16 inputs, fp32 accumulation only).

Static GEMMs of 2..16 rows (classifier heads at small batch) take amp's ``small_gemm`` schedule
on CUDA, whatever the dtype. A GEMM whose row count M is symbolic (a dynamic model's linear
layers: M = batch x sequence) with static N and K takes amp's ``tc_gemm`` schedule too, M padded
to whole tiles at run time, with the tile chosen for M at the ranges' optima (``dims``: one
kernel serves every M, so it is tuned for the size the user said to optimize for). Anything
else (fp32 GEMMs, symbolic N or K, non-CUDA) is dlight's ``Matmul`` unchanged.
"""
from __future__ import annotations

import functools

from .... import tvm_compat
from ....hardware import arch_sm
from ..kernels import small_gemm, tc_gemm
from ..kernels.analysis import SYMBOLIC_M_GUESS, gemm_shape, size_at_optimum
from ..kernels.intrinsics import bf16_intrinsics
from ..registry import register

MIN_EXTENT = 32
NARROW_MIN_EXTENT = 16  # one wmma fragment: with cuda.narrow_gemm, N = 16 takes a narrow tile
BF16_MIN_SM = 80
TC_MIN_SM = 70


@functools.lru_cache(maxsize=None)
def _make_rule():
    dl = tvm_compat.dlight()
    MatmulTensorization = tvm_compat.dlight_matmul().MatmulTensorization

    class AmpMatmul(dl.gpu.Matmul):
        """dlight's Matmul plus wmma for sides >= ``min_extent`` and for bf16 (see module doc)."""

        def __init__(self, min_extent: int = MIN_EXTENT, own_gemm: bool = True,
                     small_m: bool = True, dims: dict | None = None,
                     ranges: dict | None = None, narrow: bool = False,
                     pad_slack: float | None = None):
            super().__init__()
            self.narrow = narrow
            self.pad_slack = pad_slack
            # the narrow tiles take sides down to one fragment; without them a side below
            # ``min_extent`` is left to dlight's SIMT rule
            self.min_extent = min(min_extent, NARROW_MIN_EXTENT) if narrow else min_extent
            self.own_gemm = own_gemm
            self.small_m = small_m
            self.dims = dict(dims or {})
            self.ranges = dict(ranges or {})

        def _wants_tensor_cores(self, func, info, target) -> str | None:
            """``info``: :func:`gemm_shape` of ``func``."""
            sm = arch_sm(target)
            if sm < TC_MIN_SM or "dlight.do_not_tensorize" in (func.attrs or {}):
                return None
            if info is None:
                return None
            in_dtype, out_dtype, _, sizes = info
            if any(s is not None and s < self.min_extent for s in sizes):
                return None
            if in_dtype == "float16" and out_dtype in ("float16", "float32"):
                return "float16"
            if in_dtype == "bfloat16" and out_dtype == "float32" and sm >= BF16_MIN_SM:
                return "bfloat16"
            return None

        def apply(self, func, target, tunable):
            kind = info = None
            if isinstance(func, tvm_compat.prim_func_class()) and self.is_target_available(target):
                info = gemm_shape(func)  # once: each of amp's schedules below reads it
                if self.own_gemm and self.small_m and target.kind.name == "cuda":
                    sch = _small_m_schedule(func, info, arch_sm(target))
                    if sch is not None:
                        return sch
                kind = self._wants_tensor_cores(func, info, target)
            if kind is not None and self.own_gemm:
                sch = _own_schedule(func, kind, info, arch_sm(target), self.dims, self.ranges,
                                    self.narrow, self.pad_slack)
                if sch is not None:
                    return sch
            if kind == "float16":
                sch = MatmulTensorization().apply(func, target, tunable)
                if sch is not None:
                    return sch
            elif kind == "bfloat16":
                with bf16_intrinsics():
                    sch = MatmulTensorization().apply(func, target, tunable)
                if sch is not None:
                    return sch
            return super().apply(func, target, tunable)

    return AmpMatmul


# the batch of a batched GEMM over a symbolic batch when the optima do not give it
SYMBOLIC_BATCH_GUESS = 8
# tile variants are chosen over sizes up to this (a range's max may be huge; the largest tile
# fills the GPU long before)
MAX_VARIANT_SIZE = 1 << 24


def _own_schedule(func, in_dtype: str, info, sm: int, dims: dict | None = None,
                  ranges: dict | None = None, narrow: bool = False,
                  pad_slack: float | None = None):
    """amp's cp.async wmma schedule (``tc_gemm``) for a GEMM with static N and K (``info``: its
    :func:`gemm_shape`); a symbolic M or a symbolic batch (not both) gets the tile for its value
    at ``dims`` ({dim: optimum}, module docstring). Else None (symbolic N or K:
    MatmulTensorization pads them). ``pad_slack``: ``tc_gemm.choose_config``'s."""
    if info is None:
        return None
    _, out_dtype, batch, sizes = info
    if sizes[1] is None or sizes[2] is None or (batch is None and sizes[0] is None):
        return None
    symbolic = gemm_shape(func, symbolic=True) if None in (batch, sizes[0]) else None

    m_at = sizes[0] if sizes[0] is not None else \
        size_at_optimum(symbolic[3][0], dims, SYMBOLIC_M_GUESS)
    # a symbolic batch (the images of a conv over a dynamic batch): one grid row per batch
    # entry, the tile chosen for the batch at its optimum
    batch_at = batch if batch is not None else \
        size_at_optimum(symbolic[2], dims, SYMBOLIC_BATCH_GUESS)
    acc = "float16" if out_dtype == "float16" else "float32"
    variants = _variants(symbolic, batch, sizes, sm, ranges, acc, pad_slack) if symbolic else []
    if len(variants) > 1:
        return _dispatched(func, in_dtype, acc, symbolic, batch, sizes, sm, variants)
    return tc_gemm.schedule_gemm(func, in_dtype, acc, batch_at, [m_at, *sizes[1:]], sm,
                                 rows=sizes[0], narrow=narrow, pad_slack=pad_slack)


def _symbolic_size(symbolic, batch):
    """The symbolic size of a GEMM (:func:`gemm_shape` with ``symbolic``): M, or the batch."""
    return symbolic[3][0] if batch is not None else symbolic[2]


def _variants(symbolic, batch, sizes, sm: int, ranges: dict | None, acc: str,
              pad_slack: float | None = None) -> list:
    """``tc_gemm.tile_variants`` over the symbolic size's range (``ranges``: {dim: (lo, hi)});
    [] when a dim has no range."""
    if not ranges:
        return []
    size = _symbolic_size(symbolic, batch)
    lo = tvm_compat.size_upper_bound(size, {d: r[0] for d, r in ranges.items()})
    hi = tvm_compat.size_upper_bound(size, {d: r[1] for d, r in ranges.items()})
    if not (isinstance(lo, int) and isinstance(hi, int)) or lo < 1:
        return []
    if batch is not None:
        def sizes_at(v):
            return batch, v
    else:
        def sizes_at(v):
            return v, sizes[0]
    return tc_gemm.tile_variants(sizes_at, lo, min(hi, MAX_VARIANT_SIZE), sizes[1], sizes[2],
                                 sm, 2 if acc == "float16" else 4, pad_slack)


def _dispatched(func, in_dtype: str, acc: str, symbolic, batch, sizes, sm: int, variants):
    """One schedule per tile of ``variants``, behind a host-side branch on the symbolic size
    (``tc_gemm.dispatch``); None unless every variant schedules."""
    tvm = tvm_compat.tvm()
    funcs = []
    for start, cfg in variants:
        b, m = (batch, start) if batch is not None else (start, sizes[0])
        sch = tc_gemm.schedule_gemm(func, in_dtype, acc, b, [m, *sizes[1:]], sm, cfg,
                                    rows=sizes[0])
        if sch is None:
            return None
        funcs.append(sch.mod["main"])
    size = _symbolic_size(symbolic, batch)
    return tvm.s_tir.Schedule(tc_gemm.dispatch(funcs, size, [v for v, _ in variants]))


def _small_m_schedule(func, info, sm: int):
    """amp's few-rows GEMM schedule (``small_gemm``: M <= 16, any float dtype) for ``func``
    (``info``: its :func:`gemm_shape`), else None."""
    if info is None or not small_gemm.applies(info[2], info[3]):
        return None
    return small_gemm.schedule_small_m(func, info[2], info[3], sm)


def AmpMatmul(min_extent: int = MIN_EXTENT, own_gemm: bool = True,  # noqa: N802
              small_m: bool = True, dims: dict | None = None,
              ranges: dict | None = None, narrow: bool = False,
              pad_slack: float | None = None):
    """amp's GEMM schedule rule (an instance of a dlight ``Matmul`` subclass). ``own_gemm``:
    fp16/bf16 GEMMs with static N and K use amp's pipelined wmma schedule (tc_gemm) first, and
    static GEMMs of 2..16 rows amp's split-K-across-lanes schedule (small_gemm) on CUDA unless
    ``small_m`` is off. ``dims``: {symbolic dim: optimum} of a dynamic module; ``ranges``:
    {symbolic dim: (lo, hi)}, over which a symbolic GEMM gets one tile variant per size band.
    ``narrow``: GEMMs with N <= 32 take tc_gemm's narrow tiles (``tc_gemm.NARROW``; on by
    default through ``cuda.narrow_gemm``); off, every side must be >= 32. ``pad_slack``:
    tiles that pad the output more than that many times the least-padded one are not chosen
    (``tc_gemm.PAD_SLACK`` through ``cuda.padding_aware_tiles``; None: padding not weighed)."""
    return _make_rule()(min_extent, own_gemm, small_m, dims, ranges, narrow, pad_slack)


def ranges_to_optimum(ranges: dict, dims: dict) -> dict:
    """``ranges`` ({dim: (lo, hi)}) cut at each dim's optimum (``dims``): tile variants chosen
    over them stop there, and the optimum's tile serves every size above it.

    >>> ranges_to_optimum({"batch": (1, 32), "seq": (16, 512)}, {"batch": 8})
    {'batch': (1, 8), 'seq': (16, 512)}
    """
    return {d: (lo, max(lo, min(hi, dims.get(d, hi)))) for d, (lo, hi) in ranges.items()}


@register("matmul", "rule", 10, reads=("small_gemm", "narrow_gemm", "padding_aware_tiles",
                                       "tile_variants_above_optimum"))
def make_rule(ctx):
    ranges = ctx.ranges if ctx.cuda.tile_variants_above_optimum else \
        ranges_to_optimum(ctx.ranges, ctx.dims)
    return AmpMatmul(small_m=ctx.cuda.small_gemm, dims=ctx.dims, ranges=ranges,
                     narrow=ctx.cuda.narrow_gemm,
                     pad_slack=tc_gemm.PAD_SLACK if ctx.cuda.padding_aware_tiles else None)

"""amp's default GEMM rule for CUDA: dlight's Matmul, with tensor cores in two more cases.

dlight's ``Matmul`` hands a GEMM to its wmma rule (``MatmulTensorization``) only when the inputs
are fp16 and *every* static M/N/K extent is > 64. Two gaps matter for amp's models:

- sides of exactly 64 (ResNet-50's stem and layer-1 convolutions as GEMMs have N=64 or K=64,
  BERT's attention has K=64 or N=64) fall back to SIMT code. ``AmpMatmul`` uses tensor cores when
  every extent is >= ``min_extent`` (32): ``MatmulTensorization`` pads M/N/K up to its 128x128x64
  tile itself (``pad_einsum``), so a side of 64 wastes part of a tile but runs on tensor cores.
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
from ..kernels.analysis import gemm_shape
from ..kernels.intrinsics import bf16_intrinsics
from ..registry import register

MIN_EXTENT = 32
BF16_MIN_SM = 80
TC_MIN_SM = 70


@functools.lru_cache(maxsize=None)
def _make_rule():
    dl = tvm_compat.dlight()
    MatmulTensorization = tvm_compat.dlight_matmul().MatmulTensorization

    class AmpMatmul(dl.gpu.Matmul):
        """dlight's Matmul plus wmma for sides >= ``min_extent`` and for bf16 (see module doc)."""

        def __init__(self, min_extent: int = MIN_EXTENT, own_gemm: bool = True,
                     small_m: bool = True, dims: dict | None = None):
            super().__init__()
            self.min_extent = min_extent
            self.own_gemm = own_gemm
            self.small_m = small_m
            self.dims = dict(dims or {})

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
                sch = _own_schedule(func, kind, info, arch_sm(target), self.dims)
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


# M of a symbolic GEMM when the ranges' optima do not give it: a few waves of mid-size tiles
SYMBOLIC_M_GUESS = 1024


def _own_schedule(func, in_dtype: str, info, sm: int, dims: dict | None = None):
    """amp's cp.async wmma schedule (``tc_gemm``) for a GEMM with static batch, N and K (``info``:
    its :func:`gemm_shape`); a symbolic M gets the tile for M at ``dims`` ({dim: optimum},
    module docstring). Else None (symbolic N or K: MatmulTensorization pads them)."""
    if info is None:
        return None
    _, out_dtype, batch, sizes = info
    if batch is None or sizes[1] is None or sizes[2] is None:
        return None
    m_at = sizes[0]
    if m_at is None:
        symbolic = gemm_shape(func, symbolic=True)
        m_at = tvm_compat.size_upper_bound(symbolic[3][0], dims or {}) if symbolic else None
        if not isinstance(m_at, int) or m_at < 1:
            m_at = SYMBOLIC_M_GUESS
    acc = "float16" if out_dtype == "float16" else "float32"
    return tc_gemm.schedule_gemm(func, in_dtype, acc, batch, [m_at, *sizes[1:]], sm,
                                 rows=sizes[0])


def _small_m_schedule(func, info, sm: int):
    """amp's few-rows GEMM schedule (``small_gemm``: M <= 16, any float dtype) for ``func``
    (``info``: its :func:`gemm_shape`), else None."""
    if info is None or not small_gemm.applies(info[2], info[3]):
        return None
    return small_gemm.schedule_small_m(func, info[2], info[3], sm)


def AmpMatmul(min_extent: int = MIN_EXTENT, own_gemm: bool = True,  # noqa: N802
              small_m: bool = True, dims: dict | None = None):
    """amp's GEMM schedule rule (an instance of a dlight ``Matmul`` subclass). ``own_gemm``:
    fp16/bf16 GEMMs with static N and K use amp's pipelined wmma schedule (tc_gemm) first, and
    static GEMMs of 2..16 rows amp's split-K-across-lanes schedule (small_gemm) on CUDA unless
    ``small_m`` is off. ``dims``: {symbolic dim: optimum} of a dynamic module."""
    return _make_rule()(min_extent, own_gemm, small_m, dims)


@register("matmul", "rule", 10, reads=("small_gemm",))
def make_rule(ctx):
    return AmpMatmul(small_m=ctx.cuda.small_gemm, dims=ctx.dims)

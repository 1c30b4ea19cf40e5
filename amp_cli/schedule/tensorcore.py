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
on CUDA, whatever the dtype. Anything else (fp32 or dynamic-only GEMMs, non-CUDA) is dlight's
``Matmul`` unchanged.
"""
from __future__ import annotations

import contextlib
import functools

from .. import tvm_compat

MIN_EXTENT = 32
BF16_MIN_SM = 80
TC_MIN_SM = 70


def arch_sm(target) -> int:
    arch = str(target.attrs.get("arch", "")) if target.kind.name == "cuda" else ""
    digits = "".join(ch for ch in arch.split("_")[-1] if ch.isdigit())
    return int(digits) if digits else 0


@functools.lru_cache(maxsize=None)
def register_bf16_wmma() -> dict:
    """Register bf16 16x16x16 wmma intrinsics (shared.dyn loads, B transposed, fp32 accumulate)
    built with TVM's own generators; returns the intrinsic group MatmulTensorization uses."""
    tvm_compat.tvm()
    from tvm.s_tir import TensorIntrin
    from tvm.s_tir.tensor_intrin import cuda as tc

    group = {
        "init": tc.WMMA_FILL_16x16x16_F32_INTRIN,
        "load_a": "amp_wmma_load_16x16x16_bf16_a_shared_dyn",
        "load_b": "amp_wmma_load_16x16x16_bf16_b_trans_shared_dyn",
        "compute": "amp_wmma_sync_16x16x16_bf16bf16f32_trans",
        "store": tc.WMMA_STORE_16x16x16_F32_SHARED_DYN_INTRIN,
    }
    TensorIntrin.register(group["load_a"], *tc.get_wmma_load_intrin(
        16, 16, 16, "bfloat16", "shared.dyn", False, False), override=True)
    TensorIntrin.register(group["load_b"], *tc.get_wmma_load_intrin(
        16, 16, 16, "bfloat16", "shared.dyn", True, True), override=True)
    TensorIntrin.register(group["compute"], *tc.get_wmma_sync_intrin(
        16, 16, 16, "bfloat16", "float32", True), override=True)
    return group


@functools.lru_cache(maxsize=None)  # once per process
def register_tensor_intrinsics() -> None:
    """Register TVM's tensor intrinsics (wmma, mma, ...) and amp's bf16 wmma ones. Schedules and
    tuning records refer to them by name, so a process must do this before it reads records or
    builds tensor-core candidates."""
    tvm_compat.tvm()
    import tvm.s_tir.tensor_intrin  # noqa: F401 - registers on import

    register_bf16_wmma()


@contextlib.contextmanager
def _bf16_intrinsics():
    """While active, MatmulTensorization's f16 intrinsic lookups return the bf16 group (it imports
    ``get_wmma_intrin_group`` from the module at call time)."""
    from tvm.s_tir.tensor_intrin import cuda as tc

    group = register_bf16_wmma()
    original = tc.get_wmma_intrin_group

    def lookup(load_scope, store_scope, in_dtype, out_dtype, trans_b):
        if in_dtype == "float16" and out_dtype == "float32" and load_scope == "shared.dyn" \
                and store_scope == "shared.dyn" and trans_b:
            return dict(group)
        # anything else (e.g. its f16-accumulate retry) has no bf16 intrinsic: fail to tensorize
        return original(load_scope, store_scope, in_dtype, out_dtype, trans_b)

    tc.get_wmma_intrin_group = lookup
    try:
        yield
    finally:
        tc.get_wmma_intrin_group = original


def gemm_shape(func):
    """(dtype_in, dtype_out, batch, [M, N, K]) of a matmul-like PrimFunc, static extents as ints
    and dynamic ones as None, or None when it is not one (the analysis dlight's rules use)."""
    tvm = tvm_compat.tvm()
    from tvm.s_tir.dlight.analysis import get_root_block
    from tvm.s_tir.dlight.gpu import matmul as dm

    try:
        sch = tvm.s_tir.Schedule(func)
        blocks = sch.get_child_blocks(get_root_block(sch))
        reductions = dm.get_reduction_blocks(sch, blocks)
        if reductions is None:
            return None
        block = sch.get(reductions[0])
        maps = dm.get_index_map(block)
        if maps is None:
            return None
        dom = [iv.dom.extent for iv in block.iter_vars]
        extents = maps[0].map_shape(dom)  # -> [S, I, J, K]
        in_dtype, out_dtype = dm.get_in_out_dtypes(block)
    except Exception:  # noqa: BLE001 - not a GEMM dlight understands
        return None
    sizes = [int(e.value) if hasattr(e, "value") else None for e in list(extents)]
    return str(in_dtype), str(out_dtype), sizes[0], sizes[1:]


def gemm_extents(func):
    """(dtype_in, dtype_out, [M, N, K]) of a matmul-like PrimFunc (see :func:`gemm_shape`)."""
    info = gemm_shape(func)
    return None if info is None else (info[0], info[1], info[3])


@functools.lru_cache(maxsize=None)
def _make_rule():
    dl = tvm_compat.dlight()
    from tvm.s_tir.dlight.gpu.matmul import MatmulTensorization

    class AmpMatmul(dl.gpu.Matmul):
        """dlight's Matmul plus wmma for sides >= ``min_extent`` and for bf16 (see module doc)."""

        def __init__(self, min_extent: int = MIN_EXTENT, own_gemm: bool = True,
                     small_m: bool = True):
            super().__init__()
            self.min_extent = min_extent
            self.own_gemm = own_gemm
            self.small_m = small_m

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
                sch = _own_schedule(func, kind, info, arch_sm(target))
                if sch is not None:
                    return sch
            if kind == "float16":
                sch = MatmulTensorization().apply(func, target, tunable)
                if sch is not None:
                    return sch
            elif kind == "bfloat16":
                with _bf16_intrinsics():
                    sch = MatmulTensorization().apply(func, target, tunable)
                if sch is not None:
                    return sch
            return super().apply(func, target, tunable)

    return AmpMatmul


def _own_schedule(func, in_dtype: str, info, sm: int):
    """amp's cp.async wmma schedule (``tc_gemm``) for a static-shape GEMM (``info``: its
    :func:`gemm_shape`), else None."""
    from . import tc_gemm

    if info is None:
        return None
    _, out_dtype, batch, sizes = info
    if batch is None or any(s is None for s in sizes):
        return None  # dynamic extents: MatmulTensorization pads symbolically
    acc = "float16" if out_dtype == "float16" else "float32"
    return tc_gemm.schedule_gemm(func, in_dtype, acc, batch, sizes, sm)


def _small_m_schedule(func, info, sm: int):
    """amp's few-rows GEMM schedule (``small_gemm``: M <= 16, any float dtype) for ``func``
    (``info``: its :func:`gemm_shape`), else None."""
    from . import small_gemm

    if info is None or not small_gemm.applies(info[2], info[3]):
        return None
    return small_gemm.schedule_small_m(func, info[2], info[3], sm)


def AmpMatmul(min_extent: int = MIN_EXTENT, own_gemm: bool = True,  # noqa: N802
              small_m: bool = True):
    """amp's GEMM schedule rule (an instance of a dlight ``Matmul`` subclass). ``own_gemm``:
    static-shape fp16/bf16 GEMMs use amp's pipelined wmma schedule (tc_gemm) first, and static
    GEMMs of 2..16 rows amp's split-K-across-lanes schedule (small_gemm) on CUDA unless
    ``small_m`` is off."""
    return _make_rule()(min_extent, own_gemm, small_m)

"""32-bit index arithmetic for kernels over symbolic extents whose ranges keep it in bounds.

Relax's shape variables are int64, so every index a kernel over a symbolic batch or sequence
computes is int64, and TVM's ``NarrowDataType(32)`` cannot narrow it: the variable is unbounded
as far as the TIR knows. On a GPU that costs twice: 64-bit integer division and modulo are
emulated (a conv GEMM's gather divides each row index by the image width, per element), and the
wider index arithmetic defeats the alignment proofs behind 16-byte ``cp.async`` copies (the
dynamic ResNet-50 stem read its weights in 8-byte pieces where the static build reads 16).

A dynamic build knows more: every dynamic dim has a range, and ``main`` checks the range before
any kernel runs (compile/dynamic.py). :func:`mark_pass` (a "tir" stage pass of the CUDA
pipeline, registered in kernels/index_width.py, which sees the ranges) marks each PrimFunc
whose every buffer -- parameters and intermediates -- has fewer than ``LIMIT`` elements with
each dim at its maximum; :func:`narrow_pass`, in the TIR pipeline right
before ``NarrowDataType``, runs TVM's ``ForceNarrowIndexToInt32`` on the marked ones only. A
kernel with a dim that has no range, or a buffer that could reach ``LIMIT``, keeps int64.
amp's TIRx kernels (the Hopper GEMMs) compute in int32 already and are not touched.
"""
from __future__ import annotations

import math

from .... import tvm_compat
from ....ir_attrs import INDEX32, IS_HOST_FUNC, TIRX_KERNEL
from ....ir_module import replace_functions

# elements per buffer at most: half of int32's range, so that an index a few rows or a padding
# offset past a buffer's end (a masked last tile, an implicit GEMM's border) cannot wrap either
LIMIT = 1 << 30
WIDE_DATA = ("int64", "uint64")


def _buffers(func) -> list:
    """The type of every buffer ``func`` declares or reads (buffer-typed Vars: parameters and
    intermediate allocations alike): ``.shape``, ``.dtype``."""
    T = tvm_compat.tirx()
    types = [p.ty for p in func.params if hasattr(p.ty, "shape")]

    def on_var(var, _mutator):
        if hasattr(var.ty, "shape"):
            types.append(var.ty)
        return var

    tvm_compat.structural_mutate(func.body, [(T.Var, on_var)])
    return types


def _shapes(func) -> list:
    return [t.shape for t in _buffers(func)]


def is_symbolic(func) -> bool:
    return any(not isinstance(tvm_compat.size_value(d), int) for s in _shapes(func) for d in s)


def fits(func, upper: dict[str, int], limit: int = LIMIT) -> bool:
    """Every buffer of ``func`` has fewer than ``limit`` elements when each symbolic dim is at
    most ``upper[name]``; False when some dim has no bound there, or when a buffer holds 64-bit
    integers (an attention mask, token ids: TVM's pass narrows only index arithmetic and
    refuses such a function)."""
    buffers = _buffers(func)
    if any(str(t.dtype) in WIDE_DATA for t in buffers):
        return False
    for shape in (t.shape for t in buffers):
        size = tvm_compat.size_upper_bound(math.prod(list(shape)) if shape else 1, upper)
        if not isinstance(size, int) or size >= limit:
            return False
    return True


def mark_pass(ranges: dict, stats: dict | None = None):
    """Marks (``amp.index32``) each PrimFunc over symbolic extents that :func:`fits` the ranges'
    maxima (``ranges``: {dim: (lo, hi)}); counts them in ``stats['index32_kernels']``."""
    tvm = tvm_compat.tvm()
    upper = {name: int(hi) for name, (_, hi) in ranges.items()}

    @tvm.transform.module_pass(opt_level=0, name="AmpMarkIndex32")
    def _pass(mod, _ctx):
        marked = {}
        for gv, f in mod.functions_items():
            if not isinstance(f, tvm_compat.prim_func_class()) or \
                    (f.attrs and (f.attrs.get(TIRX_KERNEL) or f.attrs.get(IS_HOST_FUNC))):
                continue
            if is_symbolic(f) and fits(f, upper):
                marked[gv] = f.with_attr(INDEX32, True)
        if stats is not None and marked:
            stats["index32_kernels"] = stats.get("index32_kernels", 0) + len(marked)
        return replace_functions(mod, marked)

    return _pass


def narrow_pass():
    """TVM's ``ForceNarrowIndexToInt32`` on the PrimFuncs :func:`mark_pass` marked (run after
    ``FlattenBuffer``, before ``NarrowDataType``)."""
    tvm = tvm_compat.tvm()
    force = tvm_compat.tirx().transform.ForceNarrowIndexToInt32()

    @tvm.transform.module_pass(opt_level=0, name="amp.NarrowIndex32")
    def _pass(mod, _ctx):
        return replace_functions(mod, {
            gv: force(tvm.IRModule({gv: f}))[gv] for gv, f in mod.functions_items()
            if isinstance(f, tvm_compat.prim_func_class()) and f.attrs and f.attrs.get(INDEX32)})

    return _pass

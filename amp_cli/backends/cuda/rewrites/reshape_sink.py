"""Move "flatten to 2-D" reshapes past GEMMs and their epilogues, so the epilogues fuse.

Exporters and simplifiers write a 3-D linear layer as ``reshape(x, [M, K]) -> MatMul/Gemm ->
bias add -> reshape(.., [B, S, N])`` (onnxslim's ``FusionGemm`` produces exactly this from a
MatMul + Add, which suits ONNX Runtime's CPU Gemm). Relax's FuseOps fuses only elementwise and
broadcast consumers into a GEMM, and a reshape is neither, so in amp's CUDA build the reshape
after the bias add cut every epilogue short: BERT's residual add and its GELU ran as separate
memory-bound kernels instead of inside the GEMM's store.

This pass rewrites, bottom-up in each dataflow block:

- ``matmul(reshape(a, [M, K]), B)`` with a 2-D ``B``, where the reshape only merges leading
  axes of ``a`` (its last axis is K) -> ``reshape(matmul(a, B), [M, N])``;
- an elementwise op whose tensor inputs are reshapes that keep the last axis (these
  flattenings, or a 1-D conv's [N, 1, W, C] -> [N, W, C]) of same-shaped tensors, or
  constants and tensors of rank <= 1 (broadcast along the last axis either way) ->
  ``reshape(op(sources...), shape)``;
- ``reshape(reshape(z, S1), S2)`` -> ``reshape(z, S2)``, and to ``z`` when ``S2`` is its shape.

The values are the same (a reshape is a view of the same row-major data and the ops act per
element or per row); only where the reshapes sit changes. The flattening reshape ends up at
the end of the chain, where it meets the un-flattening one and both disappear.
"""
from __future__ import annotations

from .... import tvm_compat
from ...relax_calls import ELEMENTWISE
from ..registry import register
from .base import add_counts, module_pass, op_name, rewrite_calls, static_shape


def _reshape_of(lookup, expr):
    """``z`` when ``expr`` is a Var bound to ``reshape(z, ...)`` (inside a dataflow block also
    through plain aliases ``v = w``, which cancelled permutes leave), else None. Nothing is
    returned that is not visible where ``expr`` is used: a block's output Var is not looked
    through aliases, and its reshape's source must not be one of the block's own variables."""
    relax = tvm_compat.relax()
    if not isinstance(expr, relax.Var):
        return None
    bound = lookup(expr)
    if isinstance(expr, relax.DataflowVar):
        while isinstance(bound, relax.DataflowVar):
            bound = lookup(bound)
    if op_name(bound) != "relax.reshape":
        return None
    src = bound.args[0]
    # a block's output bound to reshape(a block-local var): that var does not exist where
    # the output is used (an RNN's loop body outside the block; "Var lv3 is not defined")
    if not isinstance(expr, relax.DataflowVar) and isinstance(src, relax.DataflowVar):
        return None
    return src


def _flattening(lookup, expr):
    """(source, shape) when ``expr`` is bound to ``reshape(source, [M, K])`` that flattens all
    leading axes of ``source`` (rank >= 3, same last axis K), else None."""
    src = _reshape_of(lookup, expr)
    if src is None:
        return None
    src_shape, out_shape = static_shape(src), static_shape(expr)
    if src_shape is None or out_shape is None or len(src_shape) < 3:
        return None
    if out_shape != [_prod(src_shape[:-1]), src_shape[-1]]:
        return None
    return src, out_shape


def _leading(lookup, expr):
    """(source, shape) when ``expr`` is bound to a reshape of ``source`` that keeps its last axis
    and only merges or splits the ones before it (a flattening, or a 1-D conv's [N, 1, W, C]
    -> [N, W, C]), else None: an op acting per element or per row of the last axis gives the
    same values on either side of it."""
    src = _reshape_of(lookup, expr)
    if src is None:
        return None
    src_shape, out_shape = static_shape(src), static_shape(expr)
    if not src_shape or not out_shape or src_shape[-1] != out_shape[-1]:
        return None
    return src, out_shape


def _merging(bb, lookup, expr):
    """For ``reshape(src, [M, K])`` whose source ends in axes multiplying to K with at least two
    axes before them (attention's ``[B, S, H, D] -> [B*S, H*D]``): emit ``reshape(src, [B, S,
    K])`` (it fuses with src's producer) and return it as the source of a flattening, else
    None."""
    relax = tvm_compat.relax()
    src = _reshape_of(lookup, expr)
    if src is None:
        return None
    src_shape, out_shape = static_shape(src), static_shape(expr)
    if src_shape is None or out_shape is None or len(out_shape) != 2:
        return None
    k = out_shape[1]
    for i in range(2, len(src_shape)):
        if _prod(src_shape[i:]) == k and _prod(src_shape[:i]) == out_shape[0]:
            if i == len(src_shape) - 1:
                return None  # a plain flattening: _flattening's case
            lead = bb.emit(relax.op.reshape(src, [*src_shape[:i], k]))
            return lead, out_shape
    return None


def _prod(dims) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def _broadcasts_along_last(expr) -> bool:
    shape = static_shape(expr)
    return shape is not None and len(shape) <= 1


def sink_reshapes(mod):
    """(``mod`` with flattening reshapes moved past GEMMs and elementwise ops, number of ops
    moved past); see the module docstring."""
    relax = tvm_compat.relax()

    def rewrite(bb, call, lookup):
        name = op_name(call)
        if name == "relax.reshape":
            inner = _reshape_of(lookup, call.args[0])
            if inner is None:
                return None
            target = static_shape(call)
            if target is not None and target == static_shape(inner):
                return inner
            return relax.op.reshape(inner, call.args[1])
        if name == "relax.matmul":
            a, b = call.args
            flat = _flattening(lookup, a) or _merging(bb, lookup, a)
            b_shape = static_shape(b)
            if flat is None or b_shape is None or len(b_shape) != 2 or len(flat[1]) != 2:
                return None
            src, shape = flat
            out = bb.emit(relax.op.matmul(src, b, out_dtype=call.attrs.out_dtype))
            return relax.op.reshape(out, [shape[0], b_shape[1]])
        if name in ELEMENTWISE:
            flats = [(a, _leading(lookup, a)) if isinstance(getattr(a, "ty", None),
                                                              relax.TensorType) else (a, None)
                     for a in call.args]
            moved = [f for _, f in flats if f is not None]
            if not moved:
                return None
            if len({tuple(static_shape(f[0])) for f in moved}) != 1:
                return None
            tensors_ok = all(f is not None or not isinstance(getattr(a, "ty", None),
                                                             relax.TensorType)
                             or _broadcasts_along_last(a) for a, f in flats)
            if not tensors_ok:
                return None
            args = [f[0] if f is not None else a for a, f in flats]
            out = bb.emit(relax.Call(call.op, args, call.attrs, list(call.ty_args)))
            return relax.op.reshape(out, moved[0][1])
        return None

    counted = []

    def counting(bb, call, lookup):
        new = rewrite(bb, call, lookup)
        if new is not None and op_name(call) != "relax.reshape":
            counted.append(1)
        return new

    new, _ = rewrite_calls(mod, counting)
    return new, len(counted)


def sink_reshapes_pass(stats: dict | None = None):
    """:func:`sink_reshapes` as a module pass (before combine_gemm / matmul_nt)."""
    def run(mod):
        new, count = sink_reshapes(mod)
        add_counts(stats, reshapes_sunk=count)
        return new

    return module_pass(run, "AmpSinkReshapes")


@register("sink_reshapes", "graph", 20, switch="sink_reshapes",
          labels={"reshapes_sunk": "ops moved before their flattening reshape"})
def make_pass(ctx):
    return sink_reshapes_pass(ctx.stats)

"""Relax's ``ConvertLayout`` (NCHW -> NHWC convolutions), guarded against what TVM 0.27's
per-op layout inference gets wrong. Both backends convert layouts through :func:`convert_layout`:
the CPU pipeline (NHWC/HWIO convs, ``cpu/pipeline.py``) and the CUDA conv-as-GEMM rewrite
(NHWC/OHWI, ``cuda/rewrites/conv_gemm.py``).

``ConvertLayout`` calls every op's ``FRelaxInferLayout``, even in a graph without a conv, and
these are wrong in 0.27 (``src/relax/op/tensor/manipulate.cc``, ``src/relax/op/nn/nn.cc``,
TOPI's norms); each is rewritten into a form whose inference is right, before or after the pass:

- ``squeeze`` with a negative axis: ``InferLayoutSqueeze`` writes ``axis_str[axis] = '1'``
  without normalizing the axis, a write before the start of a ``std::string`` (heap corruption,
  then ``std::bad_alloc``; torch's multi-head attention exports ``squeeze(x, [-2])``).
  Before: the axes are made non-negative.
- ``stack``: ``InferLayoutStack`` names the new axis ``'S'`` in a layout whose letters must be
  ``A..``, so the next layout-aware consumer fails (``Invalid SLayout: can't find S in source
  layout ABCDE`` -- ONNX ``Sum`` imports as ``sum(stack(xs), axis=0)``, 16 of them in ResNet-50),
  and it inserts at ``axis`` unnormalized (negative axes crash) and maps ``axis == ndim`` to 0.
  Before: a reduction over the stacked axis (``sum``/``mean``/``max``/``min``, ONNX
  Sum/Mean/Max/Min; a cast in between allowed) becomes the elementwise chain it is (which then
  fuses into the conv epilogue); any other stack becomes ``concat`` of ``expand_dims``, whose
  inference is right.
- ``nn.conv2d_transpose`` after an NHWC conv: its inference follows the input into NHWC, which
  LegalizeOps cannot lower (the build then fails in VM codegen). Pinned to NCHW/IOHW.
- ``nn.layer_norm`` / ``nn.rms_norm`` over several axes: the pass reorders the axes (``[1,2,3]``
  becomes ``[3,1,2]`` in NHWC) but leaves gamma/beta in the old order; TOPI indexes them in data
  order (a silently wrong layer norm over C,H,W), and TOPI's ``rms_norm`` only handles trailing
  axes (an RMS norm over W becomes one over axis 2 of NHWC and fails to build). After: the axes
  are sorted with gamma/beta permuted to match; an ``rms_norm`` whose axes are not trailing is
  wrapped in transposes that make them trailing.

Should ``ConvertLayout`` itself still raise, the module is returned unconverted (NCHW: correct,
only slower) and ``stats["layout_kept_nchw"]`` says so.
"""
from __future__ import annotations

import numpy as np

from .. import tvm_compat
from .relax_calls import op_name, rewrite_calls

# Ops kept in their own layout whatever their input's: LegalizeOps lowers only these.
PINNED_LAYOUTS = {"relax.nn.conv2d_transpose": ["NCHW", "IOHW"]}

# what each count in ``stats`` means (the CUDA build report shows them)
REPORT_LABELS = {
    "layout_squeeze_axes": "squeezes given non-negative axes before the layout pass",
    "layout_stack_reductions": "reductions of a stack (ONNX Sum/Mean/Max/Min) as elementwise ops",
    "layout_stacks_as_concat": "stacks as concats of expand_dims",
    "layout_norm_axes": "layer/RMS norms with their axes sorted after the layout pass",
    "layout_kept_nchw": "modules kept in NCHW (the layout pass raised)",
}

# reduction over the stacked axis -> the elementwise op that folds the stacked tensors
STACK_REDUCTIONS = {"relax.sum": "add", "relax.mean": "add", "relax.max": "maximum",
                    "relax.min": "minimum"}


def _ndim(expr) -> int | None:
    ndim = getattr(expr.ty, "ndim", -1)
    return None if ndim is None or int(ndim) < 0 else int(ndim)


def _count(stats: dict | None, key: str, n: int) -> None:
    if stats is not None and n:
        stats[key] = stats.get(key, 0) + int(n)


def _tuple_fields(expr, lookup):
    """The fields of a Relax tuple expression: those of a Tuple (inline, or bound to a Var),
    else ``expr[i]`` for each field of its tuple type (a split's outputs); None otherwise."""
    relax = tvm_compat.relax()
    bound = lookup(expr) if isinstance(expr, relax.Var) else expr
    if isinstance(bound, relax.Tuple):
        return list(bound.fields)
    fields = getattr(expr.ty, "fields", None)
    return [relax.TupleGetItem(expr, i) for i in range(len(fields))] if fields else None


def _squeeze_axes(bb, call, _lookup):
    if op_name(call) != "relax.squeeze" or call.attrs.axis is None:
        return None
    ndim = _ndim(call.args[0])
    axes = [int(a) for a in call.attrs.axis]
    if ndim is None or all(a >= 0 for a in axes):
        return None
    return tvm_compat.relax().op.squeeze(call.args[0], [a % ndim for a in axes])


def _stack_reduction(bb, call, lookup):
    """``sum/mean/max/min(stack(xs, a), axis=[a])`` -> ``x0 + x1 + ...`` (mean: / n); also
    through a cast between the two (the precision pass keeps reductions in fp32): then each
    ``x`` is cast."""
    relax = tvm_compat.relax()
    name = op_name(call)
    if name not in STACK_REDUCTIONS or call.attrs.axis is None or len(call.attrs.axis) != 1:
        return None
    src = call.args[0]
    out_ndim = _ndim(src)
    stack = lookup(src) if isinstance(src, relax.Var) else src
    cast = None
    if op_name(stack) == "relax.astype":
        cast, stack = str(stack.attrs.dtype), stack.args[0]
        stack = lookup(stack) if isinstance(stack, relax.Var) else stack
    if op_name(stack) != "relax.stack" or out_ndim is None:
        return None
    stack_axis = int(stack.attrs.axis) if stack.attrs.axis is not None else 0
    if int(call.attrs.axis[0]) % out_ndim != stack_axis % out_ndim:
        return None
    fields = _tuple_fields(stack.args[0], lookup)
    if not fields:
        return None
    if cast is not None:
        fields = [bb.emit(relax.op.astype(x, cast)) for x in fields]
    fold = getattr(relax.op, STACK_REDUCTIONS[name])
    acc = fields[0]
    for x in fields[1:]:
        acc = bb.emit(fold(acc, x))
    if name == "relax.mean":
        acc = relax.op.divide(acc, relax.const(len(fields), src.ty.dtype))
    if call.attrs.keepdims:
        acc = relax.op.expand_dims(acc, [stack_axis % out_ndim])
    return acc


def _stack_as_concat(bb, call, lookup):
    """``stack(xs, a)`` -> ``concat([expand_dims(x, a) for x in xs], a)``."""
    relax = tvm_compat.relax()
    if op_name(call) != "relax.stack":
        return None
    fields = _tuple_fields(call.args[0], lookup)
    out_ndim = _ndim(call)
    if not fields or out_ndim is None:
        return None
    axis = (int(call.attrs.axis) if call.attrs.axis is not None else 0) % out_ndim
    parts = [bb.emit(relax.op.expand_dims(x, [axis])) for x in fields]
    return relax.op.concat(parts, axis=axis)


def prepare_for_layout(mod, stats: dict | None = None):
    """``mod`` with the ops whose 0.27 layout inference is wrong rewritten into equivalent ones
    whose inference is right (squeeze axes non-negative, stacks as elementwise chains or
    concats; see the module docstring)."""
    mod, n = rewrite_calls(mod, _squeeze_axes)
    _count(stats, "layout_squeeze_axes", n)
    mod, n = rewrite_calls(mod, _stack_reduction)  # before the stacks themselves are rewritten
    _count(stats, "layout_stack_reductions", n)
    mod, n = rewrite_calls(mod, _stack_as_concat)
    _count(stats, "layout_stacks_as_concat", n)
    return mod


def _inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def _norm_axes(bb, call, _lookup):
    """layer_norm / rms_norm in the form TOPI lowers right: axes sorted (gamma/beta permuted to
    match); rms_norm's axes also trailing (transposes around it where they are not)."""
    relax = tvm_compat.relax()
    name = op_name(call)
    if name not in ("relax.nn.layer_norm", "relax.nn.rms_norm"):
        return None
    ndim = _ndim(call.args[0])
    if ndim is None:
        return None
    a = call.attrs
    axes = [int(x) % ndim for x in a.axes]
    k = len(axes)
    trailing = sorted(axes) == list(range(ndim - k, ndim))
    if axes == sorted(axes) and (name == "relax.nn.layer_norm" or trailing):
        return None
    x, params = call.args[0], list(call.args[1:])
    order = sorted(range(k), key=lambda i: axes[i])  # gamma dim i <-> data axis axes[i]
    back = None
    if name == "relax.nn.rms_norm" and not trailing:
        # move the normalized axes last, in gamma's order: then they are sorted and trailing
        perm = [d for d in range(ndim) if d not in axes] + axes
        x = bb.emit(relax.op.permute_dims(x, perm))
        new_axes, back = list(range(ndim - k, ndim)), _inverse(perm)
    else:
        new_axes = sorted(axes)
        params = [p if _ndim(p) != k or k == 1 else bb.emit(relax.op.permute_dims(p, order))
                  for p in params]
    if name == "relax.nn.layer_norm":
        out = relax.op.nn.layer_norm(x, params[0], params[1], new_axes, float(a.epsilon),
                                     bool(a.center), bool(a.scale))
    else:
        out = relax.op.nn.rms_norm(x, params[0], new_axes, float(a.epsilon))
    if back is not None:
        out = relax.op.permute_dims(bb.emit(out), back)
    return out


def convert_layout(mod, desired: dict, stats: dict | None = None):
    """Relax's ``ConvertLayout(desired)`` on ``mod``, guarded (see the module docstring): ops
    whose layout inference is wrong are rewritten first, the norms' axes fixed after, and
    ``PINNED_LAYOUTS`` added to ``desired``. ``stats`` counts each rewrite."""
    relax = tvm_compat.relax()
    mod = prepare_for_layout(mod, stats)
    try:
        converted = relax.transform.ConvertLayout({**PINNED_LAYOUTS, **desired})(mod)
    except Exception:  # noqa: BLE001 - TVM raises InternalError, IndexError, ...: keep NCHW
        _count(stats, "layout_kept_nchw", 1)
        return mod
    converted, n = rewrite_calls(converted, _norm_axes)
    _count(stats, "layout_norm_axes", n)
    converted, _ = rewrite_calls(converted, _fold_constant_permute)
    return converted


# dtypes whose constants numpy transposes exactly (bf16 and the like are left to FoldConstant)
NUMPY_DTYPES = frozenset({"float16", "float32", "float64", "int8", "int32", "int64", "uint8",
                          "bool"})


def _fold_constant_permute(_bb, call, _lookup):
    """``permute_dims`` of a constant (ConvertLayout's OIHW -> OHWI weights and [1, C, 1, 1]
    biases) as the permuted constant, computed in numpy. Relax's FoldConstant would build and
    run an LLVM kernel for each: ~8 s of a dynamic ResNet-50's cuda:sm_90 build."""
    if op_name(call) != "relax.permute_dims" or call.attrs.axes is None:
        return None
    value = tvm_compat.constant_value(call.args[0])
    if value is None or str(value.dtype) not in NUMPY_DTYPES:
        return None
    relax = tvm_compat.relax()
    return relax.const(np.ascontiguousarray(
        np.transpose(value, [int(a) for a in call.attrs.axes])), str(value.dtype))


def convert_layout_pass(desired: dict, stats: dict | None = None):
    """:func:`convert_layout` as a module pass (the CPU pipeline's place for ConvertLayout)."""
    tvm = tvm_compat.tvm()

    @tvm.transform.module_pass(opt_level=0, name="AmpConvertLayout")
    def _pass(mod, _ctx):
        return convert_layout(mod, desired, stats)

    return _pass

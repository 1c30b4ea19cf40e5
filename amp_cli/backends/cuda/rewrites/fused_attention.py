"""Scaled dot-product attention as one CUDA kernel (the graph side of attention_kernel).

Finds, in a precision-converted Relax module, the attention core a transformer exports:

    P = softmax(cast(Q @ K^T) * scale, axis=-1)       (casts between fp16 and fp32 anywhere)
    O = cast(P @ V, fp16)

with fp16 Q [B, H, S, D], K^T [B, H, D, S], V [B, H, S, D], a positive scalar scale (or none)
and no mask, and replaces O by one call of attention_kernel's fused kernel. The operands are
traced through their head-split transposes: Q = permute(q, [0, 2, 1, 3]) of a [B, S, H, D]
tensor is read in place (strided), and so are K^T = permute(k, [0, 2, 3, 1]) and V, so the
transpose kernels disappear too. An output transposed back (``permute(O, [0, 2, 1, 3])``, before
the merge of the heads) is written in that layout directly.

The kernel keeps the scores in fp32 from the GEMM through the softmax; the unfused fp16 graph
rounds them to fp16 once or twice on the way. Shapes the kernel does not serve (sequence not a
multiple of 64, more shared memory than the GPU has) keep the unfused path.
"""
from __future__ import annotations

from .... import tvm_compat
from ....hardware import smem_limit
from ..kernels import attention as ak
from ..registry import register
from .base import add_counts, calls, module_pass, op_name, rewrite_calls, static_shape
from .matmul_nt import permutation

FLOATS = ("float16", "float32")
HEADS_FIRST = [0, 2, 1, 3]      # [B, S, H, D] <-> [B, H, S, D]
KEYS_TRANSPOSED = [0, 2, 3, 1]  # [B, S, H, D] -> [B, H, D, S]
LAST_TWO = [0, 1, 3, 2]


def _bound(expr, lookup):
    """The call ``expr`` is (or is bound to), else None."""
    relax = tvm_compat.relax()
    if isinstance(expr, relax.Var):
        expr = lookup(expr)
    return expr if isinstance(expr, relax.Call) else None


def _through_casts(expr, lookup):
    """``expr`` with float-to-float ``astype`` calls stripped."""
    while True:
        call = _bound(expr, lookup)
        if (call is None or op_name(call) != "relax.astype"
                or call.args[0].ty.dtype not in FLOATS or str(call.attrs.dtype) not in FLOATS):
            return expr
        expr = call.args[0]


def _scalar(expr) -> float | None:
    if not isinstance(expr, tvm_compat.tvm().ir.expr.Constant):
        return None
    value = expr.value.numpy()
    return float(value.reshape(-1)[0]) if value.size == 1 else None


def _scaled_scores(expr, lookup):
    """(the Q @ K^T matmul call, scale) behind a softmax input, else None."""
    expr = _through_casts(expr, lookup)
    scale = 1.0
    call = _bound(expr, lookup)
    if call is not None and op_name(call) in ("relax.multiply", "relax.divide"):
        a, b = call.args
        c, scores = _scalar(b), a
        if c is None and op_name(call) == "relax.multiply":   # c * scores
            c, scores = _scalar(a), b
        if c is None or c <= 0:
            return None
        scale = 1.0 / c if op_name(call) == "relax.divide" else c
        call = _bound(_through_casts(scores, lookup), lookup)
    if call is None or op_name(call) != "relax.matmul":
        return None
    return call, scale


def _permutation(expr, lookup) -> tuple:
    """(source, axes) when ``expr`` is (bound to) a static-shape permute_dims, else
    (expr, None)."""
    call = _bound(expr, lookup)
    axes = permutation(call) if call is not None else None
    return (call.args[0], axes) if axes is not None else (expr, None)


def _ints(tup) -> list | None:
    """The integers of a Relax tuple of PrimValues (strided_slice's axes/begin/end)."""
    try:
        return [int(getattr(f, "value", f)) for f in tup.fields]
    except (AttributeError, TypeError):
        return None


def _heads_view(src, lookup, dims):
    """(tensor, Operand) for a [B, S, H, D] tensor ``src``; when it is the head split
    ``reshape(strided_slice(t, last axis, [o, o + H*D]), [B, S, H, D])`` of a [B, S, W] tensor
    (combine_gemm's Q/K/V slices), the slice is read in place from ``t``."""
    b, h, s, d = dims
    split = _bound(src, lookup)
    sliced = _bound(split.args[0], lookup) if (
        split is not None and op_name(split) == "relax.reshape") else None
    if sliced is not None and op_name(sliced) == "relax.strided_slice":
        t = sliced.args[0]
        shape = static_shape(t)
        axes, begin, end = (_ints(x) for x in sliced.args[1:4])
        strides = _ints(sliced.args[4]) if len(sliced.args) > 4 else [1]
        if (shape is not None and len(shape) == 3 and shape[:2] == [b, s]
                and axes in ([2], [-1]) and strides == [1] and len(begin) == 1
                and end[0] - begin[0] == h * d and begin[0] % ak.VEC == 0):
            return t, ak.packed(b, h, s, d, shape[2], begin[0])
    return src, ak.bshd(b, h, s, d)


def _operand(expr, lookup, dims, transposed: bool):
    """(tensor, Operand) addressing a [B, H, S, D] operand (or [B, H, D, S] when ``transposed``)
    in place, or None when D would not be innermost."""
    b, h, s, d = dims
    src, axes = _permutation(expr, lookup)
    if transposed:
        if axes == KEYS_TRANSPOSED and static_shape(src) == [b, s, h, d]:
            return _heads_view(src, lookup, dims)
        if axes == LAST_TWO and static_shape(src) == [b, h, s, d]:
            return src, ak.bhsd(b, h, s, d)
        return None
    if axes == HEADS_FIRST and static_shape(src) == [b, s, h, d]:
        return _heads_view(src, lookup, dims)
    return expr, ak.bhsd(b, h, s, d)


def match(call, lookup, smem_limit_kib: int):
    """(q, k, v tensors, params dict) when ``call`` ends an attention core this pass fuses,
    (None, reason) when it is one the kernel cannot serve, None when it is no attention."""
    if op_name(call) == "relax.astype" and str(call.attrs.dtype) == "float16":
        pv = _bound(call.args[0], lookup)
    elif op_name(call) == "relax.matmul" and call.ty.dtype == "float16":
        pv = call
    else:
        return None
    if pv is None or op_name(pv) != "relax.matmul":
        return None
    p, v = pv.args
    soft = _bound(_through_casts(p, lookup), lookup)
    if soft is None or op_name(soft) != "relax.nn.softmax" or int(soft.attrs.axis) not in (-1, 3):
        return None
    found = _scaled_scores(soft.args[0], lookup)
    if found is None:
        return None
    qk, scale = found
    q, kt = qk.args
    shapes = [static_shape(x) for x in (q, kt, v)]
    if any(s is None or len(s) != 4 for s in shapes) or p.ty.dtype != "float16":
        return None
    (b, h, s, d), (_, _, d2, s2), vs = shapes
    if shapes[1][:2] != [b, h] or d2 != d or s2 != s or vs != [b, h, s, d]:
        return None
    if any(x.ty.dtype != "float16" for x in (q, kt, v)):
        return None
    why = ak.supported(s, d, smem_limit_kib)
    if why is not None:
        return None, why
    ops = [_operand(q, lookup, (b, h, s, d), False), _operand(kt, lookup, (b, h, s, d), True),
           _operand(v, lookup, (b, h, s, d), False)]
    if any(o is None for o in ops):
        return None, "K^T is not a transpose of a tensor with the head dim innermost"
    params = {"dims": (b, h, s, d), "scale": scale, "operands": tuple(o[1] for o in ops)}
    return [o[0] for o in ops], params


def fuse_attention(mod, sm: int):
    """``mod`` with attention cores fused (module docstring); returns (module, fused count,
    {reason: count} of the attention cores left unfused)."""

    relax = tvm_compat.relax()
    limit = smem_limit(sm)
    funcs: dict = {}      # kernel parameters -> GlobalVar (one PrimFunc per distinct shape)
    made: dict = {}       # name of a fused kernel -> its params, to re-layout its output
    declined: dict = {}

    def emit(bb, tensors, params, out: ak.Operand):
        b, h, s, d = params["dims"]
        key = (params["dims"], params["scale"], params["operands"], out)
        if key not in funcs:
            func = ak.attention_func(b, h, s, d, params["scale"], *params["operands"], out)
            funcs[key] = bb.add_func(func, "amp_attention")
            made[funcs[key].name_hint] = params
        return relax.call_tir(funcs[key], relax.Tuple(list(tensors)),
                              out_ty=relax.TensorType(out.shape, "float16"))

    def rewrite(bb, call, lookup):
        # permute(attention, [0, 2, 1, 3]): write the [B, S, H, D] layout directly
        src, axes = _permutation(call, lookup)
        if axes == HEADS_FIRST:
            inner = _bound(src, lookup)
            if (inner is not None and op_name(inner) == "relax.call_tir"
                    and inner.args[0].name_hint in made):
                params = made[inner.args[0].name_hint]
                return emit(bb, list(inner.args[1].fields), params, ak.bshd(*params["dims"]))
        found = match(call, lookup, limit)
        if found is None:
            return None
        tensors, params = found
        if tensors is None:
            declined[params] = declined.get(params, 0) + 1
            return None
        return emit(bb, tensors, params, ak.bhsd(*params["dims"]))

    new, _ = rewrite_calls(mod, rewrite)
    # a kernel re-emitted in the [B, S, H, D] layout leaves its first form dead (removed)
    fused = sum(1 for c in calls(new)
                if op_name(c) == "relax.call_tir" and c.args[0].name_hint in made)
    return new, fused, declined


def fuse_attention_pass(sm: int, stats: dict | None = None):
    """:func:`fuse_attention` as a module pass (after precision conversion, before matmul_nt
    and LegalizeOps); ``stats`` counts the fused attention cores and the unfused ones."""
    def run(mod):
        new, fused, declined = fuse_attention(mod, sm)
        add_counts(stats, attention_fused=fused, attention_unfused=sum(declined.values()))
        return new

    return module_pass(run, "AmpFuseAttention")


@register("fused_attention", "graph", 40, switch="fused_attention",
          labels={"attention_fused": "attention cores fused into one kernel",
                  "attention_unfused": "attention cores left unfused (shape)"})
def make_pass(ctx):
    return fuse_attention_pass(ctx.sm, ctx.stats) if ctx.sm >= 80 else None  # wmma + cp.async

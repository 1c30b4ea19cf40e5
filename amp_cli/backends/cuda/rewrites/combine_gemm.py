"""Parallel GEMMs on one input become one wider GEMM (a transformer's Q, K and V projections).

Why: at BERT-large's shapes (M = 8 x 128 tokens, hidden 1024) each projection is a 1024x1024x1024
GEMM: 64-128 CTAs on a 132-SM H200, one partial wave. The three fused into one 1024x3072x1024
GEMM filled the GPU: 218 TFLOP/s against 142 for the separate ones in the H200 sweep
(docs/gpu-performance.md), i.e. ~30 us instead of ~45 us per layer.

TVM has ``relax.transform.CombineParallelMatmul``, but on amp's converted graphs it did not fire
(the weights are constants, and the pass only combines matmuls over function parameters); this
pass handles exactly the case amp's graphs have: in one dataflow block (after common-subexpression
elimination, which merges the per-projection reshape/cast of the input that exporters repeat),
two or more fp16/bf16
``relax.matmul(x, W_i)`` with the same input ``x`` and 2-D constant weights ``W_i[K, N_i]`` (same
dtype and out_dtype; ``x``'s leading dims may be symbolic, as in a dynamic model). They become

    g   = matmul(x, concat(W_i, axis=1))        # matmul_nt then makes it an NT GEMM
    y_i = strided_slice(g, last axis, [offset_i, offset_i + N_i])

Each output element is the same dot product over the same K as before, so the values are the
same. When the GEMM accumulates in fp32 and *every* ``y_i`` is only consumed by a cast to the
input's low type (amp's mixed-precision graphs: ``astype(matmul(...), float16)``), the cast moves
in front of the slices (``g16 = astype(g)``, ``y_i = astype(slice(g16), float32)``): the GEMM then
writes fp16 with the cast fused into its epilogue instead of a 2x larger fp32 tensor, and the
fp16 -> fp32 -> fp16 round trip of each slice is exact. When, further, every cast output's only
use is the add of a constant bias vector (the projections' biases), the biases are concatenated
and added once before the slices (``y_i = slice(g16 + concat(b_i))``, the same fp16 additions), so
the bias add runs in the GEMM's epilogue and the slices are plain views that fused_attention can
read in place. Without biases (LLaMA's projections; a random-initialized BERT's zero biases,
which the ONNX simplifier drops) the casts to the low type take the fp16 slices directly
(``astype(astype(slice(g16), float32), float16)`` is ``slice(g16)``): left in, each round trip
was a copy kernel of its slice.
"""
from __future__ import annotations

import numpy as np

from .... import tvm_compat
from ....dtypes import LOW_TYPES
from ..registry import register
from .base import add_counts, module_pass, op_name, rewrite_calls, shape_of, static_shape


def _matmul_key(call):
    """(x, K, dtype, out_dtype) for a matmul this pass can combine, else None."""
    relax = tvm_compat.relax()
    if op_name(call) != "relax.matmul":
        return None
    x, w = call.args
    if not isinstance(x, relax.Var) or not isinstance(w, tvm_compat.tvm().ir.expr.Constant):
        return None
    x_shape, w_shape = shape_of(x), static_shape(w)  # x's leading dims may be symbolic
    if x_shape is None or w_shape is None or len(w_shape) != 2 or len(x_shape) < 2:
        return None
    if x.ty.dtype not in LOW_TYPES or w.ty.dtype != x.ty.dtype or x_shape[-1] != w_shape[0]:
        return None
    out = str(call.attrs.out_dtype)
    return x, w_shape[0], x.ty.dtype, out if out not in ("", "void") else x.ty.dtype


def _groups(mod) -> list[dict]:
    """Groups of >= 2 combinable matmuls per dataflow block, as dicts: ``members`` (var, call)
    pairs, ``low``/``out`` dtypes, and ``cast_ok``: every output only feeds a cast to ``low``."""
    relax = tvm_compat.relax()
    groups = []
    for func in mod.functions.values():
        if not isinstance(func, relax.Function):
            continue
        blocks = []

        def visit(expr):
            if isinstance(expr, relax.SeqExpr):
                blocks.extend(b for b in expr.blocks if isinstance(b, relax.DataflowBlock))

        relax.analysis.post_order_visit(func.body, visit)
        for block in blocks:
            by_key, uses = {}, {}
            for binding in block.bindings:
                value = getattr(binding, "value", None)
                if not isinstance(value, relax.Call):
                    continue
                for arg in value.args:
                    if isinstance(arg, relax.Var):
                        uses.setdefault(arg, []).append((binding.var, value))
                key = _matmul_key(value)
                if key is not None:
                    x, k, dt, out = key
                    by_key.setdefault((x, k, dt, out), []).append((binding.var, value))
            for (x, _k, dt, out), members in by_key.items():
                if len(members) < 2:
                    continue
                cast_ok = out != dt and all(
                    (u := uses.get(var, [])) and all(
                        op_name(c) == "relax.astype" and str(c.attrs.dtype) == dt for _, c in u)
                    for var, _ in members)
                biases = [_bias(uses, var, call, dt) for var, call in members] if cast_ok else []
                groups.append({"members": members, "cast_ok": cast_ok, "low": dt,
                               "out": out, "biases": biases if all(
                                   b is not None for b in biases) and biases else None})
    return groups


def _bias(uses, var, call, low):
    """The constant bias vector added to ``astype(var, low)`` when that cast has exactly one use
    and it is ``add(cast, bias)`` with a 1-D constant of the matmul's width, else None."""
    casts = uses.get(var, [])
    if len(casts) != 1:
        return None
    adds = uses.get(casts[0][0], [])
    if len(adds) != 1 or op_name(adds[0][1]) != "relax.add":
        return None
    a, b = adds[0][1].args
    width = static_shape(call.args[1])[1]
    if (not a.same_as(casts[0][0]) or not isinstance(b, tvm_compat.tvm().ir.expr.Constant)
            or static_shape(b) != [width] or b.ty.dtype != low):
        return None
    return b


def combine_parallel_gemms(mod):
    """``mod`` with each group of parallel constant-weight matmuls combined (module docstring)
    and the number of matmuls combined."""
    relax = tvm_compat.relax()
    # exporters repeat the input's reshape/cast per projection (torch.export: one per Linear);
    # common-subexpression elimination makes them one input, so the projections group
    original, mod = mod, relax.transform.EliminateCommonSubexpr()(mod)
    groups = _groups(mod)
    if not groups:
        return original, 0
    # the constant weight identifies a member (each matmul has its own) through the rewrite
    by_weight, by_bias = {}, {}   # by_bias: bias constant -> member when the biases fold
    for g in groups:
        for index, (_var, call) in enumerate(g["members"]):
            by_weight[call.args[1]] = (g, index)
        for index, b in enumerate(g["biases"] or []):
            by_bias[b] = (g, index)
    done = {}  # id(group) -> replacement exprs of its members
    biased = {}  # id(group) -> the bias-added fp16 slices
    widened = {}  # the fp32 cast of a low-type slice -> that slice

    def narrowed(call, lookup):
        """The low-type slice ``call`` (a cast back to the low type) undoes, else None."""
        src = call.args[0]
        while isinstance(src, relax.Var) and src not in widened:
            bound = lookup(src)  # an alias of the cast's var (the member's old binding)
            if not isinstance(bound, relax.Var):
                return None
            src = bound
        low = widened.get(src) if isinstance(src, relax.Var) else None
        return low if low is not None and str(call.attrs.dtype) == low.ty.dtype else None

    def rewrite(bb, call, lookup):
        if op_name(call) == "relax.astype" and widened:
            return narrowed(call, lookup)
        if op_name(call) == "relax.add" and call.args[1] in by_bias:
            group, index = by_bias[call.args[1]]
            if id(group) in biased:   # its matmul was rewritten (it comes first)
                return biased[id(group)][index]
            return None
        if op_name(call) != "relax.matmul" or call.args[1] not in by_weight:
            return None
        group, index = by_weight[call.args[1]]
        if id(group) not in done:
            weights = [c.args[1].value.numpy() for _v, c in group["members"]]
            combined = relax.const(np.ascontiguousarray(np.concatenate(weights, axis=1)),
                                   group["low"])
            g = bb.emit(relax.op.matmul(call.args[0], combined, out_dtype=group["out"]))
            if group["cast_ok"]:
                g = bb.emit(relax.op.astype(g, group["low"]))
            axis = len(shape_of(call.args[0])) - 1
            outs, start, with_bias = [], 0, []
            if group["biases"]:
                bias = np.concatenate([b.value.numpy() for b in group["biases"]])
                gb = bb.emit(relax.op.add(g, relax.const(bias, group["low"])))
            for w in weights:
                y = bb.emit(relax.op.strided_slice(g, [axis], [start], [start + w.shape[1]]))
                if group["biases"]:
                    with_bias.append(bb.emit(relax.op.strided_slice(
                        gb, [axis], [start], [start + w.shape[1]])))
                if group["cast_ok"]:
                    low, y = y, bb.emit(relax.op.astype(y, group["out"]))
                    widened[y] = low
                outs.append(y)
                start += w.shape[1]
            done[id(group)] = outs
            if with_bias:
                biased[id(group)] = with_bias
        return done[id(group)][index]

    # the members' old bindings are now aliases of the slices: fold them away
    new, _ = rewrite_calls(mod, rewrite, cleanup=relax.transform.CanonicalizeBindings())
    return new, sum(len(g["members"]) for g in groups if id(g) in done)


def combine_parallel_gemms_pass(stats: dict | None = None):
    """:func:`combine_parallel_gemms` as a module pass (before matmul_nt); ``stats`` counts the
    matmuls combined."""
    def run(mod):
        new, count = combine_parallel_gemms(mod)
        add_counts(stats, combined_matmuls=count)
        return new

    return module_pass(run, "AmpCombineParallelGemms")


@register("combine_gemms", "graph", 30, switch="combine_gemms",
          labels={"combined_matmuls": "matmuls combined into wider GEMMs"})
def make_pass(ctx):
    return combine_parallel_gemms_pass(ctx.stats)

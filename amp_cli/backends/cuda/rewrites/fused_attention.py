"""Scaled dot-product attention as one CUDA kernel (the graph side of attention_kernel).

Finds, in a precision-converted Relax module, the attention core a transformer exports:

    P = softmax(cast(Q @ K^T) * scale [+ M], axis=-1)   (float casts anywhere)
    O = cast(P @ V, T)

with Q [B, H, S, D], K^T [B, H, D, S], V [B, H, S, D] all of one type T (fp16 or bf16),
positive scalar scales anywhere on the way (on the scores, or ``sqrt(scale)`` on Q and on K as
the HF/SDPA exports write it) and an optional additive mask M that broadcasts to [B, H, S, S]
(padding [B, 1, 1, S], causal [S, S] or [1, 1, S, S], fp16 or fp32, computed or constant), and
replaces O by one call of a fused attention kernel. The operands are read in place through
their layout chains (``strided_view``: the head-split transposes, the dynamo exporter's
reshape/transpose K^T, slices and split items of a combined QKV projection), so the transpose
kernels disappear too. An output transposed back (``permute(O, [0, 2, 1, 3])``, before the
merge of the heads) is written in that layout directly.

The kernel keeps the scores in fp32 from the GEMM through the mask and the softmax; the unfused
fp16 graph rounds them to fp16 once or twice on the way. Every length takes the online-softmax
kernel over 64-key tiles on mma.sync (``kernels/mma_attention.py``, head dims up to 128);
without it (``cuda.mma_attention: false``, or a larger head dim) sequences up to 256 whose
score rows fit on chip with two CTAs per SM take the row kernel, the others the wmma
online-softmax kernel (``kernels/flash_attention.py``; :func:`plan`). Shapes
neither serves (head dims not a multiple of 16, a mask that does not broadcast) keep the
unfused path and are counted.

A dynamic model's attention (symbolic batch and sequence, as in a dynamic build's
``main_dynamic``) fuses too: the head count and head dim must be constants, the batch and the
sequence may be any sizes the layout chains prove (``strided_view``), and the online-softmax
kernel serves every sequence length with its guards always on. The kernels address in int32,
so every tensor they touch must stay under 2**31 elements at the upper bounds of the model's
ranges (``tir_var_upper_bound``); without a bound the core stays unfused.
"""
from __future__ import annotations

import functools
import math

from .... import tvm_compat
from ....dims import module_ranges
from ....hardware import smem_limit
from ..kernels import attention as ak
from ..kernels import flash_attention as fk
from ..kernels import mma_attention as mk
from ..registry import register
from .base import add_counts, calls, module_pass, op_name, rewrite_calls, shape_of
from .strided_view import bound as _bound
from .strided_view import positive_scale, scalar, views

FLOATS = ("float16", "bfloat16", "float32")
INT32_ELEMENTS = 2 ** 31  # the kernels' address arithmetic is int32
HEADS_FIRST = [0, 2, 1, 3]      # [B, S, H, D] <-> [B, H, S, D]


def _through_casts(expr, lookup):
    """``expr`` with float-to-float ``astype`` calls stripped."""
    while True:
        call = _bound(expr, lookup)
        if (call is None or op_name(call) != "relax.astype"
                or call.args[0].ty.dtype not in FLOATS or str(call.attrs.dtype) not in FLOATS):
            return expr
        expr = call.args[0]


def _scaled(expr, lookup):
    """(the call behind ``expr`` once float casts and positive scalar factors are stripped, or
    None; the product of the factors)."""
    factor = 1.0
    while True:
        call = _bound(_through_casts(expr, lookup), lookup)
        scaled = positive_scale(call) if call is not None else None
        if scaled is None:
            return call, factor
        expr, factor = scaled[0], factor * scaled[1]


def _scores(expr, lookup):
    """(the Q @ K^T matmul call, scale, mask tensor or None, mask scale) behind a softmax input:
    casts, positive scalar factors and at most one additive mask between them, else None."""
    call, factor = _scaled(expr, lookup)
    mask, mask_factor = None, 1.0
    if call is not None and op_name(call) == "relax.add":
        a, b = call.args  # the side that leads to the matmul is the scores
        side = op_name(_scaled(a, lookup)[0]) == "relax.matmul"
        if side == (op_name(_scaled(b, lookup)[0]) == "relax.matmul"):
            return None
        scores, mask = (a, b) if side else (b, a)
        mask = _through_casts(mask, lookup)  # an fp32 mask is read as fp32 (no cast kernel)
        mask_factor = factor
        call, below = _scaled(scores, lookup)
        factor *= below
    if call is None or op_name(call) != "relax.matmul":
        return None
    return call, factor, mask, mask_factor


def _nan_guarded(call, lookup):
    """x when ``call`` is ``where(isnan(x), 0, x)`` (torch's SDPA export writes it after the
    softmax: a row masked everywhere gives 0, not NaN), else None."""
    if call is None or op_name(call) != "relax.where":
        return None
    cond, a, b = call.args
    test = _bound(cond, lookup)
    if test is None or op_name(test) != "relax.isnan":
        return None
    x = test.args[0]
    return x if scalar(a) == 0.0 and b.same_as(x) else None


def _same(xs, ys) -> bool:
    """Two shapes (ints or symbolic sizes) provably equal dim by dim."""
    return len(xs) == len(ys) and all(tvm_compat.prove_equal(x, y) for x, y in zip(xs, ys))


def _aligned(x) -> bool:
    return tvm_compat.prove_divisible(x, ak.VEC)


def _permutation(expr, lookup) -> tuple:
    """(source, axes) when ``expr`` is (bound to) a permute_dims, else
    (expr, None)."""
    call = _bound(expr, lookup)
    if call is None or op_name(call) != "relax.permute_dims":
        return expr, None
    rank = len(shape_of(call.args[0]) or [])
    axes = call.attrs.axes
    axes = list(range(rank))[::-1] if axes is None else [int(a) for a in axes]
    return (call.args[0], axes) if rank >= 2 else (expr, None)


def _operand(expr, lookup, dims, transposed: bool, scalable: bool = True):
    dtype = expr.ty.dtype
    """(tensor, Operand, factor) reading the [B, H, S, D] operand ``expr`` (or [B, H, D, S] when
    ``transposed``) in place from the deepest tensor its layout chain allows, with D innermost
    and 16-byte aligned rows; None when no such tensor exists. ``factor``: the scalar factors
    read through (``scalable=False``: none, for V)."""
    b, h, s, d = dims
    for view in views(expr, lookup):
        if view.source.ty.dtype != dtype or (not scalable and view.factor != 1.0):
            continue
        if transposed:
            if not _same(view.shape, [b, h, d, s]):
                continue
            sb, sh, sd, ss = view.strides
        else:
            if not _same(view.shape, [b, h, s, d]):
                continue
            sb, sh, ss, sd = view.strides
        if not tvm_compat.prove_equal(sd, 1) or not all(
                _aligned(x) for x in (sb, sh, ss, view.offset)):
            continue
        shape = tuple(shape_of(view.source))
        return view.source, ak.Operand(shape, (sb, sh, ss), view.offset), view.factor
    return None


def _mask(mask, dims, mask_factor):
    """The kernel's Mask for the additive mask tensor ``mask``, else (None, why)."""
    b, h, s, _ = dims
    shape = shape_of(mask)
    dtype = mask.ty.dtype
    if shape is None or dtype not in FLOATS:
        return None, "the attention mask is not an fp16/fp32 tensor of known rank"
    m = ak.broadcast_mask(shape, dtype, (b, h, s, s), mask_factor)
    if m is None:
        return None, f"the attention mask {shape} does not broadcast to {[b, h, s, s]}"
    return m, None


def plan(seq, head_dim: int, smem_limit_kib: int, rows: bool = True,
         mma: bool = True, wide: bool = False) -> tuple:
    """(kernel, None) for this shape, or (None, why no kernel serves it). ``kernel``, the
    first that applies:

    - ``"mma"`` (``kernels/mma_attention.py``): scores and output in registers, any length,
      when ``mma`` allows it and the head dim is one it serves (D <= 128). Faster than both
      others wherever measured (H100, 2026-12-07: whisper_encoder 16.10 -> 10.12 ms over the
      tiled kernel, vit_b_16 1.68 -> 1.54, bert 0.94 -> 0.82 and gpt2 0.94 -> 0.83 over the
      row kernel);
    - ``"rows"`` (``kernels/attention.py``): whole score rows on chip, when ``rows`` allows it
      and its shared memory leaves room for two CTAs per SM. At S = 197 (ViT, run as 256) it
      needs 197 KiB, one 4-warp CTA per SM, and lost to the tiled kernel on the H100 (vit_b_16
      1.817 vs 1.655 ms, 2026-12-07); at S = 128 (113 KiB) two fit;
    - ``"tiled"`` (``kernels/flash_attention.py``): wmma, any length.

    ``wide`` (opt-in, ``cuda.mma_attention_wide``): ``"mma_wide"``, the mma kernel with 32
    query rows a warp (FlashAttention-2's tiling), where the head dim allows it (D <= 64);
    not yet timed on a GPU."""
    if mma and wide and mk.supported(head_dim, smem_limit_kib, row_tiles=2) is None:
        return "mma_wide", None
    if mma and mk.supported(head_dim, smem_limit_kib) is None:
        return "mma", None
    if rows and isinstance(seq, int) and ak.supported(seq, head_dim, smem_limit_kib) is None:
        need = ak.shared_bytes(ak.padded_seq(seq), head_dim) + 1024  # + the CTA's reserve
        if 2 * need <= (smem_limit_kib + 1) * 1024:  # an SM has the block limit + 1 KiB
            return "rows", None
    why_flash = fk.supported(head_dim, smem_limit_kib)
    return ("tiled", None) if why_flash is None else (None, why_flash)


KERNELS = {"rows": ak.attention_func, "tiled": fk.flash_attention_func,
           "mma": mk.mma_attention_func,
           "mma_wide": functools.partial(mk.mma_attention_func, row_tiles=2)}


def _fits_int32(sizes, upper: dict) -> bool:
    """Every size (element counts, possibly symbolic) is under 2**31 at the ranges' upper
    bounds ``upper`` ({dim name: max}); False when a dim has none."""
    for n in sizes:
        top = tvm_compat.size_upper_bound(n, upper)
        if not isinstance(top, int) or top >= INT32_ELEMENTS:
            return False
    return True


def match(call, lookup, smem_limit_kib: int, upper: dict | None = None, rows: bool = True,
          mma: bool = True, wide: bool = False):
    """(q, k, v tensors, params dict) when ``call`` ends an attention core this pass fuses,
    (None, reason) when it is one the kernel cannot serve, None when it is no attention.
    ``upper``: the upper bounds of the module's symbolic dims ({name: max})."""
    if op_name(call) == "relax.astype" and str(call.attrs.dtype) in ak.DTYPES:
        pv = _bound(call.args[0], lookup)
    elif op_name(call) == "relax.matmul" and call.ty.dtype in ak.DTYPES:
        pv = call
    else:
        return None
    if pv is None or op_name(pv) != "relax.matmul":
        return None
    p, v = pv.args
    soft = _bound(_through_casts(p, lookup), lookup)
    guarded = _nan_guarded(soft, lookup)
    if guarded is not None:
        soft = _bound(_through_casts(guarded, lookup), lookup)
    if soft is None or op_name(soft) != "relax.nn.softmax" or int(soft.attrs.axis) not in (-1, 3):
        return None
    found = _scores(soft.args[0], lookup)
    if found is None:
        return None
    qk, scale, mask, mask_factor = found
    q, kt = qk.args
    shapes = [shape_of(x) for x in (q, kt, v)]
    dtype = q.ty.dtype
    if any(s is None or len(s) != 4 for s in shapes) or p.ty.dtype != dtype:
        return None
    (b, h, s, d), (_, _, d2, s2), vs = shapes
    if not (_same(shapes[1], [b, h, d, s]) and _same(vs, [b, h, s, d])):
        return None
    if not (isinstance(h, int) and isinstance(d, int)):
        return None, "the head count or head dim is symbolic"
    if dtype not in ak.DTYPES or any(x.ty.dtype != dtype for x in (kt, v)) or \
            (call.ty.dtype != dtype):
        return None
    kernel, why = plan(s, d, smem_limit_kib, rows, mma, wide)
    if why is not None:
        return None, why
    dims = (b, h, s, d)
    kmask = None
    if mask is not None:
        kmask, why = _mask(mask, dims, mask_factor)
        if why is not None:
            return None, why
    ops = [_operand(q, lookup, dims, False), _operand(kt, lookup, dims, True),
           _operand(v, lookup, dims, False, scalable=False)]
    if any(o is None for o in ops):
        return None, "K^T is not a transpose of a tensor with the head dim innermost"
    symbolic = not all(isinstance(x, int) for x in (b, s))
    if symbolic and not _fits_int32(
            [math.prod(o[1].shape) for o in ops] + [b * h * s * d]
            + ([math.prod(kmask.shape)] if kmask is not None else []), upper or {}):
        return None, "a symbolic size without an upper bound under 2**31 elements"
    scale *= ops[0][2] * ops[1][2]  # sqrt(scale) on Q and on K (HF / SDPA exports)
    params = {"dims": dims, "scale": scale, "operands": tuple(o[1] for o in ops),
              "mask": kmask, "dtype": dtype, "nan_to_zero": guarded is not None,
              "kernel": kernel}
    return [o[0] for o in ops] + ([mask] if mask is not None else []), params


def fuse_attention(mod, sm: int, rows: bool = True, mma: bool = True, wide: bool = False):
    """``mod`` with attention cores fused (module docstring); returns (module, fused count,
    {reason: count} of the attention cores left unfused)."""

    relax = tvm_compat.relax()
    limit = smem_limit(sm) // 1024  # KiB, as plan() takes it
    upper = {name: r.hi for name, r in module_ranges(mod).items()}
    funcs: dict = {}      # kernel parameters -> GlobalVar (one PrimFunc per distinct shape)
    made: dict = {}       # name of a fused kernel -> its params, to re-layout its output
    declined: dict = {}

    def emit(bb, tensors, params, out: ak.Operand):
        b, h, s, d = params["dims"]
        # as text: symbolic sizes are PrimExprs, whose == builds an expression
        key = repr((params["dims"], params["scale"], params["operands"], params["mask"],
                    params["dtype"], params["nan_to_zero"], params["kernel"], out))
        if key not in funcs:
            func = KERNELS[params["kernel"]](
                b, h, s, d, params["scale"], *params["operands"], out, params["mask"],
                params["dtype"], params["nan_to_zero"])
            funcs[key] = bb.add_func(func, "amp_attention")
            made[funcs[key].name_hint] = params
        return relax.call_tir(funcs[key], relax.Tuple(list(tensors)),
                              out_ty=relax.TensorType(out.shape, params["dtype"]))

    def rewrite(bb, call, lookup):
        # permute(attention, [0, 2, 1, 3]): write the [B, S, H, D] layout directly
        src, axes = _permutation(call, lookup)
        if axes == HEADS_FIRST:
            inner = _bound(src, lookup)
            if (inner is not None and op_name(inner) == "relax.call_tir"
                    and inner.args[0].name_hint in made):
                # the sizes as this function names them: the kernel may have been made for
                # another function of the module (main_optimum / main_dynamic copies), whose
                # symbolic dims are other variables of the same names
                dims = tuple(shape_of(src))
                params = dict(made[inner.args[0].name_hint], dims=dims)
                return emit(bb, list(inner.args[1].fields), params, ak.bshd(*dims))
        found = match(call, lookup, limit, upper, rows, mma, wide)
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


def fuse_attention_pass(sm: int, stats: dict | None = None, rows: bool = True,
                        mma: bool = True, wide: bool = False):
    """:func:`fuse_attention` as a module pass (after precision conversion, before matmul_nt
    and LegalizeOps); ``stats`` counts the fused attention cores and the unfused ones."""
    def run(mod):
        new, fused, declined = fuse_attention(mod, sm, rows, mma, wide)
        add_counts(stats, attention_fused=fused, attention_unfused=sum(declined.values()))
        return new

    return module_pass(run, "AmpFuseAttention")


@register("fused_attention", "graph", 40, switch="fused_attention",
          reads=("attention_rows", "mma_attention", "mma_attention_wide"),
          labels={"attention_fused": "attention cores fused into one kernel",
                  "attention_unfused": "attention cores left unfused (shape, mask)"})
def make_pass(ctx):
    if ctx.sm < 80:
        return None  # wmma + cp.async
    return fuse_attention_pass(ctx.sm, ctx.stats, ctx.cuda.attention_rows,
                               ctx.cuda.mma_attention, ctx.cuda.mma_attention_wide)

"""Matmuls in NT form (``C[..., i, j] = sum_k A[..., i, k] * B[..., j, k]``) for tensor cores.

Why: amp's tensor-core GEMM (tc_gemm) and dlight's ``MatmulTensorization`` stage both operands in
shared memory as [rows, K] tiles and fill them with vector copies along K (16-byte ``cp.async`` in
tc_gemm). That is only a real vector copy when K is the innermost, contiguous axis of the operand
in global memory. An ONNX ``MatMul`` with a weight ``W[K, N]`` (every linear layer of an exported
transformer) has N innermost, so the copies along K are strided: slow scalar gathers at best, and
TVM 0.27's ``InjectPTXAsyncCopy`` turns a strided vector copy into one 16-byte ``cp.async`` from
the first address (wrong data, and ``cudaErrorMisalignedAddress`` on the H200 for bert-large).

This Relax pass rewrites, for fp16/bf16 ``relax.matmul`` calls:

- ``matmul(x, W)`` with a 2-D constant ``W[K, N]`` -> an NT GEMM on the constant ``W^T[N, K]``
  (transposed once at compile time, like conv_gemm's weights); ``x``'s leading dims may be
  symbolic (a dynamic model's [batch, sequence, K] activations), its K must be static;
- ``matmul(a, permute_dims(x, p))`` (attention's ``q @ k^T`` and ``p @ v``, whose operands come
  out of head-split transposes) -> an NT GEMM on ``permute_dims(x, p')``, ``p'`` being ``p`` with
  its last two axes swapped: the transpose kernel that materialized ``B`` now materializes
  ``B^T`` instead (same cost), or none at all when ``p'`` is the identity.

The GEMM keeps ``matmul``'s output shape and ``out_dtype``, so FuseOps still fuses the epilogue.
Other matmuls (an activation ``B[K, N]`` computed by a non-transpose op) are left alone; tc_gemm
declines them (``K`` not contiguous) and dlight's rule schedules them.
"""
from __future__ import annotations

import numpy as np

from .... import tvm_compat
from ....dtypes import LOW_TYPES
from ..kernels import hopper_gemm
from ..kernels import tc_gemm
from ..registry import register
from .base import add_counts, module_pass, op_name, rewrite_calls, shape_of, static_shape


def permutation(call) -> list[int] | None:
    """The axes of a static-shape ``permute_dims`` call, else None."""
    if op_name(call) != "relax.permute_dims":
        return None
    shape = static_shape(call.args[0])
    if shape is None or len(shape) < 2:
        return None
    axes = call.attrs.axes
    return list(range(len(shape)))[::-1] if axes is None else [int(a) for a in axes]


def _out_dtype(call, x) -> str:
    dt = str(call.attrs.out_dtype)
    return dt if dt not in ("", "void") else x.ty.dtype


def _gemm_nt(te, a, b, out_dtype):
    """C[*lead, i, j] = sum_k A[*lead, i, k] * B[*blead, j, k], leading axes of B broadcast from
    the right (a 2-D B is shared by every leading index)."""
    a_shape = list(a.shape)  # leading dims may be symbolic
    b_rank = len(b.shape)
    k = a_shape[-1]
    n = int(b.shape[-2])
    r = te.reduce_axis((0, k), name="k")

    def value(*ix):
        lead, i, j = ix[:-2], ix[-2], ix[-1]
        b_lead = lead[len(lead) - (b_rank - 2):] if b_rank > 2 else ()
        return te.sum(a[(*lead, i, r)].astype(out_dtype) * b[(*b_lead, j, r)].astype(out_dtype),
                      axis=r)

    return te.compute((*a_shape[:-1], n), value, name="matmul_nt")


def _gemm_nt_split(te, a, b, out_dtype, factor):
    """Split-K partials of ``A[*lead, i, k] @ B[j, k]^T`` (B 2-D):
    ``P[s, *lead, i, j] = sum_{k < K/S} A[*lead, i, s*K/S + k] * B[j, s*K/S + k]``."""
    a_shape = [int(d) for d in a.shape]
    part = a_shape[-1] // factor
    n = int(b.shape[-2])
    r = te.reduce_axis((0, part), name="k")

    def value(s, *ix):
        lead, i, j = ix[:-2], ix[-2], ix[-1]
        return te.sum(a[(*lead, i, s * part + r)].astype(out_dtype)
                      * b[(j, s * part + r)].astype(out_dtype), axis=r)

    return te.compute((factor, *a_shape[:-1], n), value, name="matmul_nt_split")


def _sum_splits(te, p):
    """``C[...] = P[0, ...] + ... + P[S-1, ...]`` as one elementwise kernel (FuseOps fuses the
    GEMM's epilogue into it)."""
    factor = int(p.shape[0])

    def value(*ix):
        total = p[(0, *ix)]
        for s in range(1, factor):
            total = total + p[(s, *ix)]
        return total

    return te.compute([int(d) for d in p.shape[1:]], value, name="split_k_sum")


def _nt_operands(call, lookup):
    """(A, B_nt, kind) when ``call`` is a matmul this pass rewrites, else None. ``B_nt`` is a
    Relax expression of shape [..., N, K]."""
    relax = tvm_compat.relax()
    if op_name(call) != "relax.matmul":
        return None
    a, b = call.args
    a_shape, b_shape = shape_of(a), static_shape(b)
    if a_shape is None or b_shape is None or len(a_shape) < 2 or len(b_shape) < 2:
        return None
    if a.ty.dtype not in LOW_TYPES or b.ty.dtype != a.ty.dtype:
        return None
    if (isinstance(b, tvm_compat.tvm().ir.expr.Constant) and len(b_shape) == 2
            and isinstance(a_shape[-1], int)):
        wt = np.ascontiguousarray(b.value.numpy().T)
        return a, relax.const(wt, b.ty.dtype), "constant"
    if any(not isinstance(d, int) for d in a_shape):
        return None
    producer = lookup(b) if isinstance(b, relax.Var) else None
    perm = permutation(producer) if producer is not None else None
    if perm is not None and len(perm) == len(a_shape) and b_shape[:-2] == a_shape[:-2]:
        # B = permute(x, perm)  =>  B^T = permute(x, perm with its last two axes swapped)
        src = producer.args[0]
        perm_t = perm[:-2] + [perm[-1], perm[-2]]
        if perm_t == list(range(len(perm))):
            return a, src, "transposed"
        return a, relax.op.permute_dims(src, perm_t), "transposed"
    return None


def matmul_to_nt(mod, sm: int | None = None, split_k: bool = False, hopper: bool = False,
                 hopper_min_k: int = hopper_gemm.MIN_K):
    """``mod`` with eligible matmuls in NT form (module docstring) and a count per kind.
    ``split_k`` (needs ``sm``, the CUDA arch number): constant-weight GEMMs whose output is too
    small to fill the GPU with the largest tile (``tc_gemm.split_k_factor``) run as K-split
    partial GEMMs plus an elementwise sum (fp32 accumulation only). ``hopper``: GEMMs that the
    Hopper kernels take (``hopper_gemm.plan`` with ``hopper_min_k``) stay whole: they fill the
    GPU without the split."""

    te = tvm_compat.tvm().te
    relax = tvm_compat.relax()
    counts = {"constant": 0, "transposed": 0, "split_k": 0}

    def rewrite(bb, call, lookup):
        found = _nt_operands(call, lookup)
        if found is None:
            return None
        a, b_nt, kind = found
        if isinstance(b_nt, relax.Call):
            b_nt = bb.emit(b_nt)
        counts[kind] += 1
        out_dtype = _out_dtype(call, a)
        factor = 1
        if split_k and sm and kind == "constant" and out_dtype == "float32" and \
                static_shape(a) is not None:  # the split is chosen per M
            a_shape = static_shape(a)
            m = int(np.prod(a_shape[:-1]))
            n, k = static_shape(b_nt)[0], a_shape[-1]
            whole = hopper and str(a.ty.dtype) in hopper_gemm.IN_TYPES and isinstance(
                hopper_gemm.plan(m, n, k, min_k=hopper_min_k), hopper_gemm.Plan)
            factor = 1 if whole else tc_gemm.split_k_factor(1, m, n, k, sm)
        if factor > 1:
            counts["split_k"] += 1
            parts = bb.emit_te(lambda at, bt: _gemm_nt_split(te, at, bt, out_dtype, factor),
                               a, b_nt, primfunc_name_hint="amp_matmul_nt_split")
            return bb.call_te(lambda pt: _sum_splits(te, pt), parts,
                              primfunc_name_hint="amp_split_k_sum")
        return bb.call_te(lambda at, bt: _gemm_nt(te, at, bt, out_dtype), a, b_nt,
                          primfunc_name_hint="amp_matmul_nt")

    new, _ = rewrite_calls(mod, rewrite)
    return new, counts


def matmul_to_nt_pass(sm: int | None = None, split_k: bool = False, stats: dict | None = None,
                      hopper: bool = False, hopper_min_k: int = hopper_gemm.MIN_K):
    """:func:`matmul_to_nt` as a module pass (after precision conversion, before LegalizeOps);
    ``stats`` counts the matmuls made NT and those split along K."""
    def run(mod):
        new, counts = matmul_to_nt(mod, sm, split_k, hopper, hopper_min_k)
        add_counts(stats, matmuls_nt=counts["constant"] + counts["transposed"],
                   split_k_gemms=counts["split_k"])
        return new

    return module_pass(run, "AmpMatmulToNT")


@register("matmul_nt", "graph", 50, reads=("split_k", "hopper_gemm", "hopper_min_k"),
          labels={"matmuls_nt": "matmuls in NT form", "split_k_gemms": "GEMMs split along K"})
def make_pass(ctx):
    # always on; split_k and hopper_gemm change which GEMMs it splits
    hopper = ctx.cuda.hopper_gemm and hopper_gemm.enabled_for(ctx.target)
    return matmul_to_nt_pass(ctx.sm, ctx.cuda.split_k, ctx.stats, hopper, ctx.cuda.hopper_min_k)


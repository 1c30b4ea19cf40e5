"""amp's fused attention kernel for CUDA: softmax(Q K^T * scale) V in one launch (wmma).

Without it a transformer layer's attention is three kernels and two round trips of the score
tensor through global memory: the batched QK^T GEMM, a memory-bound softmax (its fp32 scores are
read and written again, 22 us per bert-large layer on the H200, more than both GEMMs together)
and the PV GEMM. Here one CTA takes one (batch, head, 64-query block):

1. Q's 64 rows and all of K and V for that head go global -> shared (16-byte vector loads);
2. each of the 4 warps computes its 16 score rows ``Q_w K^T`` on tensor cores (wmma 16x16x16,
   fp32 accumulators) into shared memory;
3. softmax per row in fp32, two lanes per row (max, exp, sum), written as fp16 probabilities;
4. ``P_w V`` on tensor cores, fp32 accumulators staged in shared memory, stored as fp16.

The whole score row stays on chip (half a row per lane in registers), so the kernel serves
sequences up to MAX_SEQ = 256 whose buffers fit the GPU's shared memory (``shared_bytes``, an
upper bound: 113 KiB for S=128, D=64; 197 KiB for S=256, which fits sm_90 but not sm_80);
longer sequences keep the unfused path. A sequence between blocks (ViT's 197) runs as the next
multiple of 64 (``padded_seq``): K/V rows past S are zeros with -inf scores, output rows past S
are not stored. The score accumulation and the softmax are fp32 end to end, which is at least
as accurate as the unfused fp16 path (its scores are rounded to fp16 before the softmax).

Operands are addressed through strides, so Q/K/V may be the [B, S, H, D] views a transformer
writes before its head-split transposes (no transpose kernels) or [B, H, S, D] tensors; the
head dimension must be innermost (16-byte vector loads).

An additive mask (``Mask``: a padding mask [B, 1, 1, S], a causal [S, S] or [1, 1, S, S], any
tensor that broadcasts to [B, H, S, S], fp16 or fp32) is added to the fp32 scores before the
softmax, read through strides (0 along broadcast dims): softmax(Q K^T * scale + M *
mask_scale). Masked positions (-inf, finfo.min, -1e9, the fp16 lowest) get probability 0; a
row masked everywhere is 0/0, as in the unfused graph.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .... import tvm_compat
from .... import ir_attrs

FRAG = 16
WARPS = 4
BLOCK_Q = FRAG * WARPS   # query rows per CTA (16 per warp)
VEC = 8                  # fp16 / bf16 lanes per 16-byte vector
DTYPES = ("float16", "bfloat16")  # wmma 16x16x16 with fp32 accumulators: sm_80+ for bf16
PAD_H = 8                # fp16 row padding in shared memory (bank spread, keeps 16-byte rows)
PAD_F = 4                # fp32 row padding
MAX_SEQ = 256            # each lane holds half a score row in registers (128 floats at most)


@dataclass(frozen=True)
class Operand:
    """How the kernel addresses a [B, H, S, D] operand inside its tensor: ``shape`` of the
    tensor, the element strides of b, h, s (d's stride is 1) and the offset of [0, 0, 0, 0]."""
    shape: tuple
    strides: tuple   # (stride_b, stride_h, stride_s)
    offset: int = 0


def bhsd(b: int, h: int, s: int, d: int) -> Operand:
    return Operand((b, h, s, d), (h * s * d, s * d, d))


def bshd(b: int, h: int, s: int, d: int) -> Operand:
    return Operand((b, s, h, d), (s * h * d, d, h * d))


def packed(b: int, h: int, s: int, d: int, width: int, offset: int) -> Operand:
    """A [B, S, H*D] slice starting at column ``offset`` of a [B, S, width] tensor (one of Q, K, V
    inside a combined QKV projection's output)."""
    return Operand((b, s, width), (s * width, d, width), offset)


@dataclass(frozen=True)
class Mask:
    """An additive attention mask: a ``dtype`` tensor of ``shape`` read at element ``offset + b *
    strides[0] + h * strides[1] + query * strides[2] + key * strides[3]`` (stride 0 along a
    broadcast dim), added to the scaled scores times ``scale``."""
    shape: tuple
    dtype: str
    strides: tuple   # (stride_b, stride_h, stride_query, stride_key)
    offset: int = 0
    scale: float = 1.0


def addresses(q: Operand, k: Operand, v: Operand, out: Operand, mask: Mask | None):
    """What the attention kernels' index arithmetic reads, as int32 (``tvm_compat.index32``:
    every tensor an attention kernel reads has fewer than 2**31 elements,
    ``attention_fits_int32``): the (b, h, s) strides of q, k, v and out, their offsets, and for a
    mask its (b, h, query, key) strides and offset (None without one)."""
    strides = tuple(tuple(tvm_compat.index32(x) for x in o.strides) for o in (q, k, v, out))
    offsets = tuple(tvm_compat.index32(o.offset) for o in (q, k, v, out))
    at = None if mask is None else (tuple(tvm_compat.index32(x) for x in mask.strides),
                                    tvm_compat.index32(mask.offset))
    return strides, offsets, at


def smem_exceeded(need: int, smem_limit_kib: int, what: str) -> str | None:
    """Why a kernel needing ``need`` bytes of shared memory for ``what`` (its shape) cannot run
    on a GPU with ``smem_limit_kib`` KiB per block, or None when it can."""
    if need > smem_limit_kib * 1024:
        return f"{need // 1024} KiB of shared memory for {what} exceeds the GPU's " \
               f"{smem_limit_kib} KiB"
    return None


def broadcast_mask(shape, dtype: str, full: tuple, scale: float = 1.0) -> Mask | None:
    """The Mask reading a contiguous ``shape`` tensor broadcast (right-aligned, numpy rules) to
    ``full`` = (B, H, S, S), or None when it does not broadcast to it. Sizes may be symbolic
    (a dynamic batch or sequence): a dim broadcasts when it is provably 1 or equal."""
    shape = [tvm_compat.size_value(x) for x in shape]
    if len(shape) > 4:
        return None
    padded = [1] * (4 - len(shape)) + shape
    strides, step = [0] * 4, 1
    for i in reversed(range(4)):
        if tvm_compat.prove_equal(padded[i], full[i]):
            strides[i] = 0 if tvm_compat.prove_equal(full[i], 1) else step
        elif not tvm_compat.prove_equal(padded[i], 1):
            return None
        step = step * padded[i]
    return Mask(tuple(shape), dtype, tuple(strides), 0, float(scale))


def shared_bytes(seq: int, head_dim: int) -> int:
    """Shared memory one CTA needs (Q, K, V, scores, probabilities, output staging, partials)."""
    ld_h, ld_s, ld_p, ld_o = head_dim + PAD_H, seq + PAD_F, seq + PAD_H, head_dim + PAD_F
    return (2 * (BLOCK_Q * ld_h + 2 * seq * ld_h + BLOCK_Q * ld_p)
            + 4 * (BLOCK_Q * ld_s + BLOCK_Q * ld_o + 2 * 32 * WARPS))


def padded_seq(seq: int) -> int:
    """The kernel's sequence length for ``seq``: whole BLOCK_Q-row blocks (ViT's 197 -> 256)."""
    return -(-seq // BLOCK_Q) * BLOCK_Q


def supported(seq: int, head_dim: int, smem_limit_kib: int) -> str | None:
    """None when this kernel handles the shape, else why not (one phrase); longer sequences are
    ``flash_attention``'s (the rewrite chooses)."""
    if head_dim % FRAG:
        return f"head dim {head_dim} is not a multiple of {FRAG}"
    if padded_seq(seq) > MAX_SEQ:
        return f"sequence length {seq} is over {MAX_SEQ}"
    return smem_exceeded(shared_bytes(padded_seq(seq), head_dim), smem_limit_kib,
                         f"S={seq}, D={head_dim}")


def row_loader(T, head_dim: int, ld: int, dtype: str, guarded: bool):
    """The TVMScript macro ``load_rows(dst, src, base, row_stride, vecs, tid, limit)`` both
    attention kernels stage Q, K and V with: rows of ``head_dim`` values from ``src[base + row *
    row_stride + d]`` into ``dst[row * ld + d]``, one 16-byte vector per thread and step,
    ``vecs`` vectors in all; when ``guarded``, rows from ``limit`` on are zeros instead."""
    D, LDH, DT, THREADS = head_dim, ld, dtype, WARPS * 32

    @T.macro
    def copy_row_vec(dst, src, base, row_stride, i):
        for l in T.vectorized(VEC):
            dst[i // (D // VEC) * LDH + i % (D // VEC) * VEC + l] = src[
                base + i // (D // VEC) * row_stride + i % (D // VEC) * VEC + l]

    @T.macro
    def load_rows(dst, src, base, row_stride, vecs, tid, limit):
        for it in T.serial((vecs + THREADS - 1) // THREADS):
            if it * THREADS + tid < vecs:
                if guarded:
                    if (it * THREADS + tid) // (D // VEC) < limit:
                        copy_row_vec(dst, src, base, row_stride, it * THREADS + tid)
                    else:
                        for l in T.vectorized(VEC):
                            dst[(it * THREADS + tid) // (D // VEC) * LDH
                                + (it * THREADS + tid) % (D // VEC) * VEC + l] = T.Cast(DT, 0)
                else:
                    copy_row_vec(dst, src, base, row_stride, it * THREADS + tid)

    return load_rows


def attention_func(batch: int, heads: int, seq: int, head_dim: int, scale: float,
                   q: Operand, k: Operand, v: Operand, out: Operand, mask: Mask | None = None,
                   dtype: str = "float16", nan_to_zero: bool = False):
    """The PrimFunc ``(q, k, v, out)``: out[b, h, s, :] = softmax(q k^T * scale) v, ``dtype``
    (float16 or bfloat16) in and out, fp32 inside; with ``mask``, ``(q, k, v, mask, out)`` and
    softmax(q k^T * scale + mask * mask.scale). ``nan_to_zero``: a row masked everywhere with
    -inf writes 0 (the ``where(isnan(P), 0, P)`` guard torch's SDPA export adds), else NaN as
    softmax gives. Shapes as in the operands; scheduled already (``tirx.is_scheduled``)."""
    if dtype not in DTYPES:
        raise ValueError(f"attention kernel dtype {dtype!r}: not one of {DTYPES}")
    DT = dtype
    tvm_compat.tvm()  # a clear error when TVM is missing
    T = tvm_compat.tvmscript_tir()

    B, H, SEQ, D = batch, heads, seq, head_dim
    S = padded_seq(SEQ)   # the kernel's sequence: whole 64-row blocks
    PADDED = S != SEQ     # rows and columns SEQ..S are zero-filled, masked and not stored
    # scores may be -inf (masks): the row max starts at -inf, as softmax's; without a mask every
    # score is finite and the kernel keeps the finite start it was measured with
    NEG = float("-inf") if (mask is not None or PADDED) else -3.0e38
    LDH, LDS, LDP, LDO = D + PAD_H, S + PAD_F, S + PAD_H, D + PAD_F
    NQB = S // BLOCK_Q
    DF, SF = D // FRAG, S // FRAG
    THREADS = WARPS * 32
    HALF = S // 2                     # score columns per lane (two lanes per row)
    CHUNK = 8 if SF % 8 == 0 else 4   # score fragments accumulated before a store
    q_vecs, kv_vecs, o_vecs = BLOCK_Q * D // VEC, S * D // VEC, BLOCK_Q * D // VEC
    scale = float(scale)

    ((qb, qh, qs), (kb, kh, ks), (vb, vh, vs), (ob, oh, os_)), \
        (q_off, k_off, v_off, o_off), mask_at = addresses(q, k, v, out, mask)
    MASKED = mask is not None
    if MASKED:
        (mb, mh, mq, mk), m_off = mask_at
        mscale = float(mask.scale)

    @T.macro
    def store_row_vec(of, o_sh, red, b, h, q0, i):
        """Output row i // (D / VEC) of this CTA, vector i % (D / VEC): staged fp32 / row sum."""
        for l in T.vectorized(VEC):
            if nan_to_zero:
                of[o_off + b * ob + h * oh + (q0 + i // (D // VEC)) * os_
                   + i % (D // VEC) * VEC + l] = T.Cast(DT, T.if_then_else(
                       T.isnan(o_sh[i // (D // VEC) * LDO + i % (D // VEC) * VEC + l]
                               / (red[THREADS + i // (D // VEC) * 2]
                                  + red[THREADS + i // (D // VEC) * 2 + 1])), T.float32(0),
                       o_sh[i // (D // VEC) * LDO + i % (D // VEC) * VEC + l]
                       / (red[THREADS + i // (D // VEC) * 2]
                          + red[THREADS + i // (D // VEC) * 2 + 1])))
            else:
                of[o_off + b * ob + h * oh + (q0 + i // (D // VEC)) * os_
                   + i % (D // VEC) * VEC + l] = T.Cast(
                    DT, o_sh[i // (D // VEC) * LDO + i % (D // VEC) * VEC + l]
                    / (red[THREADS + i // (D // VEC) * 2]
                       + red[THREADS + i // (D // VEC) * 2 + 1]))

    load_rows = row_loader(T, D, LDH, DT, PADDED)

    @T.macro
    def body(qf, kf, vf, of, mf):
        """The kernel over flat views of its buffers (``mf``: the mask's, when MASKED)."""
        bx = T.launch_thread("blockIdx.x", B * H * NQB)
        ty = T.launch_thread("threadIdx.y", WARPS)
        tx = T.launch_thread("threadIdx.x", 32)
        q_sh = T.decl_buffer((BLOCK_Q * LDH,), DT, scope="shared.dyn")
        k_sh = T.decl_buffer((S * LDH,), DT, scope="shared.dyn")
        v_sh = T.decl_buffer((S * LDH,), DT, scope="shared.dyn")
        s_sh = T.decl_buffer((BLOCK_Q * LDS,), "float32", scope="shared.dyn")
        p_sh = T.decl_buffer((BLOCK_Q * LDP,), DT, scope="shared.dyn")
        o_sh = T.decl_buffer((BLOCK_Q * LDO,), "float32", scope="shared.dyn")
        red = T.decl_buffer((2 * THREADS,), "float32", scope="shared.dyn")
        a_frag = T.decl_buffer((DF * 256,), DT, scope="wmma.matrix_a")
        b_frag = T.decl_buffer((256,), DT, scope="wmma.matrix_b")
        c_frag = T.decl_buffer((CHUNK * 256,), "float32", scope="wmma.accumulator")
        p_frag = T.decl_buffer((256,), DT, scope="wmma.matrix_a")
        v_frag = T.decl_buffer((256,), DT, scope="wmma.matrix_b")
        o_frag = T.decl_buffer((DF * 256,), "float32", scope="wmma.accumulator")
        row = T.decl_buffer((HALF,), "float32", scope="local")
        row_max = T.decl_buffer((1,), "float32", scope="local")
        row_sum = T.decl_buffer((1,), "float32", scope="local")
        b = bx // (H * NQB)
        h = bx // NQB % H
        q0 = bx % NQB * BLOCK_Q
        tid = ty * 32 + tx
        # 1. global -> shared (16-byte vectors along D)
        load_rows(q_sh, qf, q_off + b * qb + h * qh + q0 * qs, qs, q_vecs, tid, SEQ - q0)
        load_rows(k_sh, kf, k_off + b * kb + h * kh, ks, kv_vecs, tid, SEQ)
        load_rows(v_sh, vf, v_off + b * vb + h * vh, vs, kv_vecs, tid, SEQ)
        T.tvm_storage_sync("shared")
        # 2. scores of this warp's 16 rows: Q_w K^T on tensor cores, fp32 into shared; up to
        # CHUNK fragments accumulate before they are stored, so the loop only reads shared
        for kk in T.serial(DF):
            T.tvm_load_matrix_sync(a_frag.data, 16, 16, 16, kk, T.tvm_access_ptr(
                T.type_annotation(DT), q_sh.data, ty * FRAG * LDH + kk * FRAG,
                FRAG * LDH, 1), LDH, "row_major")
        for jo in T.serial(SF // CHUNK):
            for j in T.serial(CHUNK):
                T.tvm_fill_fragment(c_frag.data, 16, 16, 16, j, T.float32(0))
                for kk in T.serial(DF):
                    T.tvm_load_matrix_sync(b_frag.data, 16, 16, 16, 0, T.tvm_access_ptr(
                        T.type_annotation(DT), k_sh.data,
                        (jo * CHUNK + j) * FRAG * LDH + kk * FRAG, FRAG * LDH, 1), LDH,
                        "col_major")
                    T.tvm_mma_sync(c_frag.data, j, a_frag.data, kk, b_frag.data, 0,
                                   c_frag.data, j)
            for j in T.serial(CHUNK):
                T.tvm_store_matrix_sync(c_frag.data, 16, 16, 16, j, T.tvm_access_ptr(
                    T.type_annotation("float32"), s_sh.data,
                    ty * FRAG * LDS + (jo * CHUNK + j) * FRAG, FRAG * LDS, 2), LDS, "row_major")
        T.tvm_storage_sync("shared")
        # 3. softmax: lane pair (2r, 2r+1) of warp w owns row 16w + r, half a row each, held in
        # registers; P = exp(s - max) unnormalized (<= 1, fp16), 1/sum applied to the output
        for c in T.unroll(HALF):
            row[c] = s_sh[(ty * FRAG + tx // 2) * LDS + tx % 2 * HALF + c] * T.float32(scale)
        if MASKED:  # a Python bool: the unmasked kernel has no trace of this
            for c in T.unroll(HALF):
                if PADDED:  # no mask element exists outside SEQ x SEQ
                    row[c] = row[c] + T.if_then_else(
                        q0 + ty * FRAG + tx // 2 < SEQ, T.if_then_else(
                            tx % 2 * HALF + c < SEQ, T.Cast("float32", mf[
                                m_off + b * mb + h * mh + (q0 + ty * FRAG + tx // 2) * mq
                                + (tx % 2 * HALF + c) * mk]) * T.float32(mscale),
                            T.float32(0)), T.float32(0))
                else:
                    row[c] = row[c] + T.Cast("float32", mf[
                        m_off + b * mb + h * mh + (q0 + ty * FRAG + tx // 2) * mq
                        + (tx % 2 * HALF + c) * mk]) * T.float32(mscale)
        if PADDED:  # the zero-filled keys SEQ..S get probability 0
            for c in T.unroll(HALF):
                row[c] = T.if_then_else(tx % 2 * HALF + c < SEQ, row[c], T.float32(NEG))
        row_max[0] = T.float32(NEG)
        for c in T.unroll(HALF):
            row_max[0] = T.max(row_max[0], row[c])
        red[tid] = row_max[0]
        T.tvm_storage_sync("shared")
        row_max[0] = T.max(red[tid], red[tid // 2 * 2 + 1 - tid % 2])
        row_sum[0] = T.float32(0)
        for c in T.unroll(HALF):
            row[c] = T.exp(row[c] - row_max[0])
            row_sum[0] = row_sum[0] + row[c]
        for c in T.unroll(HALF):
            p_sh[(ty * FRAG + tx // 2) * LDP + tx % 2 * HALF + c] = T.Cast(DT, row[c])
        red[THREADS + tid] = row_sum[0]
        T.tvm_storage_sync("shared")
        # 4. out_w = P_w V on tensor cores
        for n in T.serial(DF):
            T.tvm_fill_fragment(o_frag.data, 16, 16, 16, n, T.float32(0))
        for kk in T.serial(SF):
            T.tvm_load_matrix_sync(p_frag.data, 16, 16, 16, 0, T.tvm_access_ptr(
                T.type_annotation(DT), p_sh.data, ty * FRAG * LDP + kk * FRAG,
                FRAG * LDP, 1), LDP, "row_major")
            for n in T.serial(DF):
                T.tvm_load_matrix_sync(v_frag.data, 16, 16, 16, 0, T.tvm_access_ptr(
                    T.type_annotation(DT), v_sh.data, kk * FRAG * LDH + n * FRAG,
                    FRAG * LDH, 1), LDH, "row_major")
                T.tvm_mma_sync(o_frag.data, n, p_frag.data, 0, v_frag.data, 0, o_frag.data, n)
        for n in T.serial(DF):
            T.tvm_store_matrix_sync(o_frag.data, 16, 16, 16, n, T.tvm_access_ptr(
                T.type_annotation("float32"), o_sh.data, ty * FRAG * LDO + n * FRAG,
                FRAG * LDO, 2), LDO, "row_major")
        T.tvm_storage_sync("shared")
        for it in T.serial((o_vecs + THREADS - 1) // THREADS):
            if it * THREADS + tid < o_vecs:
                if PADDED:
                    if q0 + (it * THREADS + tid) // (D // VEC) < SEQ:
                        store_row_vec(of, o_sh, red, b, h, q0, it * THREADS + tid)
                else:
                    store_row_vec(of, o_sh, red, b, h, q0, it * THREADS + tid)

    return kernel_signature(T, body, "attention", q, k, v, out, mask, DT)


def kernel_signature(T, body, name: str, q: Operand, k: Operand, v: Operand, out: Operand,
                     mask: Mask | None, dtype: str):
    """The PrimFunc ``(q, k, v[, mask], out)`` of an attention kernel: flat views of its buffers
    handed to the TVMScript macro ``body(qf, kf, vf, of, mf)`` (``mf`` None without a mask);
    ``amp.kernel`` is ``name`` or ``masked_<name>``."""
    DT = dtype
    NQ, NK, NV, NO = (math.prod(x.shape) for x in (q, k, v, out))
    if mask is None:
        @T.prim_func(private=True, s_tir=True)
        def attention(q_in: T.Buffer(q.shape, DT), k_in: T.Buffer(k.shape, DT),
                      v_in: T.Buffer(v.shape, DT), o_out: T.Buffer(out.shape, DT)):
            T.func_attr({ir_attrs.NOALIAS: True, ir_attrs.IS_SCHEDULED: True,
                         ir_attrs.KERNEL_NAME: name})
            qf = T.decl_buffer((NQ,), DT, data=q_in.data)
            kf = T.decl_buffer((NK,), DT, data=k_in.data)
            vf = T.decl_buffer((NV,), DT, data=v_in.data)
            of = T.decl_buffer((NO,), DT, data=o_out.data)
            body(qf, kf, vf, of, None)

        return attention

    NM = math.prod(mask.shape)

    @T.prim_func(private=True, s_tir=True)
    def masked_attention(q_in: T.Buffer(q.shape, DT), k_in: T.Buffer(k.shape, DT),
                         v_in: T.Buffer(v.shape, DT),
                         m_in: T.Buffer(mask.shape, mask.dtype),
                         o_out: T.Buffer(out.shape, DT)):
        T.func_attr({ir_attrs.NOALIAS: True, ir_attrs.IS_SCHEDULED: True,
                     ir_attrs.KERNEL_NAME: "masked_" + name})
        qf = T.decl_buffer((NQ,), DT, data=q_in.data)
        kf = T.decl_buffer((NK,), DT, data=k_in.data)
        vf = T.decl_buffer((NV,), DT, data=v_in.data)
        mf = T.decl_buffer((NM,), mask.dtype, data=m_in.data)
        of = T.decl_buffer((NO,), DT, data=o_out.data)
        body(qf, kf, vf, of, mf)

    return masked_attention

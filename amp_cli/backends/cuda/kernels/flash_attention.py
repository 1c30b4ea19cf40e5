"""amp's attention kernel for sequences longer than ``attention.MAX_SEQ`` (Whisper's 1500 frames,
BERT at 512): softmax(Q K^T * scale [+ M]) V with an online softmax over 64-key tiles, so no
score row has to fit on chip.

One CTA takes one (batch, head, 64-query block), 4 warps of 16 query rows, as
``attention.attention_func`` does; the difference is the loop over key tiles:

1. Q's 64 rows global -> shared once, then into wmma fragments kept for the whole loop;
2. per tile of 64 keys: K and V rows global -> shared (zeros past S); each warp's 16 x 64
   scores on tensor cores into shared memory;
3. the lane pair (2r, 2r+1) owning row r (half the tile's columns each) scales and masks its
   scores, takes the tile's row max and the new running max ``m``, writes ``exp(s - m)`` as the
   probabilities, and rescales its running sum ``l`` and its half of the output row ``o``
   (registers, fp32) by ``exp(m_old - m)``;
4. ``P V`` for the tile on tensor cores, staged in shared memory, added into ``o``;
5. after the last tile, ``o / l`` is stored (rows past S are not).

Softmax semantics are softmax's own: a row whose scores are all -inf gives 0/0 (NaN), or 0 with
``nan_to_zero`` (torch's SDPA guard); a running max of -inf is replaced by 0 in the exponents so
an all-masked first tile does not poison later ones. The scores, the sums and the output stay
fp32; only P and V meet the tensor cores in the input type, as in the unfused graph.
"""
from __future__ import annotations


from .... import tvm_compat
from .attention import BLOCK_Q, FRAG, PAD_F, PAD_H, VEC, WARPS, Mask, Operand, addresses, \
    kernel_signature, row_loader, smem_exceeded

BLOCK_K = 64  # keys per tile


def shared_bytes(head_dim: int) -> int:
    """Shared memory one CTA needs (Q, K, V tiles, scores, probabilities, PV staging, partials):
    independent of the sequence length."""
    ld_h, ld_s, ld_p, ld_o = head_dim + PAD_H, BLOCK_K + PAD_F, BLOCK_K + PAD_H, head_dim + PAD_F
    return (2 * (BLOCK_Q * ld_h + 2 * BLOCK_K * ld_h + BLOCK_Q * ld_p)
            + 4 * (BLOCK_Q * ld_s + BLOCK_Q * ld_o + 2 * 32 * WARPS))


def supported(head_dim: int, smem_limit_kib: int) -> str | None:
    """None when this kernel handles the head dim on a GPU with that much shared memory (any
    sequence length), else why not."""
    if head_dim % FRAG:
        return f"head dim {head_dim} is not a multiple of {FRAG}"
    return smem_exceeded(shared_bytes(head_dim), smem_limit_kib, f"D={head_dim}")


def flash_attention_func(batch: int, heads: int, seq: int, head_dim: int, scale: float,
                         q: Operand, k: Operand, v: Operand, out: Operand,
                         mask: Mask | None = None, dtype: str = "float16",
                         nan_to_zero: bool = False):
    """The PrimFunc ``(q, k, v[, mask], out)`` with ``attention.attention_func``'s contract, for
    any sequence length (module docstring)."""
    tvm_compat.tvm()
    T = tvm_compat.tvmscript_tir()
    DT = dtype

    i32 = tvm_compat.index32
    B, H, SEQ, D = i32(batch), heads, i32(seq), head_dim
    NQB = (SEQ + BLOCK_Q - 1) // BLOCK_Q   # query blocks
    NT = (SEQ + BLOCK_K - 1) // BLOCK_K    # key tiles
    # the last tile / query block has rows past SEQ (always possible for a symbolic SEQ)
    PARTIAL = not isinstance(SEQ, int) or SEQ % BLOCK_K != 0
    LDH, LDS, LDP, LDO = D + PAD_H, BLOCK_K + PAD_F, BLOCK_K + PAD_H, D + PAD_F
    DF, KF = D // FRAG, BLOCK_K // FRAG
    THREADS = WARPS * 32
    HALF = BLOCK_K // 2               # score columns per lane in a tile
    DH = D // 2                       # output columns per lane
    Q_VECS, KV_VECS = BLOCK_Q * D // VEC, BLOCK_K * D // VEC  # 16-byte vectors per load
    NEG = float("-inf")
    scale = float(scale)

    ((qb, qh, qs), (kb, kh, ks), (vb, vh, vs), (ob, oh, os_)), \
        (q_off, k_off, v_off, o_off), mask_at = addresses(q, k, v, out, mask)
    MASKED = mask is not None
    if MASKED:
        (mb, mh, mq, mk), m_off = mask_at
        mscale = float(mask.scale)

    load_rows = row_loader(T, D, LDH, DT, True)  # Q's last block, K/V's last tile

    @T.macro
    def body(qf, kf, vf, of, mf):
        bx = T.launch_thread("blockIdx.x", B * H * NQB)
        ty = T.launch_thread("threadIdx.y", WARPS)
        tx = T.launch_thread("threadIdx.x", 32)
        q_sh = T.decl_buffer((BLOCK_Q * LDH,), DT, scope="shared.dyn")
        k_sh = T.decl_buffer((BLOCK_K * LDH,), DT, scope="shared.dyn")
        v_sh = T.decl_buffer((BLOCK_K * LDH,), DT, scope="shared.dyn")
        s_sh = T.decl_buffer((BLOCK_Q * LDS,), "float32", scope="shared.dyn")
        p_sh = T.decl_buffer((BLOCK_Q * LDP,), DT, scope="shared.dyn")
        x_sh = T.decl_buffer((BLOCK_Q * LDO,), "float32", scope="shared.dyn")
        red = T.decl_buffer((2 * THREADS,), "float32", scope="shared.dyn")
        a_frag = T.decl_buffer((DF * 256,), DT, scope="wmma.matrix_a")
        b_frag = T.decl_buffer((256,), DT, scope="wmma.matrix_b")
        c_frag = T.decl_buffer((KF * 256,), "float32", scope="wmma.accumulator")
        p_frag = T.decl_buffer((256,), DT, scope="wmma.matrix_a")
        v_frag = T.decl_buffer((256,), DT, scope="wmma.matrix_b")
        x_frag = T.decl_buffer((DF * 256,), "float32", scope="wmma.accumulator")
        row = T.decl_buffer((HALF,), "float32", scope="local")
        o_reg = T.decl_buffer((DH,), "float32", scope="local")
        run = T.decl_buffer((4,), "float32", scope="local")  # m, l, tile max / sum, alpha
        b = bx // (H * NQB)
        h = bx // NQB % H
        q0 = bx % NQB * BLOCK_Q
        tid = ty * 32 + tx
        r = ty * FRAG + tx // 2           # this lane pair's query row in the block
        # 1. Q once: global -> shared -> fragments held for every tile
        load_rows(q_sh, qf, q_off + b * qb + h * qh + q0 * qs, qs, Q_VECS, tid, SEQ - q0)
        T.tvm_storage_sync("shared")
        for kk in T.serial(DF):
            T.tvm_load_matrix_sync(a_frag.data, 16, 16, 16, kk, T.tvm_access_ptr(
                T.type_annotation(DT), q_sh.data, ty * FRAG * LDH + kk * FRAG,
                FRAG * LDH, 1), LDH, "row_major")
        run[0] = T.float32(NEG)
        run[1] = T.float32(0)
        for j in T.serial(DH):
            o_reg[j] = T.float32(0)
        for t in T.serial(NT):
            # 2. the tile's K and V rows, then this warp's 16 x 64 scores
            load_rows(k_sh, kf, k_off + b * kb + h * kh + t * BLOCK_K * ks, ks, KV_VECS, tid,
                      SEQ - t * BLOCK_K)
            load_rows(v_sh, vf, v_off + b * vb + h * vh + t * BLOCK_K * vs, vs, KV_VECS, tid,
                      SEQ - t * BLOCK_K)
            T.tvm_storage_sync("shared")
            for j in T.serial(KF):
                T.tvm_fill_fragment(c_frag.data, 16, 16, 16, j, T.float32(0))
                for kk in T.serial(DF):
                    T.tvm_load_matrix_sync(b_frag.data, 16, 16, 16, 0, T.tvm_access_ptr(
                        T.type_annotation(DT), k_sh.data, j * FRAG * LDH + kk * FRAG,
                        FRAG * LDH, 1), LDH, "col_major")
                    T.tvm_mma_sync(c_frag.data, j, a_frag.data, kk, b_frag.data, 0,
                                   c_frag.data, j)
            for j in T.serial(KF):
                T.tvm_store_matrix_sync(c_frag.data, 16, 16, 16, j, T.tvm_access_ptr(
                    T.type_annotation("float32"), s_sh.data, ty * FRAG * LDS + j * FRAG,
                    FRAG * LDS, 2), LDS, "row_major")
            T.tvm_storage_sync("shared")
            # 3. online softmax: scale, mask, the tile's max, the new running max
            for c in T.unroll(HALF):
                row[c] = s_sh[r * LDS + tx % 2 * HALF + c] * T.float32(scale)
            if MASKED:
                for c in T.unroll(HALF):
                    row[c] = row[c] + T.if_then_else(
                        q0 + r < SEQ, T.if_then_else(
                            t * BLOCK_K + tx % 2 * HALF + c < SEQ, T.Cast("float32", mf[
                                m_off + b * mb + h * mh + (q0 + r) * mq
                                + (t * BLOCK_K + tx % 2 * HALF + c) * mk]) * T.float32(mscale),
                            T.float32(0)), T.float32(0))
            if PARTIAL:
                for c in T.unroll(HALF):
                    row[c] = T.if_then_else(t * BLOCK_K + tx % 2 * HALF + c < SEQ, row[c],
                                            T.float32(NEG))
            run[2] = T.float32(NEG)
            for c in T.unroll(HALF):
                run[2] = T.max(run[2], row[c])
            red[tid] = run[2]
            T.tvm_storage_sync("shared")
            run[2] = T.max(run[0], T.max(red[tid], red[tid // 2 * 2 + 1 - tid % 2]))
            # exponents against a finite max: an all -inf row so far keeps p = 0, alpha = 0
            run[3] = T.exp(run[0] - T.if_then_else(run[2] == T.float32(NEG), T.float32(0),
                                                    run[2]))
            run[0] = run[2]
            run[2] = T.float32(0)
            for c in T.unroll(HALF):
                row[c] = T.exp(row[c] - T.if_then_else(run[0] == T.float32(NEG),
                                                        T.float32(0), run[0]))
                run[2] = run[2] + row[c]
            for c in T.unroll(HALF):
                p_sh[r * LDP + tx % 2 * HALF + c] = T.Cast(DT, row[c])
            red[THREADS + tid] = run[2]
            T.tvm_storage_sync("shared")
            run[1] = run[1] * run[3] + red[THREADS + tid] + red[
                THREADS + tid // 2 * 2 + 1 - tid % 2]
            # 4. this tile's P V on tensor cores, staged in shared memory
            for n in T.serial(DF):
                T.tvm_fill_fragment(x_frag.data, 16, 16, 16, n, T.float32(0))
            for kk in T.serial(KF):
                T.tvm_load_matrix_sync(p_frag.data, 16, 16, 16, 0, T.tvm_access_ptr(
                    T.type_annotation(DT), p_sh.data, ty * FRAG * LDP + kk * FRAG,
                    FRAG * LDP, 1), LDP, "row_major")
                for n in T.serial(DF):
                    T.tvm_load_matrix_sync(v_frag.data, 16, 16, 16, 0, T.tvm_access_ptr(
                        T.type_annotation(DT), v_sh.data, kk * FRAG * LDH + n * FRAG,
                        FRAG * LDH, 1), LDH, "row_major")
                    T.tvm_mma_sync(x_frag.data, n, p_frag.data, 0, v_frag.data, 0,
                                   x_frag.data, n)
            for n in T.serial(DF):
                T.tvm_store_matrix_sync(x_frag.data, 16, 16, 16, n, T.tvm_access_ptr(
                    T.type_annotation("float32"), x_sh.data, ty * FRAG * LDO + n * FRAG,
                    FRAG * LDO, 2), LDO, "row_major")
            T.tvm_storage_sync("shared")
            # 5. o = o * alpha + P V (this lane's half row, registers)
            for j in T.unroll(DH):
                o_reg[j] = o_reg[j] * run[3] + x_sh[r * LDO + tx % 2 * DH + j]
            T.tvm_storage_sync("shared")
        # 6. o / l, rows past SEQ not stored
        if q0 + r < SEQ:
            for j in T.serial(DH // VEC):
                for l in T.vectorized(VEC):
                    if nan_to_zero:
                        of[o_off + b * ob + h * oh + (q0 + r) * os_ + tx % 2 * DH + j * VEC
                           + l] = T.Cast(DT, T.if_then_else(
                               T.isnan(o_reg[j * VEC + l] / run[1]), T.float32(0),
                               o_reg[j * VEC + l] / run[1]))
                    else:
                        of[o_off + b * ob + h * oh + (q0 + r) * os_ + tx % 2 * DH + j * VEC
                           + l] = T.Cast(DT, o_reg[j * VEC + l] / run[1])

    return kernel_signature(T, body, "flash_attention", q, k, v, out, mask, DT)

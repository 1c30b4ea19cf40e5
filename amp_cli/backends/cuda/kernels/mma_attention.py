"""amp's register-resident attention kernel (FlashAttention-2's structure, ``mma.sync``):
softmax(Q K^T * scale [+ M]) V for any sequence length, with the scores, the probabilities and
the output accumulator in registers instead of shared memory.

``flash_attention`` (wmma) has to round-trip every 64-key tile's scores, probabilities and P V
partials through shared memory -- wmma fragments have no element layout a program may rely on
-- and pays six block barriers per tile for it (~73 TFLOP/s on Whisper's 1500 frames on the
H100). ``mma.sync.m16n8k16`` has a documented fragment layout (PTX ISA, "Matrix Fragments for
mma.m16n8k16"), so each warp can work on its 16 query rows entirely in registers:

- accumulator of an n8 tile: lane ``l`` holds rows ``l/4`` and ``l/4 + 8``, columns
  ``2 (l % 4) + {0, 1}`` (``c0 c1`` and ``c2 c3``);
- A operand of a k16 step: ``a0 a1`` row ``l/4``, columns ``2 (l % 4) + {0, 1}``; ``a2 a3`` row
  + 8; ``a4 .. a7`` the same 8 columns on;

so the scores of two adjacent n8 tiles, converted to fp16/bf16 element by element, *are* the A
operand of the P V step over those 16 keys: no data moves between the two GEMMs. Row maxima and
sums are reduced over the 4 lanes that share a row with two ``shfl.xor``.

One CTA takes one (batch, head, 64-query block), 4 warps of 16 rows:

1. Q's 64 rows global -> shared, then ``ldmatrix`` into A fragments kept for the whole loop;
2. the next 64-key tile of K and V is loaded global -> registers while the current one is
   computed (16-byte vectors), then stored to shared memory: two block barriers per tile;
3. S = Q K^T: ``ldmatrix`` (K rows are the B operand's columns) + ``mma.sync``, fp32;
4. scale and mask in the log2 domain, the online softmax (running max ``m``, per-lane partial
   sums ``l``, ``exp2``), the output rescaled by ``exp2(m_old - m)``;
5. O += P V: P straight from the score registers, V through ``ldmatrix.trans``;
6. after the last tile the 4 lanes' sums are added, ``o / l`` is staged in shared memory and
   stored as 16-byte vectors (rows past S are not).

Semantics are ``flash_attention``'s: fp32 scores, softmax's own 0/0 for a row masked
everywhere (0 with ``nan_to_zero``), an all -inf running max replaced by 0 in the exponents,
any sequence length (symbolic too: the guards are always on then), operands through strides.
"""
from __future__ import annotations

from .... import tvm_compat
from .attention import BLOCK_Q, FRAG, PAD_H, VEC, WARPS, Mask, Operand, addresses, \
    kernel_signature, row_loader, smem_exceeded

BLOCK_K = 64         # keys per tile
MAX_HEAD_DIM = 128   # registers: the output accumulator is D/2 floats per lane
# two 16-row tiles per warp (``row_tiles=2``): scores and output twice over in registers,
# so only for head dims up to this
MAX_WIDE_HEAD_DIM = 64
LOG2E = 1.4426950408889634


def shared_bytes(head_dim: int, row_tiles: int = 1) -> int:
    """Shared memory one CTA needs: Q's block and one K and one V tile (fp16/bf16, padded rows
    so ``ldmatrix``'s eight row addresses fall in distinct banks)."""
    return 2 * (BLOCK_Q * row_tiles + 2 * BLOCK_K) * (head_dim + PAD_H)


def supported(head_dim: int, smem_limit_kib: int, row_tiles: int = 1) -> str | None:
    """None when this kernel handles the head dim (any sequence length), else why not."""
    if head_dim % FRAG:
        return f"head dim {head_dim} is not a multiple of {FRAG}"
    limit = MAX_HEAD_DIM if row_tiles == 1 else MAX_WIDE_HEAD_DIM
    if head_dim > limit:
        return f"head dim {head_dim} is over {limit} (registers, {16 * row_tiles} rows a warp)"
    return smem_exceeded(shared_bytes(head_dim, row_tiles), smem_limit_kib, f"D={head_dim}")


def mma_attention_func(batch: int, heads: int, seq: int, head_dim: int, scale: float,
                       q: Operand, k: Operand, v: Operand, out: Operand,
                       mask: Mask | None = None, dtype: str = "float16",
                       nan_to_zero: bool = False, row_tiles: int = 1):
    """The PrimFunc ``(q, k, v[, mask], out)`` with ``attention.attention_func``'s contract, for
    any sequence length (module docstring).

    ``row_tiles=2``: 32 query rows a warp, 128 a CTA (FlashAttention-2's tiling): each K and
    V fragment ``ldmatrix`` reads from shared memory feeds two row tiles' ``mma.sync``, half
    the shared-memory traffic per multiply-add of the 16-row kernel, whose ``ldmatrix`` bytes
    per tile (16 KiB a warp) rival its math. The registers that takes leave none for the next
    tile's prefetch: K and V go global -> shared at the start of each tile instead, behind the
    other CTAs on the SM (D <= 64)."""
    MT = row_tiles
    BQ = BLOCK_Q * MT                 # query rows per CTA
    WROWS = FRAG * MT                 # query rows per warp
    tvm_compat.tvm()
    T = tvm_compat.tvmscript_tir()
    DT = dtype
    ptx = {"float16": "fp16", "bfloat16": "bf16"}[str(DT)]

    i32 = tvm_compat.index32
    B, H, SEQ, D = i32(batch), heads, i32(seq), head_dim
    NQB = (SEQ + BQ - 1) // BQ        # query blocks
    NT = (SEQ + BLOCK_K - 1) // BLOCK_K    # key tiles
    # the last tile / query block has rows past SEQ (always possible for a symbolic SEQ)
    PARTIAL = not isinstance(SEQ, int) or SEQ % BLOCK_K != 0
    LDH = D + PAD_H
    DK = D // FRAG                    # k16 steps of Q K^T
    DN = D // 8                       # n8 tiles of the output
    KN = BLOCK_K // 8                 # n8 tiles of a score tile
    KC = BLOCK_K // FRAG              # k16 steps of P V
    THREADS = WARPS * 32
    ROW_VECS = D // VEC               # 16-byte vectors per row
    KV_PER = BLOCK_K * ROW_VECS // THREADS  # vectors per thread per K (or V) tile
    Q_VECS = BQ * ROW_VECS
    TILE_VECS = BLOCK_K * ROW_VECS
    NEG = float("-inf")
    sl2 = float(scale) * LOG2E        # scores in the log2 domain: exp2(s * sl2 - m)

    ((qb, qh, qs), (kb, kh, ks), (vb, vh, vs), (ob, oh, os_)), \
        (q_off, k_off, v_off, o_off), mask_at = addresses(q, k, v, out, mask)
    MASKED = mask is not None
    if MASKED:
        (mb, mh, mq, mk), m_off = mask_at
        ml2 = float(mask.scale) * LOG2E

    load_rows = row_loader(T, D, LDH, DT, True)  # Q's last block

    @T.macro
    def fetch(regs, src, base, row_stride, tid, limit):
        """This thread's KV_PER 16-byte vectors of a 64-row tile into registers (zeros from row
        ``limit`` on)."""
        for i in T.unroll(KV_PER):
            if PARTIAL:
                if (i * THREADS + tid) // ROW_VECS < limit:
                    for l in T.vectorized(VEC):
                        regs[i * VEC + l] = src[base + (i * THREADS + tid) // ROW_VECS
                                                * row_stride + (i * THREADS + tid) % ROW_VECS
                                                * VEC + l]
                else:
                    for l in T.vectorized(VEC):
                        regs[i * VEC + l] = T.Cast(DT, 0)
            else:
                for l in T.vectorized(VEC):
                    regs[i * VEC + l] = src[base + (i * THREADS + tid) // ROW_VECS * row_stride
                                            + (i * THREADS + tid) % ROW_VECS * VEC + l]

    @T.macro
    def stash(dst, regs, tid):
        for i in T.unroll(KV_PER):
            for l in T.vectorized(VEC):
                dst[(i * THREADS + tid) // ROW_VECS * LDH + (i * THREADS + tid) % ROW_VECS * VEC
                    + l] = regs[i * VEC + l]

    def smem(buf, rows):
        return T.tvm_access_ptr(T.type_annotation(DT), buf.data, 0, rows * LDH, 1)

    @T.macro
    def mma_pair(a, a_off, b, acc, acc_off):
        """``acc``'s two n8 tiles from ``acc_off`` += the k16 A fragment of ``a`` at ``a_off``
        times the two B fragments one ``ldmatrix.x4`` put in ``b`` (halves 0-3 and 4-7)."""
        T.ptx_legacy.mma("m16n8k16", "row", "col", ptx, ptx, "fp32", a.data, a_off, b.data, 0,
                         acc.data, acc_off, False, dtype="float32")
        T.ptx_legacy.mma("m16n8k16", "row", "col", ptx, ptx, "fp32", a.data, a_off, b.data, 4,
                         acc.data, acc_off + 4, False, dtype="float32")

    @T.macro
    def body(qf, kf, vf, of, mf):
        bx = T.launch_thread("blockIdx.x", B * H * NQB)
        ty = T.launch_thread("threadIdx.y", WARPS)
        tx = T.launch_thread("threadIdx.x", 32)
        q_sh = T.decl_buffer((BQ * LDH,), DT, scope="shared.dyn")
        k_sh = T.decl_buffer((BLOCK_K * LDH,), DT, scope="shared.dyn")
        v_sh = T.decl_buffer((BLOCK_K * LDH,), DT, scope="shared.dyn")
        # per row tile m of the warp: its Q fragments, scores, probabilities, output
        q_frag = T.decl_buffer((MT * DK * 8,), DT, scope="local")
        kv_frag = T.decl_buffer((8,), DT, scope="local")
        p_frag = T.decl_buffer((MT * KN * 4,), DT, scope="local")
        s_acc = T.decl_buffer((MT * KN * 4,), "float32", scope="local")
        o_acc = T.decl_buffer((MT * DN * 4,), "float32", scope="local")
        k_reg = T.decl_buffer((KV_PER * VEC,), DT, scope="local")
        v_reg = T.decl_buffer((KV_PER * VEC,), DT, scope="local")
        # per row tile, per row half (lane rows l/4 and l/4 + 8): running max, partial sum,
        # tile max, alpha
        run = T.decl_buffer((MT * 8,), "float32", scope="local")
        b = bx // (H * NQB)
        h = bx // NQB % H
        q0 = bx % NQB * BQ
        tid = ty * 32 + tx
        # 1. Q once (global -> shared -> A fragments); the first K/V tile into registers
        load_rows(q_sh, qf, q_off + b * qb + h * qh + q0 * qs, qs, Q_VECS, tid, SEQ - q0)
        if MT == 1:
            fetch(k_reg, kf, k_off + b * kb + h * kh, ks, tid, SEQ)
            fetch(v_reg, vf, v_off + b * vb + h * vh, vs, tid, SEQ)
        T.tvm_storage_sync("shared")
        for m in T.unroll(MT):
            for kk in T.unroll(DK):
                T.ptx_legacy.ldmatrix(False, 4, ".b16", q_frag.data, (m * DK + kk) * 8,
                                      smem(q_sh, BQ),
                                      (ty * WROWS + m * FRAG + tx % 16) * LDH + kk * FRAG
                                      + tx // 16 * 8, dtype=DT)
        for r in T.unroll(MT * 2):
            run[r // 2 * 8 + r % 2] = T.float32(NEG)
            run[r // 2 * 8 + 2 + r % 2] = T.float32(0)
        for x in T.unroll(MT * DN * 4):
            o_acc[x] = T.float32(0)
        for t in T.serial(NT):
            # 2. tile t into shared memory (after every warp is done with tile t - 1): from
            # the registers it was prefetched into, then tile t + 1's loads in flight during
            # this tile's math; with two row tiles, straight from global memory
            T.tvm_storage_sync("shared")
            if MT == 1:
                stash(k_sh, k_reg, tid)
                stash(v_sh, v_reg, tid)
            else:
                load_rows(k_sh, kf, k_off + b * kb + h * kh + t * BLOCK_K * ks, ks, TILE_VECS,
                          tid, SEQ - t * BLOCK_K)
                load_rows(v_sh, vf, v_off + b * vb + h * vh + t * BLOCK_K * vs, vs, TILE_VECS,
                          tid, SEQ - t * BLOCK_K)
            T.tvm_storage_sync("shared")
            if MT == 1:
                if t + 1 < NT:
                    fetch(k_reg, kf, k_off + b * kb + h * kh + (t + 1) * BLOCK_K * ks, ks, tid,
                          SEQ - (t + 1) * BLOCK_K)
                    fetch(v_reg, vf, v_off + b * vb + h * vh + (t + 1) * BLOCK_K * vs, vs, tid,
                          SEQ - (t + 1) * BLOCK_K)
            # 3. S = Q K^T, 16 x 64 per row tile: two n8 tiles per ldmatrix.x4 of K, each
            # fragment used by every row tile of the warp
            for x in T.unroll(MT * KN * 4):
                s_acc[x] = T.float32(0)
            for jj in T.unroll(KN // 2):
                for kk in T.unroll(DK):
                    T.ptx_legacy.ldmatrix(False, 4, ".b16", kv_frag.data, 0,
                                          smem(k_sh, BLOCK_K),
                                          (jj * 16 + tx // 16 * 8 + tx % 8) * LDH + kk * FRAG
                                          + tx // 8 % 2 * 8, dtype=DT)
                    for m in T.unroll(MT):
                        mma_pair(q_frag, (m * DK + kk) * 8, kv_frag, s_acc,
                                 m * KN * 4 + jj * 8)
            # 4. log2-domain scores (+ mask), keys past SEQ at -inf
            for m in T.unroll(MT):
                for x in T.unroll(KN * 4):
                    s_acc[m * KN * 4 + x] = s_acc[m * KN * 4 + x] * T.float32(sl2)
                    if MASKED:
                        s_acc[m * KN * 4 + x] = s_acc[m * KN * 4 + x] + T.if_then_else(
                            q0 + ty * WROWS + m * FRAG + tx // 4 + x % 4 // 2 * 8 < SEQ,
                            T.if_then_else(
                                t * BLOCK_K + x // 4 * 8 + tx % 4 * 2 + x % 2 < SEQ,
                                T.Cast("float32", mf[
                                    m_off + b * mb + h * mh
                                    + (q0 + ty * WROWS + m * FRAG + tx // 4 + x % 4 // 2 * 8) * mq
                                    + (t * BLOCK_K + x // 4 * 8 + tx % 4 * 2 + x % 2) * mk])
                                * T.float32(ml2), T.float32(0)), T.float32(0))
                    if PARTIAL:
                        s_acc[m * KN * 4 + x] = T.if_then_else(
                            t * BLOCK_K + x // 4 * 8 + tx % 4 * 2 + x % 2 < SEQ,
                            s_acc[m * KN * 4 + x], T.float32(NEG))
            for m in T.unroll(MT):
                for r in T.unroll(2):
                    run[m * 8 + 4 + r] = T.float32(NEG)
                for x in T.unroll(KN * 4):
                    run[m * 8 + 4 + x % 4 // 2] = T.max(run[m * 8 + 4 + x % 4 // 2],
                                                        s_acc[m * KN * 4 + x])
                for r in T.unroll(2):
                    run[m * 8 + 4 + r] = T.max(run[m * 8 + r],
                                               T.cuda.warp_max(run[m * 8 + 4 + r], 4))
                    # exponents against a finite max: a row all -inf so far keeps p = 0,
                    # alpha = 0
                    run[m * 8 + 6 + r] = T.exp2(run[m * 8 + r] - T.if_then_else(
                        run[m * 8 + 4 + r] == T.float32(NEG), T.float32(0),
                        run[m * 8 + 4 + r]))
                    run[m * 8 + r] = run[m * 8 + 4 + r]
                    run[m * 8 + 2 + r] = run[m * 8 + 2 + r] * run[m * 8 + 6 + r]
                for x in T.unroll(KN * 4):
                    s_acc[m * KN * 4 + x] = T.exp2(s_acc[m * KN * 4 + x] - T.if_then_else(
                        run[m * 8 + x % 4 // 2] == T.float32(NEG), T.float32(0),
                        run[m * 8 + x % 4 // 2]))
                    run[m * 8 + 2 + x % 4 // 2] = (run[m * 8 + 2 + x % 4 // 2]
                                                   + s_acc[m * KN * 4 + x])
                    p_frag[m * KN * 4 + x] = T.Cast(DT, s_acc[m * KN * 4 + x])
                for x in T.unroll(DN * 4):
                    o_acc[m * DN * 4 + x] = o_acc[m * DN * 4 + x] * run[m * 8 + 6 + x % 4 // 2]
            # 5. O += P V: the score registers are P's A fragments; V via ldmatrix.trans,
            # each fragment used by every row tile of the warp
            for kc in T.unroll(KC):
                for nn in T.unroll(DN // 2):
                    T.ptx_legacy.ldmatrix(True, 4, ".b16", kv_frag.data, 0,
                                          smem(v_sh, BLOCK_K),
                                          (kc * FRAG + tx // 8 % 2 * 8 + tx % 8) * LDH
                                          + nn * 16 + tx // 16 * 8, dtype=DT)
                    for m in T.unroll(MT):
                        mma_pair(p_frag, m * KN * 4 + kc * 8, kv_frag, o_acc,
                                 m * DN * 4 + nn * 8)
        # 6. the quad's partial sums, o / l staged in Q's shared block, 16-byte stores
        for r in T.unroll(MT * 2):
            run[r // 2 * 8 + 2 + r % 2] = T.cuda.warp_sum(run[r // 2 * 8 + 2 + r % 2], 4)
        T.tvm_storage_sync("shared")
        for m in T.unroll(MT):
            for x in T.unroll(DN * 4):
                if nan_to_zero:
                    q_sh[(ty * WROWS + m * FRAG + tx // 4 + x % 4 // 2 * 8) * LDH + x // 4 * 8
                         + tx % 4 * 2 + x % 2] = T.Cast(DT, T.if_then_else(
                             T.isnan(o_acc[m * DN * 4 + x] / run[m * 8 + 2 + x % 4 // 2]),
                             T.float32(0),
                             o_acc[m * DN * 4 + x] / run[m * 8 + 2 + x % 4 // 2]))
                else:
                    q_sh[(ty * WROWS + m * FRAG + tx // 4 + x % 4 // 2 * 8) * LDH + x // 4 * 8
                         + tx % 4 * 2 + x % 2] = T.Cast(
                             DT, o_acc[m * DN * 4 + x] / run[m * 8 + 2 + x % 4 // 2])
        T.tvm_storage_sync("shared")
        for it in T.serial((Q_VECS + THREADS - 1) // THREADS):
            if it * THREADS + tid < Q_VECS:
                if q0 + (it * THREADS + tid) // ROW_VECS < SEQ:
                    for l in T.vectorized(VEC):
                        of[o_off + b * ob + h * oh + (q0 + (it * THREADS + tid) // ROW_VECS)
                           * os_ + (it * THREADS + tid) % ROW_VECS * VEC + l] = q_sh[
                               (it * THREADS + tid) // ROW_VECS * LDH
                               + (it * THREADS + tid) % ROW_VECS * VEC + l]

    return kernel_signature(T, body, "mma_attention", q, k, v, out, mask, DT)

"""amp's CUDA schedule for GEMMs with few rows (M <= 16): classifier heads, small-batch dense
layers, low-batch decoding.

Such a GEMM is a weight stream, not a compute problem: ResNet-50's batch-8 classifier reads a
2048x1000 fp16 weight (4 MB, ~1 us at HBM speed) for 33 MFLOP. Tensor-core tiles need M >= 32
(``tensorcore.MIN_EXTENT``), dlight's ``GEMV``/``LowBatchGEMV`` rules decline M=8 NT matmuls, and
dlight's SIMT ``Matmul`` rule pads M to 32 and launches 16 CTAs that each walk all of K: the
H200 profile (docs/benchmarks.md) had this one kernel at ~0.12 ms, the largest of resnet50.

This rule schedules the normalized ``C[S, I, J] += A[S, I, K] * B[S, J, K]`` (dlight's analysis,
as ``tc_gemm``) as a split-K-across-lanes GEMV over all M rows at once:

- a warp owns ``cols`` output columns; its 32 lanes split K, each lane loading ``vec``
  contiguous elements (16 bytes) of every row of A and of each of its columns of B per step,
  so each weight byte is read once, coalesced, and reused for all M rows in registers;
- each lane keeps M x ``cols`` fp32 partial sums (``rfactor``); one cross-lane reduction per
  output (TVM lowers a reduction bound to threadIdx.x to warp shuffles) finishes them;
- the epilogue (cast, bias, activation, residual) runs on the reduced values in shared
  memory, one output per lane.

The result does not depend on how K is split beyond fp32 summation order.
"""
from __future__ import annotations

from dataclasses import dataclass

from .... import tvm_compat
from ....hardware import sm_count
from .tc_gemm import contiguous_vec, normalize_gemm

MAX_M = 16          # rows handled at once (each lane holds MAX_M x cols accumulators)
WARP = 32
LOAD_BYTES = 16     # per lane per K step: one 128-bit load per row
MAX_UNROLL_K = 16   # K steps unrolled (so loads of several steps are in flight at once)


@dataclass(frozen=True)
class SmallConfig:
    warps: int = 4                # warps per CTA, one column group each
    cols: int | None = None       # columns per warp (None: :func:`cols_per_warp`)
    unroll_k: bool = True         # unroll the per-lane K loop when it has <= MAX_UNROLL_K steps

    def name(self) -> str:
        return f"w{self.warps}_c{self.cols or 'auto'}{'_u' if self.unroll_k else ''}"


def applies(batch, sizes) -> bool:
    """Static GEMMs with 2..MAX_M rows and enough work along N and K to be worth a kernel of
    their own (M=1 is a plain GEMV: dlight's GEMV rule serves it)."""
    if batch is None or any(s is None for s in sizes):
        return False
    m, n, k = sizes
    return 2 <= m <= MAX_M and n >= 4 and k >= WARP


def cols_per_warp(m: int, n: int, sm_count: int, warps: int = 4) -> int:
    """Columns per warp: more reuse of A's registers per weight load, but fewer CTAs. Keep at
    least about two CTAs per SM so the weight stream has enough loads in flight."""
    cols = 4
    while cols > 1 and (n + warps * cols - 1) // (warps * cols) < 2 * sm_count:
        cols //= 2
    # M x cols fp32 accumulators plus M x vec A elements per lane: keep it within registers
    while cols > 1 and m * cols > 32:
        cols //= 2
    return cols


def schedule_small_m(func, batch: int, sizes, sm: int, cfg: SmallConfig | None = None):
    """amp's schedule for a static GEMM ``batch x [M, N, K]`` with ``applies(...)``, or None when
    the operands are not contiguous along K (the vector loads need it)."""
    tvm = tvm_compat.tvm()
    get_root_block = tvm_compat.dlight_analysis().get_root_block
    dm = tvm_compat.dlight_matmul()


    if not applies(batch, sizes):
        return None
    m, n, k = sizes
    sch = tvm.s_tir.Schedule(func)
    blocks = sch.get_child_blocks(get_root_block(sch))
    reductions = dm.get_reduction_blocks(sch, blocks)
    if reductions is None or len(reductions) != 1:
        return None
    main = reductions[0]
    in_dtype, _ = dm.get_in_out_dtypes(sch.get(main))
    vec = max(1, LOAD_BYTES // (tvm.runtime.DataType(str(in_dtype)).bits // 8))
    while vec > 1 and k % (WARP * vec):
        vec //= 2
    if vec < 2 and k % WARP:
        return None

    # 1. normalize to C[S, I, J] += A[S, I, K] * B[S, J, K]; the operand copies inline away
    reindex_c = normalize_gemm(sch, main)
    if reindex_c is None:
        return None
    dm.auto_inline_producers(sch, main)

    cfg = cfg or SmallConfig()
    cols = cfg.cols or cols_per_warp(m, n, sm_count(sm), cfg.warps)
    s, i, j, kk = sch.get_loops(main)
    bx, ty, jc = sch.split(j, [None, cfg.warps, cols])
    ko, tx, kv = sch.split(kk, [None, WARP, vec])
    sch.reorder(s, bx, ty, tx, ko, jc, i, kv)
    sch.bind(s, "blockIdx.y")
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")

    # 2. per-lane partial sums over (ko, kv); the lanes' partials then reduced across tx
    rf = sch.rfactor(tx, 0)
    sch.set_scope(rf, 0, "local")
    # the rf block's innermost iteration is the lane's vector along K: every global operand
    # must be contiguous along it (a [K, N] weight is not: its 16-byte loads would gather)
    if contiguous_vec(sch.get(rf), vec) < vec:
        return None
    sch.bind(sch.get_loops(rf)[3], "threadIdx.x")
    ko = sch.get_loops(rf)[4]
    for operand in (0, 1):
        cache = sch.cache_read(rf, operand, "local")
        sch.compute_at(cache, ko, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(cache)[-1])
    sch.unroll(sch.get_loops(rf)[-1])
    sch.unroll(sch.get_loops(rf)[-2])
    sch.unroll(sch.get_loops(rf)[-3])
    sch.decompose_reduction(rf, ko)
    if cfg.unroll_k and k // (WARP * vec) <= MAX_UNROLL_K:
        sch.unroll(ko)

    # 3. cross-lane reduction, one per output of the warp's M x cols tile
    # (rfactor gave the rf block a copy of the loop nest; the original block keeps the old one)
    rf_ty = sch.get_loops(rf)[2]
    sch.reverse_compute_at(main, rf_ty, preserve_unit_loops=True)
    red_tx = sch.get_loops(main)[3]
    sch.reorder(*sch.get_loops(main)[4:], red_tx)
    sch.bind(red_tx, "threadIdx.x")
    sch.set_scope(main, 0, "shared")

    # 4. epilogue: one output per lane, read from shared memory
    dm.auto_inline_consumer_chain(sch, reindex_c)
    sch.reverse_compute_at(reindex_c, rf_ty, preserve_unit_loops=True)
    fused = sch.fuse(*sch.get_loops(reindex_c)[3:])
    _, lane = sch.split(fused, [None, WARP])
    sch.bind(lane, "threadIdx.x")
    return sch

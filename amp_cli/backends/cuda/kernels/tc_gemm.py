"""amp's tensor-core GEMM schedule for CUDA (wmma fragments, cp.async multi-stage pipeline).

Why not dlight's ``MatmulTensorization``: its one fixed configuration (128x128x64 block tile,
16 warps of 32x32 each, register-staged double buffer) measured 39-79 TFLOP/s on the H200 for
BERT-large's GEMMs (docs/gpu-performance.md). Two things cost most:

- *waves*: a 1024x1024 output is 64 tiles of 128x128 on a 132-SM GPU, so half the SMs idle;
- *per-warp reuse*: a 32x32 warp tile loads 4 fragments per 4 MMAs.

This rule schedules the same normalized GEMM ``C[S, I, J] += A[S, I, K] * B[S, J, K]`` (dlight's
analysis does the normalization, so conv-as-GEMM, batched and transposed matmuls all reach it)
with a :class:`TileConfig` chosen per shape by :func:`choose_config` (the largest tile whose grid
fills the GPU), loads global->shared with ``cp.async`` in a ``stages``-deep software pipeline
(``software_pipeline_async_stages``; the TIR pipeline turns on ``tirx.use_async_copy``), prefetches
fragments one k-step ahead, and keeps the epilogue (bias, activation, cast, residual add) fused
into the shared->global store. Tuning (``amp tune``) can still replace it per kernel.

All schedule primitives used are TVM's; the TVM-version-specific imports go through tvm_compat.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .... import tvm_compat
from ....hardware import sm_count, smem_limit
from .intrinsics import register_bf16_wmma

FRAG = 16  # wmma m16n16k16
WARP = 32
# fp32 staging tile row padding (floats). Unpadded rows of BN floats put a warp's accumulator
# stores 4-way on the same banks; 8 floats make them conflict-free (H200 sweep 2026-12-03:
# 1-4% faster on every BERT-large GEMM, docs/gpu-performance.md).
ACC_PAD = 8

@dataclass(frozen=True)
class TileConfig:
    warps_m: int = 2    # warps along M
    warps_n: int = 4    # warps along N
    frags_m: int = 4    # 16x16 fragments per warp along M
    frags_n: int = 2    # ... along N
    k_frags: int = 2    # 16-wide K fragments per pipeline step (BK = 16 * k_frags)
    stages: int = 3     # shared-memory pipeline depth (cp.async); 1 = no pipelining

    @property
    def bm(self) -> int:
        return FRAG * self.warps_m * self.frags_m

    @property
    def bn(self) -> int:
        return FRAG * self.warps_n * self.frags_n

    @property
    def bk(self) -> int:
        return FRAG * self.k_frags

    @property
    def warps(self) -> int:
        return self.warps_m * self.warps_n

    def shared_bytes(self, in_bytes: int = 2, acc_bytes: int = 4) -> int:
        """Upper bound of dynamic shared memory (A/B stages + the accumulator staging tile; TVM
        reuses the stages' memory for the tile, so the real need is usually the larger one)."""
        ab = self.stages * (self.bm + self.bn) * (self.bk + 8) * in_bytes
        acc = self.bm * (self.bn + ACC_PAD) * acc_bytes
        return ab + acc

    def name(self) -> str:
        return (f"{self.bm}x{self.bn}x{self.bk}_w{self.warps_m}x{self.warps_n}"
                f"_s{self.stages}")


# Candidates the default heuristic picks from, largest CTA tile first. 128x128 tiles with 8 warps
# of 64x32 (2x4) measured slowest on every H200 shape of the sweep (docs/gpu-performance.md), so
# the 128x128 tile uses 4 warps of 64x64 and a 4-deep pipeline (its best depth in the sweep).
CANDIDATES = (
    TileConfig(2, 2, 4, 4, 2, 4),   # 128x128x32, 4 warps of 64x64
    TileConfig(2, 2, 4, 2, 2, 3),   # 128x64x32, 4 warps of 64x32
    TileConfig(2, 2, 2, 4, 2, 3),   # 64x128x32, 4 warps of 32x64
    TileConfig(2, 2, 2, 2, 4, 3),   # 64x64x64, 4 warps of 32x32
)
# With ``cuda.narrow_gemm`` (on by default since its H100 A/B of 2026-12-07), GEMMs with N <= 32 (convs
# with 16 or 32 output channels over a large image: a detector's first stages) take a tile as
# narrow as N instead of padding N to 64/128: the same 128 rows per
# CTA (4 warps of 32 rows), 1 or 2 fragments across. Such GEMMs are memory-bound; the wide
# tiles spent 2-8x the tensor-core work and shared memory on padding, and before these tiles
# N = 16 fell to dlight's SIMT rule (yolo_head at 640 px: 0.155 ms for a 3x3 conv 16 -> 16 over
# 8 x 160 x 160 pixels, ~35x its memory time, on the H100 of 2026-12-07).
NARROW = (
    TileConfig(4, 1, 2, 1, 2, 3),   # 128x16x32
    TileConfig(4, 1, 2, 2, 2, 3),   # 128x32x32
)
# A tile is big enough to use when its grid fills this share of the SMs (one near-full wave).
FULL_WAVE = 0.9
# With ``cuda.padding_aware_tiles``: a tile whose grid covers more than this many times the
# output the least-padded candidate covers is not chosen (its CTAs multiply that much padding).
# A batched GEMM of ResNet-50's last stage over a symbolic batch (each image 7 x 7 = 49 rows)
# took 128-row tiles, 38 % of their rows the image's, where 64-row tiles use 77 %; an N = 64
# conv took 128-wide tiles, half their columns padding.
PAD_SLACK = 1.25


def fitting(sm: int, in_bytes: int = 2, acc_bytes: int = 4) -> tuple:
    """The candidates whose shared memory (without any reuse) fits a block on ``sm``."""
    return tuple(c for c in CANDIDATES if c.shared_bytes(in_bytes, acc_bytes) <= smem_limit(sm))


def ctas(cfg: TileConfig, batch: int, m: int, n: int) -> int:
    return batch * math.ceil(m / cfg.bm) * math.ceil(n / cfg.bn)


def padded(cfg: TileConfig, m: int | None, n: int) -> int:
    """The output elements ``cfg``'s grid covers per batch entry (``m`` None: columns only)."""
    rows = 1 if m is None else math.ceil(m / cfg.bm) * cfg.bm
    return rows * math.ceil(n / cfg.bn) * cfg.bn


def unpadded(options, m: int | None, n: int, slack: float | None) -> tuple:
    """``options`` without the tiles that cover more than ``slack`` times the output the
    least-padded one covers (``m`` None: judged on the columns alone); None: all of them."""
    if slack is None:
        return tuple(options)
    least = min(padded(c, m, n) for c in options)
    return tuple(c for c in options if padded(c, m, n) <= slack * least)


def choose_config(batch: int, m: int, n: int, k: int, sm: int,
                  acc_bytes: int = 4, narrow: bool = False, pad_slack: float | None = None,
                  pad_rows: bool = True) -> TileConfig | None:
    """Default tile for a GEMM: the largest candidate whose grid still fills the GPU (at least
    ``FULL_WAVE`` x SM count CTAs), else the one with the most CTAs; the pipeline is never deeper
    than the K loop. Calibrated on the H200 sweep (benchmarks/gemm_sweep.py): it picks the best or
    second-best (within 7%) tile on all 8 BERT-large / ResNet-50 shapes measured. ``pad_slack``
    (:data:`PAD_SLACK`, ``cuda.padding_aware_tiles``): only among the candidates that pad the
    output at most that much more than the least-padded one; ``pad_rows`` off, padding is
    judged on the columns alone (an M that varies, :func:`tile_variants`). None when no
    candidate fits the arch's shared memory."""
    sms = sm_count(sm)
    options = fitting(sm, 2, acc_bytes)
    if not options:
        return None
    options = unpadded(options, m if pad_rows else None, n, pad_slack)
    thin = next((c for c in NARROW if c.bn >= n), None) if narrow else None
    if thin is not None:
        cfg = thin  # N <= 32: the narrowest tile that covers it (see NARROW)
    else:
        cfg = next((c for c in options if ctas(c, batch, m, n) >= FULL_WAVE * sms), None)
    if cfg is None:
        cfg = max(options, key=lambda c: ctas(c, batch, m, n))
    cfg = deepen(cfg, k, sm, acc_bytes)
    k_steps = math.ceil(k / cfg.bk)
    if cfg.stages > k_steps:
        cfg = dataclasses.replace(cfg, stages=max(1, k_steps))
    return cfg


def tile_variants(sizes_at, lo: int, hi: int, n: int, k: int, sm: int,
                  acc_bytes: int = 4, pad_slack: float | None = None
                  ) -> list[tuple[int, TileConfig]]:
    """The tiles :func:`choose_config` picks for a GEMM whose row count or batch is symbolic,
    over its whole range: [(first value, tile), ...] ascending, one entry per run of values
    with the same tile. ``sizes_at(v)`` = (batch, M) when the symbolic size is ``v`` (in
    ``lo..hi``). Once the largest tile's grid fills the GPU (monotone in ``v``: found by
    bisection) the choice no longer changes; below that every value is evaluated."""
    options = fitting(sm, 2, acc_bytes)
    if not options or lo > hi:
        return []
    # rows' padding counts only where the rows are the same at every value (a symbolic batch
    # of static-M GEMMs): over a symbolic M it would switch tiles every few rows
    static_m = sizes_at(lo)[1] == sizes_at(hi)[1]
    options = unpadded(options, sizes_at(lo)[1] if static_m else None, n, pad_slack)
    wave = FULL_WAVE * sm_count(sm)

    def fills(v):
        batch, m = sizes_at(v)
        return ctas(options[0], batch, m, n) >= wave

    end = hi
    if fills(hi):
        a, b = lo - 1, hi  # the first value that fills is in (a, b]
        while b - a > 1:
            mid = (a + b) // 2
            a, b = (a, mid) if fills(mid) else (mid, b)
        end = b
    variants = []
    for v in range(lo, end + 1):
        cfg = choose_config(*sizes_at(v), n, k, sm, acc_bytes, pad_slack=pad_slack,
                            pad_rows=static_m)
        if cfg is not None and (not variants or variants[-1][1] != cfg):
            variants.append((v, cfg))
    return variants


def dispatch(funcs, size, starts: list[int]):
    """One PrimFunc running ``funcs[i]`` (schedules of one GEMM, same parameters) when the
    symbolic ``size`` is at least ``starts[i]`` and below ``starts[i+1]``: a host-side branch
    around their kernels. The condition is marked thread-invariant (``tvm_thread_invariant``):
    TVM's barrier planner refuses to place a kernel's barriers under any other condition."""
    T = tvm_compat.tirx()
    body = funcs[0].body
    for func, start in zip(funcs[1:], starts[1:]):
        cond = T.call_intrin("bool", "tirx.tvm_thread_invariant",
                             size >= T.const(start, str(size.ty)))
        body = T.IfThenElse(cond, func.body, body)
    return funcs[0].with_body(body)


# K step 64 instead of 32 (three stages instead of four) for long K loops: half the barriers and
# address arithmetic per MMA and conflict-free cp.async writes (docs/gpu-performance.md). The
# H200 sweep of 2026-12-03 measured it faster on the 128x64 tile at K=1024 (15.0 -> 12.6 us on
# 1024x1024x1024) and on the 128x128 tile at K=2048 (split-K partials of BERT-large's FFN-down:
# 39.2 -> 34.5 us), but slower on the 128x128 tile at K=1024 (QKV: 28.2 -> 29.3 us).
DEEP_K_MIN = {(128, 64): 1024, (128, 128): 2048}  # (BM, BN) -> smallest K that gets BK=64


def deepen(cfg: TileConfig, k: int, sm: int, acc_bytes: int = 4) -> TileConfig:
    """``cfg`` with a 64-deep K step where :data:`DEEP_K_MIN` says it pays, if it still fits."""
    floor = DEEP_K_MIN.get((cfg.bm, cfg.bn))
    if floor is None or k < floor or cfg.k_frags != 2:
        return cfg
    deep = dataclasses.replace(cfg, k_frags=4, stages=3)
    return deep if deep.shared_bytes(2, acc_bytes) <= smem_limit(sm) else cfg


# Split-K: a GEMM whose output is too small for the largest tile to fill the GPU runs as S
# partial GEMMs over K/S each (S x the CTAs of that tile) plus an elementwise sum of the fp32
# partials. Worth it only when K is long: the partials cost 2 x S x M x N x 4 bytes of traffic.
SPLIT_K_FACTORS = (2, 4)
MIN_SPLIT_K = 1024  # K per split, at least


def split_k_factor(batch: int, m: int, n: int, k: int, sm: int) -> int:
    """How many K splits (1 = none) let the largest tile fill the GPU: the smallest factor in
    ``SPLIT_K_FACTORS`` for which ``CANDIDATES[0]`` gets >= ``FULL_WAVE`` x SMs CTAs, keeping
    K/S >= ``MIN_SPLIT_K`` and a multiple of that tile's K step. Rationale (H200 sweep,
    docs/gpu-performance.md): the 128x128 tile reached 273 TFLOP/s where its grid filled the GPU
    and the tiles that fill a 1024x1024 output 137-147; the partials of a 1024x1024 output are
    8 MB each, L2-resident on Hopper."""
    big = CANDIDATES[0]
    if big not in fitting(sm):
        return 1
    wave = FULL_WAVE * sm_count(sm)
    if ctas(big, batch, m, n) >= wave:
        return 1
    for factor in SPLIT_K_FACTORS:
        part = k // factor
        if k % factor or part < MIN_SPLIT_K or part % big.bk:
            break
        if ctas(big, batch * factor, m, n) >= wave:
            return factor
    return 1


def _intrinsics(in_dtype: str, acc_dtype: str) -> dict | None:
    tc = tvm_compat.cuda_tensor_intrin()


    if in_dtype == "float16" and acc_dtype in ("float16", "float32"):
        return tc.get_wmma_intrin_group(load_scope="shared.dyn", store_scope="shared.dyn",
                                        in_dtype="float16", out_dtype=acc_dtype, trans_b=True)
    if in_dtype == "bfloat16" and acc_dtype == "float32":
        return register_bf16_wmma()
    return None


def _widest(extent: int, widest: int) -> int:
    """The widest vector (<= widest lanes, a power of two) whose rows stay aligned: rows of
    ``extent`` elements start at multiples of the vector only if the vector divides extent."""
    lanes = widest
    while lanes > 1 and extent % lanes:
        lanes //= 2
    return lanes


def contiguous_vec(block, widest: int) -> int:
    """The widest vector (a power of two <= ``widest``) along ``block``'s innermost iteration
    variable ``v`` that keeps every global access of the block one aligned, contiguous vector.
    With ``v = chunk * lanes + lane`` (``lane < lanes``), each access must move by exactly
    ``lane`` in its buffer's last axis and not at all in the others, start at a multiple of
    ``lanes``, and the last axis' extent must be a multiple of ``lanes`` (rows start aligned);
    every ``if_then_else`` condition (padding predicates) must not depend on ``lane``, so that
    one predicated copy serves the vector. This covers plain ``A[i, k]`` rows and gathers such
    as an implicit GEMM's ``x[n, h(k), w(k), k % C]`` (``C`` a multiple of ``lanes``); it is 1
    when some access is strided along ``v`` (a ``B[K, N]`` operand copied into a [N, K] tile).
    Shared/local buffers are amp's own, aligned tiles."""
    tvm = tvm_compat.tvm()
    T = tvm_compat.tirx()
    inner_iv = block.iter_vars[-1]
    inner = inner_iv.var
    accesses, conds = [], []  # (buffer, indices); predicate expressions

    def on_load(load, mutator):
        accesses.append((load.source, list(load.indices)))
        return mutator.default_mutate(load)

    def on_store(store, mutator):
        accesses.append((store.buffer, list(store.indices)))
        return mutator.default_mutate(store)

    def on_call(call, mutator):
        if str(getattr(call.op, "name", "")).endswith("if_then_else"):
            conds.append(call.args[0])
        return mutator.default_mutate(call)

    tvm_compat.structural_mutate(block.body, [(tvm_compat.buffer_load_class(), on_load),
                                              (T.BufferStore, on_store), (tvm.ir.Call, on_call)])
    global_accesses = [(b, ix) for b, ix in accesses if str(b.scope()) == "global"]
    extent = inner_iv.dom.extent
    extent = int(extent.value) if hasattr(extent, "value") else None

    def aligned(lanes: int) -> bool:
        if extent is None or extent % lanes:
            return False
        dtype = str(inner.ty.dtype)  # int64 in large kernels
        chunk, lane = T.Var("amp_chunk", dtype), T.Var("amp_lane", dtype)
        at_lane, at_zero = tvm_compat.analyzer(), tvm_compat.analyzer()
        for ana, value in ((at_lane, chunk * lanes + lane), (at_zero, chunk * lanes)):
            for iv in block.iter_vars[:-1]:
                ana.bind(iv.var, iv.dom)
            ana.bind(chunk, tvm.ir.Range.from_min_extent(T.const(0, dtype),
                                                         T.const(extent // lanes, dtype)))
            ana.bind(lane, tvm.ir.Range.from_min_extent(T.const(0, dtype), T.const(lanes, dtype)))
            ana.bind(inner, value)
        for buf, indices in global_accesses:
            moved = [at_lane.simplify(ix) for ix in indices]
            start = [at_zero.simplify(ix) for ix in indices]
            if not all(at_lane.can_prove_equal(m, s) for m, s in zip(moved[:-1], start[:-1])):
                return False
            if not at_lane.can_prove_equal(moved[-1] - start[-1], lane):
                return False
            mod = at_zero.modular_set(start[-1])
            last = buf.shape[-1]
            last = int(last.value) if hasattr(last, "value") else 1
            if last % lanes or mod.coeff % lanes or mod.base % lanes:
                return False
        return all(at_lane.can_prove(T.EQ(at_lane.simplify(c), at_zero.simplify(c)))
                   for c in conds)

    lanes = widest
    while lanes > 1 and not aligned(lanes):
        lanes //= 2
    return lanes


def normalize_gemm(sch, main):
    """Bring the GEMM block ``main`` to ``C[S, I, J] += A[S, I, K] * B[S, J, K]`` (dlight's
    index maps; operands and output go through reindex copies). Returns the output's reindex
    block, or None when dlight's analysis cannot map the block."""
    dm = tvm_compat.dlight_matmul()

    reindex_a = sch.reindex(main, ("read", 0))
    reindex_b = sch.reindex(main, ("read", 1))
    reindex_c = sch.reindex(main, ("write", 0))
    maps = dm.get_index_map(sch.get(main))
    if maps is None:
        return None
    matmul_map, a_map, b_map, c_map = maps
    sch.transform_layout(reindex_a, ("write", 0), a_map)
    sch.transform_layout(reindex_b, ("write", 0), b_map)
    sch.transform_layout(reindex_c, ("read", 0), c_map)
    sch.transform_block_layout(main, matmul_map)
    return reindex_c


def schedule_gemm(func, in_dtype: str, acc_dtype: str, batch: int, sizes, sm: int,
                  cfg: TileConfig | None = None, rows="same", narrow: bool = False,
                  pad_slack: float | None = None):
    """amp's schedule for a GEMM ``batch x [M, N, K]`` (``tensorcore.gemm_shape``), or None where
    it does not apply (no fitting tile, rows too misaligned for cp.async). ``sizes`` are the
    extents the tile is chosen for; ``rows``: the real M when that differs (None: symbolic, M is
    padded to whole tiles at run time); ``narrow``: N <= 32 may take a ``NARROW`` tile;
    ``pad_slack``: :func:`choose_config`'s."""
    m, n, k = sizes
    acc_bytes = 2 if acc_dtype == "float16" else 4
    cfg = cfg or choose_config(batch, m, n, k, sm, acc_bytes, narrow, pad_slack,
                               pad_rows=rows is not None)
    if cfg is None:
        return None
    # cp.async copies 4, 8 or 16 bytes: 2+ fp16 lanes per copy, from K-contiguous rows
    load_vec = _widest(k, 8)
    if load_vec < 2:
        return None
    real = list(sizes) if rows == "same" else [rows, n, k]
    return schedule(func, in_dtype, acc_dtype, real, sm, cfg, load_vec=load_vec,
                    store_vec=_widest(n, 4))


def schedule(func, in_dtype: str, acc_dtype: str, sizes, sm: int, cfg: TileConfig | None = None,
             load_vec: int = 8, store_vec: int = 4, require_contiguous: bool = True):
    """A tensor-core schedule of a matmul-like PrimFunc, or None where this rule does not apply.
    ``sizes`` = [M, N, K] static extents (None for dynamic) as ``tensorcore.gemm_extents`` gives;
    ``load_vec``/``store_vec``: lanes of the global loads and of the epilogue's stores (at most;
    narrowed to what :func:`contiguous_vec` allows). ``require_contiguous=False`` vectorizes a
    strided operand copy anyway (only tests use it: it reproduces TVM's strided cp.async)."""
    tvm = tvm_compat.tvm()
    get_root_block = tvm_compat.dlight_analysis().get_root_block
    dm = tvm_compat.dlight_matmul()

    intrin = _intrinsics(in_dtype, acc_dtype)
    if intrin is None:
        return None
    m, n, k = [s if s is not None else 1024 for s in sizes]
    cfg = cfg or choose_config(1, m, n, k, sm)
    if cfg is None:
        return None

    sch = tvm.s_tir.Schedule(func)
    blocks = sch.get_child_blocks(get_root_block(sch))
    reductions = dm.get_reduction_blocks(sch, blocks)
    if reductions is None:
        return None
    main = reductions[0]

    # 1. normalize to C[S, I, J] += A[S, I, K] * B[S, J, K] and pad to whole tiles
    if normalize_gemm(sch, main) is None:
        return None
    sch.pad_einsum(main, [1, cfg.bm, cfg.bn, cfg.bk])

    # 2. 16x16x16 fragments, then block / warp / fragment tiling
    batch, i, j, kk = sch.get_loops(main)
    i, i_in = sch.split(i, [None, FRAG])
    j, j_in = sch.split(j, [None, FRAG])
    kk, k_in = sch.split(kk, [None, FRAG])
    sch.reorder(i, j, kk, i_in, j_in, k_in)
    inner = main
    outer = sch.blockize(i_in)

    i0, i1, i2 = sch.split(i, [None, cfg.warps_m, cfg.frags_m])
    j0, j1, j2 = sch.split(j, [None, cfg.warps_n, cfg.frags_n])
    k0, k1 = sch.split(kk, [None, cfg.k_frags])
    sch.reorder(i0, j0, i1, j1, k0, k1, i2, j2)
    sch.bind(batch, "blockIdx.z")
    sch.bind(i0, "blockIdx.y")
    sch.bind(j0, "blockIdx.x")
    warp = sch.fuse(i1, j1)
    sch.bind(warp, "threadIdx.y")

    def to_shared(index: int):
        block = sch.cache_read(outer, index, "shared.dyn")
        sch.compute_at(block, k0)
        return block

    def thread_copy(block, vec: int):
        fused = sch.fuse(*sch.get_loops(block)[-2:])
        _, ty, tx, v = sch.split(fused, [None, cfg.warps, WARP, vec])
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        sch.vectorize(v)
        sch.storage_align(block, 0, axis=-2, factor=16, offset=8)

    a_shared = to_shared(0)
    b_shared = to_shared(1)
    dm.auto_inline_producers(sch, a_shared)
    dm.auto_inline_producers(sch, b_shared)
    # each operand's copy runs along K: a real (and cp.async) vector only if K is contiguous
    vecs = [contiguous_vec(sch.get(b), load_vec) for b in (a_shared, b_shared)]
    if min(vecs) < 2:
        if require_contiguous:
            return None  # e.g. B[K, N] in global memory: dlight's rule gathers it instead
        vecs = [v if v >= 2 else load_vec for v in vecs]
    thread_copy(a_shared, vecs[0])
    thread_copy(b_shared, vecs[1])

    a_frag = sch.cache_read(outer, 0, "wmma.matrix_a")
    b_frag = sch.cache_read(outer, 1, "wmma.matrix_b")
    sch.compute_at(a_frag, k1)
    sch.compute_at(b_frag, k1)

    acc_shared = sch.cache_write(outer, 0, "shared.dyn")
    acc = sch.cache_write(outer, 0, "wmma.accumulator")
    sch.reverse_compute_at(acc, warp)
    sch.reverse_compute_at(acc_shared, warp)
    ai, aj = sch.get_loops(acc)[-2:]
    ai0, ai1 = sch.split(ai, [None, FRAG])
    aj0, aj1 = sch.split(aj, [None, FRAG])
    sch.reorder(ai0, aj0, ai1, aj1)

    init = sch.decompose_reduction(outer, k0)
    init_inner = sch.get_child_blocks(init)[0]

    def tile_16(block):
        li, lj = sch.get_loops(block)[-2:]
        li0, li1 = sch.split(li, [None, FRAG])
        lj0, lj1 = sch.split(lj, [None, FRAG])
        sch.reorder(li0, lj0, li1, lj1)
        sch.unroll(li0)
        sch.unroll(lj0)
        return li1

    try:
        sch.tensorize(tile_16(a_frag), intrin["load_a"])
        sch.tensorize(tile_16(b_frag), intrin["load_b"])
        sch.tensorize(sch.get_loops(init_inner)[-2], intrin["init"])
        store = sch.blockize(sch.get_loops(acc)[-2])
        sch.tensorize(store, intrin["store"])
        # rows of the fp32 staging tile padded by ACC_PAD floats (the block that *writes* the
        # tile carries the alignment): wmma's accumulator stores become bank-conflict-free
        sch.storage_align(store, 0, -2, 32, ACC_PAD)
        sch.tensorize(sch.get_loops(inner)[-3], intrin["compute"])
    except Exception:  # noqa: BLE001 - the block does not match the intrinsic: not ours
        return None

    # 3. epilogue (casts, bias, activation, residual) fused into the shared->global store
    dm.auto_inline_consumer_chain(sch, acc_shared)
    store_vec = contiguous_vec(sch.get(acc_shared), store_vec)
    fused = sch.fuse(*sch.get_loops(acc_shared)[-2:])
    _, tx, v = sch.split(fused, [None, WARP, store_vec])
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(v)

    # 4. pipelines: cp.async global->shared `stages` deep; fragments one k-step ahead
    # (InjectSoftwarePipeline expands the inner k1 pipeline first, so k0's body is then five
    # statements: A copy, B copy, k1 prologue, k1 body, k1 epilogue.)
    sch.annotate(k1, "software_pipeline_stage", [0, 0, 1])
    sch.annotate(k1, "software_pipeline_order", [0, 1, 2])
    if cfg.stages > 1:
        last = cfg.stages - 1
        sch.annotate(k0, "software_pipeline_stage", [0, 0, last, last, last])
        sch.annotate(k0, "software_pipeline_order", [0, 1, 2, 3, 4])
        sch.annotate(k0, "software_pipeline_async_stages", [0])
    return sch

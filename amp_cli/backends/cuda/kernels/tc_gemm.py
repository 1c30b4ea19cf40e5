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

from .... import tvm_compat
from .intrinsics import register_bf16_wmma
# the tile choice (tc_tiles.py); the names its callers reach through this module re-exported
from .tc_tiles import (ACC_PAD, CANDIDATES, FRAG, NARROW, PAD_SLACK, WARP,  # noqa: F401
                       TileConfig, choose_config, fitting, padded, split_k_factor,
                       tile_variants)


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

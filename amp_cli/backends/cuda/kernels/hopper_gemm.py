"""Hopper GEMMs: wgmma + TMA kernels written in TVM's TIRx, with the fused epilogue transplanted.

amp's other GEMM schedules (tc_gemm, dlight) reach the tensor cores through ``wmma``, which on
sm_90 runs at a fraction of the H200's rate (171-291 TFLOP/s per bert-large GEMM). Hopper's own
path -- ``wgmma.mma_async`` reading both operands from shared memory, fed by TMA bulk copies and
mbarriers -- cannot be reached through s_tir schedules in TVM 0.27, but TVM 0.27 also ships TIRx
(``tvm.script.tirx``, ``tir_pipeline="tirx"``), whose ``T.ptx`` namespace emits those
instructions. This module writes one such kernel per GEMM:

- a 128 x BN output tile per CTA, K in 64-deep steps (128-byte rows, TMA's 128B swizzle, which
  wgmma's K-major descriptors read back), ``stages`` shared-memory stages;
- warp-specialized: warps 0-7 are two consumer warpgroups (64 rows each, ``m64nBNk16``,
  fp32 accumulators in registers, the K loop unrolled), warp 8 is the producer: one thread waits
  for a free stage (``empty`` mbarrier, one arrival per consumer warp after its
  ``wgmma.wait_group 1``), arms the ``full`` mbarrier with the stage's byte count and issues two
  TMA copies;
- the epilogue runs on the accumulators in registers: the fused PrimFunc's elementwise tail (bias,
  GELU, residual add, casts: whatever FuseOps put there) is inlined into one expression of the
  matmul value and transplanted, element by element, then stored two columns at a time.

Which GEMMs (``hopper_match.match_gemm``): a fused PrimFunc whose first block is an NT matmul
(A [..., K] with K contiguous, B [N, K], fp16/bf16, fp32 or same-type accumulation;
``matmul_nt`` produces these) followed only by spatial blocks that end in one output of the
matmul's shape. Sizes (``hopper_plan.plan``): N a multiple of 64, K a multiple of 64 in
``cuda.hopper_min_k``..``MAX_K``, M >= 128; with ``cuda.hopper_symbolic_m`` also symbolic M
(every M >= 1, guarded: the optimum's plan, and with ``cuda.hopper_m_variants`` a kernel per
narrower plan below the optimum behind a host branch on M, ``plan_variants``). Everything
else keeps amp's other
schedules. Needs sm_90 and compiles for ``sm_90a`` (``build_target``).

The kernels carry ``amp.tirx`` and go through TVM's TIRx lowering (``legalize.pipeline`` routes
them); ``tirx.is_scheduled`` keeps dlight off them.

Status (H200; docs/gpu-performance.md, "Hopper GEMMs"): on by default (``cuda.hopper_gemm``).
An early version lost accuracy on K=4096 (a rolled K loop with a wgmma group in flight across its
back-edge); with the consumer's K loop unrolled in TIR, bert-large's four GEMM kernels match
dlight's output exactly and bert-large fp16 runs in 1.91 ms (rel L2 1.29e-3 vs ORT fp32; 3.21 ms
with amp's wmma GEMMs; torch.compile reduce-overhead 2.23 ms in the same run). Two opt-in
layouts overlap the epilogue with tensor-core work (docs/gpu-performance.md, "The Hopper
GEMM's epilogue is exposed"; not yet timed): ``cuda.hopper_two_per_sm`` (``plan``'s
``per_sm=2``) and ``cuda.hopper_persistent`` (``gemm_kernel``'s ``persistent``).
"""
from __future__ import annotations

import math

from .... import tvm_compat
from ....hardware import arch_sm, sm_count
from ....ir_attrs import HOPPER_TILE, IS_SCHEDULED, OP_PATTERN, TIRX_KERNEL
from ....ir_module import replace_functions
from ..registry import register
from .hopper_match import (IN_TYPES, PAIR_TYPES, GemmMatch, dtype_of, extents, match_gemm,
                           same_extents, same_vars, static_extents)
from .hopper_plan import BK, BM, HOPPER_SMS, MIN_K, Plan, plan, symbolic_plans, tile_name
MIN_SM, MAX_SM = 90, 90  # sm_90a instructions (wgmma): Hopper only


def build_target(target, enabled: bool = True):
    """The target to compile with: sm_90 becomes sm_90a (wgmma needs it) when the Hopper GEMMs
    are on; any other target is returned as is."""
    if not enabled or target.kind.name != "cuda" or arch_sm(target) != 90:
        return target
    arch = str(target.attrs.get("arch", ""))
    if arch.endswith("a"):
        return target
    spec = tvm_compat.target_to_dict(target)
    spec["arch"] = arch + "a"
    return tvm_compat.make_target(spec)


def enabled_for(target) -> bool:
    """Whether a pipeline for ``target`` may emit these kernels: CUDA sm_90a, the arch that
    ``build_target`` gives a build with the kernels on (a plain sm_90 target -- tests, tuning,
    other callers compiling for sm_90 -- keeps amp's other GEMM schedules, as its nvcc run
    would reject wgmma)."""
    return (target.kind.name == "cuda" and MIN_SM <= arch_sm(target) <= MAX_SM
            and str(target.attrs.get("arch", "")).endswith("a"))


# ---------------------------------------------------------------------------------------------
# The kernel


def _is_one(e) -> bool:
    return isinstance(e, int) and e == 1


def _epilogue_fn(match: GemmMatch):
    """(f, views): f(acc fp32, row, col) -> the output value, from the inlined epilogue
    expression; the epilogue's other buffers (bias, residual) are read through flat int32-indexed
    views, ``views`` = [(view, parameter)] (TIRx's lowering mis-declares its own flattened
    aliases of int64-shaped parameters read in the device region)."""
    T = tvm_compat.tirx()
    load_cls = tvm_compat.buffer_load_class()
    out_shape = extents(match.out)
    c_dtype, out_dtype = dtype_of(match.c), dtype_of(match.out)
    views = []

    def view_of(param):
        for view, orig in views:
            if orig.same_as(param):
                return view
        view = T.decl_buffer((math.prod(extents(param)),), dtype_of(param), f"{param}_flat",
                             data=param.data)
        views.append((view, param))
        return view

    def flat_index(param, indices):
        flat, stride = None, 1
        for ix, extent in reversed(list(zip(indices, extents(param)))):
            term = T.Cast("int32", ix) * stride if not _is_one(stride) else T.Cast("int32", ix)
            flat = term if flat is None else flat + term
            stride = stride * tvm_compat.index32(extent)
        return flat

    def fn(acc, row, col):
        acc_c = acc if c_dtype == "float32" else T.Cast(c_dtype, acc)
        if match.value is None:
            return acc_c if out_dtype == c_dtype else T.Cast(out_dtype, acc_c)
        subst = {}
        rest = row
        lead = list(zip(match.iters[:-1], out_shape[:-1]))
        for pos in range(len(lead) - 1, -1, -1):
            var, extent = lead[pos]
            size = tvm_compat.index32(extent)
            subst[var] = T.Cast(str(var.ty.dtype), rest % size if pos else rest)
            rest = rest // size
        subst[match.iters[-1]] = T.Cast(str(match.iters[-1].ty.dtype), col)

        def on_load(load, mutator):
            if load.source.same_as(match.c):
                return acc_c
            if same_vars(load.indices, match.iters) and \
                    same_extents(extents(load.source), out_shape):
                # a residual of the output's shape: its flat index is the output's, without
                # splitting the row into the leading dims (divisions when they are symbolic)
                return T.BufferLoad(view_of(load.source), [row * out_shape[-1] + col])
            indices = [mutator.mutate(ix) for ix in load.indices]
            return T.BufferLoad(view_of(load.source), [flat_index(load.source, indices)])

        def on_var(var, _mutator):
            for k, v in subst.items():
                if var.same_as(k):
                    return v
            return var

        return tvm_compat.structural_mutate(match.value, [(load_cls, on_load), (T.Var, on_var)])

    return fn, views


def _fence_src(n: int):
    name = f"amp_wgmma_acc_fence_{n}"
    ops = ", ".join(f'"+f"(a[{i}])' for i in range(n))
    return name, (f"__device__ __forceinline__ void {name}(float* a) "
                  f'{{ asm volatile("" : {ops} :: "memory"); }}\n')


def _store_src(dtype: str):
    ctype, pair, make = PAIR_TYPES[dtype]
    name = f"amp_store_pair_{pair}"
    return name, (f"__device__ __forceinline__ void {name}({ctype}* p, {ctype} a, {ctype} b) "
                  f"{{ *({pair}*)p = {make}(a, b); }}\n")


def gemm_kernel(match: GemmMatch, p: Plan, persistent: bool = False, sms: int = HOPPER_SMS,
                per_sm: int = 1):
    """The TIRx PrimFunc (params: A, B, out, in that order, with the original shapes).
    ``persistent`` (``cuda.hopper_persistent``): at most ``sms * per_sm`` CTAs, each walking
    the tiles ``bid, bid + grid, ...``; the producer runs ahead into the next tile's stages
    while the consumers run the epilogue, and the stage ring and its mbarrier phases carry
    across tiles (step ``g = it * KT + kt``). ``per_sm`` > 1: the CTAs an SM the plan is for,
    written into ``__launch_bounds__`` so ptxas keeps each thread's registers within that
    share."""
    T = tvm_compat.tvmscript_tir()

    M, N, K = match.m, match.n, match.k
    BN, S = p.bn, p.stages
    dt = match.in_dtype
    out_dtype = dtype_of(match.out)
    a_shape, b_shape, o_shape = extents(match.a), static_extents(match.b), extents(match.out)
    KT = K // BK
    NACC = BN // 2
    static_m = isinstance(M, int)
    M = tvm_compat.index32(M)  # a symbolic M (int64): the grid and the row guard in int32
    nbm, nbn = (M + (BM - 1)) // BM, N // BN
    tiles = nbm * nbn
    ctas = sms * per_sm  # persistent: as many CTAs as the SMs hold at once
    grid = (min(tiles, ctas) if static_m else T.min(tiles, ctas)) if persistent else tiles
    A_tile, B_tile = BM * BK, BN * BK
    tx_bytes = (A_tile + B_tile) * 2
    # cuTensorMapEncodeTiled: dims (inner, outer), outer stride in bytes, box, element strides,
    # interleave none, swizzle 128B (3), no L2 promotion, zero fill out of bounds
    a_args = [K, M, K * 2, BK, BM, 1, 1, 0, 3, 0, 0]
    b_args = [K, N, K * 2, BK, BN, 1, 1, 0, 3, 0, 0]
    wgmma = f"wgmma.mma_async.sync.aligned.m64n{BN}k16.f32.{IN_TYPES[dt]}.{IN_TYPES[dt]}"
    tma = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
    fence, fence_src = _fence_src(NACC)
    st, st_src = _store_src(out_dtype)
    epi, views = _epilogue_fn(match)
    guard = not static_m or M % BM != 0

    def step(it, kt):
        """The CTA's K step across its tiles (``it``: its tile counter; None: one tile)."""
        return kt if it is None else it * KT + kt

    # fmt: off
    @T.macro
    def produce(it, tile, As, Bs, full, empty, A_map, B_map):
        pm0: T.let = (tile // nbn) * BM
        pn0: T.let = (tile % nbn) * BN
        for kt in T.serial(KT):
            if step(it, kt) >= S:
                T.cuda.mbarrier_wait(empty.ptr_to([step(it, kt) % S]), (step(it, kt) // S + 1) % 2)
            T.ptx.mbarrier.arrive.expect_tx.shared.b64(full.ptr_to([step(it, kt) % S]), T.uint32(tx_bytes))
            T.ptx[tma](As.ptr_to([step(it, kt) % S, 0, 0]), T.address_of(A_map), kt * BK, pm0, full.ptr_to([step(it, kt) % S]))
            T.ptx[tma](Bs.ptr_to([step(it, kt) % S, 0, 0]), T.address_of(B_map), kt * BK, pn0, full.ptr_to([step(it, kt) % S]))

    @T.macro
    def consume(it, tile, As, Bs, full, empty, acc, descA, descB, Of, wg, t):
        m0: T.let = (tile // nbn) * BM
        n0: T.let = (tile % nbn) * BN
        if persistent:
            for i in T.unroll(NACC):
                acc[i] = T.float32(0)
            T.cuda.func_call(fence, acc.ptr_to([0]), source_code=fence_src, return_type="void")
        for kt in T.unroll(KT):  # no loop back-edge while a wgmma group is in flight
            T.cuda.mbarrier_wait(full.ptr_to([step(it, kt) % S]), (step(it, kt) // S) % 2)
            T.cuda.func_call(fence, acc.ptr_to([0]), source_code=fence_src, return_type="void")
            T.ptx.wgmma.fence.sync.aligned()
            for kk in T.unroll(BK // 16):
                T.ptx[wgmma](*[acc[i] for i in range(NACC)],
                             descA + T.uint64(((step(it, kt) % S) * A_tile * 2 + kk * 32) // 16),
                             descB + T.uint64(((step(it, kt) % S) * B_tile * 2 + kk * 32) // 16), True, 1, 1, 0, 0)
            T.ptx.wgmma.commit_group.sync.aligned()
            T.ptx.wgmma.wait_group.sync.aligned(1)
            T.cuda.func_call(fence, acc.ptr_to([0]), source_code=fence_src, return_type="void")
            if kt > 0:
                if t % 32 == 0:
                    T.ptx.mbarrier.arrive.shared.b64(empty.ptr_to([(step(it, kt) - 1) % S]))
        T.ptx.wgmma.wait_group.sync.aligned(0)
        T.cuda.func_call(fence, acc.ptr_to([0]), source_code=fence_src, return_type="void")
        if persistent:  # the tile's last stage goes back to the producer before the epilogue
            if t % 32 == 0:
                T.ptx.mbarrier.arrive.shared.b64(empty.ptr_to([step(it, KT - 1) % S]))
        row: T.let = m0 + wg * 64 + t // 32 * 16 + t % 32 // 4
        for i in T.unroll(BN // 8):
            col: T.let = n0 + i * 8 + t % 4 * 2
            if not guard or row < M:
                T.cuda.func_call(st, Of.ptr_to([row, col]),
                                 T.Cast(out_dtype, epi(acc[i * 4], row, col)),
                                 T.Cast(out_dtype, epi(acc[i * 4 + 1], row, col + 1)),
                                 source_code=st_src, return_type="void")
            if not guard or row + 8 < M:
                T.cuda.func_call(st, Of.ptr_to([row + 8, col]),
                                 T.Cast(out_dtype, epi(acc[i * 4 + 2], row + 8, col)),
                                 T.Cast(out_dtype, epi(acc[i * 4 + 3], row + 8, col + 1)),
                                 source_code=st_src, return_type="void")

    @T.prim_func(check_well_formed=False)
    def main(A_ptr: T.handle, B_ptr: T.handle, O_ptr: T.handle):
        A = T.match_buffer(A_ptr, a_shape, dt, align=16)
        B = T.match_buffer(B_ptr, b_shape, dt, align=16)
        O = T.match_buffer(O_ptr, o_shape, out_dtype, align=16)
        A_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", A_map, dt, 2, A.data, *a_args)
        B_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", B_map, dt, 2, B.data, *b_args)
        T.device_entry()
        if per_sm > 1:
            T.attr({tvm_compat.LAUNCH_MIN_BLOCKS_ATTR: per_sm})
        bid = T.cta_id([grid])
        tid = T.thread_id([288])
        Of = T.decl_buffer((M, N), out_dtype, data=O.data)
        arena = T.alloc_buffer((S * (A_tile + B_tile),), dt, scope="shared.dyn", align=1024)
        As = T.decl_buffer((S, BM, BK), dt, data=arena.data, scope="shared.dyn")
        Bs = T.decl_buffer((S, BN, BK), dt, data=arena.data, elem_offset=S * A_tile, scope="shared.dyn")
        full = T.alloc_shared((S,), "uint64")
        empty = T.alloc_shared((S,), "uint64")
        if tid == 256:
            for s in T.serial(S):
                T.ptx.mbarrier.init.shared.b64(full.ptr_to([s]), T.uint32(1))
                T.ptx.mbarrier.init.shared.b64(empty.ptr_to([s]), T.uint32(8))
        T.ptx.fence.proxy.async_.shared__cta()
        T.cuda.cta_sync()
        if tid == 256:
            if persistent:
                for it in T.serial((tiles - bid + grid - 1) // grid):
                    produce(it, bid + it * grid, As, Bs, full, empty, A_map, B_map)
            else:
                produce(None, bid, As, Bs, full, empty, A_map, B_map)
        elif tid < 256:
            wg: T.let = tid // 128
            t: T.let = tid % 128
            acc = T.alloc_local((NACC,), "float32")
            descA: T.uint64
            descB: T.uint64
            for i in T.unroll(NACC):
                acc[i] = T.float32(0)
            T.cuda.func_call(fence, acc.ptr_to([0]), source_code=fence_src, return_type="void")
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(descA), As.ptr_to([0, wg * 64, 0]), 1, 64, 3)
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(descB), Bs.ptr_to([0, 0, 0]), 1, 64, 3)
            if persistent:
                for it in T.serial((tiles - bid + grid - 1) // grid):
                    consume(it, bid + it * grid, As, Bs, full, empty, acc, descA, descB, Of, wg, t)
            else:
                consume(None, bid, As, Bs, full, empty, acc, descA, descB, Of, wg, t)
    # fmt: on
    if not views:
        return main
    # declare the epilogue's views on the host side, as TIRx's lowering declares its own views
    # of the parameters the kernel reads
    tirx = tvm_compat.tirx()
    return main.with_body(tirx.SeqStmt([tirx.DeclBuffer(v, data=p.data) for v, p in views]
                                       + [main.body]))


def _rebind(body, theirs, mine):
    """``body`` reading the parameters ``mine`` where it read ``theirs``."""
    T = tvm_compat.tirx()
    pairs = list(zip(theirs, mine))

    def on_var(var, _mutator):
        return next((m for t, m in pairs if var.same_as(t)), var)

    return tvm_compat.structural_mutate(body, [(T.Var, on_var)])


def hopper_func(func, sms: int = HOPPER_SMS, min_k: int = MIN_K, symbolic: bool = False,
                dims: dict | None = None, ranges: dict | None = None, per_sm: int = 1,
                persistent: bool = False):
    """``func`` rewritten as a Hopper GEMM kernel with the same parameters, or a string saying
    why not. ``symbolic``: GEMMs whose rows are symbolic too (the TMA descriptors are encoded
    per call from the runtime M, the grid is M's row blocks, the stores are guarded). Over
    ``ranges`` ({dim: (lo, hi)}) each run of M with its own plan gets its own kernel, chosen by
    a host-side branch on M (a batch-1 sequence of 128 rows takes the 64-wide tile that fills
    the GPU, as its static build does, not the optimum's wider one); without ranges one kernel,
    planned for M at ``dims`` ({dim: optimum}). ``per_sm``: :func:`plan`'s. ``persistent``:
    :func:`gemm_kernel`'s (:func:`tile_name`)."""
    T = tvm_compat.tirx()
    match = match_gemm(func, symbolic)
    if isinstance(match, str):
        return match
    if isinstance(match.m, int):
        plans = plan(match.m, match.n, match.k, sms, min_k, per_sm)
        plans = plans if isinstance(plans, str) else [(1, plans)]
    else:
        plans = symbolic_plans(match, sms, min_k, dims, ranges, per_sm)
    if isinstance(plans, str):
        return plans
    kernels = [gemm_kernel(match, p, persistent, sms, per_sm) for _, p in plans]
    first = kernels[0]
    # Same parameter list as ``func``: the kernel's own A/B/out parameters in their places,
    # the epilogue's other buffers (bias, residual) from ``func``.
    params = []
    for param in func.params:
        mine = [k for v, k in zip((match.a, match.b, match.out), first.params) if v.same_as(param)]
        params.append(mine[0] if mine else param)
    body = first.body
    for (start, _), kernel in zip(plans[1:], kernels[1:]):
        # the later kernels read the first one's parameters; the branch is host code, marked
        # thread-invariant as tc_gemm.dispatch's is
        cond = T.call_intrin("bool", "tirx.tvm_thread_invariant",
                             tvm_compat.index32(match.m) >= start)
        body = T.IfThenElse(cond, _rebind(kernel.body, kernel.params, first.params), body)
    attrs = dict(func.attrs.items()) if func.attrs else {}
    tile = tile_name(plans[0][1], persistent) if len(plans) == 1 else \
        ",".join(f"{tile_name(p, persistent)}@{start}" for start, p in plans)
    attrs.update({TIRX_KERNEL: True, IS_SCHEDULED: True, HOPPER_TILE: tile})
    attrs.pop(OP_PATTERN, None)
    return T.PrimFunc(params, body).with_attrs(attrs)


def hopper_gemm_pass(target, stats: dict | None = None, min_k: int = MIN_K,
                     symbolic: bool = False, dims: dict | None = None,
                     ranges: dict | None = None, per_sm: int = 1, persistent: bool = False):
    """A module pass that replaces every matching fused GEMM PrimFunc by its Hopper kernel
    (runs after FuseTIR, before the schedule rules); counts them in ``stats['hopper_gemm']``
    (``symbolic``, ``dims``, ``ranges``, ``per_sm``, ``persistent``: :func:`hopper_func`)."""
    tvm = tvm_compat.tvm()
    sms = sm_count(arch_sm(target))

    @tvm.transform.module_pass(opt_level=0, name="AmpHopperGemm")
    def _pass(mod, _ctx):
        updates = {}
        for gv, f in mod.functions_items():
            if not isinstance(f, tvm_compat.prim_func_class()):
                continue
            made = hopper_func(f, sms, min_k, symbolic, dims, ranges, per_sm, persistent)
            if not isinstance(made, str):
                updates[gv] = made
        if stats is not None and updates:
            stats["hopper_gemm"] = stats.get("hopper_gemm", 0) + len(updates)
        return replace_functions(mod, updates)

    return _pass


@register("hopper_gemm", "tir", 10, switch="hopper_gemm",
          reads=("hopper_min_k", "hopper_symbolic_m", "hopper_m_variants", "hopper_two_per_sm",
                 "hopper_persistent"),
          labels={"hopper_gemm": "GEMMs as Hopper wgmma + TMA kernels (epilogue fused)"})
def make_pass(ctx):
    if not enabled_for(ctx.target):
        return None
    return hopper_gemm_pass(ctx.target, ctx.stats, ctx.cuda.hopper_min_k,
                            ctx.cuda.hopper_symbolic_m, ctx.dims,
                            ctx.ranges if ctx.cuda.hopper_m_variants else None,
                            2 if ctx.cuda.hopper_two_per_sm else 1, ctx.cuda.hopper_persistent)

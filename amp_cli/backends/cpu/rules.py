"""Untuned CPU (llvm) schedules for amp's Relax pipeline.

TVM 0.27's ``relax.backend.cpu_generic`` pipeline legalizes and fuses but schedules nothing:
every kernel runs as a serial scalar loop nest. dlight's CPU rules only cover GEMV and simple
reductions, and MetaSchedule needs a tuning run. This module provides deterministic rules
written with ``tvm.s_tir.Schedule``:

* **GEMM-like** blocks (a reduction ``C[...] += A[...] * B[...]``: matmul, batch matmul, dense,
  NHWC/HWIO conv2d, with or without casts) get a register-blocked micro-kernel: the output's
  contiguous axis is split into a vector tile of 1-4 SIMD registers, the next spatial axis
  into a row tile of up to 8 rows (chosen to fit the register file), all reduction loops sit
  between the parallel outer tile loop and the register tile (the reduction order per output
  element is unchanged: results match the unscheduled kernel bit-for-bit). The accumulator
  tile is a ``local`` cache-write buffer, and the elementwise epilogue chain (bias, BN, ReLU,
  residual add, GELU, ...) is inlined into its write-back, so it runs on the tile while it is
  in registers/L1. A symbolic row count (a dynamic batch or sequence) is padded to whole row
  tiles first (``_pad_rows``), so no tile carries a row predicate.
* **Row-wise** functions (softmax, layer norm: reductions over the last axis followed by
  elementwise ops over rows) run one row per parallel iteration with every stage computed at
  the row, vectorizing the elementwise stages.
* **Other reductions** (pooling, mean) reorder so that a contiguous spatial axis is innermost
  and vectorized, reduction loops outside it; otherwise they parallelize the spatial loops.
* **Injective** blocks are fused, split into a parallel outer and a vectorized inner loop.

Elementwise producers are inlined into their consumers first (never into a GEMM operand and
never padding into a reduction, which would put a branch in the inner loop).

Every rule runs on a fresh schedule; any error makes the PrimFunc fall back to a safe
"parallelize the outermost spatial loop" schedule, and if that fails too, to the unscheduled
function. Fallbacks are counted in ``pipeline.LAST_STATS``.

Convolutions are brought to NHWC/HWIO in Relax (``ConvertLayout``) before legalization so the
output-channel axis is contiguous in both output and weights; weight transposes are folded at
compile time.
"""
from __future__ import annotations

import logging
import os
import re

from ... import tvm_compat

log = logging.getLogger(__name__)

from .analysis import (HostModel, SkipRule, block_iters, block_names, contains_if_then_else, divisors_upto, gemm_operands,
                       has_block, host_model, is_reduction, loop_extent, pick_vector,
                       region_buffer, type_name, vector_lanes, vectorizable, walk,
                       writes_param, const_int, extent_bound, same_extent, static_extent,
                       expr_is_var, is_bf16_constant_store, same_points, stores_bf16_constant)
from .packing import pack_map


# ---- inlining ------------------------------------------------------------------------------
def _auto_inline(sch) -> None:
    changed = True
    while changed:
        changed = False
        for name in block_names(sch):
            block = sch.get_sblock(name)
            if is_reduction(sch, block) or writes_param(sch, block):
                continue
            consumers = sch.get_consumers(block)
            if not consumers:
                continue
            red = [c for c in consumers if is_reduction(sch, c)]
            if red:
                # never into a GEMM operand (it would be recomputed per MAC and break the
                # vector loads), never padding into a reduction (branch in the inner loop),
                # never into a reduction when other consumers need it too (recompute).
                if len(consumers) > 1 or gemm_operands(sch, red[0]) is not None:
                    continue
                if contains_if_then_else(sch.get(block).body):
                    continue
            try:
                sch.compute_inline(block)
                changed = True
            except Exception:  # noqa: BLE001 - not inlinable (e.g. not injective)
                continue


# ---- per-block rules -----------------------------------------------------------------------
def _maybe_parallel(sch, loop, work: int, hw: HostModel) -> None:
    extent = static_extent(sch, loop)  # None: symbolic (a dynamic dim), taken as > 1
    if (extent is None or extent > 1) and work >= hw.parallel_min_work and hw.num_cores > 1:
        sch.parallel(loop)


def _bound(sch, loops, hw: HostModel) -> int:
    """Iterations of the loop nest ``loops``, dynamic dims at their largest size."""
    total = 1
    for lp in loops:
        total *= extent_bound(sch, lp, hw)
    return total


def _vectorize_last(sch, block, hw: HostModel, max_regs: int = 1) -> None:
    """Split the innermost loop of block for SIMD width and vectorize it."""
    loops = sch.get_loops(block)
    if not loops:
        return
    blk = sch.get(block)
    dtype = region_buffer(blk.writes[0]).dtype if blk.writes else "float32"
    if not vectorizable(dtype):
        return
    inner = loops[-1]
    n = static_extent(sch, inner)
    if n is None or n <= 1:  # a dynamic dim: left scalar
        return
    v = pick_vector(n, vector_lanes(hw, dtype), max_regs)
    if v <= 1:
        return
    if v < n:
        inner = sch.split(inner, [None, v])[-1]
    sch.vectorize(inner)


def _sched_injective(sch, block, hw: HostModel) -> None:
    loops = sch.get_loops(block)
    if not loops:
        return
    blk = sch.get(block)
    dtype = region_buffer(blk.writes[0]).dtype
    exts = [static_extent(sch, lp) for lp in loops]
    if None in exts:
        _sched_injective_dynamic(sch, loops, exts, dtype, hw)
        return
    total = 1
    for e in exts:
        total *= e
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    lanes = vector_lanes(hw, dtype)
    v = 1
    if vectorizable(dtype) and total > 1:
        # prefer a factor dividing the innermost extent so vector loads stay affine
        inner = exts[-1]
        v = pick_vector(inner, lanes, 1) if inner >= lanes else pick_vector(total, lanes, 1)
        if total % v:
            v = 1
    if v > 1 and v < total:
        outer, vec = sch.split(fused, [None, v])
        sch.vectorize(vec)
        _maybe_parallel(sch, outer, total, hw)
    elif v == total and v > 1:
        sch.vectorize(fused)
    else:
        _maybe_parallel(sch, fused, total, hw)


def _sched_injective_dynamic(sch, loops, exts, dtype, hw: HostModel) -> None:
    """Injective loops with a symbolic extent: one parallel loop over all but a vector of the
    innermost axis, when that axis is static (a split of a symbolic loop would need a tail)."""
    total = _bound(sch, loops, hw)
    inner = exts[-1]
    v = 1
    if inner is not None and inner > 1 and vectorizable(dtype):
        v = pick_vector(inner, vector_lanes(hw, dtype), 1)
    outer = list(loops)
    if v > 1:
        if v < inner:
            io, vec = sch.split(loops[-1], [None, v])
            outer = list(loops[:-1]) + [io]
        else:
            vec = loops[-1]
            outer = list(loops[:-1])
        sch.vectorize(vec)
    if outer:
        fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
        _maybe_parallel(sch, fused, total, hw)


def _sched_reduction(sch, block, hw: HostModel) -> None:
    """Pooling / mean / generic reductions."""
    its = block_iters(sch, block)
    s_loops = [(lp, iv) for lp, iv, k in its if k == "S"]
    r_loops = [(lp, iv) for lp, iv, k in its if k == "R"]
    blk = sch.get(block)
    dtype = region_buffer(blk.writes[0]).dtype
    total = _bound(sch, [lp for lp, _, _ in its], hw)
    out_work = total
    vec_inner = None
    if s_loops and vectorizable(dtype):
        last_lp, last_iv = s_loops[-1]
        # vectorize the innermost spatial axis if it is contiguous in some read
        contiguous = any(
            len(r.region) > 0 and expr_is_var(r.region[-1].min, last_iv.var)
            for r in blk.reads if str(region_buffer(r).name) != str(region_buffer(blk.writes[0]).name))
        if contiguous and (static_extent(sch, last_lp) or 0) >= 2:
            vec_inner = last_lp
    if vec_inner is not None:
        n = loop_extent(sch, vec_inner)
        v = pick_vector(n, vector_lanes(hw, dtype), 1)
        if v < n:
            so, si = sch.split(vec_inner, [None, v])
        else:
            so, si = None, vec_inner
        outer = [lp for lp, _ in s_loops[:-1]] + ([so] if so is not None else [])
        sch.reorder(*(outer + [lp for lp, _ in r_loops] + [si]))
        if outer:
            f = sch.fuse(*outer) if len(outer) > 1 else outer[0]
            _maybe_parallel(sch, f, out_work, hw)
        bf16_init = bool(r_loops) and is_bf16_constant_store(blk.init)
        sch.vectorize(si)
        if r_loops:
            init = sch.decompose_reduction(block, r_loops[0][0])
            if bf16_init:
                # the init loop inherited si's vectorized kind; a split makes serial loops
                sch.split(sch.get_loops(init)[-1], [None, 1])
            else:
                _vectorize_innermost(sch, init)
        return
    # reduction along the contiguous axis: parallel rows, scalar (order-preserving) reduce
    outer = [lp for lp, _ in s_loops]
    sch.reorder(*(outer + [lp for lp, _ in r_loops]))
    if outer:
        f = sch.fuse(*outer) if len(outer) > 1 else outer[0]
        _maybe_parallel(sch, f, out_work, hw)


def _vectorize_innermost(sch, block) -> None:
    loops = sch.get_loops(block)
    if loops and not stores_bf16_constant(sch, block):
        try:
            sch.vectorize(loops[-1])
        except Exception:  # noqa: BLE001
            pass


def _pad_rows(sch, block, row_var, ti: int, hw: HostModel):
    """Pad a GEMM's symbolic row axis to whole ``ti``-row tiles (``pad_einsum``): the register
    tile then needs no predicate, which would keep the accumulators out of registers (TVM
    cannot bound a predicated tile's cache-write region: the ``local`` accumulator became the
    whole [M, N] output). The padded row operand and the padded output's copy to the real one
    are copies of their own (parallel, vectorized): M x K and M x N elements against the
    GEMM's M x N x K. Returns the GEMM block, or None (nothing changed) when TVM cannot pad
    it."""
    name = sch.get(block).name_hint
    factors = [ti if iv.var.same_as(row_var) else 1 for iv in sch.get(block).iter_vars]
    before = set(block_names(sch))
    try:
        sch.pad_einsum(block, factors)
    except Exception:  # noqa: BLE001 - not an einsum TVM can pad: keep the masked last tile
        return None
    made = [n for n in block_names(sch) if n not in before]
    for n in made:                 # the padded operand's copy, and the padded output's
        _sched_injective(sch, sch.get_sblock(n), hw)
    return sch.get_sblock(name)


def _sched_gemm(sch, block, hw: HostModel, padded: bool = False) -> None:
    tvm = tvm_compat.tvm()

    its = block_iters(sch, block)
    store, _loads = gemm_operands(sch, block)
    blk = sch.get(block)
    out_buf = store.buffer
    idx = list(store.indices)
    s_its = [(lp, iv) for lp, iv, k in its if k == "S"]
    r_its = [(lp, iv) for lp, iv, k in its if k == "R"]
    if not s_its or not r_its:
        raise SkipRule("not a gemm nest")
    last = idx[-1]
    j = next((t for t in s_its if expr_is_var(last, t[1].var)), None)
    if j is None:
        raise SkipRule("output's last axis is not a spatial iter")
    # row axis: the nearest spatial iter (in output index order, before j) with extent > 1
    i = None
    for e in reversed(idx[:-1]):
        cand = next((t for t in s_its if expr_is_var(e, t[1].var)), None)
        if cand is not None and (static_extent(sch, cand[0]) or 2) > 1:
            i = cand
            break
    n_ext = loop_extent(sch, j[0])  # a symbolic vector axis: no rule (the safe fallback)
    m_ext = static_extent(sch, i[0]) if i is not None else 1

    def row_tile(limit: int) -> int:
        """Rows per register tile: a divisor of M; for a symbolic M (a dynamic dim) up to its
        largest size, the last tile masked."""
        if m_ext is not None:
            return max(divisors_upto(m_ext, limit))
        return min(limit, extent_bound(sch, i[0], hw))
    acc_dtype = out_buf.dtype
    lanes = vector_lanes(hw, acc_dtype)
    # choose (vector tile, row tile) maximizing FMAs per k-step within the register file
    best = None
    for nvec in (4, 3, 2, 1):
        jv = lanes * nvec
        if n_ext % jv:
            continue
        ti = row_tile(max(1, min(8, (hw.num_regs - nvec - 2) // nvec)))
        score = (ti * nvec, nvec)
        if best is None or score > best[0]:
            best = (score, jv, ti)
    if best is None:  # extent not a multiple of the SIMD width
        jv = pick_vector(n_ext, lanes)
        nvec = -(-jv // lanes)
        ti = row_tile(max(1, min(8, (hw.num_regs - nvec - 2) // nvec)))
    else:
        _, jv, ti = best
    if i is not None and m_ext is None and ti > 1 and not padded:
        padded_block = _pad_rows(sch, block, i[1].var, ti, hw)
        if padded_block is not None:
            return _sched_gemm(sch, padded_block, hw, padded=True)

    work = _bound(sch, [lp for lp, _, _ in its], hw)

    _pack_weight(sch, block, j, i, jv, hw)
    j_o, j_i = sch.split(j[0], [None, jv])
    if i is not None:
        i_o, i_i = sch.split(i[0], [None, ti])
    others = [lp for lp, iv in s_its if lp not in (j[0],) and (i is None or lp != i[0])]
    # sch.get_loops order: keep other spatial loops in their original order
    outer = [j_o] + others + ([i_o] if i is not None else [])
    inner = ([i_i] if i is not None else []) + [j_i]
    r_loops = [lp for lp, _ in r_its]
    sch.reorder(*(outer + r_loops + inner))
    fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
    _maybe_parallel(sch, fused, work, hw)

    # accumulate the tile in a local buffer; epilogue chain inlined into the write-back
    wb = sch.cache_write(block, 0, "local")
    wb_name = sch.get(wb).name_hint
    while True:
        wb = sch.get_sblock(wb_name)
        consumers = sch.get_consumers(wb)
        if len(consumers) != 1 or is_reduction(sch, consumers[0]):
            break
        if not same_points(sch, wb, consumers[0]):
            break  # a slice (or broadcast) epilogue: see same_points
        try:
            sch.reverse_compute_inline(consumers[0])
        except Exception:  # noqa: BLE001 - e.g. broadcast/transposed epilogue
            break
    wb = sch.get_sblock(wb_name)
    sch.reverse_compute_at(wb, fused, preserve_unit_loops=True)
    _vectorize_last(sch, wb, hw)
    # vectorize / unroll while the block still has its init (compact-dataflow check).
    # One SIMD register per vector op (LLVM turns odd-width vectors like <48 x float> into
    # element shuffles): j_i = [nvec (unrolled), lanes (vectorized)].
    if vectorizable(acc_dtype):
        if jv > lanes and jv % lanes == 0:
            j_u, j_l = sch.split(j_i, [None, lanes])
            sch.vectorize(j_l)
            sch.unroll(j_u)
        else:
            sch.vectorize(j_i)
    if i is not None and ti > 1:
        sch.unroll(i_i)
    init = sch.decompose_reduction(block, r_loops[0])
    if vectorizable(acc_dtype):
        _vectorize_innermost(sch, init)
    del tvm, blk


def _pack_weight(sch, block, j, i, jv, hw: HostModel) -> None:
    """Pre-pack the GEMM operand that is a function parameter indexed by the vector axis in
    its last dimension and not by the row axis (weights): [..., N] -> [N/jv, ..., jv], so
    each vector-tile's panel is contiguous. The caller's argument gets a matching
    relax layout_transform (folded at compile time for constant weights)."""
    if hw.pack is None:
        return
    blk = sch.get(block)
    func = sch.mod["main"]
    params = [str(p.name) for p in func.params]
    for ridx, r in enumerate(blk.reads):
        buf = region_buffer(r)
        name = str(buf.name)
        if name not in params or name == str(region_buffer(blk.writes[0]).name):
            continue
        if params.index(name) not in hw.packable:
            continue
        region = list(r.region)
        if not region or not expr_is_var(region[-1].min, j[1].var):
            continue
        used = set()
        for rg in region:
            walk(rg.min, lambda n: used.add(n) if type_name(n) == "Var" else None)
        if i is not None and any(v.same_as(i[1].var) for v in used):
            continue
        shape = [const_int(x) for x in buf.shape]
        if None in shape or shape[-1] % jv or shape[-1] == jv and len(shape) == 1:
            continue
        if shape[-1] == jv:
            continue  # already one panel
        imap = pack_map(len(shape), jv)
        sch.transform_layout(block, ("read", ridx), imap)
        hw.pack.append((params.index(name), len(shape), jv))
        return


def _sched_rowwise(sch, hw: HostModel) -> bool:
    """softmax / layer norm: every block shares the output's leading (row) loops and the
    reductions reduce exactly the trailing axis. One row per parallel iteration."""
    names = block_names(sch)
    if len(names) < 2:
        return False
    blocks = [sch.get_sblock(n) for n in names]
    out = blocks[-1]
    if is_reduction(sch, out) or not writes_param(sch, out):
        return False
    out_its = block_iters(sch, out)
    if len(out_its) < 2:
        return False
    row_ext = [sch.get(lp).extent for lp, _, _ in out_its[:-1]]  # symbolic for dynamic dims

    def same_rows(exts) -> bool:
        return len(exts) >= len(row_ext) and all(same_extent(a, b)
                                                 for a, b in zip(exts, row_ext))
    has_red = False
    for b in blocks[:-1]:
        its = block_iters(sch, b)
        kinds = "".join(k for _, _, k in its)
        exts = [sch.get(lp).extent for lp, _, _ in its]
        if is_reduction(sch, b):
            has_red = True
            if not re.fullmatch(r"S+R+", kinds) or kinds.count("S") != len(row_ext):
                return False
            if not same_rows(exts):
                return False
        else:
            if not same_rows(exts) or len(exts) > len(row_ext) + 1:
                return False
    if not has_red:
        return False
    loops = sch.get_loops(out)
    total = _bound(sch, loops, hw)
    rows = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
    for b in reversed(blocks[:-1]):
        sch.compute_at(b, rows, preserve_unit_loops=True)
    _maybe_parallel(sch, rows, total, hw)
    for n in names:
        b = sch.get_sblock(n)
        if not is_reduction(sch, b):
            _vectorize_last(sch, b, hw)
    return True


def _sched_general(sch, hw: HostModel) -> str:
    _auto_inline(sch)
    names = block_names(sch)
    gemms = [n for n in names if gemm_operands(sch, sch.get_sblock(n)) is not None]
    rule = "injective"
    for n in names:
        if not has_block(sch, n):
            continue  # inlined into a GEMM write-back
        b = sch.get_sblock(n)
        if n in gemms:
            _sched_gemm(sch, b, hw)
            rule = "gemm"
        elif is_reduction(sch, b):
            _sched_reduction(sch, b, hw)
            if rule == "injective":
                rule = "reduction"
        else:
            _sched_injective(sch, b, hw)
    return rule


def _sched_safe(sch, hw: HostModel) -> str:
    """Fallback: parallelize the outermost spatial loop of every root-level block."""
    for name in block_names(sch):
        b = sch.get_sblock(name)
        loops = sch.get_loops(b)
        if not loops:
            continue
        ivs = sch.get(b).iter_vars
        if len(ivs) == len(loops) and int(ivs[0].iter_type) == 0 and \
                (static_extent(sch, loops[0]) or 2) > 1:  # None: a dynamic dim
            sch.parallel(loops[0])
    return "fallback-parallel"


def schedule_prim_func(func, target, hw: HostModel | None = None):
    """Schedule one PrimFunc for CPU. Returns (new_func or None, rule_name)."""
    tvm = tvm_compat.tvm()
    s_tir = tvm_compat.s_tir()

    hw = hw or host_model(target)
    mod = tvm.IRModule({"main": func})
    errors = []
    for attempt in ("rowwise", "general", "safe"):
        sch = s_tir.Schedule(mod, debug_mask="all" if os.environ.get("AMP_SCHED_DEBUG") else 0)
        hw.pack = [] if hw.allow_pack else None
        try:
            if attempt == "rowwise":
                _auto_inline(sch)
                names = block_names(sch)
                if any(gemm_operands(sch, sch.get_sblock(n)) is not None for n in names):
                    continue
                if not _sched_rowwise(sch, hw):
                    continue
                rule = "rowwise"
            elif attempt == "general":
                rule = _sched_general(sch, hw)
            else:
                rule = _sched_safe(sch, hw)
        except Exception as exc:  # noqa: BLE001 - any schedule error: try the next rule
            errors.append(f"{attempt}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        if errors:
            log.debug("schedule fallback: %s", errors)
        return sch.mod["main"], rule
    log.debug("unscheduled: %s", errors)
    return None, "unscheduled"

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
  in registers/L1.
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
function. Fallbacks are counted in :data:`LAST_STATS`.

Convolutions are brought to NHWC/HWIO in Relax (``ConvertLayout``) before legalization so the
output-channel axis is contiguous in both output and weights; weight transposes are folded at
compile time.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field

from .. import tvm_compat

log = logging.getLogger(__name__)

# Statistics of the last run of the scheduling pass (per process): rule name -> count, and
# the names of PrimFuncs that fell back.
LAST_STATS: dict = {}


# --------------------------------------------------------------------------------------------
# Target / threading
# --------------------------------------------------------------------------------------------
_CPUINFO_TO_LLVM = {
    "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512vl": "avx512vl",
    "avx512dq": "avx512dq", "avx512_vnni": "avx512vnni", "avx512_bf16": "avx512bf16",
    "avx512_fp16": "avx512fp16", "amx_tile": "amx-tile", "amx_bf16": "amx-bf16",
    "amx_int8": "amx-int8", "avx2": "avx2", "fma": "fma", "f16c": "f16c",
    "avx_vnni": "avxvnni",
}


def _cpuinfo_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_llvm_target(mcpu: str | None = None) -> dict:
    """The llvm target dict for this machine.

    ``mcpu`` defaults to LLVM's host CPU name; features the host reports in /proc/cpuinfo
    (AVX-512 BF16/FP16/VNNI, AMX) that LLVM's CPU model lacks are added as ``mattr`` (LLVM
    sometimes names a virtualized Sapphire Rapids "rocketlake"). ``num-cores`` is the number
    of cores this process may run on, or TVM_NUM_THREADS when set.
    """
    tvm = tvm_compat.tvm()
    from tvm.target import codegen

    spec: dict = {"kind": "llvm"}
    if mcpu is None:
        mcpu = codegen.llvm_get_system_cpu()
        flags = _cpuinfo_flags()
        mattr = []
        if mcpu and mcpu != "generic":
            probe = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
            for flag, feat in _CPUINFO_TO_LLVM.items():
                if flag in flags:
                    try:
                        has = codegen.llvm_cpu_has_features(feat, probe)
                    except Exception:  # noqa: BLE001 - feature name unknown to this LLVM
                        continue
                    if not has:
                        mattr.append("+" + feat)
        if mattr:
            spec["mattr"] = mattr
    if mcpu:
        spec["mcpu"] = mcpu
    spec["num-cores"] = effective_num_threads(default_only=True)
    return spec


_THREADS_SET: int | None = None


def set_num_threads(n: int) -> int:
    """Resize TVM's CPU thread pool to ``n`` threads (also exported as TVM_NUM_THREADS so
    child processes and later-initialized pools agree). Returns the effective count."""
    global _THREADS_SET
    n = max(1, int(n))
    os.environ["TVM_NUM_THREADS"] = str(n)
    tvm = tvm_compat.tvm()
    cfg = tvm.get_global_func("runtime.config_threadpool", allow_missing=True)
    if cfg is not None:
        cfg(1, n)  # mode 1 (kBig): n threads pinned to the big cores
    _THREADS_SET = n
    return effective_num_threads()


def effective_num_threads(default_only: bool = False) -> int:
    """Threads TVM's runtime uses: the pool size if TVM is loaded, else TVM_NUM_THREADS, else
    the cores this process may use (TVM's own default)."""
    if not default_only:
        try:
            tvm = tvm_compat.tvm()
            return int(tvm.runtime.num_threads())
        except Exception:  # noqa: BLE001
            pass
    env = os.environ.get("TVM_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if env and env.strip().isdigit() and int(env) > 0:
        return int(env)
    return available_cores()


# --------------------------------------------------------------------------------------------
# Schedule rules
# --------------------------------------------------------------------------------------------
@dataclass
class _HW:
    vector_bits: int = 512
    num_regs: int = 32
    num_cores: int = 2
    parallel_min_work: int = 1 << 14  # loop-body instances below which we stay serial
    pack: list | None = None  # collects (param index, ndim, jv) weight packings of a func
    packable: set = field(default_factory=set)  # param indices that are constants
    allow_pack: bool = True


def _hw_from_target(target) -> _HW:
    from tvm.target import codegen

    bits = 128
    try:
        bits = int(codegen.llvm_get_vector_width(target))
    except Exception:  # noqa: BLE001
        pass
    if bits <= 0:
        bits = 128
    regs = 32 if bits >= 512 else 16
    cores = int(target.attrs.get("num-cores", 0) or 0) if hasattr(target, "attrs") else 0
    return _HW(vector_bits=bits, num_regs=regs, num_cores=cores or available_cores())


def _tname(node) -> str:
    return type(node).__name__


def _buf(x):
    """The buffer of a region / load / store (TVM 0.27: a buffer-typed Var in `.source`)."""
    b = getattr(x, "buffer", None)
    return b if b is not None else x.source


def _int(e) -> int | None:
    return int(e.value) if _tname(e) == "IntImm" else None


class _Skip(Exception):
    """A rule does not apply."""


def _ext(sch, loop) -> int:
    import tvm

    e = _int(sch.get(loop).extent)
    if e is None:
        raise _Skip("dynamic extent")
    return e


def _iters(sch, block):
    """(loop, iter_var, kind) per loop of a block; requires the one-loop-per-iter form that
    FuseTIR produces (extents equal, no predicate)."""
    import tvm

    blk = sch.get(block)
    loops = sch.get_loops(block)
    ivs = list(blk.iter_vars)
    if len(loops) != len(ivs):
        raise _Skip("loops do not map 1:1 to block iters")
    out = []
    for lp, iv in zip(loops, ivs):
        if _int(iv.dom.extent) is None or _ext(sch, lp) != _int(iv.dom.extent):
            raise _Skip("loop/iter extent mismatch")
        kind = {0: "S", 2: "R"}.get(int(iv.iter_type), "O")
        if kind == "O":
            raise _Skip("opaque iter")
        out.append((lp, iv, kind))
    return out


def _is_reduction(sch, block) -> bool:
    return any(int(iv.iter_type) == 2 for iv in sch.get(block).iter_vars)


def _bits(dtype) -> int:
    import tvm

    return tvm.runtime.DataType(str(dtype)).bits


def _lanes(hw: _HW, dtype) -> int:
    b = _bits(dtype)
    return max(1, hw.vector_bits // max(8, b))


def _vectorizable(dtype) -> bool:
    s = str(dtype)
    return not (s == "bool" or s.startswith("uint1") or "x" in s)


def _divisors_upto(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _pick_vector(n: int, lanes: int, max_regs: int = 4) -> int:
    """A split factor for a vectorized loop of extent n: a multiple of `lanes` up to
    max_regs registers when it divides n, else the largest divisor of n up to that width."""
    limit = lanes * max_regs
    if n <= limit:
        return n
    for k in range(max_regs, 0, -1):
        if n % (lanes * k) == 0:
            return lanes * k
    return max(_divisors_upto(n, limit))


def _walk(expr, fvisit) -> None:
    """Pre-order walk over a TIR expression tree (the Python API has no visitor for tirx)."""
    stack = [expr]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        fvisit(node)
        for attr in ("a", "b", "value", "condition", "true_value", "false_value"):
            child = getattr(node, attr, None)
            if child is not None and not isinstance(child, (int, float, str)):
                stack.append(child)
        args = getattr(node, "args", None)
        if args is not None:
            stack.extend(list(args))


def _call_name(node) -> str:
    op = getattr(node, "op", None)
    return str(getattr(op, "name", "")) if op is not None else ""


def _contains_if_then_else(stmt) -> bool:
    import tvm

    found = []
    value = getattr(stmt, "value", None)
    if value is None:
        return "if_then_else" in str(stmt)

    def visit(node):
        if _tname(node) == "Select" or _call_name(node).endswith("if_then_else"):
            found.append(node)

    _walk(value, visit)
    return bool(found)


def _gemm_operands(sch, block):
    """If block is `C[s] = C[s] + f(A[..] * B[..])` return (C_store, [loads]), else None."""
    import tvm

    blk = sch.get(block)
    if not _is_reduction(sch, block) or len(blk.writes) != 1:
        return None
    body = blk.body
    if not _tname(body) == "BufferStore":
        return None
    val = body.value
    if not _tname(val) == "Add":
        return None
    a, b = val.a, val.b
    if _tname(b) in ("BufferLoad", "TensorLoad") and _buf(b).same_as(body.buffer):
        a, b = b, a
    if not (_tname(a) in ("BufferLoad", "TensorLoad") and _buf(a).same_as(body.buffer)):
        return None
    loads, muls = [], []

    def strip(e):
        while _tname(e) == "Cast":
            e = e.value
        return e

    def is_load(e):
        return _tname(e) in ("BufferLoad", "TensorLoad")

    def visit(node):
        if is_load(node):
            loads.append(node)
        elif _tname(node) == "Mul":
            x, y = strip(node.a), strip(node.b)
            if is_load(x) and is_load(y) and not _buf(x).same_as(_buf(y)):
                muls.append(node)

    _walk(b, visit)
    if not muls:
        return None
    return body, loads


def _root(sch):
    return sch.get_sblock(sch.mod["main"].body.block.name_hint)


def _block_names(sch) -> list[str]:
    return [sch.get(b).name_hint for b in sch.get_child_blocks(_root(sch))]


def _has_block(sch, name: str) -> bool:
    try:
        sch.get_sblock(name)
        return True
    except Exception:  # noqa: BLE001
        return False


def _writes_param(sch, block) -> bool:
    params = {str(p.name) for p in sch.mod["main"].params}
    return any(str(_buf(w).name) in params for w in sch.get(block).writes)


# ---- inlining ------------------------------------------------------------------------------
def _auto_inline(sch) -> None:
    changed = True
    while changed:
        changed = False
        for name in _block_names(sch):
            block = sch.get_sblock(name)
            if _is_reduction(sch, block) or _writes_param(sch, block):
                continue
            consumers = sch.get_consumers(block)
            if not consumers:
                continue
            red = [c for c in consumers if _is_reduction(sch, c)]
            if red:
                # never into a GEMM operand (it would be recomputed per MAC and break the
                # vector loads), never padding into a reduction (branch in the inner loop),
                # never into a reduction when other consumers need it too (recompute).
                if len(consumers) > 1 or _gemm_operands(sch, red[0]) is not None:
                    continue
                if _contains_if_then_else(sch.get(block).body):
                    continue
            try:
                sch.compute_inline(block)
                changed = True
            except Exception:  # noqa: BLE001 - not inlinable (e.g. not injective)
                continue


# ---- per-block rules -----------------------------------------------------------------------
def _maybe_parallel(sch, loop, work: int, hw: _HW) -> None:
    if _ext(sch, loop) > 1 and work >= hw.parallel_min_work and hw.num_cores > 1:
        sch.parallel(loop)


def _vectorize_last(sch, block, hw: _HW, max_regs: int = 1) -> None:
    """Split the innermost loop of block for SIMD width and vectorize it."""
    loops = sch.get_loops(block)
    if not loops:
        return
    blk = sch.get(block)
    dtype = _buf(blk.writes[0]).dtype if blk.writes else "float32"
    if not _vectorizable(dtype):
        return
    inner = loops[-1]
    n = _ext(sch, inner)
    if n <= 1:
        return
    v = _pick_vector(n, _lanes(hw, dtype), max_regs)
    if v <= 1:
        return
    if v < n:
        inner = sch.split(inner, [None, v])[-1]
    sch.vectorize(inner)


def _sched_injective(sch, block, hw: _HW) -> None:
    loops = sch.get_loops(block)
    if not loops:
        return
    blk = sch.get(block)
    dtype = _buf(blk.writes[0]).dtype
    exts = [_ext(sch, lp) for lp in loops]
    total = 1
    for e in exts:
        total *= e
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    lanes = _lanes(hw, dtype)
    v = 1
    if _vectorizable(dtype) and total > 1:
        # prefer a factor dividing the innermost extent so vector loads stay affine
        inner = exts[-1]
        v = _pick_vector(inner, lanes, 1) if inner >= lanes else _pick_vector(total, lanes, 1)
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


def _sched_reduction(sch, block, hw: _HW) -> None:
    """Pooling / mean / generic reductions."""
    its = _iters(sch, block)
    s_loops = [(lp, iv) for lp, iv, k in its if k == "S"]
    r_loops = [(lp, iv) for lp, iv, k in its if k == "R"]
    blk = sch.get(block)
    dtype = _buf(blk.writes[0]).dtype
    total = 1
    for lp, _, _ in its:
        total *= _ext(sch, lp)
    out_work = total
    vec_inner = None
    if s_loops and _vectorizable(dtype):
        last_lp, last_iv = s_loops[-1]
        # vectorize the innermost spatial axis if it is contiguous in some read
        contiguous = any(
            len(r.region) > 0 and _expr_is_var(r.region[-1].min, last_iv.var)
            for r in blk.reads if str(_buf(r).name) != str(_buf(blk.writes[0]).name))
        if contiguous and _ext(sch, last_lp) >= 2:
            vec_inner = last_lp
    if vec_inner is not None:
        n = _ext(sch, vec_inner)
        v = _pick_vector(n, _lanes(hw, dtype), 1)
        if v < n:
            so, si = sch.split(vec_inner, [None, v])
        else:
            so, si = None, vec_inner
        outer = [lp for lp, _ in s_loops[:-1]] + ([so] if so is not None else [])
        sch.reorder(*(outer + [lp for lp, _ in r_loops] + [si]))
        if outer:
            f = sch.fuse(*outer) if len(outer) > 1 else outer[0]
            _maybe_parallel(sch, f, out_work, hw)
        bf16_init = bool(r_loops) and _is_bf16_constant_store(blk.init)
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


def _is_bf16_constant_store(stmt) -> bool:
    """``stmt`` stores a bfloat16 constant (e.g. max-pool's -inf init). TVM 0.27's
    BF16StorageLegalize does not rewrite a vector Broadcast of a bf16 constant (the build
    fails with "buffer's dtype is T.uint16 ... RHS's dtype is T.bfloat16x32"), so such
    stores stay scalar loops (LLVM still vectorizes the fill)."""
    tvm = tvm_compat.tvm()
    return (isinstance(stmt, tvm.tirx.BufferStore) and str(stmt.buffer.dtype) == "bfloat16"
            and isinstance(stmt.value, tvm.tirx.FloatImm))


def _stores_bf16_constant(sch, block) -> bool:
    return _is_bf16_constant_store(sch.get(block).body)


def _vectorize_innermost(sch, block) -> None:
    loops = sch.get_loops(block)
    if loops and not _stores_bf16_constant(sch, block):
        try:
            sch.vectorize(loops[-1])
        except Exception:  # noqa: BLE001
            pass


def _expr_is_var(expr, var) -> bool:
    import tvm

    return _tname(expr) == "Var" and expr.same_as(var)


def _sched_gemm(sch, block, hw: _HW) -> None:
    import tvm

    its = _iters(sch, block)
    store, _loads = _gemm_operands(sch, block)
    blk = sch.get(block)
    out_buf = store.buffer
    idx = list(store.indices)
    s_its = [(lp, iv) for lp, iv, k in its if k == "S"]
    r_its = [(lp, iv) for lp, iv, k in its if k == "R"]
    if not s_its or not r_its:
        raise _Skip("not a gemm nest")
    last = idx[-1]
    j = next((t for t in s_its if _expr_is_var(last, t[1].var)), None)
    if j is None:
        raise _Skip("output's last axis is not a spatial iter")
    # row axis: the nearest spatial iter (in output index order, before j) with extent > 1
    i = None
    for e in reversed(idx[:-1]):
        cand = next((t for t in s_its if _expr_is_var(e, t[1].var)), None)
        if cand is not None and _ext(sch, cand[0]) > 1:
            i = cand
            break
    n_ext = _ext(sch, j[0])
    m_ext = _ext(sch, i[0]) if i is not None else 1
    acc_dtype = out_buf.dtype
    lanes = _lanes(hw, acc_dtype)
    # choose (vector tile, row tile) maximizing FMAs per k-step within the register file
    best = None
    for nvec in (4, 3, 2, 1):
        jv = lanes * nvec
        if n_ext % jv:
            continue
        ti_max = max(1, min(8, (hw.num_regs - nvec - 2) // nvec))
        ti = max(_divisors_upto(m_ext, ti_max))
        score = (ti * nvec, nvec)
        if best is None or score > best[0]:
            best = (score, jv, ti)
    if best is None:  # extent not a multiple of the SIMD width
        jv = _pick_vector(n_ext, lanes)
        nvec = -(-jv // lanes)
        ti = max(_divisors_upto(m_ext, max(1, min(8, (hw.num_regs - nvec - 2) // nvec))))
    else:
        _, jv, ti = best

    work = 1
    for lp, _, _ in its:
        work *= _ext(sch, lp)

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
        if len(consumers) != 1 or _is_reduction(sch, consumers[0]):
            break
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
    if _vectorizable(acc_dtype):
        if jv > lanes and jv % lanes == 0:
            j_u, j_l = sch.split(j_i, [None, lanes])
            sch.vectorize(j_l)
            sch.unroll(j_u)
        else:
            sch.vectorize(j_i)
    if i is not None and ti > 1:
        sch.unroll(i_i)
    init = sch.decompose_reduction(block, r_loops[0])
    if _vectorizable(acc_dtype):
        _vectorize_innermost(sch, init)
    del tvm, blk


def _pack_map(ndim: int, jv: int):
    from tvm.tirx import IndexMap

    def fn(*idx):
        return (idx[-1] // jv, *idx[:-1], idx[-1] % jv)

    return IndexMap.from_func(fn, ndim=ndim)


def _pack_weight(sch, block, j, i, jv, hw: _HW) -> None:
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
        buf = _buf(r)
        name = str(buf.name)
        if name not in params or name == str(_buf(blk.writes[0]).name):
            continue
        if params.index(name) not in hw.packable:
            continue
        region = list(r.region)
        if not region or not _expr_is_var(region[-1].min, j[1].var):
            continue
        used = set()
        for rg in region:
            _walk(rg.min, lambda n: used.add(n) if _tname(n) == "Var" else None)
        if i is not None and any(v.same_as(i[1].var) for v in used):
            continue
        shape = [_int(x) for x in buf.shape]
        if None in shape or shape[-1] % jv or shape[-1] == jv and len(shape) == 1:
            continue
        if shape[-1] == jv:
            continue  # already one panel
        imap = _pack_map(len(shape), jv)
        sch.transform_layout(block, ("read", ridx), imap)
        hw.pack.append((params.index(name), len(shape), jv))
        return


def _sched_rowwise(sch, hw: _HW) -> bool:
    """softmax / layer norm: every block shares the output's leading (row) loops and the
    reductions reduce exactly the trailing axis. One row per parallel iteration."""
    names = _block_names(sch)
    if len(names) < 2:
        return False
    blocks = [sch.get_sblock(n) for n in names]
    out = blocks[-1]
    if _is_reduction(sch, out) or not _writes_param(sch, out):
        return False
    out_its = _iters(sch, out)
    if len(out_its) < 2:
        return False
    row_ext = [_ext(sch, lp) for lp, _, _ in out_its[:-1]]
    has_red = False
    for b in blocks[:-1]:
        its = _iters(sch, b)
        kinds = "".join(k for _, _, k in its)
        exts = [_ext(sch, lp) for lp, _, _ in its]
        if _is_reduction(sch, b):
            has_red = True
            if not re.fullmatch(r"S+R+", kinds) or kinds.count("S") != len(row_ext):
                return False
            if exts[: len(row_ext)] != row_ext:
                return False
        else:
            if exts[: len(row_ext)] != row_ext or len(exts) > len(row_ext) + 1:
                return False
    if not has_red:
        return False
    loops = sch.get_loops(out)
    rows = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
    total = 1
    for e in row_ext:
        total *= e
    total *= _ext(sch, loops[-1])
    for b in reversed(blocks[:-1]):
        sch.compute_at(b, rows, preserve_unit_loops=True)
    _maybe_parallel(sch, rows, total, hw)
    for n in names:
        b = sch.get_sblock(n)
        if not _is_reduction(sch, b):
            _vectorize_last(sch, b, hw)
    return True


def _sched_general(sch, hw: _HW) -> str:
    _auto_inline(sch)
    names = _block_names(sch)
    gemms = [n for n in names if _gemm_operands(sch, sch.get_sblock(n)) is not None]
    rule = "injective"
    for n in names:
        if not _has_block(sch, n):
            continue  # inlined into a GEMM write-back
        b = sch.get_sblock(n)
        if n in gemms:
            _sched_gemm(sch, b, hw)
            rule = "gemm"
        elif _is_reduction(sch, b):
            _sched_reduction(sch, b, hw)
            if rule == "injective":
                rule = "reduction"
        else:
            _sched_injective(sch, b, hw)
    return rule


def _sched_safe(sch, hw: _HW) -> str:
    """Fallback: parallelize the outermost spatial loop of every root-level block."""
    for name in _block_names(sch):
        b = sch.get_sblock(name)
        loops = sch.get_loops(b)
        if not loops:
            continue
        ivs = sch.get(b).iter_vars
        if len(ivs) == len(loops) and int(ivs[0].iter_type) == 0 and _ext(sch, loops[0]) > 1:
            sch.parallel(loops[0])
    return "fallback-parallel"


def schedule_prim_func(func, target, hw: _HW | None = None):
    """Schedule one PrimFunc for CPU. Returns (new_func or None, rule_name)."""
    tvm = tvm_compat.tvm()
    from tvm import s_tir

    hw = hw or _hw_from_target(target)
    mod = tvm.IRModule({"main": func})
    errors = []
    for attempt in ("rowwise", "general", "safe"):
        sch = s_tir.Schedule(mod, debug_mask="all" if os.environ.get("AMP_SCHED_DEBUG") else 0)
        hw.pack = [] if hw.allow_pack else None
        try:
            if attempt == "rowwise":
                _auto_inline(sch)
                names = _block_names(sch)
                if any(_gemm_operands(sch, sch.get_sblock(n)) is not None for n in names):
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


def _is_scheduled(func) -> bool:
    attrs = func.attrs
    if attrs is None:
        return False
    for key in ("tirx.is_scheduled", "tir.is_scheduled"):
        if key in attrs and int(attrs[key]) == 1:
            return True
    return False


def _constant_call_args(mod) -> dict:
    """PrimFunc name -> indices of the arguments that are constants at every call_tir."""
    tvm = tvm_compat.tvm()
    relax = tvm.relax
    call_tir = tvm.ir.Op.get("relax.call_tir")
    seen: dict = {}
    for _gv, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        for block in getattr(func.body, "blocks", []):
            for binding in block.bindings:
                call = binding.value
                if not isinstance(call, relax.Call) or not call.op.same_as(call_tir):
                    continue
                name = call.args[0].name_hint
                consts = {k for k, a in enumerate(call.args[1].fields)
                          if _tname(a) in ("Constant", "GenericConst")}
                seen[name] = consts if name not in seen else (seen[name] & consts)
    return seen


def _rewrite_packed_callers(mod, packs: dict, updates: dict):
    """Wrap the packed arguments of call_tir(f, args) in relax layout_transform."""
    tvm = tvm_compat.tvm()
    relax = tvm.relax
    call_tir = tvm.ir.Op.get("relax.call_tir")

    @relax.expr_functor.mutator
    class _Rewriter(relax.PyExprMutator):
        def visit_call_(self, call):  # noqa: N802 - TVM visitor naming
            call = super().visit_call_(call)
            if not call.op.same_as(call_tir):
                return call
            name = call.args[0].name_hint
            if name not in packs:
                return call
            args = list(call.args[1].fields)
            for pidx, ndim, jv in packs[name]:
                args[pidx] = self.builder_.emit(
                    relax.op.layout_transform(args[pidx], _pack_map(ndim, jv)))
            return relax.Call(call.op, [gv_map[name], relax.Tuple(args)] + list(call.args[2:]),
                              call.attrs, call.ty_args, call.span)

    rw = _Rewriter(mod)
    gv_map = {}
    for gv, func in updates.items():
        if gv.name_hint in packs:
            gv_map[gv.name_hint] = rw.builder_.add_func(func, gv.name_hint + "_packed")
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            rw.builder_.update_func(gv, rw.visit_expr(func))
    return rw.builder_.get()


def cpu_schedule_passes(target) -> list:
    """Inserted into amp's relax pipeline right after FuseTIR (where CUDA's pipeline runs
    dlight.ApplyDefaultSchedule); schedules every PrimFunc for the llvm target.

    PrimFuncs already marked scheduled (e.g. by MetaScheduleApplyDatabase) are left alone.
    Counts per rule (and fallbacks) land in :data:`LAST_STATS`.
    """
    tvm = tvm_compat.tvm()
    if isinstance(target, dict):
        target = tvm.target.Target(target)

    @tvm.transform.module_pass(opt_level=0, name="AmpCpuSchedule")
    def _amp_cpu_schedule(mod, _ctx):
        hw = _hw_from_target(target)
        stats: dict = {"rules": {}, "fallback": [], "unscheduled": [], "pre_scheduled": 0}
        updates, packs = {}, {}
        const_args = _constant_call_args(mod)
        for gv, func in mod.functions_items():
            if not isinstance(func, tvm.tirx.PrimFunc):
                continue
            if _is_scheduled(func):
                stats["pre_scheduled"] += 1
                continue
            hw.packable = const_args.get(gv.name_hint, set())
            new, rule = schedule_prim_func(func, target, hw)
            if new is not None and hw.pack:
                packs[gv.name_hint] = list(hw.pack)
            stats["rules"][rule] = stats["rules"].get(rule, 0) + 1
            if rule == "fallback-parallel":
                stats["fallback"].append(gv.name_hint)
            if new is None:
                stats["unscheduled"].append(gv.name_hint)
                continue
            updates[gv] = new.with_attr("tirx.is_scheduled", True)
        for gv, func in updates.items():
            if gv.name_hint not in packs:  # (packed ones: see below; BlockBuilder.add_func
                mod[gv] = func              # would dedup against an in-place update)
        if packs:
            # packed functions change signature; a GlobalVar keeps the type it was created
            # with, so they are re-added under fresh GlobalVars and their call sites rewritten
            mod = _rewrite_packed_callers(mod, packs, updates)
            stats["packed_weights"] = sum(len(v) for v in packs.values())
        if packs:
            # legalize + fold the new layout_transforms; schedule what stays (non-constant)
            relax = tvm.relax
            mod = tvm.transform.Sequential([
                relax.transform.LegalizeOps(), relax.transform.FoldConstant(),
                relax.transform.DeadCodeElimination()])(mod)
            hw.allow_pack = False
            for gv, func in list(mod.functions_items()):
                if isinstance(func, tvm.tirx.PrimFunc) and not _is_scheduled(func):
                    new, rule = schedule_prim_func(func, target, hw)
                    stats["rules"][rule] = stats["rules"].get(rule, 0) + 1
                    if new is not None:
                        mod[gv] = new.with_attr("tirx.is_scheduled", True)
        LAST_STATS.clear()
        LAST_STATS.update(stats)
        return mod

    return [_amp_cpu_schedule]


def cpu_layout_passes(target=None) -> list:  # noqa: ARG001 - same signature as the others
    """Relax passes before legalization: inference-mode op decomposition (BatchNorm becomes
    elementwise ops that fuse into the conv epilogue) and NHWC/HWIO convolutions."""
    relax = tvm_compat.relax()
    return [
        relax.transform.DecomposeOpsForInference(),
        relax.transform.CanonicalizeBindings(),
        relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "HWIO"]}),
        relax.transform.CanonicalizeBindings(),
    ]


def cpu_relax_pipeline(target, extra_schedule_passes=None, *, convert_layout: bool = True,
                       fast_math: bool = False):
    """The whole Relax pipeline for llvm (what ``tvm.compile(..., relax_pipeline=...)`` takes).

    cpu_generic's library dispatch -> [layout passes] -> LegalizeOps -> AnnotateTIROpPattern ->
    FoldConstant -> FuseOps -> FuseTIR -> ``extra_schedule_passes`` (e.g. a MetaSchedule
    database) -> :func:`cpu_schedule_passes` -> cpu_generic's dataflow lowering + finalize.
    ``fast_math`` swaps exp/erf/tanh/softmax for TOPI's polynomial approximations (not
    bit-compatible; off by default).
    """
    tvm = tvm_compat.tvm()
    relax = tvm.relax
    from tvm.relax.backend.cpu_generic import pipeline as cpu_pipe

    if isinstance(target, dict):
        target = tvm.target.Target(target)
    extra = list(extra_schedule_passes or [])

    @tvm.transform.module_pass(opt_level=0, name="AmpCpuRelaxPipeline")
    def _pipeline(mod, _ctx):
        with target:
            passes = list(cpu_pipe.library_dispatch_passes(target))
            if fast_math:
                passes.append(relax.transform.FastMathTransform())
            if convert_layout:
                passes += cpu_layout_passes(target)
            passes += [
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FoldConstant(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
                relax.transform.DeadCodeElimination(),
            ]
            passes += extra
            passes += cpu_schedule_passes(target)
            passes += cpu_pipe.dataflow_lower_passes(target)
            passes += cpu_pipe.finalize_passes(target)
            mod = tvm.transform.Sequential(passes)(mod)
        return mod

    return _pipeline

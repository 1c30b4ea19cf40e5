"""What amp's CPU rules read off a kernel: the host's vector model and TIR/schedule queries
(loop extents, block iterators, GEMM operands, dtype widths)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ... import tvm_compat
from ...hardware import available_cores


@dataclass
class HostModel:
    vector_bits: int = 512
    num_regs: int = 32
    num_cores: int = 2
    parallel_min_work: int = 1 << 14  # loop-body instances below which we stay serial
    pack: list | None = None  # collects (param index, ndim, jv) weight packings of a func
    packable: set = field(default_factory=set)  # param indices that are constants
    allow_pack: bool = True
    # dynamic dims: name -> largest size (the module's ranges), to size symbolic loops
    dim_bounds: dict = field(default_factory=dict)


def host_model(target) -> HostModel:
    codegen = tvm_compat.llvm_codegen()

    bits = 128
    try:
        bits = int(codegen.llvm_get_vector_width(target))
    except Exception:  # noqa: BLE001
        pass
    if bits <= 0:
        bits = 128
    regs = 32 if bits >= 512 else 16
    cores = int(target.attrs.get("num-cores", 0) or 0) if hasattr(target, "attrs") else 0
    return HostModel(vector_bits=bits, num_regs=regs, num_cores=cores or available_cores())


def type_name(node) -> str:
    return type(node).__name__


def region_buffer(x):
    """The buffer of a region / load / store (TVM 0.27: a buffer-typed Var in `.source`)."""
    b = getattr(x, "buffer", None)
    return b if b is not None else x.source


def const_int(e) -> int | None:
    return int(e.value) if type_name(e) == "IntImm" else None


class SkipRule(Exception):
    """A rule does not apply."""


def loop_extent(sch, loop) -> int:

    e = const_int(sch.get(loop).extent)
    if e is None:
        raise SkipRule("dynamic extent")
    return e


def static_extent(sch, loop) -> int | None:
    """The loop's extent, or None when it is symbolic (a dynamic dim)."""
    return const_int(sch.get(loop).extent)


DEFAULT_DIM_BOUND = 64  # the size a symbolic dim of unknown range is assumed to have


def extent_bound(sch, loop, hw: HostModel) -> int:
    """The loop's extent, or for a symbolic one its value with each dynamic dim at its
    largest size (``hw.dim_bounds``): what work estimates use, never what splits rely on."""
    extent = sch.get(loop).extent
    e = const_int(extent)
    if e is not None:
        return e
    tvm = tvm_compat.tvm()
    ana = tvm_compat.analyzer()
    seen: dict = {}
    walk(extent, lambda n: seen.setdefault(str(n.name), n) if type_name(n) == "Var" else None)
    for name, var in seen.items():
        ana.bind(var, tvm.tirx.const(hw.dim_bounds.get(name, DEFAULT_DIM_BOUND),
                                     str(var.ty.dtype)))
    return const_int(ana.simplify(extent)) or DEFAULT_DIM_BOUND


def same_extent(a, b) -> bool:
    """Two loop extents (ints or symbolic expressions) provably equal."""
    ca, cb = const_int(a), const_int(b)
    if ca is not None or cb is not None:
        return ca == cb
    return bool(tvm_compat.analyzer().can_prove_equal(a, b))


def block_iters(sch, block):
    """(loop, iter_var, kind) per loop of a block; requires the one-loop-per-iter form that
    FuseTIR produces (extents equal, no predicate)."""

    blk = sch.get(block)
    loops = sch.get_loops(block)
    ivs = list(blk.iter_vars)
    if len(loops) != len(ivs):
        raise SkipRule("loops do not map 1:1 to block iters")
    out = []
    for lp, iv in zip(loops, ivs):
        if not same_extent(sch.get(lp).extent, iv.dom.extent):
            raise SkipRule("loop/iter extent mismatch")
        kind = {0: "S", 2: "R"}.get(int(iv.iter_type), "O")
        if kind == "O":
            raise SkipRule("opaque iter")
        out.append((lp, iv, kind))
    return out


def is_reduction(sch, block) -> bool:
    return any(int(iv.iter_type) == 2 for iv in sch.get(block).iter_vars)


def dtype_bits(dtype) -> int:
    tvm = tvm_compat.tvm()

    return tvm.runtime.DataType(str(dtype)).bits


def vector_lanes(hw: HostModel, dtype) -> int:
    b = dtype_bits(dtype)
    return max(1, hw.vector_bits // max(8, b))


def vectorizable(dtype) -> bool:
    s = str(dtype)
    return not (s == "bool" or s.startswith("uint1") or "x" in s)


def divisors_upto(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def pick_vector(n: int, lanes: int, max_regs: int = 4) -> int:
    """A split factor for a vectorized loop of extent n: a multiple of `lanes` up to
    max_regs registers when it divides n, else the largest divisor of n up to that width."""
    limit = lanes * max_regs
    if n <= limit:
        return n
    for k in range(max_regs, 0, -1):
        if n % (lanes * k) == 0:
            return lanes * k
    return max(divisors_upto(n, limit))


def walk(expr, fvisit) -> None:
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


def call_name(node) -> str:
    op = getattr(node, "op", None)
    return str(getattr(op, "name", "")) if op is not None else ""


def contains_if_then_else(stmt) -> bool:

    found = []
    value = getattr(stmt, "value", None)
    if value is None:
        return "if_then_else" in str(stmt)

    def visit(node):
        if type_name(node) == "Select" or call_name(node).endswith("if_then_else"):
            found.append(node)

    walk(value, visit)
    return bool(found)


def gemm_operands(sch, block):
    """If block is `C[s] = C[s] + f(A[..] * B[..])` return (C_store, [loads]), else None."""

    blk = sch.get(block)
    if not is_reduction(sch, block) or len(blk.writes) != 1:
        return None
    body = blk.body
    if not type_name(body) == "BufferStore":
        return None
    val = body.value
    if not type_name(val) == "Add":
        return None
    a, b = val.a, val.b
    if type_name(b) in ("BufferLoad", "TensorLoad") and region_buffer(b).same_as(body.buffer):
        a, b = b, a
    if not (type_name(a) in ("BufferLoad", "TensorLoad") and region_buffer(a).same_as(body.buffer)):
        return None
    loads, muls = [], []

    def strip(e):
        while type_name(e) == "Cast":
            e = e.value
        return e

    def is_load(e):
        return type_name(e) in ("BufferLoad", "TensorLoad")

    def visit(node):
        if is_load(node):
            loads.append(node)
        elif type_name(node) == "Mul":
            x, y = strip(node.a), strip(node.b)
            if is_load(x) and is_load(y) and not region_buffer(x).same_as(region_buffer(y)):
                muls.append(node)

    walk(b, visit)
    if not muls:
        return None
    return body, loads


def root_block(sch):
    return sch.get_sblock(sch.mod["main"].body.block.name_hint)


def block_names(sch) -> list[str]:
    return [sch.get(b).name_hint for b in sch.get_child_blocks(root_block(sch))]


def has_block(sch, name: str) -> bool:
    try:
        sch.get_sblock(name)
        return True
    except Exception:  # noqa: BLE001
        return False


def writes_param(sch, block) -> bool:
    params = {str(p.name) for p in sch.mod["main"].params}
    return any(str(region_buffer(w).name) in params for w in sch.get(block).writes)


def is_bf16_constant_store(stmt) -> bool:
    """``stmt`` stores a bfloat16 constant (e.g. max-pool's -inf init). TVM 0.27's
    BF16StorageLegalize does not rewrite a vector Broadcast of a bf16 constant (the build
    fails with "buffer's dtype is T.uint16 ... RHS's dtype is T.bfloat16x32"), so such
    stores stay scalar loops (LLVM still vectorizes the fill)."""
    tvm = tvm_compat.tvm()
    return (isinstance(stmt, tvm.tirx.BufferStore) and str(stmt.buffer.dtype) == "bfloat16"
            and isinstance(stmt.value, tvm.tirx.FloatImm))


def stores_bf16_constant(sch, block) -> bool:
    return is_bf16_constant_store(sch.get(block).body)


def expr_is_var(expr, var) -> bool:
    return type_name(expr) == "Var" and expr.same_as(var)


def written_elements(sch, block):
    """Elements of the buffer ``block`` writes: an int, or the shape when it is symbolic."""
    shape = list(region_buffer(sch.get(block).writes[0]).shape)
    try:
        return math.prod(int(d) for d in shape)
    except TypeError:
        return shape


def same_points(sch, producer, consumer) -> bool:
    """Whether ``consumer`` writes as many elements as ``producer`` does. TVM 0.27's
    reverse_compute_inline accepts a consumer that reads only part of its producer (a Slice
    dropping the last position, as wav2vec2's "same"-padded positional conv does) and then runs
    it over the producer's whole domain: the write-back writes one position past the
    consumer's buffer (rel L2 0.037 on wav2vec2 at fp32, corrupting whatever lies behind)."""
    a, b = written_elements(sch, producer), written_elements(sch, consumer)
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return tvm_compat.structural_hash(a) == tvm_compat.structural_hash(b)

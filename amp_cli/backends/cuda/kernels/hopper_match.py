"""Which fused PrimFuncs the Hopper GEMM kernels (``hopper_gemm``) take: an NT matmul
(A [..., K] with K contiguous, B [N, K], fp16/bf16, fp32 or same-type accumulation) followed
only by spatial blocks that end in one output of the matmul's shape, and the pieces of such a
function the kernel is written from (:class:`GemmMatch`). Symbolic rows are matched when asked
(N and K are always static)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .... import tvm_compat
from ....ir_attrs import IS_SCHEDULED, TIRX_KERNEL

IN_TYPES = {"float16": "f16", "bfloat16": "bf16"}
# output dtype -> (CUDA element type, two-element vector type, its constructor) for paired stores
PAIR_TYPES = {"float16": ("half", "half2", "make_half2"),
              "bfloat16": ("nv_bfloat16", "nv_bfloat162", "make_bfloat162"),
              "float32": ("float", "float2", "make_float2")}


@dataclass
class GemmMatch:
    a: object          # buffers of the original function
    b: object
    out: object
    c: object          # the matmul's result buffer (an intermediate, or ``out``)
    m: int
    n: int
    k: int
    in_dtype: str
    value: object      # the output block's stored value (after inlining the epilogue)
    iters: list        # the output block's iter vars, in output-index order


def int_value(e):
    return int(e.value) if hasattr(e, "value") else None


def static_extents(buf) -> list:
    """Static shape of a buffer (0.27: a buffer-typed Var), None for dynamic extents."""
    return [int_value(s) for s in buf.ty.shape]


def extents(buf) -> list:
    """A buffer's shape: ints where static, the PrimExprs of its symbolic extents."""
    return [tvm_compat.size_value(s) for s in buf.ty.shape]


def same_extents(x: list, y: list) -> bool:
    """Two shapes equal for every value of their shape variables."""
    return len(x) == len(y) and all(tvm_compat.prove_equal(a, b) for a, b in zip(x, y))


def dtype_of(buf) -> str:
    return str(buf.ty.dtype)


def loads(expr):
    found = []
    load_cls = tvm_compat.buffer_load_class()

    def on_load(load, mutator):
        found.append(load)
        return mutator.default_mutate(load)

    tvm_compat.structural_mutate(expr, [(load_cls, on_load)])
    return found


def same_vars(indices, vars_) -> bool:
    return len(indices) == len(vars_) and all(
        hasattr(i, "same_as") and i.same_as(v) for i, v in zip(indices, vars_))


def _strip_cast(e, dtype):
    T = tvm_compat.tirx()
    if isinstance(e, T.Cast) and str(e.ty.dtype) == dtype:
        return e.value
    return e


def match_gemm(func, symbolic: bool = False):
    """A :class:`GemmMatch` for a fused NT-GEMM PrimFunc, or a string saying why not.
    ``symbolic``: the rows (A's and the output's leading dims) may be symbolic; N and K never."""
    tvm, T = tvm_compat.tvm(), tvm_compat.tirx()
    get_root_block = tvm_compat.dlight_analysis().get_root_block

    if func.attrs and (func.attrs.get(IS_SCHEDULED) or func.attrs.get(TIRX_KERNEL)):
        return "already scheduled"
    try:
        sch = tvm.s_tir.Schedule(func)
        blocks = sch.get_child_blocks(get_root_block(sch))
    except Exception as exc:  # noqa: BLE001 - not a block-structured PrimFunc
        return f"no blocks ({type(exc).__name__})"
    if len(blocks) < 1:
        return "no blocks"
    mm = sch.get(blocks[0])
    kinds = [iv.iter_type for iv in mm.iter_vars]
    spatial = [iv.var for iv in mm.iter_vars if iv.iter_type == 0]
    reduce_ = [iv.var for iv in mm.iter_vars if iv.iter_type == 2]
    if len(reduce_) != 1 or kinds[-1] != 2 or len(spatial) < 2:
        return "first block is not a matmul with one reduction axis last"
    kv = reduce_[0]
    store = mm.body
    if not isinstance(store, T.BufferStore) or not same_vars(store.indices, spatial):
        return "matmul does not store at its spatial iterators"
    c = store.buffer
    if mm.init is None or not isinstance(mm.init, T.BufferStore) or int_value(mm.init.value) != 0:
        return "matmul init is not zero"
    acc_type = dtype_of(c)
    value = store.value
    if not isinstance(value, T.Add):
        return "matmul update is not an add"
    lhs, rhs = value.a, value.b
    load_cls = tvm_compat.buffer_load_class()
    if not (isinstance(lhs, load_cls) and lhs.source.same_as(c)):
        return "matmul update does not read its accumulator"
    if not isinstance(rhs, T.Mul):
        return "matmul update is not a product"
    x, w = _strip_cast(rhs.a, acc_type), _strip_cast(rhs.b, acc_type)
    if not (isinstance(x, load_cls) and isinstance(w, load_cls)):
        return "matmul operands are not plain loads"
    a, b = x.source, w.source
    in_dtype = dtype_of(a)
    if in_dtype not in IN_TYPES or dtype_of(b) != in_dtype:
        return f"operand types {dtype_of(a)}/{dtype_of(b)}"
    if acc_type not in ("float32", in_dtype):
        return f"accumulator type {acc_type}"
    if not same_vars(x.indices, spatial[:-1] + [kv]) or not same_vars(w.indices, [spatial[-1], kv]):
        return "not an NT matmul (A[..., k] and B[n, k])"
    shape = extents(c)
    k = int_value(mm.iter_vars[-1].dom.extent)
    n = shape[-1]
    if None in static_extents(b) or k is None or not isinstance(n, int):
        return "dynamic N or K"
    if not symbolic and not all(isinstance(e, int) for e in shape + extents(a)):
        return "dynamic shape"
    m = math.prod(shape[:-1])
    if not same_extents(extents(a), shape[:-1] + [k]) or static_extents(b) != [n, k]:
        return "operand shapes do not match the output"
    params = list(func.params)

    def is_param(v):
        return any(v.same_as(p) for p in params)
    # The tail: spatial blocks of the output's shape; all but the last get inlined into it.
    for blk in blocks[1:]:
        if any(iv.iter_type != 0 for iv in sch.get(blk).iter_vars):
            return "a non-spatial block after the matmul"
    try:
        for blk in blocks[1:-1]:
            sch.compute_inline(blk)
    except Exception as exc:  # noqa: BLE001
        return f"epilogue does not inline ({type(exc).__name__})"
    remaining = sch.get_child_blocks(get_root_block(sch))
    if len(remaining) > 2:
        return "epilogue did not inline into one block"
    last = sch.get(remaining[-1])
    if len(blocks) == 1:
        out, iters = c, spatial
        value_expr = None
    else:
        ostore = last.body
        iters = [iv.var for iv in last.iter_vars]
        if not isinstance(ostore, T.BufferStore) or not same_vars(ostore.indices, iters):
            return "epilogue does not store at its iterators"
        out = ostore.buffer
        if not same_extents(extents(out), shape):
            return "epilogue output shape differs from the matmul's"
        value_expr = ostore.value
        for ld in loads(value_expr):
            if ld.source.same_as(c):
                if not same_vars(ld.indices, iters):
                    return "epilogue reads the matmul at other indices"
            elif not is_param(ld.source) or any(ld.source.same_as(v) for v in (a, b, out)):
                return f"epilogue reads {ld.source}"
    if not is_param(out) or dtype_of(out) not in PAIR_TYPES:
        return "output is not a float parameter"
    return GemmMatch(a, b, out, c, m, n, k, in_dtype, value_expr, iters)

"""GEMM shape analysis shared by amp's GEMM rule and kernels: dlight's view of a matmul-like
PrimFunc as [S, I, J, K] extents."""
from __future__ import annotations

from .... import tvm_compat

# M of a symbolic GEMM when the ranges' optima do not give it: a few waves of mid-size tiles
SYMBOLIC_M_GUESS = 1024


def size_at_optimum(size, dims: dict | None, guess: int) -> int:
    """A symbolic size's value at the ranges' optima (``dims``: {dim: optimum}), else
    ``guess``: what a kernel serving every size plans its tile for."""
    value = tvm_compat.size_upper_bound(size, dims or {})
    return value if isinstance(value, int) and value >= 1 else guess


def gemm_shape(func, symbolic: bool = False):
    """(dtype_in, dtype_out, batch, [M, N, K]) of a matmul-like PrimFunc, static extents as ints
    and dynamic ones as None (``symbolic``: as their PrimExprs), or None when it is not one (the
    analysis dlight's rules use)."""
    tvm = tvm_compat.tvm()
    get_root_block = tvm_compat.dlight_analysis().get_root_block
    dm = tvm_compat.dlight_matmul()

    try:
        sch = tvm.s_tir.Schedule(func)
        blocks = sch.get_child_blocks(get_root_block(sch))
        reductions = dm.get_reduction_blocks(sch, blocks)
        if reductions is None:
            return None
        block = sch.get(reductions[0])
        maps = dm.get_index_map(block)
        if maps is None:
            return None
        dom = [iv.dom.extent for iv in block.iter_vars]
        extents = maps[0].map_shape(dom)  # -> [S, I, J, K]
        in_dtype, out_dtype = dm.get_in_out_dtypes(block)
    except Exception:  # noqa: BLE001 - not a GEMM dlight understands
        return None
    sizes = [int(e.value) if hasattr(e, "value") else (e if symbolic else None)
             for e in list(extents)]
    return str(in_dtype), str(out_dtype), sizes[0], sizes[1:]


def gemm_extents(func):
    """(dtype_in, dtype_out, [M, N, K]) of a matmul-like PrimFunc (see :func:`gemm_shape`)."""
    info = gemm_shape(func)
    return None if info is None else (info[0], info[1], info[3])

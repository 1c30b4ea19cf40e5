"""TIR kernels for the lane matrix (tests/test_legalize.py, the gpu test, benchmarks).

Each kernel vectorizes its innermost axis with exactly ``lanes`` lanes. ``thread`` is the
thread axis the outer loop is bound to ("threadIdx.x" for CUDA) or None for a serial loop
(CPU runs, used to check the legalized TIR computes the same values). ``pad`` > lanes gives
each thread a ``pad``-element row, so vector pieces can be aligned (4+2+1 for 7 lanes, pad 8).
"""
from __future__ import annotations

import numpy as np
from tvm.script import tirx as T

KINDS = ("elementwise", "cast", "copy", "reduce_epilogue")
EXTRA_KINDS = ("select_call",)
THREADS = 8
K = 4


def _loop(thread, extent):
    return T.thread_binding(extent, thread=thread) if thread else T.serial(extent)


def make_kernel(kind: str, dtype: str, lanes: int, thread: str | None = "threadIdx.x",
                pad: int | None = None):
    pad = pad or lanes
    n = THREADS * pad
    th = THREADS

    if kind == "copy":
        @T.prim_func(s_tir=True)
        def f(A: T.Buffer((n,), dtype), B: T.Buffer((n,), dtype)):
            T.func_attr({"global_symbol": "main", "tir.noalias": True})
            for i in _loop(thread, th):
                for j in T.vectorized(lanes):
                    with T.sblock("B"):
                        v = T.axis.spatial(n, i * pad + j)
                        B[v] = A[v]
        return f
    if kind == "elementwise":
        @T.prim_func(s_tir=True)
        def f(A: T.Buffer((n,), dtype), B: T.Buffer((n,), dtype)):
            T.func_attr({"global_symbol": "main", "tir.noalias": True})
            for i in _loop(thread, th):
                for j in T.vectorized(lanes):
                    with T.sblock("B"):
                        v = T.axis.spatial(n, i * pad + j)
                        B[v] = T.max(A[v] * T.Cast(dtype, 2.0) + T.Cast(dtype, 0.5),
                                     T.Cast(dtype, -4.0))
        return f
    if kind == "select_call":
        @T.prim_func(s_tir=True)
        def f(A: T.Buffer((n,), dtype), B: T.Buffer((n,), dtype)):
            T.func_attr({"global_symbol": "main", "tir.noalias": True})
            for i in _loop(thread, th):
                for j in T.vectorized(lanes):
                    with T.sblock("B"):
                        v = T.axis.spatial(n, i * pad + j)
                        B[v] = T.Select(A[v] > T.Cast(dtype, 0.0), T.exp(A[v]),
                                        A[v] * T.Cast(dtype, 0.5))
        return f
    if kind == "cast":
        @T.prim_func(s_tir=True)
        def f(A: T.Buffer((n,), dtype), X: T.Buffer((n,), "float32"),
              B: T.Buffer((n,), "float32"), Y: T.Buffer((n,), dtype)):
            T.func_attr({"global_symbol": "main", "tir.noalias": True})
            for i in _loop(thread, th):
                for j in T.vectorized(lanes):
                    with T.sblock("B"):
                        v = T.axis.spatial(n, i * pad + j)
                        B[v] = T.Cast("float32", A[v])
                for j in T.vectorized(lanes):
                    with T.sblock("Y"):
                        v = T.axis.spatial(n, i * pad + j)
                        Y[v] = T.Cast(dtype, X[v])
        return f
    if kind == "reduce_epilogue":
        @T.prim_func(s_tir=True)
        def f(A: T.Buffer((K, n), dtype), B: T.Buffer((n,), dtype)):
            T.func_attr({"global_symbol": "main", "tir.noalias": True})
            acc = T.alloc_buffer((n,), "float32", scope="local")
            for i in _loop(thread, th):
                for k in range(K):
                    for j in T.vectorized(lanes):
                        with T.sblock("acc"):
                            vk = T.axis.reduce(K, k)
                            v = T.axis.spatial(n, i * pad + j)
                            with T.init():
                                acc[v] = T.float32(0)
                            acc[v] = acc[v] + T.Cast("float32", A[vk, v])
                for j in T.vectorized(lanes):
                    with T.sblock("B"):
                        v = T.axis.spatial(n, i * pad + j)
                        B[v] = T.Cast(dtype, acc[v] * T.float32(0.5))
        return f
    raise ValueError(kind)


def np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def make_inputs(kind: str, dtype: str, lanes: int, pad: int | None = None, seed: int = 0):
    """Inputs (numpy) and the expected outputs, in kernel-argument order. Output arrays are
    pre-filled with a sentinel so untouched padding must stay untouched."""
    pad = pad or lanes
    n = THREADS * pad
    rng = np.random.default_rng(seed)
    nd = np_dtype(dtype)
    written = np.zeros(n, bool)
    for i in range(THREADS):
        written[i * pad:i * pad + lanes] = True
    sentinel = 7.0

    def vals(shape):  # small values exactly representable in bf16/fp16
        return (rng.integers(-64, 64, size=shape) / 8.0).astype(np.float32)

    def out(shape, dt):
        return np.full(shape, sentinel, dtype=dt)

    if kind == "copy":
        a = vals(n).astype(nd)
        exp = out(n, nd)
        exp[written] = a[written]
        return [a, out(n, nd)], {1: exp}
    if kind == "elementwise":
        a = vals(n).astype(nd)
        exp = out(n, nd)
        r = np.maximum(a.astype(np.float32) * 2 + 0.5, -4.0).astype(nd)
        exp[written] = r[written]
        return [a, out(n, nd)], {1: exp}
    if kind == "select_call":
        a = vals(n).astype(nd)
        af = a.astype(np.float32)
        r = np.where(af > 0, np.exp(af), af * 0.5).astype(nd)
        exp = out(n, nd)
        exp[written] = r[written]
        return [a, out(n, nd)], {1: exp}
    if kind == "cast":
        a = vals(n).astype(nd)
        x = (rng.standard_normal(n) * 3).astype(np.float32)
        e_b = out(n, np.float32)
        e_b[written] = a.astype(np.float32)[written]
        e_y = out(n, nd)
        e_y[written] = x.astype(nd)[written]
        return [a, x, out(n, np.float32), out(n, nd)], {2: e_b, 3: e_y}
    if kind == "reduce_epilogue":
        a = vals((K, n)).astype(nd)
        r = (a.astype(np.float32).sum(axis=0) * 0.5).astype(nd)
        exp = out(n, nd)
        exp[written] = r[written]
        return [a, out(n, nd)], {1: exp}
    raise ValueError(kind)

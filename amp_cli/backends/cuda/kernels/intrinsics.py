"""Tensor-core intrinsics: TVM's (registered on import of its intrinsic module) and amp's bf16
wmma variants, which TVM lacks (see ``rules/matmul.py``'s docstring)."""
from __future__ import annotations

import contextlib
import functools

from .... import tvm_compat


@functools.lru_cache(maxsize=None)
def register_bf16_wmma() -> dict:
    """Register bf16 16x16x16 wmma intrinsics (shared.dyn loads, B transposed, fp32 accumulate)
    built with TVM's own generators; returns the intrinsic group MatmulTensorization uses."""
    TensorIntrin = tvm_compat.tensor_intrin_class()
    tc = tvm_compat.cuda_tensor_intrin()

    group = {
        "init": tc.WMMA_FILL_16x16x16_F32_INTRIN,
        "load_a": "amp_wmma_load_16x16x16_bf16_a_shared_dyn",
        "load_b": "amp_wmma_load_16x16x16_bf16_b_trans_shared_dyn",
        "compute": "amp_wmma_sync_16x16x16_bf16bf16f32_trans",
        "store": tc.WMMA_STORE_16x16x16_F32_SHARED_DYN_INTRIN,
    }
    TensorIntrin.register(group["load_a"], *tc.get_wmma_load_intrin(
        16, 16, 16, "bfloat16", "shared.dyn", False, False), override=True)
    TensorIntrin.register(group["load_b"], *tc.get_wmma_load_intrin(
        16, 16, 16, "bfloat16", "shared.dyn", True, True), override=True)
    TensorIntrin.register(group["compute"], *tc.get_wmma_sync_intrin(
        16, 16, 16, "bfloat16", "float32", True), override=True)
    return group


@functools.lru_cache(maxsize=None)  # once per process
def register_tensor_intrinsics() -> None:
    """Register TVM's tensor intrinsics (wmma, mma, ...) and amp's bf16 wmma ones. Schedules and
    tuning records refer to them by name, so a process must do this before it reads records or
    builds tensor-core candidates."""
    tvm_compat.cuda_tensor_intrin()  # importing registers them
    register_bf16_wmma()


@contextlib.contextmanager
def bf16_intrinsics():
    """While active, MatmulTensorization's f16 intrinsic lookups return the bf16 group (it imports
    ``get_wmma_intrin_group`` from the module at call time)."""
    tc = tvm_compat.cuda_tensor_intrin()
    group = register_bf16_wmma()
    original = tc.get_wmma_intrin_group

    def lookup(load_scope, store_scope, in_dtype, out_dtype, trans_b):
        if in_dtype == "float16" and out_dtype == "float32" and load_scope == "shared.dyn" \
                and store_scope == "shared.dyn" and trans_b:
            return dict(group)
        # anything else (e.g. its f16-accumulate retry) has no bf16 intrinsic: fail to tensorize
        return original(load_scope, store_scope, in_dtype, out_dtype, trans_b)

    tc.get_wmma_intrin_group = lookup
    try:
        yield
    finally:
        tc.get_wmma_intrin_group = original

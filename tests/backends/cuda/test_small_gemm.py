"""amp's few-rows GEMM schedule (schedule/small_gemm.py): which GEMMs it takes, that they build
for CUDA with lane-split K and warp-shuffle reductions (CI, no GPU), and values on the GPU."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.kernels import small_gemm  # noqa: E402
from amp_cli.backends.cuda.rules.matmul import AmpMatmul
from amp_cli.backends.cuda.kernels.analysis import gemm_shape  # noqa: E402
from test_tc_gemm import _run, build, gemm  # noqa: E402

SM90 = {"kind": "cuda", "arch": "sm_90"}


def amp_rule(func, target=SM90, **kw):
    target = tvm.target.Target(target)
    with target:
        sch = AmpMatmul(**kw).apply(func, target, False)
    return None if sch is None else sch.mod["main"]


def small(func, cfg=None, sm=90):
    _, _, batch, sizes = gemm_shape(func)
    sch = small_gemm.schedule_small_m(func, batch, sizes, sm, cfg)
    return None if sch is None else sch.mod["main"]


# ------------------------------------------------------------------ CUDA builds (CI, no GPU)
@pytest.mark.parametrize("m,n,k,dtype,vec_load", [
    (8, 1000, 2048, "float16", "uint4"),     # ResNet-50's classifier at batch 8
    (16, 4096, 1024, "float16", "uint4"),
    (2, 64, 64, "float16", "uint1"),         # K=64: two lanes' worth of fp16 per load
    (4, 256, 512, "bfloat16", "uint4"),
    (8, 1000, 2048, "float32", "float4"),
])
def test_amp_matmul_takes_few_row_gemms(m, n, k, dtype, vec_load):
    acc = "float32"
    func = amp_rule(gemm(m, n, k, dtype=dtype, acc=acc, bias=True))
    src = tvm_compat.cuda_source(build(func, "sm_90"))
    assert "__shfl_down_sync" in src           # lanes' partial sums reduced by shuffles
    assert vec_load in src                     # K read as one vector per lane and row
    assert "mma_sync" not in src


def test_same_gemm_without_the_rule_is_dlights_simt_matmul():
    """Stock behaviour for M=8 (what the H200 profile measured at ~0.12 ms): no shuffles."""
    func = amp_rule(gemm(8, 1000, 2048, bias=True), own_gemm=False)
    assert "__shfl_down_sync" not in tvm_compat.cuda_source(build(func, "sm_90"))


@pytest.mark.parametrize("batch,sizes", [
    (1, [1, 1000, 2048]),      # a GEMV: dlight's GEMV rule
    (1, [17, 1000, 2048]),     # too many rows for the per-lane accumulators
    (1, [8, 1000, None]),      # dynamic K
    (None, [8, 1000, 2048]),   # dynamic batch
    (1, [8, 2, 2048]),         # too few columns
])
def test_applies_only_to_static_few_row_gemms(batch, sizes):
    assert not small_gemm.applies(batch, sizes)


def test_declines_k_that_lanes_cannot_split_evenly():
    assert small(gemm(8, 256, 2056)) is None   # 2056 = 8 * 257: not a multiple of 32 lanes
    assert amp_rule(gemm(8, 256, 2056)) is not None  # dlight's rule still schedules it


def test_declines_k_strided_operand():
    """B stored [K, N] (an un-transposed ONNX weight): a lane's 16 bytes along K would gather."""
    assert small(gemm(8, 256, 512, b_layout="KN")) is None


def test_ragged_n_and_epilogue_build():
    # N not a multiple of warps x columns: predicated; bias + relu fused into the store
    func = small(gemm(8, 1001, 512, bias=True, relu=True))
    src = tvm_compat.cuda_source(build(func, "sm_90"))
    assert "max(" in src and "__shfl_down_sync" in src


@pytest.mark.parametrize("m,n,sms,cols", [(8, 1000, 132, 1), (8, 8192, 132, 4),
                                          (16, 8192, 132, 2), (8, 4096, 132, 2)])
def test_columns_per_warp_keep_two_ctas_per_sm(m, n, sms, cols):
    assert small_gemm.cols_per_warp(m, n, sms) == cols


# ------------------------------------------------------------------ numerics (GPU)
@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA device")
@pytest.mark.parametrize("m,n,k,cfg", [
    (8, 1000, 2048, None), (16, 4096, 1024, None), (3, 1001, 512, None), (2, 64, 64, None),
    (8, 1000, 2048, small_gemm.SmallConfig(warps=8, cols=2, unroll_k=False)),
])
def test_matches_float64_reference(m, n, k, cfg):
    """bias + relu fused, fp16 in/out: rel L2 vs float64 below 2e-3 (the fp16 output rounding
    alone is ~3e-4; a wrong lane split or reduction gives O(1))."""
    rng = np.random.default_rng(7)
    a = rng.standard_normal((m, k)).astype("float16")
    b = rng.standard_normal((n, k)).astype("float16")
    bias = rng.standard_normal(n).astype("float32")
    ref = np.maximum(a.astype("float64") @ b.astype("float64").T + bias, 0)
    sm = int(tvm_compat.cuda_compute_version().replace(".", ""))
    func = small(gemm(m, n, k, bias=True, relu=True), cfg, sm)
    out = _run(func, [a, b, bias], (m, n), "float16").astype("float64")
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA device")
def test_fp32_matches_float64_reference():
    rng = np.random.default_rng(8)
    a = rng.standard_normal((8, 2048)).astype("float32")
    b = rng.standard_normal((1000, 2048)).astype("float32")
    ref = a.astype("float64") @ b.astype("float64").T
    sm = int(tvm_compat.cuda_compute_version().replace(".", ""))
    func = small(gemm(8, 1000, 2048, dtype="float32"), None, sm)
    out = _run(func, [a, b], (8, 1000), "float32").astype("float64")
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


# ------------------------------------------------------------------ in amp's CUDA pipeline
def _classifier(arrays=None):
    """ResNet-50's head at batch 8 as amp's fp16 conversion leaves it: an ONNX [K, N] weight."""
    from test_matmul_nt import _linear_module

    return _linear_module(m=8, k=2048, n=1000, seed=4, arrays=arrays)


def _lower(mod, arch, **switches):
    from amp_cli.backends.cuda.pipeline import cuda_relax_pipeline

    tgt = tvm.target.Target({"kind": "cuda", "arch": arch})
    with tgt:
        return tgt, cuda_relax_pipeline(tgt, cuda_graph=False, **switches)(mod)


@pytest.mark.parametrize("on", [True, False])
def test_classifier_head_gets_the_rule_in_amps_pipeline(on):
    """matmul_nt makes the weight [N, K], so the lanes' K vectors are contiguous; the head's
    kernel (bias and cast fused) then reduces with shuffles. cuda.small_gemm off: dlight's."""
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline

    tgt, lowered = _lower(_classifier(), "sm_90", small_gemm=on)
    ex = tvm_compat.compile_relax(lowered, tgt, relax_pipeline=None,
                                  tir_pipeline=cuda_tir_pipeline(tgt, []))
    src = tvm_compat.cuda_source(ex)
    assert ("__shfl_down_sync" in src) == on


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA device")
def test_classifier_head_on_gpu_matches_float64_reference():
    """The whole head through amp's pipeline on the GPU: rel L2 vs float64 below 2e-3."""
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline

    relax = tvm_compat.relax()
    arrays = {}
    sm = tvm_compat.cuda_compute_version().replace(".", "")
    tgt, lowered = _lower(_classifier(arrays), f"sm_{sm}")
    ex = tvm_compat.compile_relax(lowered, tgt, relax_pipeline=None,
                                  tir_pipeline=cuda_tir_pipeline(tgt, []))
    dev = tvm.cuda(0)
    x = np.random.default_rng(5).uniform(-1, 1, (8, 2048)).astype("float16")
    got = relax.VirtualMachine(ex, dev)["main"](tvm.runtime.tensor(x, dev)).numpy()
    ref = x.astype(np.float64) @ arrays["w"].astype(np.float64) + arrays["bias"]
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-3

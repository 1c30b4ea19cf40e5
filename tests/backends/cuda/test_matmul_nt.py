"""Matmuls in NT form (amp_cli.backends.cuda.rewrites.matmul_nt): what is rewritten, that values are kept, and
that every GEMM of a BERT layer then gets amp's cp.async tensor-core schedule (CUDA codegen, no
GPU needed)."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.rewrites.matmul_nt import matmul_to_nt  # noqa: E402


def _attention_module(dtype="float16", b=2, s=32, h=2, d=16):
    """x @ W (constant), then q @ k^T and p @ v on head-split transposes, as ONNX exports them."""
    relax = tvm_compat.relax()
    rng = np.random.default_rng(0)
    hid = h * d
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((b * s, hid), dtype))
    w = relax.const((0.2 * rng.standard_normal((hid, 3 * hid))).astype(dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            qkv = bb.emit(relax.op.matmul(x, w, out_dtype="float32"))
            qkv = bb.emit(relax.op.astype(qkv, dtype))
            q, k, v = (bb.emit(relax.op.strided_slice(qkv, [1], [i * hid], [(i + 1) * hid]))
                       for i in range(3))
            heads = [bb.emit(relax.op.reshape(t, (b, s, h, d))) for t in (q, k, v)]
            qh = bb.emit(relax.op.permute_dims(heads[0], [0, 2, 1, 3]))
            kt = bb.emit(relax.op.permute_dims(heads[1], [0, 2, 3, 1]))  # k^T in one transpose
            vh = bb.emit(relax.op.permute_dims(heads[2], [0, 2, 1, 3]))
            sc = bb.emit(relax.op.matmul(qh, kt, out_dtype="float32"))
            p = bb.emit(relax.op.astype(relax.op.nn.softmax(sc, axis=-1), dtype))
            ctx = bb.emit(relax.op.matmul(p, vh, out_dtype="float32"))
            out = bb.emit_output(ctx)
        bb.emit_func_output(out)
    return bb.get()


def _run_llvm(mod, x):
    ex = tvm.compile(mod, target="llvm")
    vm = tvm_compat.relax_vm(ex, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def test_constant_weights_and_attention_operands_become_nt():
    new, counts = matmul_to_nt(_attention_module())
    assert counts == {"constant": 1, "transposed": 2, "split_k": 0}
    text = new.script()
    assert "R.matmul" not in text and text.count("amp_matmul_nt") >= 3


def test_rewrite_keeps_values():
    """Same result as the original module on random inputs (both fp16 in, fp32 accumulation;
    only the summation order may differ): rel L2 below 1e-3."""
    mod = _attention_module()
    new, _ = matmul_to_nt(mod)
    x = np.random.default_rng(1).standard_normal((64, 32)).astype("float16")
    ref, got = _run_llvm(mod, x), _run_llvm(new, x)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-3


def test_fp32_and_non_transpose_operands_are_left_alone():
    mod = _attention_module(dtype="float32")
    assert matmul_to_nt(mod)[0].same_as(mod)


def test_bert_layer_gemms_all_get_amp_tensor_core_schedule(fp16_encoder_layer):
    """Every GEMM of an encoder layer (QKV/out/FFN projections with [K, N] weights, q@k^T, p@v)
    reads K-contiguous operands after the rewrite, so each one gets tc_gemm's cp.async pipeline
    (before it, the weights' copies were strided and TVM's cp.async injection corrupted them)."""
    from amp_cli.compile import relax_pipeline
    from amp_cli.config import CudaConfig
    from amp_cli.target import resolve_target

    mod = fp16_encoder_layer
    target = resolve_target("cuda:sm_90")
    # q@k^T and p@v (K = 64) unfused: the padding-aware choice gives them a 64x64 tile with
    # K in one 64-deep step, which needs no pipeline; the wider tiles pipeline two 32-deep steps
    unfused = CudaConfig(fused_attention=False, padding_aware_tiles=False)
    for cuda, count in ((unfused, 6), (None, 4)):
        with target.tvm_target():
            lowered = relax_pipeline(target, cuda=cuda)(mod)
        gemms = [gv.name_hint for gv, f in lowered.functions.items()
                 if isinstance(f, tvm_compat.prim_func_class()) and "matmul" in gv.name_hint]
        pipelined = [gv.name_hint for gv, f in lowered.functions.items()
                     if isinstance(f, tvm_compat.prim_func_class())
                     and "software_pipeline_async_stages" in f.script()]
        # 8 GEMMs (q/k/v combined into one by combine_gemm: 6), 6 distinct PrimFuncs; with
        # fused attention q@k^T and p@v are inside the attention kernel: 4
        assert len(gemms) == count and sorted(pipelined) == sorted(gemms), cuda


# ------------------------------------------------------------------------------------ split-K
def _linear_module(m=96, k=512, n=48, seed=0, arrays=None):
    """astype(x @ W, fp16) + bias for a constant W[K, N] (fp16 in, fp32 accumulation); W and
    the bias go into ``arrays`` when given."""
    relax = tvm_compat.relax()
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype("float16")
    bias = rng.standard_normal(n).astype("float16")
    if arrays is not None:
        arrays.update(w=w, bias=bias)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.const(w), out_dtype="float32"))
            y = bb.emit(relax.op.add(relax.op.astype(y, "float16"), relax.const(bias)))
            gv = bb.emit_output(relax.op.astype(y, "float32"))
        bb.emit_func_output(gv)
    return bb.get()


def test_split_k_factor_heuristic():
    from amp_cli.backends.cuda.kernels.tc_gemm import split_k_factor

    assert split_k_factor(1, 1024, 1024, 4096, 90) == 2   # BERT-large FFN down: 64 -> 128 CTAs
    assert split_k_factor(1, 1024, 1024, 1024, 90) == 1   # K/2 = 512: partials cost more
    assert split_k_factor(1, 1024, 4096, 1024, 90) == 1   # already fills the GPU
    assert split_k_factor(1, 512, 1024, 4096, 90) == 4
    assert split_k_factor(1, 1024, 1024, 4100, 90) == 1   # K not divisible into whole tiles


@pytest.mark.parametrize("factor", [2, 4])
def test_split_k_keeps_values(monkeypatch, factor):
    """K split into 2 or 4 partial sums (fp32) added up: equal to the unsplit GEMM to fp32
    rounding (rel 1e-5), on random inputs."""
    from amp_cli.backends.cuda.kernels import tc_gemm

    monkeypatch.setattr(tc_gemm, "split_k_factor", lambda *a: factor)
    mod = _linear_module()
    new, counts = matmul_to_nt(mod, sm=90, split_k=True)
    assert counts["split_k"] == 1 and "amp_matmul_nt_split" in new.script()
    plain, _ = matmul_to_nt(mod, sm=90, split_k=False)
    assert "amp_matmul_nt_split" not in plain.script()
    x = np.random.default_rng(1).uniform(-1, 1, (96, 512)).astype("float16")
    ref, got = _run_llvm(mod, x).astype(np.float64), _run_llvm(new, x).astype(np.float64)
    assert np.count_nonzero(ref) > 0.99 * ref.size
    # fp16 output: the fp32 sums may differ in their last bits and round to neighbouring fp16
    # values, so the bound is one fp16 ulp of the largest output
    np.testing.assert_allclose(got, ref, rtol=0, atol=2 ** -10 * np.abs(ref).max())


def test_split_k_gemm_is_a_tensor_core_kernel_with_the_epilogue_in_the_sum():
    """sm_90: BERT-large's FFN-down shape (1024 x 1024, K=4096) splits in two; the partial GEMM
    gets amp's cp.async wmma schedule and the cast/bias epilogue fuses into the sum kernel."""
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline
    from amp_cli.backends.cuda.pipeline import cuda_relax_pipeline

    mod = _linear_module(m=1024, k=4096, n=1024)
    tgt = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with tgt:
        lowered = cuda_relax_pipeline(tgt, split_k=True, cuda_graph=False)(mod)
    funcs = {gv.name_hint: f for gv, f in lowered.functions.items()
             if isinstance(f, tvm_compat.prim_func_class())}
    split = [n for n in funcs if "amp_matmul_nt_split" in n]
    sums = [n for n in funcs if "split_k_sum" in n]
    assert len(split) == 1 and len(sums) == 1, sorted(funcs)
    assert "software_pipeline_async_stages" in funcs[split[0]].script()
    assert "add" in sums[0] and "cast" in sums[0], sums  # the epilogue rides on the sum
    assert [int(d) for d in funcs[split[0]].params[-1].shape] == [2, 1024, 1024]
    ex = tvm_compat.compile_relax(lowered, tgt, relax_pipeline=None,
                                  tir_pipeline=cuda_tir_pipeline(tgt, []))
    assert "mma_sync" in tvm_compat.cuda_source(ex)


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA device")
def test_split_k_on_gpu_matches_fp32_reference():
    """The split FFN-down GEMM (1024 x 1024, K=4096, S=2) on the GPU against numpy fp32 of the
    same fp16 inputs: rel L2 below 2e-3 (fp16 output rounding alone is ~3e-4)."""
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline
    from amp_cli.backends.cuda.pipeline import cuda_relax_pipeline

    relax = tvm_compat.relax()
    arrays = {}
    mod = _linear_module(m=1024, k=4096, n=1024, seed=2, arrays=arrays)
    sm = tvm_compat.cuda_compute_version().replace(".", "")
    tgt = tvm.target.Target({"kind": "cuda", "arch": f"sm_{sm}"})
    with tgt:
        lowered = cuda_relax_pipeline(tgt, split_k=True)(mod)
    assert any("amp_matmul_nt_split" in gv.name_hint for gv in lowered.get_global_vars())
    ex = tvm_compat.compile_relax(lowered, tgt, relax_pipeline=None,
                                  tir_pipeline=cuda_tir_pipeline(tgt, []))
    dev = tvm.cuda(0)
    vm = relax.VirtualMachine(ex, dev)
    x = np.random.default_rng(3).uniform(-1, 1, (1024, 4096)).astype("float16")
    got = vm["main"](tvm.runtime.tensor(x, dev)).numpy().astype(np.float64)
    w, bias = (arrays[n].astype(np.float64) for n in ("w", "bias"))
    ref = x.astype(np.float64) @ w + bias
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-3

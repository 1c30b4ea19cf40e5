"""Fused attention (amp_cli.backends.cuda.rewrites.fused_attention + attention_kernel): which attention cores
are fused and how their operands are addressed (CI), that the kernel compiles to tensor-core
code for sm_80/sm_90 with the softmax free of barriers (CI, nvcc), and its values against a
float64 reference on the GPU (gpu-marked) for several shapes and operand layouts."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.kernels import attention as ak  # noqa: E402
from amp_cli.backends.cuda.rewrites.fused_attention import fuse_attention  # noqa: E402
from amp_cli.backends.cuda.rewrites.base import calls, op_name  # noqa: E402

relax = tvm.relax


def _attention_module(b=2, h=2, s=64, d=64, scale=0.125, mask=False, kt_input=False):
    """The attention core as the ONNX importer + fp16 conversion write it: head-split transposes
    of [B, S, H, D] inputs, fp32 scores cast to fp16, scaled, softmax in fp32, PV in fp32 and
    the output transposed back. ``mask``: an additive mask before the softmax (not fused);
    ``kt_input``: K^T is a function input (materialized, D not innermost: not fused)."""
    f16 = "float16"
    q = relax.Var("q", relax.TensorType((b, s, h, d), f16))
    k = relax.Var("k", relax.TensorType((b, h, d, s) if kt_input else (b, s, h, d), f16))
    v = relax.Var("v", relax.TensorType((b, s, h, d), f16))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            qt = bb.emit(relax.op.permute_dims(q, [0, 2, 1, 3]))
            kt = k if kt_input else bb.emit(relax.op.permute_dims(k, [0, 2, 3, 1]))
            vt = bb.emit(relax.op.permute_dims(v, [0, 2, 1, 3]))
            sc = bb.emit(relax.op.astype(relax.op.matmul(qt, kt, out_dtype="float32"), f16))
            sc = bb.emit(relax.op.multiply(sc, relax.const(scale, f16)))
            if mask:
                sc = bb.emit(relax.op.add(sc, relax.const(np.zeros((b, 1, 1, s), f16))))
            p = bb.emit(relax.op.nn.softmax(relax.op.astype(sc, "float32"), axis=-1))
            o = bb.emit(relax.op.matmul(relax.op.astype(p, f16), vt, out_dtype="float32"))
            o = bb.emit(relax.op.permute_dims(relax.op.astype(o, f16), [0, 2, 1, 3]))
            gv = bb.emit_output(relax.op.reshape(o, (b, s, h * d)))
        bb.emit_func_output(gv)
    return bb.get()


def _ops(mod) -> list[str]:
    return [name for name in map(op_name, calls(mod)) if name]


def test_attention_core_becomes_one_call_reading_the_untransposed_inputs():
    new, fused, declined = fuse_attention(_attention_module(), 90)
    assert (fused, declined) == (1, {})
    ops = _ops(new)
    # one kernel call; no transposes left (inputs read in place, output written [B, S, H, D])
    assert ops.count("relax.call_tir") == 1
    assert "relax.permute_dims" not in ops and "relax.nn.softmax" not in ops
    call = [e for e in [new["main"].body.blocks[0].bindings[0].value]][0]
    assert [list(a.ty.shape.values) for a in call.args[1].fields] == [[2, 64, 2, 64]] * 3
    assert [int(x) for x in call.ty.shape.values] == [2, 64, 2, 64]


def test_the_encoder_layer_fixture_is_fused(fp16_encoder_layer):
    from amp_cli.backends.cuda.rewrites.combine_gemm import combine_parallel_gemms
    from amp_cli.backends.cuda.rewrites.reshape_sink import sink_reshapes

    new, fused, declined = fuse_attention(fp16_encoder_layer, 90)
    assert (fused, declined) == (1, {})
    assert "relax.nn.softmax" not in _ops(new)
    # after reshape_sink and combine_gemm (Q/K/V one GEMM, biases added in its epilogue), as in
    # amp's CUDA pipeline, the kernel reads Q, K and V in place from the GEMM's [2, 64, 384]
    # output: no slice, transpose or copy left
    mod = combine_parallel_gemms(sink_reshapes(fp16_encoder_layer)[0])[0]
    new, fused, _ = fuse_attention(mod, 90)
    ops = _ops(new)
    assert fused == 1 and "relax.strided_slice" not in ops and "relax.permute_dims" not in ops
    kernel = [c for c in calls(new) if op_name(c) == "relax.call_tir"]
    assert [[int(x) for x in a.ty.shape.values] for a in kernel[0].args[1].fields] == [
        [2, 64, 384]] * 3


def test_what_is_not_fused():
    mod = _attention_module(mask=True)     # masked attention: not this kernel's pattern
    assert fuse_attention(mod, 90)[1:] == (0, {})
    mod = _attention_module(s=48)          # sequence not a multiple of 64: counted, unfused
    new, fused, declined = fuse_attention(mod, 90)
    assert fused == 0 and list(declined) == ["sequence length 48 is not a multiple of 64"]
    assert new.same_as(mod)
    _, fused, declined = fuse_attention(_attention_module(kt_input=True), 90)
    assert fused == 0 and "head dim innermost" in list(declined)[0]
    _, fused, declined = fuse_attention(_attention_module(b=1, h=1, s=512), 90)
    assert fused == 0 and list(declined) == ["sequence length 512 is over 256"]


def test_shared_memory_bound_and_supported_shapes():
    assert ak.supported(128, 64, 227) is None
    # an upper bound (TVM overlaps buffers whose lifetimes do not): S=256 fits sm_90, not sm_80
    assert ak.shared_bytes(256, 64) // 1024 == 197
    assert ak.supported(256, 64, 227) is None
    assert "exceeds the GPU's 163 KiB" in ak.supported(256, 64, 163)
    assert "multiple of 16" in ak.supported(128, 40, 227)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernel_compiles_to_wmma_with_a_barrier_free_softmax(arch):
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline

    b, h, s, d = 2, 4, 128, 64
    func = ak.attention_func(b, h, s, d, 0.125, ak.bshd(b, h, s, d), ak.bshd(b, h, s, d),
                             ak.bshd(b, h, s, d), ak.bshd(b, h, s, d))
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    mod = tvm.IRModule({"attention": func.with_attr("global_symbol", "attention")})
    lib = tvm.compile(mod, target=target, tir_pipeline=cuda_tir_pipeline(target))
    src = lib.mod.imports[0].inspect_source()
    assert src.count("wmma::mma_sync") == 2      # QK^T and PV
    # TVM's barrier planner puts a __syncthreads into every iteration of a loop that reads
    # and writes shared memory; the kernel is written so that none lands in a loop (9 in all:
    # loads, score store, two row exchanges, probabilities, output staging)
    assert src.count("__syncthreads()") <= 10, src.count("__syncthreads()")


def _reference(q, k, v, scale):
    """float64 softmax(q k^T * scale) v over [B, H, S, D] arrays."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    sc = q @ k.transpose(0, 1, 3, 2) * scale
    p = np.exp(sc - sc.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("b,h,s,d,layout", [(2, 3, 64, 64, "bshd"), (8, 16, 128, 64, "bshd"),
                                            (2, 2, 256, 64, "bhsd"), (1, 4, 192, 32, "bshd"),
                                            (2, 4, 128, 32, "bhsd")])
def test_kernel_matches_float64_on_gpu(b, h, s, d, layout):
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline

    dev = tvm.cuda(0)
    arch = "sm_" + dev.compute_version.replace(".", "")
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    opnd = getattr(ak, layout)(b, h, s, d)
    scale = 1 / np.sqrt(d)
    func = ak.attention_func(b, h, s, d, scale, opnd, opnd, opnd, ak.bshd(b, h, s, d))
    mod = tvm.IRModule({"attention": func.with_attr("global_symbol", "attention")})
    lib = tvm.compile(mod, target=target, tir_pipeline=cuda_tir_pipeline(target))
    rng = np.random.default_rng(s + d)
    # scores of a few units (peaked softmax rows) on random, never-zero inputs
    q, k, v = (rng.uniform(-2, 2, (b, h, s, d)).astype("float16") for _ in range(3))
    stored = (lambda x: x.transpose(0, 2, 1, 3).copy()) if layout == "bshd" else np.copy
    out = tvm.runtime.tensor(np.zeros((b, s, h, d), "float16"), dev)
    lib["attention"](*(tvm.runtime.tensor(stored(x), dev) for x in (q, k, v)), out)
    got = out.numpy().astype(np.float64).transpose(0, 2, 1, 3)
    ref = _reference(q, k, v, scale)
    # fp16 probabilities and output (2^-11 relative each), fp32 scores and sums
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 4e-3, err

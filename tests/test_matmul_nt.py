"""Matmuls in NT form (amp_cli.schedule.matmul_nt): what is rewritten, that values are kept, and
that every GEMM of a BERT layer then gets amp's cp.async tensor-core schedule (CUDA codegen, no
GPU needed)."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from amp_cli import models, tvm_compat  # noqa: E402
from amp_cli.schedule.matmul_nt import matmul_to_nt  # noqa: E402


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
    assert counts == {"constant": 1, "transposed": 2}
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


def test_bert_layer_gemms_all_get_amp_tensor_core_schedule(tmp_path):
    """Every GEMM of an encoder layer (QKV/out/FFN projections with [K, N] weights, q@k^T, p@v)
    reads K-contiguous operands after the rewrite, so each one gets tc_gemm's cp.async pipeline
    (before it, the weights' copies were strided and TVM's cp.async injection corrupted them)."""
    import onnx

    import amp_cli
    from amp_cli.build import relax_pipeline
    from amp_cli.precision import PrecisionConfig, convert_precision
    from amp_cli.target import resolve_target

    b = models.GraphBuilder(seed=3)
    y = b.encoder_layer("x", batch=2, seq=64, hidden=128, heads=2, ffn=256)
    model = b.model([("x", [2, 64, 128], "float32")], [(y, [2, 64, 128], "float32")])
    onnx.save(model, str(tmp_path / "layer.onnx"))
    loaded = amp_cli.load(tmp_path / "layer.onnx")
    mod, _ = convert_precision(loaded.mod, PrecisionConfig(precision="fp16"), loaded.node_types)
    target = resolve_target("cuda:sm_90")
    with target.tvm_target():
        lowered = relax_pipeline(target)(mod)
    gemms = [gv.name_hint for gv, f in lowered.functions.items()
             if isinstance(f, tvm_compat.prim_func_class()) and "matmul" in gv.name_hint]
    pipelined = [gv.name_hint for gv, f in lowered.functions.items()
                 if isinstance(f, tvm_compat.prim_func_class())
                 and "software_pipeline_async_stages" in f.script()]
    # 8 GEMMs (q/k/v combined into one by combine_gemm: 6), 6 distinct PrimFuncs
    assert len(gemms) == 6 and sorted(pipelined) == sorted(gemms)

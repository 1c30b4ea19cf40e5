"""Tensor-core builds: the tvm-ffi pin that avoids the tensorize segfault, and fp16 graphs that
compile for sm_80..sm_90 with dlight default schedules, wmma in the CUDA source."""
from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.tir import cuda_tir_pipeline  # noqa: E402


# --------------------------------------------------------------------------- (a) the pin
def test_tvm_ffi_matches_pin():
    installed = metadata.version("apache-tvm-ffi")
    assert installed == tvm_compat.TVM_FFI_VERSION, (
        f"apache-tvm-ffi {installed} installed, amp pins {tvm_compat.TVM_FFI_VERSION}: "
        "0.1.15.x segfaults in ToJSONGraph/sch.tensorize with apache-tvm 0.27.0.post1")


def test_save_json_primtype_in_subprocess():
    """The minimal repro of the ABI break; a segfault here is a failed test, not a dead run."""
    code = ("import tvm; s = tvm.ir.save_json(tvm.ir.PrimType('int32')); "
            "assert 'int32' in s; print('OK')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, (
        f"rc={proc.returncode} (negative = killed by signal)\n{proc.stderr[-2000:]}")


# --------------------------------------------------------------------------- (b) graphs
def _matmul_model(shape_a=(8, 128, 1024), k_n=(1024, 4096)):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal(k_n).astype(np.float32) * 0.02, "W")
    node = helper.make_node("MatMul", ["x", "W"], ["y"])
    graph = helper.make_graph(
        [node], "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape_a))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*shape_a[:-1], k_n[1]])],
        initializer=[w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _resnet_block_model():
    """conv-bn-relu-conv-bn + skip, relu, global pool, two fc (dlight only tensorizes when
    every matmul extent is > 64)."""
    rng = np.random.default_rng(1)
    c, hw = 16, 16
    inits, nodes = [], []

    def const(name, arr):
        inits.append(numpy_helper.from_array(arr.astype(np.float32), name))
        return name

    x = "x"
    cur = x
    for i in range(2):
        w = const(f"w{i}", rng.standard_normal((c, c, 3, 3)) * 0.1)
        nodes.append(helper.make_node("Conv", [cur, w], [f"c{i}"], pads=[1, 1, 1, 1]))
        bn = [const(f"bn{i}_{p}", v) for p, v in
              (("s", np.ones(c)), ("b", np.zeros(c)), ("m", np.zeros(c)), ("v", np.ones(c)))]
        nodes.append(helper.make_node("BatchNormalization", [f"c{i}", *bn], [f"b{i}"]))
        if i == 0:
            nodes.append(helper.make_node("Relu", ["b0"], ["r0"]))
            cur = "r0"
    nodes.append(helper.make_node("Add", ["b1", x], ["s"]))
    nodes.append(helper.make_node("Relu", ["s"], ["r"]))
    nodes.append(helper.make_node("GlobalAveragePool", ["r"], ["p"]))
    nodes.append(helper.make_node("Flatten", ["p"], ["f"]))
    fc1 = const("fc1", rng.standard_normal((c, 128)) * 0.1)
    nodes.append(helper.make_node("MatMul", ["f", fc1], ["h"]))
    fc2 = const("fc2", rng.standard_normal((128, 128)) * 0.1)  # M=N=K=128: tensorizable
    nodes.append(helper.make_node("MatMul", ["h", fc2], ["y"]))
    graph = helper.make_graph(
        nodes, "res", [helper.make_tensor_value_info(x, TensorProto.FLOAT, [128, c, hw, hw])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [128, 128])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _bert_layer_model(seq=128, hidden=128):
    """One attention head + FFN: matmuls, softmax, layernorm (all dims >= 128)."""
    rng = np.random.default_rng(2)
    inits, nodes = [], []

    def const(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr, np.float32), name))
        return name

    for n in ("q", "k", "v", "o"):
        const(f"W{n}", rng.standard_normal((hidden, hidden)) * 0.05)
    for n in ("q", "k", "v"):
        nodes.append(helper.make_node("MatMul", ["x", f"W{n}"], [n]))
    nodes.append(helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]))
    nodes.append(helper.make_node("MatMul", ["q", "kt"], ["sc"]))
    nodes.append(helper.make_node("Mul", ["sc", const("scale", [1 / np.sqrt(hidden)])], ["scs"]))
    nodes.append(helper.make_node("Softmax", ["scs"], ["pr"], axis=-1))
    nodes.append(helper.make_node("MatMul", ["pr", "v"], ["ctx"]))
    nodes.append(helper.make_node("MatMul", ["ctx", "Wo"], ["o"]))
    nodes.append(helper.make_node("Add", ["o", "x"], ["res"]))
    nodes.append(helper.make_node("LayerNormalization",
                                  ["res", const("g", np.ones(hidden)), const("bt", np.zeros(hidden))],
                                  ["y"], axis=-1))
    graph = helper.make_graph(
        nodes, "bert", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, seq, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, seq, hidden])],
        initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _build(model, arch, out_dtype="float32", records=None):
    relax = tvm_compat.relax()
    mod = tvm_compat.from_onnx(model)
    mod = relax.transform.DecomposeOpsForInference()(mod)
    mod = relax.transform.ToMixedPrecision(out_dtype=out_dtype)(mod)
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    from tvm.relax.backend.cuda import pipeline as cuda_pipeline

    ex = tvm.compile(mod, target, relax_pipeline=cuda_pipeline.get_default_pipeline(target),
                     tir_pipeline=cuda_tir_pipeline(target, records if records is not None else []))
    return tvm_compat.cuda_module_source(ex)


def _has_tensor_cores(src):
    return "wmma::mma_sync" in src or "mma.sync" in src


@pytest.mark.parametrize("arch", ["sm_90", "sm_80", "sm_86", "sm_89"])
def test_minimal_repro_matmul_uses_tensor_cores(arch):
    src = _build(_matmul_model(), arch)
    assert _has_tensor_cores(src)


def test_minimal_repro_fp16_accumulation():
    src = _build(_matmul_model(), "sm_90", out_dtype="float16")
    assert _has_tensor_cores(src)
    assert "wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, half>" in src


def test_resnet_like_block_fp16():
    src = _build(_resnet_block_model(), "sm_90")
    assert "half" in src
    assert _has_tensor_cores(src)  # the 128x128x128 fc; dlight's conv schedules are SIMT


def test_bert_like_layer_fp16():
    src = _build(_bert_layer_model(), "sm_90")
    assert _has_tensor_cores(src)
    assert "expf" in src or "__expf" in src or "hexp" in src  # softmax stayed in the build


def test_bf16_matmul_builds_without_tensor_cores():
    """dlight (0.27) has no bf16 tensor-core rule (MatmulTensorization is float16-only), so
    bf16 dense builds on the SIMT Matmul schedule. Documented in docs/legalizer.md."""
    relax = tvm_compat.relax()
    from tvm.script import relax as R

    @tvm.script.ir_module
    class Mod:
        @R.function
        def main(x: R.Tensor((128, 256), "bfloat16"), w: R.Tensor((256, 256), "bfloat16")):
            with R.dataflow():
                y = R.matmul(x, w, out_dtype="float32")
                z = R.astype(y, "bfloat16")
                R.output(z)
            return z

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    from tvm.relax.backend.cuda import pipeline as cuda_pipeline

    del relax
    ex = tvm.compile(Mod, target, relax_pipeline=cuda_pipeline.get_default_pipeline(target),
                     tir_pipeline=cuda_tir_pipeline(target, []))
    src = tvm_compat.cuda_module_source(ex)
    assert "nv_bfloat16" in src and not _has_tensor_cores(src)

"""Flattening reshapes moved past GEMMs and their epilogues (amp_cli.backends.cuda.rewrites.reshape_sink): the
values stay the same (llvm, random inputs), and in the sm_90 build a BERT layer's residual adds
and GELU fuse into their GEMMs instead of running as separate kernels."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("onnx")

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.rewrites.reshape_sink import sink_reshapes  # noqa: E402
from amp_cli.backends.cuda.rewrites.base import calls, op_name  # noqa: E402

relax = tvm.relax


def _run_llvm(mod, x):
    ex = tvm.compile(mod, target="llvm")
    out = tvm_compat.relax_vm(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
    out = out if hasattr(out, "numpy") else out[0]
    return out.numpy().astype(np.float64)


def _count(mod, name):
    return sum(1 for c in calls(mod) if op_name(c) == name)


def test_encoder_layer_keeps_its_values_with_fewer_reshapes(fp16_encoder_layer):
    mod = fp16_encoder_layer
    new, moved = sink_reshapes(mod)
    assert moved > 0
    assert _count(new, "relax.reshape") < _count(mod, "relax.reshape")
    x = np.random.default_rng(0).standard_normal((2, 64, 128)).astype("float32")
    ref, got = _run_llvm(mod, x), _run_llvm(new, x)
    # the same ops on the same values in the same order: identical up to fp32 rounding
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def test_what_is_left_alone():
    """A reshape that splits axes ([M, N] -> [B, S, H, D]) and an elementwise op with another
    full-size 2-D operand keep their reshapes."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 8, 16), "float16"))
    y = relax.Var("y", relax.TensorType((16, 16), "float16"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            flat = bb.emit(relax.op.reshape(x, [16, 16]))
            summed = bb.emit(relax.op.add(flat, y))       # y is [16, 16]: no broadcast form
            split = bb.emit(relax.op.reshape(summed, [2, 8, 2, 8]))
            gv = bb.emit_output(relax.op.multiply(split, relax.const(2.0, "float16")))
        bb.emit_func_output(gv)
    mod = bb.get()
    new, moved = sink_reshapes(mod)
    assert moved == 0 and new.same_as(mod)


def test_bert_layer_epilogues_fuse_into_gemms_on_sm90(fp16_encoder_layer):
    from amp_cli.compile import relax_pipeline
    from amp_cli.config import CudaConfig
    from amp_cli.target import resolve_target

    target = resolve_target("cuda:sm_90")

    def kernels(cuda):
        with target.tvm_target():
            lowered = relax_pipeline(target, cuda=cuda)(fp16_encoder_layer)
        return sorted(gv.name_hint for gv, f in lowered.functions.items()
                      if isinstance(f, tvm_compat.prim_func_class()))

    sunk, plain = kernels(None), kernels(CudaConfig(sink_reshapes=False))
    gemms = [k for k in sunk if "matmul_nt" in k]
    assert any("erf" in k for k in gemms), gemms                      # GELU in FFN-up's store
    assert sum(k.count("add") >= 2 for k in gemms) >= 2, gemms        # bias + residual adds
    assert not any(k.startswith("fused_reshape") for k in sunk), sunk
    assert any(k.startswith("fused_reshape") for k in plain), plain  # what it was before
    assert len(sunk) < len(plain)


def test_gelu_after_a_3d_linear_layer_fuses_into_its_gemm_on_sm90(tmp_path):
    """An exported ``MatMul(x[B, S, K], W) -> Add -> Gelu -> MatMul`` (ONNX's own Gelu op): the
    importer's flatten/unflatten reshapes cancel, leaving an alias ``y = x`` in their place,
    at which FuseOps ended the GEMM's kernel (GELU ran as a kernel of its own; so did the
    residual adds of every real ViT / ConvNeXt export). The GELU must be in the GEMM's kernel."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    import amp_cli
    from amp_cli.config import ConvertConfig
    from amp_cli.target import resolve_target
    from amp_cli.tuning.tasks import fused_module

    rng = np.random.default_rng(0)
    init = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in (
        ("W1", rng.standard_normal((64, 256)) * 0.1), ("b1", rng.standard_normal(256) * 0.1),
        ("W2", rng.standard_normal((256, 64)) * 0.1))]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["m1"]),
             helper.make_node("Add", ["m1", "b1"], ["a1"]),
             helper.make_node("Gelu", ["a1"], ["g"]),
             helper.make_node("MatMul", ["g", "W2"], ["m2"]),
             helper.make_node("Add", ["m2", "x"], ["y"])]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16, 64])], init)
    path = tmp_path / "mlp.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), str(path))
    fused = fused_module(amp_cli.load(str(path)), ConvertConfig(target="cuda:sm_90"),
                         resolve_target("cuda:sm_90"))
    kernels = sorted(gv.name_hint for gv, f in fused.functions_items()
                     if isinstance(f, tvm_compat.prim_func_class()))
    assert any("matmul_nt" in k and "gelu" in k for k in kernels), kernels
    assert not any(k.startswith("gelu") for k in kernels), kernels
    # the residual add of the second GEMM is in its kernel too: no add-only kernel
    assert not any(k.startswith(("add", "fused_add")) for k in kernels), kernels


def test_reshapes_keeping_the_last_axis_sink_only_within_their_scope():
    """[N, 1, W, C] -> [N, W, C] (a 1-D conv's output) sinks past an elementwise op in its
    dataflow block, through the alias a cancelled permute leaves; an op outside the block that
    reads the block's output (an RNN's loop code) is left alone, since the reshape's source is
    the block's own variable there (the LSTM corpus model failed with "Var lv3 is not
    defined")."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 1, 4, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            z = bb.emit(relax.op.add(x, x))
            r = bb.emit(relax.op.reshape(z, [2, 4, 8]))
            alias = bb.emit(r)  # what a cancelled permute pair leaves
            g = bb.emit(relax.op.nn.relu(alias))
            out = bb.emit_output(relax.op.reshape(g, [2, 4, 8]))
        y = bb.emit(relax.op.sigmoid(out))
        bb.emit_func_output(y)
    mod = bb.get()
    new, moved = sink_reshapes(mod)
    assert moved == 1  # relu, inside the block; not the sigmoid outside it
    x_np = np.random.default_rng(0).standard_normal((2, 1, 4, 8)).astype("float32")
    # builds (a use of the block-local var outside the block would not) and keeps its values
    np.testing.assert_allclose(_run_llvm(new, x_np), _run_llvm(mod, x_np), rtol=1e-6)

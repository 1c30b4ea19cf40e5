"""1-D convolutions as 2-D ones (backends/cuda/rewrites/conv1d.py): the values are the conv1d's
(llvm, random inputs, through the conv-as-GEMM rewrite that follows it in the CUDA pipeline),
and a speech front end (two convs with GELU, then the encoder's transpose) builds for
cuda:sm_90 as two implicit tensor-core GEMMs (amp's cp.async tile) with GELU in their
epilogues and no transpose or conv1d kernel."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.rewrites.base import calls, op_name  # noqa: E402
from amp_cli.backends.cuda.rewrites.conv1d import conv1d_as_conv2d  # noqa: E402
from amp_cli.backends.cuda.rewrites.conv_gemm import conv_to_gemm  # noqa: E402


def _conv1d_module(n, c, w, o, k, stride=1, pad=(0, 0), dilation=1, groups=1, seed=0):
    relax = tvm_compat.relax()
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((o, c // groups, k)) / np.sqrt(c * k / groups)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, c, w), "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv1d(x, relax.const(weight.astype("float16")),
                                           strides=stride, padding=list(pad),
                                           dilation=dilation, groups=groups,
                                           out_dtype="float32"))
            gv = bb.emit_output(relax.op.nn.gelu(y))
        bb.emit_func_output(gv)
    return bb.get()


def _run_llvm(mod, x):
    ex = tvm.compile(mod, target="llvm")
    vm = tvm.relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy().astype(np.float64)


@pytest.mark.parametrize("n,c,w,o,k,stride,pad,dilation,groups", [
    (2, 16, 30, 24, 3, 1, (1, 1), 1, 1),    # Whisper's first conv (80 -> d, k3 p1)
    (2, 24, 31, 24, 3, 2, (1, 1), 1, 1),    # its second (stride 2, odd width)
    (1, 8, 40, 16, 10, 5, (0, 0), 1, 1),    # wav2vec2's feature extractor (k10 s5)
    (2, 6, 20, 10, 3, 1, (2, 0), 2, 1),     # dilated, causal padding (TCN)
    (2, 3, 17, 8, 1, 1, (0, 0), 1, 1),      # pointwise
    (1, 16, 25, 16, 5, 1, (2, 2), 1, 4),    # grouped (wav2vec2's positional conv)
])
def test_values_are_the_conv1d(n, c, w, o, k, stride, pad, dilation, groups):
    mod = _conv1d_module(n, c, w, o, k, stride, pad, dilation, groups)
    new, count = conv1d_as_conv2d(mod)
    assert count == 1
    ops = [op_name(x) for x in calls(new)]
    assert "relax.nn.conv1d" not in ops and "relax.nn.conv2d" in ops
    x = np.random.default_rng(1).uniform(-2, 2, (n, c, w)).astype("float16")
    ref = _run_llvm(mod, x)
    for got in (_run_llvm(new, x), _run_llvm(conv_to_gemm(new, implicit=True), x)):
        assert got.shape == ref.shape
        # the same fp16 products accumulated in fp32, in another order
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_fp32_and_channels_last_conv1d_are_left_alone():
    relax = tvm_compat.relax()
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 4, 10), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            w = relax.const(np.ones((6, 4, 3), "float32"))
            gv = bb.emit_output(relax.op.nn.conv1d(x, w))
        bb.emit_func_output(gv)
    mod = bb.get()
    new, count = conv1d_as_conv2d(mod)
    assert count == 0 and new.same_as(mod)


def test_a_speech_front_end_runs_as_two_implicit_gemms(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    from fixtures.fused_kernels import called_kernels

    rng = np.random.default_rng(0)
    c, o, w = 80, 128, 200
    init = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in (
        ("W1", rng.standard_normal((o, c, 3)) * 0.1),
        ("W2", rng.standard_normal((o, o, 3)) * 0.05))]
    nodes = [helper.make_node("Conv", ["x", "W1"], ["c1"], pads=[1, 1]),
             helper.make_node("Gelu", ["c1"], ["g1"]),
             helper.make_node("Conv", ["g1", "W2"], ["c2"], pads=[1, 1], strides=[2]),
             helper.make_node("Gelu", ["c2"], ["g2"]),
             helper.make_node("Transpose", ["g2"], ["y"], perm=[0, 2, 1])]
    graph = helper.make_graph(
        nodes, "front_end", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, c, w])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, w // 2, o])], init)
    path = tmp_path / "front_end.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), str(path))

    on = called_kernels(path)
    gemms = [k for k in on if "conv_gemm_implicit" in k]
    assert len(gemms) == 2 and all("gelu" in k for k in gemms), on
    assert not any("conv1d" in k for k in on), on
    # the NCW layout's transposes cancelled: only the input's, fused with its cast
    assert [k for k in on if "transpose" in k] == ["fused_cast_transpose_reshape"], on
    off = called_kernels(path, conv1d_as_conv2d=False)
    assert sum("conv1d" in k for k in off) == 2, off

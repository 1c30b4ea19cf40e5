"""fp32 means as sum * (1/n) (backends/cuda/rewrites/mean_as_sum.py): the squeeze-excitation
pool's fp16 -> fp32 cast fuses into the reduction instead of writing the activation in fp32
(CI: the fused kernels of a cuda:sm_90 build), and the values are the mean's (llvm, random
inputs, against float64)."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.rewrites.mean_as_sum import mean_as_sum  # noqa: E402


def _pool(shape, axis, keepdims, dtype="float16"):
    relax = tvm_compat.relax()
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            m = bb.emit(relax.op.mean(relax.op.astype(x, "float32"), axis, keepdims))
            out = bb.emit_output(relax.op.astype(m, dtype))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("shape,axis,keepdims", [((2, 7, 5, 24), [1, 2], True),
                                                 ((3, 50, 16), [1], False),
                                                 ((4, 33), None, False)])
def test_values_are_the_means(shape, axis, keepdims):
    mod = _pool(shape, axis, keepdims)
    new, count = mean_as_sum(mod)
    assert count == 1
    script = new["main"].script()
    assert "R.mean" not in script and "R.sum" in script
    x = np.random.default_rng(0).uniform(0.5, 2.0, shape).astype("float16")
    ex = tvm.compile(new, target="llvm")
    got = tvm.relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    ref = x.astype(np.float64).mean(axis=None if axis is None else tuple(axis),
                                     keepdims=keepdims)
    # the fp16 output's rounding (2^-11 relative) bounds it; the fp32 sum adds far less
    assert np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max() < 1e-3


def test_fp16_and_symbolic_means_are_left_alone():
    relax = tvm_compat.relax()
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((2, 8, 8, 4), "float16"))
    y = relax.Var("y", relax.TensorType((2, n, 4), "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            a = bb.emit(relax.op.mean(x, [1, 2], True))       # fp16: its sum could overflow
            b = bb.emit(relax.op.mean(y, [1], True))          # n elements: no constant 1/n
            out = bb.emit_output(relax.Tuple([a, b]))
        bb.emit_func_output(out)
    new, count = mean_as_sum(bb.get())
    assert count == 0 and new["main"].script().count("R.mean") == 2


def test_the_cast_of_a_squeeze_excitation_pool_fuses_into_its_reduction(tmp_path):
    """An SE block as an ONNX export writes it (conv + SiLU, GlobalAveragePool, two 1x1 convs,
    sigmoid gate) built for cuda:sm_90: the pool reads the fp16 activation inside its sum
    kernel; no kernel casts the whole activation to fp32 first."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    from fixtures.fused_kernels import called_kernels

    rng = np.random.default_rng(0)
    c = 32
    init = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in (
        ("W1", rng.standard_normal((c, c, 1, 1)) * 0.1),
        ("W2", rng.standard_normal((8, c, 1, 1)) * 0.1),
        ("W3", rng.standard_normal((c, 8, 1, 1)) * 0.1))]
    nodes = [helper.make_node("Conv", ["x", "W1"], ["c1"]),
             helper.make_node("Sigmoid", ["c1"], ["s1"]),
             helper.make_node("Mul", ["c1", "s1"], ["a1"]),
             helper.make_node("GlobalAveragePool", ["a1"], ["p"]),
             helper.make_node("Conv", ["p", "W2"], ["f1"]), helper.make_node("Relu", ["f1"], ["r"]),
             helper.make_node("Conv", ["r", "W3"], ["f2"]),
             helper.make_node("Sigmoid", ["f2"], ["g"]), helper.make_node("Mul", ["a1", "g"], ["y"])]
    graph = helper.make_graph(
        nodes, "se", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, c, 28, 28])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, c, 28, 28])], init)
    path = tmp_path / "se.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))

    on, off = called_kernels(path), called_kernels(path, mean_as_sum=False)
    assert any("cast" in k and k.endswith("sum") for k in on), on
    assert any("mean" in k for k in off) and not any(k.endswith("sum") for k in off), off
    # kernels that only cast: the model output's fp16 -> fp32 with the rewrite; that and the
    # activation's fp32 copy without it
    casts = [[k for k in ks if k.startswith("cast")] for ks in (on, off)]
    assert (len(casts[0]), len(casts[1])) == (1, 2), casts

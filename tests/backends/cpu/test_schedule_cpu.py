"""Numerical + structural tests of amp's untuned CPU schedules (amp_cli/schedule/cpu.py).

Each model is a small ONNX graph with random non-zero weights/inputs, built with
cpu_relax_pipeline for the host llvm target, run with relax.VirtualMachine on tvm.cpu() and
compared with ONNX Runtime fp32. Tolerance: rtol=1e-4, atol=1e-4 * max|ref| (the schedules
keep the per-element reduction order for GEMM/conv, so differences come only from ORT's own
kernels and vectorized transcendental functions).

The test also inspects the scheduled TIR: every GEMM/conv kernel must contain a parallel loop
and a vectorized loop, and no kernel may fall back, so a silent scheduling regression fails.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

RTOL = 1e-4
ATOL_REL = 1e-4


def _model(nodes, inits, inp, out, opset=17):
    g = helper.make_graph(
        nodes, "t",
        [helper.make_tensor_value_info(inp[0], TensorProto.FLOAT, inp[1])],
        [helper.make_tensor_value_info(out[0], TensorProto.FLOAT, out[1])],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _rand(rng, *shape, scale=1.0):
    x = rng.uniform(0.1, 1.0, shape) * rng.choice([-1.0, 1.0], shape)
    return (x * scale).astype("float32")


def conv_bn_relu_model(rng):
    cin, cout = 5, 19  # odd channels
    inits = {
        "w1": _rand(rng, cout, cin, 3, 3, scale=1 / math.sqrt(cin * 9)),
        "g": _rand(rng, cout) + 1.5, "b": _rand(rng, cout), "m": _rand(rng, cout, scale=0.1),
        "v": np.abs(_rand(rng, cout)) + 0.5,
        "w2": _rand(rng, 7, cout, 1, 1, scale=1 / math.sqrt(cout)),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                         strides=[2, 2]),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["bn"]),
        helper.make_node("Relu", ["bn"], ["r"]),
        helper.make_node("Conv", ["r", "w2"], ["y"], kernel_shape=[1, 1]),
    ]
    return _model(nodes, inits, ("x", [1, cin, 23, 17]), ("y", [1, 7, 12, 9]))


def matmul_model(rng):
    m, k, n = 37, 29, 53  # odd dims
    inits = {"w": _rand(rng, k, n, scale=1 / math.sqrt(k)), "bias": _rand(rng, n)}
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]),
             helper.make_node("Add", ["mm", "bias"], ["y"])]
    return _model(nodes, inits, ("x", [m, k]), ("y", [m, n]))


def softmax_model(rng):
    nodes = [helper.make_node("Softmax", ["x"], ["y"], axis=-1)]
    # odd row length; large enough (>= 2**14 elements) for the parallel threshold
    return _model(nodes, {}, ("x", [4, 33, 129]), ("y", [4, 33, 129]))


def layernorm_model(rng):
    h = 96
    inits = {"g": _rand(rng, h), "b": _rand(rng, h)}
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1,
                              epsilon=1e-5)]
    return _model(nodes, inits, ("x", [1, 173, h]), ("y", [1, 173, h]))


def attention_model(rng):
    s, hid, heads = 24, 96, 4
    dh = hid // heads
    inits = {f"w{n}": _rand(rng, hid, hid, scale=1 / math.sqrt(hid)) for n in "qkvo"}
    inits.update({"split": np.array([1, s, heads, dh], "int64"),
                  "merge": np.array([1, s, hid], "int64"),
                  "scale": np.array(1 / math.sqrt(dh), "float32"),
                  "g": _rand(rng, hid), "b": _rand(rng, hid)})
    nodes = []
    for n, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        nodes += [helper.make_node("MatMul", ["x", f"w{n}"], [f"{n}0"]),
                  helper.make_node("Reshape", [f"{n}0", "split"], [f"{n}1"]),
                  helper.make_node("Transpose", [f"{n}1"], [n], perm=perm)]
    nodes += [
        helper.make_node("MatMul", ["q", "k"], ["s0"]),
        helper.make_node("Mul", ["s0", "scale"], ["s1"]),
        helper.make_node("Softmax", ["s1"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["c0"]),
        helper.make_node("Transpose", ["c0"], ["c1"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["c1", "merge"], ["c2"]),
        helper.make_node("MatMul", ["c2", "wo"], ["o"]),
        helper.make_node("Add", ["o", "x"], ["r"]),
        helper.make_node("LayerNormalization", ["r", "g", "b"], ["y"], axis=-1),
    ]
    return _model(nodes, inits, ("x", [1, s, hid]), ("y", [1, s, hid]))


def _sliced(rng, head, shape_in, full, out):
    """``head`` (ops producing "h" of shape ``full``) + a Slice dropping the last position of
    the last axis + an activation: the GEMM write-back's epilogue then covers fewer points
    than the GEMM (wav2vec2's positional conv with its "same" padding did this)."""
    nodes, inits = head
    inits.update({"st": np.array([0], "int64"), "en": np.array([full[-1] - 1], "int64"),
                  "ax": np.array([len(full) - 1], "int64")})
    nodes += [helper.make_node("Slice", ["h", "st", "en", "ax"], ["s"]),
              helper.make_node("Sigmoid", ["s"], ["g"]),
              helper.make_node("Mul", ["s", "g"], ["y"])]
    return _model(nodes, inits, ("x", shape_in), ("y", out))


def grouped_conv1d_sliced_model(rng):
    c, groups, k = 64, 4, 16
    inits = {"w": _rand(rng, c, c // groups, k, scale=1 / math.sqrt(c // groups * k)),
             "bias": _rand(rng, c)}
    head = ([helper.make_node("Conv", ["x", "w", "bias"], ["h"], group=groups,
                              kernel_shape=[k], pads=[k // 2, k // 2])], inits)
    return _sliced(rng, head, [1, c, 79], [1, c, 80], [1, c, 79])


def matmul_sliced_model(rng):
    m, k, n = 32, 48, 80
    head = ([helper.make_node("MatMul", ["x", "w"], ["h"])],
            {"w": _rand(rng, k, n, scale=1 / math.sqrt(k))})
    return _sliced(rng, head, [m, k], [m, n], [m, n - 1])


CASES = {
    "conv_bn_relu": conv_bn_relu_model,
    "grouped_conv1d_sliced": grouped_conv1d_sliced_model,
    "matmul_sliced": matmul_sliced_model,
    "matmul_odd": matmul_model,
    "softmax": softmax_model,
    "layernorm": layernorm_model,
    "attention": attention_model,
}


def _build(onnx_model):
    from amp_cli import tvm_compat
    from amp_cli import hardware
    from amp_cli.backends.cpu import pipeline as sched

    tvm = tvm_compat.tvm()
    mod = tvm_compat.from_onnx(onnx_model)
    target = tvm.target.Target(hardware.host_llvm_target())
    pipeline = sched.cpu_relax_pipeline(target)
    # the scheduled TIR, for structural checks (same passes, stopped before lowering)
    ex = tvm_compat.compile_relax(mod, target, pipeline)
    stats = dict(sched.LAST_STATS)
    return tvm, ex, stats, target


def _scheduled_tir(onnx_model, target):
    from amp_cli import tvm_compat
    from amp_cli.backends.cpu import pipeline as sched

    tvm = tvm_compat.tvm()
    relax = tvm.relax
    mod = tvm_compat.from_onnx(onnx_model)
    with target:
        seq = tvm.transform.Sequential(
            sched.cpu_layout_passes(target)
            + [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
               relax.transform.FoldConstant(), relax.transform.FuseOps(),
               relax.transform.FuseTIR(), relax.transform.DeadCodeElimination()]
            + sched.cpu_schedule_passes(target))
        mod = seq(mod)
    return {gv.name_hint: f for gv, f in mod.functions_items()
            if isinstance(f, tvm.tirx.PrimFunc)}


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_schedule_matches_ort(case):
    rng = np.random.default_rng(abs(hash(case)) % 2**32)
    model = CASES[case](rng)
    tvm, ex, stats, target = _build(model)
    assert not stats.get("unscheduled"), stats
    assert not stats.get("fallback"), stats

    inp = model.graph.input[0]
    shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
    x = _rand(rng, *shape)
    vm = tvm.relax.VirtualMachine(ex, tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x)).numpy()

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    ref = sess.run(None, {inp.name: x})[0]
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL_REL * float(np.abs(ref).max()))

    # structural: scheduling really happened
    funcs = _scheduled_tir(model, target)
    text = {n: f.script() for n, f in funcs.items()}
    assert all("tirx.is_scheduled" in str(f.attrs) for f in funcs.values()), list(text)
    gemm = [n for n in text if "matmul" in n or "conv2d" in n]
    if case in ("conv_bn_relu", "matmul_odd", "attention"):
        assert gemm, list(text)
    for n in gemm:
        assert "T.vectorized" in text[n], (n, text[n][:2000])
    if case in ("conv_bn_relu", "attention"):  # 37x29x53 is below the parallel threshold
        assert any("T.parallel" in text[n] for n in gemm), "no parallel GEMM/conv loop"
    if case == "attention":  # 64-wide projections: weights pre-packed into panels
        assert stats.get("packed_weights", 0) >= 1, stats
    if case in ("softmax", "layernorm"):
        (name, src), = [(n, t) for n, t in text.items()]
        assert "T.parallel" in src and "T.vectorized" in src, src


def test_thread_helpers():
    from amp_cli import hardware

    n = hardware.effective_num_threads()
    assert n >= 1
    assert hardware.set_num_threads(1) == 1
    assert hardware.effective_num_threads() == 1
    assert os.environ["TVM_NUM_THREADS"] == "1"
    hardware.set_num_threads(n)
    spec = hardware.host_llvm_target()
    assert spec["kind"] == "llvm" and spec["num-cores"] >= 1
    assert hardware.host_llvm_target("skylake-avx512")["mcpu"] == "skylake-avx512"


def test_symbolic_row_gemm_pads_its_rows_and_matches_numpy():
    """A GEMM over a symbolic row count (a dynamic batch x sequence) with a bias + ReLU tail:
    the rows are padded to whole register tiles (``_pad_rows``), so the accumulating block has
    no row predicate (with one, TVM kept the accumulator tile out of registers: 2.8x the static
    kernel's time at M = 200 on the 2-core machine, 1.1x padded); values against float64 numpy
    at M = 1, 7 and 50 (rtol 1e-5: fp32, the reduction order of the unscheduled kernel)."""
    from amp_cli import hardware, tvm_compat
    from amp_cli.backends.cpu.rules import schedule_prim_func

    tvm = tvm_compat.tvm()
    te = tvm.te
    i64 = lambda v: tvm.tirx.IntImm("int64", v)  # noqa: E731 - Relax's shapes are int64
    m, k, n = tvm.tirx.Var("m", "int64"), i64(96), i64(128)
    a = te.placeholder((m, k), "float32", name="A")
    b = te.placeholder((k, n), "float32", name="B")
    bias = te.placeholder((n,), "float32", name="bias")
    r = te.reduce_axis((i64(0), k), "r")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="C")
    out = te.compute((m, n), lambda i, j: te.max(c[i, j] + bias[j], tvm.tirx.const(0, "float32")),
                     name="out")
    func = te.create_prim_func([a, b, bias, out]).with_attr("global_symbol", "main")
    target = tvm.target.Target(hardware.host_llvm_target())
    new, rule = schedule_prim_func(func, target)
    assert rule == "gemm", rule
    script = new.script()
    update = script[script.index('T.sblock("C_update")'):]
    update = update[:update.index("T.reads")]
    assert "T.where" not in update and "A_pad" in script
    ex = tvm.compile(tvm.IRModule({"main": new}), target=target)
    dev = tvm.cpu()
    rng = np.random.default_rng(5)
    bv = rng.standard_normal((96, 128)).astype("float32")
    biasv = rng.standard_normal(128).astype("float32")
    for rows in (1, 7, 50):
        av = rng.standard_normal((rows, 96)).astype("float32")
        got = tvm.runtime.empty((rows, 128), "float32", dev)
        ex["main"](tvm.runtime.tensor(av, dev), tvm.runtime.tensor(bv, dev),
                   tvm.runtime.tensor(biasv, dev), got)
        ref = np.maximum(av.astype("float64") @ bv.astype("float64") + biasv, 0)
        np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())

"""bf16 on the CPU target: amp's precision pass (bf16 storage, fp32 accumulation) + amp's CPU
schedules must build and match ONNX Runtime fp32 within bf16 tolerance.

Regression: TVM 0.27's BF16StorageLegalize cannot lower a vectorized store of a bf16 constant
(max-pool's -inf init became ``Broadcast(bfloat16, 32)`` and the build failed with "buffer's
dtype is T.uint16 ... RHS's dtype is T.bfloat16x32"); amp_cli/schedule/cpu.py keeps such init
loops scalar.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402


def _conv_pool_model(rng):
    cin, cout = 3, 32  # >= 32 channels: the pool loop is vectorized (32 bf16 lanes)
    w = (rng.standard_normal((cout, cin, 3, 3)) / np.sqrt(cin * 9)).astype("float32")
    w2 = (rng.standard_normal((cout, cout, 1, 1)) / np.sqrt(cout)).astype("float32")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1, 1, 1, 1]),
        # a bf16 consumer, so the pool keeps a bf16 output buffer (not fused with a cast)
        helper.make_node("Conv", ["p", "w2"], ["q"], kernel_shape=[1, 1]),
        helper.make_node("GlobalAveragePool", ["q"], ["y"]),
    ]
    g = helper.make_graph(
        nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, 20, 20])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cout, 1, 1])],
        initializer=[numpy_helper.from_array(w, "w"), numpy_helper.from_array(w2, "w2")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_bf16_conv_maxpool_builds_and_matches_ort():
    from amp_cli import tvm_compat
    from amp_cli.compile import relax_pipeline
    from amp_cli.config import PrecisionConfig
    from amp_cli.precision import convert_precision
    from amp_cli.backends.cpu import pipeline as sched
    from amp_cli.target import resolve_target

    tvm = tvm_compat.tvm()
    rng = np.random.default_rng(0)
    model = _conv_pool_model(rng)
    x = rng.uniform(-1, 1, (1, 3, 20, 20)).astype("float32")
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    mod, _ = convert_precision(tvm_compat.from_onnx(model), PrecisionConfig(precision="bf16"))
    target = resolve_target("llvm")
    tgt = target.tvm_target()
    with tgt:
        lowered = relax_pipeline(target)(mod)
    assert not sched.LAST_STATS.get("fallback"), sched.LAST_STATS
    pool = [f for gv, f in lowered.functions_items()
            if isinstance(f, tvm.tirx.PrimFunc) and "bfloat16" in f.script() and
            "pool_max" in f.script()]
    assert pool, "expected a bf16 max-pool kernel"
    ex = tvm_compat.compile_relax(lowered, tgt, relax_pipeline=None)
    vm = tvm.relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x)).numpy().astype("float32")
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err < 2e-2, err  # bf16 has 8 mantissa bits

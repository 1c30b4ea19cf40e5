"""amp's ONNX Runtime reference opens models saved by a newer onnx (frontend/ort_session.py).

The GPU machine of 2026-12-05 had an onnx writing IR version 14 and an onnxruntime reading up
to 13, and every model saved there failed amp's accuracy check. The test writes a model with
an IR version beyond what this onnxruntime reads (so onnxruntime really refuses it) and checks
the reference values against numpy in float64.
"""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper  # noqa: E402

from amp_cli.frontend.ort_session import inference_session, supported_ir_version  # noqa: E402

FUTURE_IR = 99


def _model(ir_version: int):
    """y = tanh(x) @ w + 1, opset 17."""
    rng = np.random.default_rng(11)
    w = rng.normal(0, 0.3, (8, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Tanh", ["x"], ["t"]), helper.make_node("MatMul", ["t", "w"], ["m"]),
         helper.make_node("Add", ["m", "one"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])],
        [onnx.numpy_helper.from_array(w, "w"),
         onnx.numpy_helper.from_array(np.ones(4, np.float32), "one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = ir_version
    return model, w


def test_onnxruntime_refuses_the_future_version_itself():
    model, _ = _model(FUTURE_IR)
    with pytest.raises(Exception) as info:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert supported_ir_version(str(info.value)) is not None, str(info.value)


@pytest.mark.parametrize("as_bytes", [False, True])
def test_newer_ir_version_opens_as_the_supported_one(as_bytes):
    model, w = _model(FUTURE_IR)
    x = np.random.default_rng(2).normal(0, 1, (3, 8)).astype(np.float32)
    sess = inference_session(model.SerializeToString() if as_bytes else model)
    (got,) = sess.run(None, {"x": x})
    want = np.tanh(x.astype(np.float64)) @ w.astype(np.float64) + 1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert model.ir_version == FUTURE_IR  # the caller's model is left alone


def test_other_errors_are_not_retried():
    model, _ = _model(FUTURE_IR)
    model.graph.node[1].op_type = "NoSuchOp"
    with pytest.raises(Exception) as info:
        inference_session(model)
    assert "NoSuchOp" in str(info.value)


def test_amp_reference_of_a_newer_ir_model(tmp_path):
    import amp_cli

    model, w = _model(FUTURE_IR)
    path = tmp_path / "future.onnx"
    onnx.save(model, str(path))
    x = np.random.default_rng(4).normal(0, 1, (3, 8)).astype(np.float32)
    (got,) = amp_cli.load(str(path)).reference({"x": x})
    want = np.tanh(x.astype(np.float64)) @ w.astype(np.float64) + 1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

"""The mixed-precision pass on the graph shapes real exports contain (issue 20's failure
classes, each as the smallest ONNX graph that showed it): tuple arguments that mixed fp16 and
fp32 (Concat, ONNX Sum -> stack, Split outputs), call_tir from the importer's emit_te (Clip with
tensor bounds), control flow (If), and masking sentinels (finfo(fp32).min, -1e9).

Each converts for llvm at fp16 and bf16 and is checked against ONNX Runtime fp32 on seeded
random N(0, 1) inputs; tolerances (relative L2 over each output): fp16 1e-2, bf16 3e-2.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import amp_cli
from amp_cli.models import OPSET, GraphBuilder

TOL = {"fp16": 1e-2, "bf16": 3e-2}
F32_MIN = float(np.finfo(np.float32).min)


def _convert(model, tmp_path, precision, target="llvm", **cfg):
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    loaded = amp_cli.load(path)
    conv = amp_cli.convert(loaded, amp_cli.ConvertConfig(
        target=target, precision=amp_cli.PrecisionConfig(precision=precision), **cfg),
        isolate=False)
    conv.cleanup()
    return conv


def _check(conv, precision):
    worst = conv.accuracy["worst"]
    assert worst["nonfinite_share"] == 0, worst
    assert worst["rel_l2"] < TOL[precision], worst
    return conv


def concat_of_fp32_and_low():
    """ViT / DenseNet: a Concat whose inputs come out of an fp32 op (softmax) and a low one."""
    b = GraphBuilder(seed=1)
    h = b.op("MatMul", ["x", b.weight(16, 24)])
    s = b.op("Softmax", [h], axis=-1)
    r = b.op("Relu", [b.op("MatMul", ["x", b.weight(16, 8)])])
    cat = b.op("Concat", [s, r, b.const(np.ones((4, 3), np.float32), "cls")], axis=-1)
    y = b.op("MatMul", [cat, b.weight(35, 6)])
    return b.model([("x", [4, 16], "float32")], [(y, [4, 6], "float32")])


def onnx_sum_of_three():
    """ResNet / ShuffleNet from ONNX's model zoo: Sum imports as stack + sum."""
    b = GraphBuilder(seed=2)
    a = b.op("MatMul", ["x", b.weight(16, 16)])
    c = b.op("Softmax", ["x"], axis=-1)
    y = b.op("Sum", [a, c, "x"])
    return b.model([("x", [4, 16], "float32")], [(y, [4, 16], "float32")])


def split_reordered():
    """Split outputs (a tuple variable) read through TupleGetItem and concatenated back."""
    b = GraphBuilder(seed=3)
    h = b.op("MatMul", ["x", b.weight(16, 18)])
    p0, p1, p2 = b.op("Split", [h, b.const(np.array([6, 6, 6], np.int64), "sizes")], n_out=3,
                      axis=-1)
    y = b.op("Concat", [p2, b.op("Softmax", [p0], axis=-1), p1], axis=-1)
    return b.model([("x", [4, 16], "float32")], [(y, [4, 18], "float32")])


def clip_with_tensor_bounds():
    """MobileNet's ReLU6 exported with min/max inputs: the importer emits call_tir (emit_te)."""
    b = GraphBuilder(seed=4)
    h = b.op("MatMul", ["x", b.weight(16, 16)])
    c = b.op("Clip", [h, b.const(np.float32(0.0), "lo"), b.const(np.float32(0.6), "hi")])
    y = b.op("MatMul", [c, b.weight(16, 5)])
    return b.model([("x", [4, 16], "float32")], [(y, [4, 5], "float32")])


def masked_attention(sentinel: float, additive: bool):
    """GPT-2 / BERT: scores masked with finfo(fp32).min or -1e9, then softmax."""
    b = GraphBuilder(seed=5)
    q = b.op("MatMul", ["x", b.weight(16, 16)])
    k = b.op("MatMul", ["x", b.weight(16, 16)])
    scores = b.op("MatMul", [q, b.op("Transpose", [k], perm=[1, 0])])
    causal = np.tril(np.ones((6, 6), bool))
    if additive:  # (1 - keep) * min, as HF builds its extended attention mask
        keep = b.op("Cast", ["keep"], to=TensorProto.FLOAT)
        inv = b.op("Sub", [b.const(np.float32(1.0), "one"), keep])
        bias = b.op("Mul", [inv, b.const(np.float32(sentinel), "min")])
        masked = b.op("Add", [scores, bias])
        inputs = [("x", [6, 16], "float32"), ("keep", [6, 6], "int64")]
    else:
        masked = b.op("Where", [b.const(causal, "causal"), scores,
                                b.const(np.float32(sentinel), "min")])
        inputs = [("x", [6, 16], "float32")]
    p = b.op("Softmax", [masked], axis=-1)
    y = b.op("MatMul", [p, b.op("MatMul", ["x", b.weight(16, 8)])])
    return b.model(inputs, [(y, [6, 8], "float32")])


def if_on_a_flag():
    """Control flow: an If whose branches read a tensor the pass converted."""
    b = GraphBuilder(seed=6)
    h = b.op("MatMul", ["x", b.weight(8, 8)])
    then_out, else_out = "then_y", "else_y"
    then_g = helper.make_graph([helper.make_node("Relu", [h], [then_out])], "then", [],
                               [helper.make_tensor_value_info(then_out, TensorProto.FLOAT,
                                                              [4, 8])])
    else_g = helper.make_graph([helper.make_node("Neg", [h], [else_out])], "else", [],
                               [helper.make_tensor_value_info(else_out, TensorProto.FLOAT,
                                                              [4, 8])])
    b.nodes.append(helper.make_node("If", ["flag"], ["branch"], name="if_1",
                                    then_branch=then_g, else_branch=else_g))
    y = b.op("MatMul", ["branch", b.weight(8, 3)])
    g = helper.make_graph(b.nodes, "if_model",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8]),
                           helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info(y, TensorProto.FLOAT, [4, 3])],
                          b.inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


GRAPHS = {"concat": concat_of_fp32_and_low, "sum": onnx_sum_of_three,
          "split": split_reordered, "clip_call_tir": clip_with_tensor_bounds,
          "if": if_on_a_flag}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("name", list(GRAPHS))
def test_graph_converts_and_matches_ort(name, precision, tmp_path):
    conv = _check(_convert(GRAPHS[name](), tmp_path, precision), precision)
    assert conv.precision.converted_ops > 0


def test_tuple_members_share_one_dtype(tmp_path):
    """The concat reads a softmax (fp32 by policy): every member is cast to fp32 instead of a
    mixed tuple (the TypeError real ViT / DenseNet exports hit)."""
    conv = _check(_convert(concat_of_fp32_and_low(), tmp_path, "fp16"), "fp16")
    rows = {(r["op"], r["inputs"]) for r in conv.precision.op_dtypes}
    assert ("concat", "float32") in rows
    assert not any(r["op"] == "concat" and "," in r["inputs"] for r in conv.precision.op_dtypes)


def test_call_tir_keeps_its_types_and_is_reported(tmp_path):
    conv = _check(_convert(clip_with_tensor_bounds(), tmp_path, "fp16"), "fp16")
    kept = {(k.op, k.reason) for k in conv.precision.kept_fp32}
    assert ("call_tir", "unknown-op") in kept


def test_if_stays_fp32_and_is_reported(tmp_path):
    conv = _check(_convert(if_on_a_flag(), tmp_path, "bf16"), "bf16")
    assert ("If", "control-flow") in {(k.op, k.reason) for k in conv.precision.kept_fp32}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("sentinel", [F32_MIN, -1e9])
@pytest.mark.parametrize("additive", [False, True], ids=["where", "additive"])
def test_mask_sentinels_keep_their_meaning(sentinel, additive, precision, tmp_path):
    """The sentinel becomes the low type's lowest finite value (fp16: -65504) and the masked
    ops run in the low type: finite outputs that match fp32, and the report says so."""
    conv = _check(_convert(masked_attention(sentinel, additive), tmp_path, precision), precision)
    actions = [c.action for c in conv.precision.constants]
    low = "float16" if precision == "fp16" else "bfloat16"
    if additive:
        # the bias is built from the fp32 mask input: fp32 end to end, nothing to saturate
        assert actions == []
    else:
        # the select on fp16 scores runs low with the saturated sentinel (-1e9 fits bf16)
        assert actions == (["saturated-mask"] if precision == "fp16" or sentinel == F32_MIN
                           else [])
        assert any(r["op"] == "where" and r["output"] == low for r in conv.precision.op_dtypes)


def test_a_large_value_that_is_not_a_sentinel_keeps_its_op_in_fp32(tmp_path):
    """A bias of 70000 (out of fp16's range, far below the sentinel magnitude) is a value:
    never clamped; its op stays fp32."""
    b = GraphBuilder(seed=7)
    h = b.op("MatMul", ["x", b.weight(8, 8)])
    y = b.op("Add", [h, b.const(np.full((8,), 70000.0, np.float32), "bias")])
    model = b.model([("x", [4, 8], "float32")], [(y, [4, 8], "float32")])
    conv = _check(_convert(model, tmp_path, "fp16"), "fp16")
    assert [c.action for c in conv.precision.constants] == ["kept-fp32"]


@pytest.mark.parametrize("name", ["concat", "split", "clip_call_tir", "if"])
def test_graph_builds_for_cuda(name, tmp_path):
    """The same graphs through amp's CUDA pipeline: CUDA codegen for sm_90 (nvcc, no GPU)."""
    conv = _convert(GRAPHS[name](), tmp_path, "fp16", "cuda:sm_90", check_accuracy=False)
    assert conv.build.kernels


def test_where_mask_builds_for_cuda(tmp_path):
    conv = _convert(masked_attention(F32_MIN, False), tmp_path, "fp16", "cuda:sm_90",
                    check_accuracy=False)
    assert [c.action for c in conv.precision.constants] == ["saturated-mask"]


def test_node_names_with_dots_survive_the_pass(tmp_path):
    """The pass re-binds each node under its exact name ('/model.9/Conv', not '/model_9/Conv'),
    so what the auto-precision search and the bf16 fallback look up by node name is there."""
    from amp_cli.precision.auto import node_modes
    from amp_cli.precision.convert import convert_precision

    b = GraphBuilder(seed=8)
    h = b.op("MatMul", ["x", b.weight(8, 8)])
    b.nodes[-1].name = "/model.9/MatMul"
    y = b.op("Relu", [h])
    b.nodes[-1].name = "/model.9/act.relu"
    path = tmp_path / "dots.onnx"
    onnx.save(b.model([("x", [4, 8], "float32")], [(y, [4, 8], "float32")]), str(path))
    model = amp_cli.load(path)
    mod, _ = convert_precision(model.mod, amp_cli.PrecisionConfig(precision="fp16"),
                               model.node_types)
    assert set(node_modes(mod, "float16")) == {"/model.9/MatMul", "/model.9/act.relu"}

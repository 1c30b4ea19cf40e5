"""ONNX LSTM / GRU / RNN (amp_cli/frontend/rnn.py) against ONNX Runtime fp32.

Models come from torch.nn.LSTM / GRU / RNN (``torch.onnx.export(dynamo=False)``) and from
onnx.helper, for the attributes torch never emits (reverse, layout=1, sequence_lens, peepholes,
clip, initial states, input_forget, other activations). Each is converted by amp for llvm and
run on seeded random N(0, 1) inputs; tolerances (relative L2 over each output): fp32 1e-5,
fp16 1e-2, bf16 3e-2. Measured on every case here (2026-12-04): fp32 <= 1.8e-7, fp16 <= 7.4e-4,
bf16 <= 5.2e-3.
"""
from __future__ import annotations

import io
import json

import numpy as np
import onnx
import pytest

import amp_cli
from amp_cli.accuracy import LibraryRunner, metrics
from amp_cli.errors import UnsupportedOpError
from amp_cli.models import GraphBuilder

ort = pytest.importorskip("onnxruntime")

TOL = {"fp32": 1e-5, "fp16": 1e-2, "bf16": 3e-2}
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


# --- models -----------------------------------------------------------------------------
def rnn_model(op: str, *, seq=5, batch=3, inp=4, hidden=6, direction="forward", layout=0,
              bias=True, lens=None, h0=None, c0=None, peepholes=False, n_out=None, seed=0,
              **attrs) -> onnx.ModelProto:
    """One ONNX ``op`` node reading input ``x``. ``lens``: a list (constant sequence_lens) or
    "input"; ``h0`` / ``c0``: "const" or "input"; ``attrs``: more node attributes."""
    b = GraphBuilder(seed=seed)
    ndir = 2 if direction == "bidirectional" else 1
    gh = GATES[op] * hidden
    x_shape = [seq, batch, inp] if layout == 0 else [batch, seq, inp]
    state_shape = [ndir, batch, hidden] if layout == 0 else [batch, ndir, hidden]
    inputs = [("x", x_shape, "float32")]
    args = ["x", b.weight(ndir, gh, inp, scale=0.5), b.weight(ndir, gh, hidden, scale=0.5),
            b.weight(ndir, 2 * gh, scale=0.5) if bias else ""]
    if lens == "input":
        inputs.append(("lens", [batch], "int32"))
        args.append("lens")
    else:
        args.append("" if lens is None else b.const(np.array(lens, np.int32), "lens"))
    for name, how in (("h0", h0), ("c0", c0)):
        if name == "c0" and op != "LSTM":
            continue
        if how == "input":
            inputs.append((name, state_shape, "float32"))
            args.append(name)
        else:
            args.append(b.weight(*state_shape, scale=1.0) if how == "const" else "")
    if peepholes:
        args.append(b.weight(ndir, 3 * hidden, scale=0.5))
    while args[-1] == "":
        args.pop()
    n_out = n_out or (3 if op == "LSTM" else 2)
    outs = b.op(op, args, n_out=n_out, hidden_size=hidden, direction=direction, layout=layout,
                **attrs)
    outs = outs if isinstance(outs, list) else [outs]
    y_shape = [seq, ndir, batch, hidden] if layout == 0 else [batch, seq, ndir, hidden]
    shapes = [y_shape, state_shape, state_shape]
    return b.model(inputs, [(o, s, "float32") for o, s in zip(outs, shapes)])


def torch_model(kind: str, *, seq=4, batch=2, inp=8, hidden=12, states=False, **kw):
    """torch.nn.LSTM / GRU / RNN exported with the TorchScript exporter; outputs y and the final
    states. ``states``: the initial states are model inputs."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    cls = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}[kind]
    layers = kw.get("num_layers", 1) * (2 if kw.get("bidirectional") else 1)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = cls(inp, hidden, **kw)

        def forward(self, x, *init):
            if kind == "lstm" and init:
                init = (tuple(init),)
            y, h = self.rnn(x, *init)
            return (y, *h) if kind == "lstm" else (y, h)

    x = torch.randn(batch, seq, inp) if kw.get("batch_first") else torch.randn(seq, batch, inp)
    args = [x]
    names = ["x"]
    if states:
        n = 2 if kind == "lstm" else 1
        args += [torch.randn(layers, batch, hidden) for _ in range(n)]
        names += ["h0", "c0"][:n]
    buf = io.BytesIO()
    torch.onnx.export(Net().eval(), tuple(args), buf, dynamo=False, input_names=names,
                      opset_version=17)
    return onnx.load_from_string(buf.getvalue())


def layout0_twin(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same model with its recurrent node in layout 0 between Transposes: ONNX Runtime's CPU
    LSTM and GRU refuse layout 1 ("Batchwise recurrent operations are not supported")."""
    twin = onnx.ModelProto()
    twin.CopyFrom(model)
    graph = twin.graph
    node = next(n for n in graph.node if n.op_type in GATES)
    for a in node.attribute:
        if a.name == "layout":
            a.i = 0
    before, after = [], []
    for slot in (0, 5, 6):
        if slot < len(node.input) and node.input[slot]:
            src = node.input[slot]
            node.input[slot] = f"{src}_layout0"
            before.append(onnx.helper.make_node("Transpose", [src], [node.input[slot]],
                                                perm=[1, 0, 2]))
    for k, out in enumerate(node.output):
        node.output[k] = f"{out}_layout0"
        after.append(onnx.helper.make_node("Transpose", [node.output[k]], [out],
                                           perm=[2, 0, 1, 3] if k == 0 else [1, 0, 2]))
    nodes = before + list(graph.node) + after
    del graph.node[:]
    graph.node.extend(nodes)
    return twin


# --- checking ---------------------------------------------------------------------------
def feeds_for(model: onnx.ModelProto, seed=0, lens=None) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        if vi.type.tensor_type.elem_type == onnx.TensorProto.INT32:
            feeds[vi.name] = np.array(lens, np.int32)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def run_amp(model, tmp_path, precision, feeds, target="llvm"):
    """amp's build of ``model`` at ``precision``, run on ``feeds``; with the conversion."""
    path = tmp_path / f"{precision}.onnx"
    onnx.save(model, str(path))
    loaded = amp_cli.load(path)
    cfg = amp_cli.ConvertConfig(target=target, check_accuracy=False,
                                precision=amp_cli.PrecisionConfig(precision=precision))
    conv = amp_cli.convert(loaded, cfg, isolate=False)
    try:
        if target != "llvm":
            return None, conv
        return LibraryRunner(conv.library)(feeds, [s.name for s in loaded.inputs]), conv
    finally:
        conv.cleanup()


def check(model, tmp_path, precisions=("fp32",), lens=None, seed=0) -> dict:
    """rel L2 of every output vs ONNX Runtime fp32, per precision; asserts the tolerances."""
    feeds = feeds_for(model, seed, lens)
    ref_model = layout0_twin(model) if any(
        a.name == "layout" and a.i == 1 for n in model.graph.node for a in n.attribute) else model
    sess = ort.InferenceSession(ref_model.SerializeToString(),
                                providers=["CPUExecutionProvider"])
    ref = sess.run(None, feeds)
    worst = {}
    for precision in precisions:
        got, _ = run_amp(model, tmp_path, precision, feeds)
        assert len(got) == len(ref)
        errs = [metrics(r, g) for r, g in zip(ref, got)]
        assert all(list(r.shape) == list(g.shape) for r, g in zip(ref, got))
        worst[precision] = max(e["rel_l2"] for e in errs)
        assert worst[precision] < TOL[precision], (precision, errs)
    return worst


# --- torch exports ----------------------------------------------------------------------
TORCH = {
    "lstm-bidirectional-2-layers": dict(kind="lstm", num_layers=2, bidirectional=True),
    "gru-bidirectional-2-layers-batch-first": dict(kind="gru", num_layers=2, bidirectional=True,
                                                   batch_first=True),
    "rnn-relu": dict(kind="rnn", nonlinearity="relu"),
    "lstm-2-layers-initial-states": dict(kind="lstm", num_layers=2, states=True),
}
TORCH_PRECISIONS = {"lstm-2-layers-initial-states": ("fp32", "fp16")}


@pytest.mark.parametrize("name", list(TORCH))
def test_torch_export(name, tmp_path):
    """torch exports GRU with linear_before_reset=1 and layer stacks as one node per layer."""
    kw = dict(TORCH[name])
    model = torch_model(kw.pop("kind"), **kw)
    assert any(n.op_type in GATES for n in model.graph.node)
    check(model, tmp_path, TORCH_PRECISIONS.get(name, ("fp32", "fp16", "bf16")))


# --- attributes torch never emits -------------------------------------------------------
CASES = {  # name: (model, runtime sequence_lens or None, precisions)
    "lstm-reverse-peepholes-clip-states": (
        lambda: rnn_model("LSTM", direction="reverse", peepholes=True, clip=0.7, h0="input",
                          c0="input"), None, ("fp32", "fp16", "bf16")),
    "lstm-layout1-bidirectional-states": (
        lambda: rnn_model("LSTM", direction="bidirectional", layout=1, h0="input", c0="const"),
        None, ("fp32",)),
    "lstm-bidirectional-sequence-lens-const-states": (
        lambda: rnn_model("LSTM", direction="bidirectional", lens=[5, 3, 1], h0="const",
                          c0="const", peepholes=True), None, ("fp32", "fp16")),
    "lstm-input-forget-sequence-lens-input": (
        lambda: rnn_model("LSTM", direction="bidirectional", input_forget=1, lens="input"),
        [2, 5, 4], ("fp32", "bf16")),
    "lstm-zero-length-sequence": (  # ONNX Runtime: Y_h / Y_c of an empty sequence are 0
        lambda: rnn_model("LSTM", direction="bidirectional", lens=[0, 5, 2], h0="const",
                          c0="const"), None, ("fp32",)),
    "lstm-activations": (
        lambda: rnn_model("LSTM", direction="bidirectional", activation_alpha=[0.3, 0.8, 1.5],
                          activation_beta=[0.4, 0.6], activations=[
                              "HardSigmoid", "Elu", "Softsign", "Sigmoid", "ScaledTanh",
                              "Softplus"]), None, ("fp32",)),
    "lstm-only-y": (lambda: rnn_model("LSTM", n_out=1), None, ("fp32",)),
    "gru-layout1-bidirectional-sequence-lens": (
        lambda: rnn_model("GRU", direction="bidirectional", layout=1, lens=[4, 2, 5]), None,
        ("fp32", "bf16")),
    "gru-linear-before-reset-reverse-clip-state": (
        lambda: rnn_model("GRU", direction="reverse", linear_before_reset=1, clip=0.5,
                          h0="input"), None, ("fp32",)),
    "gru-activations-no-bias": (
        lambda: rnn_model("GRU", bias=False, activations=["Affine", "ThresholdedRelu"],
                          activation_alpha=[0.5, 0.2], activation_beta=[0.3]), None, ("fp32",)),
    "rnn-bidirectional-relu-leakyrelu-sequence-lens": (
        lambda: rnn_model("RNN", direction="bidirectional", activations=["Relu", "LeakyRelu"],
                          activation_alpha=[0.3], lens=[3, 5, 1]), None, ("fp32", "fp16")),
    "rnn-reverse-sequence-lens-input-state": (
        lambda: rnn_model("RNN", direction="reverse", lens="input", h0="input"), [1, 4, 5],
        ("fp32",)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_onnx_attributes(name, tmp_path):
    make, lens, precisions = CASES[name]
    check(make(), tmp_path, precisions, lens=lens)


# --- the imported graph -----------------------------------------------------------------
def _load(model, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    return amp_cli.load(path)


def test_node_binding_named_and_matmuls_low(tmp_path):
    """A multi-output node's last binding is its output tuple, named 'onnx:<node>'; after the
    fp16 pass the matmuls read fp16 and every pointwise op of the cell runs in fp32."""
    from amp_cli.precision import convert_precision

    for n_out in (1, 3):  # Y alone: the converter leaves its last op to the importer to bind
        loaded = _load(rnn_model("LSTM", direction="bidirectional", n_out=n_out), tmp_path)
        (node,) = [n for n, t in loaded.node_types.items() if t == "LSTM"]
        names = [b.var.name for blk in loaded.mod["main"].body.blocks for b in blk.bindings]
        assert f"onnx:{node}" in names
    _, rep = convert_precision(loaded.mod, amp_cli.PrecisionConfig(precision="fp16"),
                               loaded.node_types)
    rows = {(r["op"], r["inputs"], r["output"]) for r in rep.op_dtypes}
    assert ("matmul", "float16", "float32") in rows
    pointwise = {r for r in rows if r[0] in ("sigmoid", "tanh", "multiply")}
    assert pointwise and all(r[2] == "float32" for r in pointwise), rows
    # --exclude-node reaches every op of the recurrent node: its matmuls stay fp32 too
    cfg = amp_cli.PrecisionConfig(precision="fp16")
    cfg.policy.exclude_nodes = [node]
    _, rep = convert_precision(loaded.mod, cfg, loaded.node_types)
    assert not [r for r in rep.op_dtypes if r["op"] == "matmul" and r["inputs"] != "float32"]


def test_cuda_codegen(tmp_path):
    """A bidirectional LSTM compiles for cuda:sm_90 at fp16 (nvcc; no GPU needed)."""
    _, conv = run_amp(rnn_model("LSTM", direction="bidirectional", seq=4), tmp_path, "fp16",
                      None, target="cuda:sm_90")
    assert conv.build.target["arch"] == "sm_90"
    assert conv.build.cuda_source_bytes > 0 and conv.report["build"]["kernels"]


CLI_MODELS = {
    "torch-lstm": lambda: torch_model("lstm", bidirectional=True),
    # the accuracy check's random lengths must be valid ones: [0, seq] (input_values.py)
    "sequence-lens-input": lambda: rnn_model("LSTM", direction="bidirectional", lens="input"),
}


@pytest.mark.parametrize("name", list(CLI_MODELS))
def test_cli_convert(name, tmp_path, cli):
    path = tmp_path / "lstm.onnx"
    onnx.save(CLI_MODELS[name](), str(path))
    out = tmp_path / "out"
    res = cli("convert", path, "-o", out, "--target", "llvm")
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert report["accuracy"]["worst"]["rel_l2"] < TOL["fp16"]
    assert report["accuracy"]["within_tolerance"]


# --- what amp refuses, with a one-line reason naming the node ---------------------------
REFUSED = {
    "unknown activation": (lambda: rnn_model("RNN", activations=["Gelu"]),
                           "activation 'Gelu' is not supported"),
    "activation default disputed": (lambda: rnn_model("RNN", activations=["Affine"]),
                                    "needs an explicit activation_alpha"),
    "wrong activation count": (lambda: rnn_model("LSTM", activations=["Sigmoid", "Tanh"]),
                               "2 activations given, expected 3"),
    "weights not constant": (lambda: _weights_as_input(), "input W must be a constant"),
}


def _weights_as_input():
    model = rnn_model("RNN", hidden=6, inp=4)
    w = model.graph.initializer[0]
    model.graph.input.append(onnx.helper.make_tensor_value_info(w.name, onnx.TensorProto.FLOAT,
                                                                list(w.dims)))
    del model.graph.initializer[0]
    return model


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused(case, tmp_path):
    make, message = REFUSED[case]
    model = make()
    node = next(n.name for n in model.graph.node if n.op_type in GATES)
    with pytest.raises(UnsupportedOpError) as err:
        _load(model, tmp_path)
    text = str(err.value)
    assert message in text and f"node '{node}'" in text and "\n" not in text, text


def test_symbolic_sequence_length_refused(tmp_path):
    model = rnn_model("GRU")
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "seq"
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    with pytest.raises(amp_cli.errors.AmpError) as err:
        amp_cli.load(path)
    assert "seq" in str(err.value)

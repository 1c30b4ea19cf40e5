"""Small ONNX models built in code (random weights, no downloads) for the demo, tests and benches.

Sizes are deliberately odd (channels 3/5/13, hidden 75, heads of 15) because odd sizes are what
break fp16 vectorization on CUDA.
"""
from __future__ import annotations

import numpy as np

OPSET = 17


class GraphBuilder:
    """A tiny helper over onnx.helper: named nodes, random initializers, fp32 I/O."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits, self.count = [], [], 0

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}_{self.count}"

    def const(self, array: np.ndarray, prefix: str = "w") -> str:
        from onnx import numpy_helper

        name = self.name(prefix)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(self, *shape, scale: float | None = None) -> str:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else int(shape[0])
        s = scale if scale is not None else 1.0 / np.sqrt(max(fan_in, 1))
        return self.const((self.rng.standard_normal(shape) * s).astype("float32"))

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs):
        from onnx import helper

        name = self.name(op_type.lower())
        outs = [f"{name}_out{i}" if n_out > 1 else f"{name}_out" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, **attrs))
        return outs if n_out > 1 else outs[0]

    def model(self, inputs, outputs, graph_name="amp_example"):
        """inputs/outputs: list of (name, shape, elem_type str)."""
        import onnx
        from onnx import TensorProto, helper

        types = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64,
                 "int32": TensorProto.INT32, "bool": TensorProto.BOOL}
        g = helper.make_graph(
            self.nodes, graph_name,
            [helper.make_tensor_value_info(n, types[t], s) for n, s, t in inputs],
            [helper.make_tensor_value_info(n, types[t], s) for n, s, t in outputs], self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="amp")
        m.ir_version = 8
        onnx.checker.check_model(m)
        return m

    # -- blocks ------------------------------------------------------------------------------
    def conv_bn_relu(self, x, cin, cout, k=3, stride=1, relu=True):
        w = self.weight(cout, cin, k, k)
        y = self.op("Conv", [x, w, self.const(self.rng.standard_normal(cout).astype("float32")
                                              * 0.1)],
                    kernel_shape=[k, k], pads=[k // 2] * 4, strides=[stride, stride])
        scale = self.const((1 + 0.1 * self.rng.standard_normal(cout)).astype("float32"))
        bias = self.const((0.1 * self.rng.standard_normal(cout)).astype("float32"))
        mean = self.const((0.1 * self.rng.standard_normal(cout)).astype("float32"))
        var = self.const((1 + 0.1 * self.rng.random(cout)).astype("float32"))
        y = self.op("BatchNormalization", [y, scale, bias, mean, var], epsilon=1e-5)
        return self.op("Relu", [y]) if relu else y

    def layer_norm(self, x, hidden):
        g = self.const((1 + 0.1 * self.rng.standard_normal(hidden)).astype("float32"))
        b = self.const((0.1 * self.rng.standard_normal(hidden)).astype("float32"))
        return self.op("LayerNormalization", [x, g, b], axis=-1, epsilon=1e-5)

    def linear(self, x, din, dout):
        y = self.op("MatMul", [x, self.weight(din, dout)])
        return self.op("Add", [y, self.const((0.02 * self.rng.standard_normal(dout))
                                             .astype("float32"))])

    def encoder_layer(self, x, batch, seq, hidden, heads, ffn):
        dh = hidden // heads

        def split_heads(t):
            t = self.op("Reshape", [t, self.const(np.array([batch, seq, heads, dh], "int64"),
                                                  "shape")])
            return self.op("Transpose", [t], perm=[0, 2, 1, 3])

        q = split_heads(self.linear(x, hidden, hidden))
        k = split_heads(self.linear(x, hidden, hidden))
        v = split_heads(self.linear(x, hidden, hidden))
        kt = self.op("Transpose", [k], perm=[0, 1, 3, 2])
        s = self.op("MatMul", [q, kt])
        s = self.op("Mul", [s, self.const(np.array(1.0 / np.sqrt(dh), "float32"), "scale")])
        p = self.op("Softmax", [s], axis=-1)
        ctx = self.op("MatMul", [p, v])
        ctx = self.op("Transpose", [ctx], perm=[0, 2, 1, 3])
        ctx = self.op("Reshape", [ctx, self.const(np.array([batch, seq, hidden], "int64"),
                                                  "shape")])
        x = self.layer_norm(self.op("Add", [x, self.linear(ctx, hidden, hidden)]), hidden)
        h = self.op("Gelu", [self.linear(x, hidden, ffn)]) if OPSET >= 20 else \
            self._gelu(self.linear(x, hidden, ffn))
        return self.layer_norm(self.op("Add", [x, self.linear(h, ffn, hidden)]), hidden)

    def _gelu(self, x):
        c = self.const(np.array(1 / np.sqrt(2), "float32"), "c")
        e = self.op("Erf", [self.op("Mul", [x, c])])
        one = self.const(np.array(1.0, "float32"), "one")
        half = self.const(np.array(0.5, "float32"), "half")
        return self.op("Mul", [self.op("Mul", [x, self.op("Add", [e, one])]), half])


def tiny_cnn(batch=1, size=32, seed=0):
    """Conv-BN-ReLU stack with odd channels, a residual add, pooling and a Gemm head."""
    b = GraphBuilder(seed)
    x = b.conv_bn_relu("input", 3, 13, k=3)
    y = b.conv_bn_relu(x, 13, 13, k=3, relu=False)
    x = b.op("Relu", [b.op("Add", [x, y])])
    x = b.conv_bn_relu(x, 13, 21, k=5, stride=2)
    x = b.op("GlobalAveragePool", [x])
    x = b.op("Flatten", [x], axis=1)
    x = b.op("Gemm", [x, b.weight(10, 21), b.const(np.zeros(10, "float32") + 0.01)], transB=1)
    out = b.op("Softmax", [x], axis=-1)
    return b.model([("input", ["batch", 3, size, size], "float32")],
                   [(out, ["batch", 10], "float32")], "tiny_cnn")


def tiny_bert(batch=1, seq=12, hidden=75, heads=5, ffn=150, layers=1, seed=0):
    """Encoder layers with attention, odd hidden size (75 = 5 heads of 15) and LayerNorm."""
    b = GraphBuilder(seed)
    x = "input"
    for _ in range(layers):
        x = b.encoder_layer(x, batch, seq, hidden, heads, ffn)
    return b.model([("input", [batch, seq, hidden], "float32")],
                   [(x, [batch, seq, hidden], "float32")], "tiny_bert")


def dynamic_bert(hidden=64, heads=4, ffn=128, layers=1, vocab=50, seed=0):
    """A BERT-like encoder on token ids with a padding mask, whose inputs keep the symbolic
    dims ``batch`` and ``sequence`` (Reshape with 0 = "copy this dim"): the model of the
    dynamic-shape tests (docs/dynamic-shapes.md)."""
    b = GraphBuilder(seed)
    dh = hidden // heads
    x = b.op("Gather", [b.weight(vocab, hidden, scale=1.0), "input_ids"], axis=0)
    mask = b.op("Unsqueeze", [b.op("Cast", ["attention_mask"], to=1),
                              b.const(np.array([1, 2], "int64"), "axes")])
    one = b.const(np.array(1.0, "float32"), "one")
    mask = b.op("Mul", [b.op("Sub", [one, mask]), b.const(np.array(-10000.0, "float32"), "neg")])
    x = b.layer_norm(x, hidden)
    heads_shape = b.const(np.array([0, 0, heads, dh], "int64"), "shape")
    hidden_shape = b.const(np.array([0, 0, hidden], "int64"), "shape")
    for _ in range(layers):
        q, k, v = (b.op("Transpose", [b.op("Reshape", [b.linear(x, hidden, hidden),
                                                        heads_shape])], perm=[0, 2, 1, 3])
                   for _ in range(3))
        s = b.op("MatMul", [q, b.op("Transpose", [k], perm=[0, 1, 3, 2])])
        s = b.op("Add", [b.op("Mul", [s, b.const(np.array(1 / np.sqrt(dh), "float32"))]),
                         mask])
        ctx = b.op("Transpose", [b.op("MatMul", [b.op("Softmax", [s], axis=-1), v])],
                   perm=[0, 2, 1, 3])
        ctx = b.op("Reshape", [ctx, hidden_shape])
        x = b.layer_norm(b.op("Add", [x, b.linear(ctx, hidden, hidden)]), hidden)
        h = b._gelu(b.linear(x, hidden, ffn))
        x = b.layer_norm(b.op("Add", [x, b.linear(h, ffn, hidden)]), hidden)
    dims = ["batch", "sequence"]
    return b.model([("input_ids", dims, "int64"), ("attention_mask", dims, "int64")],
                   [(x, dims + [hidden], "float32")], "dynamic_bert")


EXAMPLES = {"tiny_cnn": tiny_cnn, "tiny_bert": tiny_bert}


def write_examples(outdir) -> list:
    import onnx
    from pathlib import Path

    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fn in EXAMPLES.items():
        p = out / f"{name}.onnx"
        onnx.save(fn(), str(p))
        paths.append(p)
    return paths


def torch_tiny_convnet():
    """A small torch module (odd channels, conv + linear + layernorm) for the torch frontend.
    Spec for the CLI: ``amp_cli.models:torch_tiny_convnet`` with --input-shape x:1x3x16x16."""
    import torch
    from torch import nn

    class TinyConvNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 7, 3, padding=1)
            self.norm = nn.LayerNorm(7)
            self.fc = nn.Linear(7, 5)

        def forward(self, x):
            y = torch.relu(self.conv(x)).mean(dim=(2, 3))
            return torch.softmax(self.fc(self.norm(y)), dim=-1)

    torch.manual_seed(0)
    return TinyConvNet().eval()


if __name__ == "__main__":  # python -m amp_cli.models OUTDIR
    import sys

    for written in write_examples(sys.argv[1] if len(sys.argv) > 1 else "examples/generated"):
        print(f"wrote {written}")

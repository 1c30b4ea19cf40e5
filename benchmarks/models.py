"""Benchmark models built in code with random weights (nothing is downloaded).

Each model exists twice, from the *same* numpy weights: as an ONNX graph (what amp and ONNX
Runtime run) and as a hand-written torch ``nn.Module`` (what PyTorch eager / torch.compile run),
so every runner computes the same function. torchvision / transformers are not needed.

* resnet50: ResNet-50 v1.5 (bottleneck blocks [3, 4, 6, 3], stride on the 3x3 conv, Conv +
  BatchNormalization (inference) + Relu, MaxPool, GlobalAveragePool, Gemm 2048 -> 1000), NCHW.
* bert: a BERT encoder on token ids: word + position embeddings, LayerNorm, ``layers`` post-LN
  encoder layers (separate Q/K/V projections, softmax attention without a mask, exact-erf GELU
  FFN), output last_hidden_state [batch, seq, hidden]. bert-large: hidden 1024, 16 heads,
  FFN 4096, 24 layers, vocab 30522.

Weights are scaled so activations stay O(1) through the whole network (He-initialized convs,
small gamma on each residual branch's last BatchNorm, 0.02-std linears as in BERT), which keeps
fp16 runs finite like a trained model's would be.

Suites (``SUITES``): "gpu" (the seed's reference shapes: resnet50 8x3x224x224, bert-large 8x128)
and "cpu" (resnet50 1x3x224x224, a BERT-base-shaped 4-layer encoder at 1x128).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

BN_EPS = 1e-5
LN_EPS = 1e-12


# ---------------------------------------------------------------------------------------------
# Weights


def resnet50_weights(seed: int = 0, blocks=(3, 4, 6, 3), num_classes: int = 1000) -> dict:
    """numpy weights keyed by the torch module's state_dict names."""
    rng = np.random.default_rng(seed)
    w: dict[str, np.ndarray] = {}

    def conv(name, cout, cin, k):
        w[name] = (rng.standard_normal((cout, cin, k, k)) *
                   math.sqrt(2.0 / (cin * k * k))).astype("float32")

    def bn(name, c, gamma=1.0):
        w[f"{name}.weight"] = (gamma * rng.uniform(0.8, 1.2, c)).astype("float32")
        w[f"{name}.bias"] = rng.uniform(-0.1, 0.1, c).astype("float32")
        w[f"{name}.running_mean"] = rng.uniform(-0.1, 0.1, c).astype("float32")
        w[f"{name}.running_var"] = rng.uniform(0.8, 1.2, c).astype("float32")

    conv("conv1.weight", 64, 3, 7)
    bn("bn1", 64)
    cin = 64
    for li, n in enumerate(blocks):
        width = 64 * 2 ** li
        for b in range(n):
            p = f"layer{li + 1}.{b}"
            conv(f"{p}.conv1.weight", width, cin, 1)
            bn(f"{p}.bn1", width)
            conv(f"{p}.conv2.weight", width, width, 3)
            bn(f"{p}.bn2", width)
            conv(f"{p}.conv3.weight", width * 4, width, 1)
            bn(f"{p}.bn3", width * 4, gamma=0.2)  # keeps the residual stream O(1)
            if b == 0:
                conv(f"{p}.downsample.0.weight", width * 4, cin, 1)
                bn(f"{p}.downsample.1", width * 4)
            cin = width * 4
    w["fc.weight"] = (rng.standard_normal((num_classes, cin)) / math.sqrt(cin)).astype("float32")
    w["fc.bias"] = rng.uniform(-0.1, 0.1, num_classes).astype("float32")
    return w


def bert_weights(seed: int = 0, layers: int = 24, hidden: int = 1024, ffn: int = 4096,
                 vocab: int = 30522, max_pos: int = 512) -> dict:
    rng = np.random.default_rng(seed)
    w: dict[str, np.ndarray] = {}

    def normal(*shape, std=0.02):
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype("float32")

    def linear(name, dout, din):
        w[f"{name}.weight"] = normal(dout, din)
        w[f"{name}.bias"] = normal(dout)

    def ln(name):
        w[f"{name}.weight"] = (1 + normal(hidden, std=0.05)).astype("float32")
        w[f"{name}.bias"] = normal(hidden)

    w["word_embeddings.weight"] = normal(vocab, hidden, std=1.0)
    w["position_embeddings.weight"] = normal(max_pos, hidden, std=0.5)
    ln("emb_ln")
    for i in range(layers):
        p = f"layers.{i}"
        for name in ("q", "k", "v", "o"):
            linear(f"{p}.{name}", hidden, hidden)
        ln(f"{p}.ln1")
        linear(f"{p}.ffn1", ffn, hidden)
        linear(f"{p}.ffn2", hidden, ffn)
        ln(f"{p}.ln2")
    return w


# ---------------------------------------------------------------------------------------------
# ONNX graphs (amp_cli.models.GraphBuilder)


def resnet50_onnx(weights: dict, batch: int = 8, image: int = 224, blocks=(3, 4, 6, 3)):
    from amp_cli.models import GraphBuilder

    g = GraphBuilder()
    c = g.const

    def conv_bn(x, conv, bn, stride, k, relu):
        y = g.op("Conv", [x, c(weights[conv])], kernel_shape=[k, k], strides=[stride, stride],
                 pads=[k // 2] * 4)
        y = g.op("BatchNormalization", [y] + [c(weights[f"{bn}.{n}"]) for n in
                                              ("weight", "bias", "running_mean", "running_var")],
                 epsilon=BN_EPS)
        return g.op("Relu", [y]) if relu else y

    x = conv_bn("input", "conv1.weight", "bn1", 2, 7, True)
    x = g.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    for li, n in enumerate(blocks):
        for b in range(n):
            p = f"layer{li + 1}.{b}"
            stride = 2 if (b == 0 and li > 0) else 1
            y = conv_bn(x, f"{p}.conv1.weight", f"{p}.bn1", 1, 1, True)
            y = conv_bn(y, f"{p}.conv2.weight", f"{p}.bn2", stride, 3, True)
            y = conv_bn(y, f"{p}.conv3.weight", f"{p}.bn3", 1, 1, False)
            sc = conv_bn(x, f"{p}.downsample.0.weight", f"{p}.downsample.1", stride, 1, False) \
                if b == 0 else x
            x = g.op("Relu", [g.op("Add", [y, sc])])
    x = g.op("Flatten", [g.op("GlobalAveragePool", [x])], axis=1)
    x = g.op("Gemm", [x, c(weights["fc.weight"]), c(weights["fc.bias"])], transB=1)
    classes = weights["fc.weight"].shape[0]
    return g.model([("input", [batch, 3, image, image], "float32")],
                   [(x, [batch, classes], "float32")], "resnet50")


def bert_onnx(weights: dict, batch: int = 8, seq: int = 128, heads: int = 16):
    from amp_cli.models import GraphBuilder

    g = GraphBuilder()
    c = g.const
    hidden = weights["word_embeddings.weight"].shape[1]
    layers = len({k.split(".")[1] for k in weights if k.startswith("layers.")})
    dh = hidden // heads
    split = c(np.array([batch, seq, heads, dh], "int64"), "shape")
    merge = c(np.array([batch, seq, hidden], "int64"), "shape")
    scale = c(np.array(1.0 / math.sqrt(dh), "float32"), "scale")
    half, one = c(np.array(0.5, "float32"), "c"), c(np.array(1.0, "float32"), "c")
    rsqrt2 = c(np.array(1.0 / math.sqrt(2.0), "float32"), "c")

    def linear(x, name):  # torch Linear weight is [out, in]; ONNX MatMul wants [in, out]
        y = g.op("MatMul", [x, c(np.ascontiguousarray(weights[f"{name}.weight"].T))])
        return g.op("Add", [y, c(weights[f"{name}.bias"])])

    def ln(x, name):
        return g.op("LayerNormalization", [x, c(weights[f"{name}.weight"]),
                                           c(weights[f"{name}.bias"])], axis=-1, epsilon=LN_EPS)

    x = g.op("Gather", [c(weights["word_embeddings.weight"]), "input_ids"], axis=0)
    x = g.op("Add", [x, c(weights["position_embeddings.weight"][:seq])])
    x = ln(x, "emb_ln")
    for i in range(layers):
        p = f"layers.{i}"
        q = g.op("Transpose", [g.op("Reshape", [linear(x, f"{p}.q"), split])], perm=[0, 2, 1, 3])
        k = g.op("Transpose", [g.op("Reshape", [linear(x, f"{p}.k"), split])], perm=[0, 2, 3, 1])
        v = g.op("Transpose", [g.op("Reshape", [linear(x, f"{p}.v"), split])], perm=[0, 2, 1, 3])
        s = g.op("Mul", [g.op("MatMul", [q, k]), scale])
        a = g.op("MatMul", [g.op("Softmax", [s], axis=-1), v])
        a = g.op("Reshape", [g.op("Transpose", [a], perm=[0, 2, 1, 3]), merge])
        x = ln(g.op("Add", [x, linear(a, f"{p}.o")]), f"{p}.ln1")
        h = linear(x, f"{p}.ffn1")
        h = g.op("Mul", [g.op("Mul", [h, half]),
                         g.op("Add", [g.op("Erf", [g.op("Mul", [h, rsqrt2])]), one])])
        x = ln(g.op("Add", [x, linear(h, f"{p}.ffn2")]), f"{p}.ln2")
    m = g.model([("input_ids", [batch, seq], "int64")],
                [(x, [batch, seq, hidden], "float32")], "bert")
    return m


# ---------------------------------------------------------------------------------------------
# torch modules (same weights)


def resnet50_torch(weights: dict, blocks=(3, 4, 6, 3)):
    import torch
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin, width, stride, down):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width, eps=BN_EPS)
            self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(width, eps=BN_EPS)
            self.conv3 = nn.Conv2d(width, width * 4, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(width * 4, eps=BN_EPS)
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, width * 4, 1, stride, bias=False),
                nn.BatchNorm2d(width * 4, eps=BN_EPS)) if down else None

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            y = torch.relu(self.bn2(self.conv2(y)))
            y = self.bn3(self.conv3(y))
            return torch.relu(y + (self.downsample(x) if self.downsample is not None else x))

    class ResNet50(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64, eps=BN_EPS)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            cin = 64
            for li, n in enumerate(blocks):
                width = 64 * 2 ** li
                layer = []
                for b in range(n):
                    layer.append(Bottleneck(cin, width, 2 if (b == 0 and li > 0) else 1, b == 0))
                    cin = width * 4
                setattr(self, f"layer{li + 1}", nn.Sequential(*layer))
            self.fc = nn.Linear(cin, weights["fc.weight"].shape[0])

        def forward(self, x):
            x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
            for li in range(len(blocks)):
                x = getattr(self, f"layer{li + 1}")(x)
            return self.fc(torch.flatten(x.mean(dim=(2, 3)), 1))

    return _with_weights(ResNet50(), weights)


def bert_torch(weights: dict, heads: int = 16):
    import torch
    from torch import nn

    vocab, hidden = weights["word_embeddings.weight"].shape
    max_pos = weights["position_embeddings.weight"].shape[0]
    ffn = weights["layers.0.ffn1.weight"].shape[0]
    layers = len({k.split(".")[1] for k in weights if k.startswith("layers.")})

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
            self.ln1 = nn.LayerNorm(hidden, eps=LN_EPS)
            self.ffn1 = nn.Linear(hidden, ffn)
            self.ffn2 = nn.Linear(ffn, hidden)
            self.ln2 = nn.LayerNorm(hidden, eps=LN_EPS)

        def forward(self, x):
            b, s, _ = x.shape

            def heads_of(t):
                return t.view(b, s, heads, hidden // heads).transpose(1, 2)

            q, k, v = heads_of(self.q(x)), heads_of(self.k(x)), heads_of(self.v(x))
            p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hidden // heads), dim=-1)
            a = (p @ v).transpose(1, 2).reshape(b, s, hidden)
            x = self.ln1(x + self.o(a))
            return self.ln2(x + self.ffn2(nn.functional.gelu(self.ffn1(x))))

    class Bert(nn.Module):
        def __init__(self):
            super().__init__()
            self.word_embeddings = nn.Embedding(vocab, hidden)
            self.position_embeddings = nn.Embedding(max_pos, hidden)
            self.emb_ln = nn.LayerNorm(hidden, eps=LN_EPS)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))

        def forward(self, input_ids):
            pos = self.position_embeddings.weight[: input_ids.shape[1]]
            x = self.emb_ln(self.word_embeddings(input_ids) + pos)
            for layer in self.layers:
                x = layer(x)
            return x

    return _with_weights(Bert(), weights)


def _with_weights(module, weights: dict):
    import torch

    state = module.state_dict()
    missing = [k for k in state if k not in weights and not k.endswith("num_batches_tracked")]
    extra = [k for k in weights if k not in state]
    if missing or extra:
        raise KeyError(f"weights do not match the module: missing {missing[:4]}, extra "
                       f"{extra[:4]}")
    module.load_state_dict({k: torch.from_numpy(weights[k]) if k in weights else v
                            for k, v in state.items()})
    return module.eval()


# ---------------------------------------------------------------------------------------------
# Suites


@dataclass
class BenchModel:
    """One benchmark model: how to build its weights, ONNX graph and torch module."""

    name: str
    description: str
    input_shapes: dict  # ONNX input name -> shape
    make_weights: Callable[[], dict]
    make_onnx: Callable[[dict], object]
    make_torch: Callable[[dict], object]
    notes: list = field(default_factory=list)
    # models whose inputs are not plain random floats / token ids (the corpus's masks):
    # weights -> {input name: array}; input_shapes may then stay empty
    make_feeds: Callable[[dict], dict] | None = None
    batch_size: int | None = None

    @property
    def batch(self) -> int:
        if self.batch_size is not None:
            return self.batch_size
        return next(iter(self.input_shapes.values()))[0]


def resnet50(batch: int = 8, image: int = 224, seed: int = 0) -> BenchModel:
    return BenchModel(
        f"resnet50", f"ResNet-50 v1.5, {batch}x3x{image}x{image}, fp32 weights N(He)",
        {"input": [batch, 3, image, image]}, lambda: resnet50_weights(seed),
        lambda w: resnet50_onnx(w, batch, image), resnet50_torch)


def bert(batch: int = 8, seq: int = 128, layers: int = 24, hidden: int = 1024, heads: int = 16,
         ffn: int = 4096, seed: int = 0, name: str = "bert-large") -> BenchModel:
    return BenchModel(
        name, f"BERT encoder on token ids {batch}x{seq}: hidden {hidden}, {layers} layers, "
              f"{heads} heads, FFN {ffn} (no attention mask)",
        {"input_ids": [batch, seq]},
        lambda: bert_weights(seed, layers, hidden, ffn),
        lambda w: bert_onnx(w, batch, seq, heads), lambda w: bert_torch(w, heads))


def gpu_suite(layers: int = 24, batch: int = 8) -> list[BenchModel]:
    """The seed's reference shapes: resnet50 8x3x224x224, bert-large 8x128 (24 layers)."""
    name = "bert-large" if layers == 24 else f"bert-large-{layers}L"
    return [resnet50(batch=batch), bert(batch=batch, layers=layers, name=name)]


def cpu_suite(bert_layers: int = 4) -> list[BenchModel]:
    """CPU-sized: resnet50 1x3x224x224 and a BERT-base-shaped encoder (hidden 768, 12 heads,
    FFN 3072) with ``bert_layers`` layers at 1x128."""
    return [resnet50(batch=1),
            bert(batch=1, layers=bert_layers, hidden=768, heads=12, ffn=3072,
                 name=f"bert-base-{bert_layers}L")]


SUITES = {"gpu": gpu_suite, "cpu": cpu_suite}

"""Models with odd sizes, end to end (issue 20): a ``torch.export`` ``.pt2`` with a conv to 7
channels and a transformer layer with d_model 45 and 5 heads, and the same module through
``torch.onnx.export(dynamo=False)``; an ONNX residual net whose branches join in ``Sum`` (the
pattern of ONNX's ``light_resnet50``).

Before amp's guarded layout pass (``amp_cli/backends/layout.py``) every precision crashed with
``std::bad_alloc`` on llvm (the CPU pipeline's ConvertLayout) and on cuda (the conv-as-GEMM
rewrite's ConvertLayout): torch's multi-head attention exports ``squeeze(x, axis=[-2])``, and
TVM 0.27's squeeze layout inference writes at index -2 of a string. The Sum net failed with
``Invalid SLayout: can't find S in source layout ABCDE`` (ONNX Sum imports as a stack).

llvm: built and run on random non-zero inputs, rel L2 vs torch / ONNX Runtime fp32 within
1e-5 (fp32), 1e-2 (fp16), 3e-2 (bf16). cuda:sm_90: code generation (nvcc, no GPU needed); the
``gpu``-marked test runs the CUDA build on the local GPU (``pytest -m gpu tests/backends``).
"""
from __future__ import annotations

import numpy as np
import pytest

import amp_cli
from amp_cli import tvm_compat

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")

TOLERANCE = {"fp32": 1e-5, "fp16": 1e-2, "bf16": 3e-2}


class OddNet(torch.nn.Module):
    """conv 3 -> 7 channels, its 5x9 map flattened to 45 features, a transformer layer with
    d_model 45 and 5 heads (head dim 9), a 45 -> 7 head; output [N, 7]."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 7, 3, padding=1)
        self.layer = torch.nn.TransformerEncoderLayer(45, 5, dim_feedforward=64, dropout=0.0,
                                                      batch_first=True)
        self.head = torch.nn.Linear(45, 7)

    def forward(self, x):
        y = torch.relu(self.conv(x)).flatten(2)  # [N, 7, 45]
        return self.head(self.layer(y)).mean(1)


def _odd_net():
    torch.manual_seed(0)
    return OddNet().eval(), (torch.randn(2, 3, 5, 9),)


@pytest.fixture(scope="module")
def odd_pt2(tmp_path_factory):
    module, args = _odd_net()
    path = tmp_path_factory.mktemp("odd") / "odd.pt2"
    torch.export.save(torch.export.export(module, args), str(path))
    return path


@pytest.fixture(scope="module")
def odd_onnx(tmp_path_factory):
    module, args = _odd_net()
    path = tmp_path_factory.mktemp("odd") / "odd.onnx"
    torch.onnx.export(module, args, str(path), dynamo=False)
    return path


def residual_sum_model(seed: int = 0):
    """conv-BN-ReLU branches joined by ONNX Sum (2 and 3 inputs), a global pool and a 7-way
    Gemm head: light_resnet50's Sum pattern with random weights, 12 channels, a 17x15 image."""
    from amp_cli.models import GraphBuilder

    b = GraphBuilder(seed)
    x = b.conv_bn_relu("x", 3, 12, k=3, stride=2)
    a = b.conv_bn_relu(x, 12, 12, k=3)
    c = b.conv_bn_relu(a, 12, 12, k=1, relu=False)
    s = b.op("Relu", [b.op("Sum", [x, c])])
    s = b.op("Sum", [s, a, x])
    f = b.op("Flatten", [b.op("GlobalAveragePool", [s])])
    y = b.op("Gemm", [f, b.weight(7, 12), b.const(np.zeros(7, "float32"))], transB=1)
    return b.model([("x", [2, 3, 17, 15], "float32")], [(y, [2, 7], "float32")])


@pytest.fixture(scope="module")
def sum_onnx(tmp_path_factory):
    import onnx

    path = tmp_path_factory.mktemp("sum") / "sum.onnx"
    onnx.save(residual_sum_model(), str(path))
    return path


def _convert(path, target: str, precision: str, check_accuracy: bool = True):
    cfg = amp_cli.ConvertConfig(target=target, check_accuracy=check_accuracy)
    cfg.precision.precision = precision
    return amp_cli.convert(amp_cli.load(path), cfg, isolate=False)


def _assert_accurate(conv, precision: str):
    worst = conv.accuracy["worst"]
    assert worst["nonfinite_share"] == 0, worst
    assert worst["rel_l2"] <= TOLERANCE[precision], worst


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_odd_pt2_llvm(odd_pt2, precision):
    conv = _convert(odd_pt2, "llvm", precision)
    try:
        assert conv.model.format == "torch"
        _assert_accurate(conv, precision)
    finally:
        conv.cleanup()


def test_odd_onnx_llvm(odd_onnx):
    conv = _convert(odd_onnx, "llvm", "fp16")
    try:
        _assert_accurate(conv, "fp16")
    finally:
        conv.cleanup()


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_sum_net_llvm(sum_onnx, precision):
    conv = _convert(sum_onnx, "llvm", precision)
    try:
        _assert_accurate(conv, precision)
    finally:
        conv.cleanup()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_odd_pt2_cuda_codegen(odd_pt2, precision):
    """The fp16/bf16 conv goes through the conv-as-GEMM rewrite, whose layout pass met the
    attention's squeeze(-2)."""
    conv = _convert(odd_pt2, "cuda:sm_90", precision, check_accuracy=False)
    try:
        assert conv.build.graph_rewrites.get("convs_as_gemm") == 1, conv.build.graph_rewrites
        assert conv.build.graph_rewrites.get("layout_squeeze_axes", 0) >= 1
        assert "layout_kept_nchw" not in conv.build.graph_rewrites
    finally:
        conv.cleanup()


def test_sum_net_cuda_codegen(sum_onnx):
    conv = _convert(sum_onnx, "cuda:sm_90", "fp16", check_accuracy=False)
    try:
        rewrites = conv.build.graph_rewrites
        assert rewrites.get("convs_as_gemm") == 3 and rewrites.get("layout_stack_reductions") == 2
    finally:
        conv.cleanup()


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_odd_pt2_on_gpu(odd_pt2, precision):
    conv = _convert(odd_pt2, "cuda", precision)
    try:
        assert conv.accuracy["device"] == "cuda", conv.accuracy
        _assert_accurate(conv, precision)
    finally:
        conv.cleanup()


# --- CUDA paths at odd sizes: each builds for sm_90, and a rule or rewrite that cannot take a
# shape declines it (no schedule rule raises; the next rule schedules the kernel) -------------
def _odd_graph(kind: str, dims: tuple):
    """(ModelProto) one small graph per CUDA path, at the given odd sizes."""
    from amp_cli.models import GraphBuilder

    b = GraphBuilder(seed=sum(dims))
    if kind == "matmul":  # rows 2..16: small_gemm; more: tensor-core GEMM (tc_gemm tiles)
        m, k, n = dims
        y = b.op("Relu", [b.op("MatMul", ["x", b.weight(k, n)])])
        return b.model([("x", [m, k], "float32")], [(y, [m, n], "float32")])
    if kind == "conv":  # C % 8 == 0: implicit GEMM; else im2col + GEMM
        c, o, k, s = dims
        y = b.op("Relu", [b.op("Conv", ["x", b.weight(o, c, k, k)], kernel_shape=[k, k],
                               strides=[s, s], pads=[k // 2] * 4)])
        ho = (9 + 2 * (k // 2) - k) // s + 1
        wo = (11 + 2 * (k // 2) - k) // s + 1
        return b.model([("x", [2, c, 9, 11], "float32")], [(y, [2, o, ho, wo], "float32")])
    if kind == "encoder":  # fused attention (S <= 256), norm + cast, combined Q/K/V GEMMs
        seq, hidden, heads = dims
        y = b.encoder_layer("x", 2, seq, hidden, heads, 64)
        return b.model([("x", [2, seq, hidden], "float32")], [(y, [2, seq, hidden], "float32")])
    raise AssertionError(kind)  # pragma: no cover


ODD_CUDA = [("matmul", (2, 45, 7)), ("matmul", (16, 47, 7)), ("matmul", (45, 45, 64)),
            ("conv", (9, 7, 3, 1)), ("conv", (24, 7, 3, 1)), ("conv", (16, 45, 3, 2)),
            ("encoder", (64, 45, 5)), ("encoder", (7, 15, 3))]


@pytest.mark.parametrize("kind,dims", ODD_CUDA, ids=lambda v: "x".join(map(str, v))
                         if isinstance(v, tuple) else v)
def test_odd_sizes_cuda_codegen(kind, dims, tmp_path):
    import onnx

    path = tmp_path / f"{kind}.onnx"
    onnx.save(_odd_graph(kind, dims), str(path))
    conv = _convert(path, "cuda:sm_90", "fp16", check_accuracy=False)
    try:
        assert conv.build.rule_failures == [], conv.build.rule_failures
        if kind == "encoder":  # head dims 9 and 5: the fused kernel declines, counted
            assert conv.build.graph_rewrites.get("attention_fused") == 0
    finally:
        conv.cleanup()


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("kind,dims", ODD_CUDA, ids=lambda v: "x".join(map(str, v))
                         if isinstance(v, tuple) else v)
def test_odd_sizes_on_gpu(kind, dims, precision, tmp_path):
    import onnx

    path = tmp_path / f"{kind}.onnx"
    onnx.save(_odd_graph(kind, dims), str(path))
    conv = _convert(path, "cuda", precision)
    try:
        assert conv.accuracy["device"] == "cuda", conv.accuracy
        _assert_accurate(conv, precision)
    finally:
        conv.cleanup()

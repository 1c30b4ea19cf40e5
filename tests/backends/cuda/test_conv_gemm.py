"""Convolutions as GEMMs (amp_cli.backends.cuda.rewrites.conv_gemm) and amp's tensor-core rule.

(a) numerics on the CPU: the rewritten graph against the original conv2d, both built for llvm,
    on random non-zero inputs (odd channels, strides 1/2, kernels 1/3/5/7, padding, dilation);
(b) sm_90 codegen: every conv-derived GEMM of a ResNet-shaped graph is a wmma kernel, in fp16
    and bf16, and the CUDA-graph capture function is emitted.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("onnx")

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.rewrites.conv_gemm import conv_to_gemm, count_gemm_convs  # noqa: E402
from amp_cli.backends.cuda.rewrites.base import calls, op_name  # noqa: E402

relax = tvm.relax


def _conv_module(n, c, h, w, o, k, stride, pad, dtype="float16", out_dtype="float32", groups=1,
                 dilation=1, seed=0):
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((o, c // groups, k, k)) / np.sqrt(c * k * k / groups))
    bias = rng.standard_normal((1, o, 1, 1)) * 0.1
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, c, h, w), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(weight.astype(dtype)), strides=stride,
                                           padding=pad, dilation=dilation, groups=groups,
                                           out_dtype=out_dtype))
            y = bb.emit(relax.op.nn.relu(relax.op.add(y, relax.const(bias.astype(out_dtype)))))
            gv = bb.emit_output(y)
        bb.emit_func_output(gv)
    return bb.get()


def _run_llvm(mod, x):
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy().astype(np.float64)


def _ops(mod) -> list[str]:
    return [name for name in map(op_name, calls(mod)) if name]


# (n, c, h, w, o, k, stride, pad, dilation)
CASES = [
    (2, 5, 9, 11, 7, 3, 1, 1, 1),     # odd channels, 3x3 same
    (2, 13, 17, 15, 9, 3, 2, 1, 1),   # stride 2, odd spatial
    (1, 3, 20, 20, 16, 7, 2, 3, 1),   # ResNet stem shape
    (2, 6, 8, 8, 10, 1, 1, 0, 1),     # 1x1 stride 1: reshape-free GEMM
    (2, 6, 9, 9, 10, 1, 2, 0, 1),     # 1x1 stride 2 (downsample)
    (1, 4, 12, 10, 6, 3, 1, 2, 2),    # dilation 2
    (1, 3, 10, 10, 5, 5, 1, (1, 2, 0, 2), 1),  # asymmetric padding, 5x5
]


# implicit GEMM applies where C is a multiple of 8
IMPLICIT_CASES = [
    (2, 8, 9, 11, 7, 3, 1, 1, 1),     # 3x3 same, ragged spatial
    (2, 16, 17, 15, 9, 3, 2, 1, 1),   # stride 2
    (2, 8, 9, 9, 10, 1, 2, 0, 1),     # 1x1 stride 2 (downsample)
    (1, 8, 12, 10, 6, 3, 1, 2, 2),    # dilation 2
    (1, 16, 10, 10, 5, 5, 1, (1, 2, 0, 2), 1),  # asymmetric padding, 5x5
]


@pytest.mark.parametrize("implicit", [False, True], ids=["im2col", "implicit"])
@pytest.mark.parametrize("case", CASES + IMPLICIT_CASES,
                         ids=lambda c: "x".join(str(v) for v in c[:8]))
def test_rewrite_matches_conv2d_on_cpu(case, implicit):
    n, c, h, w, o, k, stride, pad, dil = case
    mod = _conv_module(n, c, h, w, o, k, stride, pad, dilation=dil)
    new = conv_to_gemm(mod, implicit=implicit)
    ops = _ops(new)
    assert "relax.nn.conv2d" not in ops, ops
    text = new.script()
    gathered = k > 1 or stride != 1 or pad not in (0, (0, 0, 0, 0))
    # C % 8, or an image stem (C < 8, overlapping windows) read zero-padded to 8 channels
    stem = c < 8 and k * k > stride * stride
    is_implicit = implicit and (c % 8 == 0 or stem) and gathered
    assert ("amp_conv_gemm_implicit" in text) == is_implicit
    assert ("amp_im2col" in text) == (gathered and not is_implicit)
    x = np.random.default_rng(1).uniform(-2, 2, (n, c, h, w)).astype("float16")
    ref, got = _run_llvm(mod, x), _run_llvm(new, x)
    assert got.shape == ref.shape
    assert np.count_nonzero(ref) > ref.size // 4  # a real signal through the ReLU
    # Same fp16 products accumulated in fp32, in another order: fp32 rounding only.
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_fp16_accumulation_within_fp16_tolerance():
    mod = _conv_module(2, 7, 10, 10, 12, 3, 1, 1, out_dtype="float16")
    new = conv_to_gemm(mod)
    x = np.random.default_rng(2).uniform(-1, 1, (2, 7, 10, 10)).astype("float16")
    ref, got = _run_llvm(mod, x), _run_llvm(new, x)
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())


def test_grouped_and_fp32_convs_are_left_alone():
    dw = _conv_module(1, 8, 9, 9, 8, 3, 1, 1, groups=8)
    assert count_gemm_convs(dw) == 0 and conv_to_gemm(dw).same_as(dw)
    fp32 = _conv_module(1, 4, 9, 9, 6, 3, 1, 1, dtype="float32")
    assert count_gemm_convs(fp32) == 0 and conv_to_gemm(fp32).same_as(fp32)


# --------------------------------------------------------------------------- (b) sm_90 codegen
def _resnet_like_model():
    from amp_cli.models import GraphBuilder

    b = GraphBuilder(0)
    x = b.conv_bn_relu("input", 3, 64, k=7, stride=2)                  # stem: K=147, N=64
    x = b.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    y = b.conv_bn_relu(x, 64, 64, k=1)                                 # K=64, N=64
    y = b.conv_bn_relu(y, 64, 64, k=3)                                 # im2col K=576
    y = b.conv_bn_relu(y, 64, 256, k=1, relu=False)
    sc = b.conv_bn_relu(x, 64, 256, k=1, relu=False)
    x = b.op("Relu", [b.op("Add", [sc, y])])
    y = b.conv_bn_relu(x, 256, 96, k=1)
    y = b.conv_bn_relu(y, 96, 100, k=3, stride=2)                      # odd N, stride 2
    x = b.op("Flatten", [b.op("GlobalAveragePool", [y])], axis=1)
    return b.model([("input", [2, 3, 64, 64], "float32")], [(x, [2, 100], "float32")])


def _kernels(src: str) -> dict[str, bool]:
    out = {}
    for chunk in src.split("__global__")[1:]:
        m = re.search(r"void (?:__launch_bounds__\(\d+\) )?(\w+)\(", chunk)
        if m and "{" in chunk.split(";", 1)[0]:  # a definition, not the forward declaration
            out[m.group(1)] = "wmma::" in chunk or "mma_sync" in chunk
    return out


@pytest.fixture(scope="module")
def resnet_like(tmp_path_factory):
    from amp_cli import load

    import onnx

    path = tmp_path_factory.mktemp("cg") / "resnet_like.onnx"
    onnx.save(_resnet_like_model(), str(path))
    return load(str(path))


def _build_sm90(model, precision, failures=None, **pipeline_kw):
    from amp_cli.config import PrecisionConfig
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline
    from amp_cli.precision import convert_precision
    from amp_cli.backends.cuda.pipeline import cuda_relax_pipeline

    mod, _ = convert_precision(model.mod, PrecisionConfig(precision=precision))
    tgt = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with tgt:
        lowered = cuda_relax_pipeline(tgt, rule_failures=failures, **pipeline_kw)(mod)
    ex = tvm_compat.compile_relax(lowered, tgt, relax_pipeline=None,
                                  tir_pipeline=cuda_tir_pipeline(tgt, []))
    return lowered, _kernels(tvm_compat.cuda_source(ex))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_conv_gemms_get_tensor_cores_on_sm90(resnet_like, precision):
    failures = []
    lowered, kernels = _build_sm90(resnet_like, precision, failures)
    # a rule that raises hands its kernels to slower ones silently but for this record
    assert not failures, failures
    gemms = {k: tc for k, tc in kernels.items() if "conv_gemm" in k}
    assert len(gemms) >= 7, kernels  # every conv became a GEMM kernel (some share one)
    assert all(gemms.values()), {k: tc for k, tc in gemms.items() if not tc}
    assert not any("conv2d" in k for k in kernels), kernels
    # CUDA graphs are on by default: the static middle of the model is lifted for capture.
    names = {gv.name_hint for gv in lowered.get_global_vars()}
    assert any(n.endswith("cuda_graph_capture") for n in names), sorted(names)


def test_implicit_gemm_reads_the_image_with_predicated_cp_async(resnet_like):
    """sm_90, ``implicit_gemm``: the 3x3 and strided convs (C = 64, 96, 256) and the RGB stem
    (C = 3, zero-padded to 8) run as implicit GEMMs on tensor cores whose image loads are
    predicated cp.async copies (zero fill at the padding)."""
    from amp_cli.config import PrecisionConfig
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline
    from amp_cli.precision import convert_precision
    from amp_cli.backends.cuda.pipeline import cuda_relax_pipeline

    mod, _ = convert_precision(resnet_like.mod, PrecisionConfig(precision="fp16"))
    tgt = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    failures, stats = [], {}
    with tgt:
        lowered = cuda_relax_pipeline(tgt, implicit_gemm=True, rule_failures=failures,
                                      rewrite_stats=stats)(mod)
    assert not failures, failures
    assert stats["convs_as_gemm"] == 7 and stats["implicit_gemm_convs"] == 3, stats
    ex = tvm_compat.compile_relax(lowered, tgt, relax_pipeline=None,
                                  tir_pipeline=cuda_tir_pipeline(tgt, []))
    src = tvm_compat.cuda_source(ex)
    kernels = _kernels(src)
    implicit = [k for k in kernels if "implicit" in k]
    im2col = [k for k in kernels if "im2col" in k]
    assert len(implicit) >= 3 and all(kernels[k] for k in implicit), kernels
    # the RGB stem (7x7/2, C = 3) reads its input padded to 8 channels, in the kernel that
    # casts and transposes it: no im2col anywhere
    assert not im2col, im2col
    assert any("pad" in k and "transpose" in k for k in kernels), kernels
    for chunk in src.split("__global__")[1:]:
        if "implicit" in chunk.split("(", 1)[0] and "{" in chunk.split(";", 1)[0]:
            assert "cp_async_legacy_pred" in chunk  # padded image loads, zero-filled


def test_toggles_off_give_stock_lowering(resnet_like):
    lowered, kernels = _build_sm90(resnet_like, "fp16", conv_as_gemm=False, cuda_graph=False)
    assert not any("conv_gemm" in k for k in kernels)
    assert any("conv2d" in k for k in kernels)
    assert not any("cuda_graph" in gv.name_hint for gv in lowered.get_global_vars())


def test_symbolic_batch_convs_become_gemms():
    """A dynamic model's batch: a 1x1 stride-1 conv becomes the GEMM over M = N*H*W; a 3x3,
    strided or 7x7 RGB-stem conv a batched GEMM (one image per batch entry; the 7x7 stem's image
    padded to 8 channels, a patchify stem's K padded to whole vectors), each with the conv's values on llvm at two batches; a conv whose GEMM
    would have a side under 32 stays a conv (no tensor-core schedule would take it)."""
    batch = tvm.tirx.Var("batch", "int64")
    # (c, hw, o, k, stride, pad, implicit GEMM, im2col kernels)
    for c, hw, o, k, stride, pad, implicit, im2col in (
            (8, 6, 16, 1, 1, 0, 0, 0),      # pointwise, sides < 32: M = N*H*W
            (64, 8, 48, 1, 1, 0, 0, 0),     # pointwise: batched GEMM (faster on the GPU)
            (8, 6, 40, 3, 1, 1, 1, 0),      # 3x3 same, C % 8 == 0: implicit batched GEMM
            (32, 12, 32, 1, 2, 0, 1, 0),    # 1x1 stride 2 (downsample)
            (3, 20, 32, 7, 2, 3, 1, 0),     # RGB stem: image padded to 8 channels, implicit
            (3, 32, 32, 4, 4, 0, 0, 1)):    # patchify stem: explicit im2col, K 48
        module = _conv_module(batch, c, hw, hw, o, k, stride, pad)
        stats = {}
        new = conv_to_gemm(module, implicit=True, stats=stats)
        assert "relax.nn.conv2d" not in _ops(new) and count_gemm_convs(module) == 1
        assert stats.get("implicit_gemm_convs", 0) == implicit
        assert "amp_im2col" in new.script() if im2col else "amp_im2col" not in new.script()
        # batched: every case but the small pointwise one
        assert ("weight_per_image" in new.script()) == (o != 16)
        for n in (1, 3):
            x = np.random.default_rng(n).uniform(-2, 2, (n, c, hw, hw)).astype("float16")
            ref, got = _run_llvm(module, x), _run_llvm(new, x)
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # 5x5 outputs (M = 25 per image), and K = 8 for a 1x1 stride-2 conv of 8 channels
    for c, hw, k, stride, pad in ((16, 9, 3, 2, 1), (8, 12, 1, 2, 0)):
        assert count_gemm_convs(_conv_module(batch, c, hw, hw, 40, k, stride, pad)) == 0


def _dynamic_resnet_like(tmp_path):
    import onnx

    from amp_cli import load

    model = _resnet_like_model()
    for value in list(model.graph.input) + list(model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_param = "N"
    path = tmp_path / "resnet_like_dynamic.onnx"
    onnx.save(model, str(path))
    return load(str(path), input_shapes={"input": ["1..32(8)", 3, 64, 64]})


def test_symbolic_batch_convs_get_tensor_cores_on_sm90(tmp_path, monkeypatch):
    """Every conv of the ResNet-shaped graph over a symbolic batch is a wmma GEMM kernel whose
    grid has the images on blockIdx.z, and the source compiles with NVRTC and nvcc."""
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline
    from fixtures.cuda_compile import compile_like_tvm

    failures = []
    lowered, kernels = _build_sm90(_dynamic_resnet_like(tmp_path), "fp16", failures)
    assert not failures, failures
    gemms = {k: tc for k, tc in kernels.items() if "conv_gemm" in k}
    assert len(gemms) >= 7 and all(gemms.values()), kernels
    assert not any("conv2d" in k for k in kernels), kernels
    tgt = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    src = tvm_compat.cuda_source(tvm_compat.compile_relax(
        lowered, tgt, relax_pipeline=None, tir_pipeline=cuda_tir_pipeline(tgt, [])))
    assert "blockIdx.z" in src
    for mode in ("nvrtc", "nvcc"):
        assert len(compile_like_tvm(src, mode, "sm_90", monkeypatch)) > 1000


def _check_dynamic_batch_on_gpu(model, tmp_path, out_shape=None, **cuda):
    """``model`` (dims N) converted for the local GPU (``cuda``: CudaConfig fields) against
    ONNX Runtime fp32 at five batches across 1..32 (fp16 in, fp32 accumulation: rel L2 <=
    5e-3); ``out_shape(batch)``, when given, the output's shape."""
    if not tvm_compat.has_cuda_device():
        pytest.skip("no CUDA device")
    import amp_cli
    from amp_cli.accuracy import metrics, random_inputs
    from amp_cli.config import ConvertConfig

    cfg = ConvertConfig(target="cuda")
    for name, value in cuda.items():
        setattr(cfg.cuda, name, value)
    conv = amp_cli.convert(model, cfg, isolate=False)
    out = tmp_path / "out"
    conv.save(out)
    conv.cleanup()
    dev = tvm_compat.cuda_device()
    vm = tvm_compat.relax_vm(tvm_compat.load_module(str(out / "model.so")), dev)
    for batch in (1, 3, 8, 17, 32):
        feeds = random_inputs(model.inputs_at({"N": batch}), seed=batch)
        ref = model.reference(feeds)[0]
        got = vm["main"](tvm_compat.to_tvm_tensor(feeds["input"], dev)).numpy()
        if out_shape is not None:
            assert got.shape == out_shape(batch)
        m = metrics(ref, got)
        assert m["rel_l2"] <= 5e-3, (batch, m)


@pytest.mark.gpu
def test_symbolic_batch_convs_on_gpu(tmp_path):
    """The dynamic ResNet-shaped graph converted for the local GPU against ONNX Runtime fp32 at
    five batches across 1..32 (fp16 in, fp32 accumulation: rel L2 <= 5e-3)."""
    _check_dynamic_batch_on_gpu(_dynamic_resnet_like(tmp_path), tmp_path,
                                out_shape=lambda batch: (batch, 100))


# ----------------------------------------------------- pointwise convs as N*H*W rows (Hopper)
def test_wide_pointwise_convs_over_a_symbolic_batch_read_flat_rows():
    """With the symbolic-row Hopper GEMMs on (``flat_min_k``), a pointwise conv with enough
    channels becomes one GEMM over M = N*H*W (no per-image weight broadcast); a narrower one
    stays batched, and without ``flat_min_k`` every one does. Values match conv2d on llvm."""
    batch = tvm.tirx.Var("batch", "int64")
    for c, o, flat_min_k, flat in ((512, 128, 512, True), (256, 128, 512, False),
                                   (512, 128, None, False), (512, 96, 512, False)):
        module = _conv_module(batch, c, 7, 7, o, 1, 1, 0)
        new = conv_to_gemm(module, implicit=True, flat_min_k=flat_min_k)
        assert ("weight_per_image" in new.script()) != flat, (c, o, flat_min_k)
        for n in (1, 3):
            x = np.random.default_rng(n).uniform(-2, 2, (n, c, 7, 7)).astype("float16")
            ref, got = _run_llvm(module, x), _run_llvm(new, x)
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def _dynamic_pointwise_model(tmp_path):
    """conv 1x1 512->128 + BN + ReLU, then 1x1 128->512 + BN and a residual add (ResNet's
    bottleneck ends at 7x7) over a symbolic batch."""
    import onnx

    from amp_cli import load
    from amp_cli.models import GraphBuilder

    b = GraphBuilder(0)
    y = b.conv_bn_relu("input", 512, 128, k=1)
    y = b.conv_bn_relu(y, 128, 512, k=1, relu=False)
    x = b.op("Relu", [b.op("Add", ["input", y])])
    model = b.model([("input", [2, 512, 7, 7], "float32")], [(x, [2, 512, 7, 7], "float32")])
    for value in list(model.graph.input) + list(model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_param = "N"
    path = tmp_path / "pointwise_dynamic.onnx"
    onnx.save(model, str(path))
    return load(str(path), input_shapes={"input": ["1..32(8)", 512, 7, 7]})


def test_wide_pointwise_convs_become_symbolic_row_hopper_gemms(tmp_path):
    """Through the whole CUDA pipeline for sm_90a, ``cuda.pointwise_flat_rows`` on: the
    512-channel pointwise conv is a Hopper
    GEMM over the symbolic rows (wgmma + TMA), the 128-channel one a batched wmma GEMM."""
    from amp_cli.backends.cuda.pipeline import cuda_relax_pipeline
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline
    from amp_cli.config import PrecisionConfig
    from amp_cli.precision import convert_precision

    model = _dynamic_pointwise_model(tmp_path)
    mod, _ = convert_precision(model.mod, PrecisionConfig(precision="fp16"))
    tgt = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    stats, failures = {}, []
    with tgt:
        lowered = cuda_relax_pipeline(tgt, rule_failures=failures, rewrite_stats=stats,
                                      pointwise_flat_rows=True)(mod)
    assert not failures, failures
    assert stats.get("hopper_gemm") == 1, stats
    src = tvm_compat.cuda_source(tvm_compat.compile_relax(
        lowered, tgt, relax_pipeline=None, tir_pipeline=cuda_tir_pipeline(tgt, [])))
    assert "wgmma.mma_async" in src and "cp.async.bulk.tensor.2d" in src
    assert "blockIdx.z" in src   # the 128-channel conv: images on the grid's z


@pytest.mark.gpu
def test_wide_pointwise_convs_on_gpu(tmp_path):
    """The model above converted for the local GPU (``cuda.pointwise_flat_rows`` on) against
    ONNX Runtime fp32 at batches 1, 3, 8, 17 and 32 (rel L2 <= 5e-3)."""
    _check_dynamic_batch_on_gpu(_dynamic_pointwise_model(tmp_path), tmp_path,
                                pointwise_flat_rows=True)


def test_tile_variants_to_the_optimum_compile_fewer_kernels(tmp_path):
    """``cuda.tile_variants_above_optimum`` off: the batched conv GEMMs of the ResNet-shaped
    graph (batch 1..32, optimum 8) get tile variants only up to batch 8, so fewer kernels than
    over the whole range, and still every conv a wmma GEMM."""
    model = _dynamic_resnet_like(tmp_path)
    counts = {}
    for above in (True, False):
        failures = []
        _, kernels = _build_sm90(model, "fp16", failures, tile_variants_above_optimum=above)
        assert not failures, failures
        gemms = {k: tc for k, tc in kernels.items() if "conv_gemm" in k}
        assert gemms and all(gemms.values()), kernels
        counts[above] = len(gemms)
    assert counts[False] < counts[True], counts

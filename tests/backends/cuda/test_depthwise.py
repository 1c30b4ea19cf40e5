"""Depthwise and grouped convolutions as amp's NHWC kernel (rewrites/depthwise_conv.py,
kernels/depthwise.py, rules/depthwise.py, switch ``cuda.depthwise_conv``).

(a) the rewrite on the CPU: an ONNX model of MobileNet / EfficientNet / ConvNeXt-style blocks,
    precision-converted, with amp's graph rewrites applied, built for llvm, against ONNX Runtime
    fp32 (what amp's accuracy check does for a CUDA target without a GPU);
(b) the schedule on the CPU: the scheduled PrimFunc with its loops left serial (``bind=False``:
    same tiling, register caches, vectors and epilogue, no thread binding) against float64 numpy;
(c) CUDA codegen (sm_90 and sm_80, compiled by TVM's CUDA compiler): every grouped conv of the
    model is an ``amp_dwconv`` kernel with 16-byte loads and its epilogue fused;
(d) what is declined: dilation, dynamic shapes, other targets, unannotated kernels;
(e) ``gpu``: the CUDA kernels against float64 numpy, and the model against ONNX Runtime.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("onnx")

from amp_cli import tvm_compat
from amp_cli.backends.cuda.kernels import depthwise
from amp_cli.backends.cuda.rewrites.base import calls, op_name
from amp_cli.backends.cuda.rewrites.depthwise_conv import (
    count_grouped_convs,
    grouped_convs_to_nhwc_kernel,
)
from amp_cli.backends.cuda.rules.depthwise import AmpGroupedConv

relax = tvm.relax
SM90 = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


# ------------------------------------------------------------------------------ references
def np_dtype(dtype: str):
    import ml_dtypes

    return {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]


def grouped_conv_ref(x, w, strides, padding, groups):
    """float64 NHWC grouped conv: x [N,H,W,Cin], w [kh,kw,cin_g,O], padding (t, l, b, r)."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    n = x.shape[0]
    kh, kw, cin_g, o = w.shape
    sh, sw = strides
    xp = np.pad(x, ((0, 0), (padding[0], padding[2]), (padding[1], padding[3]), (0, 0)))
    ho = (xp.shape[1] - kh) // sh + 1
    wo = (xp.shape[2] - kw) // sw + 1
    y = np.zeros((n, ho, wo, groups, o // groups))
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw, :]
            patch = patch.reshape(n, ho, wo, groups, cin_g)
            wij = w[i, j].reshape(cin_g, groups, o // groups)
            y += np.einsum("nhwgc,cgo->nhwgo", patch, wij)
    return y.reshape(n, ho, wo, o)


# ----------------------------------------------------------------- (b) kernel-level PrimFuncs
def conv_func(n, h, w, cin, o, k, s, pad, groups, dtype="float16", acc="float32",
              epilogue=True):
    """amp's conv compute [+ bias, ReLU, cast back to ``dtype``] as a TE PrimFunc (the shape a
    fused ``fused_amp_dwconv_add_relu_cast`` kernel has)."""
    from tvm import te, tirx

    pad = (pad,) * 4 if isinstance(pad, int) else pad
    ho = (h + pad[0] + pad[2] - k) // s + 1
    wo = (w + pad[1] + pad[3] - k) // s + 1
    x = te.placeholder((n, h, w, cin), dtype, name="x")
    wt = te.placeholder((k, k, cin // groups, o), dtype, name="w")
    y = depthwise.conv_te(te, tirx, x, wt, (s, s), pad, groups, acc, (ho, wo))
    args = [x, wt]
    if epilogue:
        b = te.placeholder((1, 1, 1, o), acc, name="bias")
        args.append(b)
        z = te.compute(y.shape, lambda *i: tirx.max(y(*i) + b[0, 0, 0, i[3]],
                                                    tirx.const(0, acc)), name="relu")
        y = te.compute(y.shape, lambda *i: z(*i).astype(dtype), name="cast")
    return te.create_prim_func(args + [y]).with_attr("global_symbol", "main"), (ho, wo)


def conv_inputs(n, h, w, cin, o, k, groups, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (n, h, w, cin)).astype(np_dtype(dtype))
    wt = (rng.uniform(-1, 1, (k, k, cin // groups, o)) / k).astype(np_dtype(dtype))
    bias = rng.uniform(-0.5, 0.5, (1, 1, 1, o)).astype(np.float32)
    return x, wt, bias


def expected(x, wt, bias, s, pad, groups, epilogue=True):
    pad = (pad,) * 4 if isinstance(pad, int) else pad
    y = grouped_conv_ref(x, wt, (s, s), pad, groups)
    return np.maximum(y + bias.reshape(-1), 0) if epilogue else y


def run_on(ex, dev, arrays, out_shape, out_dtype):
    args = [tvm.runtime.tensor(a, dev) for a in arrays]
    out = tvm.runtime.empty(out_shape, out_dtype, dev)
    ex["main"](*args, out)
    return out.numpy().astype(np.float64)


# (n, h, w, cin, o, k, stride, pad, groups, dtype)
SCHEDULE_CASES = [
    (2, 9, 11, 16, 16, 3, 1, 1, 16, "float16"),              # ragged spatial, 2 channel lanes
    (2, 16, 16, 64, 64, 3, 2, 1, 64, "float16"),             # stride 2 (MobileNet downsample)
    (1, 14, 14, 96, 96, 7, 1, 3, 96, "float16"),             # ConvNeXt 7x7, 4 outputs/thread
    (2, 14, 14, 24, 24, 5, 2, 2, 24, "bfloat16"),            # EfficientNet 5x5/2 in bf16
    (1, 8, 8, 12, 12, 3, 1, 0, 12, "float32"),               # no padding, fp32 (4 lanes)
    (1, 9, 9, 10, 10, 3, 1, (1, 0, 2, 1), 10, "float16"),    # asymmetric padding, C=10: vec 2
    (2, 10, 10, 16, 32, 3, 1, 1, 4, "float16"),              # grouped: 4 in, 8 out per group
    (2, 10, 10, 8, 16, 3, 2, 1, 8, "float16"),               # channel multiplier 2
    (1, 6, 6, 40, 40, 3, 1, 1, 2, "float32"),                # grouped, 20 per group (loop)
    (1, 7, 7, 16, 4, 3, 1, 1, 4, "float16"),                 # 4 inputs per output channel
]


def _case_id(case):
    return "x".join(str(v) for v in case[:9]) + "-" + case[9]


@pytest.mark.parametrize("case", SCHEDULE_CASES, ids=_case_id)
def test_schedule_matches_float64_on_cpu(case):
    n, h, w, cin, o, k, s, pad, groups, dtype = case
    func, (ho, wo) = conv_func(n, h, w, cin, o, k, s, pad, groups, dtype)
    sch = depthwise.schedule_conv(func, 90, bind=False)
    assert sch is not None
    x, wt, bias = conv_inputs(n, h, w, cin, o, k, groups, dtype)
    got = run_on(tvm.compile(sch.mod, target="llvm"), tvm.cpu(), [x, wt, bias],
                 (n, ho, wo, o), dtype)
    ref = expected(x, wt, bias, s, pad, groups)
    # fp32 accumulation; the only other rounding is the output cast (half an ulp: fp16 4.9e-4,
    # bf16 3.9e-3 relative)
    rtol = {"float16": 1e-3, "bfloat16": 8e-3, "float32": 1e-5}[dtype]
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * np.abs(ref).max())


def test_conv_output_without_epilogue_is_written_from_registers():
    """No fused epilogue: the conv block writes the function's output (a cache-write stage)."""
    func, (ho, wo) = conv_func(1, 12, 12, 32, 32, 3, 1, 1, 32, "float16", epilogue=False)
    sch = depthwise.schedule_conv(func, 90, bind=False)
    x, wt, _ = conv_inputs(1, 12, 12, 32, 32, 3, 32, "float16")
    got = run_on(tvm.compile(sch.mod, target="llvm"), tvm.cpu(), [x, wt], (1, ho, wo, 32),
                 "float32")
    ref = expected(x, wt, None, 1, 1, 32, epilogue=False)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_plan_vectors_and_tiles():
    # MobileNetV3's stride-2 64-channel layer at batch 8: 8 halves per thread, 8 lanes
    p = depthwise.plan(8, 56, 56, 64, 1, "float16", 90)
    assert (p.vec, p.tx) == (8, 8) and p.threads() <= depthwise.BLOCK_THREADS
    assert 56 % p.tw == 0 and (8 * 56 * (56 // p.tw)) % p.ty == 0
    # ConvNeXt stage 1: enough threads for 4 outputs each
    assert depthwise.plan(8, 56, 56, 96, 1, "float16", 90).tw == 4
    assert depthwise.plan(1, 7, 7, 8, 1, "float32", 90).vec == 4        # 16 bytes of fp32
    assert depthwise.plan(1, 7, 7, 12, 4, "float16", 90).vec == 4       # divides cout_g
    assert depthwise.plan(1, 7, 7, 9, 1, "float16", 90).vec == 1


# ---------------------------------------------------------------- (a) the rewrite, vs ORT fp32
def _mobile_model(batch=2, size=16):
    """Inverted residual (1x1 expand + BN + HardSwish, 3x3 depthwise + BN + ReLU, 1x1 project,
    residual add), a 5x5/2 depthwise + SiLU, a grouped 3x3 (4 groups), a channel-multiplier-2
    depthwise, a ConvNeXt 7x7 depthwise with bias, a dilated depthwise (left to TOPI), pooled."""
    from amp_cli.models import GraphBuilder

    b = GraphBuilder(0)

    def conv(x, cin, cout, k, stride=1, groups=1, dilation=1, bias=True):
        w = b.weight(cout, cin // groups, k, k, scale=1.0 / np.sqrt(k * k * cin / groups))
        ins = [x, w] + ([b.const((0.1 * b.rng.standard_normal(cout)).astype("float32"))]
                        if bias else [])
        p = dilation * (k - 1) // 2
        return b.op("Conv", ins, kernel_shape=[k, k], pads=[p] * 4, strides=[stride] * 2,
                    group=groups, dilations=[dilation] * 2)

    x = b.conv_bn_relu("input", 3, 16, k=3, stride=1)
    y = b.op("HardSwish", [conv(x, 16, 64, 1)])
    y = b.op("Relu", [conv(y, 64, 64, 3, groups=64)])
    y = conv(y, 64, 16, 1)
    x = b.op("Add", [x, y])
    y = conv(x, 16, 16, 5, stride=2, groups=16)
    y = b.op("Mul", [y, b.op("Sigmoid", [y])])                         # SiLU
    y = b.op("Relu", [conv(y, 16, 32, 3, groups=4)])                   # grouped
    y = conv(y, 32, 64, 3, groups=32)                                  # multiplier 2
    y = conv(y, 64, 64, 7, groups=64)                                  # ConvNeXt 7x7
    y = conv(y, 64, 64, 3, groups=64, dilation=2)                      # dilated: declined
    y = b.op("Flatten", [b.op("GlobalAveragePool", [y])], axis=1)
    return b.model([("input", [batch, 3, size, size], "float32")], [(y, [batch, 64], "float32")])


@pytest.fixture(scope="module")
def mobile(tmp_path_factory):
    import onnx

    from amp_cli import load

    path = tmp_path_factory.mktemp("dw") / "mobile.onnx"
    onnx.save(_mobile_model(), str(path))
    return path, load(str(path))


def _converted(model, precision):
    from amp_cli.config import PrecisionConfig
    from amp_cli.precision import convert_precision

    mod, _ = convert_precision(model.mod, PrecisionConfig(precision=precision))
    return mod


def _ort(path, x):
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"input": x})[0].astype(np.float64)


def _rel_l2(got, ref):
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("precision,tol", [("fp16", 2e-3), ("bf16", 1e-2), ("fp32", 1e-6)])
def test_rewritten_model_matches_ort_fp32_on_cpu(mobile, precision, tol):
    """The graph-rewrite stage of the CUDA pipeline (convs as GEMMs, then this rewrite), built
    for llvm, against ONNX Runtime fp32, rel L2. Measured: fp16 3.1e-4, bf16 2.1e-3 (the same
    as the stock conversion's, whose grouped convs stay TOPI's), fp32 8.6e-8."""
    from amp_cli.backends.cuda.rewrites.conv_gemm import conv_to_gemm

    path, model = mobile
    mod = _converted(model, precision)
    stats = {}
    new = grouped_convs_to_nhwc_kernel(conv_to_gemm(mod), stats)
    assert stats["grouped_convs"] == 5, stats   # the dilated one stays a conv2d
    left = [c for c in calls(new) if op_name(c) == "relax.nn.conv2d"]
    assert len(left) == (1 if precision != "fp32" else 4), [c.attrs.groups for c in left]
    assert "amp_dwconv" in new.script()
    x = np.random.default_rng(3).uniform(-1, 1, (2, 3, 16, 16)).astype("float32")
    ex = tvm.compile(new, target="llvm")
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    err = _rel_l2(got.astype(np.float64), _ort(path, x))
    assert err < tol, err


# ------------------------------------------------------------------------ (c) CUDA codegen
def _kernel_sources(src: str) -> dict[str, str]:
    out = {}
    for chunk in src.split("__global__")[1:]:
        m = re.search(r"void (?:__launch_bounds__\(\d+\) )?(\w+)\(", chunk)
        if m and "{" in chunk.split(";", 1)[0]:  # a definition, not the forward declaration
            out[m.group(1)] = chunk
    return out


def _build_cuda(mod, target, failures=None, stats=None, **switches):
    from amp_cli.backends.cuda.pipeline import cuda_relax_pipeline
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline

    with target:
        lowered = cuda_relax_pipeline(target, rule_failures=failures, rewrite_stats=stats,
                                      **switches)(mod)
    ex = tvm_compat.compile_relax(lowered, target, relax_pipeline=None,
                                  tir_pipeline=cuda_tir_pipeline(target, []))
    return ex, _kernel_sources(tvm_compat.cuda_source(ex))


@pytest.mark.parametrize("arch,precision", [("sm_90", "fp16"), ("sm_80", "bf16")])
def test_grouped_convs_are_amp_kernels_in_cuda_builds(mobile, arch, precision):
    failures, stats = [], {}
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    _, kernels = _build_cuda(_converted(mobile[1], precision), target, failures, stats,
                             cuda_graph=False)
    assert not failures, failures
    assert stats["grouped_convs"] == 5, stats
    dw = {k: v for k, v in kernels.items() if "amp_dwconv" in k}
    assert len(dw) == 5, sorted(kernels)
    # the epilogues are fused (SiLU's sigmoid, ReLU, bias) and the loads are 16-byte vectors
    assert any("sigmoid" in k for k in dw) and any("relu" in k for k in dw), sorted(dw)
    wide = [k for k, src in dw.items() if "uint4" in src]
    assert len(wide) >= 3, sorted(dw)   # the depthwise ones; grouped ones read scalars
    conv2d = [k for k in kernels if "conv2d" in k]
    assert len(conv2d) == 1, conv2d     # the dilated conv


def test_switch_off_leaves_topi_convolutions(mobile):
    _, kernels = _build_cuda(_converted(mobile[1], "fp16"), SM90, cuda_graph=False,
                             depthwise_conv=False)
    assert not any("amp_dwconv" in k for k in kernels)
    assert sum("conv2d" in k for k in kernels) == 6


# --------------------------------------------------------------------------- (d) declines
def _conv_module(shape, k=3, groups=8, dilation=1, dtype="float16"):
    c = shape[1]
    w = np.random.default_rng(0).standard_normal((c, c // groups, k, k)).astype(dtype)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(w), padding=k // 2, groups=groups,
                                           dilation=dilation, out_dtype="float32"))
            gv = bb.emit_output(y)
        bb.emit_func_output(gv)
    return bb.get()


def test_rewrite_declines_dilation_and_dynamic_shapes():
    dilated = _conv_module((1, 8, 9, 9), dilation=2)
    assert count_grouped_convs(dilated) == 0
    assert grouped_convs_to_nhwc_kernel(dilated).same_as(dilated)
    dynamic = _conv_module((tvm.tirx.Var("n", "int64"), 8, 9, 9))
    assert count_grouped_convs(dynamic) == 0
    plain = _conv_module((1, 8, 9, 9), groups=1)
    assert count_grouped_convs(plain) == 0
    assert count_grouped_convs(_conv_module((1, 8, 9, 9))) == 1


def _apply_rule(func, target=SM90):
    with target:
        return AmpGroupedConv().apply(func, target, False)


def test_rule_declines_other_kernels_targets_and_symbolic_extents():
    from tvm import te, tirx

    func, _ = conv_func(1, 8, 8, 16, 16, 3, 1, 1, 16)
    assert _apply_rule(func) is not None
    assert _apply_rule(func, tvm.target.Target("llvm")) is None
    # a reduction without amp's annotation (a row sum)
    a = te.placeholder((64, 64), "float32", name="a")
    r = te.reduce_axis((0, 64), name="r")
    s = te.compute((64,), lambda i: te.sum(a[i, r], axis=r), name="s")
    assert _apply_rule(te.create_prim_func([a, s])) is None
    # the same compute with a symbolic batch
    n = tirx.Var("n", "int64")
    x = te.placeholder((n, 8, 8, 16), "float16", name="x")
    w = te.placeholder((3, 3, 1, 16), "float16", name="w")
    y = depthwise.conv_te(te, tirx, x, w, (1, 1), (1, 1, 1, 1), 16, "float32", (8, 8))
    assert _apply_rule(te.create_prim_func([x, w, y])) is None


# ------------------------------------------------------------------------------- (e) on a GPU
GPU_CASES = [
    (8, 112, 112, 64, 64, 3, 2, 1, 64, "float16"),    # MobileNetV3-large's largest depthwise
    (8, 56, 56, 96, 96, 7, 1, 3, 96, "float16"),      # ConvNeXt-tiny stage 1
    (8, 28, 28, 240, 240, 5, 2, 2, 240, "bfloat16"),  # EfficientNet-B0 5x5/2
    (8, 7, 7, 960, 960, 5, 1, 2, 960, "float16"),     # MobileNetV3's last stage
    (2, 14, 14, 64, 128, 3, 1, 1, 8, "float16"),      # grouped, 8 in / 16 out per group
    (2, 15, 13, 10, 10, 3, 1, (1, 0, 2, 1), 10, "float32"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_cuda_kernel_matches_float64(case):
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline

    n, h, w, cin, o, k, s, pad, groups, dtype = case
    func, (ho, wo) = conv_func(n, h, w, cin, o, k, s, pad, groups, dtype)
    arch = "sm_" + tvm_compat.cuda_compute_version().replace(".", "")
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    sch = _apply_rule(func, target)
    assert sch is not None
    ex = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=target,
                     tir_pipeline=cuda_tir_pipeline(target, []))
    x, wt, bias = conv_inputs(n, h, w, cin, o, k, groups, dtype)
    got = run_on(ex, tvm.cuda(0), [x, wt, bias], (n, ho, wo, o), dtype)
    ref = expected(x, wt, bias, s, pad, groups)
    rtol = {"float16": 1e-3, "bfloat16": 8e-3, "float32": 1e-5}[dtype]
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * np.abs(ref).max())


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision,tol", [("fp16", 3e-3), ("bf16", 2e-2)])
def test_cuda_model_matches_ort_fp32(mobile, precision, tol):
    path, model = mobile
    arch = "sm_" + tvm_compat.cuda_compute_version().replace(".", "")
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    failures = []
    ex, kernels = _build_cuda(_converted(model, precision), target, failures)
    assert not failures and any("amp_dwconv" in k for k in kernels)
    x = np.random.default_rng(3).uniform(-1, 1, (2, 3, 16, 16)).astype("float32")
    vm = relax.VirtualMachine(ex, tvm.cuda(0))
    got = vm["main"](tvm.runtime.tensor(x, tvm.cuda(0))).numpy().astype(np.float64)
    err = _rel_l2(got, _ort(path, x))
    assert err < tol, err

"""amp's rule for large injective CUDA kernels (schedule/injective.py): which kernels it takes,
what it emits (CI, sm_90 codegen without a GPU), and values on the GPU."""
from __future__ import annotations

import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.rules import injective  # noqa: E402
from test_tc_gemm import _run, build  # noqa: E402

SM90 = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


def gather(n=8, c=3, hw=64, k=7, stride=2):
    """An im2col as amp's conv_gemm writes it for an NCHW fp32 image: [N, OH, OW, K*K*C] fp16,
    zero where the window leaves the image (the ResNet stem's shape, smaller). ``n`` may be a
    symbolic batch (a ``tirx.Var``)."""
    from tvm import te

    pad = k // 2
    out_hw = hw // stride
    x = te.placeholder((n, c, hw, hw), "float32", name="x")

    def at(b, oh, ow, q):
        kh, kw, ch = q // (k * c), q % (k * c) // c, q % c
        ih, iw = oh * stride + kh - pad, ow * stride + kw - pad
        inside = tvm.tirx.all(ih >= 0, ih < hw, iw >= 0, iw < hw)
        return tvm.tirx.if_then_else(inside, x[b, ch, ih, iw].astype("float16"),
                                     tvm.tirx.const(0, "float16"))

    y = te.compute((n, out_hw, out_hw, k * k * c), at, name="im2col")
    return te.create_prim_func([x, y]).with_attr("global_symbol", "main")


def rule(func, target=SM90):
    with target:
        sch = injective.AmpInjective().apply(func, target, False)
    return None if sch is None else sch.mod["main"]


def test_large_gather_gets_several_elements_per_thread():
    func = rule(gather(hw=224))          # 8 x 112 x 112 x 147 = 14.7 M outputs
    src = tvm_compat.cuda_source(build(func, "sm_90"))
    assert f"__launch_bounds__({injective.THREADS})" in src
    stores = re.findall(r"im2col_ptr\[", src)
    assert len(stores) == injective.UNROLL   # one store per unrolled element, no loop left


def test_declines_small_reductions_and_non_cuda():
    from tvm import te

    assert rule(gather(hw=32)) is None   # 8 x 16 x 16 x 147 = 0.3 M: below MIN_ELEMENTS
    a = te.placeholder((1024, 2048), "float32", name="a")
    r = te.reduce_axis((0, 2048), name="r")
    s = te.compute((1024,), lambda i: te.sum(a[i, r], axis=r), name="s")
    assert rule(te.create_prim_func([a, s])) is None
    assert rule(gather(hw=224), tvm.target.Target("llvm")) is None


@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize("pad_stem", [False, True], ids=["im2col", "padded"])
def test_stem_im2col_in_amps_pipeline(on, pad_stem):
    """A ResNet-style 7x7/2 stem on fp32 NCHW input: its fused cast + transpose + im2col kernel
    (with ``cuda.pad_stem_channels`` off; on, the cast + transpose + pad to 8 channels that
    feeds the implicit GEMM) takes the rule (cuda.unroll_injective), or dlight's Fallback with
    1024 threads when off."""
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline
    from amp_cli.backends.cuda.pipeline import cuda_relax_pipeline

    relax = tvm_compat.relax()
    w = np.random.default_rng(0).standard_normal((64, 3, 7, 7)).astype("float16")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 3, 224, 224), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            h = bb.emit(relax.op.astype(x, "float16"))
            y = bb.emit(relax.op.nn.conv2d(h, relax.const(w), strides=2, padding=3,
                                           out_dtype="float32"))
            out = bb.emit_output(relax.op.astype(y, "float16"))
        bb.emit_func_output(out)
    with SM90:
        lowered = cuda_relax_pipeline(SM90, cuda_graph=False, unroll_injective=on,
                                      pad_stem_channels=pad_stem)(bb.get())
    ex = tvm_compat.compile_relax(lowered, SM90, relax_pipeline=None,
                                  tir_pipeline=cuda_tir_pipeline(SM90, []))
    src = tvm_compat.cuda_source(ex)
    name = r"\w*transpose\w*pad\w*" if pad_stem else r"\w*im2col\w*"
    kernel = re.search(r"__launch_bounds__\((\d+)\) " + name + "_kernel", src)
    assert kernel is not None
    assert ("im2col" in src) != pad_stem
    assert kernel.group(1) == (str(injective.THREADS) if on else "1024")


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA device")
def test_gather_matches_numpy():
    """Exact: the kernel only moves (and rounds to fp16) values; compared with numpy's gather."""
    n, c, hw, k, s = 8, 3, 224, 7, 2
    x = np.random.default_rng(1).standard_normal((n, c, hw, hw)).astype("float32")
    got = _run(rule(gather(n, c, hw, k, s)), [x], (n, hw // s, hw // s, k * k * c), "float16")
    xp = np.pad(x, ((0, 0), (0, 0), (3, 3), (3, 3))).astype("float16")
    ref = np.empty_like(got)
    for kh in range(k):
        for kw in range(k):
            win = xp[:, :, kh:kh + hw:s, kw:kw + hw:s]          # [n, c, oh, ow]
            ref[..., (kh * k + kw) * c:(kh * k + kw + 1) * c] = win.transpose(0, 2, 3, 1)
    np.testing.assert_array_equal(got, ref)


def _symbolic_gather(hw=224):
    """:func:`gather` over a symbolic batch ``n``."""
    return gather(n=tvm.tirx.Var("n", "int64"), hw=hw)


def test_symbolic_batch_is_counted_at_the_optimum(monkeypatch):
    """A gather over a dynamic batch takes the rule when its size at the ranges' optimum is
    large (the stem's layout change of a dynamic CNN), with the tail predicated; without an
    optimum for the dim it is left to dlight. The source compiles with NVRTC and nvcc."""
    from fixtures.cuda_compile import compile_like_tvm

    func = _symbolic_gather()
    with SM90:
        assert injective.AmpInjective().apply(func, SM90, False) is None
        assert injective.AmpInjective({"n": 1}).apply(_symbolic_gather(hw=32), SM90,
                                                      False) is None
        sch = injective.AmpInjective({"n": 8}).apply(func, SM90, False)
    assert sch is not None
    src = tvm_compat.cuda_source(build(sch.mod["main"], "sm_90"))
    assert f"__launch_bounds__({injective.THREADS})" in src
    assert len(re.findall(r"im2col_ptr\[", src)) == injective.UNROLL
    for mode in ("nvrtc", "nvcc"):
        assert len(compile_like_tvm(src, mode, "sm_90", monkeypatch)) > 1000


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA device")
def test_symbolic_gather_matches_numpy_at_every_batch():
    """The rule's kernel over a symbolic batch, planned at 8, run at 1, 3 and 9: exactly the
    numpy gather (a cast and zero padding: no rounding beyond fp16's)."""
    func = _symbolic_gather(hw=64)
    with SM90:
        sch = injective.AmpInjective({"n": 8}).apply(func, SM90, False)
    sm = int(tvm_compat.cuda_compute_version().replace(".", ""))
    ex = build(sch.mod["main"], f"sm_{sm}")
    dev = tvm.cuda(0)
    rng = np.random.default_rng(3)
    for n in (1, 3, 9):
        x = rng.standard_normal((n, 3, 64, 64)).astype("float32")
        xp = np.pad(x, ((0, 0), (0, 0), (3, 3), (3, 3)))
        ref = np.empty((n, 32, 32, 147), "float16")
        for kh in range(7):
            for kw in range(7):
                win = xp[:, :, kh:kh + 64:2, kw:kw + 64:2]           # n, c, 32, 32
                ref[..., (kh * 7 + kw) * 3:(kh * 7 + kw) * 3 + 3] = win.transpose(0, 2, 3, 1)
        out = tvm.runtime.empty((n, 32, 32, 147), "float16", dev)
        ex(tvm.runtime.tensor(x, dev), out)
        np.testing.assert_array_equal(out.numpy(), ref)

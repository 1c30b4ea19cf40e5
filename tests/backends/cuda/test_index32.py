"""int32 indices for kernels over symbolic extents (backends/cuda/tir/index32.py): which kernels
the ranges make safe, and that a dynamic build's CUDA kernels then compute in int32 (CI, no
GPU; the GPU values: test_conv_gemm.py::test_symbolic_batch_convs_on_gpu, test_dynamic.py)."""
from __future__ import annotations

import re

import pytest

tvm = pytest.importorskip("tvm")

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.tir import index32  # noqa: E402
from amp_cli.ir_attrs import INDEX32, TIRX_KERNEL  # noqa: E402


def _gather(n_var, c=3, hw=224, dtype="float16"):
    """y[n, h, w, c] = x[n, c, h, w] over a symbolic batch, with an intermediate the size of x."""
    from tvm import te

    x = te.placeholder((n_var, c, hw, hw), dtype, name="x")
    mid = te.compute((n_var, hw, hw, c), lambda n, h, w, k: x[n, k, h, w], name="mid")
    y = te.compute(mid.shape, lambda *i: mid(*i) * tvm.tirx.const(2, dtype), name="y")
    return te.create_prim_func([x, y]).with_attr("global_symbol", "main")


def test_fits_only_where_every_buffer_stays_under_the_limit_at_the_maxima():
    n = tvm.tirx.Var("batch", "int64")
    func = _gather(n)
    assert index32.is_symbolic(func)
    assert index32.fits(func, {"batch": 32})               # 32 x 150528 elements
    assert not index32.fits(func, {"batch": 1 << 14})      # 2.5e9 elements
    assert not index32.fits(func, {})                      # no range: unbounded
    # the limit counts intermediates too (here as large as the parameters)
    assert not index32.fits(func, {"batch": 32}, limit=32 * 3 * 224 * 224)
    # 64-bit data (token ids, an int64 mask): TVM's pass refuses such functions
    assert not index32.fits(_gather(n, dtype="int64"), {"batch": 32})


def test_mark_pass_marks_bounded_symbolic_kernels_only():
    n = tvm.tirx.Var("batch", "int64")
    mod = tvm.IRModule({"sym": _gather(n).with_attr("global_symbol", "sym"),
                        "static": _gather(4).with_attr("global_symbol", "static"),
                        "tirx": _gather(n).with_attrs({"global_symbol": "tirx",
                                                       TIRX_KERNEL: True})})
    stats = {}
    out = index32.mark_pass({"batch": (1, 32)}, stats)(mod)
    marked = {gv.name_hint for gv, f in out.functions_items() if f.attrs.get(INDEX32)}
    assert marked == {"sym"} and stats == {"index32_kernels": 1}
    huge = index32.mark_pass({"batch": (1, 1 << 20)})(mod)
    assert not any(f.attrs.get(INDEX32) for _, f in huge.functions_items())


def _kernel_bodies(src: str) -> dict[str, str]:
    out = {}
    for chunk in src.split('extern "C" __global__')[1:]:
        m = re.search(r"void (?:__launch_bounds__\(\d+\) )?(\w+)\(([^)]*)\)\s*\{", chunk)
        if m:
            out[m.group(1)] = chunk
    return out


@pytest.mark.parametrize("on", [True, False])
def test_dynamic_conv_kernels_index_in_int32(tmp_path, monkeypatch, on):
    """The ResNet-shaped graph over a batch of 1..32: with ``cuda.index32`` no kernel computes
    an int64 index and the batch reaches them as ``int``; the source compiles with NVRTC and
    nvcc. Off, the kernels over the batch index in int64 (what TVM alone gives)."""
    from fixtures.cuda_compile import compile_like_tvm
    from test_conv_gemm import _dynamic_resnet_like

    from amp_cli.backends.cuda.pipeline import cuda_relax_pipeline
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline
    from amp_cli.config import PrecisionConfig
    from amp_cli.precision import convert_precision

    model = _dynamic_resnet_like(tmp_path)
    mod, _ = convert_precision(model.mod, PrecisionConfig(precision="fp16"))
    tgt = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    stats = {}
    with tgt:
        lowered = cuda_relax_pipeline(tgt, rewrite_stats=stats, index32=on)(mod)
    src = tvm_compat.cuda_source(tvm_compat.compile_relax(
        lowered, tgt, relax_pipeline=None, tir_pipeline=cuda_tir_pipeline(tgt, [])))
    bodies = _kernel_bodies(src)
    wide = sorted(name for name, body in bodies.items() if "int64_t" in body)
    if on:
        assert stats["index32_kernels"] >= 10, stats
        assert not wide, wide
        assert any(re.search(r"\bint N\b", b.split("{", 1)[0]) for b in bodies.values())
        for mode in ("nvrtc", "nvcc"):
            assert len(compile_like_tvm(src, mode, "sm_90", monkeypatch)) > 1000
    else:
        assert "index32_kernels" not in stats and len(wide) >= 10, wide

"""Parallel constant-weight GEMMs on one input become one (amp_cli.backends.cuda.rewrites.combine_gemm): which
matmuls are combined, that values are kept (llvm, random inputs), and that a BERT layer's Q/K/V
projections become one tensor-core GEMM in the sm_90 build."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("onnx")

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.rewrites.combine_gemm import combine_parallel_gemms  # noqa: E402
from amp_cli.backends.cuda.rewrites.base import calls, op_name  # noqa: E402

relax = tvm.relax


def _qkv_module(dtype="float16", out_dtype="float32", tokens=24, hidden=40, widths=(40, 40, 24),
                consumer="cast"):
    """x @ W_i for three constant W_i (different widths), each output consumed by a cast to
    ``dtype`` then a bias add (``consumer="cast"``), by a cast alone (``"cast_only"``: bias-free
    projections, LLaMA's), or used in fp32 directly ("fp32")."""
    rng = np.random.default_rng(0)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, tokens, hidden), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            outs = []
            for n in widths:
                w = (rng.standard_normal((hidden, n)) / np.sqrt(hidden)).astype(dtype)
                y = bb.emit(relax.op.matmul(x, relax.const(w), out_dtype=out_dtype))
                if consumer == "cast":
                    y = bb.emit(relax.op.astype(y, dtype))
                    y = bb.emit(relax.op.astype(relax.op.add(y, relax.const(
                        rng.standard_normal(n).astype(dtype))), "float32"))
                elif consumer == "cast_only":
                    y = bb.emit(relax.op.astype(y, dtype))
                    y = bb.emit(relax.op.astype(relax.op.multiply(y, y), "float32"))
                outs.append(y)
            gv = bb.emit_output(relax.op.concat(outs, axis=-1))
        bb.emit_func_output(gv)
    return bb.get()


def _matmul_shapes(mod):
    return [[int(d) for d in c.ty.shape.values] for c in calls(mod)
            if op_name(c) == "relax.matmul"]


def _op_dtypes(mod, name):
    return [str(c.ty.dtype) for c in calls(mod) if op_name(c) == name]


def _run_llvm(mod, x):
    ex = tvm.compile(mod, target="llvm")
    vm = tvm_compat.relax_vm(ex, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy().astype(np.float64)


@pytest.mark.parametrize("consumer", ["cast", "cast_only", "fp32"])
def test_three_projections_become_one_gemm_with_the_same_values(consumer):
    mod = _qkv_module(consumer=consumer)
    new, count = combine_parallel_gemms(mod)
    assert count == 3
    assert _matmul_shapes(new) == [[2, 24, 104]]
    # the cast moves before the slices only when every output is cast to fp16 anyway
    sliced = _op_dtypes(new, "relax.strided_slice")
    assert sliced == ["float32" if consumer == "fp32" else "float16"] * 3
    # with the casts, the three bias adds become one add on the combined output (its epilogue)
    assert len(_op_dtypes(new, "relax.add")) == (1 if consumer == "cast" else 0)
    if consumer == "cast_only":
        # the slices reach their users in fp16: the one fp16 cast left is the GEMM's epilogue,
        # no slice goes fp16 -> fp32 -> fp16 (a copy kernel each; fp16 slices alone are views
        # fused_attention reads in place)
        assert _op_dtypes(new, "relax.astype") == ["float16"] + ["float32"] * 3
    x = np.random.default_rng(1).uniform(-2, 2, (2, 24, 40)).astype("float16")
    ref, got = _run_llvm(mod, x), _run_llvm(new, x)
    assert np.count_nonzero(ref) > 0.99 * ref.size  # a real signal (fp16 may round one to 0)
    # the same fp16 products over the same K per output element, accumulated in fp32: equal to
    # fp32 rounding (1e-6 relative), and the fp16 round trip of the sliced casts is exact
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def test_what_is_left_alone():
    single = _qkv_module(widths=(40,))
    assert combine_parallel_gemms(single)[0].same_as(single)
    fp32 = _qkv_module(dtype="float32", widths=(40, 40))
    assert combine_parallel_gemms(fp32)[0].same_as(fp32)
    # different inputs: nothing shared
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 16), "float16"))
    y = relax.Var("y", relax.TensorType((8, 16), "float16"))
    w = relax.const(np.ones((16, 16), "float16"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            a = bb.emit(relax.op.matmul(x, w, out_dtype="float32"))
            b = bb.emit(relax.op.matmul(y, relax.const(np.ones((16, 16), "float16")),
                                        out_dtype="float32"))
            gv = bb.emit_output(relax.op.add(a, b))
        bb.emit_func_output(gv)
    two_inputs = bb.get()
    assert combine_parallel_gemms(two_inputs)[0].same_as(two_inputs)


def test_bert_layer_qkv_is_one_tensor_core_gemm_on_sm90(fp16_encoder_layer):
    from amp_cli.compile import relax_pipeline
    from amp_cli.config import CudaConfig
    from amp_cli.target import resolve_target

    mod = fp16_encoder_layer
    target = resolve_target("cuda:sm_90")

    def gemm_outputs(cuda):
        with target.tvm_target():
            lowered = relax_pipeline(target, cuda=cuda)(mod)
        out = {}
        for gv, f in lowered.functions.items():
            if isinstance(f, tvm_compat.prim_func_class()) and "matmul" in gv.name_hint:
                shape = [int(d) for d in f.params[-1].shape]
                out[gv.name_hint] = (shape, "software_pipeline_async_stages" in f.script())
        return out

    combined = gemm_outputs(None)
    separate = gemm_outputs(CudaConfig(combine_gemms=False))
    # the fused Q/K/V output is 3 x 128 wide ([2, 64, 384]: reshape_sink keeps the 3-D shape)
    assert 384 in [s[-1] for s, _ in combined.values()], combined
    assert 384 not in [s[-1] for s, _ in separate.values()], separate
    assert all(tc for _, tc in combined.values()), combined  # all on amp's cp.async GEMM


def test_torch_export_projections_are_combined(tmp_path):
    """torch.export gives each Linear its own reshape/cast of the input; after CSE the three
    projections share it and combine. Values: the combined module vs the uncombined one (llvm),
    both fp16 with fp32 accumulation, on random inputs."""
    torch = pytest.importorskip("torch")
    import amp_cli
    from amp_cli.config import PrecisionConfig
    from amp_cli.precision import convert_precision

    class Projections(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(64, 48) for _ in range(3))

        def forward(self, x):
            return self.q(x) + self.k(x) * self.v(x)

    torch.manual_seed(0)
    ep = torch.export.export(Projections().eval(), (torch.randn(4, 32, 64),))
    torch.export.save(ep, str(tmp_path / "p.pt2"))
    loaded = amp_cli.load(tmp_path / "p.pt2")
    mod, _ = convert_precision(loaded.mod, PrecisionConfig(precision="fp16"), loaded.node_types)
    new, count = combine_parallel_gemms(mod)
    assert count == 3 and _matmul_shapes(new) == [[128, 144]]
    x = np.random.default_rng(2).standard_normal((4, 32, 64)).astype("float32")

    def run(m):
        ex = tvm.compile(m, target="llvm")
        out = tvm_compat.relax_vm(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
        out = out[0] if not hasattr(out, "numpy") else out
        return out.numpy().astype(np.float64)

    ref, got = run(mod), run(new)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())

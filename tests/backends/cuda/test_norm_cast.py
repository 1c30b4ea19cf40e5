"""Layer norm + fp16/bf16 cast as one kernel (amp_cli.backends.cuda.rewrites.norm_cast): which pairs are fused
and which are left alone (CI), that the cast kernel disappears from a BERT layer and the layer
still builds for sm_90 with the kernel's vector loads and stores (CI, nvcc), the kernel's values
before GPU scheduling on llvm and the layer's values with it (CI), and the scheduled kernel's
values on the GPU (gpu-marked), all against float64 references."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.rewrites import norm_cast as nc  # noqa: E402
from amp_cli.backends.cuda.rewrites.base import calls, op_name  # noqa: E402

relax = tvm.relax
F32 = "float32"


def _ln_module(shape=(2, 64, 256), low="float16", axes=(-1,), other=True, source=F32,
               dynamic=False):
    """layer_norm(x) cast to ``low``, the cast feeding a matmul; ``other``: the fp32 output is
    used too (returned; a residual add in BERT); ``source``: x is astype(h, fp32) of an input
    h of this type; ``dynamic``: the leading axis is symbolic."""
    rng = np.random.default_rng(0)
    n = shape[-1]
    dims = (tvm.tirx.Var("b", "int64"), *shape[1:]) if dynamic else shape
    h = relax.Var("h", relax.TensorType(dims, source))
    norm_dims = [shape[a] for a in axes]
    gamma = relax.const(rng.uniform(0.5, 1.5, norm_dims).astype(F32))
    beta = relax.const(rng.uniform(-0.5, 0.5, norm_dims).astype(F32))
    w = relax.const((rng.standard_normal((n, 8)) / np.sqrt(n)).astype(low))
    bb = relax.BlockBuilder()
    with bb.function("main", [h]):
        with bb.dataflow():
            x = h if source == F32 else bb.emit(relax.op.astype(h, F32))
            y = bb.emit(relax.op.nn.layer_norm(x, gamma, beta, axes=list(axes), epsilon=1e-12))
            y16 = bb.emit(relax.op.astype(y, low))
            mm = bb.emit(relax.op.matmul(y16, w, out_dtype=F32))
            gv = bb.emit_output(relax.Tuple([mm, y]) if other else mm)
        bb.emit_func_output(gv)
    return bb.get()


def _kernel_calls(mod):
    return [c for c in calls(mod) if op_name(c) == "relax.call_tir"
            and c.args[0].name_hint.startswith("amp_norm_cast")]


def test_plan_threads_and_vectors():
    assert nc.plan_threads(1024) == (256, 4)   # bert-large: one 16-byte vector per thread
    assert nc.plan_threads(768) == (192, 4)
    assert nc.plan_threads(4096) == (256, 4)   # 16 floats per thread
    assert nc.plan_threads(128) == (32, 4)
    assert nc.plan_threads(320) == (160, 2)
    assert nc.plan_threads(96) == (96, 1)
    assert nc.plan_threads(100) == "row length 100 is not a multiple of 32"
    assert nc.plan_threads(32768) == "row length 32768 is over 16384"


def test_pair_becomes_one_two_output_call():
    new, fused, declined = nc.fuse_norm_casts(_ln_module())
    assert (fused, declined) == (1, {})
    ops = [op_name(c) for c in calls(new)]
    assert "relax.nn.layer_norm" not in ops and "relax.astype" not in ops
    (call,) = _kernel_calls(new)
    assert [f.dtype for f in call.ty.fields] == [F32, "float16"]
    # the matmul reads the fp16 output, the function returns the fp32 one
    body = {b.var: b.value for b in new["main"].body.blocks[0].bindings}
    mm = next(c for c in calls(new) if op_name(c) == "relax.matmul")
    assert body[mm.args[0]].index == 1
    assert body[body[new["main"].body.body].fields[1]].index == 0


def test_fp16_source_is_read_directly():
    """x = astype(h, fp32): the kernel reads h (that cast would be a kernel of its own)."""
    new, fused, _ = nc.fuse_norm_casts(_ln_module(source="float16", low="bfloat16"))
    assert fused == 1
    (call,) = _kernel_calls(new)
    assert call.args[1].fields[0].ty.dtype == "float16"
    assert [f.dtype for f in call.ty.fields] == [F32, "bfloat16"]
    assert not any(op_name(c) == "relax.astype" for c in calls(new))


@pytest.mark.parametrize("dynamic", [False, True])
def test_pre_ln_cast_norm_cast_is_one_kernel_with_only_the_low_output(dynamic):
    """A pre-LN transformer's ``astype(h, fp32) -> layer_norm -> astype(fp16)`` (GPT-2, ViT,
    Whisper): the kernel reads h and writes only the fp16 output (nothing reads fp32)."""
    new, fused, declined = nc.fuse_norm_casts(
        _ln_module(other=False, source="float16", dynamic=dynamic))
    assert (fused, declined) == (1, {})
    (call,) = _kernel_calls(new)
    assert call.args[1].fields[0].ty.dtype == "float16"
    assert isinstance(call.ty, relax.TensorType) and call.ty.dtype == "float16"
    assert not any(op_name(c) in ("relax.astype", "relax.nn.layer_norm") for c in calls(new))
    mm = next(c for c in calls(new) if op_name(c) == "relax.matmul")
    assert mm.args[0].ty.dtype == "float16"


def test_what_is_left_alone():
    for mod in (_ln_module(other=False),          # cast only: FuseOps fuses it already
                _ln_module(axes=(1, 2))):         # not the last axis alone
        new, fused, declined = nc.fuse_norm_casts(mod)
        assert (fused, declined) == (0, {}) and new.same_as(mod)
    for n, why in ((100, "row length 100 is not a multiple of 32"),
                   (32768, "row length 32768 is over 16384")):
        mod = _ln_module(shape=(2, n))
        new, fused, declined = nc.fuse_norm_casts(mod)
        assert fused == 0 and declined == {why: 1} and new.same_as(mod)


def _fused_kernels(mod):
    """The main function's call_tir callees after amp's legalize/fuse passes."""
    seq = tvm.transform.Sequential([
        relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(), relax.transform.FuseOps(), relax.transform.FuseTIR()])
    out = seq(mod)
    return [c.args[0].name_hint for c in calls(out) if op_name(c) == "relax.call_tir"], out


def _cast_only(name, mod) -> bool:
    """Whether PrimFunc ``name`` is a lone cast (a single block storing a Cast)."""
    sch = tvm.s_tir.Schedule(mod[name])
    blocks = [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]
    return len(blocks) == 1 and isinstance(blocks[0].body.value, tvm.tirx.Cast)


def _sunk(mod):
    """``mod`` after reshape_sink, which runs before this pass in amp's pipeline (the importer
    puts a flattening reshape between the layer norm and its cast)."""
    from amp_cli.backends.cuda.rewrites.reshape_sink import sink_reshapes

    return sink_reshapes(mod)[0]


def test_encoder_layer_cast_kernel_is_gone(fp16_encoder_layer):
    mod = _sunk(fp16_encoder_layer)
    before, before_mod = _fused_kernels(mod)
    new, fused, declined = nc.fuse_norm_casts(mod)
    after, after_mod = _fused_kernels(new)
    assert (fused, declined) == (1, {})   # the first layer norm; the second is the output
    casts_before = [k for k in before if _cast_only(k, before_mod)]
    casts_after = [k for k in after if _cast_only(k, after_mod)]
    # the layer's input cast (x -> fp16 for the QKV GEMM) stays; the norm's cast is gone
    assert len(casts_before) == 2 and len(casts_after) == 1, (before, after)
    assert len(after) == len(before) - 1
    assert sum(k.startswith("amp_norm_cast") for k in after) == 1


def test_encoder_layer_values_with_the_unscheduled_kernel(fp16_encoder_layer, monkeypatch):
    """The graph plumbing (which output feeds what) checked by values: the layer with the fused
    pair (kernel before GPU scheduling) vs without, both on llvm, on random inputs."""
    monkeypatch.setattr(nc, "norm_cast_func", lambda *key: nc.norm_cast_compute(*key)
                        .with_attr("op_pattern", nc.OPAQUE))
    mod = _sunk(fp16_encoder_layer)
    new, fused, _ = nc.fuse_norm_casts(mod)
    assert fused == 1
    x = np.random.default_rng(1).standard_normal((2, 64, 128)).astype(F32)

    def run(mod):
        vm = tvm_compat.relax_vm(tvm.compile(mod, target="llvm"), tvm.cpu())
        return vm["main"](tvm.runtime.tensor(x)).numpy().astype(np.float64)

    ref, got = run(mod), run(new)
    # same fp32 math and fp16 rounding; only the summation order may differ
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5


def _reference(x, gamma, beta, eps):
    x = x.astype(np.float64)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def _inputs(shape, in_dtype, seed):
    rng = np.random.default_rng(seed)
    n = shape[-1]
    # an offset mean (post-residual activations are not centered) and no zeros
    x = (rng.uniform(0.5, 2.0, shape) * rng.choice([-1, 1], shape) + 3.0).astype(in_dtype)
    gamma = rng.uniform(0.5, 1.5, n).astype(F32)
    beta = rng.uniform(-0.5, 0.5, n).astype(F32)
    return x, gamma, beta


def _check(out, out_low, x, gamma, beta, eps):
    ref = _reference(x, gamma, beta, eps)
    scale = np.abs(ref).max()
    # fp32 math over the row: ~1e-7 relative per operation; fp16: half an ulp (2^-11 relative)
    assert np.abs(out - ref).max() / scale < 1e-5
    assert np.abs(out_low.astype(np.float64) - ref).max() / scale < 1e-3
    # the low output is the fp32 output rounded, exactly as the separate cast kernel did
    np.testing.assert_array_equal(out_low, out.astype(out_low.dtype))


@pytest.mark.parametrize("shape,in_dtype", [((2, 64, 256), F32), ((3, 5, 96), "float16"),
                                            ((4, 1024), F32)])
def test_kernel_values_on_llvm(shape, in_dtype):
    eps = 1e-5
    func = nc.norm_cast_compute(shape, eps, in_dtype, "float16")
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    x, gamma, beta = _inputs(shape, in_dtype, sum(shape))
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros(shape, F32), dev)
    low = tvm.runtime.tensor(np.zeros(shape, "float16"), dev)
    lib["main"](*(tvm.runtime.tensor(a, dev) for a in (x, gamma, beta)), out, low)
    _check(out.numpy(), low.numpy(), x, gamma, beta, eps)
    # the low-only kernel writes the same fp16 values
    only = tvm.compile(tvm.IRModule({"main": nc.norm_cast_compute(
        shape, eps, in_dtype, "float16", fp32_out=False)}), target="llvm")
    low_only = tvm.runtime.tensor(np.ones(shape, "float16"), dev)
    only["main"](*(tvm.runtime.tensor(a, dev) for a in (x, gamma, beta)), low_only)
    np.testing.assert_array_equal(low_only.numpy(), low.numpy())


def _kernel_source(shape, in_dtype=F32, low="float16", arch="sm_90", fp32_out=True):
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline

    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    func = nc.norm_cast_func(shape, 1e-12, in_dtype, low, fp32_out)
    lib = tvm.compile(tvm.IRModule({"norm_cast": func.with_attr("global_symbol", "norm_cast")}),
                      target=target, tir_pipeline=cuda_tir_pipeline(target))
    return lib, lib.mod.imports[0].inspect_source()


@pytest.mark.parametrize("shape,in_dtype,low,threads,per_thread", [
    ((8, 128, 1024), F32, "float16", 256, 4), ((4, 4096), "float16", "bfloat16", 256, 16)])
def test_kernel_compiles_to_vector_loads_and_stores(shape, in_dtype, low, threads, per_thread):
    _, src = _kernel_source(shape, in_dtype, low)
    kernel = src[src.index("__launch_bounds__"):]
    assert f"__launch_bounds__({threads})" in kernel
    # the thread's part of the row lives in a register array, loaded once
    assert f"x_local_local_ptr[{per_thread}]" in kernel
    load = "half4 v" if in_dtype == "float16" else "*(float4*)(x_local_local_ptr"
    assert kernel.count("(x_ptr + ") == per_thread // 4 and load in kernel
    low_vec = "half4" if low == "float16" else "nv_bfloat164"
    assert f"*({low_vec}*)(out_low_ptr" in kernel and "*(float4*)(out_ptr" in kernel


def test_low_only_kernel_compiles_to_vector_stores_of_the_low_output():
    _, src = _kernel_source((8, 197, 768), "float16", "float16", fp32_out=False)
    kernel = src[src.index("__launch_bounds__"):]
    assert "*(half4*)(out_low_ptr" in kernel and "out_ptr" not in kernel.replace("out_low_ptr",
                                                                               "")


def test_encoder_layer_builds_for_sm90(fp16_encoder_layer):
    from amp_cli.compile import relax_pipeline, tir_pipeline
    from amp_cli.config import CudaConfig
    from amp_cli.target import resolve_target

    target = resolve_target("cuda:sm_90")

    def lower(cuda):
        stats: dict = {}
        with target.tvm_target():
            lowered = relax_pipeline(target, cuda=cuda, rewrite_stats=stats)(fp16_encoder_layer)
        # launches of cast kernels (equal shapes share one PrimFunc)
        casts = [c for c in calls(lowered) if isinstance(c.op, tvm.ir.GlobalVar)
                 and isinstance(lowered[c.op], tvm_compat.prim_func_class())
                 and c.op.name_hint.startswith("cast")]
        return lowered, stats, len(casts)

    lowered, stats, casts = lower(None)
    assert stats["norm_casts"] == 1 and stats["norm_casts_unfused"] == 0, stats
    # one cast is left: the layer's input x -> fp16 (the norm's cast is in the kernel)
    assert casts == 1
    _, stats_off, casts_off = lower(CudaConfig(fused_norm_cast=False))
    assert "norm_casts" not in stats_off and casts_off == 2
    ex = tvm_compat.compile_relax(lowered, target.tvm_target(), relax_pipeline=None,
                                  tir_pipeline=tir_pipeline(target, []))
    src = tvm_compat.cuda_source(ex)
    (kernel,) = [c for c in src.split("__global__")[1:]
                 if "amp_norm_cast" in c.split("(", 2)[1] and "{" in c.split(";", 1)[0]]
    assert "*(half4*)(out_low_ptr" in kernel and "*(float4*)(out_ptr" in kernel


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape,in_dtype", [((8, 128, 1024), F32), ((2, 64, 768), F32),
                                            ((4, 4096), "float16"), ((3, 320), F32),
                                            ((5, 96), "float16")])
def test_kernel_matches_float64_on_gpu(shape, in_dtype):
    dev = tvm.cuda(0)
    arch = "sm_" + dev.compute_version.replace(".", "")
    lib, _ = _kernel_source(shape, in_dtype, "float16", arch)
    x, gamma, beta = _inputs(shape, in_dtype, sum(shape))
    out = tvm.runtime.tensor(np.zeros(shape, F32), dev)
    low = tvm.runtime.tensor(np.zeros(shape, "float16"), dev)
    lib["norm_cast"](*(tvm.runtime.tensor(a, dev) for a in (x, gamma, beta)), out, low)
    _check(out.numpy(), low.numpy(), x, gamma, beta, 1e-12)
    # the low-only kernel (pre-LN transformers): the same fp16 values
    only, _ = _kernel_source(shape, in_dtype, "float16", arch, fp32_out=False)
    low_only = tvm.runtime.tensor(np.ones(shape, "float16"), dev)
    only["norm_cast"](*(tvm.runtime.tensor(a, dev) for a in (x, gamma, beta)), low_only)
    np.testing.assert_array_equal(low_only.numpy(), low.numpy())


def _symbolic_rows(n=256):
    b, s = tvm.tirx.Var("batch", "int64"), tvm.tirx.Var("sequence", "int64")
    return (b, s, n)


def test_symbolic_rows_values_on_llvm():
    """A dynamic model's layer norm ([batch, sequence, N], batch and sequence symbolic): one
    function, right at every shape."""
    func = nc.norm_cast_compute(_symbolic_rows(), 1e-5, F32, "float16")
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    dev = tvm.cpu()
    for shape in ((2, 7, 256), (1, 33, 256), (3, 1, 256)):
        x, gamma, beta = _inputs(shape, F32, sum(shape))
        out = tvm.runtime.tensor(np.zeros(shape, F32), dev)
        low = tvm.runtime.tensor(np.zeros(shape, "float16"), dev)
        lib["main"](*(tvm.runtime.tensor(a, dev) for a in (x, gamma, beta)), out, low)
        _check(out.numpy(), low.numpy(), x, gamma, beta, 1e-5)


def test_symbolic_rows_are_fused_and_compile():
    """Symbolic rows (one symbolic dim or two): the kernel over the flattened rows between
    reshape views, the cast gone; the kernel compiles with vector loads and stores."""
    b, s, n = _symbolic_rows()
    for mod in (_ln_module(shape=(b, s, n)), _ln_module(dynamic=True)):
        new, fused, declined = nc.fuse_norm_casts(mod)
        assert (fused, declined) == (1, {})
        ops = [op_name(c) for c in calls(new)]
        assert "relax.astype" not in ops and "relax.nn.layer_norm" not in ops
        assert ops.count("relax.reshape") == 3  # rows flattened; both outputs back
    _, src = _kernel_source((b, s, n))
    kernel = src[src.index("__launch_bounds__"):]
    assert "__launch_bounds__(64)" in kernel and "*(float4*)(out_ptr" in kernel


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA GPU")
def test_symbolic_rows_match_float64_on_gpu():
    dev = tvm.cuda(0)
    arch = "sm_" + dev.compute_version.replace(".", "")
    lib, _ = _kernel_source(_symbolic_rows(1024), F32, "float16", arch)
    for shape in ((1, 16, 1024), (3, 77, 1024), (8, 128, 1024)):
        x, gamma, beta = _inputs(shape, F32, sum(shape))
        out = tvm.runtime.tensor(np.zeros(shape, F32), dev)
        low = tvm.runtime.tensor(np.zeros(shape, "float16"), dev)
        lib["norm_cast"](*(tvm.runtime.tensor(a, dev) for a in (x, gamma, beta)), out, low)
        _check(out.numpy(), low.numpy(), x, gamma, beta, 1e-12)

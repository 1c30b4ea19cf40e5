"""amp's Hopper GEMMs (schedule/hopper_gemm.py): which fused GEMMs they take, that those build
for sm_90a with wgmma + TMA through amp's TIR pipeline (CI, no GPU), and values on an sm_90 GPU
against a float64 reference."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.kernels import hopper_gemm as hg  # noqa: E402
from amp_cli.backends.cuda.kernels import hopper_plan as hp  # noqa: E402
from test_tc_gemm import build, gemm  # noqa: E402


def epilogue_gemm(m, n, k, dtype="float16", out_dtype="float32", batch=None):
    """out = residual + erf(cast(A @ B^T, fp16) + bias) (fp32): a cast, a bias, a
    transcendental and a residual read in the tail, like bert-large's fused GEMMs."""
    from tvm import te

    lead = (batch,) if batch else ()
    a = te.placeholder(lead + (m, k), dtype, name="A")
    b = te.placeholder((n, k), dtype, name="B")
    bias = te.placeholder((n,), dtype, name="bias")
    res = te.placeholder(lead + (m, n), out_dtype, name="res")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute(lead + (m, n), lambda *ix: te.sum(
        a[ix[:-1] + (r,)].astype("float32") * b[ix[-1], r].astype("float32"), axis=r), name="C")
    low = te.compute(c.shape, lambda *ix: c(*ix).astype(dtype) + bias[ix[-1]], name="low")
    act = te.compute(c.shape, lambda *ix: te.erf(low(*ix).astype("float32")), name="act")
    out = te.compute(c.shape, lambda *ix: (res(*ix) + act(*ix)).astype(out_dtype), name="out")
    return te.create_prim_func([a, b, bias, res, out]).with_attr("global_symbol", "main")


def gelu_tanh_gemm(m, n, k, dtype="float16"):
    """out = GELU-tanh(A @ B^T) with GPT-2's ``x**3``: a ``pow`` in the transplanted epilogue."""
    from tvm import te

    a = te.placeholder((m, k), dtype, name="A")
    b = te.placeholder((n, k), dtype, name="B")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(
        a[i, r].astype("float32") * b[j, r].astype("float32"), axis=r), name="C")

    def gelu(i, j):
        x = c[i, j]
        cube = te.power(x, tvm.tirx.const(3.0, "float32"))
        return (0.5 * x * (1.0 + te.tanh(0.7978845608 * (x + 0.044715 * cube)))).astype(dtype)

    out = te.compute((m, n), gelu, name="out")
    return te.create_prim_func([a, b, out]).with_attr("global_symbol", "main")


def hopper(func):
    return hopper_args(func)


def hopper_args(func, **kwargs):
    made = hg.hopper_func(func, **kwargs)
    assert not isinstance(made, str), made
    return made


# ------------------------------------------------------------------ planning and matching
def test_plan_fills_the_gpu_with_the_widest_tile():
    assert hp.plan(1024, 4096, 1024) == hp.Plan(128, 6)      # 256 CTAs
    assert hp.plan(1024, 3072, 1024) == hp.Plan(192, 5)
    assert hp.plan(1024, 1024, 4096) == hp.Plan(64, 6)
    assert hp.plan(256, 256, 512) == hp.Plan(64, 6)          # too small to fill: most CTAs
    for p in (hp.plan(1024, 4096, 1024), hp.plan(1024, 1024, 4096)):
        assert p.smem_bytes() <= hp.SMEM_BUDGET


@pytest.mark.parametrize("m,n,k,why", [
    (1024, 1000, 1024, "multiple of 64"),
    (1024, 1024, 256, "in 512..8192"),
    (1024, 1024, 1000, "multiple of 64"),
    (1024, 1024, 16384, "in 512..8192"),
    (64, 1024, 1024, "below"),
])
def test_plan_declines(m, n, k, why):
    assert why in hp.plan(m, n, k)


def test_plan_takes_shorter_k_when_asked():
    """``cuda.hopper_min_k`` lowers the K threshold (ConvNeXt's and Whisper's K = 384 / 768
    GEMMs); never below one 64-deep step, and K must still be a multiple of 64."""
    assert "in 512..8192" in hp.plan(1568, 1536, 384)
    assert hp.plan(1568, 1536, 384, min_k=128) == hp.Plan(128, 6)
    assert isinstance(hp.plan(1024, 1024, 64, min_k=0), hp.Plan)
    assert "in 64..8192" in hp.plan(1024, 1024, 0, min_k=0)
    assert "multiple of 64" in hp.plan(1568, 384, 96, min_k=64)


def test_two_per_sm_plans_narrow_tiles_and_half_the_stages():
    """``cuda.hopper_two_per_sm``: tiles at most 128 wide (ptxas: 108 registers a thread at
    BN = 128, 140 at 192; two 288-thread CTAs fit 65,536 only under 113) and shared memory for
    two CTAs."""
    for m, n, k in [(12000, 3072, 768), (1024, 4096, 1024), (1576, 768, 3072), (256, 256, 512)]:
        one, two = hp.plan(m, n, k), hp.plan(m, n, k, per_sm=2)
        assert two.bn <= 128 and 2 * two.smem_bytes() <= hp.SMEM_BUDGET, (m, n, k, two)
        assert two.stages >= 3 and (one.bn > 128 or two.stages < one.stages), (one, two)
    assert hp.plan(12000, 3072, 768, per_sm=2) == hp.Plan(128, 3)
    assert [p.bn for _, p in hp.plan_variants(1, 4096, 3072, 1024, per_sm=2)] == [64, 128]


def test_two_per_sm_reaches_the_pass():
    """The switch from the config reaches the registered Hopper pass: the kernel's tile."""
    from amp_cli.backends.cuda.pipeline import build_context
    from amp_cli.compile import compile_target
    from amp_cli.config import CudaConfig
    from amp_cli.ir_attrs import HOPPER_TILE
    from amp_cli.target import resolve_target

    target = compile_target(resolve_target("cuda:sm_90"))
    mod = tvm.IRModule({"gemm": gemm(1024, 3072, 1024, bias=True)})
    tiles = [str(hg.make_pass(build_context(target, cfg, {}))(mod)["gemm"].attrs[HOPPER_TILE])
             for cfg in (CudaConfig(), CudaConfig(hopper_two_per_sm=True))]
    assert tiles == ["128x192x64s5", "128x128x64s3"]


def test_two_per_sm_kernels_ask_ptxas_for_two_ctas():
    """The two-CTAs-an-SM plan reaches ptxas as ``__launch_bounds__(288, 2)``, which caps the
    registers a thread at the two CTAs' share; the default plan's kernel has no such bound."""
    two = tvm_compat.cuda_source(build(hopper_args(gemm(1000, 3072, 768, bias=True), per_sm=2),
                                       "sm_90a"))
    one = tvm_compat.cuda_source(build(hopper(gemm(1000, 3072, 768, bias=True)), "sm_90a"))
    assert "__launch_bounds__(288, 2)" in two
    assert "__launch_bounds__(288)" in one and "__launch_bounds__(288, " not in one


def test_persistent_kernels_walk_their_tiles():
    """``cuda.hopper_persistent``: at most one CTA an SM, each walking tiles ``bid, bid +
    grid, ...`` in a loop around the producer's and the consumers' K loops (the consumers'
    stays unrolled), the ring's stage and phase counted across tiles; the tile name says so,
    and the switch reaches the pass."""
    import re

    from amp_cli.backends.cuda.pipeline import build_context
    from amp_cli.compile import compile_target
    from amp_cli.config import CudaConfig
    from amp_cli.ir_attrs import HOPPER_TILE
    from amp_cli.target import resolve_target

    made = hopper_args(gemm(1000, 3072, 768, bias=True), persistent=True, sms=7)
    assert str(made.attrs[HOPPER_TILE]) == "128x192x64s5p"
    src = tvm_compat.cuda_source(build(made, "sm_90a"))
    kernel = src[src.find('extern "C" __global__'):]
    # 8 x 16 = 128 tiles over 7 CTAs: a tile loop in the producer and one in the consumers
    assert len(re.findall(r"for \(int it(_\d+)? = 0; it(_\d+)? < ", kernel)) == 2
    assert "for (int kt_1" not in kernel          # the consumer's K loop is still unrolled
    assert len(re.findall(r"wgmma_\w*mma_async\w*\(", kernel)) == 12 * 4   # K 768: 12 x 4
    target = compile_target(resolve_target("cuda:sm_90"))
    mod = tvm.IRModule({"gemm": gemm(1024, 3072, 1024, bias=True)})
    tiles = [str(hg.make_pass(build_context(target, cfg, {}))(mod)["gemm"].attrs[HOPPER_TILE])
             for cfg in (CudaConfig(hopper_persistent=True),
                         CudaConfig(hopper_persistent=True, hopper_two_per_sm=True))]
    assert tiles == ["128x192x64s5p", "128x128x64s3p"]


def test_static_m_below_one_tile_is_declined():
    """Only a symbolic M may run below one 128-row tile (its optimum says nothing about the
    smallest call); a static one keeps amp's other schedules."""
    assert "below" in hg.hopper_func(gemm(64, 256, 512, bias=True))


def test_min_k_reaches_the_pass():
    """``cuda.hopper_min_k`` from the config reaches the registered Hopper pass: a K = 256
    GEMM becomes a wgmma kernel with it at 256 and keeps its schedule by default."""
    from amp_cli.backends.cuda.pipeline import build_context
    from amp_cli.compile import compile_target
    from amp_cli.config import CudaConfig
    from amp_cli.target import resolve_target

    target = compile_target(resolve_target("cuda:sm_90"))
    mod = tvm.IRModule({"gemm": gemm(256, 256, 256, bias=True)})
    counts = {}
    for cfg in (CudaConfig(), CudaConfig(hopper_min_k=256)):
        stats: dict = {}
        hg.make_pass(build_context(target, cfg, stats))(mod)
        counts[cfg.hopper_min_k] = stats.get("hopper_gemm", 0)
    assert counts == {512: 0, 256: 1}


def test_match_reads_the_fused_tail():
    match = hg.match_gemm(epilogue_gemm(128, 256, 512, batch=2))
    assert not isinstance(match, str), match
    assert (match.m, match.n, match.k, match.in_dtype) == (256, 256, 512, "float16")
    assert str(match.out) == "out" and match.value is not None


def tail_reads_operand(m=256, k=512):
    """out = A @ B^T + A[:, :N] (N = K): a tail reading a GEMM operand, which the kernel's
    epilogue cannot (A lives in shared memory tiles there)."""
    from tvm import te

    a = te.placeholder((m, k), "float16", name="A")
    b = te.placeholder((k, k), "float16", name="B")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, k), lambda i, j: te.sum(
        a[i, r].astype("float32") * b[j, r].astype("float32"), axis=r), name="C")
    d = te.compute((m, k), lambda i, j: (c[i, j] + a[i, j].astype("float32")).astype("float16"),
                   name="D")
    return te.create_prim_func([a, b, d]).with_attr("global_symbol", "main")


@pytest.mark.parametrize("func,why", [
    (lambda: gemm(256, 256, 512, b_layout="KN"), "NT"),
    (tail_reads_operand, "epilogue reads A"),
    (lambda: gemm(256, 256, 512, dtype="float32"), "operand types"),
])
def test_match_declines(func, why):
    assert why in hg.match_gemm(func())


def test_build_target_is_sm90a_only_for_hopper():
    t90 = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    assert str(hg.build_target(t90).attrs["arch"]) == "sm_90a"
    assert str(hg.build_target(t90, enabled=False).attrs["arch"]) == "sm_90"
    t80 = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    assert str(hg.build_target(t80).attrs["arch"]) == "sm_80"


def test_matmul_nt_keeps_hopper_gemms_whole():
    """bert-large's FFN-down (1024 x 1024 x 4096) is split along K for the wmma tiles, not for
    the Hopper kernel (128 CTAs of 128 x 64 already fill the GPU)."""
    from tvm.script import relax as R

    from amp_cli.backends.cuda.rewrites.matmul_nt import matmul_to_nt

    w = np.random.default_rng(0).standard_normal((4096, 1024)).astype("float16")

    @tvm.script.ir_module
    class Mod:
        @R.function
        def main(x: R.Tensor((1024, 4096), "float16")):
            with R.dataflow():
                y = R.matmul(x, R.const(w), out_dtype="float32")
                R.output(y)
            return y

    _, split = matmul_to_nt(Mod, 90, split_k=True)
    _, whole = matmul_to_nt(Mod, 90, split_k=True, hopper=True)
    assert split["split_k"] == 1 and whole["split_k"] == 0


# ------------------------------------------------------------------ CUDA builds (CI, no GPU)
@pytest.mark.parametrize("func", [
    lambda: gemm(256, 256, 512, bias=True, relu=True),
    lambda: gemm(200, 128, 512, bias=True),                 # M not a multiple of 128: guarded
    lambda: gemm(128, 192, 1024, batch=2, bias=True),       # 3-D activations, N = 192
    lambda: gemm(256, 256, 512, dtype="bfloat16", bias=True),
    lambda: epilogue_gemm(128, 256, 512, batch=2),           # fp32 output, residual, erf
    lambda: epilogue_gemm(128, 1024, 4096, batch=8),         # bert-large's FFN-down
])
def test_builds_with_wgmma_and_tma(func):
    src = tvm_compat.cuda_source(build(hopper(func()), "sm_90a"))
    assert "wgmma.mma_async.sync.aligned.m64n" in src
    assert "cp.async.bulk.tensor.2d" in src and "mbarrier.try_wait" in src
    assert "wmma::" not in src
    assert "for (int kt_1" not in src   # the consumer's K loop is unrolled (see hopper_gemm)


def test_epilogue_pow_keeps_its_sign():
    """GPT-2's GELU fused into a Hopper GEMM: its ``x**3`` must not reach the CUDA source as
    ``powf`` (fast math makes it ``__powf``, NaN for negative x: the full-size GPT-2 export
    came out 100 % NaN on the H100 while every other GEMM path was exact). The Hopper kernels
    go through TVM's TIRx lowering, so the pow rewrite must run before the split."""
    import re

    src = tvm_compat.cuda_source(build(hopper(gelu_tanh_gemm(256, 256, 512)), "sm_90a"))
    assert "wgmma.mma_async" in src and "tanhf" in src
    assert not re.search(r"\b(__)?powf\(", src[src.find('extern "C" __global__'):])


# ------------------------------------------------------------------ values on the GPU
def _sm90() -> bool:
    return tvm_compat.has_cuda_device() and tvm_compat.cuda_compute_version() == "9.0"


def _run(func, arrays, out_shape, out_dtype):
    dev = tvm.cuda(0)
    ex = build(func, "sm_90a")
    args = [tvm.runtime.tensor(a, dev) for a in arrays]
    out = tvm.runtime.empty(out_shape, out_dtype, dev)
    ex(*args, out)
    return out.numpy().astype("float64")


def _rel(out, ref):
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("m,n,k,batch", [(256, 256, 512, None), (200, 128, 1024, None),
                                         (128, 192, 1024, 2), (1024, 1024, 4096, None)])
def test_gemm_bias_relu_matches_float64(m, n, k, batch):
    """rel L2 vs float64 below 2e-3 (fp16 output rounding alone is ~3e-4; a wrong stage,
    swizzle or fragment mapping gives O(1e-2) or more, as the first prototype did)."""
    rng = np.random.default_rng(2)
    lead = (batch,) if batch else ()
    a = rng.standard_normal(lead + (m, k)).astype("float16")
    b = rng.standard_normal((n, k)).astype("float16")
    bias = rng.standard_normal(n).astype("float32")
    ref = np.maximum(a.astype("float64") @ b.astype("float64").T + bias, 0)
    out = _run(hopper(gemm(m, n, k, bias=True, relu=True, batch=batch)), [a, b, bias],
               lead + (m, n), "float16")
    assert _rel(out, ref) < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("batch,m,n,k", [
    (2, 128, 256, 512),
    # bert-large's FFN-down: 128 x 64 tiles, 6 stages, a 64-step K loop, fp32 residual output.
    # Its kernel was wrong on the H200 (33% of outputs) while nvcc kept the K loop rolled.
    (8, 128, 1024, 4096),
])
def test_fused_tail_matches_float64(batch, m, n, k):
    rng = np.random.default_rng(3)
    from math import erf

    a = rng.standard_normal((batch, m, k)).astype("float16")
    b = (rng.standard_normal((n, k)) / np.sqrt(k)).astype("float16")
    bias = rng.standard_normal(n).astype("float16")
    res = rng.standard_normal((batch, m, n)).astype("float32")
    c = (a.astype("float64") @ b.astype("float64").T).astype("float16") + bias
    ref = res + np.vectorize(erf)(c.astype("float64"))
    out = _run(hopper(epilogue_gemm(m, n, k, batch=batch)), [a, b, bias, res],
               (batch, m, n), "float32")
    assert _rel(out, ref) < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("m,n,k", [(200, 256, 64), (256, 192, 128), (1568, 1536, 384)])
def test_short_k_matches_float64(m, n, k):
    """K loops of 1..6 steps (``cuda.hopper_min_k`` below 512): fewer steps than stages, so
    the producer never waits on ``empty``, and a ragged M."""
    assert _bias_relu_rel(m, n, k, 6, min_k=64) < 2e-3


def _bias_relu_rel(m, n, k, seed, **hopper_args) -> float:
    """rel L2 of the Hopper kernel (``hopper_func(..., **hopper_args)``) of relu(A @ B^T +
    bias) on the GPU against float64 numpy, fp16 A / B of seeded normal values."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype("float16")
    b = rng.standard_normal((n, k)).astype("float16")
    bias = rng.standard_normal(n).astype("float32")
    ref = np.maximum(a.astype("float64") @ b.astype("float64").T + bias, 0)
    made = hg.hopper_func(gemm(m, n, k, bias=True, relu=True), **hopper_args)
    assert not isinstance(made, str), made
    return _rel(_run(made, [a, b, bias], (m, n), "float16"), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("m,n,k", [(1000, 3072, 768), (256, 256, 512)])
def test_two_per_sm_matches_float64(m, n, k):
    """The kernels planned for two CTAs an SM (3 stages, fewer than most K loops' steps)."""
    assert _bias_relu_rel(m, n, k, 7, per_sm=2) < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("m,n,k,args", [
    (1000, 3072, 768, dict(sms=7)),            # 128 tiles over 7 CTAs, 12 steps over 5 stages
    (1000, 3072, 768, dict()),                 # one tile a CTA (128 tiles, 132 SMs)
    (200, 256, 64, dict(sms=3, min_k=64)),     # one K step a tile: the ring turns per tile
    (1000, 3072, 768, dict(sms=5, per_sm=2)),  # with two CTAs an SM: 3 stages
])
def test_persistent_matches_float64(m, n, k, args):
    """Persistent kernels (``cuda.hopper_persistent``): CTAs walking several tiles, so the
    stage ring's phases run across tile boundaries and the producer loads the next tile while
    the consumers store this one."""
    assert _bias_relu_rel(m, n, k, 9, persistent=True, **args) < 2e-3


def symbolic_gemm(n, k, dtype="float16"):
    """out = res + (cast(A @ B^T, fp16) + bias) over a symbolic [batch, seq] of rows: a
    dynamic-shape BERT layer's GEMM with its residual."""
    from tvm import te

    bv, sv = tvm.tirx.Var("batch", "int64"), tvm.tirx.Var("seq", "int64")
    a = te.placeholder((bv, sv, k), dtype, name="A")
    b = te.placeholder((n, k), dtype, name="B")
    bias = te.placeholder((n,), dtype, name="bias")
    res = te.placeholder((bv, sv, n), "float32", name="res")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((bv, sv, n), lambda i, j, o: te.sum(
        a[i, j, r].astype("float32") * b[o, r].astype("float32"), axis=r), name="C")
    low = te.compute(c.shape, lambda *ix: c(*ix).astype(dtype) + bias[ix[-1]], name="low")
    out = te.compute(c.shape, lambda *ix: res(*ix) + low(*ix).astype("float32"), name="out")
    return te.create_prim_func([a, b, bias, res, out]).with_attr("global_symbol", "main")


def _symbolic_rel(made, batch: int, seq: int, n: int, k: int, seed: int) -> float:
    """rel L2 of ``made`` (a :func:`symbolic_gemm` kernel) on the GPU against float64, on random
    [batch, seq] rows."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((batch, seq, k)).astype("float16")
    b = (rng.standard_normal((n, k)) / np.sqrt(k)).astype("float16")
    bias = rng.standard_normal(n).astype("float16")
    res = rng.standard_normal((batch, seq, n)).astype("float32")
    c = (a.astype("float64") @ b.astype("float64").T).astype("float16") + bias
    ref = res + c.astype("float64")
    return _rel(_run(made, [a, b, bias, res], (batch, seq, n), "float32"), ref)


def test_symbolic_rows_only_when_asked():
    """A GEMM over symbolic rows keeps amp's other schedules by default; with ``symbolic``
    it becomes one wgmma kernel whose tile is planned at the optimum's M, and it builds for
    sm_90a with the residual read at the output's flat index (no divisions by the symbolic
    sequence per element)."""
    func = symbolic_gemm(1024, 1024)
    assert hg.hopper_func(func) == "dynamic shape"
    made = hg.hopper_func(func, symbolic=True, dims={"batch": 8, "seq": 128})
    assert not isinstance(made, str), made
    assert str(made.attrs[hg.HOPPER_TILE]) == "128x64x64s6"   # M = 1024: 64 CTAs of 128 x 64
    wide = hg.hopper_func(func, symbolic=True, dims={"batch": 32, "seq": 512})
    assert str(wide.attrs[hg.HOPPER_TILE]).startswith("128x128")
    src = tvm_compat.cuda_source(build(made, "sm_90a"))
    assert "wgmma.mma_async.sync.aligned.m64n64" in src and "cp.async.bulk.tensor.2d" in src
    kernel = src[src.find('extern "C" __global__'):]
    assert "% ((int)seq)" not in kernel and "/ ((int)seq)" not in kernel


def test_symbolic_rows_over_a_range_get_one_kernel_per_plan():
    """Over a range of M each run of M with its own plan gets its own kernel behind a host
    branch on M: a batch-1 sequence (M = 128) takes the 64-wide tile its static build takes
    (48 CTAs at N = 3072), not the optimum's 192-wide one (16 CTAs). Both kernels build for
    sm_90a in one module function."""
    import re

    func = symbolic_gemm(3072, 1024)
    ranges = {"batch": (1, 32), "seq": (16, 512)}
    made = hg.hopper_func(func, symbolic=True, dims={"batch": 8, "seq": 128}, ranges=ranges)
    assert not isinstance(made, str), made
    assert str(made.attrs[hg.HOPPER_TILE]) == "128x64x64s6@16,128x192x64s5@897"
    assert hp.plan(128, 3072, 1024) == hp.Plan(64, 6)   # what batch 1 gets in a static build
    src = tvm_compat.cuda_source(build(made, "sm_90a"))
    widths = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", src))
    assert widths == {"64", "192"}
    # one range, one plan: no branch
    one = hg.hopper_func(func, symbolic=True, ranges={"batch": (8, 32), "seq": (128, 128)})
    assert str(one.attrs[hg.HOPPER_TILE]) == "128x192x64s5"
    # N = 1024: the optimum's plan (64 wide at M = 1024) is already the narrowest, and M
    # above the optimum keeps it (128 wide only from M = 1793, and only without an optimum)
    narrow = symbolic_gemm(1024, 1024)
    at_opt = hg.hopper_func(narrow, symbolic=True, dims={"batch": 8, "seq": 128}, ranges=ranges)
    assert str(at_opt.attrs[hg.HOPPER_TILE]) == "128x64x64s6"
    no_opt = hg.hopper_func(narrow, symbolic=True, ranges=ranges)
    assert str(no_opt.attrs[hg.HOPPER_TILE]) == "128x64x64s6@16,128x128x64s6@1793"


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("batch,seq", [(1, 16), (1, 128), (3, 50), (4, 160), (8, 128),
                                       (32, 128)])
def test_symbolic_rows_over_a_range_match_float64(batch, seq):
    """Each kernel of the range's plans (M = 16..896 on the 64-wide tile, 1024 and 4096 on the
    192-wide), chosen on the host from the call's M."""
    made = hg.hopper_func(symbolic_gemm(3072, 1024), symbolic=True,
                          ranges={"batch": (1, 32), "seq": (16, 512)})
    assert _symbolic_rel(made, batch, seq, 3072, 1024, seed=8) < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("batch,seq", [(1, 16), (1, 128), (3, 50), (8, 128), (32, 128)])
def test_symbolic_rows_match_float64(batch, seq):
    """One kernel for every M: the TMA descriptors' row count and the grid come from the
    call's shape (M = 16 is below one 128-row tile, 150 is ragged)."""
    made = hg.hopper_func(symbolic_gemm(1024, 1024), symbolic=True,
                          dims={"batch": 8, "seq": 128})
    assert _symbolic_rel(made, batch, seq, 1024, 1024, seed=7) < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("batch,seq", [(1, 16), (3, 50), (32, 128)])
def test_symbolic_rows_persistent_match_float64(batch, seq):
    """A persistent kernel over symbolic rows: its grid is min(tiles, SMs) of the call's M."""
    made = hg.hopper_func(symbolic_gemm(1024, 1024), symbolic=True, persistent=True, sms=11,
                          dims={"batch": 8, "seq": 128})
    assert _symbolic_rel(made, batch, seq, 1024, 1024, seed=10) < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
def test_gelu_tanh_epilogue_matches_float64():
    """Half of GELU's inputs are negative: with ``__powf`` they were NaN."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((256, 512)).astype("float16")
    b = (rng.standard_normal((256, 512)) / np.sqrt(512)).astype("float16")
    x = a.astype("float64") @ b.astype("float64").T
    ref = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    out = _run(hopper(gelu_tanh_gemm(256, 256, 512)), [a, b], (256, 256), "float16")
    assert np.isfinite(out).all()
    assert _rel(out, ref) < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
def test_bf16_matches_float64():
    import ml_dtypes  # noqa: PLC0415 - ships with TVM's dependencies

    rng = np.random.default_rng(4)
    a = rng.standard_normal((256, 512)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((256, 512)).astype(ml_dtypes.bfloat16)
    bias = rng.standard_normal(256).astype("float32")
    ref = a.astype("float64") @ b.astype("float64").T + bias
    out = _run(hopper(gemm(256, 256, 512, dtype="bfloat16", bias=True)), [a, b, bias],
               (256, 256), "bfloat16")
    assert _rel(out, ref) < 1e-2


def test_on_by_default_for_sm90_only():
    """cuda.hopper_gemm is on by default: sm_90 builds compile for sm_90a and take the Hopper
    GEMMs; switched off they stay sm_90; other archs are left alone either way."""
    from amp_cli.compile import compile_target
    from amp_cli.config import CudaConfig
    from amp_cli.target import resolve_target

    target = resolve_target("cuda:sm_90")
    assert CudaConfig().hopper_gemm is True
    assert str(compile_target(target).attrs["arch"]) == "sm_90a"
    assert hg.enabled_for(compile_target(target))
    off = compile_target(target, CudaConfig(hopper_gemm=False))
    assert str(off.attrs["arch"]) == "sm_90"
    assert not hg.enabled_for(off)
    ampere = compile_target(resolve_target("cuda:sm_80"))
    assert str(ampere.attrs["arch"]) == "sm_80"
    assert not hg.enabled_for(ampere)


@pytest.mark.parametrize("func", [
    lambda: epilogue_gemm(128, 4096, 1024, batch=8, out_dtype="float16"),  # FFN-up + a tail
    lambda: epilogue_gemm(128, 1024, 4096, batch=8),                       # FFN-down
])
def test_no_register_spills(func, tmp_path):
    """wgmma's accumulators must stay in registers; ptxas on the generated CUDA reports no spills
    (128x256 tiles with a GELU tail spilled 308 bytes, which is why they are not offered)."""
    import subprocess

    from amp_cli.target import find_nvcc

    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc")
    cu = tmp_path / "k.cu"
    cu.write_text(tvm_compat.cuda_source(build(hopper(func()), "sm_90a")))
    res = subprocess.run([nvcc, "-arch=sm_90a", "-cubin", "-o", str(tmp_path / "k.cubin"),
                          str(cu), "--resource-usage"], capture_output=True, text=True,
                         check=True)
    report = res.stdout + res.stderr
    assert "0 bytes spill stores" in report and "bytes spill stores" in report, report
    assert report.count("spill stores") == report.count("0 bytes spill stores"), report

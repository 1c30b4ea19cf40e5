"""amp's pipelined tensor-core GEMM schedule (schedule/tc_gemm.py) and the access-pointer fix it
needs (legalize/access_ptr.py): CUDA builds checked here without a GPU, numerics on the GPU."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.tir import cuda_tir_pipeline  # noqa: E402
from amp_cli.backends.cuda.kernels import tc_gemm  # noqa: E402
from amp_cli.hardware import smem_limit  # noqa: E402
from amp_cli.backends.cuda.rules.matmul import AmpMatmul
from amp_cli.backends.cuda.kernels.analysis import gemm_shape  # noqa: E402


def gemm(m, n, k, dtype="float16", acc="float32", bias=False, relu=False, batch=None,
         b_layout="NK"):
    """D = cast(A @ B^T [+ bias] [relu]) as a TE PrimFunc (the shape amp's conv-GEMMs have).
    b_layout "KN": B is stored [K, N] (an ONNX MatMul weight), D = A @ B."""
    from tvm import te

    lead = (batch,) if batch else ()
    a = te.placeholder(lead + (m, k), dtype, name="A")
    b = te.placeholder((n, k) if b_layout == "NK" else (k, n), dtype, name="B")
    r = te.reduce_axis((0, k), name="k")

    def b_at(j, kk):
        return b[j, kk] if b_layout == "NK" else b[kk, j]

    c = te.compute(lead + (m, n), lambda *ix: te.sum(
        a[ix[:-1] + (r,)].astype(acc) * b_at(ix[-1], r).astype(acc), axis=r), name="C")
    args = [a, b]
    out = c
    if bias:
        bv = te.placeholder((n,), acc, name="bias")
        args.append(bv)
        out = te.compute(out.shape, lambda *ix: out(*ix) + bv[ix[-1]], name="biased")
    if relu:
        out = te.compute(out.shape, lambda *ix: te.max(out(*ix), tvm.tirx.const(0, acc)),
                         name="relu")
    d = te.compute(out.shape, lambda *ix: out(*ix).astype(dtype), name="D")
    return te.create_prim_func(args + [d]).with_attr("global_symbol", "main")


def build(sch_func, arch, records=None, **pipeline):
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    records = [] if records is None else records
    return tvm.compile(tvm.IRModule({"main": sch_func}), target=target,
                       tir_pipeline=cuda_tir_pipeline(target, records, **pipeline))


def own(func, arch="sm_90", cfg=None):
    in_dtype, out_dtype, batch, sizes = gemm_shape(func)
    sm = int(arch.split("_")[1])
    acc = "float16" if out_dtype == "float16" else "float32"
    sch = tc_gemm.schedule_gemm(func, in_dtype, acc, batch, sizes, sm, cfg)
    return None if sch is None else sch.mod["main"]


# ------------------------------------------------------------------ CUDA builds (CI, no GPU)
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("cfg", tc_gemm.CANDIDATES + tc_gemm.NARROW, ids=lambda c: c.name())
def test_every_candidate_builds_with_cp_async_and_wmma(arch, cfg):
    src = tvm_compat.cuda_source(build(own(gemm(256, 256, 256), arch, cfg), arch))
    assert "cp.async" in src and "mma_sync" in src


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_odd_sizes_and_fused_epilogue_build(dtype):
    # M, N not multiples of any tile, K a multiple of 8 but not of the tile: padded, predicated
    func = gemm(200, 100, 72, dtype=dtype, bias=True, relu=True)
    sch = own(func)
    assert sch is not None
    src = tvm_compat.cuda_source(build(sch, "sm_90"))
    assert "mma_sync" in src and "cp.async" in src
    assert "max(" in src  # relu fused into the store, not a separate kernel


def test_fp16_accumulation_builds():
    src = tvm_compat.cuda_source(build(own(gemm(128, 128, 128, acc="float16")), "sm_90"))
    assert "mma_sync" in src and "wmma::accumulator, 16, 16, 16, half" in src


def test_misaligned_k_is_declined_and_amp_matmul_still_uses_tensor_cores():
    func = gemm(256, 64, 147)  # ResNet's stem conv as a GEMM: K = 7*7*3 rows are not 4-byte aligned
    assert own(func) is None
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with target:
        sch = AmpMatmul().apply(func, target, False)
    src = tvm_compat.cuda_source(build(sch.mod["main"], "sm_90"))
    assert "mma_sync" in src and "cp.async" not in src  # dlight's MatmulTensorization


def test_k_strided_operand_is_declined():
    """B stored [K, N]: its tile copy along K would be a strided vector. amp's schedule declines
    (AmpMatmul then uses dlight's rule; matmul_nt makes such weights NT before it gets here)."""
    assert own(gemm(256, 256, 256, b_layout="KN")) is None
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with target:
        sch = AmpMatmul().apply(gemm(256, 256, 256, b_layout="KN"), target, False)
    assert "mma_sync" in tvm_compat.cuda_source(build(sch.mod["main"], "sm_90"))


def _strided_b_schedule():
    in_dtype, _, batch, sizes = gemm_shape(gemm(256, 256, 256, b_layout="KN"))
    sch = tc_gemm.schedule(gemm(256, 256, 256, b_layout="KN"), "float16", "float32", sizes, 90,
                           require_contiguous=False)
    return sch.mod["main"]


def test_guard_keeps_strided_copies_out_of_cp_async():
    """TVM 0.27's InjectPTXAsyncCopy turns a strided vector copy into one cp.async from the
    ramp's base (wrong data; cudaErrorMisalignedAddress on the H200). Forced into amp's schedule,
    such a copy of B reaches cp.async without amp's guard and stays a plain copy with it, while
    A's contiguous copy keeps its cp.async; the guard's record (what the convert report lists)
    names the kernel."""
    func = _strided_b_schedule()

    def async_copies(src, operand):
        return sum(1 for line in src.splitlines()
                   if "ptx_cp_async_" in line and f"{operand}_ptr" in line)

    stock_records, records = [], []
    stock = tvm_compat.cuda_source(build(func, "sm_90", stock_records, async_guard=False))
    guarded = tvm_compat.cuda_source(build(func, "sm_90", records))
    assert async_copies(stock, "B") > 0 and async_copies(stock, "A") > 0
    assert async_copies(guarded, "B") == 0 and async_copies(guarded, "A") > 0
    guard = [r for r in records if "InjectPTXAsyncCopy" in r.stage]
    assert len(guard) == 1 and "strided" in guard[0].rewrites[0], [r.to_dict() for r in records]
    assert not any("InjectPTXAsyncCopy" in r.stage for r in stock_records)


def test_contiguous_vec_reads_the_copy_blocks():
    from tvm.s_tir.dlight.analysis import get_root_block

    def copy_vec(func, b_index):
        sch = tvm.s_tir.Schedule(func)
        blk = sch.get_child_blocks(get_root_block(sch))[0]
        cached = sch.cache_read(blk, b_index, "shared.dyn")
        return tc_gemm.contiguous_vec(sch.get(cached), 8)

    assert copy_vec(gemm(64, 64, 64), 0) == 8           # A[M, K]
    assert copy_vec(gemm(64, 64, 64), 1) == 8           # B[N, K]
    assert copy_vec(gemm(64, 64, 36), 1) == 4           # rows of 36 halves: 8-byte aligned
    assert copy_vec(gemm(64, 64, 64, b_layout="KN"), 1) == 8  # cached as [K, N]: N innermost


def test_contiguous_vec_of_gathers_and_predicates():
    """A gather moving with the lane inside one row segment (an implicit GEMM's x[.., k % C]) is
    still one vector; a predicate that changes within a vector (k < 5) forces scalar copies."""
    from tvm import te, tirx
    from tvm.s_tir.dlight.analysis import get_root_block

    def vec(compute):
        a = te.placeholder((16, 64), "float16", name="A")
        func = te.create_prim_func([a, te.compute((16, 64), lambda i, k: compute(a, i, k))])
        sch = tvm.s_tir.Schedule(func)
        return tc_gemm.contiguous_vec(sch.get(sch.get_child_blocks(get_root_block(sch))[0]), 8)

    zero = tirx.const(0, "float16")
    assert vec(lambda a, i, k: a[i, k]) == 8
    assert vec(lambda a, i, k: a[(i + k // 16) % 16, k % 16]) == 8   # taps of 16 channels
    assert vec(lambda a, i, k: a[(i + k // 4) % 16, k % 4]) == 4     # taps of 4 channels
    assert vec(lambda a, i, k: tirx.if_then_else(i > 3, a[i, k], zero)) == 8  # row predicate
    assert vec(lambda a, i, k: tirx.if_then_else(k < 5, a[i, k], zero)) == 1  # lane predicate


@pytest.mark.parametrize("channels,copy", [(64, "legacy_pred_cg_16"), (4, "legacy_pred_ca_8")])
def test_implicit_conv_gemm_loads_with_predicated_cp_async(channels, copy):
    """A padded 3x3 conv as an implicit GEMM: the image loads become predicated cp.async copies
    of 16 bytes (C=64) or 8 bytes (C=4: a 16-byte vector would span two filter taps)."""
    import re

    from tvm import te, tirx

    from amp_cli.backends.cuda.rewrites.conv_gemm import implicit_gemm_te

    x = te.placeholder((2, 10, 10, channels), "float16", name="x")
    w = te.placeholder((64, 9 * channels), "float16", name="w")
    y = implicit_gemm_te(te, tirx, x, w, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), (10, 10), "float32")
    func = te.create_prim_func([x, w, y])
    _, _, batch, sizes = gemm_shape(func)
    sch = tc_gemm.schedule_gemm(func, "float16", "float32", batch, sizes, 90)
    assert sch is not None
    src = tvm_compat.cuda_source(build(sch.mod["main"], "sm_90"))
    copies = set(re.findall(r"ptx_cp_async_(legacy\w*?_\d+)_", src))
    assert any(c.startswith(copy) for c in copies), copies
    assert "mma_sync" in src


def test_load_vector_width_follows_k_alignment():
    assert tc_gemm._widest(1024, 8) == 8
    assert tc_gemm._widest(36, 8) == 4
    assert tc_gemm._widest(18, 8) == 2
    assert tc_gemm._widest(147, 8) == 1


def test_choose_config_respects_shared_memory_per_arch():
    for sm in (80, 86, 89, 90):
        cfg = tc_gemm.choose_config(1, 4096, 4096, 4096, sm)
        assert cfg.shared_bytes() <= smem_limit(sm)
    big = tc_gemm.CANDIDATES[0]
    assert big.shared_bytes() > smem_limit(86)  # so sm_86 must pick something smaller
    assert tc_gemm.choose_config(1, 4096, 4096, 4096, 86) != big
    assert tc_gemm.choose_config(1, 1024, 1024, 1024, 75) is None  # 64 KiB: nothing fits


@pytest.mark.parametrize("shape,tile", [
    ((1, 1024, 1024, 1024), "128x64x64_w2x2_s3"),    # BERT out-projection: BK=64 (sweep)
    ((2, 1024, 1024, 2048), "128x128x64_w2x2_s3"),   # FFN-down split-K partials: BK=64
    ((1, 1024, 3072, 1024), "128x128x32_w2x2_s4"),   # QKV: BK=32 measured faster at K=1024
    ((1, 1024, 4096, 1024), "128x128x32_w2x2_s4"),
    ((1, 6272, 128, 512), "64x64x64_w2x2_s3"),       # short-K ResNet GEMMs unchanged
])
def test_choose_config_deepens_k_step_where_the_sweep_measured_it(shape, tile):
    assert tc_gemm.choose_config(*shape, 90).name() == tile


@pytest.mark.parametrize("batch,m,n,before,after", [
    (32, 49, 512, "128x128", "64x128"),   # a 7x7 image's rows per batch entry: 38 % -> 77 %
    (1, 25088, 64, "128x128", "128x64"),  # N = 64: half of a 128-wide tile was padding
    (1, 25088, 192, "128x128", "128x64"),  # 256 columns for 192
])
def test_padding_aware_choice_skips_tiles_that_mostly_pad(batch, m, n, before, after):
    """cuda.padding_aware_tiles: no tile whose grid covers over PAD_SLACK times the output the
    least-padded candidate covers; off (the default), the choice is the calibrated one."""
    def tile(cfg):
        return f"{cfg.bm}x{cfg.bn}"

    assert tile(tc_gemm.choose_config(batch, m, n, 576, 90)) == before
    cfg = tc_gemm.choose_config(batch, m, n, 576, 90, pad_slack=tc_gemm.PAD_SLACK)
    assert tile(cfg) == after
    least = min(tc_gemm.padded(c, m, n) for c in tc_gemm.fitting(90))
    assert tc_gemm.padded(cfg, m, n) <= tc_gemm.PAD_SLACK * least


def test_padding_aware_choice_leaves_unpadded_shapes_alone():
    """BERT-large's and the swept ResNet-50 GEMMs pad no tile much: the same tiles either way."""
    for shape in [(1, 1024, 1024, 1024), (1, 1024, 4096, 1024), (1, 1024, 3072, 1024),
                  (2, 1024, 1024, 2048), (1, 25088, 256, 64), (1, 1568, 512, 4608),
                  (1, 6272, 128, 512), (8, 3136, 256, 64)]:
        assert tc_gemm.choose_config(*shape, 90) == \
            tc_gemm.choose_config(*shape, 90, pad_slack=tc_gemm.PAD_SLACK), shape


def test_padding_aware_variants_over_a_symbolic_m_judge_columns_only():
    """Over a symbolic M the rows' padding changes every few rows; weighing it would switch
    tiles back and forth (a kernel each): the variants weigh the columns alone, and are the
    static choice (columns alone) at every size; over a symbolic batch of 49-row images they
    are the static choice with the rows weighed."""
    slack = tc_gemm.PAD_SLACK
    plain = tc_gemm.tile_variants(lambda v: (1, v), 16, 4096, 1024, 72, 90)
    aware = tc_gemm.tile_variants(lambda v: (1, v), 16, 4096, 1024, 72, 90, pad_slack=slack)
    assert aware == plain  # N = 1024: nothing pads columns
    narrow = tc_gemm.tile_variants(lambda v: (1, v), 16, 4096, 64, 72, 90, pad_slack=slack)
    assert len(narrow) <= len(tc_gemm.tile_variants(lambda v: (1, v), 16, 4096, 64, 72, 90))
    assert all(cfg.bn == 64 for _, cfg in narrow)
    batched = tc_gemm.tile_variants(lambda v: (v, 49), 1, 32, 512, 4608, 90, pad_slack=slack)
    starts = [v for v, _ in batched]
    for v in range(1, 33):
        picked = batched[max(i for i, s in enumerate(starts) if s <= v)][1]
        assert picked == tc_gemm.choose_config(v, 49, 512, 4608, 90, pad_slack=slack), v
        assert picked.bm == 64


@pytest.mark.parametrize("m,n,k", [(1024, 1024, 1024), (256, 256, 256)])
def test_staging_tile_rows_are_padded(m, n, k):
    """wmma's accumulator stores go to the shared fp32 tile with a row stride of BN + ACC_PAD
    floats (unpadded, BN % 32 == 0 puts a warp's stores on 4x the banks)."""
    import re

    cfg = tc_gemm.choose_config(1, m, n, k, 90)
    src = tvm_compat.cuda_source(build(own(gemm(m, n, k)), "sm_90"))
    strides = set(re.findall(r"store_matrix_sync\(.*?, (\d+), nvcuda::wmma::mem_row_major", src))
    assert strides == {str(cfg.bn + tc_gemm.ACC_PAD)}


@pytest.mark.parametrize("n", [16, 24, 32])
def test_narrow_gemms_take_tensor_cores_with_the_switch(n):
    """cuda.narrow_gemm: a GEMM with N <= 32 (a 16-channel conv over 8 x 160 x 160 pixels)
    gets a tc_gemm tile as narrow as N; off (the default), N < 32 stays on dlight's SIMT rule
    and N = 32 on the wide tiles."""
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    func = gemm(4096, n, 144, bias=True, relu=True)
    assert tc_gemm.choose_config(1, 4096, n, 144, 90, narrow=True).bn == (16 if n == 16 else 32)
    assert tc_gemm.choose_config(1, 4096, n, 144, 90).bn >= 64
    with target:
        on = AmpMatmul(narrow=True).apply(func, target, False)
        off = AmpMatmul().apply(func, target, False)
    on_src = tvm_compat.cuda_source(build(on.mod["main"], "sm_90"))
    off_src = tvm_compat.cuda_source(build(off.mod["main"], "sm_90"))
    assert "wmma::mma_sync" in on_src and "cp.async" in on_src
    assert ("wmma::mma_sync" in off_src) == (n == 32)


def test_amp_matmul_uses_own_schedule_for_static_gemms():
    func = gemm(512, 512, 512)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with target:
        sch = AmpMatmul().apply(func, target, False)
        stock = AmpMatmul(own_gemm=False).apply(func, target, False)
    own_src = tvm_compat.cuda_source(build(sch.mod["main"], "sm_90"))
    stock_src = tvm_compat.cuda_source(build(stock.mod["main"], "sm_90"))
    assert "cp.async" in own_src and "cp.async" not in stock_src


def test_access_ptr_fix_is_what_makes_the_small_tile_build():
    """TVM 0.27's StorageRewrite points the fp32 accumulator tile's access pointers at reused fp16
    storage; LowerIntrin then rejects them. Without amp's pass the build fails with TVM's error."""
    cfg = tc_gemm.TileConfig(2, 2, 2, 2, 4, 3)  # 64x64x64: the tile whose storage gets reused
    func = own(gemm(256, 256, 256), "sm_90", cfg)
    with pytest.raises(Exception, match="tvm_access_ptr element type must match"):
        build(func, "sm_90", typed_access_ptr=False)
    assert "mma_sync" in tvm_compat.cuda_source(build(func, "sm_90"))


# ------------------------------------------------------------------ numerics (GPU)
def _run(func, arrays, out_shape, out_dtype):
    dev = tvm.cuda(0)
    ex = build(func, "sm_" + tvm_compat.cuda_compute_version().replace(".", ""))
    args = [tvm.runtime.tensor(a, dev) for a in arrays]
    out = tvm.runtime.empty(out_shape, out_dtype, dev)
    ex(*args, out)
    return out.numpy()


def _bias_relu_rel_l2(cfg, m, n, k, seed):
    """rel L2 of relu(A @ B^T + bias) on ``cfg``'s tile (fp16 in/out, random normal inputs)
    against numpy fp32."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype("float16")
    b = rng.standard_normal((n, k)).astype("float16")
    bias = rng.standard_normal(n).astype("float32")
    ref = np.maximum(a.astype("float32") @ b.astype("float32").T + bias, 0)
    sm = int(tvm_compat.cuda_compute_version().replace(".", ""))
    out = _run(own(gemm(m, n, k, bias=True, relu=True), f"sm_{sm}", cfg), [a, b, bias],
               (m, n), "float16").astype("float32")
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA device")
@pytest.mark.parametrize("cfg", tc_gemm.CANDIDATES, ids=lambda c: c.name())
@pytest.mark.parametrize("shape", [(256, 256, 256), (200, 100, 72), (96, 520, 1032)])
def test_candidates_match_fp32_reference(cfg, shape):
    """Every tile on aligned and ragged shapes, bias + relu fused: rel L2 vs numpy fp32 below 2e-3
    (fp16 output rounding alone is ~3e-4; a wrong tile/predicate gives O(1))."""
    assert _bias_relu_rel_l2(cfg, *shape, seed=1) < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA device")
@pytest.mark.parametrize("m,n,k", [(4096, 16, 144), (1000, 32, 288), (300, 24, 72),
                                   (512, 16, 16)])
def test_narrow_tiles_match_fp32_reference(m, n, k):
    """N <= 32 (a detector's 16/32-channel convs as GEMMs) on the narrow tiles, ragged M and N,
    bias + relu fused: rel L2 vs numpy fp32 below 2e-3."""
    cfg = tc_gemm.choose_config(1, m, n, k, 90, narrow=True)
    # a K loop shorter than the pipeline clips its depth (K = 16: one stage); the tile is NARROW's
    assert dataclasses.replace(cfg, stages=3) in tc_gemm.NARROW and cfg.bn >= n
    assert _bias_relu_rel_l2(cfg, m, n, k, seed=4) < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA device")
def test_bf16_and_batched_match_fp32_reference():
    rng = np.random.default_rng(2)
    sm = int(tvm_compat.cuda_compute_version().replace(".", ""))
    # bf16: 8 mantissa bits, rel L2 of the bf16 output rounding ~2e-3; bound 1e-2
    ml_dtypes = pytest.importorskip("ml_dtypes")  # a TVM dependency

    a = rng.standard_normal((192, 256)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((160, 256)).astype(ml_dtypes.bfloat16)
    ref = a.astype("float32") @ b.astype("float32").T
    out = _run(own(gemm(192, 160, 256, dtype="bfloat16"), f"sm_{sm}"), [a, b], (192, 160),
               "bfloat16").astype("float32")
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
    # batched A (attention-like), fp16
    a = rng.standard_normal((4, 128, 64)).astype("float16")
    b = rng.standard_normal((128, 64)).astype("float16")
    ref = a.astype("float32") @ b.astype("float32").T
    out = _run(own(gemm(128, 128, 64, batch=4), f"sm_{sm}"), [a, b], (4, 128, 128),
               "float16").astype("float32")
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA device")
def test_guarded_strided_copy_matches_fp32_reference():
    """The forced strided-B schedule (see test_guard_keeps_strided_copies_out_of_cp_async) with
    amp's guard runs and is right; without it TVM's cp.async would read the wrong elements."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((256, 256)).astype("float16")
    b = rng.standard_normal((256, 256)).astype("float16")  # [K, N]
    ref = a.astype("float32") @ b.astype("float32")
    out = _run(_strided_b_schedule(), [a, b], (256, 256), "float16").astype("float32")
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2e-3


# ------------------------------------------------------------------ symbolic M (dynamic models)
def _symbolic_m_gemm(n=256, k=128, dtype="float16"):
    """A dynamic model's linear layer after matmul_nt: D[batch, sequence, N] = A[batch,
    sequence, K] @ W[N, K]^T + bias, batch and sequence symbolic."""
    from tvm import te

    bsz, seq = tvm.tirx.Var("batch", "int64"), tvm.tirx.Var("sequence", "int64")
    n, k = (tvm.tirx.const(x, "int64") for x in (n, k))  # Relax's shapes are int64
    a = te.placeholder((bsz, seq, k), dtype, name="A")
    w = te.placeholder((n, k), dtype, name="W")
    bias = te.placeholder((n,), "float32", name="bias")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((bsz, seq, n), lambda b, s, j: te.sum(
        a[b, s, r].astype("float32") * w[j, r].astype("float32"), axis=r), name="C")
    d = te.compute((bsz, seq, n), lambda *ix: (c(*ix) + bias[ix[-1]]).astype(dtype), name="D")
    return te.create_prim_func([a, w, bias, d]).with_attr("global_symbol", "main")


def test_symbolic_m_takes_the_own_schedule_with_the_tile_of_the_optimum():
    """M = batch x sequence symbolic, N and K static: amp's cp.async schedule (M padded at run
    time), the tile chosen for M at the ranges' optima; N or K symbolic: not amp's."""
    func = _symbolic_m_gemm()
    assert gemm_shape(func)[3] == [None, 256, 128]
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with target:
        sch = AmpMatmul(dims={"batch": 32, "sequence": 512}).apply(func, target, False)
    src = tvm_compat.cuda_source(build(sch.mod["main"], "sm_90"))
    assert "cp.async" in src and "mma_sync" in src
    # the tile follows M at the optima: 16384 rows fill the GPU with the largest tile,
    # 8 rows (no bound known: a mid-size guess) do not
    from amp_cli.backends.cuda.rules import matmul as mm

    seen = []
    real = tc_gemm.schedule_gemm

    def spy(func, in_dtype, acc, batch, sizes, sm, cfg=None, rows="same", narrow=True,
            pad_slack=None):
        seen.append((sizes[0], rows))
        return real(func, in_dtype, acc, batch, sizes, sm, cfg, rows, narrow, pad_slack)

    tc_gemm.schedule_gemm, saved = spy, tc_gemm.schedule_gemm
    try:
        info = gemm_shape(func)
        mm._own_schedule(func, "float16", info, 90, {"batch": 32, "sequence": 512})
        mm._own_schedule(func, "float16", info, 90, {})
    finally:
        tc_gemm.schedule_gemm = saved
    assert seen == [(32 * 512, None), (mm.SYMBOLIC_M_GUESS, None)]


def test_symbolic_m_gemm_compiles_with_nvrtc_and_nvcc(monkeypatch):
    from fixtures.cuda_compile import compile_like_tvm

    func = _symbolic_m_gemm(n=192, k=72)  # ragged N and K too
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with target:
        sch = AmpMatmul(dims={"batch": 8, "sequence": 128}).apply(func, target, False)
    src = tvm_compat.cuda_source(build(sch.mod["main"], "sm_90"))
    assert "cp.async" in src
    for mode in ("nvrtc", "nvcc"):
        assert len(compile_like_tvm(src, mode, "sm_90", monkeypatch)) > 1000


@pytest.mark.parametrize("n,k,batch", [(192, 72, 1), (1024, 4096, 1), (4096, 1024, 1),
                                       (64, 576, "symbolic")])
def test_tile_variants_are_the_static_choice_at_every_size(n, k, batch):
    """Over a symbolic size's whole range the variants give, at every value, the tile a static
    build of that size would choose (checked exhaustively); a symbolic batch too (a conv over
    a dynamic batch: 3136 rows per image)."""
    def sizes_at(v):
        return (v, 3136) if batch == "symbolic" else (batch, v)

    lo, hi = (1, 64) if batch == "symbolic" else (16, 9000)
    variants = tc_gemm.tile_variants(sizes_at, lo, hi, n, k, 90)
    assert variants[0][0] == lo and len(variants) >= 2
    starts = [v for v, _ in variants]
    for v in range(lo, hi + 1):
        picked = variants[max(i for i, s in enumerate(starts) if s <= v)][1]
        assert picked == tc_gemm.choose_config(*sizes_at(v), n, k, 90), v


def test_symbolic_m_gemm_branches_between_tile_variants(monkeypatch):
    """With the ranges known, a symbolic-M GEMM is one PrimFunc whose host code picks one of
    the variant kernels by M; every kernel is a cp.async wmma kernel and the source compiles."""
    from fixtures.cuda_compile import compile_like_tvm

    func = _symbolic_m_gemm(n=1024, k=72)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    ranges = {"batch": (1, 32), "sequence": (16, 512)}
    with target:
        sch = AmpMatmul(dims={"batch": 8, "sequence": 128}, ranges=ranges).apply(func, target,
                                                                                 False)
    variants = tc_gemm.tile_variants(lambda v: (1, v), 16, 32 * 512, 1024, 72, 90)
    assert len(variants) >= 3
    assert sch.mod["main"].script().count("tvm_thread_invariant") == len(variants) - 1
    src = tvm_compat.cuda_source(build(sch.mod["main"], "sm_90"))
    bodies = [c for c in src.split("__global__")[1:] if "{" in c.split(";", 1)[0]]
    assert len(bodies) == len(variants)
    assert all("mma_sync" in b and "cp_async" in b for b in bodies)
    for mode in ("nvrtc", "nvcc"):
        assert len(compile_like_tvm(src, mode, "sm_90", monkeypatch)) > 1000


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA device")
def test_tile_variants_match_fp32_reference_on_both_sides_of_each_step():
    """The dispatched symbolic-M GEMM at M on both sides of every variant boundary (and ragged
    sizes): rel L2 vs numpy fp32 below 2e-3."""
    sm = int(tvm_compat.cuda_compute_version().replace(".", ""))
    target = tvm.target.Target({"kind": "cuda", "arch": f"sm_{sm}"})
    func = _symbolic_m_gemm(n=1024, k=72)
    ranges = {"batch": (1, 32), "sequence": (16, 512)}
    with target:
        sch = AmpMatmul(dims={"batch": 8, "sequence": 128}, ranges=ranges).apply(func, target,
                                                                                 False)
    variants = tc_gemm.tile_variants(lambda v: (1, v), 16, 32 * 512, 1024, 72, sm)
    ms = sorted({16, 77} | {s + d for s, _ in variants[1:] for d in (-1, 0, 5)})
    dev = tvm.cuda(0)
    ex = build(sch.mod["main"], f"sm_{sm}")
    rng = np.random.default_rng(6)
    w = rng.standard_normal((1024, 72)).astype("float16")
    bias = rng.standard_normal(1024).astype("float32")
    for m in ms:
        a = rng.standard_normal((1, m, 72)).astype("float16")
        ref = a.astype("float32") @ w.astype("float32").T + bias
        out = tvm.runtime.empty((1, m, 1024), "float16", dev)
        ex(*(tvm.runtime.tensor(x, dev) for x in (a, w, bias)), out)
        got = out.numpy().astype("float32")
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-3, m


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA device")
@pytest.mark.parametrize("dims", [{"batch": 8, "sequence": 128}, {}])
def test_symbolic_m_gemm_matches_fp32_reference_at_every_m(dims):
    """One compiled symbolic-M kernel at M from 1 row to several tiles, ragged ones included:
    rel L2 vs numpy fp32 below 2e-3 (a wrong pad or predicate gives O(1) or garbage rows)."""
    sm = int(tvm_compat.cuda_compute_version().replace(".", ""))
    target = tvm.target.Target({"kind": "cuda", "arch": f"sm_{sm}"})
    func = _symbolic_m_gemm(n=192, k=72)
    with target:
        sch = AmpMatmul(dims=dims).apply(func, target, False)
    dev = tvm.cuda(0)
    ex = build(sch.mod["main"], f"sm_{sm}")
    rng = np.random.default_rng(4)
    w = rng.standard_normal((192, 72)).astype("float16")
    bias = rng.standard_normal(192).astype("float32")
    for b, s in [(1, 1), (1, 16), (3, 77), (8, 128), (5, 333)]:
        a = rng.standard_normal((b, s, 72)).astype("float16")
        ref = a.astype("float32") @ w.astype("float32").T + bias
        out = tvm.runtime.empty((b, s, 192), "float16", dev)
        ex(*(tvm.runtime.tensor(x, dev) for x in (a, w, bias)), out)
        got = out.numpy().astype("float32")
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-3, (b, s)

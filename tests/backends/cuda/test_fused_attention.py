"""Fused attention (amp_cli.backends.cuda.rewrites.fused_attention + attention_kernel): which attention cores
are fused and how their operands are addressed (CI), that the kernel compiles to tensor-core
code for sm_80/sm_90 with the softmax free of barriers (CI, nvcc), and its values against a
float64 reference on the GPU (gpu-marked) for several shapes and operand layouts."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from amp_cli import tvm_compat  # noqa: E402
from fixtures.cuda_compile import compile_like_tvm  # noqa: E402
from amp_cli.backends.cuda.kernels import attention as ak  # noqa: E402
from amp_cli.backends.cuda.kernels import flash_attention as fk  # noqa: E402
from amp_cli.backends.cuda.kernels import mma_attention as mk  # noqa: E402
from amp_cli.backends.cuda.rewrites.fused_attention import KERNELS, fuse_attention, \
    plan  # noqa: E402
from amp_cli.backends.cuda.rewrites.base import calls, op_name  # noqa: E402

relax = tvm.relax


def _attention_module(b=2, h=2, s=64, d=64, scale=0.125, mask=None, kt_input=False,
                      split_scale=False, dynamo_kt=False, f16="float16", nan_guard=False):
    """The attention core as the ONNX importer + fp16 conversion write it: head-split transposes
    of [B, S, H, D] inputs, fp32 scores cast to fp16, scaled, softmax in fp32, PV in fp32 and
    the output transposed back. ``mask``: the shape (and dtype, default fp16) of an additive
    mask added before the softmax, a function input; ``kt_input``: K^T is a function input
    (materialized, D not innermost: not fused); ``split_scale``: sqrt(scale) multiplies Q and
    K^T instead of the scores (HF / SDPA exports); ``dynamo_kt``: K^T as the dynamo exporter
    writes it (reshape to [B*H, S, D], transpose, reshape to [B, H, D, S]). ``f16``: the
    low-precision type (the bf16 conversion writes the same graph in bfloat16); ``nan_guard``:
    ``where(isnan(P), 0, P)`` after the softmax (torch's SDPA export)."""
    q = relax.Var("q", relax.TensorType((b, s, h, d), f16))
    k = relax.Var("k", relax.TensorType((b, h, d, s) if kt_input else (b, s, h, d), f16))
    v = relax.Var("v", relax.TensorType((b, s, h, d), f16))
    params = [q, k, v]
    if mask is not None:
        shape, dtype = mask if isinstance(mask[-1], str) and len(mask) == 2 else (mask, f16)
        m = relax.Var("m", relax.TensorType(tuple(shape), dtype))
        params.append(m)
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            qt = bb.emit(relax.op.permute_dims(q, [0, 2, 1, 3]))
            if kt_input:
                kt = k
            elif dynamo_kt:
                kh = bb.emit(relax.op.permute_dims(k, [0, 2, 1, 3]))
                kh = bb.emit(relax.op.reshape(kh, (b * h, s, d)))
                kh = bb.emit(relax.op.permute_dims(kh, [0, 2, 1]))
                kt = bb.emit(relax.op.reshape(kh, (b, h, d, s)))
            else:
                kt = bb.emit(relax.op.permute_dims(k, [0, 2, 3, 1]))
            vt = bb.emit(relax.op.permute_dims(v, [0, 2, 1, 3]))
            if split_scale:
                root = relax.const(float(np.sqrt(scale)), f16)
                qt = bb.emit(relax.op.multiply(qt, root))
                kt = bb.emit(relax.op.multiply(kt, root))
            sc = bb.emit(relax.op.astype(relax.op.matmul(qt, kt, out_dtype="float32"), f16))
            if not split_scale:
                sc = bb.emit(relax.op.multiply(sc, relax.const(scale, f16)))
            if mask is not None:
                sc = bb.emit(relax.op.add(sc, m if m.ty.dtype == f16 else
                                          relax.op.astype(m, f16)))
            p = bb.emit(relax.op.nn.softmax(relax.op.astype(sc, "float32"), axis=-1))
            if nan_guard:
                p = bb.emit(relax.op.where(relax.op.isnan(p), relax.const(0.0, "float32"), p))
            o = bb.emit(relax.op.matmul(relax.op.astype(p, f16), vt, out_dtype="float32"))
            o = bb.emit(relax.op.permute_dims(relax.op.astype(o, f16), [0, 2, 1, 3]))
            gv = bb.emit_output(relax.op.reshape(o, (b, s, h * d)))
        bb.emit_func_output(gv)
    return bb.get()


def _kernel(kernel: str, *args):
    """The row kernel, the tiled (wmma online-softmax) one or the mma.sync one, same
    arguments."""
    return KERNELS[kernel](*args)


def _ops(mod) -> list[str]:
    return [name for name in map(op_name, calls(mod)) if name]


def test_attention_core_becomes_one_call_reading_the_untransposed_inputs():
    new, fused, declined = fuse_attention(_attention_module(), 90)
    assert (fused, declined) == (1, {})
    ops = _ops(new)
    # one kernel call; no transposes left (inputs read in place, output written [B, S, H, D])
    assert ops.count("relax.call_tir") == 1
    assert "relax.permute_dims" not in ops and "relax.nn.softmax" not in ops
    call = [e for e in [new["main"].body.blocks[0].bindings[0].value]][0]
    assert [list(a.ty.shape.values) for a in call.args[1].fields] == [[2, 64, 2, 64]] * 3
    assert [int(x) for x in call.ty.shape.values] == [2, 64, 2, 64]


def test_the_encoder_layer_fixture_is_fused(fp16_encoder_layer):
    from amp_cli.backends.cuda.rewrites.combine_gemm import combine_parallel_gemms
    from amp_cli.backends.cuda.rewrites.reshape_sink import sink_reshapes

    new, fused, declined = fuse_attention(fp16_encoder_layer, 90)
    assert (fused, declined) == (1, {})
    assert "relax.nn.softmax" not in _ops(new)
    # after reshape_sink and combine_gemm (Q/K/V one GEMM, biases added in its epilogue), as in
    # amp's CUDA pipeline, the kernel reads Q, K and V in place from the GEMM's [2, 64, 384]
    # output: no slice, transpose or copy left
    mod = combine_parallel_gemms(sink_reshapes(fp16_encoder_layer)[0])[0]
    new, fused, _ = fuse_attention(mod, 90)
    ops = _ops(new)
    assert fused == 1 and "relax.strided_slice" not in ops and "relax.permute_dims" not in ops
    kernel = [c for c in calls(new) if op_name(c) == "relax.call_tir"]
    assert [[int(x) for x in a.ty.shape.values] for a in kernel[0].args[1].fields] == [
        [2, 64, 384]] * 3


def _kernel_call(mod):
    return [c for c in calls(mod) if op_name(c) == "relax.call_tir"]


@pytest.mark.parametrize("mask,strides", [
    (((2, 1, 1, 64), "float32"), (64, 0, 0, 1)),   # padding mask, fp32 (HF BERT)
    ((64, 64), (0, 0, 64, 1)),                      # causal [S, S] (GPT-2, legacy exporter)
    ((1, 1, 64, 64), (0, 0, 64, 1)),                # causal [1, 1, S, S] (dynamo exporter)
    ((2, 2, 64, 64), (8192, 4096, 64, 1)),          # a full per-head bias
])
def test_masked_attention_is_fused_reading_the_mask_through_strides(mask, strides):
    new, fused, declined = fuse_attention(_attention_module(mask=mask), 90)
    assert (fused, declined) == (1, {})
    ops = _ops(new)
    assert "relax.nn.softmax" not in ops and "relax.permute_dims" not in ops
    call = _kernel_call(new)[0]
    args = list(call.args[1].fields)
    # the mask parameter itself (an fp32 mask read as fp32: its cast is gone too)
    assert len(args) == 4 and args[3].same_as(new["main"].params[3])
    shape, dtype = mask if isinstance(mask[-1], str) else (mask, "float16")
    assert ak.broadcast_mask(shape, dtype, (2, 2, 64, 64)).strides == strides
    func = new[call.args[0]]
    assert func.attrs["amp.kernel"] == "masked_mma_attention"
    made = [k for k in new.functions if k.name_hint.startswith("amp_attention")]
    assert len(made) == 1
    assert len(func.params) == 5


def test_the_nan_guard_of_sdpa_exports_is_kept_inside_the_kernel(monkeypatch):
    """where(isnan(P), 0, P): fused, and the kernel writes 0 for a row masked everywhere."""
    made = []
    real = mk.mma_attention_func
    monkeypatch.setitem(KERNELS, "mma", lambda *a: made.append(a[11]) or real(*a))
    new, fused, declined = fuse_attention(
        _attention_module(mask=(2, 1, 1, 64), nan_guard=True), 90)
    assert (fused, declined) == (1, {})
    assert not {"relax.where", "relax.isnan", "relax.nn.softmax"} & set(_ops(new))
    assert made and all(made)          # nan_to_zero on
    script = new[_kernel_call(new)[0].args[0]].script()
    assert "T.isnan" in script
    made.clear()
    fuse_attention(_attention_module(mask=(2, 1, 1, 64)), 90)
    assert made and not any(made)      # no guard in the graph: softmax's NaN kept


def test_bf16_attention_is_fused_with_a_bf16_kernel():
    for mask in (None, (2, 1, 1, 64)):
        new, fused, declined = fuse_attention(_attention_module(mask=mask, f16="bfloat16"), 90)
        assert (fused, declined) == (1, {})
        call = _kernel_call(new)[0]
        assert call.ty.dtype == "bfloat16"
        func = new[call.args[0]]
        script = func.script()
        assert '"bfloat16"' in script and '"float16"' not in script


def test_split_scale_and_dynamo_keys_are_read_in_place():
    """sqrt(scale) on Q and on K^T (HF exports) folds into the kernel's scale; the dynamo
    exporter's K^T (reshape / transpose / reshape) is read from the [B, S, H, D] tensor."""
    for kw in ({"split_scale": True}, {"dynamo_kt": True},
               {"split_scale": True, "dynamo_kt": True, "mask": (64, 64)}):
        new, fused, declined = fuse_attention(_attention_module(scale=0.125, **kw), 90)
        assert (fused, declined) == (1, {}), kw
        ops = _ops(new)
        assert "relax.permute_dims" not in ops and "relax.multiply" not in ops, (kw, ops)
        assert "relax.reshape" in ops  # only the merge of the heads after the kernel
        call = _kernel_call(new)[0]
        assert [list(map(int, a.ty.shape.values)) for a in call.args[1].fields][:3] == \
            [[2, 64, 2, 64]] * 3, kw

def test_the_kernel_scale_is_the_product_of_the_factors(monkeypatch):
    made = []
    real = mk.mma_attention_func
    monkeypatch.setitem(KERNELS, "mma", lambda *a: made.append(a[4]) or real(*a))
    fuse_attention(_attention_module(scale=0.125), 90)
    fuse_attention(_attention_module(scale=0.125, split_scale=True), 90)
    root = float(np.float16(np.sqrt(0.125)))  # the fp16 constant the export holds
    # two kernels each: the first form, then the one writing the heads-merged layout
    assert made == [pytest.approx(0.125)] * 2 + [pytest.approx(root * root)] * 2


def test_what_is_not_fused():
    # masks that would broadcast the scores up, not down to them: the kernel cannot read them
    full = (1, 2, 64, 64)
    assert ak.broadcast_mask((2, 2, 64, 64), "float16", full) is None
    assert ak.broadcast_mask((3, 1, 1, 1, 64), "float16", full) is None
    assert ak.broadcast_mask((64,), "float32", full).strides == (0, 0, 0, 1)
    mod = _attention_module(d=40)          # head dim not a multiple of 16: counted, unfused
    new, fused, declined = fuse_attention(mod, 90)
    assert fused == 0 and list(declined) == ["head dim 40 is not a multiple of 16"]
    assert new.same_as(mod)
    _, fused, declined = fuse_attention(_attention_module(kt_input=True), 90)
    assert fused == 0 and "head dim innermost" in list(declined)[0]


def test_sequences_between_blocks_are_padded_inside_the_kernel():
    """S = 48, 197 (ViT-B/16 at 224 px), 77 (CLIP text): fused; the kernel pads to whole
    64-row blocks (zero-filled K/V rows, their scores masked, their output rows not stored)."""
    for s, mask in ((48, None), (197, None), (77, (77, 77))):
        new, fused, declined = fuse_attention(_attention_module(s=s, mask=mask), 90)
        assert (fused, declined) == (1, {}), s
        call = _kernel_call(new)[0]
        assert [int(x) for x in call.ty.shape.values][1] == s
    assert ak.padded_seq(197) == 256 and ak.padded_seq(64) == 64 and ak.padded_seq(1) == 64


def test_shared_memory_bound_and_supported_shapes():
    # the mma.sync kernel for every length (head dims <= 128; its buffers independent of S)
    assert plan(128, 64, 227) == ("mma", None) and plan(1500, 128, 227) == ("mma", None)
    # opt-in: 32 rows a warp where the head dim leaves the registers for it
    assert plan(1500, 64, 227, wide=True) == ("mma_wide", None)
    assert plan(1500, 128, 227, wide=True) == ("mma", None)
    assert plan(1500, 256, 227) == ("tiled", None)
    assert mk.shared_bytes(128) // 1024 == 51 and "exceeds" in mk.supported(64, 24)
    # without it, the row kernel where two CTAs fit an SM: S = 128 at D = 64 (113 KiB) on sm_90
    assert plan(128, 64, 227, mma=False) == ("rows", None)
    assert plan(128, 128, 227, mma=False) == ("tiled", None)
    # an upper bound (TVM overlaps buffers whose lifetimes do not): S = 197 runs as 256, 197
    # KiB, one CTA per SM even on sm_90: the online-softmax kernel (buffers independent of S)
    assert ak.shared_bytes(256, 64) // 1024 == 197
    assert "exceeds the GPU's 163 KiB" in ak.supported(256, 64, 163)
    assert plan(197, 64, 227, mma=False) == ("tiled", None)
    assert plan(256, 64, 163, mma=False) == ("tiled", None)
    assert plan(64, 64, 163, mma=False) == ("rows", None)
    assert plan(128, 64, 163, mma=False) == ("tiled", None)
    assert plan(320, 64, 227, mma=False) == ("tiled", None)
    assert plan(128, 40, 227) == (None, "head dim 40 is not a multiple of 16")
    assert "exceeds the GPU's 48 KiB" in plan(1500, 128, 48, mma=False)[1]
    # through the rewrite, the arch's limit in KiB (it was passed in bytes: S = 256 took the
    # row kernel's 197 KiB on sm_80, whose limit is 163)
    for sm in (80, 90):
        new, fused, _ = fuse_attention(_attention_module(s=256), sm, mma=False)
        assert new[_kernel_call(new)[0].args[0]].attrs["amp.kernel"] == "flash_attention", sm
    new, _, _ = fuse_attention(_attention_module(s=64), 80, mma=False)
    assert new[_kernel_call(new)[0].args[0]].attrs["amp.kernel"] == "attention"
    # cuda.attention_rows off too: the wmma online-softmax kernel for every length
    assert plan(128, 64, 227, rows=False, mma=False) == ("tiled", None)
    new, fused, _ = fuse_attention(_attention_module(s=128), 90, rows=False, mma=False)
    assert fused == 1
    assert new[_kernel_call(new)[0].args[0]].attrs["amp.kernel"] == "flash_attention"
    new, fused, _ = fuse_attention(_attention_module(s=197), 90)
    assert fused == 1
    assert new[_kernel_call(new)[0].args[0]].attrs["amp.kernel"] == "mma_attention"


def test_long_sequences_take_the_online_softmax_kernel():
    """S = 512 (BERT's longest), 1500 (Whisper's encoder): one fused kernel per attention core,
    an online-softmax one (mma.sync; wmma without it), masked or not."""
    for s, mask in ((512, (2, 1, 1, 512)), (1500, None)):
        for mma, name in ((True, "mma_attention"), (False, "flash_attention")):
            new, fused, declined = fuse_attention(_attention_module(s=s, mask=mask), 90, mma=mma)
            assert (fused, declined) == (1, {}), s
            func = new[_kernel_call(new)[0].args[0]]
            assert func.attrs["amp.kernel"] == ("masked_" if mask else "") + name


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("masked,dtype,s,kernel", [
    (False, "float16", 128, "rows"), (True, "float16", 128, "rows"),
    (True, "bfloat16", 128, "rows"), (False, "float16", 197, "rows"),
    (True, "bfloat16", 77, "rows"), (False, "float16", 1500, "tiled"),
    (True, "bfloat16", 300, "tiled")])
def test_kernel_compiles_to_wmma_with_a_barrier_free_softmax(arch, masked, dtype, s, kernel,
                                                              monkeypatch):
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline

    b, h, d = 2, 4, 64
    mask = ak.broadcast_mask((b, 1, 1, s), "float32", (b, h, s, s)) if masked else None
    func = _kernel(kernel, b, h, s, d, 0.125, ak.bshd(b, h, s, d), ak.bshd(b, h, s, d),
                   ak.bshd(b, h, s, d), ak.bshd(b, h, s, d), mask, dtype)
    flash = kernel == "tiled"
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    mod = tvm.IRModule({"attention": func.with_attr("global_symbol", "attention")})
    lib = tvm.compile(mod, target=target, tir_pipeline=cuda_tir_pipeline(target))
    src = lib.mod.imports[0].inspect_source()
    assert src.count("wmma::mma_sync") == 2      # QK^T and PV
    assert ("nv_bfloat16, nvcuda::wmma::row_major" in src) == (dtype == "bfloat16")
    # TVM's barrier planner puts a __syncthreads into every iteration of a loop that reads
    # and writes shared memory; the kernel is written so that none lands in a loop (9 in all:
    # loads, score store, two row exchanges, probabilities, output staging); the tiled kernel
    # has its barriers once per key tile, none in the per-element loops (12 in the source)
    assert src.count("__syncthreads()") <= (12 if flash else 10), src.count("__syncthreads()")
    # the mask is read once per score (S/2 per lane of the padded row; a tile's 32 in the
    # tiled kernel), nowhere else
    per_lane = 32 if flash else ak.padded_seq(s) // 2
    assert src.count("mf_ptr[") == (per_lane if masked else 0)
    # what a GPU machine compiles it with: NVRTC (TVM's default there), and nvcc
    for mode in ("nvrtc", "nvcc"):
        assert len(compile_like_tvm(src, mode, arch, monkeypatch)) > 1000


def _skip_unserved(kernel: str, s: int, d: int):
    if kernel == "rows" and ak.padded_seq(s) > ak.MAX_SEQ:
        pytest.skip("longer than the row kernel serves")
    if kernel == "mma" and mk.supported(d, 227) is not None:
        pytest.skip(mk.supported(d, 227))
    if kernel == "mma_wide" and mk.supported(d, 227, row_tiles=2) is not None:
        pytest.skip(mk.supported(d, 227, row_tiles=2))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("masked,dtype,s,d", [
    (False, "float16", 1500, 64), (True, "bfloat16", 300, 64), (True, "float16", 197, 80),
    (False, "bfloat16", 128, 128), (False, "float16", 512, 32)])
def test_mma_kernel_keeps_scores_in_registers(arch, masked, dtype, s, d, monkeypatch):
    """The mma.sync kernel: Q K^T and P V as m16n8k16 mma.sync (D/16 x 8 and 4 x D/8 per key
    tile), operands through ldmatrix (.trans for V), no wmma and no score or probability
    buffer in shared memory: three block barriers per key tile at most (tile store, tile
    ready; TVM may add none in the loop's math), quad reductions by shuffle; compiled by
    NVRTC and nvcc without spills."""
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline

    b, h = 2, 4
    mask = ak.broadcast_mask((b, 1, 1, s), "float32", (b, h, s, s)) if masked else None
    opnd = ak.bshd(b, h, s, d)
    func = mk.mma_attention_func(b, h, s, d, 0.125, opnd, opnd, opnd, opnd, mask, dtype)
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    mod = tvm.IRModule({"attention": func.with_attr("global_symbol", "attention")})
    lib = tvm.compile(mod, target=target, tir_pipeline=cuda_tir_pipeline(target))
    src = lib.mod.imports[0].inspect_source()
    ptx = "bf16" if dtype == "bfloat16" else "f16"
    assert src.count(f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32") == \
        (d // 16) * 8 + 4 * (d // 8)
    assert src.count("ldmatrix.sync.aligned.m8n8.x4.trans") == 4 * (d // 16)
    assert "wmma" not in src and "warp_reduce_max_4" in src and "warp_reduce_sum_4" in src
    loop = src[src.index("for (int t = 0;"):]
    assert loop.count("__syncthreads()") <= 4, loop.count("__syncthreads()")
    assert src.count("mf_ptr[") == (32 if masked else 0)
    for mode in ("nvrtc", "nvcc"):
        assert len(compile_like_tvm(src, mode, arch, monkeypatch)) > 1000


@pytest.mark.parametrize("masked,dtype,s,d", [(False, "float16", 1500, 64),
                                              (True, "bfloat16", 300, 64),
                                              (False, "float16", 512, 32)])
def test_wide_mma_kernel_reads_each_fragment_for_two_row_tiles(masked, dtype, s, d, tmp_path):
    """row_tiles=2 (32 query rows a warp): twice the mma.sync of the 16-row kernel for the
    same ldmatrix count (each K / V fragment feeds both row tiles), twice the mask reads, and
    sm_90 code without spills (nvcc's ptxas report)."""
    import subprocess

    from amp_cli.backends.cuda.tir import cuda_tir_pipeline

    b, h = 2, 4
    mask = ak.broadcast_mask((b, 1, 1, s), "float32", (b, h, s, s)) if masked else None
    opnd = ak.bshd(b, h, s, d)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    srcs = []
    for tiles in (1, 2):
        func = mk.mma_attention_func(b, h, s, d, 0.125, opnd, opnd, opnd, opnd, mask, dtype,
                                     row_tiles=tiles)
        mod = tvm.IRModule({"attention": func.with_attr("global_symbol", "attention")})
        lib = tvm.compile(mod, target=target, tir_pipeline=cuda_tir_pipeline(target))
        srcs.append(lib.mod.imports[0].inspect_source())
    one, two = srcs
    assert two.count("mma.sync.aligned") == 2 * one.count("mma.sync.aligned")
    loops = [src[src.index("for (int t = 0;"):] for src in srcs]  # the key-tile loop
    assert loops[1].count("ldmatrix") == loops[0].count("ldmatrix")
    assert two.count("mf_ptr[") == 2 * one.count("mf_ptr[")
    assert mk.supported(128, 227, row_tiles=2) is not None  # D > 64: the 16-row kernel
    if shutil.which("nvcc"):
        cu = tmp_path / "wide.cu"
        cu.write_text(two)
        out = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o",
                              str(cu.with_suffix(".cubin")), str(cu)],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "0 bytes spill stores" in out.stderr, out.stderr[-2000:]


def _reference(q, k, v, scale, mask=None):
    """float64 softmax(q k^T * scale [+ mask]) v over [B, H, S, D] arrays."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    sc = q @ k.transpose(0, 1, 3, 2) * scale
    if mask is not None:
        sc = sc + mask.astype(np.float64)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("b,h,s,d,layout", [(2, 3, 64, 64, "bshd"), (8, 16, 128, 64, "bshd"),
                                            (2, 2, 256, 64, "bhsd"), (1, 4, 192, 32, "bshd"),
                                            (2, 4, 128, 32, "bhsd"), (2, 12, 197, 64, "bshd"),
                                            (3, 2, 50, 32, "bhsd"), (2, 4, 1500, 64, "bshd"),
                                            (1, 2, 520, 128, "bhsd")])
@pytest.mark.parametrize("kernel", ["rows", "tiled", "mma", "mma_wide"])
def test_kernel_matches_float64_on_gpu(b, h, s, d, layout, kernel):
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline

    dev = tvm.cuda(0)
    arch = "sm_" + dev.compute_version.replace(".", "")
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    opnd = getattr(ak, layout)(b, h, s, d)
    scale = 1 / np.sqrt(d)
    _skip_unserved(kernel, s, d)
    func = _kernel(kernel, b, h, s, d, scale, opnd, opnd, opnd, ak.bshd(b, h, s, d))
    mod = tvm.IRModule({"attention": func.with_attr("global_symbol", "attention")})
    lib = tvm.compile(mod, target=target, tir_pipeline=cuda_tir_pipeline(target))
    rng = np.random.default_rng(s + d)
    # scores of a few units (peaked softmax rows) on random, never-zero inputs
    q, k, v = (rng.uniform(-2, 2, (b, h, s, d)).astype("float16") for _ in range(3))
    stored = (lambda x: x.transpose(0, 2, 1, 3).copy()) if layout == "bshd" else np.copy
    out = tvm.runtime.tensor(np.zeros((b, s, h, d), "float16"), dev)
    lib["attention"](*(tvm.runtime.tensor(stored(x), dev) for x in (q, k, v)), out)
    got = out.numpy().astype(np.float64).transpose(0, 2, 1, 3)
    ref = _reference(q, k, v, scale)
    # fp16 probabilities and output (2^-11 relative each), fp32 scores and sums
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 4e-3, err


def _mask_values(kind, b, h, s, dtype, rng):
    """A mask of ``kind`` (its array and shape as the graph holds it): padding (the last keys
    of each sequence masked with the dtype's lowest value, as HF writes finfo.min), causal with
    -inf above the diagonal, or a random per-head bias."""
    low = np.finfo(dtype).min
    if kind == "padding":
        m = np.zeros((b, 1, 1, s), dtype)
        for i in range(b):
            m[i, ..., s - 7 * (i + 1):] = low
        return m
    if kind == "causal":
        return np.triu(np.full((s, s), -np.inf, dtype), 1)
    return rng.uniform(-3, 3, (b, h, s, s)).astype(dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind,dtype", [("padding", "float32"), ("padding", "float16"),
                                        ("causal", "float16"), ("bias", "float32")])
@pytest.mark.parametrize("b,h,s,d", [(2, 3, 128, 64), (2, 2, 64, 32), (2, 2, 77, 64),
                                     (2, 2, 333, 64)])
@pytest.mark.parametrize("io", ["float16", "bfloat16"])
@pytest.mark.parametrize("kernel", ["rows", "tiled", "mma", "mma_wide"])
def test_masked_kernel_matches_float64_on_gpu(kind, dtype, b, h, s, d, io, kernel):
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline

    dev = tvm.cuda(0)
    arch = "sm_" + dev.compute_version.replace(".", "")
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    rng = np.random.default_rng(s + d)
    m = _mask_values(kind, b, h, s, dtype, rng)
    mask = ak.broadcast_mask(m.shape, dtype, (b, h, s, s))
    opnd = ak.bshd(b, h, s, d)
    scale = 1 / np.sqrt(d)
    _skip_unserved(kernel, s, d)
    func = _kernel(kernel, b, h, s, d, scale, opnd, opnd, opnd, ak.bshd(b, h, s, d), mask, io)
    mod = tvm.IRModule({"attention": func.with_attr("global_symbol", "attention")})
    lib = tvm.compile(mod, target=target, tir_pipeline=cuda_tir_pipeline(target))
    # values exact in bf16 and fp16 alike (multiples of 1/64 in [-2, 2]): one reference
    q, k, v = (np.round(rng.uniform(-2, 2, (b, h, s, d)) * 64) / 64 for _ in range(3))
    dev_t = _device_tensor(io, dev)
    out = dev_t(np.zeros((b, s, h, d)))
    args = [dev_t(x.transpose(0, 2, 1, 3).copy()) for x in (q, k, v)]
    lib["attention"](*args, tvm.runtime.tensor(m, dev), out)
    got = _host(out, io).transpose(0, 2, 1, 3)
    ref = _reference(q, k, v, scale, np.broadcast_to(m, (b, h, s, s)))
    assert np.isfinite(got).all()
    err = np.abs(got - ref).max() / np.abs(ref).max()
    # fp16 probabilities/output: 2^-11 relative each; bf16: 2^-8
    assert err < (4e-3 if io == "float16" else 2.5e-2), err


def _device_tensor(io, dev):
    """float64 numpy -> a device tensor of ``io`` (bf16 through its uint16 bit pattern)."""
    def make(x):
        if io == "float16":
            return tvm.runtime.tensor(np.asarray(x, "float16"), dev)
        bits = (np.asarray(x, "float32").view("uint32") + 0x8000) >> 16  # round to nearest
        t = tvm.runtime.empty(x.shape, "bfloat16", dev)
        t.copyfrom(bits.astype("uint16"))
        return t
    return make


def _host(t, io):
    if io == "float16":
        return t.numpy().astype(np.float64)
    bits = t.numpy().view("uint16").astype("uint32") << 16
    return bits.view("float32").astype(np.float64)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["padding_mask", "causal"])
def test_torch_sdpa_export_is_fused(causal, precision, tmp_path):
    """torch.onnx.export of F.scaled_dot_product_attention (what HF BERT / GPT-2 export): Q, K,
    V split from one projection, sqrt(scale) on Q and on K^T, an additive mask (a padding mask
    scaled by finfo(float32).min, or the causal mask SDPA builds) -- one fused kernel, no
    split, transpose or softmax kernel left."""
    torch = pytest.importorskip("torch")
    import amp_cli

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = torch.nn.Linear(64, 192), torch.nn.Linear(64, 64)

        def forward(self, x, mask):
            b, s, _ = x.shape
            q, k, v = (t.view(b, s, 2, 32).transpose(1, 2) for t in self.qkv(x).split(64, -1))
            if causal:
                y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                bias = (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
                y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            return self.out(y.transpose(1, 2).reshape(b, s, 64))

    torch.manual_seed(0)
    mask = torch.ones(2, 64, dtype=torch.int64)
    mask[1, 50:] = 0
    path = tmp_path / "attention.onnx"
    torch.onnx.export(Attention().eval(), (torch.randn(2, 64, 64), mask), str(path),
                      dynamo=False, input_names=["x", "mask"], opset_version=17)
    cfg = amp_cli.ConvertConfig(target="cuda:sm_90", check_accuracy=False)
    cfg.precision.precision = precision
    conv = amp_cli.convert(amp_cli.load(path), cfg, isolate=False)
    try:
        rewrites = conv.build.graph_rewrites
        assert (rewrites["attention_fused"], rewrites["attention_unfused"]) == (1, 0)
        kernels = conv.build.kernels
        assert not any(k.startswith(("split", "transpose", "softmax")) for k in kernels), kernels
    finally:
        conv.cleanup()


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("nan_to_zero", [False, True])
@pytest.mark.parametrize("kernel", ["rows", "tiled", "mma", "mma_wide"])
def test_rows_masked_everywhere_on_gpu(nan_to_zero, kernel):
    """Batch 1's keys all -inf: softmax's NaN for its rows, or 0 with the SDPA guard; batch 0
    unaffected; S = 77 exercises the padded block too."""
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline

    b, h, s, d = 2, 2, 77, 64
    dev = tvm.cuda(0)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_" + dev.compute_version.replace(
        ".", "")})
    m = np.zeros((b, 1, 1, s), "float32")
    m[1] = -np.inf
    opnd = ak.bshd(b, h, s, d)
    func = _kernel(kernel, b, h, s, d, 0.125, opnd, opnd, opnd, opnd,
                   ak.broadcast_mask(m.shape, "float32", (b, h, s, s)), "float16", nan_to_zero)
    mod = tvm.IRModule({"attention": func.with_attr("global_symbol", "attention")})
    lib = tvm.compile(mod, target=target, tir_pipeline=cuda_tir_pipeline(target))
    rng = np.random.default_rng(1)
    q, k, v = (rng.uniform(-2, 2, (b, h, s, d)).astype("float16") for _ in range(3))
    out = tvm.runtime.tensor(np.zeros((b, s, h, d), "float16"), dev)
    lib["attention"](*(tvm.runtime.tensor(x.transpose(0, 2, 1, 3).copy(), dev)
                       for x in (q, k, v)), tvm.runtime.tensor(m, dev), out)
    got = out.numpy().astype(np.float64).transpose(0, 2, 1, 3)
    if nan_to_zero:
        assert (got[1] == 0).all()
    else:
        assert np.isnan(got[1]).all()
    ref = _reference(q[:1], k[:1], v[:1], 0.125)
    assert np.abs(got[:1] - ref).max() / np.abs(ref).max() < 4e-3


def _symbolic_dims():
    return tvm.tirx.Var("batch", "int64"), tvm.tirx.Var("sequence", "int64")


def _with_bounds(mod, **upper):
    """``mod`` with ``main``'s ranges' upper bounds as a dynamic build records them."""
    return tvm.IRModule({"main": mod["main"].with_attr("tir_var_upper_bound", upper)})


@pytest.mark.parametrize("dynamo_kt", [False, True])
def test_symbolic_batch_and_sequence_take_an_online_softmax_kernel(dynamo_kt):
    """A dynamic model's attention (symbolic batch and sequence, the mask [B, 1, 1, S] fp32 as
    HF exports it, the SDPA NaN guard): one call of the online-softmax kernel over symbolic
    buffers; without upper bounds for the dims (int32 addressing unproven) it stays unfused."""
    b, s = _symbolic_dims()
    mod = _attention_module(b=b, s=s, h=4, d=64, mask=((b, 1, 1, s), "float32"),
                            nan_guard=True, dynamo_kt=dynamo_kt)
    new, fused, declined = fuse_attention(_with_bounds(mod, batch=32, sequence=512), 90)
    assert (fused, declined) == (1, {})
    assert _ops(new) == ["relax.call_tir", "relax.reshape"]
    func = new[_kernel_call(new)[0].args[0]]
    assert func.attrs["amp.kernel"] == "masked_mma_attention"
    assert "T.Buffer((batch, sequence, 4, 64)" in func.script()  # q, k, v read in place

    _, fused, declined = fuse_attention(mod, 90)
    assert fused == 0 and list(declined) == [
        "a symbolic size without an upper bound under 2**31 elements"]
    # sizes whose product could pass 2**31 elements at the bounds: not fused either
    _, fused, _ = fuse_attention(_with_bounds(mod, batch=1 << 16, sequence=1 << 16), 90)
    assert fused == 0


def _symbolic_kernel(dtype="float16", kernel="tiled"):
    b, s = _symbolic_dims()
    h, d = 4, 64
    opnd = ak.bshd(b, h, s, d)
    mask = ak.broadcast_mask((b, 1, 1, s), "float32", (b, h, s, s))
    return KERNELS[kernel](b, h, s, d, 0.125, opnd, opnd, opnd, opnd, mask, dtype, True)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("kernel", ["tiled", "mma", "mma_wide"])
def test_symbolic_kernel_compiles(arch, kernel, monkeypatch):
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline

    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    mod = tvm.IRModule({"attention": _symbolic_kernel(kernel=kernel).with_attr(
        "global_symbol", "attention")})
    lib = tvm.compile(mod, target=target, tir_pipeline=cuda_tir_pipeline(target))
    src = lib.mod.imports[0].inspect_source()
    if kernel == "tiled":
        assert src.count("wmma::mma_sync") == 2 and src.count("mf_ptr[") == 32
    else:  # a 16 x 64 score tile per row tile: 32 scores per lane, each with its mask element
        tiles = 2 if kernel == "mma_wide" else 1
        assert src.count("mma.sync.aligned.m16n8k16") == 64 * tiles
        assert src.count("mf_ptr[") == 32 * tiles
    for mode in ("nvrtc", "nvcc"):
        assert len(compile_like_tvm(src, mode, arch, monkeypatch)) > 1000


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("io", ["float16", "bfloat16"])
@pytest.mark.parametrize("kernel", ["tiled", "mma", "mma_wide"])
def test_symbolic_kernel_matches_float64_at_every_shape_on_gpu(io, kernel):
    """One compiled symbolic kernel run at several (batch, sequence), partial tiles and a
    padding mask included, each against float64."""
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline

    dev = tvm.cuda(0)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_" + dev.compute_version.replace(
        ".", "")})
    mod = tvm.IRModule({"attention": _symbolic_kernel(io, kernel).with_attr("global_symbol",
                                                                            "attention")})
    lib = tvm.compile(mod, target=target, tir_pipeline=cuda_tir_pipeline(target))
    h, d = 4, 64
    dev_t = _device_tensor(io, dev)
    for b, s in [(1, 16), (3, 77), (2, 128), (1, 333), (4, 64)]:
        rng = np.random.default_rng(b * 1000 + s)
        m = _mask_values("padding", b, h, s, "float32", rng) if s > 7 * b else \
            np.zeros((b, 1, 1, s), "float32")
        q, k, v = (np.round(rng.uniform(-2, 2, (b, h, s, d)) * 64) / 64 for _ in range(3))
        out = dev_t(np.zeros((b, s, h, d)))
        lib["attention"](*(dev_t(x.transpose(0, 2, 1, 3).copy()) for x in (q, k, v)),
                         tvm.runtime.tensor(m, dev), out)
        got = _host(out, io).transpose(0, 2, 1, 3)
        ref = _reference(q, k, v, 0.125, np.broadcast_to(m, (b, h, s, s)))
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert np.isfinite(got).all() and err < (4e-3 if io == "float16" else 2.5e-2), (b, s, err)

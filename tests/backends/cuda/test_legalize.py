"""Lane legalizer: table, rewrite shapes, the CI lane matrix (CUDA codegen, no GPU needed),
the stock failures it fixes, CPU execution of legalized TIR, and a gpu-marked run."""
from __future__ import annotations

import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.tir import (LEGAL_LANES, LegalizeRecord, cuda_tir_pipeline,  # noqa: E402
                              lane_legal, lane_printable)
from fixtures.lane_kernels import EXTRA_KINDS, KINDS, make_inputs, make_kernel  # noqa: E402

ARCHS = ("sm_80", "sm_90")
DTYPES = ("float16", "bfloat16")
LANES = tuple(range(1, 17))


def _target(arch):
    return tvm.target.Target({"kind": "cuda", "arch": arch})


def _kernel_types(kind, dtype):
    """Element dtypes whose vectors the kernel prints."""
    return {"cast": {dtype, "float32"}, "reduce_epilogue": {dtype, "float32"}}.get(kind, {dtype})


def _types(kind, dtype):
    types = _kernel_types(kind, dtype)
    return types | {"bool"} if kind == "select_call" else types


def _stock_legal(kind, dtype, lanes):
    """Stock codegen prints the kernel (it may still not compile: see test_nvcc_compiles)."""
    return all(lane_printable(t, lanes) for t in _types(kind, dtype))


def _amp_legal(kind, dtype, lanes):
    """The pass leaves the kernel alone (printable *and* compilable)."""
    return all(lane_legal(t, lanes) for t in _types(kind, dtype))


_ILLEGAL_TYPE = re.compile(r"\b(half|nv_bfloat16)(3|5|6|7|8|16)\b|\b(half|nv_bfloat16)\d\d\b")


# --------------------------------------------------------------------------- table
def test_lane_legal_table():
    assert [n for n in LANES if lane_legal("float16", n)] == [1, 2, 4, 8]
    assert [n for n in LANES if lane_legal("bfloat16", n)] == [1, 2, 4, 8]
    assert [n for n in LANES if lane_printable("float16", n)] == [1, 2, 4, 6, 8]
    assert lane_legal("float16x8") and not lane_legal("float16x16") and not lane_legal("float16x3")
    assert lane_legal("int8", 16) and not lane_legal("int8", 5)
    assert lane_legal("float8_e4m3fn", 16) and not lane_legal("float8_e4m3fn", 3)
    assert not lane_legal("no_such_type", 2) and lane_legal("no_such_type", 1)


@pytest.mark.parametrize("dtype", ["float32", "int8", "int32"])
def test_table_matches_codegen(dtype):
    """The table says exactly which copies stock CUDA codegen accepts (for types beyond the
    matrix; float16/bfloat16 are covered by test_stock_matrix_fails_on_illegal_lanes)."""
    from tvm.script import tirx as T

    for lanes in LANES:
        n = 8 * lanes

        @T.prim_func(s_tir=True)
        def f(A: T.Buffer((n,), dtype), B: T.Buffer((n,), dtype)):
            T.func_attr({"global_symbol": "main", "tir.noalias": True})
            for i in T.thread_binding(8, thread="threadIdx.x"):
                for j in T.vectorized(lanes):
                    with T.sblock("B"):
                        v = T.axis.spatial(n, i * lanes + j)
                        B[v] = A[v]

        try:
            tvm.compile(f, target=_target("sm_90"))
            ok = True
        except Exception:  # noqa: BLE001 - codegen raises TVMError subclasses
            ok = False
        assert ok == lane_printable(dtype, lanes), (dtype, lanes, ok)


# --------------------------------------------------------------------------- the matrix
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", KINDS + EXTRA_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matrix_builds_with_pass(arch, kind, dtype):
    for lanes in LANES:
        records: list[LegalizeRecord] = []
        ex = tvm.compile(make_kernel(kind, dtype, lanes), target=_target(arch),
                         tir_pipeline=cuda_tir_pipeline(_target(arch), records))
        src = tvm_compat.cuda_module_source(ex)
        assert "main_kernel" in src
        changed = [r for r in records if r.rewrites]
        assert bool(changed) == (not _amp_legal(kind, dtype, lanes)), (lanes, records)
        for rec in records:
            assert rec.kernel == "main" and not rec.skipped, rec
            assert rec.to_dict()["kernel"] == "main"
            for line in rec.rewrites:
                m = re.fullmatch(r"(store|bind) (\w+?)x(\d+) -> ([0-9+]+)", line)
                assert m, line
                pieces = [int(p) for p in m.group(4).split("+")]
                assert sum(pieces) == int(m.group(3)) == lanes
                assert all(lane_legal(m.group(2), p) for p in pieces)
        # only the safety-net stage may run, and it must find nothing left
        assert all(r.stage == "after VectorizeLoop" for r in records)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_stock_matrix_fails_on_illegal_lanes(arch, kind, dtype):
    """Without the pass, stock TVM fails exactly on the illegal lane counts (so the pass
    matters), with the error messages from the issue."""
    for lanes in LANES:
        legal = _stock_legal(kind, dtype, lanes)
        if legal:
            tvm.compile(make_kernel(kind, dtype, lanes), target=_target(arch))
            continue
        with pytest.raises(Exception) as info:  # noqa: PT011 - TVMError subclasses vary
            tvm.compile(make_kernel(kind, dtype, lanes), target=_target(arch))
        msg = str(info.value)
        assert ("lanes % 2 == 0" in msg or "Cannot convert type" in msg
                or "only support even lane" in msg), msg[-400:]


# --------------------------------------------------------------------------- piece shapes
def _build(kind, dtype, lanes, pad=None, arch="sm_90"):
    records: list = []
    ex = tvm.compile(make_kernel(kind, dtype, lanes, pad=pad), target=_target(arch),
                     tir_pipeline=cuda_tir_pipeline(_target(arch), records))
    return tvm_compat.cuda_module_source(ex), [line for r in records for line in r.rewrites]


def test_widest_aligned_pieces():
    src, rw = _build("copy", "float16", 16)
    assert rw == ["store float16x16 -> 8+8"]
    assert src.count("*(uint4*)") == 4  # two 16-byte loads + two 16-byte stores
    _, rw = _build("copy", "float16", 7, pad=8)
    assert rw == ["store float16x7 -> 4+2+1"]
    _, rw = _build("copy", "bfloat16", 12)
    assert rw == ["store bfloat16x12 -> 4+4+4"]
    _, rw = _build("copy", "float16", 10)
    assert rw == ["store float16x10 -> 2+2+2+2+2"]


def test_misaligned_pieces_go_narrow():
    """Thread i owns elements [3i, 3i+3): no piece wider than 1 lane is aligned for every i,
    so the legalizer emits scalars (never a misaligned half2 access)."""
    src, rw = _build("copy", "float16", 3)
    assert rw == ["store float16x3 -> 1+1+1"]
    assert "half2" not in src.split("main_kernel", 1)[1]
    _, rw = _build("copy", "float16", 5)
    assert rw == ["store float16x5 -> 1+1+1+1+1"]


def test_access_width_capped_at_16_bytes():
    _, rw = _build("cast", "float16", 16)
    assert rw == ["store float32x16 -> 4+4+4+4", "store float16x16 -> 4+4+4+4"]


def test_bool_lanes_are_legalized_too():
    # Select's condition is a bool vector; CUDA only prints bool vectors up to 4 lanes.
    _, rw = _build("select_call", "float16", 8)
    assert rw == ["store float16x8 -> 4+4"]


def test_no_illegal_vector_types_in_source():
    for lanes in (3, 5, 7, 9, 16):
        src, _ = _build("elementwise", "float16", lanes)
        body = src.split("main_kernel", 1)[1]
        assert not re.search(r"\bhalf(3|5|7|9|16)\b", body), lanes


# --------------------------------------------------------------------------- semantics on CPU
def _bits(a):
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("kind", KINDS + EXTRA_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_legalized_tir_runs_bit_exact_on_cpu(kind, dtype):
    """The legalized TIR (forced on for an llvm target) computes exactly what numpy computes,
    bit for bit, and leaves the padding it must not touch alone."""
    for lanes, pad in ((3, None), (5, None), (7, 8), (16, None), (12, None)):
        records: list = []
        ex = tvm.compile(make_kernel(kind, dtype, lanes, thread=None, pad=pad), target="llvm",
                         tir_pipeline=cuda_tir_pipeline(None, records, only_cuda=False))
        assert any(r.rewrites for r in records)
        args, expected = make_inputs(kind, dtype, lanes, pad)
        targs = [tvm.runtime.tensor(a) for a in args]
        ex["main"](*targs)
        for i, exp in expected.items():
            got = targs[i].numpy()
            if kind == "select_call":  # exp: libm vs numpy may differ in the last bit
                np.testing.assert_allclose(got.astype(np.float32), exp.astype(np.float32),
                                           rtol=1e-2)
            else:
                assert np.array_equal(_bits(got), _bits(exp)), (kind, dtype, lanes, i)


# --------------------------------------------------------------------------- pipeline
def test_pipeline_matches_tvm_default():
    """amp's pipeline = TVM's default s_tir pipeline + the legalizer - LowerAsyncDMA (drift
    detector for the reproduced pass list in amp_cli/backends/cuda/tir/pipeline.py)."""

    def names(pipeline):
        seen = []

        @tvm.ir.instrument.pass_instrument
        class Rec:
            def run_before_pass(self, _mod, info):
                seen.append(info.name)

        # amp turns on TVM's async-copy passes for CUDA; compare against stock with them on
        with tvm.transform.PassContext(instruments=[Rec()], config={"tirx.use_async_copy": True}):
            tvm.compile(make_kernel("copy", "float16", 4), target=_target("sm_90"),
                        tir_pipeline=pipeline)
        return seen

    stock = names("default")
    ours = names(cuda_tir_pipeline(_target("sm_90"), []))
    wrappers = {"amp.LaneLegalize", "amp.CudaTIRPipeline", "amp.TypedAccessPtr",
                "amp.SyncStridedAsyncCopy", "amp.ExactPow", "amp.NonFiniteConstants", "_pipeline",
                "sequential", "amp.NarrowIndex32"}
    ours_wo = [n for n in ours if n not in wrappers]
    stock_wo = [n for n in stock if n not in wrappers]
    # the one pass amp leaves out on purpose (pipeline.py: Hexagon DMA, a no-op or a broken
    # build on CUDA, and 25 % of a dynamic CNN's build time)
    assert "s_tir.LowerAsyncDMA" in stock_wo and "s_tir.LowerAsyncDMA" not in ours_wo
    assert ours_wo == [n for n in stock_wo if n != "s_tir.LowerAsyncDMA"]
    # pow first, on the whole module (the TIRx kernels too), before the s_tir passes
    assert ours[ours.index("amp.CudaTIRPipeline") + 1:][:2] == ["amp.ExactPow", "sequential"]
    i = ours.index("amp.LaneLegalize")
    assert ours[i - 1] == "tirx.VectorizeLoop"
    assert ours.count("amp.LaneLegalize") == 2  # + the safety net after LowerIntrin
    j = ours.index("amp.SyncStridedAsyncCopy")
    assert ours[j + 1] == "s_tir.InjectPTXAsyncCopy"
    assert ours[ours.index("tirx.LowerIntrin", i):].count("amp.LaneLegalize") >= 1
    assert ours.index("amp.NonFiniteConstants") > ours.index("tirx.LowerIntrin", i)  # last
    # int32 indices for the kernels marked safe, before TVM's own narrowing (index32.py)
    assert ours[ours.index("amp.NarrowIndex32") + 1] == "tirx.NarrowDataType"


def test_records_are_plain_data():
    rec = LegalizeRecord("k", ["store float16x3 -> 2+1"])
    assert rec.to_dict() == {"kernel": "k", "rewrites": ["store float16x3 -> 2+1"],
                             "stage": "after VectorizeLoop", "skipped": []}
    assert set(LEGAL_LANES) >= {"float16", "bfloat16", "int8", "float8_e4m3fn"}


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", KINDS + EXTRA_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_lane_matrix_on_gpu(kind, dtype):
    """Every lane count (and padded rows) of one kind/dtype, compiled as one module (one CUDA
    compile per test instead of ~24), run and compared with numpy: copies and casts bit-exact."""
    arch = "sm_" + tvm.cuda(0).compute_version.replace(".", "")
    dev = tvm.cuda(0)
    cases = [(lanes, pad) for lanes in LANES for pad in {None, 16 if lanes <= 16 else None}]
    funcs = {}
    for lanes, pad in cases:
        name = f"k{lanes}_p{pad or 0}"
        funcs[name] = make_kernel(kind, dtype, lanes, pad=pad).with_attr("global_symbol", name)
    ex = tvm.compile(tvm.IRModule(funcs), target=_target(arch),
                     tir_pipeline=cuda_tir_pipeline(_target(arch), []))
    for lanes, pad in cases:
        args, expected = make_inputs(kind, dtype, lanes, pad)
        targs = [tvm.runtime.tensor(a, dev) for a in args]
        ex[f"k{lanes}_p{pad or 0}"](*targs)
        dev.sync()
        for i, exp in expected.items():
            got = targs[i].numpy()
            if kind in ("copy", "cast"):
                assert np.array_equal(_bits(got), _bits(exp)), (kind, dtype, lanes, pad, i)
            else:
                tol = 1e-2 if dtype == "bfloat16" else 2e-3
                np.testing.assert_allclose(got.astype(np.float32), exp.astype(np.float32),
                                           rtol=tol, atol=tol, err_msg=f"{lanes} lanes pad {pad}")


# --------------------------------------------------------------------------- nvcc
def _nvcc_errors(src: str, arch: str, tmp_path, name: str) -> list[str]:
    import subprocess

    cu = tmp_path / f"{name}.cu"
    cu.write_text(src)
    res = subprocess.run(["nvcc", f"-arch={arch}", "-c", "-o", str(tmp_path / f"{name}.o"),
                          str(cu)], capture_output=True, text=True, timeout=300)
    return [line for line in res.stderr.splitlines() if "error" in line]


NVCC_CASES = [(kind, dtype, lanes, pad) for kind in KINDS + EXTRA_KINDS for dtype in DTYPES
              for lanes, pad in ((3, None), (6, 16), (8, None), (16, None))]


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("kind,dtype,lanes,pad", NVCC_CASES)
def test_nvcc_compiles(tmp_path, kind, dtype, lanes, pad):
    """What the pass emits compiles with nvcc, not only prints: stock TVM prints 6 halves and 8
    floats as uint3 / ulonglong4 but their broadcasts as make_<type>(one arg per lane), which
    nvcc (and the H200's NVRTC) rejects. The pass splits those; this compiles its output."""
    arch = "sm_90"
    ex = tvm.compile(make_kernel(kind, dtype, lanes, pad=pad), target=_target(arch),
                     tir_pipeline=cuda_tir_pipeline(_target(arch), []))
    errors = _nvcc_errors(tvm_compat.cuda_module_source(ex), arch, tmp_path, "amp")
    assert not errors, errors[:3]


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("kind,dtype,lanes,pad", [("copy", "float16", 6, 16),
                                                  ("reduce_epilogue", "float16", 8, None)])
def test_stock_printable_lanes_fail_nvcc(tmp_path, kind, dtype, lanes, pad):
    """The stock failure the NVCC_REJECTS table encodes (so the split is needed)."""
    arch = "sm_90"
    ex = tvm.compile(make_kernel(kind, dtype, lanes, pad=pad), target=_target(arch))
    errors = _nvcc_errors(tvm_compat.cuda_module_source(ex), arch, tmp_path, "stock")
    assert any("too many arguments" in e for e in errors), errors[:3]

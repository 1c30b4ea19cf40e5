"""CUDA source of a model with hostile tensor and node names (tests/fixtures/hostile_names.py)
compiles, with nvcc and with NVRTC -- the compiler TVM uses on a GPU machine.

Why both: without a CUDA driver (CI), TVM's ``target.build.cuda`` keeps the generated source in
a fallback module and compiles nothing; with one (the H200), it compiles right away through
``tvm_callback_cuda_compile``, which picks NVRTC unless ``TVM_CUDA_COMPILE_MODE=nvcc``
(docs/reliability.md, "Which compiler sees the CUDA source"). The NVRTC tests here call that
same callback, so CI compiles what a GPU machine would; they need ``cuda-bindings`` and an
NVRTC library (amp's ``test`` extra) and the CUDA headers of a toolkit.
"""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("onnx")

from fixtures.cuda_compile import compile_like_tvm  # noqa: E402
from fixtures.hostile_names import hostile_model  # noqa: E402

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.target import find_nvcc  # noqa: E402

KERNEL = re.compile(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(([^)]*)\)")
IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


def _build_source(model, make_identifiers=True):
    """amp's CUDA build of ``model`` (fp16, cuda:sm_90, default switches) up to the CUDA
    source: the pipeline ``amp convert`` runs (compile/build.py), without exporting."""
    from amp_cli.backends.cuda import pipeline as cuda_pipeline
    from amp_cli.compile.pipeline import compile_target, relax_pipeline, tir_pipeline
    from amp_cli.config import PrecisionConfig
    from amp_cli.precision import convert_precision
    from amp_cli.target import resolve_target

    mod, _ = convert_precision(model.mod, PrecisionConfig(precision="fp16"), model.node_types)
    target = resolve_target("cuda:sm_90", check_toolchain=False)
    tgt = compile_target(target)
    stats: dict = {}
    keep = cuda_pipeline.make_identifiers
    if not make_identifiers:
        cuda_pipeline.make_identifiers = lambda m: (m, {})
    try:
        with tgt:
            lowered = relax_pipeline(target, rewrite_stats=stats)(mod)
    finally:
        cuda_pipeline.make_identifiers = keep
    ex = tvm_compat.compile_relax(lowered, tgt, relax_pipeline=None,
                                  tir_pipeline=tir_pipeline(target, []))
    return tvm_compat.cuda_source(ex), stats


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    import onnx

    import amp_cli

    path = tmp_path_factory.mktemp("cuda_names") / "hostile.onnx"
    onnx.save(hostile_model(), str(path))
    return amp_cli.load(path)


@pytest.fixture(scope="module")
def source(hostile):
    return _build_source(hostile)


def _nvcc(src: str, tmp_path, name: str):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc")
    (tmp_path / f"{name}.cu").write_text(src)
    return subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-o", str(tmp_path / f"{name}.cubin"),
                           str(tmp_path / f"{name}.cu")], capture_output=True, text=True,
                          timeout=600)


def test_the_paths_that_carried_the_names_are_taken(source):
    src, stats = source
    assert stats["implicit_gemm_convs"] == 2, stats  # both convs: C = 8 and 16
    assert "cp_async" in src
    assert "concatenate" in src and "mirror_pad" in src, sorted(KERNEL.findall(src))
    assert stats["names_made_identifiers"] >= 7, stats


def test_every_kernel_parameter_is_an_identifier(source):
    src, _ = source
    kernels = KERNEL.findall(src)
    assert kernels
    for name, params in kernels:
        for param in params.split(","):
            ident = param.split()[-1]
            assert IDENTIFIER.fullmatch(ident) and "__" not in ident, (name, param)
    assert "onnx_model_9_Concat" in src  # the name the H200's NVRTC choked on, made readable


def test_nvcc_compiles_the_source(source, tmp_path):
    res = _nvcc(source[0], tmp_path, "hostile")
    assert res.returncode == 0, res.stderr[-3000:]


def test_stock_names_do_not_compile(hostile, tmp_path):
    """Without make_identifiers, '/' reaches the source (``onnx_/model_9/Concat_ptr``): nvcc
    fails as NVRTC did on the H200. Keeps the tests above from passing vacuously."""
    src, _ = _build_source(hostile, make_identifiers=False)
    assert "onnx_/model_9/Concat_ptr" in src
    res = _nvcc(src, tmp_path, "stock")
    assert res.returncode != 0 and 'expected a ")"' in res.stderr


def test_names_that_collide_after_replacement_stay_apart():
    """TVM's AllocVarID de-duplicates a name before replacing ':' (``a:b`` and ``a_b`` both print
    as ``a_b_ptr``, one kernel with two parameters of one name); renamed first, they stay two."""
    from tvm.script import tirx as T

    from amp_cli.frontend.names import make_identifiers

    @T.prim_func(s_tir=True)
    def add(A: T.Buffer((64,), "float32"), B: T.Buffer((64,), "float32"),
            C: T.Buffer((64,), "float32")):
        T.func_attr({"global_symbol": "add", "tirx.noalias": True})
        for i in T.thread_binding(64, thread="threadIdx.x"):
            with T.sblock("c"):
                v = T.axis.remap("S", [i])
                C[v] = A[v] + B[v]

    hostile = {"A": "a:b", "B": "a_b"}
    mod = tvm.IRModule({"add": tvm_compat.rename_vars(add, lambda v: hostile.get(str(v.name)))})
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})

    def params(m):
        src = tvm_compat.cuda_source(tvm.compile(m, target=target))
        return [p.split()[-1] for p in KERNEL.search(src).group(2).split(",")]

    assert params(mod) == ["C_ptr", "a_b_ptr", "a_b_ptr"]  # stock: one name, two tensors
    renamed, originals = make_identifiers(mod)
    assert sorted(originals.values()) == ["a:b"]
    got = params(renamed)
    assert len(set(got)) == 3 and all(IDENTIFIER.fullmatch(p) for p in got), got


@pytest.mark.parametrize("mode", ["nvrtc", "nvcc"])
def test_tvm_compile_callback_compiles_the_source(source, mode, monkeypatch):
    """The callback a GPU machine's TVM compiles with (``tvm_callback_cuda_compile``, in
    tvm/support/nvcc.py), in both of its modes, on this source: NVRTC gives a cubin, nvcc a
    fatbin."""
    binary = compile_like_tvm(source[0], mode, "sm_90", monkeypatch)
    assert len(binary) > 1000
    if mode == "nvrtc":
        assert binary[:4] == b"\x7fELF"  # a cubin


@pytest.mark.gpu
@pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["nvrtc", "nvcc"])
def test_hostile_names_run_on_gpu(hostile, mode, monkeypatch):
    """On a GPU machine TVM compiles while building (NVRTC by default): the model converts for
    the local GPU, runs there and matches ONNX Runtime fp32 (rel L2 < 1e-2, fp16)."""
    import amp_cli

    if mode == "nvcc" and shutil.which("nvcc") is None:
        pytest.skip("needs nvcc on PATH")
    monkeypatch.setenv("TVM_CUDA_COMPILE_MODE", mode)
    cfg = amp_cli.ConvertConfig(target="cuda")
    cfg.accuracy.samples = 2
    conv = amp_cli.convert(hostile, cfg)
    try:
        acc = conv.accuracy
        assert acc["device"] == "cuda"
        assert acc["worst"]["nonfinite_share"] == 0
        assert acc["worst"]["rel_l2"] < 1e-2, acc["worst"]
        assert conv.build.graph_rewrites.get("names_made_identifiers", 0) >= 7
    finally:
        conv.cleanup()

"""The convert spine: CLI contract, artifacts, reports, fp16/bf16 builds for CUDA and llvm.

Numerical checks compare against ONNX Runtime fp32 on seeded random N(0, 1) inputs.
Tolerances (relative L2 over each output): fp16 with fp32 accumulation 1e-2, bf16 3e-2.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

import amp_cli
from amp_cli import models
from amp_cli.accuracy import LibraryRunner, metrics, random_inputs
from amp_cli.cli import main

TOL = {"fp16": 1e-2, "bf16": 3e-2, "fp32": 1e-5}


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    paths = {}
    for name, fn in models.EXAMPLES.items():
        p = d / f"{name}.onnx"
        onnx.save(fn(), str(p))
        paths[name] = p
    return paths


def _runner():
    return CliRunner()


def test_cli_convert_llvm_writes_artifacts_and_runs(model_files, tmp_path):
    out = tmp_path / "out"
    res = _runner().invoke(main, ["convert", str(model_files["tiny_cnn"]), "-o", str(out),
                                  "--target", "llvm", "--input-shape", "input:2x3x32x32"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == ["model.so", "report.json", "report.md"]
    report = json.loads((out / "report.json").read_text())
    for key in ("config", "versions", "model", "precision", "build", "accuracy", "target"):
        assert key in report
    assert report["versions"]["apache-tvm"] == "0.27.0.post1"
    assert report["accuracy"]["device"] == "cpu"
    assert report["accuracy"]["worst"]["rel_l2"] < TOL["fp16"]
    assert report["precision"]["dtype"] == "float16"
    assert any(k.endswith(":float16") for k in report["precision"]["ops_by_dtype"])
    assert "## Accuracy" in (out / "report.md").read_text()

    # The library is a Relax VM library anyone can run: compare against ORT ourselves.
    loaded = amp_cli.load(model_files["tiny_cnn"], input_shapes={"input": [2, 3, 32, 32]})
    feeds = random_inputs(loaded.inputs, seed=123)
    got = LibraryRunner(str(out / "model.so"))(feeds, ["input"])
    ref = loaded.reference(feeds)
    assert got[0].dtype == np.float32  # keep-io-types
    assert metrics(ref[0], got[0])["rel_l2"] < TOL["fp16"]


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("name", ["tiny_cnn", "tiny_bert"])
def test_llvm_matches_ort(model_files, name, precision):
    shapes = {"input": [1, 3, 32, 32]} if name == "tiny_cnn" else {}
    loaded = amp_cli.load(model_files[name], input_shapes=shapes)
    cfg = amp_cli.ConvertConfig(target="llvm")
    cfg.precision.precision = precision
    cfg.accuracy.samples = 2
    conv = amp_cli.convert(loaded, cfg)
    try:
        worst = conv.accuracy["worst"]
        assert worst["nonfinite_share"] == 0
        assert worst["rel_l2"] < TOL[precision], worst
        assert worst["rel_l2"] > 0 or precision == "fp32"  # low precision really happened
        if precision != "fp32":
            low = "float16" if precision == "fp16" else "bfloat16"
            assert conv.precision.converted_ops > 0
            assert any(k.endswith(":" + low) for k in conv.precision.ops_by_dtype)
    finally:
        conv.cleanup()


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("name", ["tiny_cnn", "tiny_bert"])
def test_cuda_codegen(model_files, name, precision, arch):
    shapes = {"input": [1, 3, 32, 32]} if name == "tiny_cnn" else {}
    loaded = amp_cli.load(model_files[name], input_shapes=shapes)
    cfg = amp_cli.ConvertConfig(target=f"cuda:{arch}")
    cfg.precision.precision = precision
    cfg.check_accuracy = False
    conv = amp_cli.convert(loaded, cfg)
    try:
        b = conv.build
        assert b.target["arch"] == arch
        assert b.cuda_source_bytes > 0 and b.size_bytes > 0
        assert conv.report["build"]["kernels"]
    finally:
        conv.cleanup()


def test_bf16_really_emits_bf16_cuda(model_files):
    from amp_cli.compile import pipeline as build_mod
    from amp_cli import tvm_compat
    from amp_cli.precision import convert_precision
    from amp_cli.target import resolve_target

    loaded = amp_cli.load(model_files["tiny_bert"])
    cfg = amp_cli.ConvertConfig(target="cuda:sm_90")
    cfg.precision.precision = "bf16"
    mod, rep = convert_precision(loaded.mod, cfg.precision, loaded.node_types)
    assert any(k.endswith(":bfloat16") for k in rep.ops_by_dtype)
    assert not any(k.endswith(":float16") for k in rep.ops_by_dtype)
    target = resolve_target("cuda:sm_90")
    with target.tvm_target():
        lowered = build_mod.relax_pipeline(target)(mod)
    ex = tvm_compat.compile_relax(lowered, target.tvm_target(), relax_pipeline=None,
                                  tir_pipeline=build_mod.tir_pipeline(target, []))
    assert "nv_bfloat16" in tvm_compat.cuda_source(ex)


def test_cuda_config_switches_graphs_and_conv_gemm(model_files):
    """``cuda.cuda_graph`` / ``cuda.conv_as_gemm`` reach amp's CUDA Relax pipeline: on by
    default (a capture function, conv GEMM kernels), and each can be turned off alone."""
    from amp_cli.compile import pipeline as build_mod
    from amp_cli.config import CudaConfig
    from amp_cli.precision import convert_precision
    from amp_cli.target import resolve_target

    loaded = amp_cli.load(model_files["tiny_cnn"], input_shapes={"input": [1, 3, 32, 32]})
    mod, _ = convert_precision(loaded.mod, amp_cli.ConvertConfig().precision, loaded.node_types)
    target = resolve_target("cuda:sm_90")

    def names(cuda):
        with target.tvm_target():
            lowered = build_mod.relax_pipeline(target, cuda=cuda)(mod)
        return {gv.name_hint for gv in lowered.get_global_vars()}

    default = names(None)
    assert any(n.endswith("cuda_graph_capture") for n in default), sorted(default)
    assert any("conv_gemm" in n for n in default), sorted(default)
    no_graph = names(CudaConfig(cuda_graph=False))
    assert not any("cuda_graph" in n for n in no_graph)
    assert any("conv_gemm" in n for n in no_graph)
    no_gemm = names(CudaConfig(conv_as_gemm=False))
    assert not any("conv_gemm" in n for n in no_gemm)
    assert any("conv2d" in n for n in no_gemm), sorted(no_gemm)


def test_cli_no_cuda_graph_is_reported(model_files, tmp_path):
    out = tmp_path / "o"
    res = _runner().invoke(main, ["convert", str(model_files["tiny_bert"]), "-o", str(out),
                                  "--target", "cuda:sm_90", "--no-cuda-graph", "--no-accuracy"])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["cuda"] == {"cuda_graph": False, "conv_as_gemm": True,
                                        "conv1d_as_conv2d": True,
                                        "sink_reshapes": True, "sink_permutes": True,
                                        "mean_as_sum": True,
                                        "split_expanding_epilogues": True,
                                        "combine_gemms": True,
                                        "split_k": True, "implicit_gemm": True,
                                        "pad_stem_channels": True,
                                        "fused_attention": True, "attention_rows": True,
                                        "mma_attention": True,
                                        "mma_attention_wide": False,
                                        "fused_norm_cast": True,
                                        "small_gemm": True, "narrow_gemm": True,
                                        "padding_aware_tiles": True,
                                        "tile_variants_above_optimum": True,
                                        "unroll_injective": True,
                                        "depthwise_conv": True, "hopper_gemm": True,
                                        "hopper_min_k": 512, "hopper_two_per_sm": False,
                                        "hopper_persistent": False,
                                        "hopper_symbolic_m": True,
                                        "index32": True,
                                        "hopper_m_variants": True,
                                        "pointwise_flat_rows": True}
    md = (out / "report.md").read_text()
    assert "CUDA graphs off, convolutions as GEMMs on" in md
    # the graph rewrites are counted: every matmul of tiny_bert has an fp16 constant weight
    assert report["build"]["graph_rewrites"]["matmuls_nt"] > 0
    assert "matmuls in NT form" in md


def test_cuda_without_gpu_checks_accuracy_on_cpu(model_files, tmp_path):
    from amp_cli import tvm_compat

    if tvm_compat.has_cuda_device():
        pytest.skip("a GPU is present: accuracy runs on it")
    out = tmp_path / "o"
    res = _runner().invoke(main, ["convert", str(model_files["tiny_bert"]), "-o", str(out),
                                  "--target", "cuda"])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert report["target"]["arch"] == "sm_80"
    assert any("sm_80" in n for n in report["notes"])
    assert report["accuracy"]["device"] == "cpu"
    assert report["accuracy"]["worst"]["rel_l2"] < TOL["fp16"]


def _bias_model(bias_value: float):
    """x @ W + bias - offset: with bias 70000 the offset brings values back into fp16 range, so
    clamping 70000 to 65504 would be a silent error of ~4500 in one column."""
    b = models.GraphBuilder(seed=3)
    y = b.op("MatMul", ["x", b.weight(17, 9)])
    bias = np.full(9, 0.5, "float32")
    bias[4] = bias_value
    y = b.op("Add", [y, b.const(bias, "bias")])
    offset = np.zeros(9, "float32")
    offset[4] = -bias_value + 1.0
    y = b.op("Add", [y, b.const(offset, "offset")])
    y = b.op("Relu", [y])
    y = b.op("MatMul", [y, b.weight(9, 5, scale=1e-3)])
    return b.model([("x", [3, 17], "float32")], [(y, [3, 5], "float32")])


def test_out_of_range_constant_keeps_op_in_fp32(tmp_path):
    path = tmp_path / "bias.onnx"
    onnx.save(_bias_model(70000.0), str(path))
    loaded = amp_cli.load(path)
    conv = amp_cli.convert(loaded, amp_cli.ConvertConfig(target="llvm"))
    try:
        issues = conv.precision.constants
        assert [c.op for c in issues] == ["add", "add"] and issues[0].max_abs == 70000.0
        assert issues[0].action == "kept-fp32"
        kept = {k.node: k.reason for k in conv.precision.kept_fp32}
        # The report names the ONNX node (onnxslim may have fused MatMul+Add into a Gemm).
        assert issues[0].node in loaded.node_types
        assert kept[issues[0].node] == "constant-range"
        worst = conv.accuracy["worst"]
        assert worst["nonfinite_share"] == 0 and worst["rel_l2"] < TOL["fp16"]
    finally:
        conv.cleanup()


def test_tiny_constants_flushed_and_counted(tmp_path):
    path = tmp_path / "tiny.onnx"
    onnx.save(_bias_model(1e-9), str(path))  # below fp16's smallest subnormal (6e-8)
    conv = amp_cli.convert(amp_cli.load(path), amp_cli.ConvertConfig(target="llvm"))
    try:
        assert conv.precision.underflow_flushed == 1
        assert not conv.precision.constants
    finally:
        conv.cleanup()


def test_exclusions_by_node_and_op_type(model_files, tmp_path):
    loaded = amp_cli.load(model_files["tiny_bert"])
    matmuls = [n for n, t in loaded.node_types.items() if t == "MatMul"]
    cfg = amp_cli.ConvertConfig(target="llvm")
    cfg.precision.policy.exclude_nodes = [matmuls[0]]
    cfg.precision.policy.exclude_ops = ["Gelu", "Erf"]
    conv = amp_cli.convert(loaded, cfg)
    try:
        kept = {k.node: k.reason for k in conv.precision.kept_fp32}
        assert kept[matmuls[0]] == "excluded-node"
        erf_nodes = [n for n, t in loaded.node_types.items() if t == "Erf"]
        assert erf_nodes and all(kept[n] == "excluded-op" for n in erf_nodes)
        assert conv.accuracy["worst"]["rel_l2"] < TOL["fp16"]
    finally:
        conv.cleanup()


def test_api_matches_cli(model_files, tmp_path):
    out = tmp_path / "cli"
    res = _runner().invoke(main, ["convert", str(model_files["tiny_bert"]), "-o", str(out),
                                  "--target", "llvm", "--precision", "bf16"])
    assert res.exit_code == 0, res.output
    cli_report = json.loads((out / "report.json").read_text())
    cfg = amp_cli.ConvertConfig(target="llvm")
    cfg.precision.precision = "bf16"
    conv = amp_cli.convert(amp_cli.load(model_files["tiny_bert"]), cfg)
    try:
        api = conv.report
        assert api["precision"]["ops_by_dtype"] == cli_report["precision"]["ops_by_dtype"]
        assert api["accuracy"]["worst"] == cli_report["accuracy"]["worst"]
        assert api["config"] == cli_report["config"]
    finally:
        conv.cleanup()


def test_yaml_config_and_flag_precedence(model_files, tmp_path):
    cfg_file = tmp_path / "amp.yaml"
    cfg_file.write_text("target: llvm\nprecision:\n  precision: bf16\n  accumulate: fp32\n")
    out = tmp_path / "o"
    res = _runner().invoke(main, ["convert", str(model_files["tiny_bert"]), "-o", str(out),
                                  "--config", str(cfg_file), "--precision", "fp16",
                                  "--target", "llvm"])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["precision"]["precision"] == "fp16"  # flag beats YAML
    assert report["config"]["target"] == "llvm"


def test_accumulate_fp16_outputs_fp16_matmul(model_files):
    loaded = amp_cli.load(model_files["tiny_bert"])
    cfg = amp_cli.ConvertConfig(target="llvm")
    cfg.precision.accumulate = "fp16"
    conv = amp_cli.convert(loaded, cfg)
    try:
        assert conv.precision.ops_by_dtype.get("matmul:float16", 0) > 0
        assert "matmul:float32" not in conv.precision.ops_by_dtype
        assert conv.accuracy["worst"]["rel_l2"] < 2e-2
    finally:
        conv.cleanup()


@pytest.mark.parametrize("keep", [True, False])
def test_keep_io_types(tmp_path, keep):
    b = models.GraphBuilder(seed=5)
    y = b.op("Relu", [b.op("MatMul", ["x", b.weight(11, 7)])])
    path = tmp_path / "m.onnx"
    onnx.save(b.model([("x", [2, 11], "float32")], [(y, [2, 7], "float32")]), str(path))
    loaded = amp_cli.load(path)
    cfg = amp_cli.ConvertConfig(target="llvm")
    cfg.precision.keep_io_types = keep
    cfg.check_accuracy = False
    conv = amp_cli.convert(loaded, cfg)
    try:
        feeds = random_inputs(loaded.inputs, 0)
        got = LibraryRunner(conv.library)(feeds, ["x"])[0]
        assert got.dtype == (np.float32 if keep else np.float16)
        ref = loaded.reference(feeds)[0]
        assert metrics(ref, got.astype(np.float32))["rel_l2"] < TOL["fp16"]
    finally:
        conv.cleanup()

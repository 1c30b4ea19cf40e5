"""amp bench: statistics, JSON schema, gates (exit 3), --compare, OUTDIRs, --inputs validation.

All runs use the llvm target on amp_cli.models' tiny models (a few seconds per build) with few
timing samples; latency values are not asserted (a shared CI machine is noisy), only their
presence, consistency (min <= p50 <= p90 <= p99) and the gate logic. Accuracy: the fp16 build
against ONNX Runtime fp32 within rel L2 1e-2.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from amp_cli import models
from amp_cli.bench import LatencyStats
from amp_cli.cli import main

FAST = ["--warmup", "1", "--repeat", "5"]
SHAPE = ["--input-shape", "input:2x3x32x32"]
STATS = ("mean_ms", "std_ms", "min_ms", "max_ms", "p50_ms", "p90_ms", "p99_ms",
         "throughput_per_s")


def _invoke(args):
    return CliRunner().invoke(main, args)


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    p = tmp_path_factory.mktemp("models") / "tiny_cnn.onnx"
    onnx.save(models.tiny_cnn(), str(p))
    return p


@pytest.fixture(scope="module")
def outdir(cnn, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "cnn"
    res = _invoke(["convert", str(cnn), "-o", str(out), "--target", "llvm", *SHAPE,
                   "--no-accuracy"])
    assert res.exit_code == 0, res.output
    return out


def _check_stats(lat: dict, samples: int, batch: int = 2):
    for key in STATS:
        assert isinstance(lat[key], float) and lat[key] >= 0, key
    assert lat["min_ms"] <= lat["p50_ms"] <= lat["p90_ms"] <= lat["p99_ms"] <= lat["max_ms"]
    assert lat["samples"] == samples and lat["batch"] == batch
    assert lat["throughput_per_s"] == pytest.approx(batch / (lat["mean_ms"] / 1e3))


def test_latency_stats_percentiles():
    s = LatencyStats.from_seconds([i / 1e3 for i in range(1, 101)], batch=4)
    assert (s.min_ms, s.max_ms, s.samples) == (1.0, 100.0, 100)
    assert s.p50_ms == pytest.approx(50.5) and s.p90_ms == pytest.approx(90.1)
    assert s.p99_ms == pytest.approx(99.01) and s.mean_ms == pytest.approx(50.5)
    assert s.throughput_per_s == pytest.approx(4 / 0.0505)


def test_bench_model_prints_statistics_and_writes_json(cnn, tmp_path):
    js = tmp_path / "b.json"
    res = _invoke(["bench", str(cnn), "--target", "llvm", *SHAPE, *FAST, "--json", str(js)])
    assert res.exit_code == 0, res.output
    for head in ("mean ms", "std", "min", "p50", "p90", "p99", "items/s", "rel L2", "max abs",
                 "cosine", "non-fin"):
        assert head in res.stdout
    assert "amp fp16" in res.stdout
    data = json.loads(js.read_text())
    assert data["schema_version"] == 1 and data["passed"] is True
    assert data["device"] == "cpu" and data["target"]["kind"] == "llvm"
    assert data["inputs"]["batch"] == 2 and data["bench"]["repeat"] == 5
    amp = data["runners"][0]
    assert (amp["kind"], amp["precision"], amp["error"], amp["skipped"]) == \
        ("amp", "float16", None, None)
    _check_stats(amp["latency"], samples=5)
    assert amp["accuracy"]["rel_l2"] < 1e-2 and amp["accuracy"]["cosine"] > 0.999
    assert amp["accuracy"]["nonfinite_share"] == 0
    assert list(tmp_path.iterdir()) == [js]  # no temp file left behind


def test_gates_and_compare_fp32_ort(outdir, tmp_path):
    # impossibly tight: exit 3 with a one-line reason, JSON still written
    js = tmp_path / "tight.json"
    res = _invoke(["bench", str(outdir), *FAST, "--compare", "fp32,ort", "--json", str(js),
                   "--max-latency-ratio", "1e-6", "--max-rel-error", "1e-12"])
    assert res.exit_code == 3, res.output
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("amp: error: ")
    assert "--max-latency-ratio" in err and "--max-rel-error" in err
    data = json.loads(js.read_text())
    assert data["passed"] is False
    assert [g["passed"] for g in data["gates"]] == [False, False]
    kinds = [r["kind"] for r in data["runners"]]
    assert kinds == ["amp", "amp-fp32", "ort"]
    for r in data["runners"]:
        assert r["error"] is None and r["skipped"] is None, r
        _check_stats(r["latency"], samples=5)
    fp32, ort = data["runners"][1], data["runners"][2]
    assert fp32["precision"] == "float32" and fp32["accuracy"]["rel_l2"] < 1e-5
    assert ort["device"] == "cpu" and ort["accuracy"]["rel_l2"] < 1e-6
    assert "amp fp32" in res.stdout and "onnxruntime cpu" in res.stdout
    # loose: exit 0
    res = _invoke(["bench", str(outdir), *FAST, "--max-latency-ratio", "1e6",
                   "--max-rel-error", "1"])
    assert res.exit_code == 0, res.output
    assert res.stdout.count(": pass: ") == 2


def test_rel_error_gate_on_model(cnn):
    res = _invoke(["bench", str(cnn), "--target", "llvm", *SHAPE, *FAST, "--max-rel-error",
                   "1e-12"])
    assert res.exit_code == 3, res.output
    assert "rel L2 error" in res.stderr and "above --max-rel-error 1e-12" in res.stderr


def test_bench_outdir_from_another_cwd(outdir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # report.json's model source is found through source_path
    res = _invoke(["bench", str(outdir), *FAST, "--json", "o.json"])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "o.json").read_text())
    assert data["source"] == str(outdir)
    assert data["runners"][0]["accuracy"]["rel_l2"] < 1e-2
    assert data["reference"].startswith("ONNX Runtime")


def test_npz_inputs_used_and_validated(outdir, tmp_path):
    good = tmp_path / "good.npz"
    x = np.random.default_rng(5).standard_normal((2, 3, 32, 32)).astype("float32")
    np.savez(good, input=x)
    res = _invoke(["bench", str(outdir), *FAST, "--inputs", str(good)])
    assert res.exit_code == 0, res.output
    assert str(good) in res.stdout

    cases = {"names": ({"image": x}, "missing input(s) input"),
             "shapes": ({"input": x[:1]}, "has shape [1, 3, 32, 32]"),
             "dtypes": ({"input": x.astype("float64")}, "has dtype float64")}
    for name, (arrays, message) in cases.items():
        bad = tmp_path / f"{name}.npz"
        np.savez(bad, **arrays)
        res = _invoke(["bench", str(outdir), *FAST, "--inputs", str(bad)])
        assert res.exit_code == 1, (name, res.output)
        assert len(res.stderr.strip().splitlines()) == 1 and message in res.stderr, res.stderr
    notnpz = tmp_path / "x.npz"
    notnpz.write_text("not an npz")
    res = _invoke(["bench", str(outdir), *FAST, "--inputs", str(notnpz)])
    assert res.exit_code == 1 and "cannot read as .npz" in res.stderr


def test_bad_npz_fails_before_converting_a_model(cnn, tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, input=np.zeros((2, 3, 31, 32), "float32"))
    res = _invoke(["bench", str(cnn), "--target", "llvm", *SHAPE, "--inputs", str(bad)])
    assert res.exit_code == 1 and "has shape [2, 3, 31, 32]" in res.stderr


def test_cuda_outdir_without_gpu_is_a_clear_error(outdir, tmp_path):
    from amp_cli import tvm_compat

    if tvm_compat.has_cuda_device():
        pytest.skip("a GPU is present")
    fake = tmp_path / "cuda_out"
    shutil.copytree(outdir, fake)
    rep = json.loads((fake / "report.json").read_text())
    rep["target"] = {"kind": "cuda", "arch": "sm_90"}
    (fake / "report.json").write_text(json.dumps(rep))
    res = _invoke(["bench", str(fake), *FAST])
    assert res.exit_code == 1
    assert "CUDA library" in res.stderr and "no GPU" in res.stderr and "--target llvm" in \
        res.stderr


def test_cuda_model_without_gpu_suggests_llvm(cnn):
    from amp_cli import tvm_compat

    if tvm_compat.has_cuda_device():
        pytest.skip("a GPU is present")
    res = _invoke(["bench", str(cnn), *SHAPE, *FAST])
    assert res.exit_code == 1 and "--target llvm" in res.stderr


def test_usage_errors(outdir):
    # the README's table: a bad option or argument is a usage error, exit 2
    res = _invoke(["bench", str(outdir), "--precision", "fp32"])
    assert res.exit_code == 2 and "OUTDIR" in res.stderr and "--precision" in res.stderr
    res = _invoke(["bench", str(outdir), "--compare", "fp32,tensorrt"])
    assert res.exit_code == 2 and "tensorrt" in res.stderr
    res = _invoke(["bench", str(outdir), "--repeat", "0"])
    assert res.exit_code == 2
    for gate in ("--max-rel-error", "--max-latency-ratio"):
        for value in ("-1", "0"):
            res = _invoke(["bench", str(outdir), gate, value])
            assert res.exit_code == 2 and gate in res.stderr, (gate, value, res.stderr)


def test_plot(outdir, tmp_path):
    png = tmp_path / "lat.png"
    res = _invoke(["bench", str(outdir), *FAST, "--plot", str(png)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert res.exit_code == 1 and "pip install matplotlib" in res.stderr
        assert not png.exists()
        return
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kernel_profile_counts_each_kernels_bytes(tmp_path):
    """profile_library's per-kernel bytes: the kernel's tensor arguments (inputs and output)
    once per call, so GB/s can be set against the GPU's bandwidth. y = relu(x + 1) at fp32 is
    one kernel reading x and writing y."""
    from amp_cli.bench.timing import profile_library

    b = models.GraphBuilder(seed=3)
    y = b.op("Relu", [b.op("Add", ["x", b.const(np.float32(1.0))])])
    path = tmp_path / "add_relu.onnx"
    onnx.save(b.model([("x", [64, 48], "float32")], [(y, [64, 48], "float32")]), str(path))
    out = tmp_path / "out"
    res = _invoke(["convert", str(path), "-o", str(out), "--target", "llvm", "--precision",
                   "fp32", "--no-accuracy"])
    assert res.exit_code == 0, res.output
    x = np.random.default_rng(0).standard_normal((64, 48)).astype("float32")
    rows = profile_library(str(out / "model.so"), "cpu", {"x": x}, ["x"])
    kernels = [r for r in rows if "relu" in r["name"]]
    assert len(kernels) == 1, rows
    assert kernels[0]["bytes"] == 2 * 64 * 48 * 4 and kernels[0]["count"] == 1
    assert kernels[0]["gbps"] > 0

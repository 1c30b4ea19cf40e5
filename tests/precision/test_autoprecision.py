"""Accuracy-guided precision (--auto-precision, amp inspect): range fallback, full-fp16 models,
and the bound on evaluated variants.

Models are built here with onnx.helper. Reference: ONNX Runtime fp32; tolerance rel L2 1e-2 on
held-out calibration inputs (N(0, 1), seeds 1000+). The search bound asserted is the one
docs/auto-precision.md states: variants <= 2 * ceil(log2 n) + 3 for n candidate nodes.
"""
from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

import amp_cli
from amp_cli.accuracy import LibraryRunner, metrics, random_inputs
from amp_cli.precision.auto import auto_precision, search_bound
from amp_cli.cli import main
from amp_cli.config import ConvertConfig
from amp_cli.precision import resolve_config
from amp_cli.target import resolve_target

TOL = 1e-2


class _Graph:
    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits = [], []

    def const(self, name, value, dtype="float32"):
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def op(self, op_type, inputs, name, **attrs):
        self.nodes.append(helper.make_node(op_type, inputs, [f"{name}_o"], name=name, **attrs))
        return f"{name}_o"

    def model(self, x_shape, out, out_shape):
        g = helper.make_graph(self.nodes, "t",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, out_shape)],
                              self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        onnx.checker.check_model(m)
        return m


def overflow_model():
    """y = h / sqrt(sum(h*h)) with h = 1000 * (x @ W): h*h reaches ~1e7 > 65504, so naive fp16
    turns the norm into inf and y into 0 (rel L2 1). Only `square` must leave fp16."""
    g = _Graph()
    h = g.op("MatMul", ["x", g.const("w", g.rng.standard_normal((16, 16)) / 4)], "mm")
    h = g.op("Mul", [h, g.const("k", 1000.0)], "scale")
    sq = g.op("Mul", [h, h], "square")
    s = g.op("ReduceSum", [sq, g.const("axes", [-1], "int64")], "sum", keepdims=1)
    r = g.op("Sqrt", [s], "root")
    y = g.op("Div", [h, r], "norm")
    y = g.op("Relu", [g.op("MatMul", [y, g.const("w2", g.rng.standard_normal((16, 8)))], "mm2")],
             "relu")
    return g.model([4, 16], y, [4, 8])


def mlp_model():
    """A well-scaled MLP: full fp16 meets 1e-2."""
    g = _Graph(1)
    x = "x"
    for i in range(3):
        x = g.op("MatMul", [x, g.const(f"w{i}", g.rng.standard_normal((24, 24)) / 5)], f"mm{i}")
        x = g.op("Add", [x, g.const(f"b{i}", g.rng.standard_normal(24) * 0.1)], f"bias{i}")
        x = g.op("Relu", [x], f"relu{i}")
    return g.model([4, 24], x, [4, 24])


def deep_model(blocks=17, width=32):
    """>= 50 nodes (MatMul, Add, Tanh, Mul per block; onnxslim fuses MatMul+Add into Gemm) with
    one precision trap in the middle: `shift` adds 256 before a Softmax (fp32 by policy), so the
    fp16 storage of x + 256 (ulp 0.25) ruins the softmax; no value leaves fp16's range."""
    g = _Graph(2)
    x = "x"
    for b in range(blocks):
        x = g.op("MatMul", [x, g.const(f"w{b}", g.rng.standard_normal((width, width)) * 1.5
                                       / np.sqrt(width))], f"mm{b}")
        x = g.op("Add", [x, g.const(f"b{b}", g.rng.standard_normal(width) * 0.1)], f"bias{b}")
        x = g.op("Tanh", [x], f"act{b}")
        if b == blocks // 2:
            x = g.op("Add", [x, g.const("big", 256.0)], "shift")
            x = g.op("Softmax", [x], "soft", axis=-1)
            x = g.op("Mul", [x, g.const("width", float(width))], "rescale")
        x = g.op("Mul", [x, g.const(f"g{b}", 1 + 0.1 * g.rng.standard_normal(width))], f"gain{b}")
    return g.model([8, width], x, [8, width])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("ap")
    out = {}
    for name, fn in {"overflow": overflow_model, "mlp": mlp_model, "deep": deep_model}.items():
        p = d / f"{name}.onnx"
        onnx.save(fn(), str(p))
        out[name] = p
    return out


def _resolved(**auto):
    cfg = ConvertConfig(target="llvm")
    cfg.auto_precision.enabled = True
    for k, v in auto.items():
        setattr(cfg.auto_precision, k, v)
    return resolve_config(cfg, "llvm")


def test_overflow_model_is_correct_by_default(files, tmp_path):
    """No flag: the plain fp16 conversion breaks the output (inf in the norm), so amp runs the
    accuracy-guided search on its own and writes an accurate library, saying so."""
    out = tmp_path / "default"
    res = CliRunner().invoke(main, ["convert", str(files["overflow"]), "-o", str(out),
                                    "--target", "llvm"])
    assert res.exit_code == 0, res.output
    assert "ran its accuracy-guided search" in res.output
    report = json.loads((out / "report.json").read_text())
    assert report["accuracy"]["within_tolerance"]
    assert report["accuracy"]["worst"]["nonfinite_share"] == 0
    assert {k["node"] for k in report["auto_precision"]["kept"] if k["reason"] == "range"} \
        == {"square"}


def test_overflow_model_without_the_search_exits_4_and_writes_nothing(files, tmp_path):
    out = tmp_path / "plain"
    res = CliRunner().invoke(main, ["convert", str(files["overflow"]), "-o", str(out),
                                    "--target", "llvm", "--no-auto-precision"])
    assert res.exit_code == 4, res.output
    assert "accuracy check failed" in res.stderr and "nothing written" in res.stderr
    assert not out.exists()
    res = CliRunner().invoke(main, ["convert", str(files["overflow"]), "-o", str(out),
                                    "--target", "llvm", "--no-auto-precision",
                                    "--allow-inaccurate"])
    assert res.exit_code == 0, res.output
    worst = json.loads((out / "report.json").read_text())["accuracy"]["worst"]
    assert worst["nonfinite_share"] > 0 or worst["rel_l2"] > TOL
    assert "written anyway (--allow-inaccurate)" in res.output
    assert "ABOVE TOLERANCE" in res.output  # the summary line reads the report's "inf"s


def test_overflow_model_cli_convert(files, tmp_path):

    out = tmp_path / "auto"
    res = CliRunner().invoke(main, ["convert", str(files["overflow"]), "-o", str(out),
                                    "--target", "llvm", "--auto-precision",
                                    "--tolerance", f"rel_l2={TOL}"])
    assert res.exit_code == 0, res.output
    assert "auto precision: kept in fp32" in res.output
    report = json.loads((out / "report.json").read_text())
    acc = report["accuracy"]
    assert acc["worst"]["nonfinite_share"] == 0 and acc["worst"]["rel_l2"] < TOL
    assert acc["within_tolerance"]
    ap = report["auto_precision"]
    chosen = {k["node"]: k["reason"] for k in ap["kept"]
              if k["reason"] in ("range", "range-input", "underflow", "tolerance")}
    assert chosen == {"square": "range"}  # only the overflowing node, for its range
    assert ap["analysis"]["first_nonfinite"] == "square"
    sq = next(n for n in ap["analysis"]["nodes"] if n["node"] == "square")
    assert sq["max_abs"] > 65504 and sq["kept"] == "values leave the float16 range"
    assert ap["search"]["met"] and ap["search"]["variants_evaluated"] == 1
    # every fp32 node says why: range, policy (sum, sqrt) or following an fp32 input
    assert {k["reason"] for k in ap["kept"]} <= {"range", "policy", "fp32-input"}
    md = (out / "report.md").read_text()
    assert "## Auto precision" in md and "| square | Mul | values leave the float16 range" in md
    assert "first node producing inf/NaN: `square`" in md
    if importlib.util.find_spec("matplotlib"):
        assert (out / "sensitivity.png").stat().st_size > 0
    else:  # skipped cleanly, and said so
        assert not (out / "sensitivity.png").exists()
        assert any("matplotlib" in n for n in ap["notes"])

    # The library itself: finite and close to ORT on fresh inputs.
    loaded = amp_cli.load(files["overflow"])
    feeds = random_inputs(loaded.inputs, seed=77)
    got = LibraryRunner(str(out / "model.so"))(feeds, ["x"])[0]
    assert np.isfinite(got).all()
    assert metrics(loaded.reference(feeds)[0], got)["rel_l2"] < TOL


def test_full_fp16_meets_tolerance_no_fallback(files):
    loaded = amp_cli.load(files["mlp"])
    res = auto_precision(loaded, _resolved(tolerance=TOL))
    assert res.met and res.reasons == {}  # nothing kept for range or tolerance
    assert [t.phase for t in res.trials] == ["base"] and res.builds == 1
    assert res.final_metric < TOL
    assert all(k["reason"] != "tolerance" for k in res.kept)
    assert res.analysis.first_nonfinite is None


def test_deep_model_search_is_logarithmic(files):
    loaded = amp_cli.load(files["deep"])
    assert len(loaded.node_types) >= 50
    res = auto_precision(loaded, _resolved(tolerance=TOL))
    n = res.candidates
    assert n >= 50
    bound = 2 * math.ceil(math.log2(n)) + 3
    assert search_bound(n) == bound
    assert res.trials[0].phase == "base" and not res.trials[0].passed  # fp16 alone fails
    assert res.met and res.final_metric < TOL
    # the trap, found by its per-edge error score, in the middle of the graph
    assert res.reasons == {"shift": "tolerance"}
    assert len(res.trials) <= bound
    d = res.to_dict()["search"]
    assert d["variants_evaluated"] == len(res.trials) and d["bound_value"] == bound

    # A tolerance only a large share of fp32 nodes meets: the search works harder, within
    # the bound, and still keeps fewer nodes than the candidates.
    res2 = auto_precision(loaded, _resolved(tolerance=2e-3))
    assert len(res2.trials) <= bound
    assert res2.builds <= len(res2.trials)
    assert res2.met
    kept = [k for k, why in res2.reasons.items() if why == "tolerance"]
    assert "shift" in kept and len(kept) < n


def test_inspect_prints_analysis_without_library(files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["inspect", str(files["overflow"]), "--target", "llvm",
                                    "--no-search"])
    assert res.exit_code == 0, res.output
    assert "first node producing inf/NaN: `square`" in res.output
    assert "| square | Mul | values leave the float16 range" in res.output
    res = CliRunner().invoke(main, ["inspect", str(files["overflow"]), "--target", "llvm",
                                    "--json", "--calibration-samples", "2"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["search"]["variants_evaluated"] == 1 and data["calibration"]["samples"] == 2
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_calibration_npz_and_bad_options(files, tmp_path):
    loaded = amp_cli.load(files["overflow"])
    x = np.random.default_rng(5).standard_normal((3, 4, 16)).astype("float32")
    npz = tmp_path / "cal.npz"
    np.savez(npz, x=x)
    res = auto_precision(loaded, _resolved(calibration=str(npz)), search=False)
    assert res.calibration["samples"] == 3 and res.reasons == {"square": "range"}
    np.savez(tmp_path / "bad.npz", y=x)
    r = CliRunner().invoke(main, ["inspect", str(files["overflow"]), "--target", "llvm",
                                  "--calibration", str(tmp_path / "bad.npz")])
    assert r.exit_code == 1 and "missing calibration input(s) x" in r.output
    r = CliRunner().invoke(main, ["inspect", str(files["overflow"]), "--target", "llvm",
                                  "--tolerance", "l3=1"])
    assert r.exit_code == 1 and "metric must be one of" in r.output


def test_bf16_fallback_runs_kept_nodes_in_bf16(files):
    loaded = amp_cli.load(files["overflow"])
    res = auto_precision(loaded, _resolved(fallback="bf16"))
    assert res.met and res.reasons == {"square": "range"}
    mod, _ = res.convert(loaded)
    assert "bfloat16" in mod.script()


def test_first_nonfinite_call_names_the_overflowing_kernel(files, tmp_path):
    """What convert reports when a GPU build writes inf/NaN, checked on a CPU build: the first
    kernel whose arguments hold inf after it ran is the one computing the square (h*h)."""
    from amp_cli.accuracy import first_nonfinite_call
    from amp_cli.compile import build
    from amp_cli.precision import convert_precision

    model = amp_cli.load(files["overflow"])
    mod, _ = convert_precision(model.mod, amp_cli.PrecisionConfig(precision="fp16"))
    lib = build(mod, resolve_target("llvm"), str(tmp_path / "m.so"), isolate=False).library
    feeds = random_inputs(model.inputs, 0)
    found = first_nonfinite_call(lib, "cpu", feeds, ["x"])
    assert found is not None and "multiply" in found["kernel"], found
    fp32, _ = convert_precision(model.mod, amp_cli.PrecisionConfig(precision="fp32"))
    lib32 = build(fp32, resolve_target("llvm"), str(tmp_path / "f.so"), isolate=False).library
    assert first_nonfinite_call(lib32, "cpu", feeds, ["x"]) is None

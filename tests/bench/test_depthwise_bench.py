"""benchmarks/depthwise_bench.py on a machine without a GPU: the dry run compiles each layer's
kernel both ways (amp's with the switch on, TOPI's with it off) and writes its table and JSON;
its float64 layer reference agrees with an llvm build of the layer; the stand-in model exports.
No timing is asserted."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tvm")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("depthwise_bench",
                                                  ROOT / "benchmarks/depthwise_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_builds_both_kernels_per_layer(bench, tmp_path, capsys):
    out = tmp_path / "dw.json"
    assert bench.main(["--dry-run", "--models", "", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["layers"]) == len(bench.LAYERS)
    for row in result["layers"]:
        assert "amp_dwconv" in row["amp_kernel"], row
        assert "conv2d" in row["amp_off_kernel"], row
        assert not any(k.endswith("_error") for k in row), row
    assert "floor us" in capsys.readouterr().out


def test_layer_reference_matches_the_relax_layer(bench):
    import tvm

    mod, w, bias = bench.layer_module(1, 12, 16, 5, 2, "silu")
    x = np.random.default_rng(0).uniform(-1, 1, (1, 12, 12, 16)).astype("float16")
    ex = tvm.compile(mod, target="llvm")
    got = tvm.relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    ref = bench.layer_reference(x, w, bias, 2, "silu")
    np.testing.assert_allclose(got.astype(np.float64), ref, rtol=2e-3,
                               atol=2e-3 * np.abs(ref).max())


def test_stand_in_model_exports(bench, tmp_path):
    pytest.importorskip("torch")
    import onnxruntime as ort

    result = {"notes": []}
    models = bench.export_models(["convnext_tiny"], 1, 32, tmp_path, True, result)
    m = models["convnext_tiny"]
    sess = ort.InferenceSession(str(m["onnx"]), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, m["feed"])
    assert y.shape[0] == 1 and np.isfinite(y).all() and float(y.std()) > 0

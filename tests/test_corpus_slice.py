"""Real exported models, as issue 20 found them failing: ONNX's own model-zoo graphs that ship in
the onnx wheel (onnx/backend/test/data/light/), converted for llvm and checked against ONNX
Runtime fp32 by amp's own accuracy check (tolerance: accuracy.rel_l2_tolerance, 0.05; no
inf/NaN). The default run takes one model per failure class; the whole folder at fp16 and bf16,
and the whole real-model corpus (benchmarks/corpus: torchvision, transformers, LSTM/GRU, a
YOLO-style head; needs those packages), are `slow`.

The light models' weights are ConstantOfShape fills, so their outputs are nearly uniform:
they test that conversion works and stays finite, not fine accuracy (docs/corpus.md).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

import amp_cli

LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
REPO = Path(__file__).resolve().parent.parent
# failure class at 1bf51b7 -> the smallest light model showing it
# (ONNX Sum -> stack of mixed dtypes, light_resnet50's class, is tests/precision/test_graphs.py's
# "sum" graph in the default run: the 415-node model itself is slow.)
SLICE = {
    "light_densenet121": "Concat of fp16 and fp32 members (TypeError in the precision pass)",
    "light_zfnet512": "fp32 activations above 65504: 100 % inf at exit 0",
}


def _convert(name: str, precision: str):
    model = amp_cli.load(LIGHT / f"{name}.onnx")
    conv = amp_cli.convert(model, amp_cli.ConvertConfig(
        target="llvm", precision=amp_cli.PrecisionConfig(precision=precision)), isolate=False)
    conv.cleanup()
    return conv


def _assert_accurate(conv):
    worst = conv.accuracy["worst"]
    assert conv.accuracy["within_tolerance"] and worst["nonfinite_share"] == 0, worst


@pytest.mark.parametrize("name", list(SLICE), ids=list(SLICE))
def test_light_model_converts_accurately(name):
    _assert_accurate(_convert(name, "fp16"))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(p.stem for p in LIGHT.glob("*.onnx")))
def test_every_light_model(name, precision):
    _assert_accurate(_convert(name, precision))


@pytest.mark.slow
def test_whole_corpus_converts(tmp_path):
    """benchmarks/corpus at tiny scale, both exporters, fp16 and bf16 on llvm: every model that
    exported converts with exit 0 and meets the tolerance or has a degenerate reference."""
    pytest.importorskip("torchvision")
    pytest.importorskip("transformers")
    corpus, results = tmp_path / "corpus", tmp_path / "results.json"
    run = [sys.executable, "-m", "benchmarks.corpus"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run(run + ["export", str(corpus), "--scale", "tiny"], check=True, cwd=REPO,
                   env=env)
    subprocess.run(run + ["run", str(corpus), "--target", "llvm", "--precision", "fp16,bf16",
                          "--json", str(results)], cwd=REPO, env=env)
    rows = json.loads(results.read_text())["rows"]
    failed = [r for r in rows if r.get("rc") not in (0, None)]  # None: did not export
    assert not failed, [(r["name"], r["exporter"], r["prec"], r.get("error")) for r in failed]

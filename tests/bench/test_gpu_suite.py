"""benchmarks/gpu_suite.py without a GPU: the corpus models it takes (--corpus), and the
issue-21 summary it prints last (geometric mean of amp fp16 / reduce-overhead, bf16 / fp16)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_suite  # noqa: E402
from benchmarks.corpus import suite as corpus_suite  # noqa: E402


def _runner(name, p50):
    return {"name": name, "latency": {"p50_ms": p50}}


def test_summary_gives_geometric_mean_worst_model_and_bf16_ratio():
    result = {"models": {
        "a": {"runners": [_runner("amp fp16", 0.5), _runner(gpu_suite.BEST_TORCH, 1.0),
                          _runner("amp bf16", 0.55)]},
        "b": {"runners": [_runner("amp fp16", 2.0), _runner(gpu_suite.BEST_TORCH, 1.0)]},
        "c": {"runners": [_runner("amp fp16", 1.0), {"name": gpu_suite.BEST_TORCH,
                                                     "latency": None}]},
    }}
    lines = gpu_suite.summary_lines(result)
    geo = math.sqrt(0.5 * 2.0)
    assert lines[0].startswith(f"amp fp16 / {gpu_suite.BEST_TORCH}: geometric mean "
                               f"{geo:.2f}x over 2 models")
    assert "worst b 2.00x" in lines[0] and "not compared: c" in lines[0]
    assert lines[1] == "amp bf16 / amp fp16: a 1.10x (goal <= 1.05x)"


def test_no_comparable_model_prints_no_summary():
    assert gpu_suite.summary_lines({"models": {"a": {"runners": []}}}) == []


def test_corpus_names_expand_default_and_reject_unknown_names():
    names = corpus_suite.names("default,lstm,resnet50")
    assert names[:len(corpus_suite.DEFAULT.split(","))] == corpus_suite.DEFAULT.split(",")
    assert names.count("resnet50") == 1 and names[-1] == "lstm"
    with pytest.raises(SystemExit, match="unknown model.*resnet5; the corpus has: .*bert"):
        corpus_suite.names("resnet5 ")


def test_suite_args_take_corpus_options():
    args = gpu_suite.parse_args(["--models", "", "--corpus", "default", "--exporter", "both",
                                 "--max-autotune"])
    assert (args.models, args.corpus, args.exporter, args.max_autotune) == (
        "", "default", "both", True)


def test_corpus_bench_model_exports_the_module_it_times(tmp_path):
    """At tiny scale: the ONNX export and the torch module agree (ORT vs torch on the model's
    own valid feeds), so the suite compares amp and torch on the same network."""
    pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    ort = pytest.importorskip("onnxruntime")
    import onnx
    import torch

    model = corpus_suite.bench_model("squeezenet1_0", batch=2, exporter="legacy", scale="tiny")
    assert model.name == "squeezenet1_0.legacy" and model.batch == 2
    w = model.make_weights()
    feeds = model.make_feeds(w)
    assert list(feeds) == ["input"] and feeds["input"].shape == (2, 3, 64, 64)
    assert np.abs(feeds["input"]).mean() > 0.1  # random, not zeros
    path = tmp_path / "m.onnx"
    onnx.save(model.make_onnx(w), str(path))
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    with torch.no_grad():
        want = model.make_torch(w)(torch.from_numpy(feeds["input"])).numpy()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_profiled_precisions_are_the_built_ones_asked_for():
    """--profile-precisions picks which amp builds get a graph-free twin to profile (the bf16
    one is how a bf16 build slower than fp16 is looked into); --no-profile turns all off."""
    def profiled(*argv):
        return gpu_suite.profiled_precisions(gpu_suite.parse_args(list(argv)))

    assert profiled() == ["fp16"]
    assert profiled("--amp-precisions", "fp16,bf16", "--profile-precisions", "fp16,bf16") == [
        "fp16", "bf16"]
    assert profiled("--amp-precisions", "fp16", "--profile-precisions", "bf16") == []
    assert profiled("--amp-precisions", "fp16,bf16", "--profile-precisions", "bf16",
                    "--no-profile") == []
    assert gpu_suite.no_graph_label("bf16") == "amp bf16, no CUDA graph"

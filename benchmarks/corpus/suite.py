"""Corpus models as benchmark-suite models (``benchmarks/gpu_suite.py --corpus NAMES``).

The GPU suite times the *same* torch module under PyTorch and its ONNX export under amp. For a
corpus model that module comes from ``zoo`` at full scale (torchvision at 224 px, transformers
at base size) with the corpus's seeded weights, BatchNorm calibration and zero-weight
re-initialization, and the ONNX file is exported in the run by ``torch.onnx.export`` (the
dynamo exporter unless told otherwise), so the suite measures what a user's export gives.
Inputs are the corpus's valid ones (token ids below the vocabulary, 0/1 padding masks).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from . import zoo

# issue 21's table plus a detector and more transformers: the suite's default real models
DEFAULT = ("resnet50,mobilenet_v3_large,efficientnet_b0,convnext_tiny,vit_b_16,bert,gpt2,"
           "yolo_head,whisper_encoder")


def names(spec: str) -> list[str]:
    """The corpus model names in ``spec`` ("default" expands to :data:`DEFAULT`); an unknown
    name raises SystemExit with the known ones."""
    known = {e.name for e in zoo.list_entries()}
    out = []
    for name in (n.strip() for n in spec.split(",")):
        if name == "default":
            out += DEFAULT.split(",")
        elif name:
            out.append(name)
    unknown = [n for n in out if n not in known]
    if unknown:
        raise SystemExit(f"--corpus: unknown model(s) {', '.join(unknown)}; the corpus has: "
                         f"{', '.join(sorted(known))}")
    return list(dict.fromkeys(out))


def bench_model(name: str, batch: int = 8, exporter: str = "dynamo", seed: int = 0,
                scale: str = "full"):
    """A ``benchmarks.models.BenchModel`` for corpus model ``name`` (torch needed to build it)."""
    from benchmarks.models import BenchModel

    from .export import calibrate_batchnorm, export_onnx, reinit_zero_weights

    entry = next(e for e in zoo.list_entries() if e.name == name)

    def make_weights() -> dict:
        import torch

        torch.manual_seed(seed)
        built = entry.build(scale, batch)
        reinit_zero_weights(built.module)
        calibrate_batchnorm(built.module, built.inputs, np.random.default_rng(seed))
        feeds = zoo.make_inputs(built.inputs, np.random.default_rng(seed))
        return {"module": built.module, "feeds": feeds, "inputs": built.inputs}

    def make_onnx(w: dict):
        import onnx

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"{name}.onnx"
            export_onnx(w["module"], w["feeds"], path, exporter)
            return onnx.load(str(path))

    return BenchModel(
        f"{name}.{exporter}", f"{entry.family} {name} ({entry.tag}), {scale} scale, batch "
                              f"{batch}, torch.onnx.export {exporter}",
        {}, make_weights, make_onnx, lambda w: w["module"],
        make_feeds=lambda w: dict(w["feeds"]), batch_size=batch)

"""Shared test fixtures: small models written to tmp_path, a CLI runner, a clean temp dir."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

AMP = str(Path(sys.executable).with_name("amp"))  # the venv's console script


@pytest.fixture
def tiny_onnx(tmp_path) -> Path:
    """amp_cli.models.tiny_cnn (input 'input', dims [batch, 3, 32, 32]) as tmp_path/tiny.onnx."""
    import onnx

    from amp_cli import models

    path = tmp_path / "tiny.onnx"
    onnx.save(models.tiny_cnn(), str(path))
    return path


@pytest.fixture
def fp16_encoder_layer(tmp_path):
    """A BERT-shaped encoder layer (2x64 tokens, hidden 128, 2 heads, FFN 256) exported to ONNX,
    loaded and converted to fp16: the Relax module amp's CUDA pipeline starts from."""
    import onnx

    import amp_cli
    from amp_cli import models
    from amp_cli.config import PrecisionConfig
    from amp_cli.precision import convert_precision

    b = models.GraphBuilder(seed=3)
    y = b.encoder_layer("x", batch=2, seq=64, hidden=128, heads=2, ffn=256)
    model = b.model([("x", [2, 64, 128], "float32")], [(y, [2, 64, 128], "float32")])
    onnx.save(model, str(tmp_path / "layer.onnx"))
    loaded = amp_cli.load(tmp_path / "layer.onnx")
    return convert_precision(loaded.mod, PrecisionConfig(precision="fp16"), loaded.node_types)[0]


@pytest.fixture
def cli():
    """cli(*args) -> click Result of `amp *args` run in-process (stdout and stderr apart)."""
    from click.testing import CliRunner

    from amp_cli.cli import main

    def invoke(*args, **kwargs):
        return CliRunner().invoke(main, [str(a) for a in args], **kwargs)

    return invoke


@pytest.fixture
def clean_tmp(tmp_path, monkeypatch) -> Path:
    """A private TMPDIR (for this process and subprocesses), to assert amp leaves no temp files
    behind without seeing other processes' ones."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setenv("TMPDIR", str(d))
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def amp_env(**extra) -> dict:
    """os.environ for an `amp` subprocess, plus `extra` (None removes a variable)."""
    env = dict(os.environ)
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env

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

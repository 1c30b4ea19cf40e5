"""PyTorch models: torch.export .pt2 files and pkg.module:factory specs, checked vs torch fp32."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import amp_cli
from amp_cli.cli import main

torch = pytest.importorskip("torch")

TOL_FP16 = 1e-2


def test_factory_spec_cli(tmp_path):
    out = tmp_path / "o"
    res = CliRunner().invoke(main, ["convert", "amp_cli.models:torch_tiny_convnet", "-o",
                                    str(out), "--target", "llvm", "--input-shape", "x:2x3x16x16"])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert report["model"]["format"] == "torch"
    assert report["accuracy"]["worst"]["rel_l2"] < TOL_FP16
    assert report["precision"]["converted_ops"] > 0


def test_pt2_file(tmp_path):
    from amp_cli.models import torch_tiny_convnet

    module = torch_tiny_convnet()
    ep = torch.export.export(module, (torch.randn(1, 3, 16, 16),))
    path = tmp_path / "m.pt2"
    torch.export.save(ep, str(path))
    loaded = amp_cli.load(path)
    assert [i.shape for i in loaded.inputs] == [[1, 3, 16, 16]]
    cfg = amp_cli.ConvertConfig(target="llvm")
    cfg.precision.precision = "bf16"
    conv = amp_cli.convert(loaded, cfg)
    try:
        assert conv.accuracy["worst"]["rel_l2"] < 3e-2
        assert any(k.endswith(":bfloat16") for k in conv.precision.ops_by_dtype)
    finally:
        conv.cleanup()


def test_factory_needs_shapes():
    res = CliRunner().invoke(main, ["convert", "amp_cli.models:torch_tiny_convnet", "-o",
                                    "/tmp/amp-never-written", "--target", "llvm"])
    assert res.exit_code == 1
    assert "--input-shape" in res.output

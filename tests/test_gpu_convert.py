"""On a CUDA device: converted models run on the GPU and match ONNX Runtime fp32.

Tolerance (relative L2 per output): fp16 with fp32 accumulation 1e-2, bf16 3e-2. Skipped where
there is no GPU (CI); run on the lent H200 with `pytest -m gpu`.
"""
from __future__ import annotations

import onnx
import pytest

import amp_cli
from amp_cli import models, tvm_compat

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not tvm_compat.has_cuda_device(), reason="needs a CUDA GPU")]
TOL = {"fp16": 1e-2, "bf16": 3e-2}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("name", ["tiny_cnn", "tiny_bert"])
def test_converted_model_runs_on_gpu(tmp_path, name, precision):
    path = tmp_path / f"{name}.onnx"
    onnx.save(models.EXAMPLES[name](), str(path))
    shapes = {"input": [2, 3, 32, 32]} if name == "tiny_cnn" else {}
    cfg = amp_cli.ConvertConfig(target="cuda")
    cfg.precision.precision = precision
    cfg.accuracy.samples = 2
    conv = amp_cli.convert(amp_cli.load(path, input_shapes=shapes), cfg)
    try:
        acc = conv.accuracy
        assert acc["device"] == "cuda"
        assert acc["worst"]["nonfinite_share"] == 0
        assert acc["worst"]["rel_l2"] < TOL[precision], acc["worst"]
        print(f"{name} {precision} on {conv.target.arch}: {acc['worst']}")
    finally:
        conv.cleanup()


def test_tensor_core_matmul_runs_on_gpu(tmp_path):
    """The seed's repro shape (MatMul [8,128,1024] x [1024,4096]) as fp16 on tensor cores."""
    b = models.GraphBuilder(seed=1)
    y = b.op("MatMul", ["x", b.weight(1024, 4096)])
    path = tmp_path / "mm.onnx"
    onnx.save(b.model([("x", [8, 128, 1024], "float32")], [(y, [8, 128, 4096], "float32")]),
              str(path))
    conv = amp_cli.convert(amp_cli.load(path), amp_cli.ConvertConfig(target="cuda"))
    try:
        assert conv.build.tensor_core_kernels >= 1
        assert conv.accuracy["device"] == "cuda"
        assert conv.accuracy["worst"]["rel_l2"] < TOL["fp16"]
        print("matmul fp16 tensor-core:", conv.accuracy["worst"])
    finally:
        conv.cleanup()


def test_bert_layer_on_amp_gemm_schedule_runs_on_gpu(tmp_path):
    """An encoder layer with tensor-core-sized GEMMs (every GEMM on tc_gemm's cp.async schedule
    after matmul_nt; the layer shape where bert-large hit cudaErrorMisalignedAddress before)."""
    b = models.GraphBuilder(seed=4)
    y = b.encoder_layer("x", batch=2, seq=128, hidden=256, heads=4, ffn=1024)
    path = tmp_path / "layer.onnx"
    onnx.save(b.model([("x", [2, 128, 256], "float32")], [(y, [2, 128, 256], "float32")]),
              str(path))
    cfg = amp_cli.ConvertConfig(target="cuda")
    cfg.accuracy.samples = 2
    conv = amp_cli.convert(amp_cli.load(path), cfg)
    try:
        assert conv.build.tensor_core_kernels >= 5
        assert conv.accuracy["device"] == "cuda"
        assert conv.accuracy["worst"]["rel_l2"] < TOL["fp16"], conv.accuracy["worst"]
        print("bert layer fp16 on tc_gemm:", conv.accuracy["worst"])
    finally:
        conv.cleanup()


def test_implicit_gemm_convs_run_on_gpu(tmp_path):
    """cuda.implicit_gemm: padded/strided convs with C % 8 == 0 read the image inside the GEMM
    (predicated cp.async); against ONNX Runtime fp32 within the fp16 tolerance."""
    b = models.GraphBuilder(seed=5)
    x = b.conv_bn_relu("input", 3, 32, k=3, stride=2)   # stem (C=3): im2col
    x = b.conv_bn_relu(x, 32, 64, k=3)                 # implicit, padded
    x = b.conv_bn_relu(x, 64, 64, k=3, stride=2)       # implicit, strided
    x = b.conv_bn_relu(x, 64, 128, k=1, stride=2)      # implicit 1x1 stride 2
    y = b.op("Flatten", [b.op("GlobalAveragePool", [x])], axis=1)
    path = tmp_path / "cnn.onnx"
    onnx.save(b.model([("input", [4, 3, 64, 64], "float32")], [(y, [4, 128], "float32")]),
              str(path))
    cfg = amp_cli.ConvertConfig(target="cuda")
    cfg.cuda.implicit_gemm = True
    cfg.accuracy.samples = 2
    conv = amp_cli.convert(amp_cli.load(path), cfg)
    try:
        assert sum("implicit" in k for k in conv.build.kernels) >= 3, conv.build.kernels
        assert not conv.build.rule_failures, conv.build.rule_failures
        assert conv.accuracy["device"] == "cuda"
        assert conv.accuracy["worst"]["rel_l2"] < TOL["fp16"], conv.accuracy["worst"]
        print("implicit-GEMM CNN fp16:", conv.accuracy["worst"])
    finally:
        conv.cleanup()

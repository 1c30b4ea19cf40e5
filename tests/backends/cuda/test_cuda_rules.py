"""dlight rules that raise on kernels they mis-match must not abort a CUDA build.

Both graphs were found by tests/test_fuzz.py: stock dlight's GEMV rule asserts on the GEMM of a
conv with one output channel, and its Reduction rule's rfactor fails on a mean to a scalar.
amp's pipeline treats a raising rule as "not applicable" and tries the next one.
"""
from __future__ import annotations

import onnx
import pytest

import amp_cli
from amp_cli import models


def _conv_one_channel():
    b = models.GraphBuilder(seed=7)
    y = b.op("Conv", ["x", b.weight(1, 5, 3, 3)], kernel_shape=[3, 3], strides=[2, 2],
             pads=[1, 1, 1, 1])
    return b.model([("x", [1, 5, 17, 17], "float32")], [(y, [1, 1, 9, 9], "float32")])


def _mean_to_scalar():
    b = models.GraphBuilder(seed=8)
    y = b.op("ReduceMean", ["x"], keepdims=0)
    return b.model([("x", [9, 23, 23], "float32")], [(y, [], "float32")])


@pytest.mark.parametrize("make", [_conv_one_channel, _mean_to_scalar])
def test_raising_rule_falls_through(tmp_path, make):
    path = tmp_path / "m.onnx"
    onnx.save(make(), str(path))
    cfg = amp_cli.ConvertConfig(target="cuda:sm_90")
    conv = amp_cli.convert(amp_cli.load(path), cfg)
    try:
        assert conv.build.cuda_source_bytes > 0
        assert conv.accuracy["worst"]["rel_l2"] < 1e-2  # the CPU build of the same module
    finally:
        conv.cleanup()

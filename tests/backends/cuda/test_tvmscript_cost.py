"""A CUDA build parses no TVMScript through the slow ``inspect.stack()``.

TVMScript's ``@T.prim_func`` calls ``inspect.stack()`` for every function it parses, and
``inspect.getmodule`` scans all of ``sys.modules`` for each frame. TVM's tensor intrinsics
(~250 prim_funcs) are imported lazily by dlight's ``MatmulTensorization`` the first time a
fp16 GEMM it schedules appears -- e.g. a conv GEMM with K = 3*11*11 = 363, which amp's own
tensor-core schedule declines. Imported that way they cost 30-40 s of every CUDA build of such
a model (measured: this test's one 3-channel 11x11 conv, 39 s of a 40 s build;
light_bvlc_alexnet's whole `amp convert`, 149 s before, 58 s after). amp's pipeline imports
them first, under ``tvm_compat.fast_tvmscript_parsing``.

The check is on the mechanism, not on time: a fresh interpreter whose ``inspect.stack`` counts
its calls builds the model; no call may reach it.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("tvm")
pytest.importorskip("onnx")

PROBE = textwrap.dedent("""
    import inspect, sys
    calls = []
    slow = inspect.stack
    def counting(context=1):
        calls.append(1)
        return slow(context)
    inspect.stack = counting

    import onnx
    import amp_cli
    from amp_cli import models
    from amp_cli.compile.build import build
    from amp_cli.config import PrecisionConfig
    from amp_cli.precision import convert_precision
    from amp_cli.target import resolve_target

    b = models.GraphBuilder(seed=0)
    y = b.op("Conv", ["x", b.weight(96, 3, 11, 11)], kernel_shape=[11, 11], strides=[4, 4])
    onnx.save(b.model([("x", [1, 3, 227, 227], "float32")], [(y, [1, 96, 55, 55], "float32")]),
              sys.argv[1])
    m = amp_cli.load(sys.argv[1])
    mod, _ = convert_precision(m.mod, PrecisionConfig(precision="fp16"), m.node_types)
    build(mod, resolve_target("cuda:sm_90", check_toolchain=False), sys.argv[2], isolate=False)
    print("RESULT", len(calls), "tvm.s_tir.tensor_intrin.cuda" in sys.modules)
""")


def test_cuda_build_parses_tvmscript_fast(tmp_path):
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "conv.onnx"),
                          str(tmp_path / "conv.so")], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")][-1]
    _, slow_calls, imported = line.split()
    # the intrinsics were needed (else the test shows nothing) and imported the fast way
    assert imported == "True"
    assert slow_calls == "0", f"{slow_calls} TVMScript parses went through inspect.stack()"

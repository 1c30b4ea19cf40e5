"""Which schedule rule took each CUDA kernel (rules/fallible.py): recorded by the wrapped rules
and by dlight's Fallback, with the kernel's reduction size, and shown in the build report
(report.json ``build.kernel_schedules``; report.md names compute kernels left on Fallback)."""
from __future__ import annotations

import pytest

tvm = pytest.importorskip("tvm")

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.rules.fallible import fallible, recorded_fallback, \
    reduction_extent  # noqa: E402


def _sum_module(k: int):
    te = tvm.te
    a = te.placeholder((64, k), "float32", name="a")
    r = te.reduce_axis((0, k), name="r")
    s = te.compute((64,), lambda i: te.sum(a[i, r] * a[i, r], axis=r), name="sumsq")
    e = te.compute((64, k), lambda i, j: a[i, j] + 1.0, name="add_one")
    return tvm.IRModule({"sumsq": te.create_prim_func([a, s]).with_attr("amp.kernel", "sumsq"),
                         "add_one": te.create_prim_func([a, e]).with_attr("amp.kernel",
                                                                         "add_one")})


def test_the_rule_of_every_kernel_is_recorded_with_its_reduction():
    dl = tvm_compat.dlight()
    mod = _sum_module(300)
    assert reduction_extent(mod["sumsq"]) == 300 and reduction_extent(mod["add_one"]) == 0
    records: list = []
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with target:
        out = dl.ApplyDefaultSchedule(recorded_fallback(records))(mod)
    assert sorted((r["kernel"], r["rule"], r["reduction"]) for r in records) == [
        ("add_one", "Fallback", 0), ("sumsq", "Fallback", 300)]
    assert all(f.attrs.get("tirx.is_scheduled") for _, f in out.functions_items())
    # a wrapped rule records what it takes; the kernels it declines go on to the next rule
    records.clear()
    with target:
        dl.ApplyDefaultSchedule(fallible(dl.gpu.Reduction(), [], records),
                                recorded_fallback(records))(_sum_module(300))
    assert sorted((r["kernel"], r["rule"]) for r in records) == [
        ("add_one", "Fallback"), ("sumsq", "Reduction")]


def test_the_build_report_lists_the_rules(tmp_path):
    """`amp convert --target cuda:sm_90` of a small conv net: report.json has every kernel's
    rule (the conv GEMMs on amp's matmul rule, with their K), report.md the counts."""
    import json

    onnx = pytest.importorskip("onnx")
    import numpy as np
    from click.testing import CliRunner
    from onnx import TensorProto, helper, numpy_helper

    from amp_cli.cli import main

    rng = np.random.default_rng(0)
    init = [numpy_helper.from_array((rng.standard_normal((32, 16, 3, 3)) * 0.1).astype(
        np.float32), "W")]
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y"])], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16, 20, 20])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32, 20, 20])], init)
    path = tmp_path / "conv.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["convert", str(path), "-o", str(out), "--target",
                                    "cuda:sm_90", "--no-accuracy"])
    assert res.exit_code == 0, res.output
    build = json.loads((out / "report.json").read_text())["build"]
    rules = {r["kernel"]: (r["rule"], r["reduction"]) for r in build["kernel_schedules"]}
    gemm = [k for k in rules if "conv_gemm" in k]
    assert gemm and rules[gemm[0]] == ("AmpMatmul", 16 * 9), rules
    assert set(rules) <= set(build["kernels"])
    md = (out / "report.md").read_text()
    assert "- schedule rules: " in md and "AmpMatmul 1" in md
    assert "generic fallback schedule" not in md  # nothing heavy was left to it

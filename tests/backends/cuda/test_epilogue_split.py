"""GEMM kernels whose fused epilogue broadcast the result to a larger tensor are split in two
(backends/cuda/rewrites/epilogue_split.py): FuseOps' output for a squeeze-excitation gate has
such a kernel (the precondition), the split module computes the same values (llvm, random
inputs, against float64), and a cuda:sm_90 build of an NHWC SE block schedules every kernel
with a real rule (no rule raises, no GEMM on dlight's generic Fallback)."""
from __future__ import annotations

import math

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.rewrites.epilogue_split import split_expanding_epilogues  # noqa: E402


def _se_gate(n=2, hw=7, c=48, dtype="float16"):
    """y = x * hardsigmoid(pool(x) @ W + b): the FC's [n, 1, 1, c] result gates x [n, hw, hw, c]."""
    relax = tvm_compat.relax()
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, hw, hw, c), dtype))
    w = relax.Var("w", relax.TensorType((c, c), dtype))
    b = relax.Var("b", relax.TensorType((c,), dtype))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            p = bb.emit(relax.op.mean(x, [1, 2], keepdims=True))
            h = bb.emit(relax.op.add(relax.op.matmul(p, w), b))
            g = bb.emit(relax.op.clip(relax.op.add(relax.op.multiply(
                h, relax.const(1 / 6, dtype)), relax.const(0.5, dtype)), 0, 1))
            out = bb.emit_output(relax.op.multiply(x, g))
        bb.emit_func_output(out)
    return bb.get()


def _fused(mod):
    relax = tvm_compat.relax()
    seq = tvm.transform.Sequential([relax.transform.LegalizeOps(),
                                    relax.transform.AnnotateTIROpPattern(),
                                    relax.transform.FuseOps()])
    return seq(mod)


def _expanding_gemm_kernels(mod) -> int:
    """Fused PrimFuncs (after FuseTIR) whose first block is a GEMM and whose output has more
    elements than it."""
    sch_mod = tvm_compat.relax().transform.FuseTIR()(mod)
    count = 0
    for _, f in sch_mod.functions_items():
        if not isinstance(f, tvm_compat.prim_func_class()):
            continue
        sch = tvm.s_tir.Schedule(f)
        blocks = sch.get_child_blocks(tvm_compat.dlight_analysis().get_root_block(sch))
        first = sch.get(blocks[0])
        if not any(int(iv.iter_type) == 2 for iv in first.iter_vars):
            continue
        gemm_points = math.prod(int(iv.dom.extent) for iv in first.iter_vars
                                if int(iv.iter_type) == 0)
        out = sch.get(blocks[-1]).writes[0].source
        if math.prod(int(d) for d in out.shape) > gemm_points:
            count += 1
    return count


def test_fuse_ops_puts_the_gate_into_the_gemm_kernel_and_the_split_takes_it_out():
    fused = _fused(_se_gate())
    assert _expanding_gemm_kernels(fused) == 1  # what the split is for
    new, count = split_expanding_epilogues(fused)
    assert count == 1
    assert _expanding_gemm_kernels(new) == 0
    # the GEMM kernel keeps its epilogue (bias, hardsigmoid); the gate is its own kernel
    prims = {gv.name_hint: f for gv, f in tvm_compat.relax().transform.FuseTIR()(new)
             .functions_items() if isinstance(f, tvm_compat.prim_func_class())}
    gemm = [n for n, f in prims.items() if "matmul" in n]
    assert len(gemm) == 1 and "clip" in gemm[0] and not gemm[0].endswith("multiply1"), prims
    assert len(prims) == 3, sorted(prims)  # the pool, the GEMM + epilogue, the gate


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_split_module_computes_the_gate(dtype):
    n, hw, c = 2, 7, 48
    new, count = split_expanding_epilogues(_fused(_se_gate(n, hw, c, dtype)))
    assert count == 1
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, (n, hw, hw, c)).astype(dtype)
    w = (rng.standard_normal((c, c)) * 2 / np.sqrt(c)).astype(dtype)
    b = rng.uniform(-1, 1, c).astype(dtype)
    ex = tvm.compile(tvm_compat.relax().transform.FuseTIR()(new), target="llvm")
    got = tvm.relax.VirtualMachine(ex, tvm.cpu())["main"](
        *[tvm.runtime.tensor(a) for a in (x, w, b)]).numpy().astype(np.float64)
    x64, w64, b64 = (a.astype(np.float64) for a in (x, w, b))
    h = x64.mean(axis=(1, 2), keepdims=True) @ w64 + b64
    ref = x64 * np.clip(h / 6 + 0.5, 0, 1)
    tol = 1e-2 if dtype == "float16" else 1e-5  # fp16 intermediates: 2^-11 per rounding
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < tol


def test_same_shape_epilogues_and_symbolic_shapes_stay_whole():
    relax = tvm_compat.relax()
    bb = relax.BlockBuilder()
    m = tvm.tirx.Var("m", "int64")
    a = relax.Var("a", relax.TensorType((64, 32), "float16"))
    s = relax.Var("s", relax.TensorType((m, 32), "float16"))
    w = relax.Var("w", relax.TensorType((32, 32), "float16"))
    r = relax.Var("r", relax.TensorType((64, 32), "float16"))
    with bb.function("main", [a, s, w, r]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(relax.op.nn.relu(relax.op.matmul(a, w)), r))  # residual
            z = bb.emit(relax.op.multiply(relax.op.matmul(s, w), relax.const(2, "float16")))
            out = bb.emit_output(relax.Tuple([y, z]))
        bb.emit_func_output(out)
    fused = _fused(bb.get())
    new, count = split_expanding_epilogues(fused)
    assert count == 0 and new is fused


def test_nhwc_se_block_builds_for_sm90_with_no_rule_failure(tmp_path):
    """An SE block as an export writes it (NCHW; ConvertLayout and the permute sinking make it
    NHWC end to end), built for cuda:sm_90: without the split the FC GEMM + gate kernel makes
    amp's GEMM rule raise and dlight's Fallback take it; with it, nothing raises."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    import amp_cli
    from amp_cli.backends.cuda.pipeline import cuda_relax_pipeline
    from amp_cli.config import PrecisionConfig
    from amp_cli.precision import convert_precision

    rng = np.random.default_rng(0)
    c = 64
    init = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in (
        ("W1", rng.standard_normal((c, c, 1, 1)) * 0.1),
        ("W2", rng.standard_normal((16, c, 1, 1)) * 0.1), ("B2", rng.standard_normal(16) * 0.1),
        ("W3", rng.standard_normal((c, 16, 1, 1)) * 0.1), ("B3", rng.standard_normal(c) * 0.1))]
    nodes = [helper.make_node("Conv", ["x", "W1"], ["c1"]),
             helper.make_node("HardSwish", ["c1"], ["a1"]),
             helper.make_node("GlobalAveragePool", ["a1"], ["p"]),
             helper.make_node("Conv", ["p", "W2", "B2"], ["f1"]),
             helper.make_node("Relu", ["f1"], ["r"]),
             helper.make_node("Conv", ["r", "W3", "B3"], ["f2"]),
             helper.make_node("HardSigmoid", ["f2"], ["g"], alpha=1 / 6, beta=0.5),
             helper.make_node("Mul", ["a1", "g"], ["y"])]
    graph = helper.make_graph(
        nodes, "se", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, c, 14, 14])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, c, 14, 14])], init)
    path = tmp_path / "se.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))

    mod, _ = convert_precision(amp_cli.load(str(path)).mod, PrecisionConfig(precision="fp16"))
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    outcome = {}
    for split in (True, False):
        failures, schedules, stats = [], [], {}
        with target:
            cuda_relax_pipeline(target, rule_failures=failures, schedules=schedules,
                                rewrite_stats=stats, cuda_graph=False,
                                split_expanding_epilogues=split)(mod)
        heavy = [r["kernel"] for r in schedules if r["rule"] == "Fallback" and r["reduction"] >= 16]
        outcome[split] = (failures, heavy, stats.get("epilogues_split", 0))
    failures, heavy, count = outcome[False]
    assert failures and heavy and count == 0, outcome[False]   # the failure being fixed
    failures, heavy, count = outcome[True]
    assert not failures and not heavy and count == 1, outcome[True]

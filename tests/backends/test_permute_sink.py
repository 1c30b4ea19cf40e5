"""Transposes sunk through elementwise ops until they cancel (backends/permute_sink.py).

The ConvNeXt pattern after ConvertLayout: the block's output leaves NHWC through the model's own
permute, is scaled by a [C, 1, 1] constant and added to the NCHW residual stream, and the next
conv's ConvertLayout permutes it back. Checked: the transposes go, the values are the same
(llvm, random inputs, exact: every op sees the same elements), and what must not move stays.
"""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.permute_sink import compose, sink_permutes  # noqa: E402

N, H, W, C = 2, 6, 5, 8
TO_NCHW, TO_NHWC = [0, 3, 1, 2], [0, 2, 3, 1]


def _permutes(mod) -> int:
    return mod["main"].script().count("R.permute_dims")


def _module(build):
    relax = tvm_compat.relax()
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((N, H, W, C), "float16"))
    res = relax.Var("res", relax.TensorType((N, H, W, C), "float16"))
    with bb.function("main", [x, res]):
        with bb.dataflow():
            out = bb.emit_output(build(bb, relax.op, x, res))
        bb.emit_func_output(out)
    return bb.get()


def _convnext_tail(bb, op, x, res):
    """x (a block's NHWC output) -> NCHW -> gamma * . -> fp32 -> + residual -> fp16 -> NHWC."""
    relax = tvm_compat.relax()
    gamma = relax.const(np.random.default_rng(0).uniform(0.1, 0.6, (C, 1, 1)).astype("float16"))
    a = bb.emit(op.permute_dims(x, TO_NCHW))
    scaled = bb.emit(op.astype(op.multiply(gamma, a), "float32"))
    r = bb.emit(op.astype(bb.emit(op.permute_dims(res, TO_NCHW)), "float32"))
    s = bb.emit(op.astype(op.add(r, scaled), "float16"))
    y = bb.emit(op.permute_dims(s, TO_NHWC))
    same = bb.emit(op.permute_dims(y, [0, 1, 2, 3]))  # ConvertLayout's identity permutes
    return op.clip(same, -1.0, 1.5)


def _run_llvm(mod, *arrays):
    ex = tvm.compile(mod, target="llvm")
    vm = tvm.relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()


def _inputs():
    rng = np.random.default_rng(1)
    return [rng.standard_normal((N, H, W, C)).astype("float16") for _ in range(2)]


def test_compose_and_cancel():
    assert compose(TO_NCHW, TO_NHWC) == [0, 1, 2, 3]
    assert compose([1, 0, 2], [1, 0, 2]) == [0, 1, 2]
    x = np.arange(24).reshape(2, 3, 4)
    p, q = [2, 0, 1], [1, 2, 0]
    assert np.array_equal(np.transpose(np.transpose(x, p), q), np.transpose(x, compose(p, q)))


def test_convnext_tail_loses_every_transpose_and_keeps_its_values():
    mod = _module(_convnext_tail)
    assert _permutes(mod) == 4
    new, count = sink_permutes(mod)
    assert count > 0 and _permutes(new) == 0
    x, res = _inputs()
    want, got = _run_llvm(mod, x, res), _run_llvm(new, x, res)
    assert got.shape == want.shape == (N, H, W, C)
    assert np.array_equal(got, want)  # the same elementwise ops on the same elements


def test_transposes_the_sink_cannot_remove_stay():
    relax = tvm_compat.relax()

    def mixed_axes(bb, op, x, res):  # two different permutations meet: nothing to share
        a = bb.emit(op.permute_dims(x, [0, 3, 1, 2]))
        b = bb.emit(op.permute_dims(res, [0, 3, 2, 1]))
        return op.add(a, op.reshape(b, a.ty.shape))

    def broadcast_tensor(bb, op, x, res):  # a lower-rank non-constant operand: left alone
        a = bb.emit(op.permute_dims(x, TO_NCHW))
        row = bb.emit(op.strided_slice(res, [0, 1, 3], [0, 0, 0], [1, 1, 1]))  # [1, 1, W, 1]
        return op.multiply(a, op.reshape(row, [W]))

    def shared(bb, op, x, res):  # the permute feeds two ops and is the output too
        a = bb.emit(op.permute_dims(x, TO_NCHW))
        e = bb.emit(op.exp(a))
        return relax.Tuple([a, e])

    for build, keep in ((mixed_axes, 2), (broadcast_tensor, 1)):
        mod = _module(build)
        new, _ = sink_permutes(mod)
        assert _permutes(new) == keep, build.__name__
        x, res = _inputs()
        np.testing.assert_array_equal(_run_llvm(new, x, res), _run_llvm(mod, x, res))
    new, count = sink_permutes(_module(shared))
    assert count == 0  # sinking exp would add a transpose (a is used elsewhere): not done


def test_bindings_after_the_dataflow_block_are_left_alone():
    """keep_io_types' output cast sits after the dataflow block: moving the block's last
    permute below it would use a dataflow variable outside its block (the VM's codegen then
    fails with 'Var lv2 is not defined')."""
    relax = tvm_compat.relax()
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((N, H, W, C), "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            r = bb.emit(relax.op.nn.relu(x))
            y = bb.emit_output(relax.op.permute_dims(r, TO_NCHW))
        out = bb.emit(relax.op.astype(y, "float32"))
        bb.emit_func_output(out)
    mod = bb.get()
    new, count = sink_permutes(mod)
    assert count == 0
    tvm.relax.analysis.well_formed(new)
    (x_np,) = _inputs()[:1]
    np.testing.assert_array_equal(_run_llvm(new, x_np), _run_llvm(mod, x_np))

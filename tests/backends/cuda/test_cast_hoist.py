"""Casts to fp16/bf16 moved above single-use layout ops (amp_cli.backends.cuda.rewrites.cast_hoist):
the values are bit for bit the same (llvm, random inputs), a layout op with another user keeps
its cast below it, and ViT's ``layer_norm -> permute -> cast`` becomes one low-only layer norm
kernel and an fp16 permute."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.rewrites import norm_cast as nc  # noqa: E402
from amp_cli.backends.cuda.rewrites.base import calls, op_name  # noqa: E402
from amp_cli.backends.cuda.rewrites.cast_hoist import hoist_casts  # noqa: E402

relax = tvm.relax
F32 = "float32"


def _module(low="float16", shared=False):
    """h (fp16) -> astype fp32 -> layer_norm -> permute [1, 0, 2] -> astype low -> matmul;
    ``shared``: the permuted fp32 value is returned too."""
    rng = np.random.default_rng(0)
    h = relax.Var("h", relax.TensorType((4, 6, 64), "float16"))
    gamma = relax.const(rng.uniform(0.5, 1.5, 64).astype(F32))
    beta = relax.const(rng.uniform(-0.5, 0.5, 64).astype(F32))
    w = relax.const((rng.standard_normal((64, 8)) / 8).astype(low))
    bb = relax.BlockBuilder()
    with bb.function("main", [h]):
        with bb.dataflow():
            x = bb.emit(relax.op.astype(h, F32))
            y = bb.emit(relax.op.nn.layer_norm(x, gamma, beta, axes=[-1], epsilon=1e-5))
            t = bb.emit(relax.op.permute_dims(y, [1, 0, 2]))
            mm = bb.emit(relax.op.matmul(bb.emit(relax.op.astype(t, low)), w, out_dtype=F32))
            gv = bb.emit_output(relax.Tuple([mm, t]) if shared else mm)
        bb.emit_func_output(gv)
    return bb.get()


def _run(mod, h):
    vm = tvm_compat.relax_vm(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(h)).numpy()


@pytest.mark.parametrize("low", ["float16", "bfloat16"])
def test_cast_moves_above_the_permute_with_the_same_values(low):
    mod = _module(low)
    new, moved = hoist_casts(mod)
    assert moved == 1
    perm = next(c for c in calls(new) if op_name(c) == "relax.permute_dims")
    assert perm.ty.dtype == low                     # the copy moves fp16/bf16 now
    h = (np.random.default_rng(1).standard_normal((4, 6, 64)) + 2).astype("float16")
    np.testing.assert_array_equal(_run(new, h), _run(mod, h))


def test_layout_op_with_another_user_keeps_its_cast():
    mod = _module(shared=True)
    new, moved = hoist_casts(mod)
    assert moved == 0 and new.same_as(mod)


def test_vit_layer_norm_then_permute_is_one_low_only_kernel():
    new, fused, _ = nc.fuse_norm_casts(hoist_casts(_module())[0])
    assert fused == 1
    (kernel,) = [c for c in calls(new) if op_name(c) == "relax.call_tir"]
    assert kernel.args[1].fields[0].ty.dtype == "float16" and kernel.ty.dtype == "float16"
    assert not any(op_name(c) in ("relax.astype", "relax.nn.layer_norm") for c in calls(new))

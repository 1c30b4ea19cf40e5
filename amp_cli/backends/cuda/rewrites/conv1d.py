"""1-D convolutions as 2-D ones over a height of 1, so the conv rewrites that follow take them.

Speech and audio encoders (Whisper's two-conv front end, wav2vec2's feature extractor and its
positional conv, TCNs) are ``relax.nn.conv1d``. amp's conv rewrites (``conv_gemm``: tensor-core
implicit GEMMs; ``depthwise_conv``: grouped convs) match ``conv2d`` only, so a conv1d stayed
TOPI's conv1d in NCW, which dlight's matmul analysis recognizes and tensorizes with its own
wmma tile (no cp.async pipeline: the schedule amp's ``tc_gemm`` replaced for every other GEMM),
between transpose kernels for the NCW layout (Whisper's second conv is 8 x 1500 x 768 x 768 x
3 multiply-adds at batch 8). The build report's schedule records showed it (``AmpMatmul`` via
dlight's ``MatmulTensorization``, not amp's tile).

An fp16/bf16 ``conv1d`` (NCW data, OIW weights, static width) becomes

    permute x to [N, W, C] -> reshape [N, 1, W, C] -> conv2d (NHWC / OHWI, strides (1, s),
    padding (0, l, 0, r), dilation (1, d), same groups) -> reshape [N, Wo, O] -> permute to
    [N, O, Wo]

The weight's permute and reshape fold into a constant. The permutes are the model's NCW layout
made explicit: ``sink_permutes`` moves them through the elementwise ops between convs (GELU) and
cancels them against each other and against the [N, O, W] -> [N, W, O] transpose an encoder
applies after its front end, so the convs run back to back in NHWC.
"""
from __future__ import annotations

from .... import tvm_compat
from ....dtypes import LOW_TYPES
from ..registry import register
from .base import add_counts, module_pass, op_name, rewrite_calls, shape_of, static_shape


def _as_conv2d(bb, call):
    """The conv2d form of an NCW/OIW conv1d ``call`` (module docstring), or None."""
    relax = tvm_compat.relax()
    a = call.attrs
    if a.data_layout != "NCW" or a.kernel_layout != "OIW" or a.out_layout not in ("", "NCW"):
        return None
    x, w = call.args
    if x.ty.dtype not in LOW_TYPES or w.ty.dtype != x.ty.dtype:
        return None
    xs, ws = shape_of(x), static_shape(w)
    if xs is None or ws is None or len(xs) != 3 or not isinstance(xs[2], int):
        return None
    n, c, width = xs
    o, c_group, k = ws
    out_dtype = str(a.out_dtype)
    x4 = bb.emit(relax.op.reshape(bb.emit(relax.op.permute_dims(x, [0, 2, 1])),
                                  [n, 1, width, c]))
    w4 = bb.emit(relax.op.reshape(relax.op.permute_dims(w, [0, 2, 1]), [o, 1, k, c_group]))
    y4 = bb.emit(relax.op.nn.conv2d(
        x4, w4, strides=[1, int(a.strides[0])], padding=[0, int(a.padding[0]), 0,
                                                         int(a.padding[1])],
        dilation=[1, int(a.dilation[0])], groups=int(a.groups), data_layout="NHWC",
        kernel_layout="OHWI", out_dtype=out_dtype if out_dtype not in ("", "void") else None))
    wo = shape_of(y4)[2]
    y = bb.emit(relax.op.reshape(y4, [n, wo, o]))
    return relax.op.permute_dims(y, [0, 2, 1])


def conv1d_as_conv2d(mod):
    """``mod`` with every eligible conv1d in conv2d form; returns (module, count)."""
    relax = tvm_compat.relax()
    count = 0

    def rewrite(bb, call, _lookup):
        nonlocal count
        if op_name(call) != "relax.nn.conv1d":
            return None
        new = _as_conv2d(bb, call)
        count += new is not None
        return new

    new, _ = rewrite_calls(mod, rewrite, cleanup=relax.transform.FoldConstant())
    return new, count


@register("conv1d_as_conv2d", "graph", 5, switch="conv1d_as_conv2d",
          labels={"conv1d_as_conv2d": "1-D convolutions as 2-D ones (then GEMMs)"})
def make_pass(ctx):
    def run(mod):
        new, count = conv1d_as_conv2d(mod)
        add_counts(ctx.stats, conv1d_as_conv2d=count)
        return new

    return module_pass(run, "AmpConv1dAsConv2d")

"""Depthwise and grouped convolutions as amp's NHWC kernel (``kernels/depthwise.py``).

Legalized, a grouped ``relax.nn.conv2d`` is TOPI's ``group_conv2d`` with dlight's ``Fallback``
schedule (one thread per output, scalar loads, the filter re-read per output): MobileNetV3,
EfficientNet-B0 and ConvNeXt-tiny ran 6-12x slower than torch.compile on the H200 (issue 21).
This pass replaces each eligible conv (groups > 1, static shapes, dilation 1, fp16/bf16/fp32
with the filter in the input's type) with the TE compute of ``kernels/depthwise.conv_te``:

    x [N,H,W,Cin] --pad (in-kernel)--> y[n,ho,wo,o] = sum_{i,j,r} x[.., (o//cout_g)*cin_g + r]
                                                                  * w[i, j, r, o]
    w [O,kh,kw,cin_g] --permute--> [kh, kw, cin_g, O]   (a constant, folded at compile time)

whose reduction block carries the annotation ``rules/depthwise.py`` schedules. The output is a
plain NHWC tensor, so FuseOps fuses the elementwise epilogue (BN bias, activation, cast,
residual add) into the kernel.

Layout: the convs must be NHWC. When ``conv_gemm`` ran first (the default for fp16/bf16
models) they already are -- its ``ConvertLayout`` moves every conv2d, grouped ones included,
and the layout propagates through the elementwise ops between them, so no transposes appear
between neighbouring convs. Otherwise (``conv_as_gemm`` off, an fp32 model) this pass runs the
same guarded ``ConvertLayout`` (``backends/layout.py``) itself, which moves the model's other
convs to NHWC too. Dilated convs stay TOPI convolutions.
"""
from __future__ import annotations

from .... import tvm_compat
from ...layout import REPORT_LABELS as LAYOUT_LABELS
from ...layout import convert_layout
from ..kernels import depthwise
from ..registry import register
from .base import add_counts, calls, conv2d_in, module_pass, rewrite_calls, static_shape
from .conv_gemm import CONV_LAYOUTS

DTYPES = ("float16", "bfloat16", "float32")
COUNT = "grouped_convs"  # build-report count


def is_candidate(call, want_layout: str | None = None) -> bool:
    """A grouped (groups > 1) static-shape conv2d with dilation 1 in fp16/bf16/fp32 (in
    ``want_layout`` with OHWI filters when given)."""
    if not conv2d_in(call, DTYPES, want_layout):
        return False
    return int(call.attrs.groups) > 1 and all(int(d) == 1 for d in call.attrs.dilation)


def count_grouped_convs(mod, want_layout: str | None = None) -> int:
    """How many conv2d calls in ``mod`` this pass would rewrite (in ``want_layout``, or any)."""
    return sum(1 for call in calls(mod) if is_candidate(call, want_layout))


def _rewrite_conv(bb, call):
    """The kernel's TE call for an NHWC/OHWI grouped conv2d call."""
    tvm = tvm_compat.tvm()
    relax, te, tirx = tvm.relax, tvm.te, tvm.tirx
    a = call.attrs
    x, w = call.args
    _, h, wd, _ = static_shape(x)
    _, kh, kw, _ = static_shape(w)
    strides = [int(s) for s in a.strides]
    padding = [int(p) for p in a.padding]  # top, left, bottom, right
    ho = (h + padding[0] + padding[2] - kh) // strides[0] + 1
    wo = (wd + padding[1] + padding[3] - kw) // strides[1] + 1
    # unset (None / "" / void: an fp32 model) means the input's type
    out_dtype = str(a.out_dtype) if str(a.out_dtype) not in ("", "void", "None") else x.ty.dtype
    groups = int(a.groups)
    filt = bb.emit(relax.op.permute_dims(w, [1, 2, 3, 0]))  # [kh, kw, cin_g, O]
    return bb.call_te(
        lambda xt, wt: depthwise.conv_te(te, tirx, xt, wt, strides, padding, groups, out_dtype,
                                         (ho, wo)),
        x, filt, primfunc_name_hint=depthwise.KERNEL)


def grouped_convs_to_nhwc_kernel(mod, stats: dict | None = None):
    """``mod`` with its eligible grouped convs as amp's NHWC kernel (module docstring); a module
    without any is returned unchanged. ``stats`` counts what changed."""
    relax = tvm_compat.relax()
    total = count_grouped_convs(mod)
    if not total:
        return mod
    if count_grouped_convs(mod, "NHWC") < total:
        mod = convert_layout(mod, CONV_LAYOUTS, stats)  # guarded: backends/layout.py

    def rewrite(bb, call, _lookup):
        return _rewrite_conv(bb, call) if is_candidate(call, want_layout="NHWC") else None

    # fold the filter's permute before dead code goes, so it is a plain constant for FuseOps
    new, count = rewrite_calls(mod, rewrite, cleanup=relax.transform.FoldConstant())
    add_counts(stats, **{COUNT: count})
    return new


@register("depthwise_conv", "graph", 15, switch="depthwise_conv",
          labels={COUNT: "depthwise/grouped convolutions as amp's NHWC kernel", **LAYOUT_LABELS})
def make_pass(ctx):
    return module_pass(lambda mod: grouped_convs_to_nhwc_kernel(mod, ctx.stats),
                       "AmpGroupedConvNHWC")

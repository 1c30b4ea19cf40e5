"""Convolutions as GEMMs, so that dlight's tensor-core matmul rule can schedule them.

dlight has a wmma tensor-core rule for matmuls (``MatmulTensorization``) but none for conv2d: a
legalized NCHW conv2d falls back to SIMT code. This Relax pass moves the model to NHWC and
rewrites each eligible ``relax.nn.conv2d`` (fp16/bf16 inputs, groups=1, static shapes) into:

    x [N,H,W,C] --im2col--> A [N,Ho,Wo, kh*kw*C]       (1x1 stride-1 unpadded: A is x itself)
    w [O,kh,kw,C] --reshape--> B [O, kh*kw*C]          (a constant, folded at compile time)
    y[n,ho,wo,o] = sum_k A[n,ho,wo,k] * B[o,k]         (accumulated in the conv's out_dtype)

dlight sees an [M=N*Ho*Wo, K] x [K, O] GEMM (it fuses n, ho, wo into M itself).

The GEMM is emitted as one TE reduction with B in [J, K] order, which is the operand layout
dlight's tensor-core rule loads natively (its wmma intrinsics are the ``trans_b`` ones); a
``relax.matmul`` with a transposed constant would be folded into a [K, J] constant and loaded
with strided, unvectorized global reads. The im2col is its own spatial kernel (padding done
in-kernel), so the im2col tensor is materialized once per conv: memory traffic, but small next to
SIMT conv time. Depthwise/grouped and fp32 convolutions are left as convolutions (in NHWC).

Implicit GEMM (``implicit=True``, the CUDA pipeline's ``cuda.implicit_gemm``): for a kxk or
strided conv whose C is a multiple of 8 the GEMM reads the (zero-padded) image directly,
``A[m, k] = x[n, ho*s + i*d - p, wo*s + j*d - p, c]``, with the padding as a stage of the same
PrimFunc; amp's tensor-core schedule inlines it into the shared-memory loads, which TVM turns into
predicated 16-byte ``cp.async`` copies (zero fill outside the image). No im2col tensor is written
or read. An image stem (C < 8, overlapping windows: ``stem_channels``) reads its input padded
to 8 zero-filled channels the same way; other convs keep the explicit im2col.

A dynamic model's batch may be symbolic. A 1x1 stride-1 unpadded convolution could read the
image as it is, M = N*H*W rows with M padded at run time, but on amp's wmma tiles that GEMM ran
30-50x slower than the static one (ResNet-50 on the H100, 2026-12-05,
benchmarks/kernel_profile.py), so it takes the batched form below where its sides allow, and
M = N*H*W only where they do not -- or where the symbolic-row Hopper GEMM takes it
(:func:`flat_rows_fit`, ``cuda.pointwise_flat_rows``: TMA reads the rows as one [M, C] matrix;
dynamic ResNet-50 on the H200, 2026-12-07: 1.12x its static build at batch 32 against 1.20x
batched). Any other convolution's GEMM has producer stages on its A operand (padding, im2col),
and over a symbolic M = N*Ho*Wo
neither amp's schedule nor dlight's ``MatmulTensorization`` can place that operand's
shared-memory copy in the K loop (TVM's ``compute_at`` refuses the scope): it would lose its
tensor cores, and as a plain conv2d it ran 10-140x slower than the static build (ResNet-50 on the
H100, 2026-12-05: 305 ms vs 2.2 ms at batch 32). So such a conv becomes a *batched* GEMM: the
images are the GEMM's batch (dlight's S axis, one grid row each, ``blockIdx.z``) and each image
is a static [Ho*Wo, K] x [K, O] GEMM, whose tiles and copies are static. dlight's analysis puts
an axis in S only when A, B and C all carry it, so B is read through a broadcast stage
``B[n, o, k] = W[o, k]`` that every GEMM schedule inlines into its shared-memory copy (nothing
is materialized). The explicit im2col of a channel count that is not a multiple of 8 (the RGB
stem) pads K to a multiple of 8 with zero columns (zero weights): cp.async needs whole vectors
along K. Such a conv is rewritten only where amp's tensor-core schedule takes it (fp16/bf16,
every GEMM side >= 32); else it stays a conv.

Non-multiple-of-16 sizes need no padding here: dlight's tensor-core rule pads M/N/K to its tile
(``pad_einsum``), so odd channel counts still get tensor cores.
"""
from __future__ import annotations

import numpy as np

from .... import tvm_compat
from ....dtypes import LOW_TYPES
from ...layout import REPORT_LABELS as LAYOUT_LABELS
from ...layout import NUMPY_DTYPES, convert_layout
from ..kernels import hopper_gemm
from ..registry import register
from .base import add_counts, calls, conv2d_in, module_pass, rewrite_calls, shape_of, \
    static_shape

CONV_LAYOUTS = {"relax.nn.conv2d": ["NHWC", "OHWI"]}


# a symbolic-batch conv becomes a batched GEMM only if each side reaches the tensor-core rule's
# minimum (rules/matmul.py MIN_EXTENT): else no GEMM schedule of amp's would take it
BATCHED_MIN_SIDE = 32


def _geometry(call) -> dict:
    """The conv's sizes: c, o, kh, kw (any weight layout), ho, wo, strides, padding, dilation."""
    a = call.attrs
    x_shape, w_shape = shape_of(call.args[0]), static_shape(call.args[1])
    if a.kernel_layout == "OHWI":
        o, kh, kw, c = w_shape
    else:
        o, c, kh, kw = w_shape
    h, w = (x_shape[1], x_shape[2]) if a.data_layout == "NHWC" else (x_shape[2], x_shape[3])
    strides = [int(v) for v in a.strides]
    dilation = [int(v) for v in a.dilation]
    padding = [int(v) for v in a.padding]  # top, left, bottom, right
    ho = (h + padding[0] + padding[2] - dilation[0] * (kh - 1) - 1) // strides[0] + 1
    wo = (w + padding[1] + padding[3] - dilation[1] * (kw - 1) - 1) // strides[1] + 1
    return dict(c=c, o=o, kh=kh, kw=kw, ho=ho, wo=wo, strides=strides, padding=padding,
                dilation=dilation)


def _pointwise(g: dict) -> bool:
    return g["kh"] == g["kw"] == 1 and g["strides"] == [1, 1] and not any(g["padding"])


def _padded_k(g: dict) -> int:
    """K of the batched GEMM: kh*kw*C, rounded up to whole cp.async vectors (module doc)."""
    k = g["kh"] * g["kw"] * g["c"]
    return -(-k // IMPLICIT_CHANNEL_MULTIPLE) * IMPLICIT_CHANNEL_MULTIPLE


def _is_candidate(call, want_layout: str | None = None) -> bool:
    """fp16/bf16, groups=1 conv2d (in ``want_layout`` when given), static, or over a symbolic
    batch: a pointwise one (1x1, stride 1, unpadded) as a GEMM over M = N*H*W, any other as a
    batched GEMM where amp's tensor-core schedule takes it (module docstring)."""
    if not conv2d_in(call, LOW_TYPES, want_layout, symbolic_batch=True) or \
            int(call.attrs.groups) != 1:
        return False
    if static_shape(call.args[0]) is not None:
        return True
    g = _geometry(call)
    return _pointwise(g) or min(g["ho"] * g["wo"], g["o"], _padded_k(g)) >= BATCHED_MIN_SIDE


def count_gemm_convs(mod) -> int:
    """How many conv2d calls in ``mod`` this pass would rewrite (any layout)."""
    return sum(1 for call in calls(mod) if _is_candidate(call))


def _im2col(te, tirx, x, kh, kw, strides, padding, dilation, out_hw, columns=None):
    """A[n, ho, wo, (i*kw + j)*C + c] = x[n, ho*sh + i*dh - pt, wo*sw + j*dw - pl, c]
    (zero outside the image, and in the ``columns - kh*kw*C`` zero columns of a padded K)."""
    n_, h_, w_, c_ = x.shape[0], *(int(d) for d in x.shape[1:])  # the batch may be symbolic
    ho_, wo_ = out_hw
    sh, sw = strides
    dh, dw = dilation
    pt, pl = padding[0], padding[1]
    k_real = kh * kw * c_

    def value(n, ho, wo, k):
        i, r = k // (kw * c_), k % (kw * c_)
        j, c = r // c_, r % c_
        h = ho * sh + i * dh - pt
        w = wo * sw + j * dw - pl
        inside = tirx.all(h >= 0, h < h_, w >= 0, w < w_)
        if columns is not None and columns != k_real:
            inside = tirx.all(inside, k < k_real)
        return tirx.if_then_else(inside, x[n, h, w, c], tirx.const(0, x.dtype))

    return te.compute((n_, ho_, wo_, columns or k_real), value, name="im2col")


def _per_image(te, b, batch):
    """``B[n, o, k] = W[o, k]``: the weights as the batched GEMM's B (module docstring); every
    GEMM schedule inlines this stage into its shared-memory copy."""
    return te.compute((batch, *b.shape), lambda _n, oc, r: b[oc, r], name="weight_per_image")


def _gemm_nt(te, a, b, out_dtype, batched: bool = False):
    """C[n, ho, wo, o] = sum_k A[n, ho, wo, k] * B[o, k], products and sum in ``out_dtype``.
    Keeping the NHWC output shape (no reshape after the GEMM) lets FuseOps fuse the elementwise
    epilogue (cast, bias, ReLU, residual add) into the GEMM kernel: it fuses elementwise and
    broadcast consumers only, and a reshape in between would stop it. ``batched``: the images
    are the GEMM's batch (a symbolic batch, module docstring)."""
    n, (ho, wo, k) = a.shape[0], (int(d) for d in a.shape[1:])
    o = int(b.shape[0])
    r = te.reduce_axis((0, k), name="k")
    if batched:
        bn_ = _per_image(te, b, n)
        return te.compute(
            (n, ho, wo, o),
            lambda bn, i, j, oc: te.sum(a[bn, i, j, r].astype(out_dtype)
                                        * bn_[bn, oc, r].astype(out_dtype), axis=r),
            name="conv_gemm")
    return te.compute(
        (n, ho, wo, o),
        lambda bn, i, j, oc: te.sum(a[bn, i, j, r].astype(out_dtype) * b[oc, r].astype(out_dtype),
                                    axis=r), name="conv_gemm")


# Implicit GEMM needs whole cp.async vectors (8 fp16 = 16 bytes) inside one filter tap: C % 8.
IMPLICIT_CHANNEL_MULTIPLE = 8


def stem_channels(c: int, kh: int, kw: int, strides) -> bool:
    """A conv over fewer than 8 channels (an image stem: RGB, grayscale) whose windows overlap
    (kh*kw > sh*sw): it reads its input zero-padded to 8 channels as an implicit GEMM. Its
    im2col tensor would be kh*kw/(sh*sw) times the image (12x for ResNet's 7x7/2 stem, 2.25x
    for a 3x3/2 one) and its K (27, 147) too ragged for cp.async, so the GEMM over it ran on
    dlight's rule (yolo_head's 3 -> 16 stem at 640 px: im2col 0.086 ms + GEMM 0.159 ms on the
    H100, 2026-12-07); the 8-channel copy costs 8/C of the image's bytes, written by the
    kernel that casts and transposes the input anyway. A patchify stem (ViT's 16x16/16,
    ConvNeXt's 4x4/4) has no overlap: its im2col is a permutation of the image and stays."""
    return c < IMPLICIT_CHANNEL_MULTIPLE and kh * kw > strides[0] * strides[1]


def implicit_gemm_te(te, tirx, x, b, kh, kw, strides, padding, dilation, out_hw, out_dtype,
                     batched: bool = False):
    """The conv as a GEMM that reads the image directly (no im2col tensor):
    ``y[n,ho,wo,o] = sum_k xp[n, ho*sh + i*dh, wo*sw + j*dw, c] * B[o, k]`` with
    ``k = (i*kw + j)*C + c`` and ``xp`` the zero-padded image, a stage of the same PrimFunc that
    the tensor-core schedule inlines into its shared-memory loads (predicated cp.async).
    ``batched``: the images are the GEMM's batch (a symbolic batch, module docstring)."""
    n_, h_, w_, c_ = x.shape[0], *(int(d) for d in x.shape[1:])
    ho_, wo_ = out_hw
    sh, sw = strides
    dh, dw = dilation
    pt, pl, pb, pr = padding
    o = int(b.shape[0])
    xp = x
    if any(padding):
        def pad(n, h, w, c):
            inside = tirx.all(h >= pt, h < h_ + pt, w >= pl, w < w_ + pl)
            return tirx.if_then_else(inside, x[n, h - pt, w - pl, c], tirx.const(0, x.dtype))

        xp = te.compute((n_, h_ + pt + pb, w_ + pl + pr, c_), pad, name="pad")
    r = te.reduce_axis((0, kh * kw * c_), name="k")
    weight = _per_image(te, b, n_) if batched else None

    def value(bn, ho, wo, oc):
        i, rest = r // (kw * c_), r % (kw * c_)
        j, c = rest // c_, rest % c_
        bv = weight[bn, oc, r] if batched else b[oc, r]
        return te.sum(xp[bn, ho * sh + i * dh, wo * sw + j * dw, c].astype(out_dtype)
                      * bv.astype(out_dtype), axis=r)

    return te.compute((n_, ho_, wo_, o), value, name="conv_gemm")


def _weight_value(expr, lookup):
    """The numpy value of a conv weight that is a constant, directly or through its binding,
    else None. ConvertLayout's OIHW -> OHWI permute of a constant weight is already a constant
    (``layout.convert_layout`` folds it, for the dtypes numpy represents: ``NUMPY_DTYPES``), so
    the weight matrix is folded here too instead of leaving reshape/pad calls for Relax's
    FoldConstant, which compiles and runs an LLVM kernel per conv (10 of the 36 s of a dynamic
    ResNet-50 cuda:sm_90 build)."""
    if isinstance(expr, tvm_compat.relax().Var):
        expr = lookup(expr)
    value = tvm_compat.constant_value(expr) if expr is not None else None
    return value if value is not None and str(value.dtype) in NUMPY_DTYPES else None


def flat_rows_fit(c: int, o: int, min_k: int | None) -> bool:
    """Whether a pointwise conv over a symbolic batch reads its image as M = N*H*W rows:
    only where ``min_k`` is given (the symbolic-row Hopper GEMMs are on: their TMA copies
    read the rows as one [M, C] matrix, with no index arithmetic per element) and those
    kernels plan its sizes (``hopper_gemm.plan``: K = C, N = O).

    >>> flat_rows_fit(2048, 512, 512), flat_rows_fit(256, 1024, 512), flat_rows_fit(512, 96, 512)
    (True, False, False)
    """
    return min_k is not None and \
        not isinstance(hopper_gemm.plan(hopper_gemm.BM, o, c, min_k=min_k), str)


def _rewrite_conv(bb, call, implicit: bool = False, pad_stems: bool = True, lookup=None,
                  flat_min_k: int | None = None):
    """Emit the GEMM form of an NHWC/OHWI conv2d call; returns (the replacement expression,
    whether it is an implicit GEMM). ``implicit``: convs with C a multiple of 8 read the image
    inside the GEMM (no im2col); ``pad_stems``: image stems too, padded to 8 channels;
    ``flat_min_k``: :func:`flat_rows_fit`'s."""
    tvm = tvm_compat.tvm()
    relax, te, tirx = tvm.relax, tvm.te, tvm.tirx
    a = call.attrs
    x, w = call.args
    n, h, wd, c = shape_of(x)
    o, kh, kw, _ = static_shape(w)
    strides = [int(s) for s in a.strides]
    dilation = [int(d) for d in a.dilation]
    padding = [int(p) for p in a.padding]  # top, left, bottom, right
    ho = (h + padding[0] + padding[2] - dilation[0] * (kh - 1) - 1) // strides[0] + 1
    wo = (wd + padding[1] + padding[3] - dilation[1] * (kw - 1) - 1) // strides[1] + 1
    out_dtype = str(a.out_dtype) if str(a.out_dtype) not in ("", "void") else x.ty.dtype
    w_np = _weight_value(w, lookup) if lookup is not None else None

    def weight_matrix(cols: int, k_pad: int = 0):
        """[O, cols] (+ ``k_pad`` zero columns): a constant when the weight folds here."""
        if w_np is not None:
            return relax.const(np.pad(w_np.reshape(o, cols), [(0, 0), (0, k_pad)]))
        m = bb.emit(relax.op.reshape(w, [o, cols]))
        return bb.emit(relax.op.nn.pad(m, [0, 0, 0, k_pad])) if k_pad else m

    pointwise = kh == kw == 1 and strides == [1, 1] and not any(padding)
    if pad_stems and (implicit or not isinstance(n, int)) and stem_channels(c, kh, kw, strides):
        # an image stem (RGB: C = 3) whose windows overlap: zero channels up to a whole
        # cp.async vector, so the GEMM reads the image in place (the pad fuses into the
        # producer's cast/layout kernel) instead of an im2col tensor kh*kw/(sh*sw) its size
        extra = IMPLICIT_CHANNEL_MULTIPLE - c
        x = bb.emit(relax.op.nn.pad(x, [0, 0, 0, 0, 0, 0, 0, extra]))
        if w_np is not None:
            w_np = np.pad(w_np, [(0, 0), (0, 0), (0, 0), (0, extra)])
        else:
            w = bb.emit(relax.op.nn.pad(w, [0, 0, 0, 0, 0, 0, 0, extra]))
        c = IMPLICIT_CHANNEL_MULTIPLE
    # a symbolic batch: a batched GEMM (module docstring), a pointwise conv too where its sides
    # allow (over M = N*H*W on wmma tiles it ran 30-50x slower than static on the H100,
    # 2026-12-05) unless a symbolic-row Hopper GEMM takes it (flat_rows_fit)
    batched = not isinstance(n, int) and \
        min(ho * wo, o, _padded_k(dict(kh=kh, kw=kw, c=c))) >= BATCHED_MIN_SIDE and \
        not (pointwise and flat_rows_fit(c, o, flat_min_k))
    if pointwise and batched and c % IMPLICIT_CHANNEL_MULTIPLE == 0:
        wmat = weight_matrix(c)
        return bb.call_te(lambda at, bt: _gemm_nt(te, at, bt, out_dtype, True), x, wmat,
                          primfunc_name_hint="amp_conv_gemm"), False
    if pointwise:
        cols = x  # already [N, H, W, C]
    elif (implicit or batched) and c % IMPLICIT_CHANNEL_MULTIPLE == 0:
        wmat = weight_matrix(kh * kw * c)
        return bb.call_te(
            lambda xt, bt: implicit_gemm_te(te, tirx, xt, bt, kh, kw, strides, padding, dilation,
                                          (ho, wo), out_dtype, batched), x, wmat,
            primfunc_name_hint="amp_conv_gemm_implicit"), True
    else:
        columns = _padded_k(dict(kh=kh, kw=kw, c=c)) if batched else kh * kw * c
        cols = bb.emit_te(
            lambda xt: _im2col(te, tirx, xt, kh, kw, strides, padding, dilation, (ho, wo),
                               columns), x, primfunc_name_hint="amp_im2col")
        # zero weights for the zero columns
        wmat = weight_matrix(kh * kw * c, columns - kh * kw * c)
        return bb.call_te(lambda at, bt: _gemm_nt(te, at, bt, out_dtype, batched), cols, wmat,
                          primfunc_name_hint="amp_conv_gemm"), False
    wmat = weight_matrix(kh * kw * c)
    return bb.call_te(lambda at, bt: _gemm_nt(te, at, bt, out_dtype), cols, wmat,
                      primfunc_name_hint="amp_conv_gemm"), False


def conv_to_gemm(mod, implicit: bool = False, stats: dict | None = None,
                 pad_stems: bool = True, flat_min_k: int | None = None):
    """Return ``mod`` with eligible conv2d calls in GEMM form (see the module docstring); a module
    without any is returned unchanged (no layout change). ``implicit``: implicit GEMM (no im2col
    tensor) for convs whose channel count is a multiple of 8, and with ``pad_stems`` for image
    stems (``stem_channels``); ``flat_min_k``: pointwise convs over a symbolic batch with at
    least that many channels read their image as N*H*W rows (:func:`flat_rows_fit`).
    ``stats`` counts what changed."""
    relax = tvm_compat.relax()
    if not count_gemm_convs(mod):
        return mod
    mod = convert_layout(mod, CONV_LAYOUTS, stats)  # guarded: backends/layout.py

    implicit_count = []

    def rewrite(bb, call, lookup):
        if not _is_candidate(call, want_layout="NHWC"):
            return None
        new, is_implicit = _rewrite_conv(bb, call, implicit, pad_stems, lookup, flat_min_k)
        implicit_count.append(is_implicit)
        return new

    # The rewrite leaves reshapes/pads of weights numpy could not fold (bf16): folded here, so
    # the GEMM's B operand is a plain constant before FuseOps groups kernels.
    new, count = rewrite_calls(mod, rewrite, cleanup=relax.transform.FoldConstant())
    add_counts(stats, convs_as_gemm=count, implicit_gemm_convs=sum(implicit_count))
    return new


def conv_to_gemm_pass(implicit: bool = False, stats: dict | None = None,
                      pad_stems: bool = True, flat_min_k: int | None = None):
    """``conv_to_gemm`` as a module pass (run after precision conversion, before LegalizeOps)."""
    return module_pass(lambda mod: conv_to_gemm(mod, implicit, stats, pad_stems, flat_min_k),
                       "AmpConvToGemm")


@register("conv_as_gemm", "graph", 10, switch="conv_as_gemm",
          reads=("implicit_gemm", "pad_stem_channels", "pointwise_flat_rows", "hopper_gemm",
                 "hopper_symbolic_m", "hopper_min_k"),
          labels={"convs_as_gemm": "convolutions as GEMMs",
                  "implicit_gemm_convs": "of them implicit GEMMs", **LAYOUT_LABELS})
def make_pass(ctx):
    cuda = ctx.cuda
    flat = cuda.pointwise_flat_rows and cuda.hopper_gemm and cuda.hopper_symbolic_m and \
        hopper_gemm.enabled_for(ctx.target)
    return conv_to_gemm_pass(cuda.implicit_gemm, ctx.stats, cuda.pad_stem_channels,
                             cuda.hopper_min_k if flat else None)

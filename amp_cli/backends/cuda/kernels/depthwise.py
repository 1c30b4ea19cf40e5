"""amp's CUDA kernel for depthwise and grouped convolutions in NHWC: the TE compute that the graph
rewrite emits (``rewrites/depthwise_conv.py``) and the schedule amp's rule gives it
(``rules/depthwise.py``).

dlight has no convolution rule: a depthwise conv gets its ``Fallback``, one thread per output
element, each walking the kh x kw window with scalar 2-byte loads and re-reading the filter.
A depthwise conv has no reuse across channels and ~4.5 FLOP per byte (3x3, fp16): it is a
bandwidth problem, so the kernel is built around loads:

- **the compute** (:func:`conv_te`): ``y[n,ho,wo,o] = sum_{i,j,r} xp[n, ho*sh+i, wo*sw+j,
  (o // cout_g)*cin_g + r] * w[i, j, r, o]`` with ``xp`` the zero-padded image as a stage of the
  same PrimFunc (always present, an identity copy when there is no padding) and the filter as
  [kh, kw, cin_g, O], so a thread's channels are contiguous in both operands. Depthwise convs
  (``cin_g == cout_g == 1``) have no ``r`` axis. Products and sum are in the conv's
  ``out_dtype`` (fp32 under amp's policy); the output is a plain NHWC tensor, so FuseOps fuses
  the elementwise epilogue (BN bias, ReLU/Hardswish/SiLU, cast, residual add) into the kernel.
  The reduction block carries the ``ir_attrs.GROUPED_CONV`` annotation (its value: output
  channels per group): the rule takes exactly these kernels and nothing that merely looks like
  one.
- **the schedule** (:func:`schedule_conv`): ``vec`` channels per thread (one 16-byte load:
  8 halves, 4 floats) on ``threadIdx.x``, so a warp reads whole NHWC pixels, coalesced;
  ``tw`` neighbouring outputs along W per thread and a spatial tile of ``ty`` such groups per
  block on ``threadIdx.y``; fp32 accumulators in registers. Depthwise: for each filter row the
  thread loads the ``(tw-1)*sw + kw`` input pixels it needs (16-byte vectors, zero-filled at the
  border) and the row's ``kw`` filter vectors into registers once and runs all ``kw * tw * vec``
  FMAs from there; the inputs are reused ``kw`` times along W in registers, across rows and
  neighbouring threads through L1/L2. Grouped (``r`` axis): the input value is shared by the
  thread's ``vec`` output channels (one group), the filter vector is loaded once per ``r``.
  The epilogue runs on the accumulators and stores ``vec`` channels at once.

No shared memory: a depthwise tile has no reuse across channels, the halo of a thread's W
segment is reused in registers, and what neighbouring rows share (kh-fold) the L1 serves.
"""
from __future__ import annotations

from dataclasses import dataclass

from .... import tvm_compat
from ....hardware import sm_count
from ....ir_attrs import GROUPED_CONV

KERNEL = "amp_dwconv"  # the PrimFunc name hint (fused kernels: fused_amp_dwconv_add_...)
DEPTHWISE, GROUPED = "depthwise", "grouped"
LOAD_BYTES = 16       # one vector load per thread and pixel
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
MAX_TX = 32           # threads along channels
BLOCK_THREADS = 256   # threads per block (at most)
TW_CHOICES = (4, 2, 1)  # outputs per thread along W (those dividing Wo)
MAX_UNROLL_R = 16     # grouped: the per-group channel loop is unrolled up to this length


# --------------------------------------------------------------------------------- the compute
def conv_te(te, tirx, x, w, strides, padding, groups: int, out_dtype: str, out_hw):
    """The grouped conv of ``x`` [N, H, W, Cin] with ``w`` [kh, kw, Cin/groups, O] (stride,
    padding (top, left, bottom, right), dilation 1) as a TE tensor [N, Ho, Wo, O] (module doc).
    ``te``/``tirx``: TVM's modules (the caller has them from ``tvm_compat``)."""
    n, h, wd, cin = x.shape  # symbolic dims allowed (the rule then declines the kernel)
    kh, kw, cin_g, o = (int(d) for d in w.shape)
    sh, sw = strides
    pt, pl, pb, pr = padding
    ho, wo = out_hw
    cout_g = o // groups

    def pad(b, p, q, c):
        inside = tirx.all(p >= pt, p < h + pt, q >= pl, q < wd + pl)
        return tirx.if_then_else(inside, x[b, p - pt, q - pl, c], tirx.const(0, x.dtype))

    xp = te.compute((n, h + pt + pb, wd + pl + pr, cin), pad, name="pad")
    i = te.reduce_axis((0, kh), name="i")
    j = te.reduce_axis((0, kw), name="j")
    if cin_g == 1 and cout_g == 1:
        return te.compute(
            (n, ho, wo, o),
            lambda b, p, q, c: te.sum(xp[b, p * sh + i, q * sw + j, c].astype(out_dtype)
                                      * w[i, j, 0, c].astype(out_dtype), axis=[i, j]),
            name="dwconv", attrs={GROUPED_CONV: 1})
    r = te.reduce_axis((0, cin_g), name="r")
    return te.compute(
        (n, ho, wo, o),
        lambda b, p, q, c: te.sum(
            xp[b, p * sh + i, q * sw + j, c // cout_g * cin_g + r].astype(out_dtype)
            * w[i, j, r, c].astype(out_dtype), axis=[i, j, r]),
        name="dwconv", attrs={GROUPED_CONV: cout_g})


# ------------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class Plan:
    vec: int  # output channels per thread (one vector)
    tx: int   # threads along channels
    ty: int   # threads along the fused (n, ho, wo / tw) positions
    tw: int   # outputs per thread along W

    def threads(self) -> int:
        return self.tx * self.ty


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def plan(n: int, ho: int, wo: int, c: int, cout_g: int, dtype: str, sm: int,
         tw: int | None = None) -> Plan:
    """Tile sizes for an [n, ho, wo, c] output: the widest vector of channels that divides C
    (and the group's output channels), as many outputs along W per thread as keep at least two
    256-thread blocks' worth of threads per SM for every SM (a guess, to be measured: latency
    hiding against reuse), and blocks of up to ``BLOCK_THREADS`` threads whose sizes divide the
    extents (no predicates). ``tw``: outputs per thread along W instead (a divisor of ``wo``;
    benchmarks/depthwise_bench.py sweeps it)."""
    max_vec = LOAD_BYTES // DTYPE_BYTES.get(dtype, 4)
    vec = next(v for v in (8, 4, 2, 1)
               if v <= max_vec and c % v == 0 and (cout_g == 1 or cout_g % v == 0))
    lanes = c // vec
    tx = _largest_divisor(lanes, MAX_TX)
    min_threads = 2 * sm_count(sm) * BLOCK_THREADS
    if tw is None:
        tw = next((t for t in TW_CHOICES
                   if wo % t == 0 and n * ho * (wo // t) * lanes >= min_threads), 1)
    ty = _largest_divisor(n * ho * (wo // tw), max(1, BLOCK_THREADS // tx))
    return Plan(vec, tx, ty, tw)


# -------------------------------------------------------------------------------- the schedule
def find_conv_block(sch):
    """(the annotated conv block, its output channels per group) in ``sch``'s function, or
    None."""
    root = tvm_compat.dlight_analysis().get_root_block(sch)
    found = [(b, sch.get(b).annotations[GROUPED_CONV]) for b in sch.get_child_blocks(root)
             if GROUPED_CONV in sch.get(b).annotations]
    if len(found) != 1:
        return None
    block, value = found[0]
    value = getattr(value, "value", value)  # an IntImm, or a plain int through tvm-ffi
    return (block, value) if isinstance(value, int) and value > 0 else None


def _static_extents(block) -> list[int] | None:
    """The block's iteration extents, or None when one is symbolic."""
    out = []
    for iv in block.iter_vars:
        lo, ext = iv.dom.min, iv.dom.extent
        if not (hasattr(lo, "value") and hasattr(ext, "value")) or int(lo.value) != 0:
            return None
        out.append(int(ext.value))
    return out


def _writes_output(sch, block_rv, outputs) -> bool:
    return any(region.source.same_as(b) for region in sch.get(block_rv).writes for b in outputs)


def schedule_conv(func, sm: int, bind: bool = True, tw: int | None = None):
    """A ``tvm.s_tir.Schedule`` of ``func`` (a PrimFunc with one :func:`conv_te` block and any
    fused producers/epilogue), or None when ``func`` is not one or its shape is not supported
    (non-static extents, a producer or consumer that cannot be inlined). ``bind``: map the
    loops to CUDA threads (False leaves them serial, so a CPU build can check the schedule's
    values). ``tw``: outputs per thread along W instead of :func:`plan`'s (a divisor of Wo)."""
    tvm = tvm_compat.tvm()
    sch = tvm.s_tir.Schedule(func)
    found = find_conv_block(sch)
    if found is None:
        return None
    conv, cout_g = found
    extents = _static_extents(sch.get(conv))
    if extents is None or len(extents) not in (6, 7):
        return None
    kind = DEPTHWISE if len(extents) == 6 else GROUPED
    n, ho, wo, c = extents[:4]
    outputs = list(func.params)  # TVM 0.27: a buffer parameter is its buffer
    root = tvm_compat.dlight_analysis().get_root_block(sch)
    blocks = list(sch.get_child_blocks(root))
    names = [sch.get(b).name_hint for b in blocks]
    at = names.index(sch.get(conv).name_hint)
    pad_name = sch.get(sch.get_producers(conv)[0]).name_hint if sch.get_producers(conv) else None
    if pad_name is None:
        return None

    # Producers other than the padded image (a fused cast, a weight transpose) are inlined.
    for name in names[:at]:
        if name != pad_name:
            sch.compute_inline(sch.get_sblock(name))
    pad = sch.get_sblock(pad_name)
    # Epilogue blocks that do not write an output are inlined into those that do.
    epilogue = []
    for name in names[at + 1:]:
        block = sch.get_sblock(name)
        if _writes_output(sch, block, outputs):
            epilogue.append(block)
        else:
            sch.compute_inline(block)
    if _writes_output(sch, conv, outputs):
        epilogue.insert(0, sch.cache_write(conv, 0, "local"))
    else:
        sch.set_scope(conv, 0, "local")

    dtype = _input_dtype(sch.get(conv))
    if tw is not None and wo % tw:
        return None
    p = plan(n, ho, wo, c, cout_g, dtype, sm, tw)

    loops = sch.get_loops(conv)
    ln, lh, lw, lc, li, lj = loops[:6]
    lr = loops[6] if kind == GROUPED else None
    w_out, w_in = sch.split(lw, [None, p.tw])
    c_out, tx, v = sch.split(lc, [None, p.tx, p.vec])
    by, ty = sch.split(sch.fuse(ln, lh, w_out), [None, p.ty])
    inner = [li, lj] + ([lr] if lr is not None else []) + [w_in, v]
    sch.reorder(by, c_out, ty, tx, *inner)
    bx = sch.fuse(by, c_out)
    if bind:
        sch.bind(bx, "blockIdx.x")
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")

    for block in epilogue:  # on the accumulators, vec channels stored at once
        sch.reverse_compute_at(block, tx, preserve_unit_loops=False)
        _vectorize_last(sch, block, p.vec)
        _unroll_all_but_last(sch, block, tx)

    # The filter row (depthwise) / the filter vector of one input channel (grouped) in registers.
    load_at = li if kind == DEPTHWISE else lr
    wcache = sch.cache_read(conv, 1, "local")
    sch.compute_at(wcache, load_at, preserve_unit_loops=False)
    _vectorize_last(sch, wcache, p.vec)
    _unroll_all_but_last(sch, wcache, load_at)
    if kind == DEPTHWISE:
        # The input pixels of this filter row in registers: (tw-1)*sw + kw vectors.
        sch.set_scope(pad, 0, "local")
        sch.compute_at(pad, li, preserve_unit_loops=False)
        _vectorize_last(sch, pad, p.vec)
        _unroll_all_but_last(sch, pad, li)
    else:
        sch.compute_inline(pad)  # one input value serves the thread's vec output channels

    sch.decompose_reduction(conv, li)
    for loop in (li, lj, w_in, v):
        sch.unroll(loop)
    if lr is not None and extents[6] <= MAX_UNROLL_R:
        sch.unroll(lr)
    return sch


def _input_dtype(block) -> str:
    return str(block.reads[0].source.dtype)


def _vectorize_last(sch, block, vec: int) -> None:
    loops = sch.get_loops(block)
    last = loops[-1]
    extent = sch.get(last).extent
    if vec > 1 and hasattr(extent, "value") and int(extent.value) == vec:
        sch.vectorize(last)


def _unroll_all_but_last(sch, block, outer) -> None:
    """Unroll the loops of ``block`` below ``outer`` but its innermost (vectorized) one."""
    loops = list(sch.get_loops(block))
    below = loops[[sch.get(lp).same_as(sch.get(outer)) for lp in loops].index(True) + 1:]
    for loop in below[:-1]:
        sch.unroll(loop)

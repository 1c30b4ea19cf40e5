"""Layer norm and its fp16/bf16 cast as one CUDA kernel with two outputs.

amp's precision policy keeps ``nn.layer_norm`` in fp32. In a post-LN transformer (BERT) its
output ``y`` has two consumers: ``astype(y, fp16)``, the next GEMM's input, and a residual add
fused into a later GEMM's epilogue. FuseOps cannot fuse the cast into the layer norm kernel (``y``
must be written for the residual anyway), so the cast is a kernel of its own that reads ``y``
back: 48 launches and 48 fp32 reads of the activations on bert-large.

This Relax pass (after precision conversion, before LegalizeOps) replaces such a pair by one
``call_tir`` of a two-output PrimFunc, ``(y fp32, y fp16/bf16)``; ``y``'s other consumers read the
fp32 output. When ``x`` is itself ``astype(h, fp32)`` of an fp16/bf16 ``h`` (that cast is a kernel
of its own too: FuseOps does not fuse it into the layer norm), the kernel reads ``h``.

The kernel computes exactly what TVM's legalized layer norm computes, in fp32: the mean, the
centered variance sum, ``(x - mean) * rsqrt(var_sum / N + eps) * gamma + beta``, with the same
epsilon. It is written in TE (``norm_cast_compute``, runs on any target) and scheduled here
(``schedule_norm_cast``): one CTA per row, each thread holds a contiguous chunk of the row in
registers (loaded once, ``vec``-wide vector loads), two block-wide sums (warp shuffles + shared
memory, TVM's cross-thread reduction), then ``vec``-wide stores of both outputs.

Declined (left unchanged, counted): rows whose length is not a multiple of 32 or longer than
``MAX_THREADS * MAX_PER_THREAD``. The row count may be symbolic (a dynamic model's batch x
sequence: the grid is sized at run time; the kernel then sees the rows flattened, ``reshape``
views before and after, as the schedule's fused row loop over several symbolic dims is not
affine); the row length must be static. Not matched at all:
a symbolic row length, axes other than the last,
``center``/``scale`` off, non-fp32 layer norms, and layer norms whose only consumers are casts
(FuseOps already fuses those into one kernel).
"""
from __future__ import annotations

from .... import tvm_compat
from ....dtypes import LOW_TYPES
from ....ir_attrs import IS_SCHEDULED, OP_PATTERN
from ..registry import register
from .base import (add_counts, bindings_and_users, module_pass, op_name, rewrite_calls,
                   shape_of, static_shape)

MAX_THREADS = 256     # threads per row (CTA); more rows fill the GPU instead
MAX_PER_THREAD = 64   # fp32 row elements one thread keeps in registers
VECTORS = (4, 2, 1)   # fp32 lanes per load/store, widest first (4 = 16 bytes)


def plan_threads(n: int):
    """(threads, vec) for a row of ``n`` elements, or a string saying why the kernel does not
    serve ``n``. ``vec``: the widest of 4/2/1 fp32 lanes with ``n % (32 * vec) == 0``;
    ``threads``: the most full warps (shuffle reduction), up to MAX_THREADS, that split the row
    into equal chunks of ``vec``-vectors, one chunk per thread.

    >>> plan_threads(1024), plan_threads(320), plan_threads(100)
    ((256, 4), (160, 2), 'row length 100 is not a multiple of 32')
    """
    for vec in VECTORS:
        if n % (32 * vec) == 0:
            break
    else:
        return f"row length {n} is not a multiple of 32"
    warps = max(d for d in range(1, MAX_THREADS // 32 + 1) if (n // (32 * vec)) % d == 0)
    threads = 32 * warps
    if n // threads > MAX_PER_THREAD:
        return f"row length {n} is over {MAX_THREADS * MAX_PER_THREAD}"
    return threads, vec


def norm_cast_compute(shape, epsilon: float, in_dtype: str = "float32",
                      low_dtype: str = "float16", fp32_out: bool = True):
    """The unscheduled PrimFunc ``(x, gamma, beta, out, out_low)``: layer norm over the last axis
    of ``x`` (``shape``, read as fp32) as TVM legalizes it, written once as fp32 ``out`` and
    once cast to ``low_dtype``; ``(x, gamma, beta, out_low)`` without ``fp32_out``. Runs on any
    target (the CPU tests build it for llvm).

    >>> f = norm_cast_compute((2, 64, 256), 1e-12)   # then schedule_norm_cast(f, 64, 4)
    """
    tvm = tvm_compat.tvm()
    te = tvm.te
    shape = [tvm_compat.size_value(d) for d in shape]  # leading dims may be symbolic
    n, lead = int(shape[-1]), shape[:-1]
    f32 = "float32"
    size, eps = tvm.tirx.const(float(n), f32), tvm.tirx.const(float(epsilon), f32)
    x = te.placeholder(shape, in_dtype, "x")
    gamma = te.placeholder((n,), f32, "gamma")
    beta = te.placeholder((n,), f32, "beta")
    # an explicit stage, so that the schedule can keep the row in registers
    xl = te.compute(shape, lambda *i: x[i].astype(f32), name="x_local")
    k = te.reduce_axis((0, n), "k")
    total = te.compute(lead, lambda *i: te.sum(xl[(*i, k)], axis=k), name="x_sum")
    k2 = te.reduce_axis((0, n), "k2")

    def centered(i, j):
        return xl[(*i, j)] - total[i] / size

    var_sum = te.compute(lead, lambda *i: te.sum(centered(i, k2) * centered(i, k2), axis=k2),
                         name="x_var_sum")
    norm = te.compute(shape, lambda *i: centered(i[:-1], i[-1]) * te.rsqrt(
        var_sum[i[:-1]] / size + eps) * gamma[i[-1]] + beta[i[-1]], name="norm")
    out_low = te.compute(shape, lambda *i: norm[i].astype(low_dtype), name="out_low")
    if not fp32_out:
        return te.create_prim_func([x, gamma, beta, out_low])
    out = te.compute(shape, lambda *i: norm[i], name="out")
    return te.create_prim_func([x, gamma, beta, out, out_low])


def schedule_norm_cast(func, threads: int, vec: int):
    """``func`` (from :func:`norm_cast_compute`) scheduled for CUDA: rows on blockIdx.x,
    ``threads`` threads per row, each owning a contiguous chunk of the row (loaded into
    registers once), ``vec``-wide loads and stores."""
    sch = tvm_compat.s_tir().Schedule(func)
    xl, total, var_sum, norm, out_low = (sch.get_sblock(name) for name in (
        "x_local", "x_sum", "x_var_sum", "norm", "out_low"))
    outs = [out_low] if len(func.params) == 4 else [sch.get_sblock("out"), out_low]
    n = int(sch.get(sch.get_loops(norm)[-1]).extent)
    chunks = n // threads // vec

    def split(loop):
        # thread-contiguous chunks: a thread's registers compact to n / threads elements (a
        # row-strided layout would make TVM allocate the whole row per thread)
        tx, it, v = sch.split(loop, [threads, chunks, vec])
        sch.bind(tx, "threadIdx.x")
        sch.unroll(it)
        return it, v

    loops = sch.get_loops(norm)
    row = sch.fuse(*loops[:-1])
    sch.bind(row, "blockIdx.x")
    it, v = split(loops[-1])
    sch.vectorize(v)
    for block in outs:
        sch.reverse_compute_at(block, it)
        sch.vectorize(sch.get_loops(block)[-1])
    sch.set_scope(norm, 0, "local")
    for block in (var_sum, total):
        sch.compute_at(block, row)
        split(sch.get_loops(block)[-1])
        # local: TVM's allreduce hands every thread the sum (no write-back and barrier)
        sch.set_scope(block, 0, "local")
    sch.compute_at(xl, row)
    sch.vectorize(split(sch.get_loops(xl)[-1])[-1])
    sch.set_scope(xl, 0, "local")
    return sch.mod["main"]


OPAQUE = 8  # relax OpPatternKind kOpaque: FuseOps leaves the scheduled kernel alone


def norm_cast_func(shape, epsilon: float, in_dtype: str = "float32",
                   low_dtype: str = "float16", fp32_out: bool = True):
    """The scheduled CUDA PrimFunc for a supported row length (see :func:`plan_threads`)."""
    threads, vec = plan_threads(int(shape[-1]))
    func = schedule_norm_cast(norm_cast_compute(shape, epsilon, in_dtype, low_dtype, fp32_out),
                              threads, vec)
    return func.with_attr(IS_SCHEDULED, True).with_attr(OP_PATTERN, OPAQUE)


def _low_cast(expr, var) -> str | None:
    """The fp16/bf16 type ``expr`` casts ``var`` to, else None."""
    if (op_name(expr) == "relax.astype" and expr.args[0].same_as(var)
            and str(expr.attrs.dtype) in LOW_TYPES):
        return str(expr.attrs.dtype)
    return None


def _low_source(x, bound):
    """``h`` when ``x`` is (bound to) ``astype(h, fp32)`` of an fp16/bf16 ``h``, else None."""
    src = bound.get(x)
    if op_name(src) == "relax.astype" and src.args[0].ty.dtype in LOW_TYPES:
        return src.args[0]
    return None


def _candidates(mod) -> dict:
    """layer_norm call -> (low type, reason it is declined or None, fp32 output used) for each
    fp32, static-shape, last-axis layer norm whose output is cast to fp16/bf16 and either used
    by something else too, or read from an fp16/bf16 tensor through a cast (a pre-LN
    transformer's ``astype(h, fp32) -> layer_norm -> astype(fp16)``: one kernel for three)."""
    found = {}
    bound, users = bindings_and_users(mod)
    for var, uses in users.items():
        casts = [c for c in (_low_cast(u, var) for u in uses) if c]
        if not casts:
            continue
        ln = bound.get(var)
        if op_name(ln) != "relax.nn.layer_norm" or not (ln.attrs.center and ln.attrs.scale):
            continue
        only_casts = len(casts) == len(uses)
        if only_casts and (len(set(casts)) > 1 or _low_source(ln.args[0], bound) is None):
            continue  # FuseOps already makes layer norm + cast one kernel
        x, gamma, beta = ln.args
        shape = shape_of(x)
        if (shape is None or len(shape) < 2 or not isinstance(shape[-1], int)
                or x.ty.dtype != "float32"):
            continue
        if [int(a) % len(shape) for a in ln.attrs.axes] != [len(shape) - 1]:
            continue
        if any(static_shape(p) != shape[-1:] or p.ty.dtype != "float32" for p in (gamma, beta)):
            continue
        why = plan_threads(shape[-1])
        found[ln] = (casts[0], why if isinstance(why, str) else None, not only_casts)
    return found


def fuse_norm_casts(mod):
    """``mod`` with layer-norm/cast pairs fused (module docstring); returns (module, fused count,
    {reason: count} of the pairs left alone)."""
    relax = tvm_compat.relax()
    found = _candidates(mod)
    funcs: dict = {}   # (shape, eps, input type, low type) -> GlobalVar
    made: dict = {}    # the call_tir's var -> (its low type, the shape of flattened rows)
    declined: dict = {}

    def first_output(expr, lookup):
        """The kernel call whose first output ``expr`` is (through the reshape back from
        flattened rows), else None."""
        src = lookup(expr) if isinstance(expr, relax.Var) else None
        if op_name(src) == "relax.reshape" and isinstance(src.args[0], relax.Var):
            src = lookup(src.args[0])
        if isinstance(src, relax.TupleGetItem) and src.index == 0 and src.tuple_value in made:
            return src.tuple_value
        return None

    def low_only_output(expr, lookup):
        """The low-only kernel's output (through the reshape back from flattened rows) that
        ``expr`` -- the layer norm's stand-in ``astype(out, fp32)`` -- casts, else None."""
        src = lookup(expr) if isinstance(expr, relax.Var) else None
        if op_name(src) != "relax.astype" or not isinstance(src.args[0], relax.Var):
            return None
        low = src.args[0]
        inner = lookup(low)
        if op_name(inner) == "relax.reshape" and isinstance(inner.args[0], relax.Var):
            return low if inner.args[0] in made else None
        return low if low in made else None

    def rewrite(bb, call, lookup):
        if op_name(call) == "relax.astype":   # the cast: the kernel's (second) low output
            both = first_output(call.args[0], lookup)
            if both is not None and made[both][0] == str(call.attrs.dtype):
                low_out = relax.TupleGetItem(both, 1)
                shape = made[both][1]
                return low_out if shape is None else relax.op.reshape(bb.emit(low_out), shape)
            low = low_only_output(call.args[0], lookup)
            if low is not None and str(call.attrs.dtype) == low.ty.dtype:
                return low
            return None
        if op_name(call) != "relax.nn.layer_norm" or call not in found:
            return None
        low, why, fp32_out = found[call]
        if why is not None:
            declined[why] = declined.get(why, 0) + 1
            return None
        x, gamma, beta = call.args
        # x = astype(h, fp32) of an fp16/bf16 h: read h (that cast is a kernel of its own)
        src = lookup(x) if isinstance(x, relax.Var) else None
        if op_name(src) == "relax.astype" and src.args[0].ty.dtype in LOW_TYPES:
            x = src.args[0]
        shape = shape_of(x)
        flat = any(not isinstance(d, int) for d in shape[:-1])
        if flat:  # symbolic rows: the kernel takes [rows, N] (module docstring)
            rows = 1
            for d in shape[:-1]:
                rows = rows * d
            x = bb.emit(relax.op.reshape(x, (rows, shape[-1])))
            shape, full = [rows, shape[-1]], shape
        # the kernel's own row count variable (bound from its input's shape at run time): a
        # product of the model's dims cannot define them
        kernel_shape = (tvm_compat.tvm().tirx.Var("rows", "int64"), shape[-1]) if flat \
            else tuple(shape)
        args = (kernel_shape, float(call.attrs.epsilon), x.ty.dtype, low, fp32_out)
        key = repr((tuple(shape), *args[1:]))  # as text: PrimExprs' == builds an expression
        if key not in funcs:
            # without TE's global_symbol "main", which would clash with the Relax main
            func = norm_cast_func(*args).without_attr("global_symbol")
            funcs[key] = bb.add_func(func, "amp_norm_cast")
        low_ty = relax.TensorType(shape, low)
        if not fp32_out:
            # every user is a cast: they read the kernel's one output; the layer norm's own
            # var becomes a cast of it that nothing uses (dead-code elimination drops it)
            only = bb.emit(relax.call_tir(funcs[key], relax.Tuple([x, gamma, beta]),
                                          out_ty=low_ty))
            made[only] = (low, full if flat else None)
            out = relax.op.reshape(only, full) if flat else only
            return relax.op.astype(bb.emit(out) if flat else out, "float32")
        both = bb.emit(relax.call_tir(
            funcs[key], relax.Tuple([x, gamma, beta]),
            out_ty=[relax.TensorType(shape, "float32"), low_ty]))
        made[both] = (low, full if flat else None)
        out = relax.TupleGetItem(both, 0)
        return relax.op.reshape(bb.emit(out), full) if flat else out

    new, _ = rewrite_calls(mod, rewrite)
    return new, len(made), declined


def fuse_norm_cast_pass(stats: dict | None = None):
    """:func:`fuse_norm_casts` as a module pass (after precision conversion, before
    LegalizeOps); ``stats`` counts the fused pairs and the declined ones."""
    def run(mod):
        new, fused, declined = fuse_norm_casts(mod)
        add_counts(stats, norm_casts=fused, norm_casts_unfused=sum(declined.values()))
        return new

    return module_pass(run, "AmpFuseNormCast")


@register("fused_norm_cast", "graph", 60, switch="fused_norm_cast",
          labels={"norm_casts": "layer norms writing their fp16/bf16 cast in the same kernel",
                  "norm_casts_unfused": "layer norm + cast pairs left unfused (row length)"})
def make_pass(ctx):
    return fuse_norm_cast_pass(ctx.stats)

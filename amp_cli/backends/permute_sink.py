"""Transposes moved down through elementwise ops until they meet their inverse and vanish.

Relax's ``ConvertLayout`` (``layout.py``: the CPU pipeline, CUDA's ``conv_gemm`` /
``depthwise_conv``) makes convolutions NHWC by
wrapping them in ``permute_dims`` pairs, and it propagates the new layout only through ops it
infers layouts for. A model that transposes *itself* stops it: ConvNeXt's block is
``dwconv -> permute(0,2,3,1) -> LayerNorm -> MLP -> permute(0,3,1,2) -> gamma * y -> + x``, so
after ConvertLayout its residual stream stays NCHW and every block ran
``NHWC -> NCHW`` (the model's permute) and ``NCHW -> NHWC`` (the next conv's) as copies of
their own: 4 of convnext_tiny's 15 costliest kernels on the H100 were such transposes, ~20 % of
its time. Identity ``permute_dims(x, [0, 1, 2, 3])`` that ConvertLayout leaves behind are
copies too.

This pass rewrites, to a fixed point:

- ``permute_dims(permute_dims(x, p), q)`` -> ``permute_dims(x, p[q])``, and to ``x`` when that
  is the identity (also a lone identity permute);
- an elementwise op (``relax_calls.ELEMENTWISE``) whose non-constant tensor inputs are all
  ``permute_dims(y_i, p)`` with one ``p`` and the op's rank, at least one of them used only
  there, and whose other inputs are constants (transposed here, at compile time, after
  broadcasting to that rank) -> ``permute_dims(op(y_1, ...), p)``.

The values are the same (an elementwise op commutes with a permutation of its operands' axes).
The "used only there" condition keeps the count of transposes from growing: each sink retires
at least one. Sinking carries a transpose along the model's own dataflow until it reaches the
inverse transpose that ConvertLayout put in front of the next convolution, where both go; one
that reaches no inverse ends where it would have fused anyway (into its consumer's kernel).

Both backends run it right after their ``ConvertLayout`` (CUDA: ``cuda/rewrites/permute_sink.py``,
switch ``cuda.sink_permutes``; CPU: ``cpu/pipeline.py``'s layout passes).
"""
from __future__ import annotations

from .. import tvm_compat
from .relax_calls import ELEMENTWISE, bindings_and_users, op_name, rewrite_calls

MAX_ROUNDS = 16  # each round moves every transpose at least one op; ConvNeXt needs 3


def _axes(call) -> list[int] | None:
    """The permutation of a ``permute_dims`` call (None axes: reversed), or None."""
    if op_name(call) != "relax.permute_dims":
        return None
    rank = getattr(call.args[0].ty, "ndim", -1)
    if call.attrs.axes is None:
        return None if rank < 0 else list(range(rank))[::-1]
    return [int(a) for a in call.attrs.axes]


def compose(p: list[int], q: list[int]) -> list[int]:
    """The axes of ``permute_dims(permute_dims(x, p), q)`` as one permute.

    >>> compose([0, 3, 1, 2], [0, 2, 3, 1])
    [0, 1, 2, 3]
    """
    return [p[i] for i in q]


def _inverse(p: list[int]) -> list[int]:
    inv = [0] * len(p)
    for i, a in enumerate(p):
        inv[a] = i
    return inv


def _permuted_constant(const, rank: int, p: list[int]):
    """The constant ``c'`` with ``permute_dims(c', p)`` == ``const`` broadcast to ``rank``, or
    None when it cannot broadcast to that rank."""
    relax = tvm_compat.relax()
    import numpy as np

    arr = tvm_compat.constant_value(const)
    if arr.ndim > rank:
        return None
    arr = arr.reshape((1,) * (rank - arr.ndim) + arr.shape)
    return relax.const(np.ascontiguousarray(np.transpose(arr, _inverse(p))), str(arr.dtype))


def sink_permutes(mod):
    """(``mod`` rewritten to a fixed point, number of rewrites); see the module docstring."""
    relax = tvm_compat.relax()
    Constant = tvm_compat.tvm().ir.expr.Constant  # tvm_compat.constant_value reads one
    total = 0
    for _ in range(MAX_ROUNDS):
        _, users = bindings_and_users(mod)

        def permute_of(lookup, expr):
            """(source, axes) when ``expr`` is a Var bound to a permute_dims, else None."""
            if not isinstance(expr, relax.Var):
                return None
            bound = lookup(expr)
            axes = _axes(bound)
            return None if axes is None else (bound.args[0], axes)

        def rewrite(bb, call, lookup):
            if not bb.current_block_is_dataflow():
                return None  # a dataflow block's vars must not reach the bindings after it
            axes = _axes(call)
            if axes is not None:
                if axes == list(range(len(axes))):
                    return call.args[0]
                inner = permute_of(lookup, call.args[0])
                if inner is None:
                    return None
                src, p = inner
                both = compose(p, axes)
                if both == list(range(len(both))):
                    return src
                return relax.op.permute_dims(src, both)
            if op_name(call) not in ELEMENTWISE:
                return None
            rank = getattr(call.ty, "ndim", -1)
            perm, single, args = None, False, []
            for arg in call.args:
                if isinstance(arg, Constant):
                    args.append(arg)
                    continue
                if not isinstance(getattr(arg, "ty", None), relax.TensorType):
                    if isinstance(arg, relax.Var):
                        return None
                    args.append(arg)  # clip's bounds and the like (PrimValue)
                    continue
                inner = permute_of(lookup, arg)
                if inner is None or len(inner[1]) != rank or (perm and inner[1] != perm):
                    return None
                perm = inner[1]
                single = single or len(users.get(arg, ())) == 1
                args.append(inner[0])
            if perm is None or not single:
                return None
            for i, arg in enumerate(args):
                if isinstance(arg, Constant) and getattr(arg.ty, "ndim", 0) > 0:
                    moved = _permuted_constant(arg, rank, perm)
                    if moved is None:
                        return None
                    args[i] = moved
            inner_call = bb.emit(relax.Call(call.op, args, call.attrs, list(call.ty_args)))
            return relax.op.permute_dims(inner_call, perm)

        mod, count = rewrite_calls(mod, rewrite)
        total += count
        if not count:
            break
    return mod, total


def sink_permutes_pass(stats: dict | None = None):
    """:func:`sink_permutes` as a module pass; ``stats["permutes_sunk"]`` counts the rewrites."""
    tvm = tvm_compat.tvm()

    @tvm.transform.module_pass(opt_level=0, name="AmpSinkPermutes")
    def _pass(mod, _ctx):
        new, count = sink_permutes(mod)
        if stats is not None:
            stats["permutes_sunk"] = stats.get("permutes_sunk", 0) + count
        return new

    return _pass

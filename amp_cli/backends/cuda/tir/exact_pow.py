"""``pow`` that keeps its sign on CUDA: fast math turns ``powf`` into ``__powf``.

Symptom: HF GPT-2 (GELU ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``) came out 100 % inf/NaN
on the H200 while the same converted module was accurate on the CPU (rel L2 5.6e-4).

Cause (apache-tvm 0.27 ``tvm/support/nvcc.py``): both the nvcc and the NVRTC path compile with
``--use_fast_math``, which maps ``powf`` to the intrinsic ``__powf(x, y) = exp2(y·log2(x))``:
NaN for every negative ``x``, even for an integer exponent, where C's ``powf(-2, 3)`` is -8.
The pow ran in fp32 (amp's policy keeps it there), so no precision choice could fix it; about
half of the kernel's outputs (the negative inputs) were NaN. ``x.pow(2)`` in RMSNorm / variance
code has the same problem.

Fix, a PrimFunc pass at the start of amp's CUDA TIR pipeline (before any other pass sees the
call): ``pow(x, c)`` with ``c`` an integer-valued constant, ``|c| <= MAX_UNROLLED``, becomes a
product of ``x`` (square-and-multiply; ``1/…`` for ``c < 0``; ``1`` for ``c == 0``), which is
exact, cheaper than the intrinsic, and what frameworks' codegen does. Any other
``pow(x, y)`` becomes ``select(x < 0 and y == floor(y), ±pow(-x, y), pow(x, y))``, the sign
from the parity of ``y``: ONNX's (numpy's) semantics for negative bases; a negative base with a
fractional exponent stays NaN.
"""
from __future__ import annotations

from .... import tvm_compat

PASS_NAME = "amp.ExactPow"
MAX_UNROLLED = 8  # |c| up to this becomes multiplications (x**8: 3 squarings)


def _dtype(expr) -> str:
    """A PrimExpr's dtype (a TIR Call carries it in ``ty``)."""
    dtype = getattr(expr, "dtype", None)
    return str(dtype if dtype is not None else expr.ty.dtype)


def _integer_constant(expr):
    """The exponent as a Python int when it is an integer-valued constant, else None."""
    value = getattr(expr, "value", None)
    if isinstance(value, bool) or value is None or not isinstance(value, (int, float)):
        return None
    if float(value) != int(value) or abs(int(value)) > MAX_UNROLLED:
        return None
    return int(value)


def _product(x, n: int):
    """x**n for n >= 1 by square-and-multiply on the expression ``x`` (a variable)."""
    result, base = None, x
    while n:
        if n & 1:
            result = base if result is None else result * base
        n >>= 1
        if n:
            base = base * base
    return result


def exact_pow(base, exponent):
    """The expression replacing ``pow(base, exponent)`` (both PrimExpr of one float dtype)."""
    T = tvm_compat.tirx()
    dtype = _dtype(base)
    one = T.const(1.0, dtype)
    n = _integer_constant(exponent)
    x = T.Var("pow_base", dtype)
    if n is not None:
        if n == 0:
            return one
        body = _product(x, abs(n))
        return T.Let(x, base, body if n > 0 else one / body)
    ydtype = _dtype(exponent)
    y = T.Var("pow_exp", ydtype)
    negative_int = T.And(T.LT(x, T.const(0.0, dtype)), T.EQ(y, T.floor(y)))
    half = y * T.const(0.5, ydtype)
    odd = T.NE(T.floor(half), half)  # y an integer: odd when y/2 is not one
    fixed = T.power(-x, y) * T.Select(odd, T.const(-1.0, dtype), one)
    return T.Let(x, base, T.Let(y, exponent, T.Select(negative_int, fixed, T.power(x, y))))


def rewrite_func(func):
    """``func`` with every float ``tirx.pow`` call replaced by :func:`exact_pow`."""
    tvm = tvm_compat.tvm()
    ir = tvm.ir
    pow_op = ir.Op.get("tirx.pow")
    changed = []

    def on_call(call, mutator):
        call = mutator.default_mutate(call)
        if call.op.same_as(pow_op) and len(call.args) == 2 and "float" in _dtype(call):
            changed.append(call)
            return exact_pow(call.args[0], call.args[1])
        return call

    body = tvm_compat.structural_mutate(func.body, [(ir.Call, on_call)])
    return func.with_body(body) if changed else func


def exact_pow_pass():
    """The PrimFunc pass applying :func:`rewrite_func`."""
    return tvm_compat.prim_func_pass(lambda f, _m, _c: rewrite_func(f), PASS_NAME)

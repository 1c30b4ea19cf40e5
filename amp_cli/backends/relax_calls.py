"""Call-level rewriting of Relax modules, shared by both backends' graph passes (the CUDA
rewrites in ``cuda/rewrites/``, the layout guards in ``layout.py``).

``rewrite_calls(mod, fn)`` visits every call of every Relax function bottom-up (arguments are
rewritten first) and replaces a call by what ``fn(builder, call, lookup)`` returns, or keeps it
when ``fn`` returns None. ``builder`` is the mutator's BlockBuilder (``emit``/``call_te`` new
bindings before the replacement), ``lookup`` maps a dataflow Var to the expression bound to it.
Bindings a rewrite made dead (the old operands) are removed, and an untouched module is returned
as the very same object.
"""
from __future__ import annotations

from collections.abc import Callable

from .. import tvm_compat


# Relax ops computed element by element (with numpy broadcasting): a layout op (reshape,
# permute) may move past them (cuda/rewrites/reshape_sink.py, permute_sink.py)
ELEMENTWISE = frozenset(f"relax.{n}" for n in (
    "add", "subtract", "multiply", "divide", "power", "maximum", "minimum", "astype", "erf",
    "exp", "log", "tanh", "sigmoid", "sqrt", "rsqrt", "negative", "abs", "clip", "square",
    "nn.relu", "nn.gelu", "nn.gelu_tanh", "nn.silu", "floor_divide", "where"))


def static_shape(expr) -> list[int] | None:
    """The shape of a Relax expression as ints, or None when any dim is symbolic/unknown."""
    shape = getattr(expr.ty, "shape", None)
    if shape is None or not hasattr(shape, "values"):
        return None
    out = []
    for v in shape.values:
        if not hasattr(v, "value"):
            return None
        out.append(int(v.value))
    return out


def shape_of(expr) -> list | None:
    """The shape of a Relax expression, each dim an int or (symbolic) a PrimExpr over shape
    variables; None when the rank or the shape is unknown."""
    shape = getattr(expr.ty, "shape", None)
    if shape is None or not hasattr(shape, "values"):
        return None
    return [tvm_compat.size_value(v) for v in shape.values]


def op_name(expr) -> str | None:
    """The op name of a Relax call (``"relax.matmul"``), None for anything else."""
    return getattr(getattr(expr, "op", None), "name", None)


def _mutator_class():
    relax = tvm_compat.relax()

    @relax.expr_functor.mutator
    class _CallRewriter(relax.PyExprMutator):
        def __init__(self, mod, fn):
            super().__init__(mod)
            self.mod_, self.fn, self.count = mod, fn, 0

        def visit_call_(self, call):
            call = super().visit_call_(call)
            new = self.fn(self.builder_, call, self.lookup_binding)
            if new is None:
                return call
            self.count += 1
            return new

        def run(self):
            for gv, func in self.mod_.functions.items():
                if isinstance(func, relax.Function):
                    self.builder_.update_func(gv, self.visit_expr(func))
            return self.builder_.get()

    return _CallRewriter


def calls(mod) -> list:
    """Every Relax call in ``mod``'s Relax functions, in post order."""
    relax = tvm_compat.relax()
    found = []
    for _, func in mod.functions.items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(
                func.body, lambda e: found.append(e) if isinstance(e, relax.Call) else None)
    return found


def bindings_and_users(mod) -> tuple[dict, dict]:
    """(var -> its bound value, var -> the expressions that use it) over ``mod``'s Relax
    functions; a function's result counts as a use."""
    relax = tvm_compat.relax()
    bound: dict = {}
    users: dict = {}

    def note(user):
        def visit(e):
            if isinstance(e, relax.Var):
                users.setdefault(e, []).append(user)
        return visit

    for _, func in mod.functions.items():
        if not isinstance(func, relax.Function):
            continue
        for block in func.body.blocks:
            for binding in block.bindings:
                bound[binding.var] = binding.value
                relax.analysis.post_order_visit(binding.value, note(binding.value))
        relax.analysis.post_order_visit(func.body.body, note(func.body.body))
    return bound, users


def entry_functions(mod) -> list[str]:
    relax = tvm_compat.relax()
    return [gv.name_hint for gv, f in mod.functions.items() if isinstance(f, relax.Function)]


def rewrite_calls(mod, fn: Callable, cleanup: Callable | None = None):
    """(new module, number of calls replaced); see the module docstring. ``cleanup``: a pass
    (module -> module) run on a changed module before dead-code elimination."""
    relax = tvm_compat.relax()
    rewriter = _mutator_class()(mod, fn)
    new = rewriter.run()
    if not rewriter.count:
        return mod, 0
    if cleanup is not None:
        new = cleanup(new)
    return relax.transform.DeadCodeElimination(entry_functions(new))(new), rewriter.count

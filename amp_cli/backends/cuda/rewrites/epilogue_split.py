"""A GEMM's fused epilogue never broadcasts the GEMM's result to a larger tensor.

Relax's FuseOps fuses a ``kOutEWiseFusable`` call (a GEMM, a conv) with the chain of
elementwise and broadcast calls after it, checking the ops' patterns only -- not whether a
broadcast *expands* the GEMM's result (Relay's FuseOps gave a broadcast op's same-shape inputs
an elementwise edge, so only those fused into a conv; Relax's ``fuse_ops.cc`` gives every
input the op's own pattern). A squeeze-excitation block ``x * hardsigmoid(fc(pool(x)))``
multiplies the FC's [N, 1, 1, C] output into x's [N, H, W, C]: once nothing stands between
them (``sink_permutes`` made MobileNetV3's SE multiply NHWC like its conv), FuseOps puts the
FC GEMM, its hardsigmoid and the multiply into one kernel. Every GEMM schedule (amp's tiles,
dlight's) computes the GEMM's output tile and inlines the epilogue into its store; an epilogue
with more points than the GEMM cannot be inlined there, the rule raises ("consumers of the
cache-write stage that are not properly inlined") and dlight's generic Fallback takes the
kernel: one thread per output, nothing tiled. mobilenet_v3_large ran 0.661 ms with its eight
SE blocks so (the largest such kernel 0.173 ms) and 0.463 ms with the permutes left in place
(H100, 2026-12-07).

This pass runs between FuseOps and FuseTIR. A fused function with one GEMM-like call whose
result (or an elementwise function of it) reaches a call with more output elements than that
value is split in two: the GEMM and what its expanding consumer reads of it (its epilogue:
bias, activation), and the rest (the expanding call and what follows it), each its own fused
function -- so the GEMM keeps its fast schedule and the broadcast runs as an elementwise kernel.
Functions with symbolic shapes on the split edge are left alone (their sizes do not compare).
"""
from __future__ import annotations

import math

from .... import tvm_compat
from ....ir_attrs import OP_PATTERN
from ..registry import register
from .base import add_counts, module_pass, rewrite_calls, static_shape

OUT_EWISE_FUSABLE = 4  # tvm::relay::OpPatternKind::kOutEWiseFusable


def _numel(expr) -> int | None:
    shape = static_shape(expr)
    return None if shape is None else math.prod(shape)


def _vars_in(expr) -> list:
    relax = tvm_compat.relax()
    found = []
    relax.analysis.post_order_visit(
        expr, lambda e: found.append(e) if isinstance(e, relax.Var) else None)
    return found


def _callee(mod, value):
    """The PrimFunc a ``call_tir`` binding calls, or None."""
    relax = tvm_compat.relax()
    if not isinstance(value, relax.Call) or getattr(value.op, "name", None) != "relax.call_tir":
        return None
    func = mod[value.args[0]]
    return func if isinstance(func, tvm_compat.prim_func_class()) else None


def _call_args(value) -> list:
    return list(value.args[1].fields)


def plan_split(mod, func):
    """(head bindings, tail bindings) for a fused ``func`` whose GEMM result is broadcast to a
    larger tensor inside it, else None. The head is the GEMM and the ancestors of the
    expanding call's GEMM-derived inputs; the tail is every other binding."""
    relax = tvm_compat.relax()
    blocks = func.body.blocks
    if len(blocks) != 1:
        return None
    bindings = list(blocks[0].bindings)
    if not all(isinstance(b, relax.VarBinding) for b in bindings):
        return None
    anchors = []
    for b in bindings:
        callee = _callee(mod, b.value)
        if callee is None:
            if isinstance(b.value, relax.Call):
                return None  # not a plain call_tir chain: leave it
            continue
        if int((callee.attrs or {}).get(OP_PATTERN, -1)) == OUT_EWISE_FUSABLE:
            anchors.append(b)
    if len(anchors) != 1:
        return None
    derived = {anchors[0].var}
    cut = None
    for b in bindings:
        if b is anchors[0] or not isinstance(b.value, relax.Call):
            continue
        ins = [a for a in _call_args(b.value) if isinstance(a, relax.Var) and a in derived]
        if not ins:
            continue
        out_n = _numel(b.var)
        small = [a for a in ins if out_n is not None and _numel(a) is not None
                 and _numel(a) < out_n]
        if small:
            cut = (b, small)
            break
        derived.add(b.var)
    if cut is None:
        return None
    producer = {b.var: b for b in bindings}
    head_vars, stack = set(), list(cut[1])
    while stack:
        v = stack.pop()
        if v in head_vars or v not in producer:
            continue
        head_vars.add(v)
        stack.extend(_vars_in(producer[v].value))
    head = [b for b in bindings if b.var in head_vars]
    tail = [b for b in bindings if b.var not in head_vars]
    if func.body.body in head_vars or not tail:
        return None
    return head, tail


def _substitute(expr, mapping):
    relax = tvm_compat.relax()
    if isinstance(expr, relax.Var):
        return mapping.get(expr, expr)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([_substitute(f, mapping) for f in expr.fields])
    if isinstance(expr, relax.TupleGetItem):
        return relax.TupleGetItem(_substitute(expr.tuple_value, mapping), expr.index)
    if isinstance(expr, relax.Call):
        return relax.Call(expr.op, [_substitute(a, mapping) for a in expr.args], expr.attrs,
                          expr.ty_args)
    return expr


def _function(bb, name: str, attrs: dict, inputs: list, bindings: list, outputs: list):
    """Add a fused function of ``bindings`` to ``bb``: parameters for ``inputs`` (outer vars),
    result ``outputs`` (one var or a tuple). Returns its GlobalVar."""
    relax = tvm_compat.relax()
    params = [relax.Var(str(v.name), v.ty) for v in inputs]
    mapping = dict(zip(inputs, params))
    sub = relax.BlockBuilder()
    with sub.function(name, params, attrs=attrs, private=True):
        with sub.dataflow():
            for b in bindings:
                value = _substitute(b.value, mapping)
                mapping[b.var] = (sub.emit_output(value, name_hint=str(b.var.name))
                                  if b.var in outputs else
                                  sub.emit(value, name_hint=str(b.var.name)))
        result = [mapping[v] for v in outputs]
        sub.emit_func_output(result[0] if len(result) == 1 else relax.Tuple(result))
    made = sub.get()
    return bb.add_func(made[made.get_global_var(name)], name)


def split_expanding_epilogues(mod):
    """``mod`` (after FuseOps) with every fused function whose GEMM result is broadcast to a
    larger tensor split in two (module docstring); returns (module, count)."""
    relax = tvm_compat.relax()
    plans = {}
    for gv, func in mod.functions_items():
        if (isinstance(func, relax.Function) and func.attrs is not None
                and int(func.attrs.get("Primitive", 0)) == 1):
            plan = plan_split(mod, func)
            if plan is not None:
                plans[gv] = plan
    if not plans:
        return mod, 0
    made: dict = {}
    names = {gv.name_hint for gv in mod.get_global_vars()}

    def fresh(bindings):
        base = "fused_" + "_".join(b.value.args[0].name_hint for b in bindings
                                   if _callee(mod, b.value) is not None)
        name, i = base, 1
        while name in names:
            name, i = f"{base}_{i}", i + 1
        names.add(name)
        return name

    def split_functions(bb, gv):
        """(head GlobalVar, tail GlobalVar, head params, tail params, exports) of ``gv``'s
        split, the two functions added to ``bb`` on first use."""
        if gv not in made:
            func = mod[gv]
            head, tail = plans[gv]
            head_vars, params = {b.var for b in head}, set(func.params)
            tail_reads = [v for b in tail for v in _vars_in(b.value)]
            exports = list(dict.fromkeys(v for v in tail_reads + _vars_in(func.body.body)
                                         if v in head_vars))
            head_params = list(dict.fromkeys(v for b in head for v in _vars_in(b.value)
                                             if v in params))
            tail_params = list(dict.fromkeys(v for v in tail_reads if v in params))
            attrs = {k: v for k, v in func.attrs.items() if k != "global_symbol"}
            result = _vars_in(func.body.body)  # the function's output var, or a tuple's
            made[gv] = (_function(bb, fresh(head), attrs, head_params, head, exports),
                        _function(bb, fresh(tail), attrs, tail_params + exports, tail,
                                  result if len(result) > 1 else [func.body.body]),
                        head_params, tail_params, exports)
        return made[gv]

    def rewrite(bb, call, lookup):  # noqa: ARG001
        gv = call.op
        if not isinstance(gv, relax.GlobalVar) or gv not in plans:
            return None
        head_gv, tail_gv, head_params, tail_params, exports = split_functions(bb, gv)
        actual = dict(zip(mod[gv].params, call.args))
        out = bb.emit(relax.Call(head_gv, [actual[p] for p in head_params]))
        got = ([out] if len(exports) == 1 else
               [bb.emit(relax.TupleGetItem(out, i)) for i in range(len(exports))])
        return relax.Call(tail_gv, [actual[p] for p in tail_params] + got)

    new, _ = rewrite_calls(mod, rewrite)
    keep = {gv: f for gv, f in new.functions_items() if gv not in plans}
    out = tvm_compat.tvm().IRModule(keep, attrs=new.attrs)
    return out, len(plans)


@register("split_expanding_epilogues", "fused", 10, switch="split_expanding_epilogues",
          labels={"epilogues_split": "GEMM kernels split where their epilogue broadcast the "
                                     "result to a larger tensor"})
def _make(ctx):
    def run(mod):
        new, n = split_expanding_epilogues(mod)
        add_counts(ctx.stats, epilogues_split=n)
        return new

    return module_pass(run, "AmpSplitExpandingEpilogues")

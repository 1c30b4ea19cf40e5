"""Weight pre-packing for amp's CPU GEMM rule: the layout map of a packed weight, which
call_tir arguments are constants, and the rewrite of the callers of a packed kernel."""
from __future__ import annotations

from ... import tvm_compat
from .analysis import type_name


def pack_map(ndim: int, jv: int):
    IndexMap = tvm_compat.index_map_class()

    def fn(*idx):
        return (idx[-1] // jv, *idx[:-1], idx[-1] % jv)

    return IndexMap.from_func(fn, ndim=ndim)


def constant_call_args(mod) -> dict:
    """PrimFunc name -> indices of the arguments that are constants at every call_tir."""
    tvm = tvm_compat.tvm()
    relax = tvm.relax
    call_tir = tvm.ir.Op.get("relax.call_tir")
    seen: dict = {}
    for _gv, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        for block in getattr(func.body, "blocks", []):
            for binding in block.bindings:
                call = binding.value
                if not isinstance(call, relax.Call) or not call.op.same_as(call_tir):
                    continue
                name = call.args[0].name_hint
                consts = {k for k, a in enumerate(call.args[1].fields)
                          if type_name(a) in ("Constant", "GenericConst")}
                seen[name] = consts if name not in seen else (seen[name] & consts)
    return seen


def rewrite_packed_callers(mod, packs: dict, updates: dict):
    """Wrap the packed arguments of call_tir(f, args) in relax layout_transform."""
    tvm = tvm_compat.tvm()
    relax = tvm.relax
    call_tir = tvm.ir.Op.get("relax.call_tir")

    @relax.expr_functor.mutator
    class _Rewriter(relax.PyExprMutator):
        def visit_call_(self, call):  # noqa: N802 - TVM visitor naming
            call = super().visit_call_(call)
            if not call.op.same_as(call_tir):
                return call
            name = call.args[0].name_hint
            if name not in packs:
                return call
            args = list(call.args[1].fields)
            for pidx, ndim, jv in packs[name]:
                args[pidx] = self.builder_.emit(
                    relax.op.layout_transform(args[pidx], pack_map(ndim, jv)))
            return relax.Call(call.op, [gv_map[name], relax.Tuple(args)] + list(call.args[2:]),
                              call.attrs, call.ty_args, call.span)

    rw = _Rewriter(mod)
    gv_map = {}
    for gv, func in updates.items():
        if gv.name_hint in packs:
            gv_map[gv.name_hint] = rw.builder_.add_func(func, gv.name_hint + "_packed")
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            rw.builder_.update_func(gv, rw.visit_expr(func))
    return rw.builder_.get()

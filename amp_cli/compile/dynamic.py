"""What a build adds to a module with dynamic dims (docs/dynamic-shapes.md): a range check at
the entry of ``main``, a function that tells what the library accepts, and (``specialize``)
a copy of the model compiled for the optimum shape exactly, which ``main`` dispatches to when
the input has that shape.

The check runs in the VM before any kernel, so a shape outside the ranges is a Python
``AssertionError`` naming every range (``vm["main"](x)`` called directly included), never a
kernel reading past a buffer planned for the largest shape. Inputs whose dims disagree (an
``attention_mask`` of another batch than ``input_ids``) are stopped earlier still, by the VM's
own shape matching, with a ValueError.
"""
from __future__ import annotations

import json
import math

from .. import tvm_compat
from ..dims import describe_ranges, module_ranges
from ..ir_attrs import (CAPTURE_SYMBOLIC_VARS, DIM_OPTIMUM, INPUT_RANGES_FUNCTION, IS_HOST_FUNC,
                        NOALIAS, TIR_VAR_LOWER_BOUND, TIR_VAR_UPPER_BOUND)
from ..ir_module import replace_functions, replace_main

DYNAMIC_FUNCTION = "main_dynamic"  # the model for every shape in the ranges (symbolic kernels)
OPTIMUM_FUNCTION = "main_optimum"  # the model at the optimum shape (static kernels)
# main_dynamic again, captured as CUDA graphs per shape, for the shapes on the capture grid
GRAPHS_FUNCTION = "main_dynamic_graphs"
# CUDA graphs of the symbolic function are captured once per distinct shape (TVM's cache keeps
# every one), so only when the ranges hold at most this many shapes (docs/dynamic-shapes.md)
MAX_CAPTURED_SHAPES = 1024


def shape_count(ranges: dict) -> int:
    """How many distinct input shapes the ranges ({dim: DimRange}) accept."""
    count = 1
    for r in ranges.values():
        count *= r.hi - r.lo + 1
    return count


def capture_per_shape(func, ranges: dict):
    """``func`` (the symbolic function) marked so that TVM's RewriteCUDAGraph also captures its
    regions whose shapes depend on the dims, one graph per shape seen, when the ranges hold at
    most :data:`MAX_CAPTURED_SHAPES` shapes; else ``func`` (only its static regions are
    captured)."""
    if shape_count(ranges) > MAX_CAPTURED_SHAPES:
        return func
    return func.with_attr(CAPTURE_SYMBOLIC_VARS, list(ranges))


def capture_grid(ranges: dict, limit: int = MAX_CAPTURED_SHAPES) -> dict[str, int] | None:
    """For ranges holding more than ``limit`` shapes: {dim: step}, the shapes whose every dim
    is a multiple of its step (a power of two) being at most ``limit`` -- the shapes a
    ``main_dynamic_graphs`` copy captures as CUDA graphs, one per shape seen, so TVM's cache
    (which never evicts) stays bounded. Steps double on the dim with the most sizes left
    until the grid fits: BERT's batch 1..32 x sequence 16..512 keeps every batch and the
    sequences that are multiples of 16 (what tokenizers pad to), 1,024 shapes. None when the
    ranges fit ``limit`` as they are (every shape is captured) or no grid of them does.

    >>> from amp_cli.config import DimRange
    >>> capture_grid({"batch": DimRange(1, 32, 8), "sequence": DimRange(16, 512, 128)})
    {'batch': 1, 'sequence': 16}
    >>> capture_grid({"batch": DimRange(1, 32, 8)}) is None
    True
    """
    def sizes(r, step):
        return r.hi // step - (r.lo - 1) // step

    if shape_count(ranges) <= limit:
        return None
    steps = {name: 1 for name in ranges}
    while math.prod(sizes(ranges[n], s) for n, s in steps.items()) > limit:
        name = max(steps, key=lambda n: sizes(ranges[n], steps[n]))
        if sizes(ranges[name], steps[name]) <= 1:
            return None
        steps[name] *= 2
    return steps


def capture_note(ranges: dict, specialize: bool) -> str:
    """The report's line on which shapes of a dynamic CUDA build with CUDA graphs on replay
    captured graphs: what :func:`guard_dynamic` arranges for ``ranges``."""
    head = ("CUDA graphs: the copy at the optimum shape runs as one captured graph; "
            "every other shape" if specialize else "CUDA graphs: every shape")
    count = shape_count(ranges)
    if count <= MAX_CAPTURED_SHAPES:
        return head + (f" is captured at its first call (the ranges hold {count} shapes)")
    grid = capture_grid(ranges)
    if grid is None:
        return head + " launches its kernels one by one"
    on = ", ".join(f"{n} a multiple of {s}" if s > 1 else f"any {n}" for n, s in grid.items())
    return head + (f" with {on} is captured at its first call (at most "
                   f"{MAX_CAPTURED_SHAPES} graphs); other shapes launch their kernels one by one")


def range_message(ranges: dict) -> str:
    """The AssertionError text: the sizes given ({} placeholders, filled by the VM) and every
    allowed range."""
    given = ", ".join(f"{name}={{}}" for name in ranges)
    return (f"amp: input shape outside the ranges this library was built for: {given}; "
            f"allowed: {describe_ranges(ranges)}")


def ranges_json(ranges: dict) -> str:
    """What ``amp_input_ranges()`` returns: {dim: {"min", "max", "opt"}}."""
    return json.dumps({name: {"min": r.lo, "max": r.hi, "opt": r.optimum}
                       for name, r in ranges.items()})


def guard_dynamic(mod, specialize: bool = False, graphs: bool = False):
    """``mod`` with main's range check and ``amp_input_ranges()``, and with ``specialize`` the
    dispatch to a static copy at the optimum; a static module as it is. ``graphs`` (a CUDA
    build with CUDA graphs on): main runs the model as ``main_dynamic``, whose regions over the
    dynamic dims are captured per shape when the ranges hold at most
    :data:`MAX_CAPTURED_SHAPES` shapes; wider ranges get the ``main_dynamic_graphs`` copy for
    the shapes of their :func:`capture_grid`."""
    ranges = module_ranges(mod)
    if not ranges:
        return mod
    if specialize or graphs:
        grid = capture_grid(ranges) if graphs else None
        sizes = {n: r.optimum for n, r in ranges.items()} if specialize else None
        mod = dispatch_copies(mod, sizes, grid).clone()
        if graphs:
            # the captured function is main's callee, never main itself: per-shape capture
            # in main (with its range check) fails in TVM 0.27's VM codegen ("Var storage is
            # not defined", a symbolic-only ResNet-50; tests/test_dynamic.py)
            gv = mod.get_global_var(DYNAMIC_FUNCTION)
            mod[gv] = capture_per_shape(mod[gv], ranges)
    main = mod["main"]
    by_name = {str(v.name): v for v in tvm_compat.symbolic_vars(main)}
    dims = [by_name[n] for n in ranges]
    checked = tvm_compat.with_range_check(main, dims, [(r.lo, r.hi) for r in ranges.values()],
                                          range_message(ranges))
    new = mod.clone()
    new[mod.get_global_var("main")] = checked
    new[INPUT_RANGES_FUNCTION] = tvm_compat.string_function(INPUT_RANGES_FUNCTION,
                                                            ranges_json(ranges))
    return new


def dispatch_copies(mod, sizes: dict[str, int] | None = None,
                    grid: dict[str, int] | None = None):
    """``mod`` whose main runs ``main_dynamic`` (main as it was) and, with ``sizes``,
    ``main_optimum`` (main with each dynamic dim bound to ``sizes``: static shapes, so every
    static-shape rewrite and kernel applies) when the input has exactly that shape. Both read
    the same weights (the build's constant dedup keeps one copy of what the passes leave
    equal). ``grid`` ({dim: step}, :func:`capture_grid`): inputs whose dims are multiples of
    their steps run ``main_dynamic_graphs`` instead of main_dynamic, main_dynamic again but
    with its symbolic regions captured as CUDA graphs per shape (the same kernels: the
    build's dedup keeps one copy of each)."""
    relax = tvm_compat.relax()
    tvm = tvm_compat.tvm()
    main_gv = mod.get_global_var("main")
    main = mod[main_gv]
    dims = {str(v.name): v for v in tvm_compat.symbolic_vars(main)}
    bb = relax.BlockBuilder(mod)
    params = [relax.Var(p.name, p.ty) for p in main.params]

    def call(name, attrs=None):  # a fresh copy of main as the private function ``name``
        func = tvm_compat.private_function(
            tvm_compat.with_fresh_constants(tvm_compat.copy_with_new_vars(main)))
        for key, value in (attrs or {}).items():
            func = func.with_attr(key, value)
        out = relax.Var(f"out_{name}", main.ret_ty)
        return relax.SeqExpr([relax.BindingBlock(
            [relax.VarBinding(out, relax.Call(bb.add_func(func, name), params))])], out)

    def branch(cond, then, other, name):
        out = relax.Var(name, main.ret_ty)
        return relax.SeqExpr([relax.BindingBlock(
            [relax.VarBinding(out, relax.If(relax.prim_value(cond), then, other))])], out)

    body = call(DYNAMIC_FUNCTION)
    if grid:
        on_grid = tvm.tirx.all(*[tvm.tirx.floormod(dims[n], step) == 0
                                 for n, step in grid.items() if step > 1]
                               or [tvm.tirx.const(True)])
        body = branch(on_grid, call(GRAPHS_FUNCTION, {CAPTURE_SYMBOLIC_VARS: list(grid)}),
                      body, "out_symbolic")
    if sizes:
        static = tvm_compat.private_function(main.bind_symbolic_vars(sizes))
        for key in (TIR_VAR_UPPER_BOUND, TIR_VAR_LOWER_BOUND, DIM_OPTIMUM):
            static = static.without_attr(key)
        opt_gv = bb.add_func(static, OPTIMUM_FUNCTION)
        fixed = [relax.Var(f"{p.name}_optimum", q.ty) for p, q in zip(params, static.params)]
        opt_out = relax.Var("out_optimum", static.ret_ty)
        then = relax.SeqExpr([relax.BindingBlock(
            [relax.MatchCast(v, p, v.ty) for v, p in zip(fixed, params)]
            + [relax.VarBinding(opt_out, relax.Call(opt_gv, fixed))])], opt_out)
        body = branch(tvm.tirx.all(*[dims[n] == v for n, v in sizes.items()]), then, body,
                      "out_any")
    fbb = relax.BlockBuilder()
    with fbb.function("main", params, attrs=dict(main.attrs), pure=main.is_pure):
        out = fbb.emit(body.blocks[0].bindings[0].value)  # the call, or the outermost If
        fbb.emit_func_output(fbb.match_cast(out, main.ret_ty))
    bb.update_func(main_gv, fbb.get()["main"])
    return bb.get()


def at_optimum(mod):
    """``mod`` with each dynamic dim of main bound to its optimum: a static module whose
    kernels are those of ``main_optimum`` (what ``amp tune`` tunes); a static module as it
    is."""
    ranges = module_ranges(mod)
    if not ranges:
        return mod
    main = mod["main"].bind_symbolic_vars({n: r.optimum for n, r in ranges.items()})
    for key in (TIR_VAR_UPPER_BOUND, TIR_VAR_LOWER_BOUND, DIM_OPTIMUM):
        main = main.without_attr(key)
    return replace_main(mod, main)


def kernels_by_function(mod, functions=(OPTIMUM_FUNCTION, DYNAMIC_FUNCTION)) -> dict:
    """{``main_optimum`` / ``main_dynamic`` (or each of ``functions``): the kernels (PrimFunc
    names) each calls} for a lowered module with the optimum copy (the report's per-variant
    kernels); {} otherwise."""
    relax = tvm_compat.relax()
    prim = tvm_compat.prim_func_class()
    names = {gv.name_hint for gv, f in mod.functions_items() if isinstance(f, prim)}
    out = {}
    for gv, func in mod.functions_items():
        if gv.name_hint not in functions:
            continue
        used: set = set()

        def visit(expr):
            for x in [getattr(expr, "op", None), *(getattr(expr, "args", None) or [])]:
                name = getattr(x, "name_hint", None)
                if name in names:
                    used.add(name)

        relax.analysis.post_order_visit(func.body, visit)
        out[gv.name_hint] = sorted(used)
    return out


def noalias_shape_functions(mod):
    """``mod`` with ``tirx.noalias`` on the VM's host PrimFuncs of at most one buffer (the shape
    functions on the shape heap, the range check's scalar conditions), which a module with
    dynamic dims has. TVM 0.27's LLVM codegen outlines each
    kernel's body into a restrict-pointer ``<name>_compute_`` function only when every PrimFunc
    of the module is noalias: one shape function without it made every CPU kernel of a dynamic
    build 2-2.5x slower (a ResNet conv: 1.25 ms instead of 0.50 ms, same TIR)."""
    prim = tvm_compat.prim_func_class()
    updates = {gv: f.with_attr(NOALIAS, True) for gv, f in mod.functions_items()
               if isinstance(f, prim) and f.attrs is not None and IS_HOST_FUNC in f.attrs
               and NOALIAS not in f.attrs
               and sum(type(p.ty).__name__ == "BufferType" for p in f.params) <= 1}
    return replace_functions(mod, updates)


def guard_pass(specialize: bool = False, graphs: bool = False):
    """:func:`guard_dynamic` as a module pass (the first of amp's Relax pipelines)."""
    tvm = tvm_compat.tvm()

    @tvm.transform.module_pass(opt_level=0, name="AmpDynamicGuard")
    def _pass(mod, _ctx):
        return guard_dynamic(mod, specialize, graphs)

    return _pass

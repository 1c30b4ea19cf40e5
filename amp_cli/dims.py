"""Dynamic dims in the IR (docs/dynamic-shapes.md).

The ranges of a model's dynamic input dims travel with its Relax module, from the frontend to
the build, as attributes of ``main``: TVM's ``tir_var_lower_bound`` / ``tir_var_upper_bound``
(with them TVM plans memory once, for the largest shape) and amp's optimum per dim. The build
reads them back to guard the library's entry (``compile/dynamic.py``), and the CPU rules to
size their loops.
"""
from __future__ import annotations

from . import tvm_compat
from .config import DimRange
from .ir_attrs import DIM_OPTIMUM, TIR_VAR_LOWER_BOUND, TIR_VAR_UPPER_BOUND
from .ir_module import replace_main


def attach_ranges(mod, ranges: dict[str, DimRange]):
    """``mod`` with ``ranges`` (IR dim name -> range) recorded on ``main``. Every name must be a
    symbolic dim of main's parameters."""
    if not ranges:
        return mod
    main = mod["main"]
    have = {str(v.name) for v in tvm_compat.symbolic_vars(main)}
    missing = [n for n in ranges if n not in have]
    if missing:
        raise ValueError(f"dynamic dims {missing} are not symbolic dims of main's parameters "
                         f"({sorted(have)})")
    main = (main.with_attr(TIR_VAR_LOWER_BOUND, {n: r.lo for n, r in ranges.items()})
            .with_attr(TIR_VAR_UPPER_BOUND, {n: r.hi for n, r in ranges.items()})
            .with_attr(DIM_OPTIMUM, {n: r.optimum for n, r in ranges.items()}))
    return replace_main(mod, main)


def module_ranges(mod) -> dict[str, DimRange]:
    """The ranges recorded on ``mod``'s main, in the order its parameters name the dims
    (empty: a static module, or one without main)."""
    if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
        return {}
    main = mod["main"]
    attrs = main.attrs
    if attrs is None or TIR_VAR_UPPER_BOUND not in attrs:
        return {}
    upper = {str(k): int(v) for k, v in attrs[TIR_VAR_UPPER_BOUND].items()}
    lower = {str(k): int(v) for k, v in attrs[TIR_VAR_LOWER_BOUND].items()} \
        if TIR_VAR_LOWER_BOUND in attrs else {}
    opt = {str(k): int(v) for k, v in attrs[DIM_OPTIMUM].items()} if DIM_OPTIMUM in attrs \
        else {}
    order = [str(v.name) for v in tvm_compat.symbolic_vars(main)]
    names = [n for n in order if n in upper] + [n for n in upper if n not in order]
    return {n: DimRange(lower.get(n, 1), upper[n], opt.get(n)) for n in names}


def describe_ranges(ranges: dict[str, DimRange]) -> str:
    """'batch 1..32, sequence 16..512' (optimum left out)."""
    return ", ".join(f"{n} {r.lo}..{r.hi}" for n, r in ranges.items())

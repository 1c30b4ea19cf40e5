"""Call-level rewriting of Relax modules for amp's graph passes (every module of
``backends/cuda/rewrites``): the rewriter itself is shared with the CPU backend
(``backends/relax_calls.py``, re-exported here); the report counters and the module-pass wrapper
are the CUDA rewrites' own.
"""
from __future__ import annotations

from typing import Callable

from .... import tvm_compat
from ...relax_calls import (bindings_and_users, calls, entry_functions, op_name, rewrite_calls,
                            shape_of, static_shape)

__all__ = ["add_counts", "bindings_and_users", "calls", "conv2d_in", "entry_functions",
           "module_pass", "op_name", "rewrite_calls", "shape_of", "static_shape"]


def add_counts(stats: dict | None, **counts) -> None:
    """Add ``counts`` into ``stats`` (a dict the build report shows; None: not collected)."""
    if stats is not None:
        for key, n in counts.items():
            stats[key] = stats.get(key, 0) + int(n)


def module_pass(fn: Callable, name: str):
    """``fn`` (module -> module) as a TVM module pass named ``name``."""
    tvm = tvm_compat.tvm()

    @tvm.transform.module_pass(opt_level=0, name=name)
    def _pass(mod, _ctx):
        return fn(mod)

    return _pass


def conv2d_in(call, dtypes, want_layout: str | None = None, symbolic_batch: bool = False) -> bool:
    """``call`` is a static-shape conv2d whose data and weight share one of ``dtypes`` and, when
    ``want_layout`` is given, whose data is in it with OHWI filters (what the conv rewrites take
    once ConvertLayout ran). ``symbolic_batch``: the data's first dim may be symbolic (a
    dynamic model's batch). Groups, dilation and the like are each rewrite's own."""
    if op_name(call) != "relax.nn.conv2d":
        return False
    a = call.attrs
    if want_layout and (a.data_layout != want_layout or a.kernel_layout != "OHWI"
                        or a.out_layout not in ("", want_layout)):
        return False
    x, w = call.args
    if x.ty.dtype not in dtypes or w.ty.dtype != x.ty.dtype:
        return False
    x_shape = shape_of(x)
    if x_shape is None or static_shape(w) is None:
        return False
    return all(isinstance(d, int) for d in (x_shape[1:] if symbolic_batch else x_shape))

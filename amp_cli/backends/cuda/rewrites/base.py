"""Call-level rewriting of Relax modules for amp's graph passes (every module of
``backends/cuda/rewrites``): the rewriter itself is shared with the CPU backend
(``backends/relax_calls.py``, re-exported here); the report counters and the module-pass wrapper
are the CUDA rewrites' own.
"""
from __future__ import annotations

from typing import Callable

from .... import tvm_compat
from ...relax_calls import calls, entry_functions, op_name, rewrite_calls, static_shape

__all__ = ["add_counts", "calls", "entry_functions", "module_pass", "op_name", "rewrite_calls",
           "static_shape"]


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

"""Where amp's CUDA graph rewrites, TIR rewrites and schedule rules register themselves.

Each one lives in its own file and registers with :func:`register`: the stage it runs in, its
place in that stage (``order``: smaller runs first; a rule earlier gets a kernel first), the
``CudaConfig`` switch that turns it on (None: always on) and the other switches it reads, the
build-report labels of the counts it records, and a factory that makes its pass (or dlight rule)
for one build, or returns None when it does not apply to the target. ``backends/cuda/pipeline.py``
imports the modules (registering them) and asks for each stage's passes here. Adding a rewrite:
a file in ``rewrites/`` with its ``@register``, a field in ``config.CudaConfig``, an import line
in ``pipeline.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

STAGES = ("graph", "fused", "tir", "rule")
# Relax before LegalizeOps | Relax after FuseOps, before FuseTIR | PrimFuncs after FuseTIR | dlight


@dataclass(frozen=True)
class BuildContext:
    """What a factory may read about the build it makes a pass for."""

    target: Any  # the tvm Target (sm_90a when the Hopper GEMMs are on)
    sm: int  # its SM version (hardware.arch_sm)
    cuda: Any  # the config.CudaConfig of this build
    stats: dict | None  # counts for the build report (None: not collected)
    # {symbolic dim name: the size to optimize for} of a dynamic module (its ranges' optima):
    # a kernel that serves every size picks its tiles for this one
    dims: dict = field(default_factory=dict)
    # {symbolic dim name: (lo, hi)}: a kernel that serves every size may branch on the size
    # between variants chosen over the whole range
    ranges: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Entry:
    name: str
    stage: str
    order: int
    switch: str | None
    reads: tuple[str, ...]
    labels: dict
    make: Callable[[BuildContext], Any]

    def enabled(self, ctx: BuildContext) -> bool:
        return self.switch is None or bool(getattr(ctx.cuda, self.switch))


ENTRIES: list[Entry] = []


def register(name: str, stage: str, order: int, switch: str | None = None,
             reads: tuple[str, ...] = (), labels: dict | None = None):
    """Decorator for a factory ``(BuildContext) -> pass | rule | None``."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")

    def deco(make):
        ENTRIES[:] = [e for e in ENTRIES if e.name != name]  # a module reload re-registers
        ENTRIES.append(Entry(name, stage, order, switch, tuple(reads), dict(labels or {}), make))
        return make

    return deco


def made(stage: str, ctx: BuildContext) -> list:
    """The passes (or rules) of ``stage`` for this build, in order: the enabled entries whose
    factory returned something."""
    out = []
    for entry in sorted(ENTRIES, key=lambda e: e.order):
        if entry.stage == stage and entry.enabled(ctx):
            thing = entry.make(ctx)
            if thing is not None:
                out.append(thing)
    return out


def report_labels() -> dict:
    """Build-report label of every count a registered entry records."""
    labels: dict = {}
    for entry in ENTRIES:
        labels.update(entry.labels)
    return labels


def switches() -> set[str]:
    """Every CudaConfig field some entry reads."""
    return {s for e in ENTRIES for s in ((e.switch,) if e.switch else ()) + e.reads}

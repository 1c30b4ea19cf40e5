"""Lane-safe CUDA legalizer: makes fp16/bf16 (and other) vectors of any lane count printable by
TVM's CUDA code generator. See docs/legalizer.md.

Public interface::

    records = []
    ex = tvm.compile(mod, target, relax_pipeline=...,
                     tir_pipeline=cuda_tir_pipeline(target, records))
    [r.to_dict() for r in records]
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .table import LEGAL_LANES, PIECE_WIDTHS, lane_legal, lane_printable
from .pipeline import LEGALIZER_PASS_NAME, cuda_tir_pipeline

__all__ = ["LegalizeRecord", "lane_legal", "lane_printable", "cuda_tir_pipeline", "lane_legalize_pass",
           "legalize_module", "LEGAL_LANES", "PIECE_WIDTHS"]


@dataclass
class LegalizeRecord:
    """One per kernel that the legalizer changed (or could not fully legalize)."""

    kernel: str
    rewrites: list[str] = field(default_factory=list)  # e.g. "store float16x3 -> 2+1"
    stage: str = "after VectorizeLoop"
    skipped: list[str] = field(default_factory=list)   # statements left alone, with the reason

    def to_dict(self) -> dict:
        return asdict(self)


def _is_cuda(func) -> bool:
    attrs = func.attrs
    target = attrs.get("target", None) if attrs is not None else None
    return target is not None and target.kind.name == "cuda"


def lane_legalize_pass(records: list | None = None, stage: str = "after VectorizeLoop",
                       only_cuda: bool = True):
    """The legalizer as a PrimFunc pass; appends a LegalizeRecord per changed kernel."""
    from .. import tvm_compat
    from .lane_pass import LaneLegalizer

    def _transform(func, _mod, _ctx):
        if only_cuda and not _is_cuda(func):
            return func
        legalizer = LaneLegalizer()
        body = legalizer.rewrite_body(func.body)
        if legalizer.rewrites or legalizer.skipped:
            name = None
            if func.attrs is not None:
                name = func.attrs.get("global_symbol", None)
            if records is not None:
                records.append(LegalizeRecord(str(name) if name is not None else "?",
                                              list(legalizer.rewrites), stage,
                                              list(legalizer.skipped)))
        if not legalizer.rewrites:
            return func
        return func.with_body(body)

    return tvm_compat.prim_func_pass(_transform, name=LEGALIZER_PASS_NAME)


def legalize_module(mod, records: list | None = None, only_cuda: bool = False):
    """Run the legalizer on an already lowered (post-VectorizeLoop) IRModule."""
    return lane_legalize_pass(records, stage="direct", only_cuda=only_cuda)(mod)

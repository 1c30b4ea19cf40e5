"""The lane legalizer as a TIR pass: makes fp16/bf16 (and other) vectors of any lane count
printable by TVM's CUDA code generator (the rewriting itself is ``lane_pass.py``; the table of
printable lanes ``table.py``). See docs/legalizer.md."""
from __future__ import annotations

from .... import tvm_compat
from .lane_pass import LaneLegalizer
from .records import LegalizeRecord

LEGALIZER_PASS_NAME = "amp.LaneLegalize"


def _is_cuda(func) -> bool:
    attrs = func.attrs
    target = attrs.get("target", None) if attrs is not None else None
    return target is not None and target.kind.name == "cuda"


def lane_legalize_pass(records: list | None = None, stage: str = "after VectorizeLoop",
                       only_cuda: bool = True):
    """The legalizer as a PrimFunc pass; appends a LegalizeRecord per changed kernel."""
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

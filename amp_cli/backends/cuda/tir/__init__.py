"""amp's CUDA TIR pipeline: TVM's s_tir lowering with the lane legalizer, the strided-cp.async
guard and the access-pointer dtype fix. See docs/legalizer.md.

Public interface::

    records = []
    ex = tvm.compile(mod, target, relax_pipeline=...,
                     tir_pipeline=cuda_tir_pipeline(target, records))
    [r.to_dict() for r in records]
"""
from .legalize import LEGALIZER_PASS_NAME, lane_legalize_pass, legalize_module
from .pipeline import cuda_tir_pipeline
from .records import LegalizeRecord
from .table import LEGAL_LANES, PIECE_WIDTHS, lane_legal, lane_printable

__all__ = ["LEGALIZER_PASS_NAME", "LEGAL_LANES", "LegalizeRecord", "PIECE_WIDTHS",
           "cuda_tir_pipeline", "lane_legal", "lane_legalize_pass", "lane_printable",
           "legalize_module"]

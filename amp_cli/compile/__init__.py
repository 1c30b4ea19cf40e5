"""Compilation: the target's Relax/TIR pipelines (``pipeline.py``), tuning records applied at
build time (``records.py``) and the sandboxed build itself (``build.py``)."""
from .build import BuildResult, build
from .pipeline import compile_target, relax_pipeline, tir_pipeline

__all__ = ["BuildResult", "build", "compile_target", "relax_pipeline", "tir_pipeline"]

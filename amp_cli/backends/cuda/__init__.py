"""amp's CUDA backend. ``pipeline.py`` assembles the Relax pipeline; ``rewrites/`` holds Relax
graph rewrites (one per file), ``rules/`` dlight schedule rules, ``kernels/`` TIR kernels and
their analysis, ``tir/`` the TIR pipeline (lane legalizer and fixes); ``registry.py`` is where
rewrites and rules register their switch and report labels."""

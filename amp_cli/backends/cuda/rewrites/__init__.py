"""Relax graph rewrites of amp's CUDA pipeline, one per file, each registering its switch and
report labels in ``registry.py``; ``base.py`` is the call rewriter they share."""

"""dlight schedule rules of amp's CUDA pipeline, one per file, each registering in
``registry.py``. Order (first match wins; ``pipeline.py``'s imports give it): amp's GEMM rule
(``matmul.py``), dlight's GEMV / Reduction / GeneralReduction (``dlight_rules.py``), amp's
large-injective rule (``injective.py``), then dlight's Fallback. A new rule (a depthwise
convolution, say) is a file here and an import line in ``pipeline.py`` at its place."""

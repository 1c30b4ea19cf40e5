"""Target backends: ``cuda`` (graph rewrites, schedule rules, kernels, TIR passes) and ``cpu``
(llvm schedule rules). Each builds a Relax pipeline for its target kind; they do not import each
other (an import-linter contract checks it)."""

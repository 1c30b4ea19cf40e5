"""amp's CPU (llvm) backend: ``pipeline.py`` (the Relax pipeline), ``rules.py`` (deterministic
schedule rules), ``analysis.py`` (what the rules read off a kernel), ``packing.py`` (weight
pre-packing)."""

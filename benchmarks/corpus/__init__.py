"""Real-model corpus for amp (issue 20): export models to ONNX, convert each with amp.

Run `python benchmarks/corpus --help`; see docs/corpus.md.
"""

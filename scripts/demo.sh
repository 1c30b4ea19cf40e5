#!/usr/bin/env bash
# The demo: set up, generate example models, convert one for CUDA (codegen; runs without a GPU)
# and for the CPU, and print the report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m amp_cli.models examples/generated
.venv/bin/amp convert examples/generated/tiny_cnn.onnx -o examples/out/tiny_cnn-cuda \
  --target cuda:sm_90 --input-shape input:1x3x32x32 --force
.venv/bin/amp convert examples/generated/tiny_cnn.onnx -o examples/out/tiny_cnn-cpu \
  --target llvm --input-shape input:1x3x32x32 --force
cat examples/out/tiny_cnn-cuda/report.md

#!/usr/bin/env bash
# Set up and run the test suite (CPU + CUDA codegen; `gpu` tests skip without a GPU).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -ra "$@"

#!/usr/bin/env bash
# Set up and run the test suite (CPU + CUDA codegen; `gpu` tests skip without a GPU).
# Default: everything but the `slow` tests (what CI runs). Arguments replace the default and go
# to pytest, e.g. `bash scripts/test.sh -m "slow or not slow"` for all, or `-m gpu` on a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -eq 0 ]; then set -- -m "not slow"; fi
exec .venv/bin/python -m pytest -q -ra "$@"

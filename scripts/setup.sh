#!/usr/bin/env bash
# Creates .venv (if needed) and installs amp with its test and torch extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first, pinned to the CPU build that pip can take without a multi-GB download; the
# [torch] extra's range is then already satisfied. Skipped (torch tests skip) if unavailable.
.venv/bin/python -m pip install -q "torch==2.13.0" 2>/dev/null \
  || echo "setup: torch 2.13.0 not installable here; PyTorch tests will be skipped" >&2
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c "import amp_cli.tvm_compat as t; t.check_versions(); import tvm; print('setup: amp ready, TVM', tvm.__version__)"

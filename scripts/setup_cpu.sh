#!/usr/bin/env bash
# Create .venv with the CPU stack (torch 2.14.1 + transformers 5.12.1 + sglang 0.5.17's Python
# code, installed --no-deps so pip never resolves sglang's GPU pins) and this package. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
# The CUDA build of torch pulls ~3 GB of nvidia wheels; pip's cache would keep a second copy of
# them, which a small disk cannot hold (a CI run once died of ENOSPC while installing).
export PIP_NO_CACHE_DIR=1
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ ! -f .venv/.ddtree-ready ] || [ scripts/requirements-cpu.txt -nt .venv/.ddtree-ready ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r scripts/requirements-cpu.txt
  .venv/bin/python -m pip install -q --no-deps "sglang==0.5.17"
  touch .venv/.ddtree-ready
fi
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .

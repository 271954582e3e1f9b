#!/usr/bin/env bash
# Create .venv with the CPU stack (torch 2.14.1 + transformers 5.19.0 + sglang 0.5.23's Python
# code, installed --no-deps so pip never resolves sglang's GPU pins) and this package. Idempotent:
# a second run only reinstalls this package. pip's own output goes to .venv/setup.log.
set -euo pipefail
cd "$(dirname "$0")/.."
# The CUDA build of torch pulls ~3 GB of nvidia wheels; pip's cache would keep a second copy of
# them, which a small disk cannot hold (a CI run once died of ENOSPC while installing).
export PIP_NO_CACHE_DIR=1
PY=${PYTHON:-python3}
LOG=.venv/setup.log
step() { echo "[setup] $*"; }
pip_quiet() {  # pip into the log; on failure, its last lines
  if ! .venv/bin/python -m pip install -q "$@" >>"$LOG" 2>&1; then
    echo "[setup] pip failed; the end of $LOG:" >&2
    tail -n 30 "$LOG" >&2
    exit 1
  fi
}
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $("$PY" --version)"
  "$PY" -m venv .venv
fi
if [ ! -f .venv/.ddtree-ready ] || [ scripts/requirements-cpu.txt -nt .venv/.ddtree-ready ]; then
  t0=$SECONDS
  step "installing torch 2.14.1 (with its CUDA libraries: ~3 GB to download, ~6 GB in .venv),"
  step "transformers 5.19.0 and the test tools; a few minutes (log: $LOG)"
  pip_quiet --upgrade pip
  pip_quiet -r scripts/requirements-cpu.txt
  step "installing sglang 0.5.23's Python code (--no-deps: none of its GPU pins)"
  pip_quiet --no-deps "sglang==0.5.23"
  touch .venv/.ddtree-ready
  step "done in $((SECONDS - t0)) s; .venv holds $(du -sh .venv | cut -f1)"
fi
pip_quiet --no-deps --no-build-isolation -e .

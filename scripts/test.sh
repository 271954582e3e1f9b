#!/usr/bin/env bash
# Set up (scripts/setup_cpu.sh) and run the whole CPU test suite plus lint. GPU tests (marker
# `gpu`) skip here; run them on a CUDA machine (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
df -h . | sed 's/^/disk: /'  # the install needs ~6.5 GB free; say what there was if it fails
bash scripts/setup_cpu.sh
.venv/bin/python -m ruff check sglang_ddtree tests scripts
.venv/bin/python -m ruff format --check sglang_ddtree tests scripts
.venv/bin/python -m pytest -q "$@"

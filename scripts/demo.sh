#!/usr/bin/env bash
# Set up (scripts/setup_cpu.sh) and run the reference engine's demo: DDTree and chain DFlash
# side by side on the repo's small pair, printing text and per-round acceptance lengths.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
.venv/bin/python -m sglang_ddtree.reference --demo "$@"

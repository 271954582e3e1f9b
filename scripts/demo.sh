#!/usr/bin/env bash
# Set up (scripts/setup_cpu.sh) and run the reference engine's demo: DDTree and chain DFlash
# side by side on the repo's small pair, printing each text, each round's accepted drafts + bonus,
# and a table of tokens, verify rounds, tokens per round (SGLang's accept length) and tokens/s.
# Extra arguments go to the CLI (e.g. --show-tree DIR, --max-new-tokens N; --help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
.venv/bin/python -m sglang_ddtree.reference --demo "$@"

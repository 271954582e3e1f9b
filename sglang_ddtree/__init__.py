"""DDTree tree speculative decoding for SGLang (plugin) with a transformers reference engine."""

from pathlib import Path

__version__ = "0.1.0"

# The trained Qwen3.5 target + DFlash draft shipped as package data (docs/training.md):
# DEMO_PAIR_DIR / "target" and DEMO_PAIR_DIR / "draft".
DEMO_PAIR_DIR = Path(__file__).resolve().parent / "assets" / "demo"

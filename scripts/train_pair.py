#!/usr/bin/env python
"""Train a small Qwen3.5 target + DFlash draft pair on this machine's Python sources.

  python scripts/train_pair.py --out DIR [--minutes M] [--seed S] [--device cuda|cpu] [--toy]

Writes DIR/target (HF checkpoint, tokenizer, preprocessor config), DIR/draft (z-lab DFlash
config + safetensors), DIR/heldout_packages.json and DIR/report.json. See docs/training.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sglang_ddtree.training.pipeline import RunArgs, configure_cuda_determinism, run


def parse_args(argv: list[str] | None = None) -> RunArgs:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument(
        "--minutes",
        type=float,
        default=10.0,
        help="training budget, target + draft (corpus, tokenizer and evaluation come on top)",
    )
    p.add_argument(
        "--total-minutes",
        type=float,
        help="wall-clock cap for the whole run: training gets min(--minutes, what is left after "
        "corpus + tokenizer, minus a reserve for evaluation)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--toy", action="store_true", help="tiny sizes and fixed steps (CPU, ~1 min)")
    p.add_argument("--target-steps", type=int, help="fixed target steps (default: from --minutes)")
    p.add_argument("--draft-steps", type=int, help="fixed draft steps (default: from --minutes)")
    a = p.parse_args(argv)
    if a.minutes <= 0:
        p.error(f"--minutes must be > 0, got {a.minutes}")
    if a.total_minutes is not None and a.total_minutes <= 0:
        p.error(f"--total-minutes must be > 0, got {a.total_minutes}")
    for name in ("target_steps", "draft_steps"):
        value = getattr(a, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return RunArgs(
        a.out, a.minutes, a.seed, a.device, a.toy, a.target_steps, a.draft_steps, a.total_minutes
    )


def main(argv: list[str] | None = None) -> int:
    configure_cuda_determinism()
    report = run(parse_args(argv))
    summary = {
        "heldout_loss": report["target"]["heldout"]["loss"],
        "target_steps": report["target"]["train"]["steps"],
        "draft_steps": report["draft"]["train"]["steps"],
        "chain_accept_len": report["draft"]["acceptance"]["chain_accept_len"],
        "size_mib": report["sizes"]["total_mib"],
        "training_budget_s": report["training_budget_s"],
        "seconds": report["seconds"],
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python
"""Train a DFlash2 drafter for a trained pair: its DFlash draft, frozen, plus a candidate
selector, on the pair's own data; then score four drafters offline on its held-out text.

  python scripts/train_dflash2.py --pair DIR --out OUT [--minutes M] [--device cuda|cpu] [--toy]

PAIR is scripts/train_pair.py's output (DIR/target, DIR/draft), e.g. the shipped pair
(sglang_ddtree/assets/demo). Writes OUT/draft_dflash2 (a DFlash2 draft checkpoint SGLang serves
with --speculative-draft-model-path) and OUT/report.json. See docs/training.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sglang_ddtree.training.dflash2 import DFlash2Args, missing_pair_part, run_dflash2
from sglang_ddtree.training.pipeline import configure_cuda_determinism


def parse_args(argv: list[str] | None = None) -> DFlash2Args:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pair", type=Path, required=True, help="DIR with target/ and draft/")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--minutes", type=float, default=3.0, help="the selector's training budget")
    p.add_argument("--seed", type=int, default=0, help="the pair's seed (fixes its corpus)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--toy", action="store_true", help="the toy recipe (a --toy pair, CPU)")
    p.add_argument("--steps", type=int, help="fixed selector steps (default: from --minutes)")
    p.add_argument("--batch", type=int, help="sequences per step (default: the recipe's, 64)")
    p.add_argument(
        "--eval-windows", type=int, help="held-out windows of 8 blocks scored (default: 64)"
    )
    a = p.parse_args(argv)
    if a.minutes <= 0:
        p.error(f"--minutes must be > 0, got {a.minutes}")
    for name in ("steps", "batch", "eval_windows"):
        value = getattr(a, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    missing = missing_pair_part(a.pair)
    if missing:
        p.error(f"--pair {a.pair}: no {missing}/config.json there (train_pair.py's output)")
    return DFlash2Args(
        a.pair, a.out, a.minutes, a.seed, a.device, a.toy, a.steps, a.batch, a.eval_windows
    )


def main(argv: list[str] | None = None) -> int:
    configure_cuda_determinism()
    report = run_dflash2(parse_args(argv))
    acc = report["acceptance"]
    print(
        json.dumps(
            {
                "selector_steps": report["train"]["steps"],
                "nodes": acc["nodes"],
                "tokens_per_round": acc["tokens_per_round"],
                "heldout_loss": acc["heldout_loss"],
                "seconds": report["seconds"],
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

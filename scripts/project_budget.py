#!/usr/bin/env python
"""Projected DDTREE / DFLASH decode speed when accept/budget.py's policy picks the width per batch
size: measured round costs (bench_round.py rows) x measured acceptance (acceptance_table.py rows).

    python scripts/project_budget.py --rounds docs/data/round_cost_27b.jsonl \
        --acceptance docs/data/acceptance.jsonl [--sitting N] [--temperature 0]

Both inputs are measured; the product (tokens per ms, as if the 27B pair accepted like the
shipped one) is a projection. An acceptance budget b (nodes below the root) stands for the
verify width b + 1; a measured width N is matched to the acceptance row of the nearest budget.
Rows that carry a `sitting` (docs/data/: one measurement session each) are read one sitting at
a time: `--sitting`, by default the newest.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sglang_ddtree.round.widths import CHAIN, CostTable, choose_width


def _one_sitting(rows: list[dict], sitting: int | None) -> list[dict]:
    """The rows of one sitting (the newest unless given); rows without sittings as they are."""
    sittings = {r["sitting"] for r in rows if "sitting" in r}
    if not sittings:
        return rows
    chosen = max(sittings) if sitting is None else sitting
    if chosen not in sittings:
        raise SystemExit(f"no sitting {chosen} in the rows; there are {sorted(sittings)}")
    return [r for r in rows if r.get("sitting") == chosen]


def load(rounds: Path, acceptance: Path, temperature: float, variants=None, sitting=None):
    """(CostTable, {width or CHAIN: tokens per round}). Rows of automatic-width servers
    (`_auto`) have no one width and are left out; `variants` keeps only those names."""
    rows = [json.loads(line) for line in rounds.read_text().splitlines() if line.strip()]
    rows = _one_sitting(rows, sitting)
    rows = [r for r in rows if r.get("round_ms") is not None and "_auto" not in r["variant"]]
    if variants:
        rows = [r for r in rows if r["variant"] in variants]
    width_of = {}
    for r in rows:
        name = r["variant"]
        width_of[name] = CHAIN if name.startswith("dflash") else int(name[6:].split("_")[0])
    clash = [w for w in set(width_of.values()) if list(width_of.values()).count(w) > 1]
    if clash:
        names = sorted(n for n, w in width_of.items() if w in clash)
        raise SystemExit(
            f"several variants measure the same width: {names}; keep one of each with --variants"
        )
    batch = sorted({r["bs"] for r in rows})
    ms = {}
    for name, width in width_of.items():
        by_bs = {r["bs"]: r["round_ms"] for r in rows if r["variant"] == name}
        if all(b in by_bs for b in batch):
            ms[width] = tuple(by_bs[b] for b in batch)
    acc_rows = [json.loads(line) for line in acceptance.read_text().splitlines() if line.strip()]
    acc_rows = _one_sitting(acc_rows, None)
    acc = {r["method"]: r["mean_accept_len"] for r in acc_rows if r["temperature"] == temperature}
    budgets = {int(m.split()[-1]): v for m, v in acc.items() if m.startswith("DDTree")}
    tokens = {CHAIN: next(v for m, v in acc.items() if m.startswith("chain"))}
    for width in ms:
        if width != CHAIN:
            tokens[width] = budgets[min(budgets, key=lambda b: abs(b + 1 - width))]
    return CostTable(tuple(batch), ms), tokens


def project(cost: CostTable, tokens: dict[int, float], batch_sizes) -> list[dict]:
    widths = sorted(w for w in tokens if w != CHAIN)
    out = []
    for bs in batch_sizes:
        expected = torch.tensor([[tokens[w] for w in widths]] * bs)
        chain = torch.full((bs,), tokens[CHAIN])
        pick = choose_width(cost, expected, widths, chain)
        rate = tokens[pick] / cost.cost(bs, pick)
        out.append(
            {
                "bs": bs,
                "choice": "chain" if pick == CHAIN else f"N={pick}",
                "projected_vs_dflash": rate / (tokens[CHAIN] / cost.cost(bs, CHAIN)),
            }
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=Path, required=True)
    p.add_argument("--acceptance", type=Path, required=True)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--sitting", type=int, help="the rounds' sitting (default: the newest)")
    p.add_argument(
        "--variants",
        help="comma-separated bench_round variants to use (one per "
        "width and the chain), e.g. dflash,ddtree16,ddtree32",
    )
    args = p.parse_args(argv)
    keep = args.variants.split(",") if args.variants else None
    cost, tokens = load(args.rounds, args.acceptance, args.temperature, keep, args.sitting)
    print(f"{'bs':>3} {'choice':>7} {'DDTREE/DFLASH':>14}")
    for row in project(cost, tokens, cost.batch_sizes):
        print(f"{row['bs']:>3} {row['choice']:>7} {row['projected_vs_dflash']:>14.2f}")
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python
"""Mean acceptance length of chain DFlash and of DDTree at several node budgets, on held-out
prompts, with the reference engine (transformers, CPU float32 by default).

    python scripts/acceptance_table.py [--target DIR --draft DIR] [--prompts 24] [--tokens 128]
        [--budgets 16,32,64,128] [--topk 8] [--temperatures 0,1] [--out OUT]

Defaults to the pair shipped in sglang_ddtree/assets/demo. Prompts: the opening 400 characters
of files of the packages the training held out (training.corpus.heldout_prompts). Budgets count
the nodes below the root (the server's --speculative-num-draft-tokens is budget + 1). At T > 0
every method decodes prompt i with seed i (sampling is lossless, so the texts differ between
methods only by chance). Every run also checks that at T=0 all methods emit the target's own
greedy tokens (generate_plain), and stops with an error if one does not. Rows go to
OUT/acceptance.jsonl (docs/data/acceptance.jsonl keeps them; docs/results.md shows them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sglang_ddtree import DEMO_PAIR_DIR as DEMO
from sglang_ddtree.reference.engine import (
    generate,
    generate_chain,
    generate_plain,
    load_pair,
)
from sglang_ddtree.training.corpus import heldout_prompts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", type=Path, default=DEMO / "target")
    p.add_argument("--draft", type=Path, default=DEMO / "draft")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--budgets", default="16,32,64,128")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", type=Path, help="folder for the rows, OUT/acceptance.jsonl")
    p.add_argument("--plot", type=Path, help="also draw acceptance against budget (.png/.svg)")
    p.add_argument(
        "--rows",
        type=Path,
        help="table and plot from these rows (a .jsonl this script wrote) instead of decoding",
    )
    a = p.parse_args(argv)
    a.budgets = [int(b) for b in a.budgets.split(",")]
    a.temperatures = [float(t) for t in a.temperatures.split(",")]
    if min(a.budgets) < 1 or a.topk < 1 or a.prompts < 1 or a.tokens < 1:
        p.error("--budgets, --topk, --prompts and --tokens must be >= 1")
    if min(a.temperatures) < 0:
        p.error("--temperatures must be >= 0")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rows:
        rows = [json.loads(line) for line in args.rows.read_text().splitlines() if line.strip()]
        print(render(rows, args))
        if args.plot:
            plot(rows, args.plot)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    target, drafter, tok = load_pair(args.target, args.draft)
    prompts = heldout_prompts(args.prompts)
    if len(prompts) < args.prompts:
        raise SystemExit(f"only {len(prompts)} held-out prompts on this Python")
    ids = [tok(p)["input_ids"] for p in prompts]
    methods = {
        "chain DFlash": lambda p, **kw: generate_chain(target, drafter, p, args.tokens, **kw)
    }
    for b in args.budgets:
        methods[f"DDTree {b}"] = lambda p, b=b, **kw: generate(
            target, drafter, p, args.tokens, budget=b, topk=args.topk, **kw
        )
    rows = []
    for temp in args.temperatures:
        greedy = [generate_plain(target, p, args.tokens).tokens for p in ids] if temp == 0 else None
        for name, run in methods.items():
            t0 = time.perf_counter()
            lengths, rounds, tokens = [], 0, 0
            for i, p in enumerate(ids):
                res = run(p, temperature=temp, seed=i) if temp > 0 else run(p)
                if greedy is not None and list(res.tokens) != list(greedy[i]):
                    raise SystemExit(f"{name} at T=0 differs from the target's greedy, prompt {i}")
                lengths += res.accept_lengths
                rounds += res.rounds
                tokens += len(res.tokens)
            row = {
                "temperature": temp,
                "method": name,
                "mean_accept_len": tokens / rounds,
                "median_round": statistics.median(lengths),
                "rounds": rounds,
                "tokens": tokens,
                "seconds": round(time.perf_counter() - t0, 1),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    table = render(rows, args)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "acceptance.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if args.plot:
        plot(rows, args.plot)
    return 0


def plot(rows: list[dict], path: Path) -> None:
    """Tokens per round against the DDTree budget, one line per temperature, chain DFlash as a
    dashed line of the same colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for i, temp in enumerate(sorted({r["temperature"] for r in rows})):
        at = [r for r in rows if r["temperature"] == temp]
        tree = sorted(
            (int(r["method"].split()[-1]), r["mean_accept_len"])
            for r in at
            if r["method"].startswith("DDTree")
        )
        color = f"C{i}"
        ax.plot(*zip(*tree, strict=True), marker="o", color=color, label=f"DDTree, T={temp:g}")
        for r in at:
            if r["method"].startswith("chain"):
                ax.axhline(
                    r["mean_accept_len"], color=color, ls="--", label=f"chain DFlash, T={temp:g}"
                )
    budgets = sorted(
        {int(r["method"].split()[-1]) for r in rows if r["method"].startswith("DDTree")}
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("DDTree budget (nodes below the root)")
    ax.set_ylabel("tokens per round")
    ax.set_title("Acceptance on held-out prompts (shipped pair)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(rows: list[dict], args: argparse.Namespace) -> str:
    temps = sorted({r["temperature"] for r in rows})
    names = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["method"], r["temperature"]): r for r in rows}
    head = "| method | " + " | ".join(f"T={t:g}: tokens/round (rounds)" for t in temps) + " |"
    lines = [head, "|---|" + "---|" * len(temps)]
    for name in names:
        vals = [cell[name, t] for t in temps]
        lines.append(
            f"| {name} | "
            + " | ".join(f"{v['mean_accept_len']:.2f} ({v['rounds']})" for v in vals)
            + " |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())

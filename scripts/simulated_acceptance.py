"""Tokens per round in the simulated worlds (scripts/simworld), on the CPU: DDTREE's draft head
and accept walk over many independent rounds of each regime, at each tree width, and the chain
(the world's top-1 path, what DFLASH reads), beside the chain's calibrated value.

    python scripts/simulated_acceptance.py --out OUT [--rounds 20000] [--nodes 16,32,64]

This is what a server sees per round under DDTREE_SIMULATE (the same head, the same world); a
GPU benchmark then adds what each round costs. Output: OUT/simulated_acceptance.jsonl, one row
per (regime, width): mean tokens per round (accepted drafts + the bonus) and its standard error.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from simworld import world as simulation
from simworld.server import SimulatedHead

from sglang_ddtree.accept import accept_walk
from sglang_ddtree.config import DDTreeConfig

BLOCK, TOPK, VOCAB, BATCH = 16, 8, 4096, 2000


def tree_tau(world: simulation.World, nodes: int, rounds: int, seed: int) -> tuple[float, float]:
    """Mean tokens per round of `rounds` independent rounds at tree width `nodes`, and its
    standard error."""
    cfg = DDTreeConfig(block_size=BLOCK, num_nodes=nodes, topk=TOPK)
    head = SimulatedHead(
        world, lm_head_weight=torch.zeros(VOCAB, 1), vocab_size=VOCAB, cfg=cfg, max_bs=BATCH
    )
    generator = torch.Generator().manual_seed(seed)
    taus = []
    for _ in range(math.ceil(rounds / BATCH)):
        head.random_rounds(BATCH, generator)
        accept = accept_walk(head.tree(BATCH), head.simulated_picks[:BATCH], BLOCK - 1)
        taus.append(accept.num_accepted.double() + 1)
    tau = torch.cat(taus)[:rounds]
    return float(tau.mean()), float(tau.std() / math.sqrt(tau.numel()))


def chain_tau(world: simulation.World, rounds: int, seed: int) -> tuple[float, float]:
    generator = torch.Generator().manual_seed(seed)
    position = torch.randint(0, 1 << 30, (rounds,), generator=generator)
    root = torch.randint(simulation.FIRST_ID, VOCAB, (rounds,), generator=generator)
    drafts, picks = world.chain(position, root, BLOCK, VOCAB)
    tau = (picks[:, :-1] == drafts).long().cumprod(dim=1).sum(dim=1).double() + 1
    return float(tau.mean()), float(tau.std() / math.sqrt(rounds))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=20000)
    p.add_argument("--nodes", default="16,32,64")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, world in simulation.REGIMES.items():
        base = {
            "regime": name,
            "world": world.as_dict(),
            "rounds": args.rounds,
            "block": BLOCK,
            "chain_tau_calibrated": simulation.chain_tau(world, BLOCK - 1),
        }
        tau, err = chain_tau(world, args.rounds, seed=1)
        rows.append(
            {**base, "verify": "chain", "nodes": BLOCK, "topk": 1, "tau": tau, "tau_stderr": err}
        )
        for nodes in (int(n) for n in args.nodes.split(",")):
            tau, err = tree_tau(world, nodes, args.rounds, seed=2)
            rows.append(
                {
                    **base,
                    "verify": "tree",
                    "nodes": nodes,
                    "topk": TOPK,
                    "tau": tau,
                    "tau_stderr": err,
                }
            )
    with open(args.out / "simulated_acceptance.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{'regime':<10} {'verify':<6} {'N':>3} {'tau':>7}  (chain calibrated)")
    for r in rows:
        print(
            f"{r['regime']:<10} {r['verify']:<6} {r['nodes']:>3} {r['tau']:>7.3f}  "
            f"({r['chain_tau_calibrated']:.3f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

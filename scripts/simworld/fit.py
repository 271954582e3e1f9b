"""The `ddtree_paper` world's fit to published tree acceptance, on the CPU (docs/simulation.md).

    python scripts/simworld/fit.py --out OUT                  # the search, then OUT/world_fit.jsonl
    python scripts/simworld/fit.py --out OUT --sensitivity    # OUT/world_sensitivity.jsonl

Targets (docs/data/ddtree_paper_acceptance.jsonl): the DDTree paper's Qwen3-8B MATH-500 cell at
T = 0, block 16: Figure 3's tree tokens per round over the chain's at budgets 16..512 and Figure
4's two accepted-length histograms (the chain; the tree at budget 512). The world's top-1 means
are the chain histogram's per-depth acceptance (`world.matching_means`), so the search moves only
what the chain cannot see: tail, shared, ratio, miss_ratio, off_spine.

Loss: sum over budgets of (world ratio / paper ratio - 1)^2, plus the sums over the 16 lengths
of the squared differences of the two histograms (fractions of rounds). Each evaluation runs
the same rounds (seed fixed, the world hash-deterministic): DDTREE's draft head (SimulatedHead)
builds each round's tree once at the largest budget, and the accept walk reads its first
budget + 1 nodes for each budget (the builder's best-first order makes them the tree of that
budget), as scripts/simulated_acceptance.py does for one width. The search is a coordinate
pattern search: each parameter up and down by its step, kept when the loss falls; the steps
halve when no move helps, until the evaluations run out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: `simworld` imports
from sglang_ddtree.accept import accept_walk  # noqa: E402
from sglang_ddtree.accept.budget import truncate  # noqa: E402
from sglang_ddtree.config import DDTreeConfig  # noqa: E402
from simworld import world as simulation  # noqa: E402
from simworld.server import SimulatedHead  # noqa: E402

BLOCK, TOPK, VOCAB = 16, 8, 4096
PAPER = Path(__file__).resolve().parents[2] / "docs" / "data" / "ddtree_paper_acceptance.jsonl"
CELL = {"model": "Qwen3-8B", "dataset": "MATH-500", "temperature": 0.0}
FIT_BUDGETS = (16, 32, 64, 128, 256, 512)
HIST_BUDGET = 512
# the search: parameter, start, step, bounds
SEARCH = (
    ("tail", 3.0, 1.0, (0.0, 4.0)),
    ("shared", 0.0, 0.2, (0.0, 1.0)),
    ("ratio", 0.5, 0.1, (0.05, 0.9)),
    ("miss_ratio", 0.4, 0.1, (0.05, 0.9)),
    ("off_spine", 0.8, 0.1, (0.1, 1.0)),
)


def paper_targets(path: Path = PAPER) -> dict:
    """Figure 3's chain and tree tokens per round by budget, Figure 4's histograms (fractions
    of rounds at accepted lengths 1..16, bonus included), from the data file."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    cell = [r for r in rows if all(r.get(k) == v for k, v in CELL.items())]
    figure3 = [r for r in cell if r["where"].startswith("Figure 3")]
    chain = next(r["acceptance_length"] for r in figure3 if r["method"] == "dflash")
    tree = {r["budget"]: r["acceptance_length"] for r in figure3 if r["method"] == "ddtree"}
    hists = {
        r["method"]: [r["fraction_of_rounds_percent"][str(k)] / 100 for k in range(1, BLOCK + 1)]
        for r in cell
        if r.get("kind") == "histogram"
    }
    return {"chain": chain, "tree": dict(sorted(tree.items())), "hist": hists}


def paper_world(targets: dict | None = None, **params) -> simulation.World:
    """The `ddtree_paper` world with these parameters: its chain the paper's histogram."""
    targets = targets or paper_targets()
    hist = tuple(targets["hist"]["dflash"])
    return simulation.histogram_world("ddtree_paper", hist, **params)


def evaluate(
    world: simulation.World,
    budgets: tuple[int, ...] = FIT_BUDGETS,
    rounds: int = 2000,
    seed: int = 2,
    batch: int = 250,
) -> dict:
    """Accepted lengths (bonus included) of `rounds` independent rounds: the chain's and the
    tree's at each budget (draft nodes, root excluded), each [rounds] int64."""
    N = max(budgets) + 1
    cfg = DDTreeConfig(block_size=BLOCK, num_nodes=N, topk=TOPK)
    head = SimulatedHead(
        world, lm_head_weight=torch.zeros(VOCAB, 1), vocab_size=VOCAB, cfg=cfg, max_bs=batch
    )
    generator = torch.Generator().manual_seed(seed)
    lengths: dict = {"chain": [], **{b: [] for b in budgets}}
    for _ in range(math.ceil(rounds / batch)):
        position, root = head.random_rounds(batch, generator)
        tree, picks = head.tree(batch), head.simulated_picks[:batch]
        for b in budgets:
            walk = accept_walk(truncate(tree, b + 1), picks[:, : b + 1], BLOCK - 1)
            lengths[b].append(walk.num_accepted + 1)
        drafts, targets = world.chain(position, root, BLOCK, VOCAB)
        lengths["chain"].append((targets[:, :-1] == drafts).long().cumprod(1).sum(1) + 1)
    return {k: torch.cat(v)[:rounds] for k, v in lengths.items()}


def histogram(lengths: torch.Tensor) -> list[float]:
    counts = torch.bincount(lengths, minlength=BLOCK + 1)[1:].double()
    return (counts / counts.sum()).tolist()


def loss(result: dict, targets: dict) -> dict:
    """The loss's three parts and their sum (module docstring)."""
    chain = float(result["chain"].double().mean())
    ratios = {b: float(result[b].double().mean()) / chain for b in result if b != "chain"}
    paper = {b: t / targets["chain"] for b, t in targets["tree"].items()}
    parts = {
        "ratios": sum((ratios[b] / paper[b] - 1) ** 2 for b in ratios),
        "tree_hist": _hist_error(histogram(result[HIST_BUDGET]), targets["hist"]["ddtree"]),
        "chain_hist": _hist_error(histogram(result["chain"]), targets["hist"]["dflash"]),
    }
    return {**parts, "total": sum(parts.values())}


def _hist_error(got: list[float], want: list[float]) -> float:
    return sum((g - w) ** 2 for g, w in zip(got, want, strict=True))


def search(rounds: int, evaluations: int, log=print) -> tuple[dict, dict]:
    """The pattern search (module docstring): the best parameters and their loss."""
    targets = paper_targets()
    params = {name: start for name, start, _, _ in SEARCH}
    steps = {name: step for name, _, step, _ in SEARCH}
    bounds = {name: bound for name, _, _, bound in SEARCH}

    def cost(trial: dict) -> float:
        try:
            world = paper_world(targets=targets, **trial)
        except ValueError:  # a tail past the floor: outside the family
            return math.inf
        value = loss(evaluate(world, rounds=rounds), targets)["total"]
        log(f"  {json.dumps({k: round(v, 4) for k, v in trial.items()})} loss {value:.5f}")
        return value

    best, spent = cost(params), 1
    while spent < evaluations and max(steps.values()) > 1e-3:
        moved = False
        for name, *_ in SEARCH:
            for sign in (1, -1):
                lo, hi = bounds[name]
                value = round(min(max(params[name] + sign * steps[name], lo), hi), 4)
                if value == params[name] or spent >= evaluations:
                    continue
                trial = {**params, name: value}
                got, spent = cost(trial), spent + 1
                if got < best:
                    best, params, moved = got, trial, True
                    break
        if not moved:
            steps = {k: v / 2 for k, v in steps.items()}
    return params, {"total": best, "evaluations": spent}


def fit_rows(
    world: simulation.World, rounds: int, budgets: tuple[int, ...], fit: dict
) -> list[dict]:
    """world_fit.jsonl's rows: the fitted world's tokens per round by budget beside the
    paper's, and both histograms beside the paper's."""
    targets = paper_targets()
    result = evaluate(world, budgets=budgets, rounds=rounds)
    chain = result["chain"].double()
    base = {"world": world.as_dict(), "rounds": rounds, "block": BLOCK, "topk": TOPK}
    rows = [
        {
            **base,
            "kind": "tokens_per_round",
            "verify": "chain",
            "budget": None,
            "tau": float(chain.mean()),
            "tau_stderr": float(chain.std() / math.sqrt(rounds)),
            "paper_tau": targets["chain"],
            "chain_tau_calibrated": simulation.chain_tau(world, BLOCK - 1),
        }
    ]
    for b in budgets:
        tau = result[b].double()
        paper = targets["tree"].get(b)
        rows.append(
            {
                **base,
                "kind": "tokens_per_round",
                "verify": "tree",
                "budget": b,
                "tau": float(tau.mean()),
                "tau_stderr": float(tau.std() / math.sqrt(rounds)),
                "ratio": float(tau.mean() / chain.mean()),
                "paper_tau": paper,
                "paper_ratio": paper / targets["chain"] if paper else None,
                "fitted": b in FIT_BUDGETS,
            }
        )
    for verify, key, budget in (("chain", "chain", None), ("tree", HIST_BUDGET, HIST_BUDGET)):
        rows.append(
            {
                **base,
                "kind": "histogram",
                "verify": verify,
                "budget": budget,
                "fraction_of_rounds": histogram(result[key]),
                "paper_fraction_of_rounds": targets["hist"][
                    "dflash" if key == "chain" else "ddtree"
                ],
            }
        )
    rows.append({**base, "kind": "fit", "loss": loss(result, targets), **fit})
    return rows


SENSITIVITY = {  # each parameter of the fitted world moved alone, the others kept
    "off_spine": (0.3, 0.5, 0.7, 1.0),
    "miss_ratio": (0.2, 0.4, 0.6),
    "ratio": (0.3, 0.5, 0.7),
    "tail": (0.0, 1.0, 2.0, 3.0),
    "shared": (0.0, 0.5, 1.0),
}
SENSITIVITY_NODES = (16, 32, 64)  # verify widths, root included (the servers' N)


def sensitivity_rows(rounds: int) -> list[dict]:
    """Tokens per round of the chain and of trees of N = 16, 32, 64 nodes (root included: the
    servers' widths) in the fitted world and with each parameter moved alone (the means matched
    to the paper's chain again)."""
    fitted = simulation.REGIMES["ddtree_paper"]
    keep = {k: getattr(fitted, k) for k, *_ in SEARCH}
    worlds = [("fitted", None, fitted)]
    for name, values in SENSITIVITY.items():
        for value in values:
            try:
                worlds.append((name, value, paper_world(**{**keep, name: value})))
            except ValueError as e:
                print(f"  {name}={value}: {e}")
    rows = []
    for varied, value, world in worlds:
        result = evaluate(world, budgets=tuple(n - 1 for n in SENSITIVITY_NODES), rounds=rounds)
        row = {
            "varied": varied,
            "value": value,
            "world": world.as_dict(),
            "rounds": rounds,
            "block": BLOCK,
            "topk": TOPK,
            "chain_tau": float(result["chain"].double().mean()),
            "tree_tau": {str(n): float(result[n - 1].double().mean()) for n in SENSITIVITY_NODES},
        }
        print(f"  {varied} {value}: chain {row['chain_tau']:.3f} trees {row['tree_tau']}")
        rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=2000, help="rounds per search evaluation")
    p.add_argument("--evaluations", type=int, default=40)
    p.add_argument("--final-rounds", type=int, default=8000)
    p.add_argument("--budgets", default="16,32,64,128,256,512,1024")
    p.add_argument("--sensitivity", action="store_true")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sensitivity:
        rows, name = sensitivity_rows(args.final_rounds), "world_sensitivity.jsonl"
    else:
        params, fit = search(args.rounds, args.evaluations)
        print(f"fitted: {params} loss {fit['total']:.5f} ({fit['evaluations']} evaluations)")
        world = paper_world(**params)
        fit = {**fit, "search_rounds": args.rounds, "parameters": params}
        budgets = tuple(int(b) for b in args.budgets.split(","))
        rows, name = fit_rows(world, args.final_rounds, budgets, fit), "world_fit.jsonl"
        print(world.describe())
    with open(args.out / name, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

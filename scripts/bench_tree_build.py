"""GPU time of the draft head and of the tree build alone, torch vs Triton builder (the target:
"tree building under 0.2 ms per round at batch 1"), without a server.

    python scripts/bench_tree_build.py [--bs 1,8] [--nodes 16,32,64,128] [--shapes pair,27b]
        [--iters 200] [--out OUT]

Per (shape, builder, bs, N): the DraftTreeHead the server runs inside its draft CUDA graph
(target-LM-head logits of the B-1 draft positions, float32 log-softmax, top-K, tree build, copies
into static buffers), and the tree build alone on the same top-K; each captured in a CUDA graph
and replayed `iters` times between CUDA events, so the numbers are GPU time as the server sees
it (no launch overhead). Random bf16 LM head and hidden states, seeded. The torch and Triton trees
are checked equal on every configuration. Shapes: `pair` (hidden 256, vocab 8192: the shipped
pair) and `27b` (hidden 5120, vocab 248320: Qwen3.6-27B). B = 16, K = 8.
Output: JSON lines (OUT/tree_build.jsonl if --out) and a table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sglang_ddtree.config import DDTreeConfig
from sglang_ddtree.round.draft_head import DraftTreeHead, tree_builder
from sglang_ddtree.tree import topk_logprobs_from_logits
from sglang_ddtree.tree.testing import assert_trees_equal

SHAPES = {"pair": (256, 8192), "27b": (5120, 248320)}  # hidden, vocab
BLOCK, TOPK = 16, 8


def gpu_ms(fn, iters: int, graph: bool) -> float:
    """Mean GPU ms per call of fn(): captured in a CUDA graph and replayed (graph=True), or
    launched eagerly; timed with CUDA events after a warm-up."""
    torch.cuda.synchronize()
    for _ in range(3):  # warm-up (and Triton compile) outside the capture
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        step = g.replay
    else:
        step = fn
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    step()
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def run_one(shape: str, builder: str, bs: int, nodes: int, iters: int, device: str = "cuda"):
    """(row, tree) for one configuration; the tree is the head's output, for cross-checks."""
    hidden_size, vocab = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(vocab, hidden_size, generator=g, device=device, dtype=torch.bfloat16)
    weight *= hidden_size**-0.5
    cfg = DDTreeConfig(block_size=BLOCK, num_nodes=nodes, topk=TOPK)
    head = DraftTreeHead(lm_head_weight=weight, vocab_size=vocab, cfg=cfg, max_bs=bs)
    head.build = tree_builder(builder)
    hidden = torch.randn(bs * BLOCK, hidden_size, generator=g, device=device, dtype=torch.bfloat16)
    ids = torch.randint(vocab, (bs * BLOCK,), generator=g, device=device)
    logits = torch.matmul(hidden.view(bs, BLOCK, -1)[:, 1:], weight.T).float()
    top_ids, top_lp = topk_logprobs_from_logits(logits, TOPK)
    root = ids.view(bs, BLOCK)[:, 0]
    row = {"shape": shape, "builder": builder, "bs": bs, "nodes": nodes}
    if device == "cuda":
        row["head_ms"] = gpu_ms(lambda: head(hidden, ids), iters, graph=True)
        row["build_ms"] = gpu_ms(lambda: head.build(root, top_ids, top_lp, cfg.budget), iters, True)
        row["build_eager_ms"] = gpu_ms(
            lambda: head.build(root, top_ids, top_lp, cfg.budget), iters, False
        )
    head(hidden, ids)
    return row, head.tree(bs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bs", default="1,8")
    p.add_argument("--nodes", default="16,32,64,128")
    p.add_argument("--shapes", default="pair,27b")
    p.add_argument("--builders", default="torch,triton")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        for bs in (int(b) for b in args.bs.split(",")):
            for nodes in (int(n) for n in args.nodes.split(",")):
                trees = {}
                for builder in args.builders.split(","):
                    row, trees[builder] = run_one(shape, builder, bs, nodes, args.iters)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.out:
                        args.out.mkdir(parents=True, exist_ok=True)
                        with open(args.out / "tree_build.jsonl", "a") as f:
                            f.write(json.dumps(row) + "\n")
                first, *others = trees.values()
                for other in others:
                    assert_trees_equal(other, first)
    print(
        f"\n{'shape':<5} {'builder':<7} {'bs':>3} {'N':>4} {'head ms':>8} {'build ms':>9} "
        f"{'eager ms':>9}"
    )
    for r in rows:
        print(
            f"{r['shape']:<5} {r['builder']:<7} {r['bs']:>3} {r['nodes']:>4} {r['head_ms']:>8.3f} "
            f"{r['build_ms']:>9.3f} {r['build_eager_ms']:>9.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

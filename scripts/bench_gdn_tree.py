"""One Gated DeltaNet layer's tree verify and commit at Qwen3.6-27B head sizes, on the GPU: SGLang's
kernel (every node's state stored, the parent's reloaded at every node) against
sglang_ddtree.gdn.tree_verify (state carried in registers) + replay_path, on DDTrees from the
builder in its best-first node order and in DFS preorder. Also checks that both give the same
outputs and committed state.

    python scripts/bench_gdn_tree.py [--nodes 16,32,64] [--bs 1,8] [--iters 50] [--out OUT]

Each measured call is captured in a CUDA graph and replayed `iters` times between CUDA events
(`bench_tree_build.gpu_ms`: GPU time, no launch overhead). Per (bs, N, order): SGLang's verify, its commit (copying the
accepted node's state into the pool), our gating + verify, our replay commit; state loads and
stores per request (`state_traffic`). A 27B round runs 48 such layers.
Output: JSON lines (OUT/bench_gdn_tree.jsonl if --out) and a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_ddtree.gdn.tree_verify import (  # noqa: E402
    dfs_preorder_reference,
    gdn_gating,
    relabel_parents,
    replay_path,
    root_paths,
    state_traffic,
    tree_verify,
)
from sglang_ddtree.tree import build_tree_reference  # noqa: E402
from sglang_ddtree.tree.testing import random_build_inputs  # noqa: E402

H, HV, K, V = 16, 48, 128, 128  # Qwen3.6-27B: GDN key / value heads x head dim
BLOCK, TOPK = 16, 8


def trees(bs: int, nodes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(parents in the builder's best-first order, the same trees in DFS preorder), [bs, N]."""
    g = torch.Generator().manual_seed(seed)
    root, ids, lps = random_build_inputs(g, bs, BLOCK - 1, TOPK, 1000, "continuous")
    parents = build_tree_reference(root, ids, lps, nodes - 1).parents.clone()
    parents[:, 0] = -1
    return parents, relabel_parents(parents, dfs_preorder_reference(parents))


def accepted_paths(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per request, the deepest node (ties: the last) and its root path (path [bs, BLOCK],
    path_len [bs], node [bs]): the longest commit a round can make."""
    bs, N = parents.shape
    depth = torch.zeros((bs, N), dtype=torch.int64)
    for t in range(1, N):
        depth[:, t] = depth[torch.arange(bs), parents[:, t]] + 1
    ends = (N - 1 - torch.argmax(depth.flip(1), dim=1)).tolist()
    return (*root_paths(parents, ends, width=BLOCK), torch.tensor(ends))


def run_one(
    bs: int,
    nodes: int,
    order: str,
    parents: torch.Tensor,
    iters: int,
    device: str = "cuda",
    heads: tuple[int, int, int, int] = (H, HV, K, V),
) -> dict:
    """One configuration; on a CPU device (Triton's interpreter) only the equality checks."""
    from sglang.kernels.ops.attention.fla.fused_sigmoid_gating_recurrent import (
        fused_sigmoid_gating_delta_rule_update,
    )

    H, HV, K, V = heads
    dev, T = device, bs * nodes
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16, std=1.0):
        return (std * torch.randn(*shape, generator=g, device=dev)).to(dtype)

    q, k, v = randn(1, T, H, K), randn(1, T, H, K), randn(1, T, HV, V)
    a, b = randn(T, HV), randn(T, HV)
    A_log, dt_bias = randn(HV, dtype=torch.float32, std=0.5), randn(HV, dtype=torch.float32)
    ssm = randn(bs + 1, HV, V, K, dtype=torch.float32, std=0.1)  # the pool: slot b = request b
    slots = torch.arange(bs, dtype=torch.int32, device=dev)
    scratch = torch.empty((bs + 1, nodes, HV, V, K), dtype=torch.float32, device=dev)
    cu = torch.arange(0, T + 1, nodes, dtype=torch.int32, device=dev)
    parent_tok = parents.clamp(min=0).to(dev)
    parents_dev = parents.to(dev)
    path, path_len, ends = (x.to(dev) for x in accepted_paths(parents))
    committed = torch.empty((bs, HV, V, K), dtype=torch.float32, device=dev)
    out = {}

    def sglang_verify():
        out["sglang"] = fused_sigmoid_gating_delta_rule_update(
            A_log=A_log, a=a, dt_bias=dt_bias, softplus_beta=1.0, softplus_threshold=20.0,
            q=q, k=k, v=v, b=b, initial_state_source=ssm, initial_state_indices=slots,
            cu_seqlens=cu, use_qk_l2norm_in_kernel=True, disable_state_update=True,
            intermediate_states_buffer=scratch, intermediate_state_indices=slots,
            cache_steps=nodes, retrieve_parent_token=parent_tok,
        )  # fmt: skip

    def sglang_commit():
        committed.copy_(scratch[torch.arange(bs, device=dev), ends])

    def ours_verify():
        gg, beta = gdn_gating(A_log, a, b, dt_bias)
        out["ours"], _ = tree_verify(
            q[0], k[0], v[0], gg, beta, ssm[:bs], parents_dev, scale=K**-0.5
        )
        out["g"], out["beta"] = gg, beta

    def ours_commit():
        out["replayed"] = replay_path(k[0], v[0], out["g"], out["beta"], ssm[:bs], path, path_len)

    row = {"bs": bs, "nodes": nodes, "order": order}
    for name, fn in (("sglang_verify", sglang_verify), ("sglang_commit", sglang_commit),
                     ("ours_verify", ours_verify), ("ours_commit", ours_commit)):  # fmt: skip
        if dev == "cuda":
            from bench_tree_build import gpu_ms  # beside this script, so on sys.path when it runs

            row[f"{name}_ms"] = gpu_ms(fn, iters, graph=True)
        else:
            fn()
    loads, stores = state_traffic(parents)
    row.update(ours_loads=loads / bs, ours_stores=stores / bs, sglang_loads=nodes - 1,
               sglang_stores=nodes)  # fmt: skip
    # the same numbers either way, up to float32 rounding and the bf16 output
    o_diff = (out["ours"].float() - out["sglang"].reshape(T, HV, V).float()).abs().max()
    row["max_abs_diff_o"] = float(o_diff)
    row["max_abs_diff_state"] = float((out["replayed"] - committed).abs().max())
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", default="16,32,64")
    p.add_argument("--bs", default="1,8")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rows = []
    for bs in (int(x) for x in args.bs.split(",")):
        for nodes in (int(x) for x in args.nodes.split(",")):
            best_first, preorder = trees(bs, nodes, seed=nodes)
            for order, parents in (("best_first", best_first), ("preorder", preorder)):
                rows.append(run_one(bs, nodes, order, parents, args.iters))
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "bench_gdn_tree.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"\n{'bs':>3} {'N':>4} {'order':<10} {'SGLang verify':>13} {'commit':>7} "
          f"{'ours verify':>11} {'commit':>7} {'loads/stores ours':>17} {'diff o':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['bs']:>3} {r['nodes']:>4} {r['order']:<10} {r['sglang_verify_ms']:>13.3f} "
              f"{r['sglang_commit_ms']:>7.3f} {r['ours_verify_ms']:>11.3f} "
              f"{r['ours_commit_ms']:>7.3f} {r['ours_loads']:>8.1f}/{r['ours_stores']:<8.1f} "
              f"{r['max_abs_diff_o']:>7.4f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

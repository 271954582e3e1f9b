"""One Gated DeltaNet layer's tree verify and commit at Qwen3.6-27B head sizes, on the GPU: SGLang's
kernel (the N nodes walked one after another, every node's state stored, the commit a copy)
against sglang_ddtree.gdn.tree_verify (one program per root path, no state stored, the commit a
replay of the accepted path) and gdn.chunk_tree.chunk_tree_verify (the chunked form, the default:
one block of nodes up to 64, blocks of 64 up to MAX_NODES = 256), on DDTrees from the builder.
Also checks that they give the same outputs and committed state.

    python scripts/bench_gdn_tree.py [--nodes 16,32,64,128,256] [--bs 1,8] [--iters 50] [--out OUT]

Each measured call is captured in a CUDA graph and replayed `iters` times between CUDA events
(`bench_tree_build.gpu_ms`: GPU time, no launch overhead). Per (bs, N): SGLang's verify, its commit
(copying the accepted node's state into the pool), our root-path verify, the chunked verify
(widths up to MAX_NODES), our commit (one layer; in the server one launch commits all 48). A 27B
round runs 48 such layers. The commit replays the deepest path of each tree (the longest a round
can accept).
Output: JSON lines (OUT/gdn_tree_kernel.jsonl if --out) and a table.
"""

from __future__ import annotations

import argparse
import json
import re
from functools import partial
from pathlib import Path

import torch

from sglang_ddtree.gdn.chunk_tree import MAX_NODES, PRECISIONS, chunk_tree_verify
from sglang_ddtree.gdn.reference import root_path
from sglang_ddtree.gdn.tree_verify import commit_paths, scratch_floats, tree_verify
from sglang_ddtree.tree import build_tree_reference
from sglang_ddtree.tree.testing import random_build_inputs

H, HV, K, V = 16, 48, 128, 128  # Qwen3.6-27B: GDN key / value heads x head dim
CONV_DIM = 2 * H * K + HV * V  # the conv1d runs over q, k and v: 10,240 channels
BLOCK, TOPK = 16, 8


def trees(bs: int, nodes: int, seed: int) -> torch.Tensor:
    """[bs, N] parents of DDTrees from the builder, in its best-first node order."""
    g = torch.Generator().manual_seed(seed)
    root, ids, lps = random_build_inputs(g, bs, BLOCK - 1, TOPK, 1000, "continuous")
    parents = build_tree_reference(root, ids, lps, nodes - 1).parents.clone()
    parents[:, 0] = -1
    return parents


def deepest(parents: torch.Tensor) -> torch.Tensor:
    """Per request the deepest node (ties: the last): the longest commit a round can make."""
    depth = [
        [len(root_path(parents, b, t)) for t in range(parents.shape[1])]
        for b in range(parents.shape[0])
    ]
    return torch.tensor([max(range(len(d)), key=lambda t, d=d: (d[t], t)) for d in depth])


def run_one(
    bs: int,
    nodes: int,
    parents: torch.Tensor,
    iters: int,
    device: str = "cuda",
    heads: tuple[int, int, int, int] = (H, HV, K, V),
    tiles=(),
    chunk_tiles=(),
) -> dict:
    """One configuration; on a CPU device (Triton's interpreter) only the equality checks.
    Without SGLang installed, ours alone: the chunked form checked against the root paths."""
    try:
        from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
            fused_sigmoid_gating_delta_rule_update,
        )
    except ImportError:
        fused_sigmoid_gating_delta_rule_update = None

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
    inter = torch.empty((bs + 1, nodes, HV, V, K), dtype=torch.float32, device=dev)
    cu = torch.arange(0, T + 1, nodes, dtype=torch.int32, device=dev)
    parents_dev = parents.to(dev)
    ends = deepest(parents).to(dev)
    scratch = torch.empty((1, bs + 1, scratch_floats(nodes, HV, K, V)), device=dev)
    pool = ssm.clone()[None]  # our commit writes the pool in place
    out = {}

    def sglang_verify():
        out["sglang"] = fused_sigmoid_gating_delta_rule_update(
            A_log=A_log,
            a=a,
            dt_bias=dt_bias,
            softplus_beta=1.0,
            softplus_threshold=20.0,
            q=q,
            k=k,
            v=v,
            b=b,
            initial_state_source=ssm,
            initial_state_indices=slots,
            cu_seqlens=cu,
            use_qk_l2norm_in_kernel=True,
            disable_state_update=True,
            intermediate_states_buffer=inter,
            intermediate_state_indices=slots,
            cache_steps=nodes,
            retrieve_parent_token=parents_dev.clamp(min=0),
        )

    def sglang_commit():
        out["committed"] = inter[torch.arange(bs, device=dev), ends]

    def ours_verify():
        out["ours"] = tree_verify(
            q[0],
            k[0],
            v[0],
            a,
            b,
            A_log,
            dt_bias,
            ssm,
            slots,
            parents_dev,
            scratch[0],
            slots,
            max_path=BLOCK,
        )

    def ours_commit():
        commit_paths(pool, slots, scratch, slots, parents_dev, ends, max_path=BLOCK)

    chunked = nodes <= MAX_NODES  # the chunked verify's widths: one block to 64, blocks to 256

    def chunk_verify(block_v=None, warps=None, precision="split"):
        def fn():
            out["chunk"] = chunk_tree_verify(
                q[0],
                k[0],
                v[0],
                a,
                b,
                A_log,
                dt_bias,
                ssm,
                slots,
                parents_dev,
                scratch[0],
                slots,
                max_path=BLOCK,
                block_v=block_v,
                num_warps=warps,
                precision=precision,
            )

        return fn

    # SGLang's chain verify (DFLASH's) over the same number of tokens: T / BLOCK chains of BLOCK
    # tokens, every token's state stored for the commit
    chains = T // BLOCK
    chain_slots = torch.arange(chains, dtype=torch.int32, device=dev) % (bs + 1)
    chain_inter = torch.empty((chains, BLOCK, HV, V, K), dtype=torch.float32, device=dev)
    chain_cu = torch.arange(0, T + 1, BLOCK, dtype=torch.int32, device=dev)
    chain_idx = torch.arange(chains, dtype=torch.int32, device=dev)

    def sglang_chain_verify():
        fused_sigmoid_gating_delta_rule_update(
            A_log=A_log,
            a=a,
            dt_bias=dt_bias,
            softplus_beta=1.0,
            softplus_threshold=20.0,
            q=q,
            k=k,
            v=v,
            b=b,
            initial_state_source=ssm,
            initial_state_indices=chain_slots,
            cu_seqlens=chain_cu,
            use_qk_l2norm_in_kernel=True,
            disable_state_update=True,
            intermediate_states_buffer=chain_inter,
            intermediate_state_indices=chain_idx,
            cache_steps=BLOCK,
        )

    def ours_verify_tile(block_v, warps):
        def fn():
            tree_verify(
                q[0],
                k[0],
                v[0],
                a,
                b,
                A_log,
                dt_bias,
                ssm,
                slots,
                parents_dev,
                scratch[0],
                slots,
                max_path=BLOCK,
                block_v=block_v,
                num_warps=warps,
            )

        return fn

    theirs = fused_sigmoid_gating_delta_rule_update is not None
    ref_name = "sglang" if theirs else "ours"
    for fn in (sglang_verify, sglang_commit) if theirs else ():  # once, for the checks
        fn()
    for fn in (ours_verify, ours_commit):
        fn()
    if chunked:
        chunk_verify()()
    row = {"bs": bs, "nodes": nodes, "reference": ref_name}
    # the same numbers either way, up to float32 rounding and the bf16 output
    ref_o = out[ref_name].reshape(T, HV, V).float()
    row["max_abs_diff_o"] = float((out["ours"].float() - ref_o).abs().max())
    if theirs:
        row["max_abs_diff_state"] = float((pool[0, :bs] - out["committed"]).abs().max())
    if chunked:
        row["chunk_max_abs_diff_o"] = float((out["chunk"].float() - ref_o).abs().max())
    if dev == "cuda":
        from bench_tree_build import gpu_ms  # beside this script, so on sys.path when it runs

        timed = [("ours_verify", ours_verify), ("ours_commit", ours_commit)]
        if theirs:
            timed += [("sglang_verify", sglang_verify), ("sglang_commit", sglang_commit)]
        for name, fn in timed:
            row[f"{name}_ms"] = gpu_ms(fn, iters, graph=True)
        for block_v, warps in tiles:
            row[f"ours_verify_bv{block_v}_w{warps}_ms"] = gpu_ms(
                ours_verify_tile(block_v, warps), iters, graph=True
            )
        if theirs and T % BLOCK == 0:
            row["sglang_chain_same_tokens_ms"] = gpu_ms(sglang_chain_verify, iters, graph=True)
        if chunked:
            row["chunk_verify_ms"] = gpu_ms(chunk_verify(), iters, graph=True)
            for block_v, warps, precision in chunk_tiles:
                key = f"chunk_verify_bv{block_v}_w{warps}_{precision}_ms"
                row[key] = _timed(gpu_ms, chunk_verify(block_v, warps, precision), iters)
    return row


def parse_tiles(text: str) -> list[tuple[int, int]]:
    """--tiles "16x1,32x2": (V tile, warps) of the root-path verify."""
    return [(int(bv), int(w)) for bv, w in (t.split("x") for t in text.split(",") if t)]


def parse_chunk_tiles(text: str) -> list[tuple[int, int, str]]:
    """--chunk-tiles "32x4xsplit,64x8xtf32x3": (V tile, warps, chunk_tree_verify precision)."""
    out = []
    for t in (t for t in text.split(",") if t):
        bv, warps, precision = t.split("x", 2)
        if precision not in PRECISIONS:
            raise ValueError(f"--chunk-tiles {t}: precision must be one of {PRECISIONS}")
        out.append((int(bv), int(warps), precision))
    return out


def conv_tilings(text: str) -> dict[str, dict]:
    """--conv-tilings "t16n256w4,t8n128w4tile,t4n256w4anc,t2n512w4in,t16n256w4nosave": name ->
    conv_tree keywords (block_t, block_n, num_warps, window_tile, ancestor_table, save_inputs:
    "in" stores each node's input once, as DDTREE's compact pool serves it; "nosave" drops the
    stores)."""
    out = {}
    for name in (t for t in text.split(",") if t):
        m = re.fullmatch(r"t(\d+)n(\d+)w(\d+)(tile)?(anc)?(in)?(nosave)?", name)
        if m is None:
            raise ValueError(f"--conv-tilings {name}: expected tNnNwN[tile][anc][in][nosave]")
        if m[4] and m[6]:
            raise ValueError(f"--conv-tilings {name}: 'in' stores no windows to tile")
        out[name] = dict(
            block_t=int(m[1]),
            block_n=int(m[2]),
            num_warps=int(m[3]),
            window_tile=m[4] is not None,
            ancestor_table=m[5] is not None,
            save_inputs=m[6] is not None,
        )
    return out


def _timed(gpu_ms, fn, iters: int) -> float | str:
    """GPU ms of one swept configuration, or why it could not run (a tile too large for the
    chip's shared memory is a result of the sweep, not the end of it)."""
    try:
        return gpu_ms(fn, iters, graph=True)
    except Exception as exc:  # noqa: BLE001 - reported in the row
        return f"error: {str(exc)[:200]}"


def run_conv(
    bs: int,
    nodes: int,
    parents: torch.Tensor,
    iters: int,
    dim: int = CONV_DIM,
    device: str = "cuda",
    tilings=(),
) -> dict:
    """One configuration of the tree conv1d: SGLang's causal_conv1d_update (tree path) against
    sglang_ddtree.gdn.conv_tree, bf16 at Qwen3.6-27B's conv width; also checks they agree. On a
    CPU device (Triton's interpreter) only the checks, in float32."""
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update

    from sglang_ddtree.gdn.conv_tree import conv_tree
    from sglang_ddtree.tree.testing import eagle_links

    dev, KW = device, 4
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=dev).to(dtype)

    x = randn(bs, nodes, dim).transpose(1, 2)
    weight, bias, state = randn(dim, KW), randn(dim), randn(bs + 1, dim, KW - 1)
    idx = torch.arange(bs, dtype=torch.int32, device=dev)
    nxt, sib = (t.to(dev) for t in eagle_links(parents))
    out = {}

    def call(name, fn):
        # its own conv state (SGLang's kernel rolls it during a tree verify), windows, parents
        own = state.clone()
        windows = out[f"{name}_win"] = torch.zeros(
            (bs + 1, nodes, dim, KW - 1), dtype=dtype, device=dev
        )
        par = out[f"{name}_par"] = torch.zeros((bs, nodes), dtype=torch.int64, device=dev)

        def run():
            out[name] = fn(
                x,
                own,
                weight,
                bias,
                "silu",
                conv_state_indices=idx,
                intermediate_conv_window=windows,
                intermediate_state_indices=idx,
                retrieve_next_token=nxt,
                retrieve_next_sibling=sib,
                retrieve_parent_token=par,
            )

        return run

    sglang, ours = call("sglang", causal_conv1d_update), call("ours", conv_tree)
    sglang()
    ours()
    # SGLang's chain conv (DFLASH's verify) over the same number of tokens: chains of BLOCK
    whole = bs * nodes % BLOCK == 0  # the timing below needs a whole number of chains
    chains = max(1, bs * nodes // BLOCK)
    chain_x = x.transpose(1, 2).reshape(chains, BLOCK, dim).transpose(1, 2) if whole else None
    chain_state = randn(chains + 1, dim, KW - 1)
    chain_idx = torch.arange(chains, dtype=torch.int32, device=dev)
    chain_win = torch.zeros((chains + 1, BLOCK, dim, KW - 1), dtype=dtype, device=dev)

    def sglang_chain():
        causal_conv1d_update(
            chain_x,
            chain_state,
            weight,
            bias,
            "silu",
            conv_state_indices=chain_idx,
            intermediate_conv_window=chain_win,
            intermediate_state_indices=chain_idx,
        )

    # as served on DDTREE's compact pool: each node's input once, the commit builds the window
    call("ours_in", partial(conv_tree, save_inputs=True))()

    def fronts_hold_inputs(buffer) -> bool:  # each live request's row begins with its inputs
        front = buffer[:bs].reshape(bs, -1)[:, : nodes * dim].view(bs, nodes, dim)
        return torch.equal(front, x.transpose(1, 2))

    row = {
        "bs": bs,
        "nodes": nodes,
        "conv_dim": dim,
        "conv_max_abs_diff_o": float((out["ours"].float() - out["sglang"].float()).abs().max()),
        "conv_windows_equal": bool(torch.equal(out["ours_win"][:bs], out["sglang_win"][:bs])),
        "conv_parents_equal": bool(torch.equal(out["ours_par"], out["sglang_par"])),
        "conv_inputs_equal": bool(
            torch.equal(out["ours_in"], out["ours"]) and fronts_hold_inputs(out["ours_in_win"])
        ),
    }
    timed = {}
    for tiling, kw in conv_tilings(",".join(tilings)).items():
        if "nosave" in tiling:  # the same kernel without the window stores (a bound)
            timed[tiling] = partial(
                conv_tree,
                x,
                state.clone(),
                weight,
                bias,
                "silu",
                conv_state_indices=idx,
                intermediate_conv_window=None,
                intermediate_state_indices=idx,
                retrieve_next_token=nxt,
                retrieve_next_sibling=sib,
                retrieve_parent_token=out["ours_par"].clone(),
                **kw,
            )
            continue
        timed[tiling] = call(f"ours_{tiling}", partial(conv_tree, **kw))
        timed[tiling]()
        stores = out[f"ours_{tiling}_win"]
        if kw["save_inputs"]:
            stored = fronts_hold_inputs(stores)
        else:
            stored = torch.equal(stores[:bs], out["ours_win"][:bs])
        row[f"conv_{tiling}_equal"] = bool(
            torch.equal(out[f"ours_{tiling}"], out["ours"]) and stored
        )
    if dev == "cuda":
        from bench_tree_build import gpu_ms  # beside this script, so on sys.path when it runs

        for tiling, fn in timed.items():
            row[f"conv_{tiling}_ms"] = _timed(gpu_ms, fn, iters)
        row["sglang_conv_ms"] = gpu_ms(sglang, iters, graph=True)
        row["ours_conv_ms"] = gpu_ms(ours, iters, graph=True)
        # as served: the parents kernel in the first GDN layer only (state/gdn.py), so a
        # round of L layers costs ours_conv_ms + (L - 1) x ours_conv_noparents_ms
        from sglang_ddtree.gdn.conv_tree import tree_parents

        served = call("ours_np", partial(conv_tree, fill_parents=False))
        out["ours_np_par"].copy_(out["ours_par"])  # as the first layer left it
        served()
        row["conv_noparents_equal"] = bool(torch.equal(out["ours_np"], out["ours"]))
        row["ours_conv_noparents_ms"] = gpu_ms(served, iters, graph=True)
        row["parents_ms"] = gpu_ms(
            partial(tree_parents, nxt, sib, out["ours_par"].clone()), iters, graph=True
        )
        stored_np = call("ours_in_np", partial(conv_tree, fill_parents=False, save_inputs=True))
        out["ours_in_np_par"].copy_(out["ours_par"])
        stored_np()
        row["ours_conv_inputs_noparents_ms"] = gpu_ms(stored_np, iters, graph=True)
        row.update(_time_window_commits(bs, nodes, dim, KW, out["ours_par"], randn, iters))
        if chain_x is not None:
            row["sglang_chain_conv_same_tokens_ms"] = gpu_ms(sglang_chain, iters, graph=True)
        served_tilings = {"": {}} | {
            t: kw for t, kw in conv_tilings(",".join(tilings)).items() if kw["save_inputs"]
        }
        row.update(
            _time_conv_rounds(
                bs, nodes, dim, KW, nxt, sib, randn, iters, served_tilings, chain=whole
            )
        )

    return row


def _time_conv_rounds(
    bs, nodes, dim, KW, nxt, sib, randn, iters, tilings, chain: bool, layers=48
) -> dict:
    """A round's conv1d as it runs in the server: `layers` GDN layers' calls back to back in one
    CUDA graph, each layer with its own inputs, weights, conv states and stores (so no layer
    reads another's data from L2), ms per round. Ours as DDTREE's compact pool serves it (the
    parents kernel in the first layer, each node's input stored once; per tiling, "" the
    default; and with SGLang's per-node windows stored, as on the full pool); SGLang's chain
    conv (DFLASH's verify) over the same tokens in chains of BLOCK."""
    from bench_tree_build import gpu_ms
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update

    from sglang_ddtree.gdn.conv_tree import conv_tree, tree_parents

    dev = nxt.device
    xs = [randn(bs, nodes, dim).transpose(1, 2) for _ in range(layers)]
    weights, biases = randn(layers, dim, KW), randn(layers, dim)
    states = randn(layers, bs + 1, dim, KW - 1)
    inputs = torch.zeros((layers, bs + 1, nodes, dim, 1), dtype=xs[0].dtype, device=dev)
    parents = torch.zeros((bs, nodes), dtype=torch.int64, device=dev)
    idx = torch.arange(bs, dtype=torch.int32, device=dev)

    table = torch.zeros((bs, nodes, KW - 1), dtype=torch.int32, device=dev)

    def ours(windows, ancestor_table=False, **kw):
        # ancestor_table: the first layer's parents kernel also writes each node's K - 1
        # ancestors, which every layer then reads instead of walking the parent links
        def run():
            if ancestor_table:
                tree_parents(nxt, sib, parents, table)
            for layer in range(layers):
                conv_tree(
                    xs[layer],
                    states[layer],
                    weights[layer],
                    biases[layer],
                    "silu",
                    conv_state_indices=idx,
                    intermediate_conv_window=windows[layer],
                    intermediate_state_indices=idx,
                    retrieve_next_token=nxt,
                    retrieve_next_sibling=sib,
                    retrieve_parent_token=parents,
                    fill_parents=layer == 0 and not ancestor_table,
                    ancestors=table if ancestor_table else None,
                    **kw,
                )

        return run

    row = {}
    for tiling, kw in tilings.items():
        name = f"conv_round_{tiling}_ms" if tiling else "ours_conv_round_ms"
        row[name] = _timed(gpu_ms, ours(inputs, **{**kw, "save_inputs": True}), iters)
    windows = torch.zeros((layers, bs + 1, nodes, dim, KW - 1), dtype=xs[0].dtype, device=dev)
    row["ours_conv_round_windows_ms"] = _timed(gpu_ms, ours(windows), iters)
    del windows
    if chain:
        chains = bs * nodes // BLOCK
        chain_xs = [x.transpose(1, 2).reshape(chains, BLOCK, dim).transpose(1, 2) for x in xs]
        chain_states = randn(layers, chains + 1, dim, KW - 1)
        chain_windows = torch.zeros(
            (layers, chains + 1, BLOCK, dim, KW - 1), dtype=xs[0].dtype, device=dev
        )
        chain_idx = torch.arange(chains, dtype=torch.int32, device=dev)

        def sglang_chain():
            for layer in range(layers):
                causal_conv1d_update(
                    chain_xs[layer],
                    chain_states[layer],
                    weights[layer],
                    biases[layer],
                    "silu",
                    conv_state_indices=chain_idx,
                    intermediate_conv_window=chain_windows[layer],
                    intermediate_state_indices=chain_idx,
                )

        row["sglang_chain_conv_round_ms"] = _timed(gpu_ms, sglang_chain, iters)
    return row


def _time_window_commits(bs, nodes, dim, KW, parents, randn, iters, layers=48) -> dict:
    """A round's conv-window commit over `layers` GDN layers (one launch each way): SGLang's
    scatter of the per-node windows, and conv_tree.commit_windows from the stored inputs."""
    from bench_tree_build import gpu_ms
    from sglang.kernels.ops.mamba.mamba_state_scatter_triton import (
        fused_conv_window_scatter_with_mask,
    )

    from sglang_ddtree.gdn.conv_tree import commit_windows

    dev = parents.device
    states = randn(layers, bs + 1, dim, KW - 1)
    buffer = randn(layers, bs + 1, nodes, dim, KW - 1)
    idx = torch.arange(bs, dtype=torch.int32, device=dev)
    last = torch.full((bs,), nodes - 1, dtype=torch.int64, device=dev)
    return {
        "sglang_window_scatter_ms": gpu_ms(
            partial(fused_conv_window_scatter_with_mask, states, buffer, idx, last),
            iters,
            graph=True,
        ),
        "ours_commit_windows_ms": gpu_ms(
            partial(commit_windows, states, buffer, idx, idx, parents, last), iters, graph=True
        ),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", default="16,32,64,128")
    p.add_argument("--bs", default="1,8")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--tiles",
        default="",
        help="also time our verify at these V tiles x warps, e.g. 16x1,32x2,64x4",
    )
    p.add_argument(
        "--chunk-tiles",
        default="",
        help="also time the chunked verify at these V "
        "tiles x warps x precision, e.g. 64x8xsplit,128x8xtf32",
    )
    p.add_argument("--conv", action="store_true", help="also time the tree conv1d (conv_tree)")
    p.add_argument("--conv-only", action="store_true", help="the tree conv1d alone (no verify)")
    p.add_argument(
        "--conv-tilings",
        default="",
        help="with --conv, also these conv_tree "
        "tilings, e.g. t16n256w4,t8n128w4tile,t16n256w4nosave",
    )
    args = p.parse_args()
    tiles, chunk_tiles = parse_tiles(args.tiles), parse_chunk_tiles(args.chunk_tiles)
    conv_tilings(args.conv_tilings)  # a typo fails here, before any GPU work
    rows = []
    for bs in (int(x) for x in args.bs.split(",")):
        for nodes in (int(x) for x in args.nodes.split(",")):
            parents = trees(bs, nodes, seed=nodes)
            if args.conv_only:
                rows.append({})
            else:
                rows.append(
                    run_one(bs, nodes, parents, args.iters, tiles=tiles, chunk_tiles=chunk_tiles)
                )
            if args.conv or args.conv_only:
                rows[-1].update(
                    run_conv(
                        bs,
                        nodes,
                        parents,
                        args.iters,
                        tilings=[t for t in args.conv_tilings.split(",") if t],
                    )
                )
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "gdn_tree_kernel.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    if args.conv_only:
        _print_conv(rows)
        return 0
    print(
        f"\n{'bs':>3} {'N':>4} {'SGLang verify':>13} {'commit':>7} {'chain same T':>12} "
        f"{'root paths':>10} {'chunk':>7} {'commit':>7} {'diff o':>7} {'chunk':>7} "
        f"{'diff state':>10}"
    )
    for r in rows:
        print(
            f"{r['bs']:>3} {r['nodes']:>4} {r.get('sglang_verify_ms', -1):>13.3f} "
            f"{r.get('sglang_commit_ms', -1):>7.3f} {r.get('sglang_chain_same_tokens_ms', -1):>12.3f} "
            f"{r['ours_verify_ms']:>10.3f} {r.get('chunk_verify_ms', -1):>7.3f} "
            f"{r['ours_commit_ms']:>7.3f} {r['max_abs_diff_o']:>7.4f} "
            f"{r.get('chunk_max_abs_diff_o', -1):>7.4f} {r.get('max_abs_diff_state', -1):>10.2e}"
        )
    return 0


def _print_conv(rows: list[dict]) -> None:
    """The conv rows' per-round times (ms, 48 layers in one graph)."""
    print(f"\n{'bs':>3} {'N':>4} {'ours':>8} {'windows':>8} {'chain':>8} {'best tiling':>20}")
    for r in rows:
        tiled = {k: v for k, v in r.items() if k.startswith("conv_round_") and isinstance(v, float)}
        best = min(tiled, key=tiled.get, default="")
        cells = [
            r.get(k)
            for k in (
                "ours_conv_round_ms",
                "ours_conv_round_windows_ms",
                "sglang_chain_conv_round_ms",
            )
        ]
        shown = " ".join(
            f"{c:>8.3f}" if isinstance(c, float) else f"{str(c)[:8]:>8}" for c in cells
        )
        print(
            f"{r['bs']:>3} {r['nodes']:>4} {shown} {best.removeprefix('conv_round_').removesuffix('_ms')} "
            f"{tiled.get(best, -1):.3f}"
        )


if __name__ == "__main__":
    raise SystemExit(main())

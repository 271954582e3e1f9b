"""The Gated DeltaNet layers' causal conv1d over a token tree, every node in parallel (DDTREE's
tree verify runs it through state/gdn.py's conv hook).

SGLang's tree path of `causal_conv1d_update` (`_causal_conv1d_update_kernel` with
retrieve_next_token / retrieve_next_sibling) runs one program per (request, 256 channels) that
walks the N nodes in an unrolled loop, re-deriving parent links with vector reductions at every
node. At Qwen3.6-27B and N = 64 that is 3.4 ms of a DDTREE round against 0.6 ms for DFLASH's
16-token chain (docs/results.md), and the unrolled loop is compiled per width. A node's conv
output only needs its own input and its K - 1 nearest ancestors' (or, above the root, the conv
state's history columns), so here:

- `tree_parents`: one program per request derives every node's parent from SGLang's first-child /
  next-sibling links at once (pointer jumping along the sibling chains), into the same
  `retrieve_parent_token` SGLang's kernel fills (root and unused entries 0).
- `conv_tree`: one program per (request, channel block, node block) gathers each node's window
  through the parent links, writes the output and the node's window into SGLang's
  intermediate-window buffer (for SGLang's commit scatter), in SGLang's arithmetic order.

Unlike SGLang's kernel it leaves the conv state itself alone: SGLang's tree path overwrites it
with the last K - 1 node inputs by index, which the commit then replaces with the accepted node's
window for every request, so only the commit's result matters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _parents_kernel(next_token, next_sibling, parents, ancestors, N, stride_nt, stride_ns,
                    stride_p, NP: tl.constexpr, LOG_NP: tl.constexpr, HOPS: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)
    o = tl.arange(0, NP)
    m = o < N
    nt = tl.load(next_token + b * stride_nt + o, mask=m, other=-1).to(tl.int32)
    ns = tl.load(next_sibling + b * stride_ns + o, mask=m, other=-1).to(tl.int32)
    # first-child links give a parent directly; a later sibling inherits its first sibling's
    fc_parent = tl.max(tl.where(nt[None, :] == o[:, None], o[None, :], -1), axis=1)
    prev = tl.max(tl.where(ns[None, :] == o[:, None], o[None, :], -1), axis=1)
    first = tl.where(prev >= 0, prev, o)
    for _ in range(LOG_NP):  # pointer jumping: first[s] <- first[first[s]]
        first = tl.max(tl.where(o[None, :] == first[:, None], first[None, :], -1), axis=1)
    parent = tl.maximum(tl.max(tl.where(o[None, :] == first[:, None], fc_parent[None, :], -1),
                               axis=1), 0)  # fmt: skip
    tl.store(parents + b * stride_p + o, parent, mask=m)
    # HOPS > 0: ancestors[b, i, h] = the node h + 1 steps above i, or -1, -2, ... for the conv
    # history above the root (the conv kernel's encoding), so that its loads are independent
    cur = o
    for h in tl.static_range(HOPS):
        up = tl.max(tl.where(o[None, :] == cur[:, None], parent[None, :], -1), axis=1)
        cur = tl.where(cur > 0, up, cur - 1)
        tl.store(ancestors + (b * N + o) * HOPS + h, cur, mask=m)


@triton.jit
def _conv_tree_kernel(
    x, w, bias, conv_state, state_idx, inter, inter_idx, parents, o, N, dim,
    stride_x_seq, stride_x_dim, stride_x_tok, stride_w_dim, stride_w_win,
    stride_cs_seq, stride_cs_dim, stride_cs_tok, stride_in_seq, stride_in_step, stride_in_dim,
    stride_in_win, stride_p, stride_o_seq, stride_o_dim, stride_o_tok,
    KW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, SAVE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW_TILE: tl.constexpr, WIN: tl.constexpr,
    ANCESTORS: tl.constexpr, ancestors, STORE_UP: tl.constexpr,
):  # fmt: skip
    b, i_c, i_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(state_idx + b).to(tl.int64)
    if slot == -1:  # SGLang's PAD_SLOT_ID: a padding request
        return
    t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    c = i_c * BLOCK_N + tl.arange(0, BLOCK_N)
    mt, mc = t < N, c < dim
    m2 = mt[:, None] & mc[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + c, mask=mc, other=0.0).to(tl.float32)[None, :]
    x_row = x + b * stride_x_seq + c[None, :] * stride_x_dim
    history = conv_state + slot * stride_cs_seq + c[None, :] * stride_cs_dim
    if SAVE:  # STORE_UP 0: the launcher's strides address the row's front as [N, dim]
        window = inter + tl.load(inter_idx + b).to(tl.int64) * stride_in_seq
        window += t[:, None] * stride_in_step + c[None, :] * stride_in_dim
    # WINDOW_TILE: the node's whole window [BLOCK_T, BLOCK_N, WIN] in one store whose lanes run
    # over (channel, window slot), i.e. along memory (WIN = KW - 1 rounded up to a power of 2);
    # else one strided store per slot
    o_w = tl.arange(0, WIN)[None, None, :]
    tile = tl.zeros([BLOCK_T, BLOCK_N, WIN], dtype=x.dtype.element_ty)
    cur = t  # the j-th ancestor: a node >= 0, or -1, -2, ... for the history above the root
    for j in tl.static_range(KW):
        if ANCESTORS:  # the j-th ancestor from tree_parents' table: no chain of loads
            if j > 0:
                cur = tl.load(ancestors + (b * N + t) * (KW - 1) + j - 1, mask=mt, other=-1)
        in_tree = cur >= 0
        from_x = tl.load(x_row + tl.maximum(cur, 0)[:, None] * stride_x_tok,
                         mask=m2 & in_tree[:, None], other=0.0)  # fmt: skip
        from_state = tl.load(history + (KW - 1 + cur)[:, None] * stride_cs_tok,
                             mask=m2 & (cur < 0)[:, None], other=0.0)  # fmt: skip
        xv = tl.where(in_tree[:, None], from_x, from_state.to(from_x.dtype))
        wv = tl.load(w + c * stride_w_dim + (KW - 1 - j) * stride_w_win, mask=mc, other=0.0)
        acc += xv * wv[None, :]
        if SAVE:
            if j <= STORE_UP:  # the node's window: itself last, its ancestors before it
                if WINDOW_TILE:
                    tile = tl.where(o_w == KW - j - 2, xv[:, :, None], tile)
                else:
                    tl.store(window + (KW - j - 2) * stride_in_win, xv, mask=m2)
        if not ANCESTORS:
            parent = tl.load(parents + b * stride_p + tl.maximum(cur, 0), mask=mt, other=0)
            cur = tl.where(cur > 0, parent.to(tl.int32), cur - 1)
    if SAVE:
        if WINDOW_TILE:
            tl.store(window[:, :, None] + o_w * stride_in_win, tile,
                     mask=m2[:, :, None] & (o_w < KW - 1))  # fmt: skip
    if SILU:
        acc = acc / (1 + tl.exp(-acc))
    out = o + b * stride_o_seq + c[None, :] * stride_o_dim + t[:, None] * stride_o_tok
    tl.store(out, acc, mask=m2)


def tree_parents(next_token: torch.Tensor, next_sibling: torch.Tensor, out: torch.Tensor,
                 ancestors: torch.Tensor | None = None) -> None:  # fmt: skip
    """out [bs, N] <- every node's parent from SGLang's first-child / next-sibling links (root and
    unreachable entries 0, as SGLang's conv kernel leaves them); ancestors [bs, N, H] int32
    (optional) <- the nodes 1..H steps above each node, -1, -2, ... above the root. Sync-free."""
    bs, N = next_token.shape
    NP = triton.next_power_of_2(N)
    hops = 0 if ancestors is None else ancestors.shape[-1]
    _parents_kernel[(bs,)](
        next_token, next_sibling, out, out if ancestors is None else ancestors, N,
        next_token.stride(0), next_sibling.stride(0), out.stride(0), NP=NP,
        LOG_NP=max(1, NP.bit_length() - 1), HOPS=hops,
    )  # fmt: skip


def conv_tree(x, conv_state, weight, bias, activation, *, conv_state_indices,
              intermediate_conv_window, intermediate_state_indices, retrieve_next_token,
              retrieve_next_sibling, retrieve_parent_token, block_t: int = 4,
              block_n: int = 128, window_tile: bool = False, num_warps: int = 2,
              ancestor_table: bool = False, fill_parents: bool = True,
              save_inputs: bool = False, ancestors: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """SGLang's `causal_conv1d_update` for a tree verify (same arguments and outputs: x and the
    returned o are [bs, dim, N] views, conv_state [slots, dim, K - 1], weight [dim, K],
    intermediate_conv_window [slots', N, dim, K - 1]; retrieve_parent_token is filled), with
    every node computed in parallel. The conv state is read, not rolled (module docstring).
    4 nodes x 128 channels per program, 2 warps: the fastest tiling of an H200 sweep of a
    round as served (48 layers in one graph, inputs stored once: 0.702 ms at bs 8 / N 32
    against 0.723 for 4 x 256 x 4 warps, 1.19 against 1.24 at bs 16 / N 32; smaller node blocks
    were slower). An earlier per-layer sweep had moved it from 16 nodes to 4 (0.027 ms per
    layer at bs 8 / N = 32 against 0.087 for 16 x 256: the program's chain of dependent parent
    loads is its latency, so more programs hide more of it). ancestor_table:
    the parents kernel also writes each node's K - 1 ancestors, and this kernel reads them
    instead of walking the parent links (the same values; 1.33 against 1.27 ms per round at
    bs 8 / N 32 on the H200: no gain). fill_parents=False: retrieve_parent_token already holds
    this round's parents (an earlier layer's call filled it: every GDN layer of a verify sees the
    same tree), so the parents kernel is skipped. save_inputs: instead of the per-node windows,
    each node's own input goes once to the front of its request's row of
    intermediate_conv_window, as [N, dim] (a third of the stores; `commit_windows` then builds
    the accepted node's window from them: DDTREE's own pool, whose layout only DDTREE reads).
    ancestors: a [bs, N, K - 1] int32 table tree_parents already wrote this round (an earlier
    layer's), read as ancestor_table reads its own; with fill_parents=False (0.700
    against 0.723 ms per round at bs 8 / N 32, no better than the 4 x 128 tiling without it)."""
    bs, dim, N = x.shape
    KW = weight.shape[1]
    if conv_state.shape[-1] != KW - 1:
        raise ValueError(f"conv_state {tuple(conv_state.shape)} is not [.., dim, {KW - 1}]")
    table = _ancestor_table(ancestors, ancestor_table, fill_parents, (bs, N, KW - 1), x.device)
    if fill_parents:
        tree_parents(retrieve_next_token, retrieve_next_sibling, retrieve_parent_token, table)
    o = torch.empty_like(x)
    save = intermediate_conv_window is not None
    inter = intermediate_conv_window if save else x
    in_strides = intermediate_conv_window.stride() if save else (0, 0, 0, 0)
    if save and save_inputs:  # the row's front as [N, dim]
        if window_tile:
            raise ValueError("save_inputs stores no windows: drop window_tile")
        _check_rows(intermediate_conv_window, N, dim, KW)
        in_strides = (in_strides[0], dim, 1, 0)
    grid = (bs, triton.cdiv(dim, block_n), triton.cdiv(N, block_t))
    _conv_tree_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_state, conv_state_indices,
        inter, intermediate_state_indices if save else conv_state_indices,
        retrieve_parent_token, o, N, dim, *x.stride(), *weight.stride(), *conv_state.stride(),
        *in_strides, retrieve_parent_token.stride(0), *o.stride(),
        KW=KW, HAS_BIAS=bias is not None, SILU=activation in ("silu", "swish", True),
        SAVE=save, BLOCK_T=block_t, BLOCK_N=block_n, WINDOW_TILE=window_tile,
        WIN=triton.next_power_of_2(KW - 1), ANCESTORS=table is not None,
        ancestors=retrieve_parent_token if table is None else table, num_warps=num_warps,
        STORE_UP=0 if save_inputs else KW - 2,  # how many ancestors' inputs a node stores
    )  # fmt: skip
    return o


def _ancestor_table(given, own: bool, fill_parents: bool, shape, device) -> torch.Tensor | None:
    """The ancestor table conv_tree reads: `given` (an earlier layer's), a new one the parents
    kernel fills (`own`), or None (the kernel walks the parent links)."""
    if given is not None:
        if own or fill_parents or tuple(given.shape) != shape or not given.is_contiguous():
            raise ValueError(f"ancestors {tuple(given.shape)}: a contiguous {list(shape)} table "
                             "from an earlier tree_parents, with fill_parents=False")  # fmt: skip
        return given
    if not own:
        return None
    if not fill_parents:
        raise ValueError("ancestor_table needs the parents kernel (fill_parents=True)")
    return torch.empty(shape, dtype=torch.int32, device=device)


def _check_rows(windows: torch.Tensor, N: int, dim: int, KW: int) -> None:
    """The per-request rows of a per-node conv buffer [rows, >= N, dim, K - 1 or 1] (or with a
    layer dimension in front) are dense, so that a row's front holds N x dim inputs."""
    nodes, width, win = windows.shape[-3:]
    dense = (windows.stride(-1), windows.stride(-2), windows.stride(-3)) == (1, win, width * win)
    if nodes < N or width != dim or win not in (1, KW - 1) or not dense:
        raise ValueError(f"conv buffer {tuple(windows.shape)} (strides {windows.stride()}) is "
                         f"not dense [.., >= {N}, {dim}, {KW - 1} or 1] rows")  # fmt: skip


@triton.jit
def _commit_windows_kernel(conv, inputs, state_idx, inter_idx, parents, nodes, track_idx,
                           track_node, dim, stride_c_layer, stride_c_slot, stride_i_layer,
                           stride_i_row, stride_p, KM1: tl.constexpr, WIN: tl.constexpr,
                           TRACK: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """One program per (layer, request, channel block): the accepted node's window (and the
    track node's) from the stored inputs along its parent links, the conv state's history
    above the root; every value read before any is written (the history is the request's own
    slot, which the commit overwrites)."""
    layer, b, blk = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    c = blk * BLOCK + tl.arange(0, BLOCK)
    mc = c < dim
    slot = tl.load(state_idx + b).to(tl.int64)
    if slot >= 0:  # else a padding request
        row = inputs + layer * stride_i_layer + tl.load(inter_idx + b).to(tl.int64) * stride_i_row
        history = conv + layer * stride_c_layer + slot * stride_c_slot + c * KM1
        links = parents + b * stride_p
        node = tl.load(nodes + b).to(tl.int32)
        main = _window(row, history, links, node, c, mc, dim, KM1, WIN, BLOCK)
        # column h (h steps above the node) is window slot KM1 - 1 - h: the node itself last
        cols = tl.arange(0, WIN)[None, :]
        put = mc[:, None] & (cols < KM1)
        if TRACK:
            t_slot = tl.load(track_idx + b).to(tl.int64)
            t_node = tl.load(track_node + b).to(tl.int32)
            tracked = _window(row, history, links, t_node, c, mc, dim, KM1, WIN, BLOCK)
        tl.debug_barrier()  # every thread's history loads before any thread overwrites it
        if TRACK:
            if (t_slot >= 0) & (t_node >= 0):
                to = conv + layer * stride_c_layer + t_slot * stride_c_slot + c * KM1
                tl.store(to[:, None] + (KM1 - 1 - cols), tracked, mask=put)
        if node >= 0:
            tl.store(history[:, None] + (KM1 - 1 - cols), main, mask=put)


@triton.jit
def _window(row, history, links, node, c, mc, dim, KM1: tl.constexpr, WIN: tl.constexpr,
            BLOCK: tl.constexpr):  # fmt: skip
    """[BLOCK, WIN]: column h < KM1 the input h steps above `node` (the history's columns above
    the root); zeros elsewhere and when node < 0."""
    out = tl.zeros([BLOCK, WIN], dtype=row.dtype.element_ty)
    cols = tl.arange(0, WIN)[None, :]
    cur = node
    for h in tl.static_range(KM1):
        live = mc & (node >= 0)
        from_x = tl.load(row + tl.maximum(cur, 0) * dim + c, mask=live & (cur >= 0), other=0.0)
        from_state = tl.load(history + KM1 + cur, mask=live & (cur < 0), other=0.0)
        value = tl.where(cur >= 0, from_x, from_state.to(from_x.dtype))
        out = tl.where(cols == h, value[:, None], out)
        parent = tl.load(links + tl.maximum(cur, 0), mask=cur > 0, other=0).to(tl.int32)
        cur = tl.where(cur > 0, parent, cur - 1)
    return out


def commit_windows(conv_states: torch.Tensor, inputs: torch.Tensor, state_idx: torch.Tensor,
                   inter_idx: torch.Tensor, parents: torch.Tensor, nodes: torch.Tensor,
                   track_idx: torch.Tensor | None = None, track_node: torch.Tensor | None = None,
                   block: int = 256) -> None:  # fmt: skip
    """The conv-window commit for `conv_tree(save_inputs=True)`, every layer in one launch:
    conv_states [layers, slots, dim, K - 1] (contiguous) slot state_idx[b] <- the window of node
    nodes[b] (the node itself last, its K - 2 nearest ancestors before it, the slot's own
    history above the root), from inputs [layers, rows, >= N, dim, K - 1] (row inter_idx[b]'s
    front: the [N, dim] inputs) and parents [bs, N] (conv_tree's; root 0). With track_idx: slot
    track_idx[b] <- node track_node[b]'s window too (-1 in either: none). state_idx[b] < 0 or
    nodes[b] < 0: nothing for that request. SGLang's scatter of the full windows, as values."""
    layers, _, dim, km1 = conv_states.shape
    if not conv_states.is_contiguous():
        raise ValueError("commit_windows needs contiguous conv states")
    _check_rows(inputs, parents.shape[-1], dim, km1 + 1)
    bs = nodes.shape[0]
    track = track_idx is not None
    if track and track_node is None:
        raise ValueError("track_idx needs track_node")
    if bs == 0:
        return
    grid = (layers, bs, triton.cdiv(dim, block))
    _commit_windows_kernel[grid](
        conv_states, inputs, state_idx, inter_idx, parents, nodes,
        track_idx if track else nodes, track_node if track else nodes, dim,
        conv_states.stride(0), conv_states.stride(1), inputs.stride(0), inputs.stride(1),
        parents.stride(0), KM1=km1, WIN=triton.next_power_of_2(km1), TRACK=track, BLOCK=block,
    )  # fmt: skip

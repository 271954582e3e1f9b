"""Gated DeltaNet over a token tree, carrying the recurrent state in registers (work in progress).

SGLang's tree verify (`fused_sigmoid_gating_delta_rule_update_kernel` with the EAGLE tree mask)
reloads the parent's state from memory at every node but the first, even when the parent is the
node just processed, and stores every node's state so that the commit can copy the accepted one:
at Qwen3.6-27B that is 144 MiB per node and request in float32, and it is most of the cost of a
64-node DDTREE round (docs/benchmarks.md). Here:

- `tree_verify`: one program per (request, value head, V block) walks the nodes in their given
  order (any order with parent < child). The state stays in registers from a node to the next
  when the next is its child; it is reloaded from `scratch` only when the next node's parent is
  an earlier one, and stored only at nodes that have such a child (`store_flags`). In DFS
  preorder that is once per extra sibling instead of once per node.
- `replay_path`: the commit by replay instead of copy: the accepted path's updates (at most
  B - 1 + 1 steps) folded into the pre-verify state, writing one state per request.

The per-token math is SGLang's (l2-normalised q and k, q scaled, h *= exp(g), delta rule with
beta); g (log decay) and beta come precomputed per token and value head. Layouts follow SGLang:
q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV] float32; states [.., HV, V, K] (K contiguous);
T = bs * N tokens, request-major. Not yet wired into SGLang's GDN backend: `*_reference` are the
plain-torch definitions the kernels are tested against (tests/unit/test_gdn_tree_verify.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# --- plain torch definitions -------------------------------------------------------------------


def _prepare(q, k, h, l2norm: bool, scale: float):
    """[H, K] q, k (float32) expanded to the HV value heads, normalised and scaled as SGLang does."""
    q, k = q.float(), k.float()
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    group = h // q.shape[0]
    return (q * scale).repeat_interleave(group, 0), k.repeat_interleave(group, 0)


def _update(state, k, v, g, beta):
    """One token: state [HV, V, K] float32, k [HV, K], v [HV, V], g / beta [HV]."""
    state = state * torch.exp(g)[:, None, None]
    v_new = (v.float() - (state * k[:, None, :]).sum(-1)) * beta[:, None]
    return state + v_new[:, :, None] * k[:, None, :]


def tree_verify_reference(q, k, v, g, beta, h0, parents, *, scale: float, l2norm: bool = True):
    """(o [T, HV, V] float32, states [bs, N, HV, V, K] float32): node t starts from its parent's
    state (node 0, the root, from h0 [bs, HV, V, K]); parents [bs, N] with parents[:, 0] ignored."""
    bs, N = parents.shape
    HV = v.shape[1]
    o = torch.empty(v.shape, dtype=torch.float32)
    states = torch.empty((bs, N, *h0.shape[1:]), dtype=torch.float32)
    for b in range(bs):
        for t in range(N):
            tok = b * N + t
            start = h0[b].float() if t == 0 else states[b, int(parents[b, t])]
            qq, kk = _prepare(q[tok], k[tok], HV, l2norm, scale)
            states[b, t] = _update(start, kk, v[tok], g[tok], beta[tok])
            o[tok] = (states[b, t] * qq[:, None, :]).sum(-1)
    return o, states


def replay_reference(k, v, g, beta, h0, path, path_len, num_nodes: int, *, l2norm: bool = True):
    """[bs, HV, V, K] float32: h0 advanced by the nodes path[b, :path_len[b]] (root first)."""
    HV = v.shape[1]
    out = h0.float().clone()
    for b in range(path.shape[0]):
        for i in range(int(path_len[b])):
            tok = b * num_nodes + int(path[b, i])
            _, kk = _prepare(k[tok], k[tok], HV, l2norm, 1.0)
            out[b] = _update(out[b], kk, v[tok], g[tok], beta[tok])
    return out


def gdn_gating(A_log, a, b, dt_bias) -> tuple[torch.Tensor, torch.Tensor]:
    """(g [T, HV], beta [T, HV]) float32 from the layer's A_log, dt_bias [HV] and the token's a,
    b [T, HV], as SGLang's fused verify kernel forms them in float32 (softplus with beta 1 and
    threshold 20). SGLang's standalone `fused_gdn_gating` rounds beta to b's dtype instead."""
    x = a.float() + dt_bias.float()
    softplus = torch.where(x <= 20.0, torch.log(1.0 + torch.exp(x)), x)
    return -torch.exp(A_log.float()) * softplus, 1.0 / (1.0 + torch.exp(-b.float()))


def store_flags(parents: torch.Tensor) -> torch.Tensor:
    """[bs, N] int8: 1 where node t has a child other than t + 1 (whose walk must reload t's
    state). Sync-free."""
    bs, N = parents.shape
    child = torch.arange(1, N, device=parents.device)
    parent = parents[:, 1:].clamp(min=0)
    needs = (child[None, :] != parent + 1).to(torch.int8)
    flags = torch.zeros((bs, N), dtype=torch.int8, device=parents.device)
    return flags.scatter_reduce_(1, parent, needs, reduce="amax")


def state_traffic(parents: torch.Tensor) -> tuple[int, int]:
    """(state loads, state stores) over all requests for `tree_verify` in this node order;
    SGLang's tree verify does bs * (N - 1) loads and bs * N stores."""
    bs, N = parents.shape
    loads = int((parents[:, 1:] != torch.arange(N - 1, device=parents.device)[None, :]).sum())
    return loads, int(store_flags(parents).sum())


def dfs_preorder_reference(parents: torch.Tensor) -> torch.Tensor:
    """[bs, N] permutation (new position -> old node) into DFS preorder, children in their
    original order; node 0 stays first and every parent still precedes its children."""
    perms = []
    for row in parents.tolist():
        children: dict[int, list[int]] = {}
        for t in range(1, len(row)):
            children.setdefault(row[t], []).append(t)
        order, stack = [], [0]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(children.get(node, [])))
        perms.append(order)
    return torch.tensor(perms, dtype=torch.int64)


def root_paths(parents: torch.Tensor, ends: list[int], width: int | None = None):
    """(path [bs, width] int64: the node indices from the root to ends[b], zero-padded;
    path_len [bs]) for `replay_path`. width defaults to the longest path."""
    chains = []
    for b, node in enumerate(ends):
        chain = [int(node)]
        while chain[-1]:
            chain.append(int(parents[b, chain[-1]]))
        chains.append(chain[::-1])
    path = torch.zeros((len(ends), width or max(map(len, chains))), dtype=torch.int64)
    for b, chain in enumerate(chains):
        path[b, : len(chain)] = torch.tensor(chain)
    return path, torch.tensor([len(c) for c in chains])


def relabel_parents(parents: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Parents of the same trees with node perm[b, i] renamed i (perm[b, 0] must be 0)."""
    out = torch.full_like(parents, -1)
    for b in range(parents.shape[0]):
        inv = {old: new for new, old in enumerate(perm[b].tolist())}
        for new, old in enumerate(perm[b].tolist()):
            if old:
                out[b, new] = inv[int(parents[b, old])]
    return out


# --- Triton --------------------------------------------------------------------------------------


@triton.jit
def _load_qk(ptr, tok, i_h, H: tl.constexpr, K: tl.constexpr, o_k, mask_k, L2NORM: tl.constexpr):
    x = tl.load(ptr + (tok * H + i_h) * K + o_k, mask=mask_k, other=0).to(tl.float32)
    if L2NORM:
        x = x / tl.sqrt(tl.sum(x * x) + 1e-6)
    return x


@triton.jit
def _delta_update(b_h, b_k, b_v, b_g, b_beta):
    b_h *= tl.exp(b_g)
    b_v = (b_v - tl.sum(b_h * b_k[:, None], 0)) * b_beta
    return b_h + b_k[:, None] * b_v[None, :]


@triton.jit
def _advance(b_h, k, v, g, beta, tok, i_h, i_hv, o_k, o_v, mask_k, mask_v,
             H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
             L2NORM: tl.constexpr):  # fmt: skip
    """b_h advanced by token `tok` (its k, v, g and beta)."""
    b_k = _load_qk(k, tok, i_h, H, K, o_k, mask_k, L2NORM)
    b_v = tl.load(v + (tok * HV + i_hv) * V + o_v, mask=mask_v, other=0).to(tl.float32)
    b_g = tl.load(g + tok * HV + i_hv)
    b_beta = tl.load(beta + tok * HV + i_hv)
    return _delta_update(b_h, b_k, b_v, b_g, b_beta)


@triton.jit
def _tree_verify_kernel(
    q, k, v, g, beta, h0, parents, flags, o, scratch, scale, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
):  # fmt: skip
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    in_state = o_v[None, :] * K + o_k[:, None]  # [BK, BV] offsets into one [V, K] state
    b_h = tl.load(h0 + (i_n * HV + i_hv) * V * K + in_state, mask=mask_h, other=0).to(tl.float32)
    for t in range(0, N):
        tok = i_n * N + t
        parent = tl.load(parents + tok)
        if (t > 0) & (parent != t - 1):  # the state in registers is not the parent's
            src = scratch + ((i_n * N + parent) * HV + i_hv) * V * K + in_state
            b_h = tl.load(src, mask=mask_h, other=0)
        b_h = _advance(b_h, k, v, g, beta, tok, i_h, i_hv, o_k, o_v, mask_k, mask_v,
                       H, HV, K, V, L2NORM)  # fmt: skip
        b_q = _load_qk(q, tok, i_h, H, K, o_k, mask_k, L2NORM) * scale
        b_o = tl.sum(b_h * b_q[:, None], 0)
        tl.store(o + (tok * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
        if tl.load(flags + tok) != 0:  # a later node starts from this one's state
            dst = scratch + ((i_n * N + t) * HV + i_hv) * V * K + in_state
            tl.store(dst, b_h, mask=mask_h)


@triton.jit
def _replay_kernel(
    k, v, g, beta, h0, path, path_len, out, N, MAX_LEN,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
):  # fmt: skip
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    in_state = o_v[None, :] * K + o_k[:, None]
    b_h = tl.load(h0 + (i_n * HV + i_hv) * V * K + in_state, mask=mask_h, other=0).to(tl.float32)
    steps = tl.load(path_len + i_n)
    for i in range(0, MAX_LEN):
        if i < steps:
            tok = i_n * N + tl.load(path + i_n * MAX_LEN + i)
            b_h = _advance(b_h, k, v, g, beta, tok, i_h, i_hv, o_k, o_v, mask_k, mask_v,
                           H, HV, K, V, L2NORM)  # fmt: skip
    dst = out + (i_n * HV + i_hv) * V * K + in_state
    tl.store(dst, b_h.to(out.dtype.element_ty), mask=mask_h)


def _shapes(q, v, parents):
    bs, N = parents.shape
    T, H, K = q.shape
    _, HV, V = v.shape
    if T != bs * N or HV % H:
        raise ValueError(f"q {tuple(q.shape)} / v {tuple(v.shape)} do not fit {bs} x {N} nodes")
    return bs, N, H, HV, K, V


def _block_v(V: int) -> int:
    return min(32, triton.next_power_of_2(V))


def tree_verify(q, k, v, g, beta, h0, parents, *, scale: float, l2norm: bool = True):
    """(o [T, HV, V] in v's dtype, scratch [bs, N, HV, V, K] float32, written at
    `store_flags` nodes only). Same definition as `tree_verify_reference`. Sync-free."""
    bs, N, H, HV, K, V = _shapes(q, v, parents)
    q, k, v, g, beta, h0 = (x.contiguous() for x in (q, k, v, g, beta, h0))
    parents = parents.to(torch.int64).contiguous()
    flags = store_flags(parents)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    scratch = torch.empty((bs, N, HV, V, K), dtype=torch.float32, device=v.device)
    BV = _block_v(V)
    grid = (triton.cdiv(V, BV), bs * HV)
    _tree_verify_kernel[grid](
        q, k, v, g, beta, h0, parents, flags, o, scratch, float(scale), N,
        H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV, L2NORM=l2norm,
    )  # fmt: skip
    return o, scratch


def replay_path(k, v, g, beta, h0, path, path_len, *, l2norm: bool = True, out=None):
    """h0 [bs, HV, V, K] advanced by the nodes path[b, :path_len[b]] (node indices, root first)
    into `out` (a new tensor in h0's dtype if None; h0 itself is allowed). Sync-free."""
    bs, MAX_LEN = path.shape
    N = k.shape[0] // bs
    _, HV, V = v.shape
    H, K = k.shape[1], k.shape[2]
    k, v, g, beta = (x.contiguous() for x in (k, v, g, beta))
    out = torch.empty_like(h0) if out is None else out
    BV = _block_v(V)
    grid = (triton.cdiv(V, BV), bs * HV)
    _replay_kernel[grid](
        k, v, g, beta, h0.contiguous(), path.to(torch.int64).contiguous(),
        path_len.to(torch.int64).contiguous(), out, N, MAX_LEN,
        H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV, L2NORM=l2norm,
    )  # fmt: skip
    return out

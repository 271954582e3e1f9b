"""Plain-torch definitions of the Gated DeltaNet tree verify (the kernels in tree_verify.py and
chunk_tree.py are tested against them), in SGLang's conventions: q and k l2-normalised, q
scaled, g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b) in float32, states
[HV, V, K]; and the root-path helpers the tests and benchmarks share.
"""

from __future__ import annotations

import torch


def _prepare(q, k, h, l2norm: bool, scale: float, dtype=torch.float32):
    """[H, K] q, k (in `dtype`) expanded to the HV value heads, normalised and scaled as SGLang
    does."""
    q, k = q.to(dtype), k.to(dtype)
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    group = h // q.shape[0]
    return (q * scale).repeat_interleave(group, 0), k.repeat_interleave(group, 0)


def _update(state, k, v, g, beta):
    """One token: state [HV, V, K] float32, k [HV, K], v [HV, V], g / beta [HV]."""
    state = state * torch.exp(g)[:, None, None]
    v_new = (v.to(state.dtype) - (state * k[:, None, :]).sum(-1)) * beta[:, None]
    return state + v_new[:, :, None] * k[:, None, :]


def gdn_gating(A_log, a, b, dt_bias) -> tuple[torch.Tensor, torch.Tensor]:
    """(g [T, HV], beta [T, HV]) float32 from the layer's A_log, dt_bias [HV] and the token's a,
    b [T, HV], as SGLang's fused verify kernel forms them in float32 (softplus with beta 1 and
    threshold 20). SGLang's standalone `fused_gdn_gating` rounds beta to b's dtype instead."""
    x = a.float() + dt_bias.float()
    softplus = torch.where(x <= 20.0, torch.log(1.0 + torch.exp(x)), x)
    return -torch.exp(A_log.float()) * softplus, 1.0 / (1.0 + torch.exp(-b.float()))


def tree_verify_reference(
    q, k, v, g, beta, h0, parents, *, scale: float, l2norm: bool = True, dtype=torch.float32
):
    """(o [T, HV, V], states [bs, N, HV, V, K], both in `dtype`): node t starts from its
    parent's state (node 0, the root, from h0 [bs, HV, V, K]); parents [bs, N] with
    parents[:, 0] ignored. float64 makes it the referee of the float32 kernels."""
    bs, N = parents.shape
    HV = v.shape[1]
    o = torch.empty(v.shape, dtype=dtype)
    states = torch.empty((bs, N, *h0.shape[1:]), dtype=dtype)
    for b in range(bs):
        for t in range(N):
            tok = b * N + t
            start = h0[b].to(dtype) if t == 0 else states[b, int(parents[b, t])]
            qq, kk = _prepare(q[tok], k[tok], HV, l2norm, scale, dtype)
            states[b, t] = _update(start, kk, v[tok], g[tok].to(dtype), beta[tok].to(dtype))
            o[tok] = (states[b, t] * qq[:, None, :]).sum(-1)
    return o, states


def root_path(parents: torch.Tensor, b: int, node: int) -> list[int]:
    """Request b's node indices from the root (node 0) down to `node`."""
    chain = [int(node)]
    while chain[-1]:
        chain.append(int(parents[b, chain[-1]]))
    return chain[::-1]


def max_path_len(parents: torch.Tensor) -> int:
    """The longest root path (nodes, root included) among the trees: the kernels' `max_path`
    must be at least this (DDTREE: the DFlash block size B)."""
    return max(
        len(root_path(parents, b, t)) for b in range(len(parents)) for t in range(parents.shape[1])
    )

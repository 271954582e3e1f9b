"""Gated DeltaNet over a token tree in the chunked (WY) form: every node at once with
tensor-core matmuls, in two launches (the N x N factors per (request, value head), then the
state tiles per (request, value head, V tile)).

Along any root path the gated delta rule is a chain, so the chunked form that prefill uses
(flash-linear-attention's `chunk_gated_delta_rule`) holds for a whole tree once the causal mask
becomes the ancestor mask. With nodes in parent-before-child order, S0 the pre-verify state
[K, V] (SGLang stores it transposed, [V, K]), G_i the sum of the gates g over i's root path
(i included), D[i, j] = exp(G_i - G_j) for j an ancestor-or-self of i (else 0), k and q
l2-normalised and q scaled:

    A = diag(beta) (K K^T ⊙ D), strictly below the diagonal (j a strict ancestor of i)
    U = (I + A)^-1 diag(beta) (V - diag(exp G) K S0)        each node's delta-rule update
    O = diag(exp G) Q S0 + (Q K^T ⊙ D) U

which is the recurrence h <- exp(g) h; h <- h + k (beta (v - h^T k))^T; o = h^T q along every
root path at once (`tree_verify_reference`, the node-by-node definition, is what the tests
hold it to). A is nilpotent of the tree's depth d (a product of A's walks up ancestor chains),
so (I + A)^-1 = I - A + A^2 - ... = (I - A)(I + A^2)(I + A^4)..., log2(d) doublings of N x N x N
products (`_unit_inverse`), and O = diag(exp G) Q S0 + W R with W = (Q K^T ⊙ D) (I + A)^-1 and
R = diag(beta) (V - diag(exp G) K S0).

Two launches per layer. `_chunk_factors_kernel`, one program per (request, value head): the
Gram matrices and the inverse (N x N x K and N x N x N products), W and the per-node factors
(written to a small buffer, [bs x HV, NP, NP] floats); `_chunk_out_kernel`, one program per
(request, value head, V tile): two N x K x BV products with the state and one N x N x BV, so S0
is read once and no state is written. Split so that the state tiles, most of the work, run in
many small programs beside each other instead of behind the N x N work of their head. The
commit is unchanged: the same per-node scratch (g, beta, raw k, v) as
`tree_verify.tree_verify`, read by `tree_verify.commit_paths`, which replays the accepted path
node by node (the exact recurrence, so the pool holds the state the chain would have).
N <= MAX_NODES.

Precision: one tf32 pass per product left the outputs 1.5e-3 of their largest entry from the
float64 recurrence on the H200, against 2e-7 for the root-path kernel; the GPU
suite's greedy test on a hybrid model failed with it. So by default ("split") every float32
operand is split into a tf32-exact high part and a remainder and each product takes the three
tf32 passes that matter (`_mm`); the model's bf16 q and k are exact in tf32 and keep one part.
q and k enter the products raw: their l2 norms scale the products' rows and columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_ddtree.gdn.tree_verify import _scratch_offsets, verify_shapes

MAX_NODES = 64  # [N, N] fp32 tiles in registers; wider trees use tree_verify's root paths
# how the float32 products run; servers use "split", the others are for kernel comparisons
# (tests/unit/test_gdn_tree_verify.py, scripts/bench_gdn_tree.py, tests/gpu/server_debug)
PRECISIONS = ("split", "tf32", "tf32x3", "ieee")


@triton.jit
def _ancestors(parents, row, N, NP: tl.constexpr, MAX_PATH: tl.constexpr):
    """[NP, NP] bool: [i, j] = node j is i or an ancestor of i (row i of node i's root path),
    from parents[row + .]; entries outside [0, N) are clamped and j > i is never set, so a
    warm-up or padding row gives a finite answer whatever its parents hold."""
    o_n = tl.arange(0, NP)
    live = o_n < N
    anc = o_n[:, None] == o_n[None, :]
    cur = o_n
    for _ in range(MAX_PATH - 1):
        parent = tl.load(parents + row + tl.maximum(cur, 1), mask=live, other=0).to(tl.int32)
        cur = tl.where(cur > 0, tl.minimum(tl.maximum(parent, 0), N - 1), 0)
        anc = anc | (o_n[None, :] == cur[:, None])
    return anc & (o_n[None, :] <= o_n[:, None]) & live[:, None] & live[None, :]


@triton.jit
def _load_heads(ptr, row, N, i_h, H: tl.constexpr, K: tl.constexpr, NP: tl.constexpr,
                BK: tl.constexpr):  # fmt: skip
    """(raw float32 [NP, BK], 1 / l2 norm [NP]) of the request's nodes' q or k, key head i_h."""
    o_n, o_k = tl.arange(0, NP), tl.arange(0, BK)
    m = (o_n < N)[:, None] & (o_k < K)[None, :]
    x = tl.load(ptr + ((row + o_n)[:, None] * H + i_h) * K + o_k[None, :], mask=m, other=0)
    x = x.to(tl.float32)
    return x, 1.0 / tl.sqrt(tl.sum(x * x, 1) + 1e-6)


@triton.jit
def _tf32_part(x):
    """x with its low 13 mantissa bits cleared: exactly representable in tf32."""
    return (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _mm(a, b, A_EXACT: tl.constexpr, B_EXACT: tl.constexpr, DOT: tl.constexpr):
    """a @ b of float32 tiles. DOT="split": each operand as hi + lo with hi exact in tf32, and
    the three tf32 tensor-core products that matter (hi hi + hi lo + lo hi; the dropped lo x lo
    term is below 2^-20 of |a| |b|); an operand known to be exact in tf32 (A_EXACT, B_EXACT:
    the model's own bf16 q and k) keeps one part. Else one tl.dot at that input precision
    ("tf32", "tf32x3", "ieee")."""
    if DOT == "split":
        a1 = a if A_EXACT else _tf32_part(a)
        b1 = b if B_EXACT else _tf32_part(b)
        out = tl.dot(a1, b1, input_precision="tf32")
        if not B_EXACT:
            out += tl.dot(a1, b - b1, input_precision="tf32")
        if not A_EXACT:
            out += tl.dot(a - a1, b1, input_precision="tf32")
        return out
    else:
        return tl.dot(a, b, input_precision=DOT)


@triton.jit
def _gates(a, b, A_log, dt_bias, tok, live, i_hv, stride_a, stride_b):
    """(g, beta) [NP] of the nodes, as SGLang's fused verify kernel forms them (float32,
    softplus threshold 20); 0 for the padding nodes."""
    x = tl.load(a + tok * stride_a + i_hv, mask=live, other=0).to(tl.float32)
    x += tl.load(dt_bias + i_hv).to(tl.float32)
    softplus = tl.where(x <= 20.0, tl.log(1.0 + tl.exp(x)), x)
    g = -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * softplus
    b_b = tl.load(b + tok * stride_b + i_hv, mask=live, other=0).to(tl.float32)
    return tl.where(live, g, 0.0), tl.where(live, 1.0 / (1.0 + tl.exp(-b_b)), 0.0)


@triton.jit
def _unit_inverse(A, NP: tl.constexpr, LOG: tl.constexpr, DOT: tl.constexpr):
    """(I + A)^-1 for A strictly lower-triangular with A^(2^LOG) = 0: the product
    (I - A)(I + A^2)(I + A^4)...(I + A^(2^(LOG-1))), i.e. 1 - A + A^2 - ... by doubling
    (2 (LOG - 1) NP x NP x NP products instead of a solve step per depth level)."""
    o_n = tl.arange(0, NP)
    T = tl.where(o_n[:, None] == o_n[None, :], 1.0, 0.0) - A
    X = A
    for _ in tl.static_range(1, LOG):
        X = _mm(X, X, False, False, DOT)
        T += _mm(X, T, False, False, DOT)
    return T


@triton.jit
def _chunk_factors_kernel(
    q, k, a, b, A_log, dt_bias, parents, scratch, scratch_idx, scratch_stride, w, c, scale, N,
    stride_a, stride_b,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, NP: tl.constexpr,
    MAX_PATH: tl.constexpr, LOG: tl.constexpr, QK_BF16: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """Per (request, value head): everything that does not touch the state or v, the N x N
    part. w[., NP, NP] = (Q K^T o D) (I + A)^-1 diag(beta) and c[., 2, NP] = (exp(G) / |k|,
    exp(G) scale / |q|) per node, for `_chunk_out_kernel`; g, beta and raw k into the commit's
    scratch."""
    i_nh = tl.program_id(0)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    row = i_n * N
    o_n, o_k = tl.arange(0, NP), tl.arange(0, BK)
    live = o_n < N
    anc = _ancestors(parents, row, N, NP, MAX_PATH)
    g, beta = _gates(a, b, A_log, dt_bias, row + o_n, live, i_hv, stride_a, stride_b)
    G = tl.sum(tl.where(anc, g[None, :], 0.0), 1)  # [NP] log decay from S0 to after node i
    decay = tl.exp(tl.where(anc, G[:, None] - G[None, :], float("-inf")))  # D, 0 off the paths

    # raw q and k (exact in tf32 when the model's are bf16: QK_BF16); their l2 norms and the
    # scale scale the products' rows and columns
    raw_k, rk = _load_heads(k, row, N, i_h, H, K, NP, BK)
    raw_q, rq = _load_heads(q, row, N, i_h, H, K, NP, BK)
    rq = rq * scale
    kt = tl.trans(raw_k)
    strict = anc & (o_n[None, :] < o_n[:, None])
    gram = _mm(raw_k, kt, QK_BF16, QK_BF16, DOT) * rk[:, None] * rk[None, :]
    A = tl.where(strict, gram * decay * beta[:, None], 0.0)
    P = _mm(raw_q, kt, QK_BF16, QK_BF16, DOT) * rq[:, None] * rk[None, :] * decay
    W = _mm(P, _unit_inverse(A, NP, LOG, DOT), False, False, DOT) * beta[None, :]
    base = i_nh.to(tl.int64) * NP
    tl.store(w + (base + o_n[:, None]) * NP + o_n[None, :], W)
    gamma = tl.exp(G)
    tl.store(c + 2 * base + o_n, gamma * rk)
    tl.store(c + 2 * base + NP + o_n, gamma * rq)

    # the commit's scratch (tree_verify.scratch_floats): g, beta, raw k per value head
    x_row = scratch + tl.load(scratch_idx + i_n).to(tl.int64) * scratch_stride
    x_beta, x_k, _ = _scratch_offsets(N, HV, K)
    tl.store(x_row + o_n * HV + i_hv, g, mask=live)
    tl.store(x_row + x_beta + o_n * HV + i_hv, beta, mask=live)
    m_nk = live[:, None] & (o_k < K)[None, :]
    tl.store(x_row + x_k + (o_n[:, None] * HV + i_hv) * K + o_k[None, :], raw_k, mask=m_nk)


@triton.jit
def _chunk_out_kernel(
    q, k, v, state, state_idx, state_stride, scratch, scratch_idx, scratch_stride, w, c, o, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NP: tl.constexpr, QK_BF16: tl.constexpr,
    DOT: tl.constexpr,
):  # fmt: skip
    """Per (request, value head, V tile): O = diag(c_q) Q S0 + W (V - diag(c_k) K S0) with the
    factors of `_chunk_factors_kernel`; v into the commit's scratch. Reads S0 once."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    row = i_n * N
    o_n, o_k = tl.arange(0, NP), tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    live, mask_k, mask_v = o_n < N, o_k < K, o_v < V
    raw_k = _load_heads(k, row, N, i_h, H, K, NP, BK)[0]
    raw_q = _load_heads(q, row, N, i_h, H, K, NP, BK)[0]
    base = i_nh.to(tl.int64) * NP
    W = tl.load(w + (base + o_n[:, None]) * NP + o_n[None, :])
    c_k = tl.load(c + 2 * base + o_n)
    c_q = tl.load(c + 2 * base + NP + o_n)

    slot = tl.load(state_idx + i_n).to(tl.int64)
    h0 = tl.zeros([BK, BV], dtype=tl.float32)
    if slot >= 0:  # SGLang pads a graph batch with slot -1
        src = state + slot * state_stride + i_hv * V * K + o_v[None, :] * K + o_k[:, None]
        h0 = tl.load(src, mask=mask_k[:, None] & mask_v[None, :], other=0).to(tl.float32)
    tok = row + o_n
    m_nv = live[:, None] & mask_v[None, :]
    b_v = tl.load(v + (tok[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_nv, other=0)
    b_v = b_v.to(tl.float32)
    R = b_v - c_k[:, None] * _mm(raw_k, h0, QK_BF16, False, DOT)
    out = c_q[:, None] * _mm(raw_q, h0, QK_BF16, False, DOT) + _mm(W, R, False, False, DOT)
    tl.store(o + (tok[:, None] * HV + i_hv) * V + o_v[None, :], out.to(o.dtype.element_ty),
             mask=m_nv)  # fmt: skip
    x_row = scratch + tl.load(scratch_idx + i_n).to(tl.int64) * scratch_stride
    x_v = _scratch_offsets(N, HV, K)[2]
    tl.store(x_row + x_v + (o_n[:, None] * HV + i_hv) * V + o_v[None, :], b_v, mask=m_nv)


def chunk_tree_verify(q, k, v, a, b, A_log, dt_bias, state, state_idx, parents, scratch,
                      scratch_idx, *, max_path: int, scale: float | None = None,
                      block_v: int | None = None, num_warps: int | None = None,
                      precision: str = "split") -> torch.Tensor:  # fmt: skip
    """`tree_verify.tree_verify`'s contract (same arguments, outputs and scratch), computed in
    the chunked form: o [T, HV, V] (q's dtype) for bs trees of N <= MAX_NODES nodes whose
    parents come before their children (parents [bs, N]; T = bs * N, request-major; root paths
    of at most `max_path` nodes), from state[state_idx[b]] ([S, HV, V, K], unchanged; slot -1
    starts from zeros). precision: how the float32 products run on tensor cores, "split" (hi +
    lo tf32 parts, `_mm`) or one tl.dot at "tf32", "tf32x3" or "ieee". block_v / num_warps: the
    state kernel's V tile and warps (the factors kernel runs 4 warps; not swept yet). Sync-free,
    CUDA-graph safe."""
    bs, N, H, K, HV, V = verify_shapes(q, k, v, parents, state, scratch)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if N > MAX_NODES:
        raise ValueError(f"chunk_tree_verify takes at most {MAX_NODES} nodes, got {N}")
    q, k, v = (x.contiguous() for x in (q, k, v))
    a, b = (x if x.stride(-1) == 1 else x.contiguous() for x in (a, b))
    o = torch.empty(v.shape, dtype=q.dtype, device=v.device)
    NP = max(16, triton.next_power_of_2(N))  # tl.dot's smallest tile
    w = torch.empty((bs * HV, NP, NP), dtype=torch.float32, device=v.device)
    c = torch.empty((bs * HV, 2, NP), dtype=torch.float32, device=v.device)
    max_path2 = triton.next_power_of_2(max_path)  # one compiled kernel per power of two
    BK = max(16, triton.next_power_of_2(K))
    scale = float(K**-0.5 if scale is None else scale)
    qk_bf16 = q.dtype == torch.bfloat16
    _chunk_factors_kernel[(bs * HV,)](
        q, k, a, b, A_log, dt_bias, parents, scratch, scratch_idx, scratch.stride(0), w, c,
        scale, N, a.stride(0), b.stride(0),
        H=H, HV=HV, K=K, BK=BK, NP=NP, MAX_PATH=max_path2,
        LOG=max(1, (max_path2 - 1).bit_length()), QK_BF16=qk_bf16, DOT=precision, num_warps=4,
    )  # fmt: skip
    # 64 x 4 warps: the fastest V tile of bench_gdn_tree's H200 sweep (16 / 32 / 64 x 4) at
    # every (bs, N) in {1, 8, 16} x {16, 32, 64} but batch 1 (within 5 % there)
    BV = block_v or min(64, max(16, triton.next_power_of_2(V)))
    _chunk_out_kernel[(triton.cdiv(V, BV), bs * HV)](
        q, k, v, state, state_idx, state.stride(0), scratch, scratch_idx, scratch.stride(0),
        w, c, o, N,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, NP=NP, QK_BF16=qk_bf16, DOT=precision,
        num_warps=num_warps or 4,
    )  # fmt: skip
    return o

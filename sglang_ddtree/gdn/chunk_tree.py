"""Gated DeltaNet over a token tree in the chunked (WY) form: every node at once with
tensor-core matmuls, in [64, 64] register tiles: one block of nodes for N <= 64 (two launches),
up to four blocks for N <= MAX_NODES = 256 (three launches).

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

One block (N <= 64), two launches per layer. `_chunk_factors_kernel`, one program per (request,
value head): the Gram matrices and the inverse (N x N x K and N x N x N products), W and the
per-node factors (written to a small buffer, [bs x HV, NP, NP] floats); `_chunk_out_kernel`,
one program per (request, value head, V tile): two N x K x BV products with the state and one
N x N x BV, so S0 is read once and no state is written. Split so that the state tiles, most of
the work, run in many small programs beside each other instead of behind the N x N work of
their head.

Blocks (64 < N <= 256): the nodes in NB = ceil(N / 64) blocks of BN = 64 (a parent comes before
its child, so every matrix above is block lower triangular), only [BN, BN] and [BN, K] tiles,
three launches, each one program per (block, ...) to give a narrow batch more programs:
- `_blocks_diag_kernel` per (block c, request, value head): G and beta of the block's nodes,
  their root paths as bit masks (one int64 word per block: bit j of word c = node c BN + j is on
  the path; root paths cross blocks), and T_cc = (I + A_cc)^-1 of the diagonal block (its depth
  is at most min(BN, the longest root path): the doubling above).
- `_blocks_factors_kernel` per (row block b, request, value head): row block b of W by back
  substitution, W (I + A) = (Q K^T ⊙ D) diag(beta) read column block by column block,
      W_bc = (P_bc - sum_{c<e<=b} W_be Γ_ec) T_cc diag(beta_c),   c = b, b - 1, ..., 0,
  with P = Q K^T ⊙ D and Γ = K K^T ⊙ D on the strict ancestors (A = diag(beta) Γ), so a row
  block needs only its own W and the others' T_cc; and Qe_b = diag(exp G) Q_b - sum_c W_bc
  diag(exp G) K_c, which moves the K S0 term of R onto the query side once per head
  (O = Qe S0 + W V) instead of once per (row block, V tile, column block).
- `_blocks_out_kernel` per (row block b, V tile, request, value head): O_b = Qe_b S0 +
  sum_{c<=b} W_bc V_c. Row blocks are the fastest grid axis: the programs that read one S0
  tile run together, so that they can share it through L2.
The factors go through a scratch of [bs x HV] x (NB T_cc + NB (NB + 1) / 2 W_bc blocks of
BN x BN, Qe [NB BN, K], G and beta) floats; the single block keeps its two launches, buffers
and arithmetic (through the helpers it shares with the blocks). Per head at N = 4 BN the
products are: 4 K K^T blocks and 4 inverses (2 (LOG - 1) BN^3 each); 10 P, 10 Γ (the 6 blocks
below the diagonal, each recomputed by every row block that needs it), 10 W Γ, 10 T and 10
W K; per V tile 4 Qe S0 and 10 W V.

The commit is unchanged: the same per-node scratch (g, beta, raw k, v) as
`tree_verify.tree_verify`, read by `tree_verify.commit_paths`, which replays the accepted path
node by node (the exact recurrence, so the pool holds the state the chain would have).

Precision: one tf32 pass per product left the outputs 1.5e-3 of their largest entry from the
float64 recurrence on the H200, against 2e-7 for the root-path kernel; the GPU
suite's greedy test on a hybrid model failed with it. So by default ("split") every float32
operand is split into a tf32-exact high part and a remainder and each product takes the three
tf32 passes that matter (`_mm`); the model's bf16 q, k (and v, in the blocks' W V) are exact in
tf32 and keep one part. q and k enter the products raw: their l2 norms scale the products'
rows and columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_ddtree.gdn.tree_verify import _scratch_offsets, verify_shapes

BLOCK_NODES = 64  # one block: [64, 64] fp32 tiles in registers, one int64 word of a root path
MAX_NODES = 4 * BLOCK_NODES  # the widest tree: 4 blocks (the W scratch grows with their square)
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
def _log_gate(a, A_log, dt_bias, tok, live, i_hv, stride_a):
    """g [.] of the tokens: -exp(A_log) softplus(a + dt_bias), as SGLang's fused verify kernel
    forms it (float32, softplus threshold 20); 0 where not live."""
    x = tl.load(a + tok * stride_a + i_hv, mask=live, other=0).to(tl.float32)
    x += tl.load(dt_bias + i_hv).to(tl.float32)
    softplus = tl.where(x <= 20.0, tl.log(1.0 + tl.exp(x)), x)
    return tl.where(live, -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * softplus, 0.0)


@triton.jit
def _gates(a, b, A_log, dt_bias, tok, live, i_hv, stride_a, stride_b):
    """(g, beta) [NP] of the nodes (beta = sigmoid(b) in float32); 0 for the padding nodes."""
    g = _log_gate(a, A_log, dt_bias, tok, live, i_hv, stride_a)
    b_b = tl.load(b + tok * stride_b + i_hv, mask=live, other=0).to(tl.float32)
    return g, tl.where(live, 1.0 / (1.0 + tl.exp(-b_b)), 0.0)


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
def _store_commit_inputs(scratch, scratch_idx, scratch_stride, i_n, nodes, live, i_hv, g,
                         beta, raw_k, N, HV: tl.constexpr, K: tl.constexpr,
                         BK: tl.constexpr):  # fmt: skip
    """The commit's scratch (tree_verify.scratch_floats): g, beta, raw k of the nodes, value
    head i_hv."""
    o_k = tl.arange(0, BK)
    x_row = scratch + tl.load(scratch_idx + i_n).to(tl.int64) * scratch_stride
    x_beta, x_k, _ = _scratch_offsets(N, HV, K)
    tl.store(x_row + nodes * HV + i_hv, g, mask=live)
    tl.store(x_row + x_beta + nodes * HV + i_hv, beta, mask=live)
    m_nk = live[:, None] & (o_k < K)[None, :]
    tl.store(x_row + x_k + (nodes[:, None] * HV + i_hv) * K + o_k[None, :], raw_k, mask=m_nk)


@triton.jit
def _load_state(state, state_idx, state_stride, i_n, i_hv, o_v, mask_v, V: tl.constexpr,
                K: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    """S0 [BK, BV] float32 of request i_n, value head i_hv, V columns o_v (zeros for slot -1:
    SGLang pads a graph batch with it)."""
    o_k = tl.arange(0, BK)
    slot = tl.load(state_idx + i_n).to(tl.int64)
    h0 = tl.zeros([BK, BV], dtype=tl.float32)
    if slot >= 0:
        src = state + slot * state_stride + i_hv * V * K + o_v[None, :] * K + o_k[:, None]
        h0 = tl.load(src, mask=(o_k < K)[:, None] & mask_v[None, :], other=0).to(tl.float32)
    return h0


@triton.jit
def _load_values(v, row, i0, N, i_hv, o_v, mask_v, HV: tl.constexpr, V: tl.constexpr,
                 BN: tl.constexpr):  # fmt: skip
    """(v [BN, BV] float32 of nodes i0 + ., V columns o_v; the mask of the live entries)."""
    nodes = i0 + tl.arange(0, BN)
    m_nv = (nodes < N)[:, None] & mask_v[None, :]
    b_v = tl.load(v + ((row + nodes)[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_nv, other=0)
    return b_v.to(tl.float32), m_nv


@triton.jit
def _store_rows(o, v, scratch, scratch_idx, scratch_stride, out, b_v, m_nv, i_n, row, i0, N,
                i_hv, o_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BN: tl.constexpr):  # fmt: skip
    """Nodes i0 + .'s outputs (o's dtype) and their v into the commit's scratch."""
    nodes = i0 + tl.arange(0, BN)
    dst = o + ((row + nodes)[:, None] * HV + i_hv) * V + o_v[None, :]
    tl.store(dst, out.to(o.dtype.element_ty), mask=m_nv)
    x_row = scratch + tl.load(scratch_idx + i_n).to(tl.int64) * scratch_stride
    x_v = _scratch_offsets(N, HV, K)[2]
    tl.store(x_row + x_v + (nodes[:, None] * HV + i_hv) * V + o_v[None, :], b_v, mask=m_nv)


# --- one block: N <= BLOCK_NODES -----------------------------------------------------------------


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
    o_n = tl.arange(0, NP)
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
    _store_commit_inputs(scratch, scratch_idx, scratch_stride, i_n, o_n, live, i_hv, g, beta,
                         raw_k, N, HV, K, BK)  # fmt: skip


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
    o_n = tl.arange(0, NP)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_v = o_v < V
    raw_k = _load_heads(k, row, N, i_h, H, K, NP, BK)[0]
    raw_q = _load_heads(q, row, N, i_h, H, K, NP, BK)[0]
    base = i_nh.to(tl.int64) * NP
    W = tl.load(w + (base + o_n[:, None]) * NP + o_n[None, :])
    c_k = tl.load(c + 2 * base + o_n)
    c_q = tl.load(c + 2 * base + NP + o_n)
    h0 = _load_state(state, state_idx, state_stride, i_n, i_hv, o_v, mask_v, V, K, BK, BV)
    b_v, m_nv = _load_values(v, row, 0, N, i_hv, o_v, mask_v, HV, V, NP)
    R = b_v - c_k[:, None] * _mm(raw_k, h0, QK_BF16, False, DOT)
    out = c_q[:, None] * _mm(raw_q, h0, QK_BF16, False, DOT) + _mm(W, R, False, False, DOT)
    _store_rows(o, v, scratch, scratch_idx, scratch_stride, out, b_v, m_nv, i_n, row, 0, N,
                i_hv, o_v, HV, K, V, NP)  # fmt: skip


# --- blocks: BLOCK_NODES < N <= MAX_NODES --------------------------------------------------------


@triton.jit
def _walk_block(a, A_log, dt_bias, parents, row, N, i0, i_hv, stride_a, BN: tl.constexpr,
                NBP: tl.constexpr, MAX_PATH: tl.constexpr):  # fmt: skip
    """(G [BN], words [BN, NBP] int64) of nodes i0 + .: G the sum of g over each one's root path
    (itself included), bit j of words[i, c] set where node c * BN + j is on it. A parent outside
    [0, node) (a warm-up or padding row's garbage) is clamped into it, so every row is a tree
    and every read stays in it; padding nodes have no path."""
    cur = i0 + tl.arange(0, BN)
    on = cur < N
    o_w = tl.arange(0, NBP)
    words = tl.zeros([BN, NBP], dtype=tl.int64)
    G = tl.zeros([BN], dtype=tl.float32)
    for _ in range(MAX_PATH):
        G += _log_gate(a, A_log, dt_bias, row + cur, on, i_hv, stride_a)
        bit = tl.full([BN], 1, tl.int64) << (cur % BN).to(tl.int64)
        words |= tl.where(on[:, None] & (o_w[None, :] == (cur // BN)[:, None]), bit[:, None], 0)
        parent = tl.load(parents + row + tl.maximum(cur, 1), mask=on, other=0).to(tl.int32)
        on = on & (cur > 0)
        cur = tl.where(on, tl.minimum(tl.maximum(parent, 0), cur - 1), 0)
    return G, words


@triton.jit
def _on_paths(word, BN: tl.constexpr):
    """[BN, BN] bool from a column block's words [BN] (`_walk_block`): [i, j] = bit j of word i."""
    shift = tl.arange(0, BN).to(tl.int64)
    return ((word[:, None] >> shift[None, :]) & 1) != 0


@triton.jit
def _decay(G_i, G_j):
    """D = exp(G_i - G_j) [BN, BN], at most 1 (its value on every ancestor pair of a tree whose
    root paths fit MAX_PATH; the cap keeps a padding row's off-path entries finite)."""
    return tl.exp(tl.minimum(G_i[:, None] - G_j[None, :], 0.0))


@triton.jit
def _tile(ptr, base, BN: tl.constexpr):
    """The [BN, BN] float32 tile at ptr + base * BN * BN (row-major); base int64."""
    o_n = tl.arange(0, BN)
    return ptr + (base * BN + o_n[:, None]) * BN + o_n[None, :]


@triton.jit
def _blocks_diag_kernel(
    k, a, b, A_log, dt_bias, parents, scratch, scratch_idx, scratch_stride, paths, inv, gb, N,
    stride_a, stride_b,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
    NB: tl.constexpr, NBP: tl.constexpr, MAX_PATH: tl.constexpr, LOG: tl.constexpr,
    QK_BF16: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """Per (block c, request, value head): gb[., 2, NB BN] = (G, beta) of the block's nodes,
    paths[request, node, NBP] their root-path words (value head 0 writes them), inv[., NB, BN,
    BN] = T_cc = (I + A_cc)^-1 of the diagonal block; g, beta and raw k into the commit's
    scratch."""
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    row, i0 = i_n * N, i_c * BN
    o_n, o_w = tl.arange(0, BN), tl.arange(0, NBP)
    nodes = i0 + o_n
    live = nodes < N
    G, words = _walk_block(a, A_log, dt_bias, parents, row, N, i0, i_hv, stride_a, BN, NBP,
                           MAX_PATH)  # fmt: skip
    if i_hv == 0:  # the tree is the request's, the same for every head
        tl.store(paths + (i_n * NB * BN + nodes)[:, None] * NBP + o_w[None, :], words)
    g, beta = _gates(a, b, A_log, dt_bias, row + nodes, live, i_hv, stride_a, stride_b)
    on_path = _on_paths(tl.sum(tl.where(o_w[None, :] == i_c, words, 0), 1), BN)
    raw_k, rk = _load_heads(k, row + i0, N - i0, i_h, H, K, BN, BK)
    gram = _mm(raw_k, tl.trans(raw_k), QK_BF16, QK_BF16, DOT) * rk[:, None] * rk[None, :]
    strict = on_path & (o_n[None, :] < o_n[:, None])
    A = tl.where(strict, gram * _decay(G, G) * beta[:, None], 0.0)
    head = i_nh.to(tl.int64)
    tl.store(_tile(inv, head * NB + i_c, BN), _unit_inverse(A, BN, LOG, DOT))
    tl.store(gb + head * 2 * NB * BN + nodes, G)
    tl.store(gb + (head * 2 + 1) * NB * BN + nodes, beta)
    _store_commit_inputs(scratch, scratch_idx, scratch_stride, i_n, nodes, live, i_hv, g, beta,
                         raw_k, N, HV, K, BK)  # fmt: skip


@triton.jit
def _blocks_factors_kernel(
    q, k, paths, inv, gb, w, qe, scale, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
    NB: tl.constexpr, NBP: tl.constexpr, QK_BF16: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """Per (row block b, request, value head): W_bc for c = b, ..., 0 by back substitution into
    w[., NB (NB + 1) / 2, BN, BN] (block (b, c) at b (b + 1) / 2 + c), and Qe_b = diag(exp G)
    Q_b scale / |q| - sum_c W_bc diag(exp G_c / |k_c|) K_c into qe[., NB BN, BK]."""
    i_b, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    row, i0 = i_n * N, i_b * BN
    o_n, o_k = tl.arange(0, BN), tl.arange(0, BK)
    head = i_nh.to(tl.int64)
    G_row, beta_row = gb + head * 2 * NB * BN, gb + (head * 2 + 1) * NB * BN
    path_row = paths + (i_n * NB * BN + o_n) * NBP  # + e * BN * NBP + c: block e's words on c
    w_row = head * (NB * (NB + 1) // 2) + i_b * (i_b + 1) // 2  # + c: block (b, c)
    raw_q, rq = _load_heads(q, row + i0, N - i0, i_h, H, K, BN, BK)
    rq = rq * scale
    G_b = tl.load(G_row + i0 + o_n)
    q_eff = raw_q * (tl.exp(G_b) * rq)[:, None]
    for cc in range(0, i_b + 1):
        c = i_b - cc
        raw_kc, rkc = _load_heads(k, row + c * BN, N - c * BN, i_h, H, K, BN, BK)
        kct = tl.trans(raw_kc)
        G_c = tl.load(G_row + c * BN + o_n)
        acc = _mm(raw_q, kct, QK_BF16, QK_BF16, DOT) * rq[:, None] * rkc[None, :]
        on_path = _on_paths(tl.load(path_row + i0 * NBP + c), BN)
        acc = tl.where(on_path, acc * _decay(G_b, G_c), 0.0)  # P_bc
        for e in range(c + 1, i_b + 1):  # - W_be Γ_ec, Γ recomputed here, W_be from this row
            raw_ke, rke = _load_heads(k, row + e * BN, N - e * BN, i_h, H, K, BN, BK)
            gram = _mm(raw_ke, kct, QK_BF16, QK_BF16, DOT) * rke[:, None] * rkc[None, :]
            on_path = _on_paths(tl.load(path_row + e * BN * NBP + c), BN)
            decay = _decay(tl.load(G_row + e * BN + o_n), G_c)
            W_be = tl.load(_tile(w, w_row + e, BN))
            acc -= _mm(W_be, tl.where(on_path, gram * decay, 0.0), False, False, DOT)
        T = tl.load(_tile(inv, head * NB + c, BN))
        W = _mm(acc, T, False, False, DOT) * tl.load(beta_row + c * BN + o_n)[None, :]
        tl.store(_tile(w, w_row + c, BN), W)
        tl.debug_barrier()  # the later column blocks read W_bc back (as W_be)
        q_eff -= _mm(W * (tl.exp(G_c) * rkc)[None, :], raw_kc, False, QK_BF16, DOT)
    tl.store(qe + (head * NB * BN + i0 + o_n)[:, None] * BK + o_k[None, :], q_eff)


@triton.jit
def _blocks_out_kernel(
    v, state, state_idx, state_stride, scratch, scratch_idx, scratch_stride, w, qe, o, N,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BN: tl.constexpr, NB: tl.constexpr, V_BF16: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """Per (row block b, V tile, request, value head): O_b = Qe_b S0 + sum_{c<=b} W_bc V_c with
    the factors of `_blocks_factors_kernel`; block b's v into the commit's scratch."""
    i_b, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_hv = i_nh // HV, i_nh % HV
    row, i0 = i_n * N, i_b * BN
    o_n, o_k = tl.arange(0, BN), tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_v = o_v < V
    head = i_nh.to(tl.int64)
    w_row = head * (NB * (NB + 1) // 2) + i_b * (i_b + 1) // 2
    h0 = _load_state(state, state_idx, state_stride, i_n, i_hv, o_v, mask_v, V, K, BK, BV)
    q_eff = tl.load(qe + (head * NB * BN + i0 + o_n)[:, None] * BK + o_k[None, :])
    out = _mm(q_eff, h0, False, False, DOT)
    for c in range(0, i_b + 1):
        b_v = _load_values(v, row, c * BN, N, i_hv, o_v, mask_v, HV, V, BN)[0]
        out += _mm(tl.load(_tile(w, w_row + c, BN)), b_v, False, V_BF16, DOT)
    b_v, m_nv = _load_values(v, row, i0, N, i_hv, o_v, mask_v, HV, V, BN)
    _store_rows(o, v, scratch, scratch_idx, scratch_stride, out, b_v, m_nv, i_n, row, i0, N,
                i_hv, o_v, HV, K, V, BN)  # fmt: skip


# --- launch --------------------------------------------------------------------------------------


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
    state kernel's V tile and warps (the factors kernels run 4 warps; not swept yet).
    Sync-free, CUDA-graph safe."""
    bs, N, H, K, HV, V = verify_shapes(q, k, v, parents, state, scratch)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if N > MAX_NODES:
        raise ValueError(f"chunk_tree_verify takes at most {MAX_NODES} nodes, got {N}")
    q, k, v = (x.contiguous() for x in (q, k, v))
    a, b = (x if x.stride(-1) == 1 else x.contiguous() for x in (a, b))
    o = torch.empty(v.shape, dtype=q.dtype, device=v.device)
    shapes = dict(
        H=H, HV=HV, K=K, BK=max(16, triton.next_power_of_2(K)), QK_BF16=q.dtype == torch.bfloat16,
        DOT=precision,
    )  # fmt: skip
    scale = float(K**-0.5 if scale is None else scale)
    inputs = (q, k, v, a, b, A_log, dt_bias, state, state_idx, parents, scratch, scratch_idx, o)
    # 64 x 4 warps: the fastest V tile of bench_gdn_tree's H200 sweep (16 / 32 / 64 x 4) at
    # every (bs, N) in {1, 8, 16} x {16, 32, 64} but batch 1 (within 5 % there)
    BV = block_v or min(64, max(16, triton.next_power_of_2(V)))
    launch = _one_block if N <= BLOCK_NODES else _blocks
    launch(inputs, bs, N, V, shapes, max_path, scale, BV, num_warps or 4)
    return o


def _one_block(inputs, bs, N, V, shapes, max_path, scale, BV, num_warps) -> None:
    """The two launches of N <= BLOCK_NODES nodes: one [NP, NP] tile per head."""
    q, k, v, a, b, A_log, dt_bias, state, state_idx, parents, scratch, scratch_idx, o = inputs
    HV = shapes["HV"]
    NP = max(16, triton.next_power_of_2(N))  # tl.dot's smallest tile
    w = torch.empty((bs * HV, NP, NP), dtype=torch.float32, device=v.device)
    c = torch.empty((bs * HV, 2, NP), dtype=torch.float32, device=v.device)
    max_path2 = triton.next_power_of_2(max_path)  # one compiled kernel per power of two
    _chunk_factors_kernel[(bs * HV,)](
        q, k, a, b, A_log, dt_bias, parents, scratch, scratch_idx, scratch.stride(0), w, c,
        scale, N, a.stride(0), b.stride(0),
        NP=NP, MAX_PATH=max_path2, LOG=max(1, (max_path2 - 1).bit_length()), num_warps=4,
        **shapes,
    )  # fmt: skip
    _chunk_out_kernel[(triton.cdiv(V, BV), bs * HV)](
        q, k, v, state, state_idx, state.stride(0), scratch, scratch_idx, scratch.stride(0),
        w, c, o, N, V=V, BV=BV, NP=NP, num_warps=num_warps, **shapes,
    )  # fmt: skip


def _blocks(inputs, bs, N, V, shapes, max_path, scale, BV, num_warps) -> None:
    """The three launches of BLOCK_NODES < N <= MAX_NODES nodes in NB blocks of BN (the module
    docstring): their scratch, the per-block inverses, the row blocks' factors, the outputs."""
    q, k, v, a, b, A_log, dt_bias, state, state_idx, parents, scratch, scratch_idx, o = inputs
    HV, BK, dev = shapes["HV"], shapes["BK"], v.device
    BN, NB = BLOCK_NODES, triton.cdiv(N, BLOCK_NODES)
    NBP = triton.next_power_of_2(NB)
    paths = torch.empty((bs, NB * BN, NBP), dtype=torch.int64, device=dev)  # root-path words
    inv = torch.empty((bs * HV, NB, BN, BN), dtype=torch.float32, device=dev)  # T_cc
    gb = torch.empty((bs * HV, 2, NB * BN), dtype=torch.float32, device=dev)  # G, beta
    w = torch.empty((bs * HV, NB * (NB + 1) // 2, BN, BN), dtype=torch.float32, device=dev)
    qe = torch.empty((bs * HV, NB * BN, BK), dtype=torch.float32, device=dev)
    max_path2 = triton.next_power_of_2(max_path)  # one compiled kernel per power of two
    depth = min(max_path2, BN)  # a diagonal block's longest chain
    blocks = dict(BN=BN, NB=NB)
    _blocks_diag_kernel[(NB, bs * HV)](
        k, a, b, A_log, dt_bias, parents, scratch, scratch_idx, scratch.stride(0), paths, inv,
        gb, N, a.stride(0), b.stride(0),
        NBP=NBP, MAX_PATH=max_path2, LOG=max(1, (depth - 1).bit_length()), num_warps=4,
        **blocks, **shapes,
    )  # fmt: skip
    _blocks_factors_kernel[(NB, bs * HV)](
        q, k, paths, inv, gb, w, qe, scale, N, NBP=NBP, num_warps=4, **blocks, **shapes,
    )  # fmt: skip
    _blocks_out_kernel[(NB, triton.cdiv(V, BV), bs * HV)](
        v, state, state_idx, state.stride(0), scratch, scratch_idx, scratch.stride(0), w, qe,
        o, N, HV=HV, K=shapes["K"], V=V, BK=BK, BV=BV, V_BF16=v.dtype == torch.bfloat16,
        DOT=shapes["DOT"], num_warps=num_warps, **blocks,
    )  # fmt: skip

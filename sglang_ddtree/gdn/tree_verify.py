"""Gated DeltaNet over a token tree, one root path per program, and the commit by replay.

SGLang's tree verify (`fused_sigmoid_gating_delta_rule_update` with the EAGLE parent
indices) walks a request's N nodes one after another in one program per (value head, V block),
storing every node's state so that the commit can copy the accepted one. At Qwen3.6-27B that is
N sequential steps per layer (64 for a 64-node tree against a chain's 16) and 3 MiB of state
written per node and layer. A tree's depth is at most the DFlash block B, though. Here:

- `tree_verify`: the tree is cut into segments, each a node that is not its parent's first
  child (or the root) followed by the first-child chain below it down to a leaf. One program per
  (segment, value head, V block) runs the recurrence along the whole root path of its leaf (at
  most B steps, all programs in parallel) and writes the outputs of its segment's nodes, so
  every node's output is written exactly once. No state is stored; instead each node's k, v,
  gate and beta go to a small per-request scratch (N x HV x (K + V + 2) floats, k per value
  head so that the commit needs no head grouping).
- `commit_paths`: the accepted path replayed from the pre-verify state with that scratch, for
  all layers in one launch, written into the state pool in place (and into the radix-cache
  track slot at the step SGLang's commit would snapshot).

The per-token math is SGLang's: q and k l2-normalised, q scaled by K^-0.5, g = -exp(A_log) *
softplus(a + dt_bias) (threshold 20) and beta = sigmoid(b) in float32, h *= exp(g), delta rule.
Layouts follow SGLang: q, k [T, H, K]; v [T, HV, V]; a, b [T, HV]; states [.., HV, V, K] with K
contiguous; T = bs * N tokens, request-major; parents [bs, N] local node indices (parents[:, 0]
is ignored). `gdn/reference.py` holds the plain-torch definitions the kernels are tested against
(tests/unit/test_gdn_tree_verify.py). The SGLang wiring is `state/gdn.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# --- scratch layout ------------------------------------------------------------------------------


def scratch_floats(N: int, HV: int, K: int, V: int) -> int:
    """Float32 words per request that `tree_verify` writes and `commit_paths` reads: per node and
    value head its g, beta, raw k [K] and v [V], in that order ([N, HV] blocks)."""
    return N * HV * (2 + K + V)


def as_scratch(buffer: torch.Tensor, rows_dims: int) -> torch.Tensor:
    """A [*rows, words] float32 view of a contiguous-per-row buffer whose first `rows_dims`
    dimensions index the rows (e.g. SGLang's intermediate-state buffer [slots, N, HV, V, K], any
    float dtype): the per-request scratch lives at the front of each row. No copy."""
    rows = buffer.shape[:rows_dims]
    flat = buffer.reshape(*rows, -1)
    if flat.stride(-1) != 1 or flat.shape[-1] * flat.element_size() % 4:
        raise ValueError(
            f"cannot view a {tuple(buffer.shape)} {buffer.dtype} buffer as scratch rows"
        )
    return flat.view(torch.float32)


# --- Triton --------------------------------------------------------------------------------------


@triton.jit
def _load_qk(ptr, tok, i_h, H: tl.constexpr, K: tl.constexpr, o_k, mask_k):
    """(raw, l2-normalised) float32 q or k of token `tok`, key head i_h."""
    x = tl.load(ptr + (tok * H + i_h) * K + o_k, mask=mask_k, other=0).to(tl.float32)
    return x, x / tl.sqrt(tl.sum(x * x) + 1e-6)


@triton.jit
def _scratch_offsets(N, HV: tl.constexpr, K: tl.constexpr):
    """(beta, k, v) offsets in a request's scratch row; g starts at 0 (`scratch_floats`)."""
    return N * HV, 2 * N * HV, 2 * N * HV + N * HV * K


@triton.jit
def _delta_update(b_h, b_k, b_v, b_g, b_beta):
    b_h *= tl.exp(b_g)
    b_v = (b_v - tl.sum(b_h * b_k[:, None], 0)) * b_beta
    return b_h + b_k[:, None] * b_v[None, :]


@triton.jit
def _path_to(parents, row, node, N, MAX_PATH: tl.constexpr):
    """(rev [MAX_PATH]: rev[j] = the node j steps above `node`, length of its root path): walks
    parents[row + .] up to node 0 (whose own parent entry is never read). Entries outside
    [0, N) (a warm-up or padding row) are clamped, so every read stays in the row."""
    o_p = tl.arange(0, MAX_PATH)
    rev = tl.zeros([MAX_PATH], dtype=tl.int32)
    length = 0
    cur = node
    live = 1
    for j in range(MAX_PATH):
        rev = tl.where((o_p == j) & (live != 0), cur, rev)
        length += live
        live = live * (cur != 0).to(tl.int32)
        parent = tl.load(parents + row + tl.maximum(cur, 1)).to(tl.int32)  # cur 0: unused
        cur = tl.where(cur != 0, tl.minimum(tl.maximum(parent, 0), N - 1), 0)
    return rev, length


@triton.jit
def _tree_verify_kernel(
    q, k, v, a, b, A_log, dt_bias, state, state_idx, state_stride, parents,
    scratch, scratch_idx, scratch_stride, o, scale, N, stride_a, stride_b,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NP: tl.constexpr, MAX_PATH: tl.constexpr,
):  # fmt: skip
    i_v, i_nh, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    row = i_n * N
    # Segment start: the root or a node that is not its parent's first (lowest-index) child.
    o_n = tl.arange(0, NP)
    par = tl.load(parents + row + o_n, mask=o_n < N, other=-2).to(tl.int32)
    par = tl.where(o_n == 0, -1, par)
    p = tl.sum(tl.where(o_n == s, par, 0))
    if (s > 0) & (tl.min(tl.where(par == p, o_n, NP)) == s):
        return
    leaf = s  # down the first-child chain: the segment is s .. leaf
    seg = 1
    for _step in range(MAX_PATH):
        child = tl.min(tl.where(par == leaf, o_n, NP))
        seg += (child < NP).to(tl.int32)
        leaf = tl.where(child < NP, child, leaf)
    rev, length = _path_to(parents, row, leaf, N, MAX_PATH)
    o_p = tl.arange(0, MAX_PATH)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    slot = tl.load(state_idx + i_n).to(tl.int64)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if slot >= 0:  # SGLang pads a graph batch with slot -1
        src = state + slot * state_stride + i_hv * V * K + o_v[None, :] * K + o_k[:, None]
        b_h = tl.load(src, mask=mask_h, other=0).to(tl.float32)
    neg_a = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    dtb = tl.load(dt_bias + i_hv).to(tl.float32)
    x_row = scratch + tl.load(scratch_idx + i_n).to(tl.int64) * scratch_stride
    x_beta, x_k, x_v = _scratch_offsets(N, HV, K)
    for i in range(MAX_PATH):
        if i < length:
            node = tl.sum(tl.where(o_p == length - 1 - i, rev, 0))
            tok = row + node
            raw_k, b_k = _load_qk(k, tok, i_h, H, K, o_k, mask_k)
            b_v = tl.load(v + (tok * HV + i_hv) * V + o_v, mask=mask_v, other=0).to(tl.float32)
            x = tl.load(a + tok * stride_a + i_hv).to(tl.float32) + dtb
            b_g = neg_a * tl.where(x <= 20.0, tl.log(1.0 + tl.exp(x)), x)
            b_beta = 1.0 / (1.0 + tl.exp(-tl.load(b + tok * stride_b + i_hv).to(tl.float32)))
            b_h = _delta_update(b_h, b_k, b_v, b_g, b_beta)
            if i >= length - seg:  # this program's segment: the node's output and scratch
                b_q = _load_qk(q, tok, i_h, H, K, o_k, mask_k)[1]
                b_o = tl.sum(b_h * (b_q * scale)[:, None], 0)
                tl.store(o + (tok * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
                tl.store(x_row + x_v + (node * HV + i_hv) * V + o_v, b_v, mask=mask_v)
                if i_v == 0:
                    tl.store(x_row + node * HV + i_hv, b_g)
                    tl.store(x_row + x_beta + node * HV + i_hv, b_beta)
                    tl.store(x_row + x_k + (node * HV + i_hv) * K + o_k, raw_k, mask=mask_k)


@triton.jit
def _commit_kernel(
    state, state_idx, state_layer_stride, state_stride, scratch, scratch_idx,
    scratch_layer_stride, scratch_stride, parents, last, track_idx, track_node, N,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, MAX_PATH: tl.constexpr, TRACK: tl.constexpr,
):  # fmt: skip
    i_v, i_nh, i_l = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_n, i_hv = i_nh // HV, i_nh % HV
    end = tl.load(last + i_n).to(tl.int32)
    slot = tl.load(state_idx + i_n).to(tl.int64)
    if (end < 0) | (slot < 0):
        return
    rev, length = _path_to(parents, i_n * N, tl.minimum(end, N - 1), N, MAX_PATH)
    o_p = tl.arange(0, MAX_PATH)
    if TRACK:
        tracked = tl.load(track_node + i_n).to(tl.int32)
        track_slot = tl.load(track_idx + i_n).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    in_state = i_hv * V * K + o_v[None, :] * K + o_k[:, None]
    layer = state + i_l * state_layer_stride
    b_h = tl.load(layer + slot * state_stride + in_state, mask=mask_h, other=0).to(tl.float32)
    x_row = scratch + i_l * scratch_layer_stride
    x_row += tl.load(scratch_idx + i_n).to(tl.int64) * scratch_stride
    x_beta, x_k, x_v = _scratch_offsets(N, HV, K)
    for i in range(MAX_PATH):
        if i < length:
            node = tl.sum(tl.where(o_p == length - 1 - i, rev, 0))
            b_k = tl.load(x_row + x_k + (node * HV + i_hv) * K + o_k, mask=mask_k, other=0)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
            b_v = tl.load(x_row + x_v + (node * HV + i_hv) * V + o_v, mask=mask_v, other=0)
            b_g = tl.load(x_row + node * HV + i_hv)
            b_beta = tl.load(x_row + x_beta + node * HV + i_hv)
            b_h = _delta_update(b_h, b_k, b_v, b_g, b_beta)
            if TRACK:
                if (node == tracked) & (track_slot >= 0):
                    dst = layer + track_slot * state_stride + in_state
                    tl.store(dst, b_h.to(dst.dtype.element_ty), mask=mask_h)
    dst = layer + slot * state_stride + in_state
    tl.store(dst, b_h.to(dst.dtype.element_ty), mask=mask_h)


def _block_v(V: int) -> int:
    return min(32, triton.next_power_of_2(V))


def _check_state(state: torch.Tensor, inner: tuple[int, int, int]) -> None:
    if tuple(state.shape[-3:]) != inner or not state[(0,) * (state.dim() - 3)].is_contiguous():
        raise ValueError(f"state pool {tuple(state.shape)} is not [..., {inner}] with K contiguous")


def verify_shapes(q, k, v, parents, state, scratch) -> tuple[int, int, int, int, int, int]:
    """(bs, N, H, K, HV, V) of a tree verify's inputs, or a ValueError saying what does not fit
    (both verify kernels take the same arguments)."""
    bs, N = parents.shape
    T, H, K = q.shape
    _, HV, V = v.shape
    if T != bs * N or HV % H or k.shape != q.shape:
        raise ValueError(f"q {tuple(q.shape)} / v {tuple(v.shape)} do not fit {bs} x {N} nodes")
    _check_scratch(scratch, N, HV, K, V)
    _check_state(state, (HV, V, K))
    return bs, N, H, K, HV, V


def _check_scratch(scratch: torch.Tensor, N: int, HV: int, K: int, V: int) -> None:
    if scratch.dtype != torch.float32 or scratch.shape[-1] < scratch_floats(N, HV, K, V):
        raise ValueError(f"scratch rows {tuple(scratch.shape)} {scratch.dtype} are too small")


def tree_verify(q, k, v, a, b, A_log, dt_bias, state, state_idx, parents, scratch, scratch_idx,
                *, max_path: int, scale: float | None = None, block_v: int | None = None,
                num_warps: int = 1) -> torch.Tensor:  # fmt: skip
    """o [T, HV, V] (q's dtype) of every node of bs trees of N nodes (T = bs * N, request-major):
    the recurrence runs from state[state_idx[b]] (the pool [S, HV, V, K], left unchanged; slot -1
    starts from zeros) along each node's root path, at most `max_path` nodes. Writes each node's
    g, beta, raw k and v to scratch[scratch_idx[b]] (rows of at least `scratch_floats` float32
    words) for `commit_paths`. block_v / num_warps: the V tile and warps per program (the
    defaults were the fastest in bench_gdn_tree's sweep on the H200). Sync-free, CUDA-graph
    safe."""
    bs, N, H, K, HV, V = verify_shapes(q, k, v, parents, state, scratch)
    q, k, v = (x.contiguous() for x in (q, k, v))
    a, b = (x if x.stride(-1) == 1 else x.contiguous() for x in (a, b))
    o = torch.empty(v.shape, dtype=q.dtype, device=v.device)
    BV = block_v or min(16, triton.next_power_of_2(V))  # 16 x 1 warp: fastest of 16-64 x 1-4
    grid = (triton.cdiv(V, BV), bs * HV, N)
    _tree_verify_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, state, state_idx, state.stride(0), parents,
        scratch, scratch_idx, scratch.stride(0), o, float(K**-0.5 if scale is None else scale),
        N, a.stride(0), b.stride(0),
        H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
        NP=triton.next_power_of_2(N), MAX_PATH=triton.next_power_of_2(max_path),
        num_warps=num_warps,
    )  # fmt: skip
    return o


def commit_paths(state, state_idx, scratch, scratch_idx, parents, last, *, max_path: int,
                 track_idx=None, track_node=None) -> None:  # fmt: skip
    """In place, for every layer l and request b with last[b] >= 0 and state_idx[b] >= 0:
    state[l, state_idx[b]] advanced along the root path of node last[b] with the g, beta, k and
    v that `tree_verify` left in scratch[l, scratch_idx[b]]; where track_node[b] >= 0 (a node on
    that path), the state after it also goes to state[l, track_idx[b]]. state [L, S, HV, V, K];
    scratch [L, S2, words] float32; parents [bs', N] with bs' >= bs = len(last). Sync-free."""
    bs, N = len(last), parents.shape[1]
    L, _, HV, V, K = state.shape
    _check_state(state, (HV, V, K))
    _check_scratch(scratch, N, HV, K, V)
    if bs == 0:
        return
    track = track_node is not None
    BV = _block_v(V)
    grid = (triton.cdiv(V, BV), bs * HV, L)
    _commit_kernel[grid](
        state, state_idx, state.stride(0), state.stride(1), scratch, scratch_idx,
        scratch.stride(0), scratch.stride(1), parents, last,
        track_idx if track else last, track_node if track else last, N,
        HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
        MAX_PATH=triton.next_power_of_2(max_path), TRACK=track, num_warps=1,
    )  # fmt: skip

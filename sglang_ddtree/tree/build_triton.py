"""Triton DDTree construction (ddtree.md §2): the best-first search itself, one program per request.

`build_reference.build_tree_reference` is the specification and `build.build_tree` the batched
torch version; this file must agree with both bit-for-bit (same signature, same DraftTree).

Kernel 1, `_tree_search_kernel`, one program per request:
  1. preprocess the [L, K] log-probs exactly like `build.preprocess_logprobs` (NaN/-inf -> floor,
     clamp to [floor, 0], running minimum over K) into a scratch buffer, then a block barrier;
  2. `budget` pops. The frontier is indexed by parent: slot p holds the key of node p's next
     unpopped child, because the heap holds at most one child of a node at a time (rank 0 is
     pushed when the node pops, rank r + 1 when rank r pops). A pop takes the smallest key,
     emits node j, replaces slot p with the next sibling (rank + 1, or empty at rank K - 1) and
     fills slot j with j's first child (or leaves it empty at depth L). Pop order = emission
     order, so the key's parent field is the parent's tree index.
  3. first_child / next_sibling come from the pops: a rank-0 pop is its parent's first child, any
     other pop is the next sibling of the parent's previously popped child.
Kernel 2, `_visibility_kernel`, one program per (request, block of rows): ancestor-or-self rows
by walking `parents` up min(L, budget) steps.
`_lattice_search_kernel` is kernel 1 over a DFlash2 lattice (`build_lattice_tree_triton`, against
`lattice.build_lattice_tree_reference`): its rows come sorted from torch, each emitted node keeps
its candidate index, and a node's children and siblings read the rows of their parent's candidate.

Keys: scores are <= 0 and never -0.0 (they are sums of values in [floor, 0] starting from +0.0),
so the float32 bits of |score| order like -score. One int64 holds the whole key
(-score, depth, parent, rank) and integer order is key order:
    bits 32..62 |score| bits, 20..31 depth, 8..19 parent, 0..7 rank.
budget <= MAX_BUDGET keeps depth and parent < 2**12, K <= MAX_TOPK keeps rank < 2**8.

Cost per pop: one min and two masked extractions over next_power_of_2(budget + 1) lanes, plus
three scalar loads; no host synchronisation, static shapes, so it can be captured in a CUDA graph.
On CPU it runs under Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .inputs import LOGPROB_FLOOR, MAX_TOPK, check_build_inputs
from .lattice import check_lattice_inputs, sorted_rows_batched
from .types import DraftTree

MAX_BUDGET = 1024  # depth and parent fields of the packed key hold values < 2**12

_FLOOR: tl.constexpr = tl.constexpr(LOGPROB_FLOOR)
_EMPTY: tl.constexpr = tl.constexpr(2**63 - 1)  # key of an empty frontier slot
_ABS_MASK: tl.constexpr = tl.constexpr(0x7FFFFFFF)
_FIELD: tl.constexpr = tl.constexpr(0xFFF)

_LP_TILE = 1024  # log-probs per preprocessing tile
_VIS_TILE = 4096  # visibility entries per program


@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit
def _preprocess(lp_ptr, s_l, s_k, out_ptr, L, K, LT: tl.constexpr, KP: tl.constexpr):
    """lp [L, K] (strided) -> out [L, K] contiguous: build.preprocess_logprobs for one request."""
    ks = tl.arange(0, KP)
    for l0 in range(0, L, LT):
        ls = l0 + tl.arange(0, LT)
        ok = (ls[:, None] < L) & (ks[None, :] < K)  # [LT, KP]
        x = tl.load(lp_ptr + ls[:, None] * s_l + ks[None, :] * s_k, mask=ok, other=0.0)
        x = tl.where(x != x, _FLOOR, x)  # NaN -> floor
        x = tl.minimum(tl.maximum(x, _FLOOR), 0.0)  # -inf -> floor, +inf -> 0
        # Padding lanes k >= K sit after the real ones, so they never reach a stored prefix.
        x = tl.associative_scan(x, 1, _min_combine)  # running minimum over ranks
        tl.store(out_ptr + ls[:, None] * K + ks[None, :], x, mask=ok)


@triton.jit
def _pack_key(score, depth, parent, rank):
    """(-score, depth, parent, rank) as one int64 ordered like the tuple (score <= 0)."""
    magnitude = (tl.cast(score, tl.int32, bitcast=True) & _ABS_MASK).to(tl.int64)
    fields = (tl.cast(depth, tl.int64) << 20) | (tl.cast(parent, tl.int64) << 8)
    return (magnitude << 32) | fields | tl.cast(rank, tl.int64)


@triton.jit
def _unpack_key(key):
    """Inverse of _pack_key: (score f32, depth, parent, rank) int64; a zero score is +0.0."""
    magnitude = (key >> 32).to(tl.int32)
    score = tl.where(magnitude == 0, 0.0, -magnitude.to(tl.float32, bitcast=True))
    return score, (key >> 20) & _FIELD, (key >> 8) & _FIELD, key & 0xFF


@triton.jit
def _push_sibling_and_child(
    frontier, row_ptr, child_row_ptr, slots, at_parent, j, score, parent_score, depth, parent,
    rank, L, K,
):  # fmt: skip
    """After node j pops at rank `rank` of its parent's row of preprocessed log-probs (row_ptr):
    the parent's frontier slot takes the next sibling (rank + 1 of that row), slot j its first
    child (rank 0 of the row its children read, child_row_ptr: the next position's in the
    marginal tree, its own candidate's at the next slot in the lattice)."""
    has_sibling = rank + 1 < K
    sibling_lp = tl.load(row_ptr + rank + 1, mask=has_sibling, other=0.0)
    sibling = _pack_key(parent_score + sibling_lp, depth, parent, rank + 1)
    frontier = tl.where(at_parent, tl.where(has_sibling, sibling, _EMPTY), frontier)
    has_child = depth < L
    child_lp = tl.load(child_row_ptr, mask=has_child, other=0.0)
    child = _pack_key(score + child_lp, depth + 1, j, 0)
    return tl.where((slots == j) & has_child, child, frontier)


@triton.jit
def _store_root_and_links(
    tokens_ptr, parents_ptr, depth_ptr, scores_ptr, first_child_ptr, next_sibling_ptr,
    out_row, root, slots, N, first_child, next_sibling,
):  # fmt: skip
    """The root's entries (token, parent -1, depth 0, score 0) and every node's links."""
    tl.store(tokens_ptr + out_row, root)
    tl.store(parents_ptr + out_row, -1)
    tl.store(depth_ptr + out_row, 0)
    tl.store(scores_ptr + out_row, 0.0)
    in_tree = slots < N
    tl.store(first_child_ptr + out_row + slots, first_child.to(tl.int64), mask=in_tree)
    tl.store(next_sibling_ptr + out_row + slots, next_sibling.to(tl.int64), mask=in_tree)


@triton.jit
def _tree_search_kernel(
    root_ptr, root_s, ids_ptr, ids_s0, ids_s1, ids_s2, lp_ptr, lp_s0, lp_s1, lp_s2, lp_buf,
    tokens_ptr, parents_ptr, depth_ptr, first_child_ptr, next_sibling_ptr, scores_ptr,
    L, K, budget, NP: tl.constexpr, LT: tl.constexpr, KP: tl.constexpr,
):  # fmt: skip
    """root [bs] int64; ids [bs, L, K] int64 and lp [bs, L, K] float32 raw log-probs (strided);
    lp_buf [bs, L, K] float32 scratch, contiguous, for the preprocessed log-probs; outputs
    tokens, parents, depth, first_child, next_sibling [bs, N] int64 and scores [bs, N] float32,
    contiguous. NP = next_power_of_2(N): lanes of the frontier and the per-node arrays."""
    b = tl.program_id(0).to(tl.int64)
    N = budget + 1
    lp_row = lp_buf + b * L * K  # this request's [L, K]
    ids_row = ids_ptr + b * ids_s0
    out_row = b * N
    _preprocess(lp_ptr + b * lp_s0, lp_s1, lp_s2, lp_row, L, K, LT, KP)
    tl.debug_barrier()  # the pops below read lp_row entries stored by other threads

    slots = tl.arange(0, NP)  # [NP] node index; slot p = candidate child of node p
    first = _pack_key(tl.load(lp_row), 1, 0, 0)  # depth 1, parent root, rank 0
    frontier = tl.where(slots == 0, first, _EMPTY)  # [NP] int64 keys
    node_score = tl.zeros([NP], dtype=tl.float32)  # [NP] score of each emitted node; root 0
    last_child = tl.full([NP], -1, dtype=tl.int32)  # [NP] latest popped child of each node
    first_child = tl.full([NP], -1, dtype=tl.int32)  # [NP]
    next_sibling = tl.full([NP], -1, dtype=tl.int32)  # [NP]

    for j in range(1, budget + 1):
        score, depth, parent, rank = _unpack_key(tl.min(frontier, axis=0))
        at_parent = slots == parent
        parent_score = tl.min(tl.where(at_parent, node_score, 1.0), axis=0)  # scores <= 0
        previous = tl.max(tl.where(at_parent, last_child, -1), axis=0)

        token = tl.load(ids_row + (depth - 1) * ids_s1 + rank * ids_s2)
        tl.store(tokens_ptr + out_row + j, token)
        tl.store(parents_ptr + out_row + j, parent)
        tl.store(depth_ptr + out_row + j, depth)
        tl.store(scores_ptr + out_row + j, score)
        node_score = tl.where(slots == j, score, node_score)
        first_child = tl.where(at_parent & (rank == 0), j, first_child)
        next_sibling = tl.where(slots == previous, j, next_sibling)  # previous = -1 at rank 0
        last_child = tl.where(at_parent, j, last_child)

        frontier = _push_sibling_and_child(
            frontier, lp_row + (depth - 1) * K, lp_row + depth * K, slots, at_parent, j, score,
            parent_score, depth, parent, rank, L, K,
        )  # fmt: skip

    _store_root_and_links(
        tokens_ptr, parents_ptr, depth_ptr, scores_ptr, first_child_ptr, next_sibling_ptr,
        out_row, tl.load(root_ptr + b * root_s), slots, N, first_child, next_sibling,
    )  # fmt: skip


@triton.jit
def _visibility_kernel(
    parents_ptr,  # [bs, N] int64, contiguous
    vis_ptr,  # [bs, N, N] uint8 (a bool tensor's bytes), contiguous
    N,
    max_depth,
    ROWS: tl.constexpr,
    NP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, NP)  # [NP]
    row_ok = rows < N
    parents_row = parents_ptr + b * N
    cur = rows
    seen = cols[None, :] == rows[:, None]  # [ROWS, NP] self
    for _ in range(max_depth):  # the root points to itself
        up = tl.load(parents_row + cur, mask=row_ok, other=0)
        cur = tl.maximum(up, 0).to(tl.int32)
        seen = seen | (cols[None, :] == cur[:, None])
    ok = row_ok[:, None] & (cols[None, :] < N)
    tl.store(vis_ptr + b * N * N + rows[:, None] * N + cols[None, :], seen.to(tl.uint8), mask=ok)


@triton.jit
def _lattice_search_kernel(
    root_ptr, root_s, ids_ptr, ids_s0, ids_s1, ids_s2, vals_ptr, order_ptr,
    tokens_ptr, parents_ptr, depth_ptr, first_child_ptr, next_sibling_ptr, scores_ptr,
    L, K, budget, NP: tl.constexpr,
):  # fmt: skip
    """`_tree_search_kernel` over a DFlash2 lattice (tree/lattice.py's heap): a node's
    children are the ranks of its own candidate's row, so each emitted node keeps its
    candidate index (the root's row is 0) and a sibling reads its parent's row.
    root [bs] int64; ids [bs, L, K] int64, the candidates of each slot (strided); vals
    [bs, L, K, K] float32, each row cleaned and sorted descending, and order [bs, L, K, K]
    int64, the candidate index at each rank (both contiguous); outputs as
    `_tree_search_kernel`'s."""
    b = tl.program_id(0).to(tl.int64)
    N = budget + 1
    vals_row = vals_ptr + b * L * K * K  # this request's [L, K, K]
    order_row = order_ptr + b * L * K * K
    ids_row = ids_ptr + b * ids_s0
    out_row = b * N

    slots = tl.arange(0, NP)  # [NP] node index; slot p = candidate child of node p
    frontier = tl.where(slots == 0, _pack_key(tl.load(vals_row), 1, 0, 0), _EMPTY)
    node_score = tl.zeros([NP], dtype=tl.float32)  # [NP] score of each emitted node; root 0
    node_cand = tl.zeros([NP], dtype=tl.int32)  # [NP] candidate index at its slot; root 0
    last_child = tl.full([NP], -1, dtype=tl.int32)
    first_child = tl.full([NP], -1, dtype=tl.int32)
    next_sibling = tl.full([NP], -1, dtype=tl.int32)

    for j in range(1, budget + 1):
        score, depth, parent, rank = _unpack_key(tl.min(frontier, axis=0))
        at_parent = slots == parent
        parent_score = tl.min(tl.where(at_parent, node_score, 1.0), axis=0)  # scores <= 0
        row = tl.max(tl.where(at_parent, node_cand, -1), axis=0)  # the parent's candidate
        previous = tl.max(tl.where(at_parent, last_child, -1), axis=0)
        row_at = (depth - 1) * K * K + row * K  # the parent's row at this node's slot
        cand = tl.load(order_row + row_at + rank).to(tl.int32)

        token = tl.load(ids_row + (depth - 1) * ids_s1 + cand * ids_s2)
        tl.store(tokens_ptr + out_row + j, token)
        tl.store(parents_ptr + out_row + j, parent)
        tl.store(depth_ptr + out_row + j, depth)
        tl.store(scores_ptr + out_row + j, score)
        node_score = tl.where(slots == j, score, node_score)
        node_cand = tl.where(slots == j, cand, node_cand)
        first_child = tl.where(at_parent & (rank == 0), j, first_child)
        next_sibling = tl.where(slots == previous, j, next_sibling)
        last_child = tl.where(at_parent, j, last_child)

        frontier = _push_sibling_and_child(
            frontier, vals_row + row_at, vals_row + depth * K * K + cand * K, slots, at_parent,
            j, score, parent_score, depth, parent, rank, L, K,
        )  # fmt: skip

    _store_root_and_links(
        tokens_ptr, parents_ptr, depth_ptr, scores_ptr, first_child_ptr, next_sibling_ptr,
        out_row, tl.load(root_ptr + b * root_s), slots, N, first_child, next_sibling,
    )  # fmt: skip


def _check_limits(root: torch.Tensor, K: int, budget: int) -> None:
    if budget > MAX_BUDGET:
        raise ValueError(f"build_tree_triton supports budget <= {MAX_BUDGET}, got budget={budget}")
    if K > MAX_TOPK:
        raise ValueError(f"build_tree_triton supports K <= {MAX_TOPK} candidates, got K={K}")
    if isinstance(_tree_search_kernel, JITFunction) and root.device.type != "cuda":
        raise ValueError(
            f"build_tree_triton needs CUDA tensors, got device {root.device}; on CPU use "
            f"build_tree, or set TRITON_INTERPRET=1 before importing triton"
        )


def _search_warps(NP: int) -> int:
    """One warp up to 256 lanes (reductions stay in shuffles), then 8 lanes per thread."""
    return max(1, min(8, NP // 256))


def _outputs(bs: int, N: int, device: torch.device) -> DraftTree:
    """Uninitialised DraftTree buffers for bs trees of N nodes."""

    def empty(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    return DraftTree(
        tokens=empty(bs, N),
        parents=empty(bs, N),
        depth=empty(bs, N),
        first_child=empty(bs, N),
        next_sibling=empty(bs, N),
        visibility=empty(bs, N, N, dtype=torch.bool),
        scores=empty(bs, N, dtype=torch.float32),
    )


def _fill_visibility(tree: DraftTree, L: int, budget: int) -> None:
    bs, N = tree.tokens.shape
    NP = triton.next_power_of_2(N)
    rows = max(1, _VIS_TILE // NP)
    _visibility_kernel[(bs, triton.cdiv(N, rows))](
        tree.parents, tree.visibility.view(torch.uint8), N, min(L, budget),
        ROWS=rows, NP=NP, num_warps=4,
    )  # fmt: skip


def build_tree_triton(
    root: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, budget: int
) -> DraftTree:
    """Same contract and result as `build.build_tree`, as two Triton kernels.

    root [bs] int64, topk_ids [bs, L, K] int64, topk_logprobs [bs, L, K] float32 (any strides).
    Returns a DraftTree of width N = budget + 1. Limits: budget <= 1024, K <= 64.
    """
    bs, L, K = check_build_inputs(root, topk_ids, topk_logprobs, budget)
    _check_limits(root, K, budget)
    N = budget + 1
    NP = triton.next_power_of_2(N)
    KP = triton.next_power_of_2(K)
    LT = min(triton.next_power_of_2(L), _LP_TILE // KP)
    tree = _outputs(bs, N, root.device)
    if bs > 0:
        lp_buf = torch.empty(bs, L, K, dtype=torch.float32, device=root.device)
        _tree_search_kernel[(bs,)](
            root, root.stride(0),
            topk_ids, *topk_ids.stride(),
            topk_logprobs, *topk_logprobs.stride(),
            lp_buf, tree.tokens, tree.parents, tree.depth, tree.first_child, tree.next_sibling,
            tree.scores, L, K, budget,
            NP=NP, LT=LT, KP=KP, num_warps=_search_warps(NP),
        )  # fmt: skip
        _fill_visibility(tree, L, budget)
    return tree


def build_lattice_tree_triton(
    root: torch.Tensor, candidate_ids: torch.Tensor, cond_logprobs: torch.Tensor, budget: int
) -> DraftTree:
    """Same contract and result as `lattice.build_lattice_tree`: the rows cleaned and sorted
    by torch (`lattice.sorted_rows_batched`, one sort), then one search program per request
    and the visibility kernel. Limits as `build_tree_triton`'s."""
    bs, L, K = check_lattice_inputs(root, candidate_ids, cond_logprobs, budget)
    _check_limits(root, K, budget)
    N = budget + 1
    NP = triton.next_power_of_2(N)
    tree = _outputs(bs, N, root.device)
    if bs > 0:
        values, order = (t.contiguous() for t in sorted_rows_batched(cond_logprobs))
        _lattice_search_kernel[(bs,)](
            root, root.stride(0),
            candidate_ids, *candidate_ids.stride(),
            values, order, tree.tokens, tree.parents, tree.depth, tree.first_child,
            tree.next_sibling, tree.scores, L, K, budget,
            NP=NP, num_warps=_search_warps(NP),
        )  # fmt: skip
        _fill_visibility(tree, L, budget)
    return tree

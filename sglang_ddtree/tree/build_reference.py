"""Plain-Python DDTree construction: a best-first heap per request (the specification).

Scores are float32: a node's score is float32(score[parent] + lp[depth-1][rank]), root 0.
Heap keys are (-score, depth, parent index, rank); a pop emits the next node and pushes its next
sibling (rank + 1) and its first child (rank 0 one level down). Both successors have larger
keys than the popped node, so pops come out in key order and the emitted set is prefix-closed.
"""

from __future__ import annotations

import heapq
import math

import numpy as np
import torch

from .inputs import LOGPROB_FLOOR, check_build_inputs
from .types import DraftTree

f32 = np.float32


def plain_logprobs(row: list[float]) -> list[np.float32]:
    """One position's K log-probs: NaN/-inf -> floor, clamp to [floor, 0], running minimum."""
    out, running = [], f32(0.0)
    for value in row:
        v = f32(LOGPROB_FLOOR) if math.isnan(value) else f32(value)
        v = min(max(v, f32(LOGPROB_FLOOR)), f32(0.0))
        running = min(running, v)
        out.append(running)
    return out


def _best_first(lp: list[list[np.float32]], budget: int) -> list[tuple[int, int, int, np.float32]]:
    """lp[d][r] for depth d+1, rank r -> [(parent, depth, rank, score)] for nodes 1..budget."""
    L, K = len(lp), len(lp[0])
    scores = [f32(0.0)]  # by tree index; root first
    nodes = []
    heap = [(-float(scores[0] + lp[0][0]), 1, 0, 0)]
    while len(nodes) < budget:
        neg_score, depth, parent, rank = heapq.heappop(heap)
        index = len(scores)
        scores.append(f32(-neg_score))
        nodes.append((parent, depth, rank, scores[index]))
        if rank + 1 < K:
            sibling = scores[parent] + lp[depth - 1][rank + 1]
            heapq.heappush(heap, (-float(sibling), depth, parent, rank + 1))
        if depth < L:
            child = scores[index] + lp[depth][0]
            heapq.heappush(heap, (-float(child), depth + 1, index, 0))
    return nodes


def sibling_links(parents: list[int]) -> tuple[list[int], list[int]]:
    """(first_child, next_sibling) of a parent-first tree (parents[0], the root's, is ignored):
    each node's lowest-index child and the next higher-index child of its parent, -1 where none."""
    N = len(parents)
    first_child, next_sibling = [-1] * N, [-1] * N
    for i in range(1, N):
        p = parents[i]
        if first_child[p] == -1:
            first_child[p] = i
        later = [j for j in range(i + 1, N) if parents[j] == p]
        next_sibling[i] = later[0] if later else -1
    return first_child, next_sibling


def _links_and_visibility(parents: list[int]) -> tuple[list[int], list[int], list[list[bool]]]:
    N = len(parents)
    first_child, next_sibling = sibling_links(parents)
    visibility = [[False] * N for _ in range(N)]
    for i in range(N):
        j = i
        while j != -1:
            visibility[i][j] = True
            j = parents[j]
    return first_child, next_sibling, visibility


def _one_tree(root: int, ids: list[list[int]], lp_rows: list[list[float]], budget: int) -> dict:
    lp = [plain_logprobs(row) for row in lp_rows]
    return host_tree(root, ids, _best_first(lp, budget))


def host_tree(root: int, ids: list[list[int]], nodes: list[tuple]) -> dict:
    """One request's host tree ({field: list}, as `stack_trees` takes it) from its best-first
    nodes, each (parent, depth, index into ids[depth - 1], score), root first."""
    parents = [-1] + [p for p, _, _, _ in nodes]
    first_child, next_sibling, visibility = _links_and_visibility(parents)
    return {
        "tokens": [root] + [ids[d - 1][r] for _, d, r, _ in nodes],
        "parents": parents,
        "depth": [0] + [d for _, d, _, _ in nodes],
        "first_child": first_child,
        "next_sibling": next_sibling,
        "visibility": visibility,
        "scores": [f32(0.0)] + [s for _, _, _, s in nodes],
    }


def build_tree_reference(
    root: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, budget: int
) -> DraftTree:
    """Same contract as `build.build_tree`, one heap per request on the host."""
    bs, _, _ = check_build_inputs(root, topk_ids, topk_logprobs, budget)
    roots, ids, lps = root.tolist(), topk_ids.tolist(), topk_logprobs.tolist()
    trees = [_one_tree(roots[b], ids[b], lps[b], budget) for b in range(bs)]
    return stack_trees(trees, root.device)


def stack_trees(trees: list[dict], device) -> DraftTree:
    """Per-request host trees ({field: list}, as `_one_tree` returns them) as one DraftTree."""

    def field(name: str, dtype: torch.dtype) -> torch.Tensor:
        if name == "scores":
            array = np.array([t[name] for t in trees], dtype=np.float32)
            return torch.from_numpy(array).to(device)
        return torch.tensor([t[name] for t in trees], dtype=dtype, device=device)

    return DraftTree(
        tokens=field("tokens", torch.int64),
        parents=field("parents", torch.int64),
        depth=field("depth", torch.int64),
        first_child=field("first_child", torch.int64),
        next_sibling=field("next_sibling", torch.int64),
        visibility=field("visibility", torch.bool),
        scores=field("scores", torch.float32),
    )

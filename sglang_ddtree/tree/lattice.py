"""DDTree over a DFlash2 lattice: the best-first tree under the drafter's first-order chain.

A DFlash2 drafter gives, per block position (slot) e = 0..L-1, K candidate tokens and K x K
transition scores `scores[b, e, p, c]`: candidate c at slot e after candidate p at slot e-1
(slot 0's predecessor is the root, so its K rows are equal). Softmax over c makes the chain
model the drafter's own sampler walks (docs/dflash2.md):

    Q(y_1..y_d) = q_0(y_1) * prod_{e=1..d-1} q_e(y_{e+1} | y_e),   q_e(. | p) = softmax_c(s[e, p])

The tree is the `budget` most probable prefixes under Q. Every conditional is <= 1, so a prefix
is at least as probable as its extensions and the top set is prefix-closed, as in the marginal
DDTree (tree/build_reference.py); the only change is that a node's children are ranked by the
row of its own candidate, not by one row per depth.

    lattice_chain_logprobs      DFlash2 scores -> log conditionals [bs, L, K, K]
    build_lattice_tree_reference  heap per request (the specification)
    build_lattice_tree          batched, static shapes, no host sync; bit-equal to the heap

Both return the project's DraftTree (scores = log Q of each root path), so the verify layout,
the accept walk and the target sampling take it unchanged. Acceptance is the target-only walk
(accept/walk.py with accept/sampling.py): lossless for any tree fixed before the target samples,
the proposal probabilities are never read (docs/dflash2.md, "Losslessness").
"""

from __future__ import annotations

import heapq
import math

import numpy as np
import torch

from .build import select_nodes
from .build_reference import host_tree, stack_trees
from .inputs import LOGPROB_FLOOR, beam_widths, check_build_inputs
from .types import DraftTree

f32 = np.float32


def lattice_chain_logprobs(
    scores: torch.Tensor, log_coverage: torch.Tensor | None = None
) -> torch.Tensor:
    """DFlash2 lattice scores [bs, L, K, K] -> log q_e(c | p) [bs, L, K, K] float32.

    log-softmax over the K successors (upstream's `CandidateSelector.sample_path` at T = 1);
    slot 0 takes row 0 for every p (its predecessor is the root). `log_coverage` [bs, L]
    (optional, <= 0), added to slot e's rows, is the log of the drafter's mass on its K
    candidates (logsumexp of their unary logits - the full-vocabulary lse), so that a slot whose
    top-K misses most of the mass costs its paths what it should. Non-finite results become
    LOGPROB_FLOOR; all values are clamped to [LOGPROB_FLOOR, 0].
    """
    if not isinstance(scores, torch.Tensor) or scores.dim() != 4:
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"lattice scores must be a [bs, L, K, K] tensor, got {shape}")
    if scores.shape[-1] != scores.shape[-2]:
        raise ValueError(f"lattice scores must be [bs, L, K, K], got {tuple(scores.shape)}")
    lp = torch.log_softmax(scores.float(), dim=-1)  # [bs, L, K, K]
    lp = torch.cat([lp[:, :1, :1].expand_as(lp[:, :1]), lp[:, 1:]], dim=1)
    if log_coverage is not None:
        if tuple(log_coverage.shape) != tuple(scores.shape[:2]):
            raise ValueError(
                f"log_coverage must be [bs, L] = {tuple(scores.shape[:2])}, "
                f"got {tuple(log_coverage.shape)}"
            )
        lp = lp + log_coverage.float().clamp(max=0.0)[:, :, None, None]
    lp = torch.nan_to_num(lp, nan=LOGPROB_FLOOR, posinf=0.0, neginf=LOGPROB_FLOOR)
    return lp.clamp(min=LOGPROB_FLOOR, max=0.0)


def check_lattice_inputs(
    root: torch.Tensor, candidate_ids: torch.Tensor, cond_logprobs: torch.Tensor, budget: int
) -> tuple[int, int, int]:
    """Validate lattice builder inputs; return (bs, L, K). Raises ValueError naming the values.

    root [bs] int64, candidate_ids [bs, L, K] int64 (distinct within a slot, not checked: it
    would read contents), cond_logprobs [bs, L, K, K] float32.
    """
    if not isinstance(cond_logprobs, torch.Tensor) or cond_logprobs.dim() != 4:
        shape = (
            tuple(cond_logprobs.shape)
            if isinstance(cond_logprobs, torch.Tensor)
            else type(cond_logprobs).__name__
        )
        raise ValueError(f"cond_logprobs must be a [bs, L, K, K] tensor, got {shape}")
    if tuple(cond_logprobs.shape[:3]) != tuple(getattr(candidate_ids, "shape", ())) or (
        cond_logprobs.shape[-1] != cond_logprobs.shape[-2]
    ):
        raise ValueError(
            f"cond_logprobs {tuple(cond_logprobs.shape)} must be [bs, L, K, K] for "
            f"candidate_ids {tuple(getattr(candidate_ids, 'shape', ()))} = [bs, L, K]"
        )
    return check_build_inputs(root, candidate_ids, cond_logprobs[:, :, 0, :], budget)


def _clean(value: float) -> np.float32:
    v = f32(LOGPROB_FLOOR) if math.isnan(value) else f32(value)
    return min(max(v, f32(LOGPROB_FLOOR)), f32(0.0))


def _sorted_rows(cond: list) -> tuple[list, list]:
    """cond[e][p][c] -> (value[e][p][r], cand[e][p][r]): each row by value, ties to lower c."""
    values, cands = [], []
    for slot in cond:
        clean = [[_clean(v) for v in row] for row in slot]
        order = [sorted(range(len(row)), key=lambda c, row=row: (-row[c], c)) for row in clean]
        values.append([[row[c] for c in o] for row, o in zip(clean, order, strict=True)])
        cands.append(order)
    return values, cands


def _best_first(values: list, cands: list, budget: int) -> list[tuple[int, int, int, np.float32]]:
    """-> [(parent, depth, candidate, score)] for nodes 1..budget in emission order.

    Heap keys (-score, depth, parent index, rank) as in build_reference; rank indexes the
    parent's own row, sorted: row[node] is the node's candidate (the root's row is 0).
    """
    L, K = len(values), len(values[0][0])
    scores, rows, nodes = [f32(0.0)], [0], []
    heap = [(-float(values[0][0][0]), 1, 0, 0)]
    while len(nodes) < budget:
        neg_score, depth, parent, rank = heapq.heappop(heap)
        index, row = len(scores), rows[parent]
        scores.append(f32(-neg_score))
        rows.append(cands[depth - 1][row][rank])
        nodes.append((parent, depth, rows[index], scores[index]))
        if rank + 1 < K:
            sibling = scores[parent] + values[depth - 1][row][rank + 1]
            heapq.heappush(heap, (-float(sibling), depth, parent, rank + 1))
        if depth < L:
            child = scores[index] + values[depth][rows[index]][0]
            heapq.heappush(heap, (-float(child), depth + 1, index, 0))
    return nodes


def _one_tree(root: int, ids: list[list[int]], cond: list, budget: int) -> dict:
    return host_tree(root, ids, _best_first(*_sorted_rows(cond), budget))


def build_lattice_tree_reference(
    root: torch.Tensor, candidate_ids: torch.Tensor, cond_logprobs: torch.Tensor, budget: int
) -> DraftTree:
    """Best-first tree of `budget` nodes per request under the chain model, one heap each.

    root [bs] int64, candidate_ids [bs, L, K] int64, cond_logprobs [bs, L, K, K] float32
    (`lattice_chain_logprobs`; [b, e, p, c] = log q_e(candidate c | candidate p at slot e-1)).
    """
    bs, _, _ = check_lattice_inputs(root, candidate_ids, cond_logprobs, budget)
    roots, ids, cond = root.tolist(), candidate_ids.tolist(), cond_logprobs.tolist()
    trees = [_one_tree(roots[b], ids[b], cond[b], budget) for b in range(bs)]
    return stack_trees(trees, root.device)


def sorted_rows_batched(cond_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[bs, L, K, K] -> (values, cands) [bs, L, K, K]: each row cleaned and stably sorted."""
    lp = torch.nan_to_num(cond_logprobs, nan=LOGPROB_FLOOR, posinf=0.0, neginf=LOGPROB_FLOOR)
    lp = lp.clamp(min=LOGPROB_FLOOR, max=0.0)
    return torch.sort(lp, dim=-1, descending=True, stable=True)


def _beams(values: torch.Tensor, cands: torch.Tensor, budget: int) -> list[tuple]:
    """Per depth d = 1..L: (score, cand_slot, candidate) [bs, w_d] in key order.

    cand_slot = parent_beam_index * K + rank over the (parent, rank) layout of depth d's
    candidates; candidate is the chosen candidate index at slot d-1 (the row of its children).
    """
    bs, L, K, _ = values.shape
    prev_score = torch.zeros(bs, 1, dtype=values.dtype, device=values.device)  # [bs, 1] root
    prev_row = torch.zeros(bs, 1, dtype=torch.int64, device=values.device)  # root: row 0
    beams = []
    for d, width in enumerate(beam_widths(K, L, budget), start=1):
        rows = prev_row[:, :, None].expand(-1, -1, K)  # [bs, w, K]
        row_values = values[:, d - 1].gather(1, rows)  # [bs, w, K] each parent's own row
        cand_score = (prev_score[:, :, None] + row_values).flatten(1)  # [bs, w*K]
        pick = torch.sort(cand_score, dim=1, descending=True, stable=True).indices[:, :width]
        prev_score = cand_score.gather(1, pick)  # [bs, width]
        prev_row = cands[:, d - 1].gather(1, rows).flatten(1).gather(1, pick)  # [bs, width]
        beams.append((prev_score, pick, prev_row))
    return beams


def build_lattice_tree(
    root: torch.Tensor, candidate_ids: torch.Tensor, cond_logprobs: torch.Tensor, budget: int
) -> DraftTree:
    """Batched, sync-free `build_lattice_tree_reference` (same contract, bit-equal).

    One beam per depth as in tree/build.py. Why the beams hold every selected node: the key
    (-score, depth, parent, rank) totally orders all prefixes and the tree is its first `budget`;
    a selected depth-d node's parent is selected, so in beam[d-1] by induction, and every
    depth-d candidate that outranks it is selected too, hence fewer than `budget` of them: it
    is in beam[d], the top min(budget, K**d) children of beam[d-1]. (Unlike the marginal tree,
    beam[d] need not be the top depth-d prefixes: a weak row can hide a parent's children.)
    """
    bs, L, K = check_lattice_inputs(root, candidate_ids, cond_logprobs, budget)
    device = root.device
    scores, tokens, parents, depths = [], [], [], []
    offset_prev, offset = -1, 0  # slot of beam[d-1]'s first entry; the root sits at -1
    for d, (score, pick, cand) in enumerate(_beams(*sorted_rows_batched(cond_logprobs), budget), 1):
        width = score.shape[1]
        scores.append(score)
        tokens.append(candidate_ids[:, d - 1].gather(1, cand))  # [bs, width]
        parents.append(pick // K + offset_prev)  # [bs, width]
        depths.append(torch.full((bs, width), d, dtype=torch.int64, device=device))
        offset_prev, offset = offset, offset + width
    score, token, parent_slot, depth = (
        torch.cat(x, dim=1) for x in (scores, tokens, parents, depths)
    )
    return select_nodes(root, score, token, parent_slot, depth, budget, min(L, budget))

"""Batched DDTree construction (ddtree.md §2): static shapes, no host synchronisation.

`build_reference.build_tree_reference` is the specification; this file must agree with it
bit-for-bit. Nodes are the `budget` smallest prefixes under the key
(-score, depth, parent's order, rank), emitted in that order.

Algorithm: one beam per depth. beam[d] holds the top min(budget, K**d) depth-d prefixes in key
order, found by a stable sort of beam[d-1] x K candidates laid out in (parent, rank) order.
Every selected depth-d node is in beam[d] (its parent is in beam[d-1], and the first children of
the beam[d-1] entries before that parent outrank it), so a stable sort by score of the
depth-major concatenation of all beams, cut to `budget`, is the tree in emission order.
"""

from __future__ import annotations

import torch

from .inputs import LOGPROB_FLOOR, beam_widths, check_build_inputs
from .types import DraftTree


def preprocess_logprobs(topk_logprobs: torch.Tensor) -> torch.Tensor:
    """[bs, L, K] float32 -> clamped to [LOGPROB_FLOOR, 0], NaN/-inf -> floor, non-increasing.

    The running minimum over K is a no-op for topk output; it makes the order monotone for any
    input, so that best-first order and sorted-key order agree.
    """
    lp = torch.nan_to_num(topk_logprobs, nan=LOGPROB_FLOOR, posinf=0.0, neginf=LOGPROB_FLOOR)
    lp = lp.clamp(min=LOGPROB_FLOOR, max=0.0)
    return torch.cummin(lp, dim=-1).values


def topk_logprobs_from_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [bs, L, V] -> (ids [bs, L, k] int64, logprobs [bs, L, k] float32), sorted.

    float32 log_softmax over the full vocabulary, then topk (largest first).
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a [bs, L, V] tensor, got {shape}")
    V = logits.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= V:
        raise ValueError(f"k must be an int in [1, V={V}], got {k!r}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [bs, L, V] f32
    values, ids = torch.topk(logprobs, k, dim=-1, largest=True, sorted=True)  # [bs, L, k]
    return ids, values


def _beams(lp: torch.Tensor, budget: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per depth d = 1..L: (score [bs, w_d] f32, cand [bs, w_d] int64) in key order.

    cand = parent_beam_index * K + rank indexes the (parent, rank) layout of depth d's
    candidates; for d = 1 the parent beam is the root alone.
    """
    bs, L, K = lp.shape
    prev_score = torch.zeros(bs, 1, dtype=lp.dtype, device=lp.device)  # [bs, 1] root
    beams = []
    for d, width in enumerate(beam_widths(K, L, budget), start=1):
        cand_score = (prev_score[:, :, None] + lp[:, d - 1, None, :]).flatten(1)  # [bs, w*K]
        cand = torch.sort(cand_score, dim=1, descending=True, stable=True).indices[:, :width]
        prev_score = cand_score.gather(1, cand)  # [bs, width]
        beams.append((prev_score, cand))
    return beams


def _flatten_beams(
    beams: list[tuple[torch.Tensor, torch.Tensor]], topk_ids: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Concatenate beams depth-major: score, token, parent slot, depth, each [bs, T].

    A slot is a position in the concatenation; parent slot -1 stands for the root.
    """
    bs, _, K = topk_ids.shape
    device = topk_ids.device
    scores, tokens, parents, depths = [], [], [], []
    offset_prev = -1  # slot of beam[d-1]'s first entry; the root for d = 1 sits at -1
    offset = 0
    for d, (score, cand) in enumerate(beams, start=1):
        width = score.shape[1]
        scores.append(score)
        tokens.append(topk_ids[:, d - 1].gather(1, cand % K))  # [bs, width]
        parents.append(cand // K + offset_prev)  # [bs, width]
        depths.append(torch.full((bs, width), d, dtype=torch.int64, device=device))
        offset_prev, offset = offset, offset + width
    return tuple(torch.cat(x, dim=1) for x in (scores, tokens, parents, depths))


def tree_links(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [bs, N] (topological, -1 at root) -> (first_child, next_sibling) [bs, N], -1 = none."""
    bs, N = parents.shape
    idx = torch.arange(N, device=parents.device).expand(bs, N)  # [bs, N]
    child_parent = parents[:, 1:]  # [bs, N-1]
    first_child = torch.full_like(parents, N)
    first_child.scatter_reduce_(1, child_parent, idx[:, 1:], reduce="amin", include_self=True)
    first_child = torch.where(first_child == N, -1, first_child)
    # Group children by parent, increasing index inside a group: the next entry of a group is
    # the next sibling.
    order = torch.sort(child_parent, dim=1, stable=True).indices  # [bs, N-1] node index - 1
    grouped = child_parent.gather(1, order)
    successor = torch.where(grouped[:, 1:] == grouped[:, :-1], order[:, 1:] + 1, -1)
    next_sibling = torch.full_like(parents, -1)
    next_sibling[:, 1:] = next_sibling[:, 1:].scatter(1, order[:, :-1], successor)
    return first_child, next_sibling


def tree_visibility(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents [bs, N] -> [bs, N, N] bool, [b, i, j] = j is i or an ancestor of i.

    max_depth pointer-jumping rounds, each a gather and a scatter; the root points to itself.
    """
    bs, N = parents.shape
    up = parents.clamp(min=0)  # [bs, N] root -> root
    cur = torch.arange(N, device=parents.device).expand(bs, N)  # [bs, N]
    visibility = torch.zeros(bs, N, N, dtype=torch.bool, device=parents.device)
    visibility.scatter_(2, cur[:, :, None], True)
    for _ in range(max_depth):
        cur = up.gather(1, cur)
        visibility.scatter_(2, cur[:, :, None], True)
    return visibility


def build_tree(
    root: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, budget: int
) -> DraftTree:
    """Best-first draft tree of `budget` nodes (+ root) per request, batched and sync-free.

    root [bs] int64, topk_ids [bs, L, K] int64, topk_logprobs [bs, L, K] float32 (sorted by
    non-increasing log-prob along K). Returns a DraftTree of width N = budget + 1.
    """
    bs, L, K = check_build_inputs(root, topk_ids, topk_logprobs, budget)
    lp = preprocess_logprobs(topk_logprobs)  # [bs, L, K] f32
    score, token, parent_slot, depth = _flatten_beams(_beams(lp, budget), topk_ids)  # [bs, T]
    return select_nodes(root, score, token, parent_slot, depth, budget, min(L, budget))


def select_nodes(root, score, token, parent_slot, depth, budget: int, max_depth: int) -> DraftTree:
    """The first `budget` candidate slots by (score, slot order) as a DraftTree: score, token,
    parent_slot (-1: the root), depth [bs, T] per slot; max_depth bounds the visibility."""
    bs, T = score.shape
    sel = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :budget]  # [bs, B]

    # node_of[:, s + 1] = tree index of slot s (0 if unselected); column 0 is the root.
    node_of = torch.zeros(bs, T + 1, dtype=torch.int64, device=root.device)
    node_ids = torch.arange(1, budget + 1, device=root.device).expand(bs, budget)  # [bs, B]
    node_of.scatter_(1, sel + 1, node_ids)
    parents = node_of.gather(1, parent_slot.gather(1, sel) + 1)  # [bs, B]

    def with_root(head: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
        return torch.cat([head.expand(bs, 1), rest], dim=1)  # [bs, N]

    minus_one = torch.full((bs, 1), -1, dtype=torch.int64, device=root.device)
    parents = with_root(minus_one, parents)
    first_child, next_sibling = tree_links(parents)
    return DraftTree(
        tokens=with_root(root[:, None], token.gather(1, sel)),
        parents=parents,
        depth=with_root(torch.zeros_like(minus_one), depth.gather(1, sel)),
        first_child=first_child,
        next_sibling=next_sibling,
        visibility=tree_visibility(parents, max_depth),
        scores=with_root(torch.zeros_like(score[:, :1]), score.gather(1, sel)),
    )

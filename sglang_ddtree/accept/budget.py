"""Budget by load, the tree's part: what a tree's first nodes are and what they predict and
accepted (the width policy that chooses among them is round/widths.py).

The builders emit nodes in non-increasing q(u) (the drafter's probability of the root->u path),
so the first n nodes of an N-node DDTree are the best n-node tree, prefix-closed, and under the
drafter's factorised distribution a tree T yields 1 + sum_{u in T} q(u) tokens per round in
expectation (the DDTree paper's Proposition 1; the 1 is the target's bonus token). One build at
the largest width therefore gives every smaller width's tree and its prediction. Chain DFlash is
the top-1 path: 1 + sum_d prod_{i <= d} p_i(top 1).

The prediction assumes the target accepts what the drafter believes; `Calibration` scales it by
the ratio of observed to predicted acceptance over recent requests. The policy picks the width
(or the chain) with the most expected tokens per millisecond of verify at the running batch size.
A round verified at width w also tells what every narrower width would have accepted
(`accepted_at_widths`): the narrower tree is the first nodes of the wider one.

    truncate            the first w nodes of a built tree as a w-node tree (the smaller build)
    expected_tokens     the drafter's expected tokens per round at each width
    accepted_at_widths  what each narrower width would have accepted in a round
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_ddtree.tree.types import DraftTree

from .walk import accepted_nodes


def expected_tokens(scores: torch.Tensor, widths: Sequence[int]) -> torch.Tensor:
    """[bs, len(widths)] float32: 1 + sum of q over the first w nodes' drafted part (node 0 is
    the root) for each width w, from the tree's scores [bs, N] (log q, root 0)."""
    if any(not 1 <= w <= scores.shape[1] for w in widths):
        raise ValueError(f"widths {list(widths)} must be in [1, {scores.shape[1]}]")
    q = scores.float().exp()
    q[:, 0] = 0.0  # the root is already committed; the 1 below is the bonus token
    total = 1.0 + q.cumsum(1)  # [bs, N]: through node i
    # columns one by one (a list index would be a host-to-device copy, i.e. a sync)
    return torch.stack([total[:, w - 1] for w in widths], dim=1)


def accepted_at_widths(
    tree: DraftTree, emitted: torch.Tensor, accept_lens: torch.Tensor, widths: Sequence[int]
) -> torch.Tensor:
    """[bs, len(widths)] float32: the tokens (bonus included) a verified round would have
    accepted at each width w, had it verified only the first w nodes of `tree` (w capped at the
    tree's width), from what it accepted: `emitted` [bs, >= max depth] the round's tokens (the
    accepted drafts, then the bonus), `accept_lens` [bs] how many it emitted.

    The first w nodes are prefix-closed, so the accepted path's nodes among them are a prefix of
    it, and the narrower round's walk stops where the path leaves them: 1 + the path's nodes of
    index below w. Exact for greedy requests (a node's target token depends on its path alone);
    under sampling, the narrower round under the same draws of the target's token at each node.
    On the device, no host sync."""
    w_run, depth = tree.tokens.shape[1], tree.depth
    # the target's token at each node, as far as the path goes: the emitted token at its depth
    targets = emitted.gather(1, depth.clamp(max=emitted.shape[1] - 1)).to(tree.tokens.dtype)
    on_path = accepted_nodes(tree, targets) & (depth < accept_lens[:, None].to(depth.dtype))
    on_path[:, 0] = False  # the root is committed; the 1 below is the bonus token
    through = 1.0 + on_path.float().cumsum(1)  # [bs, w_run]: accepted through node i
    # columns one by one (a list index would be a host-to-device copy, i.e. a sync)
    return torch.stack([through[:, min(w, w_run) - 1] for w in widths], dim=1)


def truncate(tree: DraftTree, width: int) -> DraftTree:
    """The first `width` nodes of a tree (root included) as a tree of their own: what the
    builder gives for budget width - 1 (prefix-closed best-first order; a node's children and
    its siblings after it come later, so a link past the cut means none is left). On the device,
    no host sync."""
    N = tree.num_nodes
    if not 1 <= width <= N:
        raise ValueError(f"width must be in [1, {N}], got {width}")
    return DraftTree(
        tokens=tree.tokens[:, :width],
        parents=tree.parents[:, :width],
        depth=tree.depth[:, :width],
        first_child=cut_links(tree.first_child, width),
        next_sibling=cut_links(tree.next_sibling, width),
        visibility=tree.visibility[:, :width, :width],
        scores=tree.scores[:, :width],
    )


def cut_links(link: torch.Tensor, width: int) -> torch.Tensor:
    """[bs, width]: the first `width` nodes' links [bs, N] (first child or next sibling), -1 for
    a link past the cut."""
    link = link[:, :width]
    return torch.where(link < width, link, torch.full_like(link, -1))


def chain_expected_tokens(top1_logprobs: torch.Tensor) -> torch.Tensor:
    """[bs] float32: chain DFlash's expected tokens per round from the drafter's top-1 log-probs
    at each block position [bs, L]."""
    return 1.0 + top1_logprobs.float().cumsum(1).exp().sum(1)

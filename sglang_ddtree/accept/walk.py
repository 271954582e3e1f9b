"""Batched accept walk (ddtree.md §2 "Acceptance"): static shapes, no host synchronisation.

Node i is on the accepted path iff every non-root node j on its root path carries the target
token of j's parent (the walk moves to the child whose token the target produced; siblings are
distinct, so at most one child matches). With the ancestor-or-self visibility this is one
[bs, N, N] reduction; the path nodes have distinct depths 0..a, so path[depth[i]] = i.
`accept_reference.accept_walk_reference` is the plain loop this must agree with exactly.
"""

from __future__ import annotations

import torch

from sglang_ddtree.tree.inputs import check_accept_inputs
from sglang_ddtree.tree.types import AcceptResult, DraftTree


def accepted_nodes(tree: DraftTree, target_tokens: torch.Tensor) -> torch.Tensor:
    """[bs, N] bool: node is on the accepted path (the root always is)."""
    parent_target = target_tokens.gather(1, tree.parents.clamp(min=0))  # [bs, N]
    matches = tree.tokens == parent_target  # [bs, N]
    matches[:, 0] = True
    # [b, i] = every ancestor-or-self j of i matches
    return (matches[:, None, :] | ~tree.visibility).all(dim=-1)


def accept_walk(tree: DraftTree, target_tokens: torch.Tensor, max_depth: int) -> AcceptResult:
    """Walk the tree against target_tokens [bs, N] int64; results padded to D = max_depth + 1.

    Precondition (not checked, it would need a sync): every tree depth is <= max_depth, which
    holds for trees built from topk_ids with L = max_depth positions.
    """
    check_accept_inputs(tree, target_tokens, max_depth)
    bs, N = tree.tokens.shape
    D = max_depth + 1
    on_path = accepted_nodes(tree, target_tokens)  # [bs, N]
    num_accepted = on_path.sum(dim=1) - 1  # [bs]

    # Off-path nodes scatter into a spare column D, dropped afterwards.
    slot = torch.where(on_path, tree.depth, D)  # [bs, N]
    node_ids = torch.arange(N, device=slot.device).expand(bs, N)
    path = torch.full((bs, D + 1), -1, dtype=torch.int64, device=slot.device)
    path = path.scatter(1, slot, node_ids)[:, :D]  # [bs, D]

    deepest = path.gather(1, num_accepted[:, None])  # [bs, 1]
    bonus = target_tokens.gather(1, deepest)  # [bs, 1]
    path_tokens = tree.tokens.gather(1, path[:, 1:].clamp(min=0))  # [bs, D-1]
    k = torch.arange(D - 1, device=slot.device)  # [D-1]
    emitted = torch.where(k < num_accepted[:, None], path_tokens, -1)  # [bs, D-1]
    emitted = torch.cat([emitted, torch.full_like(bonus, -1)], dim=1)  # [bs, D]
    emitted = emitted.scatter(1, num_accepted[:, None], bonus)
    return AcceptResult(path=path, num_accepted=num_accepted, bonus=bonus[:, 0], emitted=emitted)

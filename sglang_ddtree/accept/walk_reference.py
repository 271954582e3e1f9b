"""Plain-Python accept walk: the specification for `accept.accept_walk`."""

from __future__ import annotations

import torch

from sglang_ddtree.tree.inputs import check_accept_inputs
from sglang_ddtree.tree.types import AcceptResult, DraftTree


def _walk_one(tokens: list[int], parents: list[int], target: list[int]) -> list[int]:
    """Root-first accepted path: move to the child whose token the target produced."""
    path = [0]
    while True:
        node = path[-1]
        children = [j for j in range(len(tokens)) if parents[j] == node]
        matched = [j for j in children if tokens[j] == target[node]]
        if not matched:
            return path
        assert len(matched) == 1, f"siblings {children} of node {node} repeat a token"
        path.append(matched[0])


def accept_walk_reference(
    tree: DraftTree, target_tokens: torch.Tensor, max_depth: int
) -> AcceptResult:
    """Same contract as `accept.accept_walk`, one Python loop per request."""
    check_accept_inputs(tree, target_tokens, max_depth)
    D = max_depth + 1
    paths, counts, bonuses, emitted = [], [], [], []
    tokens, parents, targets = tree.tokens.tolist(), tree.parents.tolist(), target_tokens.tolist()
    for tok, par, tgt in zip(tokens, parents, targets, strict=True):
        path = _walk_one(tok, par, tgt)
        if len(path) > D:
            raise ValueError(f"accepted depth {len(path) - 1} exceeds max_depth={max_depth}")
        bonus = tgt[path[-1]]
        out = [tok[j] for j in path[1:]] + [bonus]
        paths.append(path + [-1] * (D - len(path)))
        counts.append(len(path) - 1)
        bonuses.append(bonus)
        emitted.append(out + [-1] * (D - len(out)))

    def as_tensor(rows: list) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int64, device=tree.tokens.device).reshape(
            len(tokens), -1
        )

    return AcceptResult(
        path=as_tensor(paths),
        num_accepted=as_tensor(counts).reshape(-1),
        bonus=as_tensor(bonuses).reshape(-1),
        emitted=as_tensor(emitted),
    )

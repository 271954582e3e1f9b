"""The draft tree as data: one fixed-width layout shared by every builder, walker and backend.

A batch of trees has `bs` requests and `N = budget + 1` nodes per request. Node 0 is the root
(the last committed token, i.e. the previous round's bonus token); nodes 1..budget are draft
tokens in best-first order, so `parents[b, i] < i` (topological) and a node's score never
exceeds its parent's. Every request has exactly N nodes: the builders refuse a budget the
candidate set cannot fill.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class DraftTree(NamedTuple):
    tokens: torch.Tensor  # [bs, N] int64: node 0 = root token
    parents: torch.Tensor  # [bs, N] int64: -1 at the root, else parent index < own index
    depth: torch.Tensor  # [bs, N] int64: 0 at the root; positions = committed_len + depth
    first_child: torch.Tensor  # [bs, N] int64: SGLang retrieve_next_token, -1 for a leaf
    next_sibling: torch.Tensor  # [bs, N] int64: SGLang retrieve_next_sibling, -1 for the last
    visibility: torch.Tensor  # [bs, N, N] bool: [b, i, j] = j is i or an ancestor of i
    scores: torch.Tensor  # [bs, N] float32: log Q(root->node path) = sum of log-probs; root 0

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def positions(self, committed_len: torch.Tensor) -> torch.Tensor:
        """[bs, N] int64 absolute positions; committed_len [bs] is the root's position."""
        return committed_len.to(self.depth.dtype)[:, None] + self.depth


class AcceptResult(NamedTuple):
    """Outcome of the accept walk. D = max depth + 1 = L + 1 (root included)."""

    path: torch.Tensor  # [bs, D] int64: node indices root-first, -1 after the deepest accepted
    num_accepted: torch.Tensor  # [bs] int64: accepted draft nodes (depth of deepest), 0..L
    bonus: torch.Tensor  # [bs] int64: target token at the deepest accepted node
    emitted: torch.Tensor  # [bs, D] int64: tokens[path[1..a]] then bonus, -1 padded (a+1 valid)

"""Contracts between the reference engine's parts (batch 1, CPU or GPU, transformers 5.19.0).

The round, in the paper's five steps:
  draft    DraftRunner.draft_logits(bonus, position) -> per-position logits of q_1..q_L
  build    sglang_ddtree.tree.build_tree(...) -> DraftTree
  verify   TargetRunner.verify(tree) -> logits and tapped hidden states of every node (no commit)
  accept   sglang_ddtree.tree.accept_walk(...) -> accepted path + bonus
  commit   TargetRunner.commit(path); DraftRunner.append_context(taps of the accepted nodes)

Token bookkeeping: the root of a round is the previous round's bonus token, which is *not* yet in
the target's cache. Its position is `committed_len`. Verify computes the root and every node at
position committed_len + depth; commit keeps the root and the accepted nodes, so committed_len
grows by num_accepted + 1 and the new bonus becomes the next root.
"""

from __future__ import annotations

from typing import Protocol

import torch


class TargetRunner(Protocol):
    vocab_size: int
    committed_len: int  # tokens whose KV / recurrent state is committed

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] int64 -> (logits [T, V] float32, taps [T, n_taps * hidden])."""
        ...

    def verify(
        self,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        depth: torch.Tensor,
        visibility: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One tree (node 0 = root), [N] / [N, N] tensors -> (logits [N, V] f32, taps [N, n_taps*H]).

        Node i sees the committed prefix and its ancestors-or-self; recurrent layers run each node
        from its parent's state. Nothing is committed until `commit`.
        """
        ...

    def commit(self, path: torch.Tensor) -> None:
        """path [a+1] int64 node indices root-first (the accepted nodes of the last verify)."""
        ...


class DraftRunner(Protocol):
    block_size: int  # B; the draft proposes L = B - 1 positions

    def append_context(self, taps: torch.Tensor) -> None:
        """taps [n, n_taps * hidden] of newly committed target tokens, in order."""
        ...

    def draft_logits(self, bonus: int, position: int) -> torch.Tensor:
        """Block [bonus, MASK x (B-1)] at positions position.. -> logits [B-1, V] float32."""
        ...

"""A TargetRunner with no cache at all: the plain reference beside `target.HFTargetRunner`.

Every node of a verified tree is recomputed from scratch: the committed token ids followed by
the node's root-to-node path, one ordinary causal forward. That is exactly the definition of what
tree verification must produce (for attention and for recurrent Gated DeltaNet layers alike), so
it is slow but obviously right, and the engine tests use it as a cross-check.
"""

from __future__ import annotations

import torch
from torch import nn


def _text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _root_paths(parents: torch.Tensor) -> list[list[int]]:
    """parents [N] (-1 at the root) -> for each node, its node indices root-first."""
    parent_list = parents.tolist()
    paths: list[list[int]] = []
    for node, parent in enumerate(parent_list):
        assert parent < node, "tree nodes must be in topological order"
        paths.append([node] if parent < 0 else paths[parent] + [node])
    return paths


class NaiveTargetRunner:
    """TargetRunner (see base.py) that keeps only the committed token ids, no KV or GDN state."""

    def __init__(self, model: nn.Module, tap_layer_ids: list[int]) -> None:
        config = _text_config(model)
        self.model = model
        self.tap_layer_ids = list(tap_layer_ids)
        self.vocab_size: int = config.vocab_size
        self.hidden_size: int = config.hidden_size
        self.num_layers: int = config.num_hidden_layers
        self.max_position_embeddings: int = config.max_position_embeddings
        self._device = next(model.parameters()).device
        self._committed = torch.zeros(0, dtype=torch.long, device=self._device)  # [C]
        self._last_tokens: torch.Tensor | None = None  # [N] tokens of the last verify

    @property
    def committed_len(self) -> int:
        return int(self._committed.numel())

    @torch.no_grad()
    def _forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [S, T] -> (logits [S, T, V] f32, taps [S, T, n_taps * H])."""
        out = self.model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
        taps = torch.cat([out.hidden_states[i + 1] for i in self.tap_layer_ids], dim=-1)
        return out.logits.float(), taps

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._committed = input_ids.to(self._device, torch.long).clone()
        logits, taps = self._forward(self._committed[None])
        return logits[0], taps[0]

    def verify(
        self,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        depth: torch.Tensor,
        visibility: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        paths = _root_paths(parents)
        width = self.committed_len + max(len(p) for p in paths)
        # Right padding is harmless: every model here is causal, and we read each row at its end.
        seqs = torch.zeros(len(paths), width, dtype=torch.long, device=self._device)  # [N, W]
        seqs[:, : self.committed_len] = self._committed
        for node, path in enumerate(paths):
            seqs[node, self.committed_len : self.committed_len + len(path)] = tokens[path]
        logits, taps = self._forward(seqs)
        last = torch.tensor([self.committed_len + len(p) - 1 for p in paths], device=self._device)
        rows = torch.arange(len(paths), device=self._device)
        self._last_tokens = tokens.to(self._device, torch.long).clone()
        return logits[rows, last], taps[rows, last]

    def commit(self, path: torch.Tensor) -> None:
        assert self._last_tokens is not None, "commit() needs a verify() first"
        kept = self._last_tokens[path.to(self._device)]  # [a + 1]
        self._committed = torch.cat([self._committed, kept])
        self._last_tokens = None

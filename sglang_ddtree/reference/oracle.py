"""A drafter that agrees with the target, to exercise deep and non-chain accepted paths.

A random tiny DFlash draft almost never agrees with a random tiny target, so an engine test with
it only ever accepts depth 0. The OracleDrafter instead proposes the target's own greedy
continuation, with the true token deterministically demoted to rank 1 or 2 at some positions: at
T=0 the accepted path then follows the rank-0 chain where nothing was demoted and a side branch
(a rank-1/2 sibling) where something was, which is exactly what a tree buys over a chain.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang_ddtree.reference.engine import generate_plain, model_limits


class OracleDrafter:
    """DraftRunner (see base.py) backed by the target model itself.

    The engine tells it the committed token ids through `observe(ids)` (taps are ignored).
    Per drafted position i (1..L) the logits rank every vocabulary token: the target's greedy
    token at rank r_i (r_i = 0, or 1 / 2 with probability `noise`), the others in a seeded random
    order, and rank k gets logit -gap * k. Draws are keyed by (seed, root position), so a run is
    reproducible and independent of call history.
    """

    def __init__(
        self,
        model: nn.Module,
        block_size: int,
        noise: float = 0.15,
        seed: int = 0,
        gap: float = 3.0,
        lookahead: int = 64,
    ) -> None:
        if block_size < 2 or not 0.0 <= noise <= 1.0 or gap <= 0:
            raise ValueError(
                f"need block_size >= 2, 0 <= noise <= 1, gap > 0; got block_size={block_size}, "
                f"noise={noise}, gap={gap}"
            )
        self.model = model
        self.block_size = block_size
        self.noise = noise
        self.seed = seed
        self.gap = gap
        self.lookahead = lookahead
        self.vocab_size, self.max_position_embeddings = model_limits(model)
        self._committed: list[int] = []
        # A token sequence whose entries from index _greedy_from on are the target's greedy
        # continuation of what precedes them; at T=0 most rounds just read the next L of them.
        self._known: list[int] = []
        self._greedy_from = 0

    def reset(self) -> None:
        self._committed, self._known, self._greedy_from = [], [], 0

    def observe(self, ids: torch.Tensor) -> None:
        """ids [n] int64: newly committed tokens, in order."""
        self._committed.extend(int(t) for t in ids.tolist())

    def append_context(self, taps: torch.Tensor) -> None:
        """Taps carry nothing the oracle needs; it reads token ids from `observe`."""

    def _truth(self, bonus: int) -> list[int]:
        """The target's greedy continuation of committed + [bonus]: L tokens."""
        sequence = self._committed + [bonus]
        num_positions = self.block_size - 1
        start, stop = len(sequence), len(sequence) + num_positions
        known = self._known[:start] == sequence and start >= self._greedy_from
        if not (known and len(self._known) >= stop):
            room = num_positions + self.lookahead
            if self.max_position_embeddings is not None:
                room = min(room, self.max_position_embeddings - start)
            more = generate_plain(self.model, sequence, room).tokens if room > 0 else []
            self._known, self._greedy_from = sequence + more, start
        # Past the context limit nothing can be verified anyway; any token will do.
        truth = self._known[start:stop]
        return truth + [0] * (num_positions - len(truth))

    def draft_logits(self, bonus: int, position: int) -> torch.Tensor:
        """-> logits [L, V] float32 for block positions 1..L (L = block_size - 1)."""
        if position != len(self._committed):
            raise ValueError(
                f"OracleDrafter saw {len(self._committed)} committed tokens but was asked to "
                f"draft at position {position}; call observe() with every committed token"
            )
        device = next(self.model.parameters()).device
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + position)
        num_positions = self.block_size - 1
        logits = torch.empty(num_positions, self.vocab_size)  # [L, V]
        demote = torch.rand(num_positions, generator=generator) < self.noise  # [L]
        demoted_rank = torch.randint(1, 3, (num_positions,), generator=generator)  # [L]
        rank_logits = -self.gap * torch.arange(self.vocab_size, dtype=torch.float32)  # [V]
        for i, true_token in enumerate(self._truth(bonus)):
            order = torch.randperm(self.vocab_size, generator=generator)  # [V]
            order = order[order != true_token]  # [V - 1]
            rank = int(demoted_rank[i]) if demote[i] else 0
            order = torch.cat([order[:rank], torch.tensor([true_token]), order[rank:]])  # [V]
            logits[i, order] = rank_logits
        return logits.to(device)

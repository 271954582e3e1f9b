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

MEMO_SIZE = 1024  # remembered (prefix -> truth, logits) entries


class OracleDrafter:
    """DraftRunner (see base.py) backed by the target model itself.

    The engine tells it the committed token ids through `observe(ids)` (taps are ignored).
    Per drafted position i (1..L) the logits rank every vocabulary token: the target's greedy
    token at rank r_i (r_i = 0, or 1 / 2 with probability `noise`), the others in the order of
    the target's own logits at that position of the greedy path, and rank k gets logit -gap * k
    (sharp, so best-first trees are deep). Demotions are drawn from a generator keyed by
    (seed, root position): a run is reproducible and independent of call history.
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
        self._known_logits = torch.zeros(0, self.vocab_size)  # [len(_known), V]
        self._memo: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}

    def reset(self) -> None:
        """Forget the committed tokens (a new request). The greedy cache stays: it depends only
        on the token prefix, so it is still right for the next request."""
        self._committed = []

    def observe(self, ids: torch.Tensor) -> None:
        """ids [n] int64: newly committed tokens, in order."""
        self._committed.extend(int(t) for t in ids.tolist())

    def append_context(self, taps: torch.Tensor) -> None:
        """Taps carry nothing the oracle needs; it reads token ids from `observe`."""

    def _extend(self, sequence: list[int]) -> None:
        """Make `_known` = sequence + its greedy continuation (>= L tokens when the context
        allows), with the target's logits along it."""
        room = self.block_size - 1 + self.lookahead
        if self.max_position_embeddings is not None:
            room = min(room, self.max_position_embeddings - len(sequence))
        more = generate_plain(self.model, sequence, room).tokens if room > 0 else []
        self._known, self._greedy_from = sequence + more, len(sequence)
        ids = torch.tensor([self._known], device=next(self.model.parameters()).device)  # [1, S]
        positions = torch.arange(ids.shape[1], device=ids.device)[None]  # [1, S]
        with torch.no_grad():
            out = self.model(input_ids=ids, position_ids=positions, use_cache=False)
        self._known_logits = out.logits[0].float().cpu()  # [S, V]: row j predicts token j + 1

    def _truth(self, bonus: int) -> tuple[list[int], torch.Tensor]:
        """-> (the target's greedy continuation of committed + [bonus], L tokens;
        the target's logits at those L positions [L, V])."""
        sequence = self._committed + [bonus]
        key = tuple(sequence)
        if key in self._memo:  # sampled runs revisit the same short prefixes many times
            return self._memo[key]
        num_positions = self.block_size - 1
        start, stop = len(sequence), len(sequence) + num_positions
        known = self._known[:start] == sequence and start >= self._greedy_from
        if not (known and len(self._known) >= stop):
            self._extend(sequence)
        truth = self._known[start:stop]
        logits = self._known_logits[start - 1 : stop - 1]  # [<= L, V]
        # Past the context limit nothing can be verified anyway; any token will do.
        missing = num_positions - len(truth)
        result = truth + [0] * missing, torch.cat([logits, torch.zeros(missing, self.vocab_size)])
        if len(self._memo) >= MEMO_SIZE:
            self._memo.clear()
        self._memo[key] = result
        return result

    def draft_logits(self, bonus: int, position: int) -> torch.Tensor:
        """-> logits [L, V] float32 for block positions 1..L (L = block_size - 1)."""
        if position != len(self._committed):
            raise ValueError(
                f"OracleDrafter saw {len(self._committed)} committed tokens but was asked to "
                f"draft at position {position}; call observe() with every committed token"
            )
        num_positions = self.block_size - 1
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + position)
        demote = torch.rand(num_positions, generator=generator) < self.noise  # [L]
        demoted_rank = torch.randint(1, 3, (num_positions,), generator=generator)  # [L]
        rank_logits = -self.gap * torch.arange(self.vocab_size, dtype=torch.float32)  # [V]
        truth, target_logits = self._truth(bonus)  # L, [L, V]
        logits = torch.empty(num_positions, self.vocab_size)  # [L, V]
        for i, true_token in enumerate(truth):
            order = target_logits[i].argsort(descending=True, stable=True)  # [V]
            order = order[order != true_token]  # [V - 1]
            rank = int(demoted_rank[i]) if demote[i] else 0
            order = torch.cat([order[:rank], torch.tensor([true_token]), order[rank:]])  # [V]
            logits[i, order] = rank_logits
        return logits.to(next(self.model.parameters()).device)

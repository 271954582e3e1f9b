"""Budget by load: how many of a tree's nodes to verify, from the verify's measured cost and the
drafter's own expected acceptance (the policy; wiring it into the server is not done yet).

The builders emit nodes in non-increasing q(u) (the drafter's probability of the root->u path),
so the first n nodes of an N-node DDTree are the best n-node tree, prefix-closed, and under the
drafter's factorised distribution a tree T yields 1 + sum_{u in T} q(u) tokens per round in
expectation (the DDTree paper's Proposition 1; the 1 is the target's bonus token). One build at
the largest width therefore gives every smaller width's tree and its prediction. Chain DFlash is
the top-1 path: 1 + sum_d prod_{i <= d} p_i(top 1).

The prediction assumes the target accepts what the drafter believes; `Calibration` scales it by
the running ratio of observed to predicted acceptance. The policy picks the width (or the chain)
with the most expected tokens per millisecond of verify at the running batch size.

    truncate   the first w nodes of a built tree as a w-node tree (the smaller build, exactly)
    widths     verify widths N (nodes, root included) the server can run, e.g. captured graphs
    cost       CostTable: ms per round for (batch size, width), measured
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import torch

from .types import DraftTree

CHAIN = 0  # the width `choose_width` returns for chain DFlash


def expected_tokens(scores: torch.Tensor, widths: Sequence[int]) -> torch.Tensor:
    """[bs, len(widths)] float32: 1 + sum of q over the first w nodes' drafted part (node 0 is
    the root) for each width w, from the tree's scores [bs, N] (log q, root 0)."""
    q = scores.float().exp()
    q[:, 0] = 0.0  # the root is already committed; the 1 below is the bonus token
    total = 1.0 + q.cumsum(1)  # [bs, N]: through node i
    index = torch.tensor([w - 1 for w in widths], device=scores.device)
    if (index < 0).any() or (index >= scores.shape[1]).any():
        raise ValueError(f"widths {list(widths)} must be in [1, {scores.shape[1]}]")
    return total[:, index]


def truncate(tree: DraftTree, width: int) -> DraftTree:
    """The first `width` nodes of a tree (root included) as a tree of their own: what the
    builder gives for budget width - 1 (prefix-closed best-first order; a node's children and
    its siblings after it come later, so a link past the cut means none is left). On the device,
    no host sync."""
    N = tree.num_nodes
    if not 1 <= width <= N:
        raise ValueError(f"width must be in [1, {N}], got {width}")

    def cut(link: torch.Tensor) -> torch.Tensor:
        link = link[:, :width]
        return torch.where(link < width, link, torch.full_like(link, -1))

    return DraftTree(
        tokens=tree.tokens[:, :width],
        parents=tree.parents[:, :width],
        depth=tree.depth[:, :width],
        first_child=cut(tree.first_child),
        next_sibling=cut(tree.next_sibling),
        visibility=tree.visibility[:, :width, :width],
        scores=tree.scores[:, :width],
    )


def chain_expected_tokens(top1_logprobs: torch.Tensor) -> torch.Tensor:
    """[bs] float32: chain DFlash's expected tokens per round from the drafter's top-1 log-probs
    at each block position [bs, L]."""
    return 1.0 + top1_logprobs.float().cumsum(1).exp().sum(1)


class Calibration:
    """A running ratio observed / predicted tokens per round (exponential average), so that the
    policy's predictions follow what the target really accepts."""

    def __init__(self, decay: float = 0.9, start: float = 1.0) -> None:
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay, self.ratio = decay, start

    def update(self, observed: float, predicted: float) -> float:
        if predicted > 0:
            self.ratio = self.decay * self.ratio + (1 - self.decay) * observed / predicted
        return self.ratio


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Verify cost, ms per round, measured at some batch sizes for each width (CHAIN: the
    chain's). Between measured batch sizes it interpolates linearly; beyond them it extrapolates
    from the last two (a round's cost grows with the batch once it is compute-bound)."""

    batch_sizes: tuple[int, ...]
    ms: dict[int, tuple[float, ...]]  # width -> ms at each of batch_sizes

    def __post_init__(self) -> None:
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or not self.batch_sizes:
            raise ValueError(f"batch sizes must be increasing, got {self.batch_sizes}")
        for width, row in self.ms.items():
            if len(row) != len(self.batch_sizes) or min(row) <= 0:
                raise ValueError(f"width {width}: need {len(self.batch_sizes)} positive ms")

    def cost(self, bs: int, width: int) -> float:
        xs, ys = self.batch_sizes, self.ms[width]
        if len(xs) == 1:
            return ys[0]
        i = min(max(bisect.bisect_left(xs, bs), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (bs - x0) / (x1 - x0), min(ys))


def choose_width(cost: CostTable, expected: torch.Tensor, widths: Sequence[int],
                 chain: torch.Tensor | None = None, ratio: float = 1.0) -> int:  # fmt: skip
    """The width (or CHAIN) with the most expected tokens per ms for this batch: expected
    [bs, len(widths)] from `expected_tokens`, chain [bs] from `chain_expected_tokens` (None:
    the chain is not a choice), both host tensors (one round late, so no device wait), scaled by
    the calibration ratio. Ties go to the smaller width."""
    bs = expected.shape[0]
    options = [(float(expected[:, j].sum()) * ratio, w) for j, w in enumerate(widths)]
    if chain is not None and CHAIN in cost.ms:
        options.append((float(chain.sum()) * ratio, CHAIN))
    rates = [(tokens / cost.cost(bs, w), -w, w) for tokens, w in options if w in cost.ms]
    if not rates:
        raise ValueError(f"no cost measured for any of the widths {list(widths)}")
    return max(rates)[2]

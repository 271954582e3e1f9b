"""Budget by load: how many of a tree's nodes to verify, from the verify's measured cost and the
drafter's own expected acceptance (the policy; round/widths.py runs it in the server).

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

    truncate       the first w nodes of a built tree as a w-node tree (the smaller build, exactly)
    verify_widths  the widths N (nodes, root included) the server captures verify graphs for
    cost           CostTable: ms per round for (batch size, width), measured (projections)
    WidthPolicy    the server's per-round choice: round costs it measures itself per (batch
                   bucket, width), predictions and accepted lengths one round late
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import statistics
from collections.abc import Sequence

import torch

from .accept import accepted_nodes
from .types import DraftTree

CHAIN = 0  # the width `choose_width` returns for chain DFlash


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


class Calibration:
    """The ratio of observed to predicted tokens per round over about the last `horizon` requests'
    rounds (sums weighted by requests, older ones fading geometrically), so that the policy's
    predictions follow what the target really accepts. None before any reading; its first
    reading alone at first, then the mean of all readings until they span the horizon.

    A ratio of sums, by requests, because one request's round is noisy (a batch-1 server's rounds
    accept 1 to 16 tokens): an average of the last few rounds' ratios read a width 20% better or
    worse than it was, and the width the policy stops choosing keeps the reading that stopped it
    (biased low)."""

    def __init__(self, horizon: float = 256.0) -> None:
        if not horizon >= 1:
            raise ValueError(f"horizon must be >= 1 (requests), got {horizon}")
        self.keep = 1.0 - 1.0 / horizon
        self.observed = self.predicted = 0.0

    @property
    def ratio(self) -> float | None:
        return self.observed / self.predicted if self.predicted > 0 else None

    def update(self, observed: float, predicted: float, requests: int = 1) -> float | None:
        """One round's mean observed and predicted tokens per request, over `requests`."""
        if predicted > 0:
            fade = self.keep**requests
            self.observed = fade * self.observed + observed * requests
            self.predicted = fade * self.predicted + predicted * requests
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


def choose_width(
    cost: CostTable,
    expected: torch.Tensor,
    widths: Sequence[int],
    chain: torch.Tensor | None = None,
    ratio: float = 1.0,
) -> int:
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


def verify_widths(
    block_size: int,
    num_nodes: int,
    given: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """The verify widths a server runs, increasing, the largest N = num_nodes: `given` (each in
    [B, N]; N is added), else B, 2B, 4B, ... below N, and N. Widths start at the DFlash block B:
    a B-node DDTree holds at least the chain's expected tokens (the best B-node tree, which the
    chain is one of) at the chain's verify width, so the chain itself is not a separate choice."""
    B, N = block_size, num_nodes
    if given is None:
        widths = {N}
        w = B
        while w < N:
            widths.add(w)
            w *= 2
        return tuple(sorted(widths))
    bad = [w for w in given if not B <= w <= N]
    if bad:
        raise ValueError(
            f"SGLANG_DDTREE_WIDTHS {list(given)}: every width must be in [B, N] = "
            f"[{B}, {N}] (--speculative-dflash-block-size, "
            f"--speculative-num-draft-tokens); {bad} are not."
        )
    return tuple(sorted({*given, N}))


def automatic_widths(
    width: str, block_size: int, num_nodes: int, given: Sequence[int] | None = None
) -> tuple[int, ...]:
    """The verify widths a server chooses among per round: `verify_widths` with
    SGLANG_DDTREE_WIDTH=auto (`width`) and several of them; () where every round runs at N."""
    widths = verify_widths(block_size, num_nodes, given)
    return widths if width == "auto" and len(widths) > 1 else ()


class WidthPolicy:
    """The verify width of each round: the one with the most expected tokens per millisecond at
    the running batch, from costs measured on the server's own rounds.

    - Cost: the round's GPU time (CUDA events, read when they have completed; no waiting), the
      median of the last `window` rounds per (batch bucket, width), the bucket being the
      CUDA-graph batch size a batch pads to. A median, not a mean: the events also time the
      host's stalls inside a round, and on a host-bound server one stall reads 10x a round
      (the GPU suite's tables). A bucket first runs every width `explore` times
      (the calibration: a few rounds per bucket). After it, a width the policy is not
      choosing is run again, for window // 2 + 1 rounds in a row (enough to move its median),
      once `refresh` rounds of that bucket times its shortfall over `tolerance` have passed
      without it: shortfall = 1 - its rate / the chosen width's, the interval at least
      `refresh` rounds. A width within `tolerance` of the chosen one is watched every
      `refresh` rounds; one 30% slower every 15 x `refresh` (tolerance 0.02), so watching it
      costs about 0.3% of the bucket's time where a fixed interval cost 5% (the 27B round
      table: tests/unit/test_widths.py). The chosen width runs in all the other rounds and needs
      no refresh; if its cost rises, the shortfalls shrink and the others are watched sooner.
      Batches beyond the graphs' sizes (or without graphs) round up to a power of two.
    - Tokens: per width, the drafter's expected tokens per request (1 + sum of q over the first w
      nodes), averaged over recent rounds (`decay`), times that width's ratio of accepted to
      predicted tokens over about the last `horizon` requests (`Calibration`), read on the
      rounds that ran it or a wider width: a round at width w also gives what each narrower
      width would have accepted (`accepted_at_widths`), so the narrower widths are read on the
      same rounds as the chosen one. A width not yet read takes the ratio of every round.
    - Both are made monotone in the width before they are compared, as the true ones are: a
      wider tree costs at least and accepts at least what a narrower one does (`costs`,
      `tokens`). Between equal rates the wider width wins.
    Host floats only; the server feeds it readings one round late (round/widths.py)."""

    def __init__(
        self,
        widths: Sequence[int],
        buckets: Sequence[int] = (),
        decay: float = 0.8,
        explore: int = 3,
        refresh: int = 32,
        window: int = 5,
        tolerance: float = 0.02,
        horizon: float = 256.0,
    ) -> None:
        if not widths or list(widths) != sorted(set(widths)):
            raise ValueError(f"widths must be increasing, got {list(widths)}")
        if min(explore, refresh, window) < 1:
            raise ValueError(
                f"explore, refresh and window must be >= 1, got {explore}, {refresh}, {window}"
            )
        if not 0 < tolerance <= 1:
            raise ValueError(f"tolerance must be in (0, 1], got {tolerance}")
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.widths, self.buckets = tuple(widths), tuple(sorted(buckets))
        self.decay, self.explore, self.refresh = decay, explore, refresh
        self.tolerance = tolerance
        self.ran_at: dict[tuple[int, int], int] = {}  # (bucket, width) -> the bucket's round
        self.cost: dict[tuple[int, int], float] = {}  # (bucket, width) -> ms, the median
        self.recent: dict[tuple[int, int], collections.deque] = {}  # the last `window` ms
        self.window = window
        self.samples: collections.Counter = collections.Counter()  # (bucket, width) -> rounds
        self.predicted: list[float] | None = None  # per width, tokens per request
        self.ratio = {w: Calibration(horizon) for w in widths}
        self.overall = Calibration(horizon)
        self.rounds = 0
        self.bucket_rounds: collections.Counter = collections.Counter()  # bucket -> rounds
        self.burst: dict[int, list] = {}  # bucket -> [width, rounds left] of a refresh
        self.chosen: collections.Counter = collections.Counter()  # width -> rounds
        self.eager: collections.Counter = collections.Counter()  # width -> rounds without graphs
        self.calibrated: list[int] = []  # buckets just calibrated (newly_calibrated)
        self.announced: set[int] = set()

    def bucket(self, bs: int) -> int:
        """The batch bucket bs pads to: the smallest bucket >= bs, else the power of two >= bs
        (beyond the graphs, or without them, batches still share a few calibrations)."""
        i = bisect.bisect_left(self.buckets, bs)
        return self.buckets[i] if i < len(self.buckets) else 1 << max(bs - 1, 0).bit_length()

    def choose(self, bs: int) -> int:
        self.rounds += 1
        b = self.bucket(bs)
        self.bucket_rounds[b] += 1
        untried = [w for w in reversed(self.widths) if self.samples[b, w] < self.explore]
        burst = self.burst.get(b)
        if untried:  # calibration: the widest first (the configured N)
            width = untried[0]
        elif burst and burst[1] > 0:  # a refresh runs a few rounds, enough to move a median
            width, burst[1] = burst[0], burst[1] - 1
        else:
            cost, tokens = self.costs(b), self.all_tokens()
            rate = {w: tokens[w] / max(cost[w], 1e-6) for w in self.widths}
            width = max(self.widths, key=lambda w: (rate[w], w))
            stale = self._overdue(b, rate, width)
            if stale is not None:  # keep the others' costs fresh, the closer ones more often
                width = stale
                self.burst[b] = [width, self.window // 2]
        self.ran_at[b, width] = self.bucket_rounds[b]
        self.chosen[width] += 1
        return width

    def _overdue(self, bucket: int, rate: dict[int, float], best: int) -> int | None:
        """The width other than `best` most overdue for a refresh in this bucket (None: none is
        due): due once refresh x max(1, shortfall / tolerance) of the bucket's rounds have
        passed since it last ran, shortfall = 1 - its rate / best's."""
        now, due = self.bucket_rounds[bucket], []
        for w in self.widths:
            if w == best:
                continue
            shortfall = 1.0 - rate[w] / max(rate[best], 1e-12)
            interval = self.refresh * max(1.0, shortfall / self.tolerance)
            overdue = (now - self.ran_at.get((bucket, w), 0)) / interval
            if overdue >= 1.0:
                due.append((overdue, w))
        return max(due)[1] if due else None

    def costs(self, bucket: int) -> dict[int, float]:
        """The bucket's measured costs made non-decreasing in the width (a wider tree verifies
        the narrower one's nodes and more): neighbouring widths measured the other way round
        are pooled to their mean (pool adjacent violators, equal weights), so a host-bound
        server's noise (flat costs that read 4.2 ms at 32 and 6.0 at 16) cannot make the
        narrower tree look cheaper than the wider."""
        blocks: list[list] = []  # [mean, count, widths]
        for w in self.widths:
            blocks.append([self.cost[bucket, w], 1, [w]])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                (m1, n1, w1), (m2, n2, w2) = blocks.pop(-2), blocks.pop()
                blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2, w1 + w2])
        return {w: mean for mean, _, ws in blocks for w in ws}

    def tokens(self, width: int) -> float:
        """Expected tokens per request and round at `width`, calibrated (1.0 before any reading:
        then the cheapest width wins), and at least a narrower width's: the wider tree holds the
        narrower one, so it accepts at least as much; a per-width ratio that says otherwise was
        learned on other rounds (one server's table read 1.63 at 16 against 1.55 at 32)."""
        return self.all_tokens()[width]

    def all_tokens(self) -> dict[int, float]:
        """`tokens` of every width, narrowest first: the running maximum of the calibrated."""
        out, best = {}, 0.0
        for w in self.widths:
            best = max(best, self._calibrated(w))
            out[w] = best
        return out

    def _calibrated(self, width: int) -> float:
        if self.predicted is None:
            return 1.0
        ratio = self.ratio[width].ratio
        if ratio is None:
            ratio = self.overall.ratio if self.overall.ratio is not None else 1.0
        return self.predicted[self.widths.index(width)] * ratio

    def observe_cost(self, bs: int, width: int, ms: float) -> None:
        key = (self.bucket(bs), width)
        recent = self.recent.setdefault(key, collections.deque(maxlen=self.window))
        recent.append(ms)
        self.cost[key] = statistics.median(recent)
        self.samples[key] += 1
        b = key[0]  # readings come late, so a width may pass `explore`: at least, once
        if b not in self.announced and all(self.samples[b, w] >= self.explore for w in self.widths):
            self.announced.add(b)
            self.calibrated.append(b)

    def newly_calibrated(self) -> list[int]:
        """Buckets whose every width got its calibration rounds since the last call."""
        done, self.calibrated = self.calibrated, []
        return done

    def observe_tokens(
        self,
        width: int,
        predicted: Sequence[float],
        accepted: float,
        narrower: dict[int, float] | None = None,
        requests: int = 1,
    ) -> None:
        """One round's readings, each a mean over its `requests`: the predicted tokens at every
        width, the tokens the round accepted (bonus included) at the width it ran, and
        (`narrower`) what it would have accepted at narrower widths."""
        if len(predicted) != len(self.widths):
            raise ValueError(f"need {len(self.widths)} predictions, got {len(predicted)}")
        if any(w >= width or w not in self.widths for w in narrower or {}):
            raise ValueError(
                f"narrower widths {sorted(narrower)} must be the policy's, below {width}"
            )
        if self.predicted is None:
            self.predicted = [float(p) for p in predicted]
        else:
            d = self.decay
            self.predicted = [
                d * old + (1 - d) * p for old, p in zip(self.predicted, predicted, strict=True)
            ]
        for w, tokens in {**(narrower or {}), width: accepted}.items():
            self.ratio[w].update(float(tokens), float(predicted[self.widths.index(w)]), requests)
        self.overall.update(accepted, float(predicted[self.widths.index(width)]), requests)

    def table(self) -> str:
        """The measured cost table (ms per round; '-' not measured) and the chosen widths."""
        buckets = sorted({b for b, _ in self.cost})
        head = "bs  " + " ".join(f"{w:>8}" for w in self.widths)
        rows = [
            f"{b:<4}"
            + " ".join(
                f"{self.cost[b, w]:8.2f}" if (b, w) in self.cost else f"{'-':>8}"
                for w in self.widths
            )
            for b in buckets
        ]
        monotone = self.all_tokens()
        tokens = " ".join(f"{w}: {monotone[w]:.2f}" for w in self.widths)
        if any(monotone[w] != self._calibrated(w) for w in self.widths):  # raised: the ratios
            tokens += (
                " (as calibrated: "
                + " ".join(f"{w}: {self._calibrated(w):.2f}" for w in self.widths)
                + ")"
            )
        chosen = ", ".join(f"{w} x {n}" for w, n in sorted(self.chosen.items()))
        lines = [
            head,
            *rows,
            f"tokens per request and round: {tokens}",
            f"widths chosen: {chosen or 'none yet'}",
        ]
        if self.eager:
            eager = ", ".join(f"{w} x {n}" for w, n in sorted(self.eager.items()))
            lines.append(f"verified without CUDA graphs: {eager}")
        return "\n".join(lines)

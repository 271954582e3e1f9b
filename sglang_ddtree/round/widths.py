"""The width policy, in one module: the verify width of every round, among the widths the
target has verify CUDA graphs for (config.automatic_widths lists them from the options).

- `WidthPolicy`: the per-round choice, from round costs it measures itself per (batch bucket,
  width) and the drafter's predictions, scaled by what the target accepted (`Calibration`);
  `CostTable` and `choose_width` are the same choice on a given cost table (the projections of
  scripts/project_budget.py). The tree's part (truncation, predictions, the accepted tokens at
  each width) is accept/budget.py.

- `VerifyWidths`: per extra width, the target's own attention backend and a DecodeCudaGraphRunner
  captured at that width (as SGLang's adaptive EAGLE builds one per step count,
  compat.build_target_verify_state); `use(width)` swaps them in for one verify and back.
- `RankWidths`: at --tp-size > 1, rank 0's choice broadcast to every TP rank each round.
- `RoundReadings`: per round, on the device, the drafter's expected tokens at every width
  (1 + sum of q over the first w nodes, from the tree's scores: the draft head writes them
  inside the draft's CUDA graph) and the tokens accepted at the round's width and at each
  narrower one (tree.budget.accepted_at_widths, from the accepted path), copied into pinned
  host memory in one copy, with CUDA events at the round's start and end. A later round reads
  a slot once its end event has completed (`Event.query`, which never waits), so the host
  never waits on the device; a reading not ready by the time its slot comes round is dropped.

The width changes which nodes are verified (the first w of the one N-node build: the best
w-node tree, tree/budget.truncate), never how tokens are accepted.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import logging
import statistics
import time
from collections.abc import Sequence

import torch

from sglang_ddtree.adapter import compat
from sglang_ddtree.state import round_memory

logger = logging.getLogger(__name__)


CHAIN = 0  # the width `choose_width` returns for chain DFlash


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


class WidthPolicy:
    """The verify width of each round: the one with the most expected tokens per millisecond at
    the running batch, from costs measured on the server's own rounds.

    - Cost: the round's GPU time (CUDA events, read when they have completed; no waiting), the
      median of the last `window` rounds per (batch bucket, width), the bucket being the
      CUDA-graph batch size a batch pads to. A median, not a mean: the events also time the
      host's stalls inside a round, and on a host-bound server one stall reads 10x a round
      (the GPU suite's tables).
    - Calibration, narrowest first: a bucket runs its narrowest width `explore` times, then the
      next, and goes on widening only while the widest width it has measured is the best by
      rate (`known`, `_to_explore`). A width is chosen only among the bucket's measured ones, so
      a wide tree at a large batch is never run blindly: where 32 already loses to 16 (the 27B
      table at batch 8 and up) 64, 128 and 256 are never run there; should a refresh later find
      the widest measured width best (the acceptance rose), the next one is explored then.
      After it, a width the policy is not
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
        self.announced: set[tuple[int, int]] = set()  # (bucket, calibrated widths)

    def bucket(self, bs: int) -> int:
        """The batch bucket bs pads to: the smallest bucket >= bs, else the power of two >= bs
        (beyond the graphs, or without them, batches still share a few calibrations)."""
        i = bisect.bisect_left(self.buckets, bs)
        return self.buckets[i] if i < len(self.buckets) else 1 << max(bs - 1, 0).bit_length()

    def choose(self, bs: int) -> int:
        self.rounds += 1
        b = self.bucket(bs)
        self.bucket_rounds[b] += 1
        explore = self._to_explore(b)
        burst = self.burst.get(b)
        if explore is not None:  # calibration: narrowest first, wider while the widest pays
            width = explore
        elif burst and burst[1] > 0:  # a refresh runs a few rounds, enough to move a median
            width, burst[1] = burst[0], burst[1] - 1
        else:
            rate = self.rates(b)
            width = max(rate, key=lambda w: (rate[w], w))
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
        for w in rate:
            if w == best:
                continue
            shortfall = 1.0 - rate[w] / max(rate[best], 1e-12)
            interval = self.refresh * max(1.0, shortfall / self.tolerance)
            overdue = (now - self.ran_at.get((bucket, w), 0)) / interval
            if overdue >= 1.0:
                due.append((overdue, w))
        return max(due)[1] if due else None

    def known(self, bucket: int) -> tuple[int, ...]:
        """The bucket's calibrated widths: its narrowest ones, each read `explore` times."""
        n = 0
        while n < len(self.widths) and self.samples[bucket, self.widths[n]] >= self.explore:
            n += 1
        return self.widths[:n]

    def _to_explore(self, bucket: int) -> int | None:
        """The width the bucket's calibration runs next (None: none): the narrowest unread one,
        once its narrower neighbour is the best of the bucket's calibrated widths (or fewer
        than two are calibrated, or it has begun)."""
        known = self.known(bucket)
        if len(known) == len(self.widths):
            return None
        nxt = self.widths[len(known)]
        if len(known) < 2 or self.samples[bucket, nxt] > 0:
            return nxt
        rate = self.rates(bucket)
        return nxt if max(rate, key=lambda w: (rate[w], w)) == known[-1] else None

    def rates(self, bucket: int) -> dict[int, float]:
        """Expected tokens per ms of each calibrated width of the bucket (`costs`, `tokens`)."""
        cost, tokens = self.costs(bucket), self.all_tokens()
        return {w: tokens[w] / max(cost[w], 1e-6) for w in cost}

    def costs(self, bucket: int) -> dict[int, float]:
        """The bucket's measured costs (its calibrated widths, `known`) made non-decreasing in
        the width (a wider tree verifies the narrower one's nodes and more): neighbouring widths
        measured the other way round are pooled to their mean (pool adjacent violators, equal
        weights), so a host-bound server's noise (flat costs that read 4.2 ms at 32 and 6.0 at
        16) cannot make the narrower tree look cheaper than the wider."""
        blocks: list[list] = []  # [mean, count, widths]
        for w in self.known(bucket):
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
        done = (b, len(self.known(b)))  # once per extent: a later widening announces again
        if done[1] and done not in self.announced and self._to_explore(b) is None:
            self.announced.add(done)
            self.calibrated.append(b)

    def newly_calibrated(self) -> list[int]:
        """Buckets whose calibration (`_to_explore`) has stopped since the last call."""
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


MIN_FREE_GB = 2.0  # an extra width's graphs are not captured with less GPU memory free


class VerifyWidths:
    """The target's verify state (attention backend, CUDA-graph runner) at each width. Start-up
    stops, naming the width, where the attention buffers SGLang allocates for a width's graphs
    at the graphs' largest batch and the context length (round_memory.verify_graph_bytes) are
    more than the memory free; a width whose graphs cannot be captured beyond that (under
    MIN_FREE_GB left beside its buffers, a capture that runs out of memory) is dropped with a
    warning: the server serves the others (`widths` is what is left)."""

    def __init__(
        self, model_runner, widths: tuple[int, ...], capture: bool = True, free_gb=None
    ) -> None:
        """free_gb: the GB free that decides whether a width is captured (default this GPU's;
        at tp > 1 the least of every rank's, compat.least_free_gb, so that all ranks capture
        the same widths: a capture runs the target's forward and its collectives)."""
        self.model_runner = model_runner
        self.widest = N = widths[-1]
        self.states = {N: compat.target_verify_state(model_runner)}
        self.buckets = compat.graph_batch_sizes(self.states[N][1])
        graphs = capture and self.states[N][1] is not None
        for width in reversed(widths[:-1]):  # the widest first, as SGLang captures batches
            state = self._capture(width, free_gb or _free_gb) if graphs else self.states[N]
            if state is not None:
                self.states[width] = state
        self.widths = tuple(sorted(self.states))

    def graph_bytes(self, width: int) -> int:
        """Bytes of the attention buffers of `width`'s verify graphs (SGLang's FlashInfer
        backend's, at the graphs' largest batch and the model's context length)."""
        backend = self.states[self.widest][0]
        return round_memory.verify_graph_bytes(
            max_bs=max(self.buckets, default=0),
            width=width,
            context_len=int(self.model_runner.model_config.context_len),
            wrappers=int(getattr(backend, "num_wrappers", 1)),
        )

    def _capture(self, width: int, free_gb):
        """The verify state at `width` (None: dropped), its graphs captured; RuntimeError where
        their attention buffers do not fit in the memory free (round_memory.check_width)."""
        tic, free = time.perf_counter(), free_gb()
        need = self.graph_bytes(width)
        round_memory.check_width(width, need, free, max(self.buckets, default=0))
        if (spare := free - need / round_memory.GIB) < MIN_FREE_GB:
            msg = "DDTREE: width %d dropped: %.1f GB free beside its graphs' buffers (needs %.1f)"
            logger.warning(msg, width, spare, MIN_FREE_GB)
            return None
        try:
            state = compat.build_target_verify_state(self.model_runner, width)
        except Exception as exc:
            if "out of memory" not in f"{exc} {exc.__context__}".lower():
                raise  # anything but memory may have broken the CUDA context: stop here
            msg = "DDTREE: width %d dropped: its verify graphs did not fit (%s)"
            logger.warning(msg, width, str(exc)[:300])
            return None
        if state is None:
            return self.states[self.widest]
        logger.info(
            "DDTREE: target verify graphs at width %d captured in %.1f s, %.2f GB",
            width,
            time.perf_counter() - tic,
            free - _free_gb(),
        )
        return state

    def keep(self, widths: tuple[int, ...]) -> None:
        """Serve only `widths` (RankWidths.agree's: what every TP rank captured); N stays, and
        the others' graphs are let go."""
        self.widths = tuple(w for w in self.widths if w in widths or w == self.widths[-1])
        for width in [w for w in self.states if w not in self.widths]:
            del self.states[width]

    @contextlib.contextmanager
    def use(self, width: int):
        if width == self.widths[-1]:
            yield
            return
        before = compat.target_verify_state(self.model_runner)
        compat.set_target_verify_state(self.model_runner, self.states[width])
        try:
            yield
        finally:
            compat.set_target_verify_state(self.model_runner, before)


class RankWidths:
    """At --tp-size > 1, one verify width for every TP rank: rank 0's policy chooses and `share`
    broadcasts the choice on the TP group's CPU (gloo) group each round, before any rank
    launches its verify. At start-up the ranks decide each width's capture from the least
    free memory of them all (compat.least_free_gb), and `agree` keeps the widths every rank
    captured. A
    capture that fails on one rank alone (anything but the memory check) still stops the
    others in its collectives, as SGLang's own captures would. Per round a host collective of
    one number, no device sync: SGLang's scheduler broadcasts each round's new requests on the
    same group."""

    def __init__(self, group, source: int, is_source: bool, dist=None) -> None:
        self.group, self.source, self.is_source = group, source, is_source
        self.dist = dist if dist is not None else torch.distributed
        self.buffer = torch.zeros(1, dtype=torch.int64)

    def agree(self, configured: tuple[int, ...], captured: tuple[int, ...]) -> tuple[int, ...]:
        """The configured widths that every rank captured."""
        have = torch.tensor([int(w in captured) for w in configured], dtype=torch.int32)
        self.dist.all_reduce(have, op=self.dist.ReduceOp.MIN, group=self.group)
        return tuple(w for w, kept in zip(configured, have.tolist(), strict=True) if kept)

    def share(self, width: int | None) -> int:
        """Rank 0's `width` on every rank (the others pass None)."""
        if self.is_source:
            self.buffer[0] = width
        self.dist.broadcast(self.buffer, src=self.source, group=self.group)
        return int(self.buffer[0])


def _free_gb() -> float:
    """Free GPU memory, GB, after returning the caching allocator's unused blocks."""
    if not torch.cuda.is_available():
        return float("inf")
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    return free / (1 << 30)


@dataclasses.dataclass
class _Slot:
    host: torch.Tensor  # [max_bs, 2W] float32, pinned: predictions | accepted, per width
    start: object  # CUDA events (timing)
    end: object
    bs: int = 0
    width: int = 0
    pending: bool = False

    def __post_init__(self) -> None:
        self.array = self.host.numpy()  # the same memory: numpy's mean is the cheaper call


class RoundReadings:
    """Readings of past rounds for the policy, one round late or more, without host waits.

    buffer [max_bs, 2 * len(widths)] float32 on the device (the draft head's `readings`): each
    round's expected tokens per request at `widths` (the configured ones; the policy's are those
    whose graphs were captured), written by the draft head; `finish` adds the tokens accepted
    at each width (those wider than the round's read as its own) in the other half and copies
    the rows to the host."""

    def __init__(
        self, policy: WidthPolicy, buffer: torch.Tensor, widths, slots: int = 4, event=None
    ) -> None:
        self.policy, self.buffer = policy, buffer
        if buffer.shape[1] != 2 * len(widths) or not set(policy.widths) <= set(widths):
            raise ValueError(
                f"readings of widths {list(widths)} ({buffer.shape[1]} columns) "
                f"cannot serve the policy's {list(policy.widths)}"
            )
        self.columns = [list(widths).index(w) for w in policy.widths]
        self.accepted_columns = [len(widths) + c for c in self.columns]
        pin = torch.cuda.is_available() and buffer.device.type == "cuda"
        event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self.slots = [
            _Slot(torch.zeros(tuple(buffer.shape), pin_memory=pin), event(), event())
            for _ in range(slots)
        ]
        self.next = 0
        self.current: _Slot | None = None

    def poll(self) -> int:
        """Feed the policy every completed reading; returns how many."""
        done = 0
        oldest_first = self.slots[self.next :] + self.slots[: self.next]
        for slot in oldest_first:
            if slot.pending and not slot.end.query():
                break  # one stream: the later rounds have not completed either
            if slot.pending:
                slot.pending = False
                mean = slot.array[: slot.bs].mean(0).tolist()  # host memory: no device work
                predicted = [mean[c] for c in self.columns]
                accepted = {
                    w: mean[c]
                    for w, c in zip(self.policy.widths, self.accepted_columns, strict=True)
                    if w <= slot.width
                }
                run = accepted.pop(slot.width)
                self.policy.observe_tokens(slot.width, predicted, run, accepted, slot.bs)
                self.policy.observe_cost(slot.bs, slot.width, slot.start.elapsed_time(slot.end))
                done += 1
        return done

    def start(self, bs: int, width: int) -> None:
        """At the round's start: claim the next slot (skipped when its reading is still out)."""
        slot = self.slots[self.next]
        self.current = None
        if slot.pending:  # still in flight after len(slots) rounds: drop this round's
            return
        self.next = (self.next + 1) % len(self.slots)
        slot.bs, slot.width = bs, width
        slot.start.record()
        self.current = slot

    def finish(self, accepted: torch.Tensor) -> None:
        """At the round's end, the tokens it accepted at each read width [bs, W]
        (tree.budget.accepted_at_widths; the buffer holds its expected tokens): one write and
        one device-to-host copy."""
        slot = self.current
        if slot is None:
            return
        rows = self.buffer[: slot.bs]
        rows[:, rows.shape[1] // 2 :].copy_(accepted)
        slot.host[: slot.bs].copy_(rows, non_blocking=True)
        slot.end.record()
        slot.pending = True
        self.current = None

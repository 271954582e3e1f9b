"""Budget by load in the server: the verify width of every round, chosen by tree/budget.py's
`WidthPolicy` among widths the target has verify CUDA graphs for.

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

import contextlib
import dataclasses
import logging
import time

import torch

from sglang_ddtree.adapter import compat
from sglang_ddtree.tree.budget import WidthPolicy

logger = logging.getLogger(__name__)


MIN_FREE_GB = 2.0  # an extra width's graphs are not captured with less GPU memory free


class VerifyWidths:
    """The target's verify state (attention backend, CUDA-graph runner) at each width. A width
    whose graphs cannot be captured (too little memory left, a capture that fails) is dropped
    with a warning: the server serves the others (`widths` is what is left)."""

    def __init__(
        self, model_runner, widths: tuple[int, ...], capture: bool = True, free_gb=None
    ) -> None:
        """free_gb: the GB free that decides whether a width is captured (default this GPU's;
        at tp > 1 the least of every rank's, compat.least_free_gb, so that all ranks capture
        the same widths: a capture runs the target's forward and its collectives)."""
        free_gb = free_gb or _free_gb
        self.model_runner = model_runner
        N = widths[-1]
        self.states = {N: compat.target_verify_state(model_runner)}
        graphs = capture and self.states[N][1] is not None
        for width in reversed(widths[:-1]):  # the widest first, as SGLang captures batches
            if not graphs:  # no CUDA graphs: the one backend verifies every width
                self.states[width] = self.states[N]
                continue
            tic, free = time.perf_counter(), free_gb()
            if free < MIN_FREE_GB:
                logger.warning(
                    "DDTREE: width %d dropped: %.1f GB free for its verify graphs (needs %.1f)",
                    width,
                    free,
                    MIN_FREE_GB,
                )
                continue
            try:
                state = compat.build_target_verify_state(model_runner, width)
            except Exception as exc:
                if "out of memory" not in f"{exc} {exc.__context__}".lower():
                    raise  # anything but memory may have broken the CUDA context: stop here
                logger.warning(
                    "DDTREE: width %d dropped: its verify graphs did not fit (%s)",
                    width,
                    str(exc)[:300],
                )
                continue
            if state is None:
                self.states[width] = self.states[N]
                continue
            self.states[width] = state
            logger.info(
                "DDTREE: target verify graphs at width %d captured in %.1f s, %.2f GB",
                width,
                time.perf_counter() - tic,
                free - _free_gb(),
            )
        self.widths = tuple(sorted(self.states))
        self.buckets = compat.graph_batch_sizes(self.states[N][1])

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

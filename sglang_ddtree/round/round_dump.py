"""Opt-in dump of sampled DDTREE rounds as JSON lines, for `python -m sglang_ddtree.tree.show`.

    SGLANG_DDTREE_DUMP_ROUNDS=/path/rounds.jsonl   [SGLANG_DDTREE_DUMP_EVERY=100]

Every EVERY-th decode round (counted on the host, so choosing costs nothing) the worker hands
its tree and its result to `RoundDump.round`: the tensors are copied into pinned host memory
with non_blocking copies on the current stream and a CUDA event is recorded after them; a
background thread waits for the event and writes one line per request. The decode round never
waits on the host: no .item(), .tolist() or synchronize on its thread. Unset (the default),
the worker holds no RoundDump and does nothing.

A line: {"round", "request", "width", "tokens" [N], "parents" [N], "q" [N] (path
probabilities), "emitted" [a+1] (the accepted drafts, then the bonus)}; tree/show.py recovers
the accepted path from "emitted".

A debugging aid must not take the server with it: a write that fails (a full disk, an unwritable
path) is logged once and the dump turns itself off; so does a file that reaches MAX_BYTES (the
round that crossed it written: the lines are ASCII, a character a byte); `round` never waits (a
full queue skips the round) and `close` waits at most `timeout` seconds for the writer.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
from pathlib import Path

import torch

from sglang_ddtree.config import Options

logger = logging.getLogger(__name__)


MAX_BYTES = 1 << 30  # a dump stops at 1 GiB


class RoundDump:
    def __init__(
        self, path: str | Path, every: int = 100, max_pending: int = 8, max_bytes: int = MAX_BYTES
    ) -> None:
        if every < 1:
            raise ValueError(f"SGLANG_DDTREE_DUMP_EVERY must be >= 1, got {every}")
        self.path, self.every, self.max_bytes = Path(path), every, max_bytes
        self._rounds = self._written = 0
        self._off = threading.Event()  # set once the dump has stopped (a failure, the cap)
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._write, name="ddtree-round-dump", daemon=True)
        self._thread.start()

    @classmethod
    def from_options(cls, options: Options) -> RoundDump | None:
        """The dump `options` ask for (SGLANG_DDTREE_DUMP_ROUNDS / _EVERY), None when off."""
        return cls(options.dump_rounds, options.dump_every) if options.dump_rounds else None

    @property
    def on(self) -> bool:
        return not self._off.is_set()

    def round(self, tokens, parents, scores, emitted, accept_lens) -> None:
        """Record this round if it is a sampled one. tokens / parents [bs, N] int64, scores
        [bs, N] float32 log path probabilities, emitted [bs, B] int (the first accept_lens[b]
        are the round's tokens), accept_lens [bs]; any device."""
        self._rounds += 1
        if self._rounds % self.every or self._queue.full() or not self.on:  # never waits
            return
        host = [_to_pinned(t) for t in (tokens, parents, scores, emitted, accept_lens)]
        event = None
        if tokens.is_cuda:
            event = torch.cuda.Event()
            event.record()
        try:
            self._queue.put_nowait((self._rounds, event, host))
        except queue.Full:  # the writer is behind: this round goes unrecorded
            pass

    def close(self, timeout: float = 5.0) -> None:
        """Stop the writer once it has written what is queued; waits at most `timeout` s."""
        try:
            self._queue.put_nowait(None)
        except queue.Full:  # a writer that is behind stops after its current item
            self._off.set()
        self._thread.join(timeout=timeout)

    def _write(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                self._written = f.tell()  # a file appended to counts from its size
                while not self._off.is_set() and (item := self._queue.get()) is not None:
                    self._written += self._write_round(f, *item)
                    f.flush()
                    if self._written >= self.max_bytes:
                        self._stop(f"it reached its cap of {self.max_bytes} bytes")
        except OSError as exc:
            self._stop(f"writing {self.path} failed: {exc}")

    def _stop(self, why: str) -> None:
        self._off.set()
        logger.warning("sglang_ddtree: the round dump stopped (%s); serving goes on", why)

    @staticmethod
    def _write_round(f, number, event, host) -> int:
        """One sampled round's lines; the characters written."""
        tokens, parents, scores, emitted, lens = host
        if event is not None:
            event.synchronize()  # this thread waits, the decode loop does not
        written = 0
        for b in range(tokens.shape[0]):
            n = int(lens[b])
            line = {
                "round": number,
                "request": b,
                "width": int(tokens.shape[1]),
                "tokens": tokens[b].tolist(),
                "parents": parents[b].tolist(),
                "q": [math.exp(s) for s in scores[b].tolist()],
                "emitted": emitted[b, :n].tolist(),
            }
            written += f.write(json.dumps(line) + "\n")
        return written


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    if not t.is_cuda:
        return t.detach().clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out

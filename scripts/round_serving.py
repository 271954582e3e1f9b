"""bench_round.py --serving: end to end at Qwen3.6-27B shapes through SGLang's load generator,
`sglang.bench_serving` (scripts/bench_serving.py's prompts and arguments, `harness.bench_args`),
against one variant's server at a time; rows to OUT/serving_simulated_27b.jsonl.

Short cells (the default): per concurrency c a first wave of c requests, unmeasured, then
prompts_for(c, --requests-per-client) requests of --serving-tokens new tokens, one row. With so
few requests and tokens the prefills fill much of a run at low c, so its tokens/s is not the
decode's.

--steady-state: bench_serving.py's steady state on one server at a time. Per variant a probe
run (a short cell, its row mode="probe") per concurrency, c = 1 included, measures the server's
prefill P (its median TTFT at c = 1: a lone request's) and its TPOT at c; each cell then runs
R requests per client of T new tokens (`harness.steady_plan`: T >= w x P x (1 - s) / (s x TPOT)
and R >= 1 / (2 s), s = --prefill-share, w = min(c, the server's running requests): a wave's
prefills, and the first wave's ramp and the last one's tail, each stay under s of the run).
The variants' servers run one after another, so a cell takes its own variant's R and T, not the
largest of all the variants' as bench_serving's cells do (its servers are up together); in the
steady state tokens/s hangs on T only through the longer contexts' attention, and every row
says its R and T. A cap keeps a cell bounded at high c (`cap`): where one run's estimate,
w-request waves of prefills and T rounds at the probe's TPOT, passes --max-cell-seconds, R comes
down to --requests-per-client, then T to --serving-tokens; T never passes what the context and
the KV cache hold for w requests (`token_ceiling`). --runs runs per cell (2): run 1 of every c,
then run 2, so that a drift of the machine lands between a cell's runs and in their spread.
Rows: each run's, mode="steady", with `run`, `requests_per_client` (R), `tokens` (T),
`prefill_ms` (P), `prefill_share` (completed x P / duration, as measured; an upper bound, P
being a lone request's), `prefill_share_limit` (s), `capped` (the cap lowered R or T),
`asked` (the rule's R and T) and `estimated_s`; then each cell's kind="spread" row: its runs'
tokens/s, their median and spread, (max - min) / median. The same file holds them all, so one
`results_page.py add` carries a sitting; a row's `kind` or `mode` says what it is (none: a
short cell, as before).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import harness  # beside this script (scripts/harness.py)
from harness import bench_args, prompts_for, run_bench, write_dataset

MAX_CELL_SECONDS = 120.0  # --max-cell-seconds: one run of a steady cell, as estimated
PROMPT_TOKENS = 512  # a prompt's room where the probe did not say its length
KV_HEADROOM = 0.9  # of the KV cache's tokens, what a cell's running requests may fill


def add_arguments(p: argparse.ArgumentParser) -> None:
    """bench_round.py's --serving flags."""
    p.add_argument(
        "--serving",
        default="",
        help="after each variant's rounds, "
        "sglang.bench_serving at these concurrencies (e.g. 1,8,16,32): "
        "OUT/serving_simulated_27b.jsonl",
    )
    p.add_argument(
        "--serving-variants", default="", help="the variants --serving runs on (default: every one)"
    )
    p.add_argument("--serving-tokens", type=int, default=256, help="new tokens per request")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument(
        "--steady-state",
        action="store_true",
        help="--serving runs long enough that decode rounds dominate: a probe run per "
        "concurrency (c = 1 included) gives the prefill and the TPOT, then each cell runs R "
        "requests per client of T tokens (harness.steady_plan: prefills under "
        "--prefill-share of a run), --runs times; rows carry R, T, P and the measured "
        "prefill share, a kind=spread row per cell the runs' spread",
    )
    p.add_argument("--prefill-share", type=float, default=harness.STEADY_PREFILL_SHARE)
    p.add_argument("--runs", type=int, default=None, help="runs per steady cell (2)")
    p.add_argument(
        "--max-cell-seconds",
        type=float,
        default=MAX_CELL_SECONDS,
        help="a steady cell's run at most this long, as estimated from its probe (R lowered, "
        "then T, to --requests-per-client and --serving-tokens; its rows say capped)",
    )


def check_args(args: argparse.Namespace) -> argparse.Namespace:
    """--runs belongs to --steady-state (2 unless given); a short cell is one run."""
    if args.runs is not None and not args.steady_state:
        raise SystemExit(f"--runs {args.runs} needs --steady-state (a short cell is one run)")
    if args.steady_state and not args.serving:
        raise SystemExit("--steady-state needs --serving C,... (the concurrencies it runs)")
    if args.runs is None:
        args.runs = 2 if args.steady_state else 1
    return args


def concurrencies(args: argparse.Namespace) -> list[int]:
    return [int(c) for c in args.serving.split(",") if c]


def write_prompts(args: argparse.Namespace) -> Path | None:
    """The prompt file for the largest run --serving can make (None: no --serving)."""
    cs = concurrencies(args)
    if not cs:
        return None
    per_client = args.requests_per_client
    if args.steady_state:  # the rule's R; the cap only lowers it
        per_client = harness.steady_per_client(args.prefill_share, per_client)
    return write_dataset(args.out / "prompts.jsonl", max(prompts_for(c, per_client) for c in cs))


def serve(
    server,
    dataset: Path,
    tokenizer: str,
    concurrency: int,
    tokens: int,
    per_client: int,
    out: Path,
    warm: bool = True,
) -> dict:
    """One sglang.bench_serving run at this concurrency: tokens/s, TPOT, TTFT, SGLang's accept
    length, and the run's requests, duration and mean prompt tokens. A first wave of
    `concurrency` requests goes unmeasured (warm: unless a probe at this c just ran): without
    it, each server's first run at 4 clients stalled one request about 6 s before its first
    token (a first-seen prefill shape), a third of the run."""
    prompts = prompts_for(concurrency, per_client)
    raw = out / f"bench_serving_{server.name}.jsonl"
    if warm:
        first = out / f"bench_serving_{server.name}_warmup.jsonl"
        run_bench(
            bench_args(server, dataset, tokenizer, concurrency, concurrency, 0.0, tokens, first)
        )
    result = run_bench(
        bench_args(server, dataset, tokenizer, prompts, concurrency, 0.0, tokens, raw)
    )
    completed = result.get("completed")
    return {
        "concurrency": concurrency,
        "requests": prompts,
        "tokens": tokens,
        "output_tok_s": result["output_throughput"],
        "median_tpot_ms": result.get("median_tpot_ms"),
        "median_ttft_ms": result.get("median_ttft_ms"),
        "accept_len": result.get("accept_length"),
        "completed": completed,
        "duration_s": result.get("duration"),
        "prompt_tokens": result["total_input_tokens"] / completed
        if completed and result.get("total_input_tokens")
        else None,
    }


def kv_tokens(log: str) -> int | None:
    """The KV cache's tokens SGLang settled on (its max_total_num_tokens line)."""
    found = re.findall(r"max_total_num_tokens=(\d+)", log)
    return int(found[-1]) if found else None


def token_ceiling(context: int, kv: int | None, wave: int, prompt: float) -> int:
    """The most new tokens a request of a w-request wave can take: what its context leaves
    beside the prompt, and its share of KV_HEADROOM of the KV cache (SGLang retracts running
    requests when the cache runs out, and the run is no longer the decode's)."""
    room = context - prompt
    if kv:
        room = min(room, KV_HEADROOM * kv / wave - prompt)
    return max(1, math.floor(room))


@dataclass(frozen=True)
class Cell:
    """One steady cell of one server, from its probes: the concurrency c, a wave's requests
    (min(c, running)), the prefill P (ms) and the TPOT at c (ms)."""

    concurrency: int
    wave: int
    prefill_ms: float
    tpot_ms: float

    def seconds(self, R: int, T: int) -> float:
        """A run's estimated length: prompts_for(c, R) requests in waves of `wave`, each its
        prefills, then T rounds at the probe's TPOT."""
        waves = prompts_for(self.concurrency, R) / self.wave
        return waves * (self.wave * self.prefill_ms + T * self.tpot_ms) / 1e3

    def tokens_within(self, R: int, limit_s: float) -> int:
        """The largest T whose run at R fits `limit_s`."""
        per_wave_ms = 1e3 * limit_s * self.wave / prompts_for(self.concurrency, R)
        return math.floor((per_wave_ms - self.wave * self.prefill_ms) / self.tpot_ms)


def cap(
    cell: Cell, asked: tuple[int, int], floor: tuple[int, int], limit_s: float, ceiling: int
) -> tuple[int, int]:
    """The (R, T) a cell runs: the rule's `asked`, T at most `ceiling`; while the run's estimate
    passes `limit_s`, R lowered to its floor, then T to its (the short run's), not below."""
    R, T = asked[0], min(asked[1], ceiling)
    floor_R, floor_T = min(floor[0], R), min(floor[1], T)
    while R > floor_R and cell.seconds(R, T) > limit_s:
        R -= 1
    if cell.seconds(R, T) > limit_s:
        T = max(floor_T, cell.tokens_within(R, limit_s))
    return R, T


def plan_cells(
    probes: dict[int, dict],
    name: str,
    args: argparse.Namespace,
    running: int,
    context: int,
    kv: int | None,
) -> dict[int, dict]:
    """Each asked concurrency's steady cell on server `name` from its probes (by c): the R and
    T harness.steady_plan asks, capped (`cap`), with what the rows record of the plan."""
    cs, share = concurrencies(args), args.prefill_share
    short = (args.requests_per_client, args.serving_tokens)
    asks = harness.steady_plan(
        {(name, c): row for c, row in probes.items()},
        cs,
        share,
        tokens=args.serving_tokens,
        per_client=args.requests_per_client,
        running={name: running},
    )
    plan = {}
    for c, ask in asks.items():
        cell = Cell(c, min(c, running), ask["prefill_ms"][name], probes[c]["median_tpot_ms"])
        asked = (ask["requests_per_client"], ask["tokens"])
        prompt = probes[c].get("prompt_tokens") or PROMPT_TOKENS
        ceiling = token_ceiling(context, kv, cell.wave, prompt)
        R, T = cap(cell, asked, short, args.max_cell_seconds, ceiling)
        plan[c] = {
            "requests_per_client": R,
            "tokens": T,
            "prefill_ms": cell.prefill_ms,
            "prefill_share_limit": share,
            "capped": (R, T) != asked,
            "asked": {"requests_per_client": asked[0], "tokens": asked[1]},
            "estimated_s": round(cell.seconds(R, T), 1),
        }
    return plan


def spread_row(runs: list[dict]) -> dict:
    """A steady cell's summary: its runs' tokens/s, their median and one-run spread."""
    tps = [r["output_tok_s"] for r in runs]
    keep = ("concurrency", "requests_per_client", "tokens", "prefill_ms", "capped")
    return {
        "kind": "spread",
        "mode": "steady",
        **{k: runs[0][k] for k in keep},
        "runs": len(runs),
        "runs_tok_s": tps,
        "median_tok_s": statistics.median(tps),
        "spread": harness.spread(tps),
        "prefill_shares": [r["prefill_share"] for r in runs],
    }


def steady_cells(
    server, dataset: Path, tokenizer: str, args, running: int, context: int
) -> Iterator[dict]:
    """--steady-state on one server: its probe rows, its runs' rows (run 1 of every c, then
    run 2, ...), then a spread row per cell."""
    short = (args.serving_tokens, args.requests_per_client, args.out)
    probes = {}
    for c in sorted({1, *concurrencies(args)}):
        probes[c] = {"mode": "probe", **serve(server, dataset, tokenizer, c, *short)}
        yield probes[c]
    plan = plan_cells(probes, server.name, args, running, context, kv_tokens(server.log_text()))
    runs = []
    for run in range(1, args.runs + 1):
        for c, cell in plan.items():
            size = (cell["tokens"], cell["requests_per_client"], args.out)
            row = {
                "mode": "steady",
                "run": run,
                **serve(server, dataset, tokenizer, c, *size, warm=False),
            }
            row.update(cell)
            row["prefill_share"] = harness.prefill_share(
                row["completed"] or 0, cell["prefill_ms"], row["duration_s"] or 0.0
            )
            runs.append(row)
            yield row
    for c in plan:
        yield spread_row([r for r in runs if r["concurrency"] == c])


def cells(
    server, dataset: Path, tokenizer: str, args, running: int, context: int
) -> Iterator[dict]:
    """--serving's rows on one server, short cells or (--steady-state) steady ones; each is
    yielded once its run ends, so that the caller reads the server's counters after it."""
    if args.steady_state:
        yield from steady_cells(server, dataset, tokenizer, args, running, context)
        return
    for c in concurrencies(args):
        yield serve(
            server, dataset, tokenizer, c, args.serving_tokens, args.requests_per_client, args.out
        )

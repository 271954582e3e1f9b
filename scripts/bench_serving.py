"""End to end on the shipped pair through SGLang's own load generator, `sglang.bench_serving`
(`--dataset-name custom`, held-out prompts): DDTREE with automatic widths (the default), DDTREE
at fixed N, DFLASH and plain decoding (the end-to-end target).

    python scripts/bench_serving.py --out OUT [--servers ddtree,ddtree16,ddtree32,dflash,none]
        [--concurrency 1,4,16,32] [--temperatures 0,1] [--runs 3] [--tokens 128]
        [--requests-per-client 8] [--no-pin-cpus] [--first-token N]

All servers start up front (small memory slices; their own CUDA graphs) and are measured one at
a time. Per temperature the runs alternate: run 1 of every (concurrency, server), then run 2,
..., so that a drift of the shared machine spreads over all servers alike (each run takes the
servers in an order rotated by one); the pair is host-bound and one run varies by 15-30%. A run
is --requests-per-client requests per client, at least 16, so that the batch's decode rounds,
not the first wave's prefills or its tail, fill most of it (runs of two per client lasted under
2 s). Per (server, temperature, concurrency): the median output tokens/s of the
runs and their spread (min, max), SGLang's accept length, and the median over DFLASH's median,
with the geometric mean and the range of the run-by-run ratios over DFLASH (the runs alternate,
so a run's servers are neighbours in time).
Prompts: 400-character pieces of the standard-library packages the pair's training held out
(`training.corpus.heldout_prompts`: each file's opening, then its next pieces), each distinct,
the same for every server (bench_serving shuffles them with its --seed). By default (where each
set gets at least two CPUs; --no-pin-cpus turns it off) the machine's CPUs are split into one
set per server, all of one size, and one for the load generator, the lowest CPUs (CPU 0)
and the rest (`harness.cpu_sets`), so that an idle server's processes and the client do not
share the measured server's cores; each such row says `"pinned": true` and its server's CPU
count, `"cpus"` (OUT/interrupts_start.txt and interrupts_end.txt: /proc/interrupts around the
runs). --first-token N adds one-at-a-time requests of 1-3 new tokens (OUT/first_token_pair.jsonl;
with --host-profile, host samples of the one-token requests too). --host-profile also writes
host_profile.py's tables of every sampled run, the servers side by side
(OUT/host/report_RUN.md). Output: OUT/serving_pair.jsonl (one row per run), OUT/table.md.

--steady-state: runs in which decode rounds, not prefills, fill the time. Per temperature a
probe run (the short run above, not recorded) per concurrency and server, c = 1 included,
measures a lone request's prefill (its median TTFT at c = 1, P) and the TPOT at c; each cell
then runs R requests per client of T new tokens (harness.steady_state, the largest any server
asks): T >= c x P x (1 - s) / (s x TPOT) and R >= 1 / (2 s), s = --prefill-share (0.05), so
that c prefills per wave and the first wave's ramp and the last one's tail each stay under s
of the run. Two runs per cell (--runs); each row records R, T, P and the prefill share it
measured (completed x P / duration), OUT/steady_summary.jsonl each cell's runs' tokens/s and
their spread, (max - min) / median.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import math
import os
import statistics
import time
from pathlib import Path

import harness  # beside this script (scripts/harness.py)
import round_trace  # beside this script (scripts/round_trace.py)
from harness import ADMIN_ARGS, bench_args, prompts_for, run_bench, write_dataset

from sglang_ddtree import DEMO_PAIR_DIR
from sglang_ddtree.training.corpus import heldout_prompts

COMMON = [
    *ADMIN_ARGS,  # the tools' admin calls (/flush_cache, /start_profile)
    "--attention-backend",
    "flashinfer",
    "--dtype",
    "bfloat16",
    "--mem-fraction-static",
    "0.08",
    "--max-running-requests",
    "32",
    "--cuda-graph-max-bs-decode",
    "32",
    "--disable-prefill-cuda-graph",
]
TOPK = 8
NODES = 32  # the pair's default tree: N = 2B


def server_table(
    draft: str, dflash2: str | None = None
) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (server flags, environment). With a DFlash2 draft (scripts/train_dflash2.py's,
    the same backbone as `draft`): SGLang's DFLASH on it (upstream's chain) and DDTREE on it
    (the lattice tree), beside `dflash` and `ddtree` on the DFlash draft (its marginals)."""

    def dd(path: str) -> list[str]:
        spec = ["--speculative-draft-model-path", path, "--speculative-eagle-topk", str(TOPK)]
        return ["--speculative-algorithm", "DDTREE", *spec]

    def nodes(n: int) -> list[str]:
        return ["--speculative-num-draft-tokens", str(n)]

    def dflash(path: str) -> list[str]:
        return ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", path]

    fixed = {"SGLANG_DDTREE_WIDTH": "fixed"}
    table = {
        "none": ([], {}),
        "dflash": (dflash(draft), {}),
        "ddtree": ([*dd(draft), *nodes(NODES)], {}),  # automatic widths among 16 and 32
        "ddtree64": ([*dd(draft), *nodes(64)], {}),  # automatic among 16, 32 and 64
        "ddtree16": ([*dd(draft), *nodes(16)], fixed),
        "ddtree32": ([*dd(draft), *nodes(32)], fixed),
    }
    if dflash2 is not None:
        table["dflash_dflash2"] = (dflash(dflash2), {})
        table["ddtree_dflash2"] = ([*dd(dflash2), *nodes(NODES)], {})
    return table


def summarize(rows: list[dict]) -> list[dict]:
    """Per (temperature, concurrency, server): median and spread of the runs' tokens/s, the
    median over DFLASH's median in the same run set, the geometric-mean ratio and the range of
    the run-by-run ratios (`_run_ratios`), and the medians of the runs' median TTFT and TPOT
    (DFLASH's TPOT over this server's: the decode alone, without the prefills)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["temperature"], r["concurrency"], r["server"]), []).append(r)
    med = {k: statistics.median(x["output_throughput"] for x in v) for k, v in groups.items()}
    tpot = {k: _median(x.get("median_tpot_ms") for x in v) for k, v in groups.items()}
    out = []
    for (t, c, name), runs in sorted(groups.items()):
        tps = [x["output_throughput"] for x in runs]
        base, base_tpot = med.get((t, c, "dflash")), tpot.get((t, c, "dflash"))
        out.append(
            {
                "temperature": t,
                "concurrency": c,
                "server": name,
                "runs": len(runs),
                "runs_tok_s": tps,
                "spread": harness.spread(tps),
                "median_tok_s": med[t, c, name],
                "min_tok_s": min(tps),
                "max_tok_s": max(tps),
                "accept_len": statistics.median(x.get("accept_length") or 1.0 for x in runs),
                "vs_dflash": med[t, c, name] / base if base else None,
                **_run_ratios(runs, groups.get((t, c, "dflash"), [])),
                "ttft_ms": _median(x.get("median_ttft_ms") for x in runs),
                "tpot_ms": tpot[t, c, name],
                "tpot_vs_dflash": base_tpot / tpot[t, c, name]
                if base_tpot and tpot[t, c, name]
                else None,
            }
        )
    return out


def _run_ratios(runs: list[dict], base: list[dict]) -> dict:
    """This server's tokens/s over DFLASH's, run by run (rows of the same "run" number; the runs
    alternate, so the two are neighbours in time): their geometric mean, which equals the ratio
    of the two servers' geometric means over those runs, so that a slowdown of the machine
    during one run, common to every server in it, cancels (a ratio of medians can take its two
    medians from different runs), and their min and max, the spread of one comparison. A run
    of 0 tokens/s makes the mean 0; runs DFLASH lacks or did not complete are left out."""
    numbers = [r["run"] for r in base if "run" in r]
    if len(set(numbers)) != len(numbers):
        raise ValueError(
            f"DFLASH has repeated run numbers {sorted(numbers)}: rows of two "
            "benchmarks in one summary"
        )
    dflash = {r["run"]: r["output_throughput"] for r in base if "run" in r}
    ratios = [
        r["output_throughput"] / dflash[r["run"]] for r in runs if dflash.get(r.get("run"), 0) > 0
    ]
    if not ratios:
        return {"geomean_vs_dflash": None, "run_ratio_min": None, "run_ratio_max": None}
    mean = 0.0 if min(ratios) <= 0 else math.exp(statistics.fmean(map(math.log, ratios)))
    return {"geomean_vs_dflash": mean, "run_ratio_min": min(ratios), "run_ratio_max": max(ratios)}


def _median(values) -> float | None:
    """The median of the values that are there (None: none is; older rows lack some keys)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


MIN_PINNED_CPUS = 2  # per set, for --pin-cpus's default


def pinned_cpus(cpus: list[int], servers: int, pin: bool | None) -> list[tuple[int, ...]]:
    """--pin-cpus: a CPU set per server, all of one size, then the load generator's (the lowest
    CPUs and any left over: harness.cpu_sets' first set), or none. Unset, on where every set
    gets MIN_PINNED_CPUS or more: pinned runs took out a steady excess that servers
    and client sharing cores had put on one server's rounds."""
    if pin is None:
        pin = len(cpus) >= MIN_PINNED_CPUS * (servers + 1)
    if not pin:
        return []
    client, *each = harness.cpu_sets(cpus, servers + 1)
    return [*each, client]


def snapshot_interrupts(path: Path, source: Path = Path("/proc/interrupts")) -> None:
    """A copy of the machine's interrupt counts per CPU (Linux; nothing where it cannot be
    read), before and after the measured runs: which CPUs took the interrupts while they ran,
    against the servers' CPU sets in the log."""
    with contextlib.suppress(OSError):
        path.write_text(source.read_text())


def run_order(servers: list, run: int) -> list:
    """The servers in run `run`'s order (1-based): rotated by one a run, so that no server is
    always measured first after the concurrency changes."""
    k = (run - 1) % len(servers) if servers else 0
    return servers[k:] + servers[:k]


def table(summary: list[dict]) -> str:
    lines = [
        "| T | c | server | tok/s median (min-max) | accept | / DFLASH | geo-mean / DFLASH "
        "(runs' range) | TTFT ms | TPOT ms | DFLASH's TPOT / this |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    for s in summary:
        lines.append(
            f"| {s['temperature']:g} | {s['concurrency']} | {s['server']} | "
            f"{s['median_tok_s']:.0f} ({s['min_tok_s']:.0f}-{s['max_tok_s']:.0f}) | "
            f"{s['accept_len']:.2f} | {num(s['vs_dflash'], '.2f')} | "
            f"{_ratio_cell(s)} | "
            f"{num(s.get('ttft_ms'), '.1f')} | {num(s.get('tpot_ms'), '.2f')} | "
            f"{num(s.get('tpot_vs_dflash'), '.2f')} |"
        )
    return "\n".join(lines)


def _ratio_cell(s: dict) -> str:
    """The geometric-mean ratio with the range of the run-by-run ratios, or "-"."""
    if s.get("geomean_vs_dflash") is None:
        return "-"
    return f"{s['geomean_vs_dflash']:.2f} ({s['run_ratio_min']:.2f}-{s['run_ratio_max']:.2f})"


def profile(servers: list, names: list[str], out: Path, temperatures: list[float]) -> None:
    """round_trace.profile_parts on the named servers at batch 1 and 4 and each temperature,
    after the measured runs (a profiled run is slower, so it is never one of them):
    OUT/round_profile_pair.jsonl."""
    for server in (s for s in servers if s.name in names):
        for t, bs in itertools.product(temperatures, (1, 4)):
            row = {
                "server": server.name,
                "bs": bs,
                "temperature": t,
                **round_trace.profile_parts(server, bs, out / "profiles", temperature=t),
            }
            with open(out / "round_profile_pair.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            host = row.get("host", {})
            print(
                json.dumps(
                    {
                        "server": server.name,
                        "bs": bs,
                        "temperature": t,
                        "round_period_ms": host.get("round_period_ms"),
                        "syncs_per_round": host.get("syncs_per_round"),
                    }
                ),
                flush=True,
            )


FIRST_TOKEN_LENGTHS = (1, 2, 3)


def first_token(
    servers: list, prompts: list[str], out: Path, n: int, send=None, sampled: tuple = ()
) -> list[dict]:
    """Latency of one request at a time, by new tokens (FIRST_TOKEN_LENGTHS, greedy): at 1 the
    prefill alone, at 2 and 3 one and two decode rounds behind it, so that a server's longer
    time to first token is placed in its prefill or in its first rounds. The servers alternate
    request by request (the same prompt on each in turn); a first request per server and
    length, not counted, warms the path. Rows (median and min ms) to OUT/first_token_pair.jsonl.
    Servers named in `sampled` (--host-profile's) then take the n one-token requests once more,
    alone, with their host sampler on: OUT/host/NAME/first_token/, a round per request."""
    if n < 1:
        return []
    send = send or (
        lambda server, prompt, k: harness.generate(
            server, prompt, max_new_tokens=k, temperature=0.0, ignore_eos=True
        )
    )
    rows = []
    for k in FIRST_TOKEN_LENGTHS:
        ms = {server.name: [] for server in servers}
        for i, prompt in enumerate([prompts[0], *prompts[:n]]):
            for server in servers:
                tic = time.perf_counter()
                send(server, prompt, k)
                if i:  # the first is the warm-up
                    ms[server.name].append(1e3 * (time.perf_counter() - tic))
        for server in servers:
            row = {
                "probe": "first_token",
                "server": server.name,
                "max_new_tokens": k,
                "requests": n,
                "median_ms": statistics.median(ms[server.name]),
                "min_ms": min(ms[server.name]),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(out / "first_token_pair.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
    for server in (s for s in servers if s.name in sampled):
        with sampling(server, out / "host" / server.name / "first_token") as meta:
            for prompt in prompts[:n]:
                send(server, prompt, 1)
            meta.update(probe="first_token", total_output_tokens=n, accept_length=1.0)
        print(
            f"{server.name}: first-token host samples in {out / 'host' / server.name}", flush=True
        )
    return rows


ROOT = Path(__file__).resolve().parents[1]
SAMPLER = ROOT / "scripts" / "host_sampler"


def sampled_env(env: dict[str, str], folder: Path) -> dict[str, str]:
    """A server's environment with the host sampler on PYTHONPATH (dormant until sampling)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(x for x in (str(SAMPLER), os.environ.get("PYTHONPATH")) if x)
    return {**env, "PYTHONPATH": path, "HOST_SAMPLER_DIR": str(folder)}


def host_profile(servers: list, names: list[str], dataset: Path, args) -> None:
    """One run per temperature and --host-concurrency on each named server with its host
    sampler on, after the measured runs: OUT/host/NAME/tT_cC/ (scripts/host_profile.py reads
    them)."""
    for server in (s for s in servers if s.name in names):
        for t in (float(x) for x in args.temperatures.split(",")):
            for c in (int(x) for x in args.host_concurrency.split(",")):
                sample_run(
                    server, args.out / "host" / server.name / f"t{t:g}_c{c}", dataset, t, c, args
                )


@functools.cache
def own_files() -> str:
    """sglang_ddtree's file names that no SGLang file shares. The sampler labels a frame by its
    file's name alone, so SGLang's own dflash.py or spec.py would count as the package's; a
    torch or Triton file of a package name (torch's worker.py, Triton's build.py) still would,
    but neither runs on the scheduler's thread in a decode round."""
    import importlib.util

    ours = {f.name for f in (ROOT / "sglang_ddtree").rglob("*.py")}
    spec = importlib.util.find_spec("sglang")
    dirs = (spec.submodule_search_locations or []) if spec else []
    theirs = {f.name for d in dirs for f in Path(d).rglob("*.py")}
    return ",".join(sorted(ours - theirs - {"__init__.py"}))


def host_reports(host: Path, names: list[str]) -> list[Path]:
    """host_profile.py's tables for every sampled run (tT_cC, first_token), the named servers
    side by side: HOST/report_RUN.md, the call tree from the worker's forward_batch_generation
    and the package's own frames (--own). A few kB each, where the samples are megabytes. A run
    whose samples cannot be read gets the reason in its report; the benchmark goes on."""
    import host_profile  # beside this script

    def sampled(d: Path) -> bool:
        return (d / "meta.json").exists() and any(d.glob("*.txt"))

    written = []
    for run in sorted({d.name for n in names for d in (host / n).glob("*") if sampled(d)}):
        dirs = [host / n / run for n in names if sampled(host / n / run)]
        try:
            text = (
                "## the worker's round (--focus forward_batch_generation --depth 12)\n\n"
                + host_profile.report(dirs, depth=12, focus="forward_batch_generation")
                + "\n\n## sglang_ddtree's own frames (--own)\n\n"
                + host_profile.report(dirs, own=own_files())
            )
        except (SystemExit, ValueError, KeyError, ZeroDivisionError, OSError) as exc:
            text = f"not readable: {type(exc).__name__}: {exc}"
        path = host / f"report_{run}.md"
        path.write_text(f"# host samples, {run} (scripts/host_profile.py)\n\n{text}\n")
        written.append(path)
    return written


def sample_run(server, folder: Path, dataset: Path, t: float, c: int, args) -> None:
    """One sampled run, as long as a measured one (prompts_for), so that decode rounds, not
    the prefills of the first wave, fill most of the samples."""
    with sampling(server, folder) as meta:
        meta.update(
            run_bench(
                bench_args(
                    server,
                    dataset,
                    args.target,
                    prompts_for(c, args.requests_per_client),
                    c,
                    t,
                    args.tokens,
                    folder / "raw.jsonl",
                )
            )
        )
    print(f"{server.name} T={t:g} c={c}: host samples in {folder}", flush=True)


@contextlib.contextmanager
def sampling(server, folder: Path, settle: float = 2.0):
    """The server's host sampler on for the body; then its processes' samples are moved into
    `folder` with meta.json, the dict the body filled (host_profile.py reads its
    total_output_tokens and accept_length to count rounds)."""
    sampler = Path(server.env["HOST_SAMPLER_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    for old in sampler.glob("*.txt"):
        old.unlink()
    meta: dict = {}
    (sampler / "on").touch()
    try:
        yield meta
    finally:
        (sampler / "on").unlink()
    deadline = time.monotonic() + 30
    while not list(sampler.glob("*.txt")) and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(settle)  # every sampled process writes within about 0.2 s of the others
    for f in sampler.glob("*.txt"):
        f.rename(folder / f.name)
    (folder / "meta.json").write_text(json.dumps(meta))


RESULT_KEYS = (
    "output_throughput",
    "accept_length",
    "median_tpot_ms",
    "mean_tpot_ms",
    "median_ttft_ms",
    "mean_ttft_ms",
    "completed",
    "total_output_tokens",
    "duration",
)


def default_plan(args) -> dict[int, dict]:
    """Per concurrency the run's requests per client and new tokens: the flags'."""
    cs = {int(x) for x in args.concurrency.split(",")}
    return {c: {"requests_per_client": args.requests_per_client, "tokens": args.tokens} for c in cs}


def measure(server, run: int, t: float, c: int, cell: dict, dataset: Path, args) -> dict:
    """One sglang.bench_serving run of `cell`'s requests per client and tokens: its row."""
    raw = args.out / f"raw_{server.name}.jsonl"
    n = prompts_for(c, cell["requests_per_client"])
    res = run_bench(bench_args(server, dataset, args.target, n, c, t, cell["tokens"], raw))
    row = {"run": run, "server": server.name, "temperature": t, "concurrency": c}
    row.update({k: res.get(k) for k in RESULT_KEYS})
    if "prefill_ms" in cell:  # a steady-state cell: its plan and the share its prefills took
        row.update(mode="steady", **cell)
        row["prefill_ms"] = cell["prefill_ms"][server.name]
        row["prefill_share"] = harness.prefill_share(
            row["completed"] or 0, row["prefill_ms"], row["duration"] or 0.0
        )
    return row


def steady_plan(servers: list, t: float, args, probe) -> dict[int, dict]:
    """--steady-state's cells at temperature t: a probe run (the flags' short run, not
    recorded) per concurrency and server, c = 1 first, gives each server's prefill time (its
    median TTFT at c = 1, a lone request's) and TPOT at c; each cell takes the largest R and T
    harness.steady_state asks of any server (harness.steady_plan), so that the servers of a
    cell do the same work. probe(server, run, t, c, cell) -> a row."""
    cs = sorted({1, *(int(x) for x in args.concurrency.split(","))})
    short = {"requests_per_client": args.requests_per_client, "tokens": args.tokens}
    rows = {(s.name, c): probe(s, 0, t, c, short) for c in cs for s in servers}
    plan = harness.steady_plan(rows, cs, args.prefill_share, args.tokens, args.requests_per_client)
    for c, cell in plan.items():
        R, T = cell["requests_per_client"], cell["tokens"]
        print(json.dumps({"steady_state": c, "temperature": t, "R": R, "T": T}), flush=True)
    return plan


def write_spread(summary: list[dict], path: Path) -> None:
    """--steady-state's summary rows, each with its runs' tokens/s and their one-run spread,
    (max - min) / median."""
    with open(path, "a") as f:
        for s in summary:
            f.write(json.dumps(s) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--target", default=str(DEMO_PAIR_DIR / "target"))
    p.add_argument("--draft", default=str(DEMO_PAIR_DIR / "draft"))
    p.add_argument(
        "--dflash2",
        help="a DFlash2 draft of the same pair (scripts/train_dflash2.py's OUT/draft_dflash2): "
        "adds the servers dflash_dflash2 (SGLang's chain on it) and ddtree_dflash2 (the "
        "lattice tree)",
    )
    p.add_argument("--servers", default="ddtree,ddtree16,ddtree32,dflash,none")
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--runs", type=int, default=None, help="runs per cell (3; --steady-state 2)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument(
        "--requests-per-client",
        type=int,
        default=8,
        help="requests per run and client (at least 16 a run)",
    )
    p.add_argument("--port-base", type=int, default=33000)
    p.add_argument(
        "--profile",
        default="",
        help="servers to profile after the runs (SGLang's torch profiler, batch 1 "
        "and 4 at each of --temperatures): host ms per round by function, "
        "syncs by frame, GPU ms per part, into OUT/round_profile_pair.jsonl",
    )
    p.add_argument(
        "--hold-until",
        type=Path,
        help="start the servers, then wait for this file before measuring (the GPU "
        "to itself: e.g. another job's end)",
    )
    p.add_argument(
        "--host-profile",
        default="",
        help="servers whose host time to sample, in one run per temperature and "
        "--host-concurrency after the measured runs: OUT/host/NAME/tT_cC "
        "(scripts/host_profile.py prints their call trees in ms per round)",
    )
    p.add_argument(
        "--host-concurrency", default="1", help="the concurrencies of --host-profile's runs"
    )
    p.add_argument(
        "--pin-cpus",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each server on its own CPUs, the load generator on the rest (default: "
        f"on where every set gets at least {MIN_PINNED_CPUS} CPUs)",
    )
    p.add_argument(
        "--first-token",
        type=int,
        default=0,
        help="after the runs, this many one-at-a-time /generate requests per server "
        "and length (1, 2 and 3 new tokens, greedy; the servers alternate): "
        "the prefill alone, then one and two decode rounds behind it, as "
        "rows of OUT/first_token_pair.jsonl",
    )
    p.add_argument(
        "--steady-state",
        action="store_true",
        help="runs long enough that decode rounds dominate: per temperature, a probe run per "
        "concurrency and server measures the lone request's TTFT and the TPOT, then each "
        "cell runs R requests per client of T tokens (harness.steady_state: prefills under "
        "--prefill-share of the run), --runs 2 unless given; rows carry R, T and the "
        "measured prefill share, OUT/steady_summary.jsonl both runs and their spread",
    )
    p.add_argument("--prefill-share", type=float, default=harness.STEADY_PREFILL_SHARE)
    args = p.parse_args()
    if args.runs is None:
        args.runs = 2 if args.steady_state else 3
    args.out.mkdir(parents=True, exist_ok=True)
    table_ = server_table(args.draft, args.dflash2)
    names = args.servers.split(",")
    unknown = [n for n in names if n not in table_]
    if unknown:
        raise SystemExit(f"unknown servers {unknown}; choose from {sorted(table_)}")
    profiled = [n for n in args.profile.split(",") if n]
    sampled = [n for n in args.host_profile.split(",") if n]
    for flag, chosen in (("--profile", profiled), ("--host-profile", sampled)):
        if set(chosen) - set(names):
            raise SystemExit(f"{flag} {','.join(chosen)}: only servers in --servers {names}")
    servers = []
    cpus = pinned_cpus(list(os.sched_getaffinity(0)), len(names), args.pin_cpus)
    for i, name in enumerate(names):
        flags, env = table_[name]
        if name in sampled:
            env = sampled_env(env, args.out / "host" / name / "samples")
        # a free port (another server's internal ports may hold a fixed one), above the last
        port = harness.free_port(
            max(args.port_base + 10 * i, servers[-1].port + 1 if servers else 0)
        )
        servers.append(
            harness.Server(
                name,
                args.target,
                port,
                [*COMMON, *flags],
                env=env,
                log_dir=args.out,
                cpus=cpus[i] if cpus else (),
            )
        )
        print(
            f"{name}: {servers[-1].url}" + (f", CPUs {list(cpus[i])}" if cpus else ""), flush=True
        )
    if cpus:  # the load generator (bench_serving runs in this process) on the last set
        os.sched_setaffinity(0, set(cpus[-1]))
    concurrencies = [int(x) for x in args.concurrency.split(",")]
    concurrencies += [int(x) for x in args.host_concurrency.split(",")]
    per_client = args.requests_per_client
    if args.steady_state:  # the plan's R (harness.steady_per_client), the same for every c
        per_client = harness.steady_per_client(args.prefill_share, per_client)
    requests = max(prompts_for(c, per_client) for c in concurrencies)
    dataset = write_dataset(args.out / "heldout.jsonl", requests)
    rows_path = args.out / "serving_pair.jsonl"
    rows = []
    try:
        for server in servers:  # staggered: SGLang sizes its pools from the free memory it sees
            server.start_once_more_on_exit("Memory pool end", timeout=600)
        for server in servers:
            print(f"{server.name}: healthy after {server.wait_healthy(900):.0f} s", flush=True)
        while args.hold_until is not None and not args.hold_until.exists():
            time.sleep(2)
        snapshot_interrupts(args.out / "interrupts_start.txt")
        # every temperature's runs complete before the next one's begin
        for t in (float(x) for x in args.temperatures.split(",")):
            plan = default_plan(args)
            if args.steady_state:
                plan = steady_plan(servers, t, args, lambda *a: measure(*a, dataset, args))
            for run in range(1, args.runs + 1):
                for c in (int(x) for x in args.concurrency.split(",")):
                    for server in run_order(servers, run):
                        row = measure(server, run, t, c, plan[c], dataset, args)
                        if cpus:
                            row["pinned"], row["cpus"] = True, len(server.cpus)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        with open(rows_path, "a") as f:
                            f.write(json.dumps(row) + "\n")
        snapshot_interrupts(args.out / "interrupts_end.txt")
        if args.steady_state:
            write_spread(summarize(rows), args.out / "steady_summary.jsonl")
        text = table(summarize(rows))  # before the profiles: the measured runs' table
        (args.out / "table.md").write_text(text + "\n")
        print(text, flush=True)
        if args.first_token:  # heldout_prompts reads the held-out packages' files
            prompts = heldout_prompts(args.first_token)
            first_token(servers, prompts, args.out, args.first_token, sampled=tuple(sampled))
        host_profile(servers, sampled, dataset, args)
        host_reports(args.out / "host", sampled)
        profile(servers, profiled, args.out, [float(x) for x in args.temperatures.split(",")])
    finally:
        for server in servers:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The results page, docs/results.md, and the README's generated blocks, from the data files in
docs/data/: one JSON-lines file per kind of measurement, named for what it measures.

    python scripts/results_page.py            # write docs/results.md and the README's blocks
    python scripts/results_page.py --check    # exit 1 when either differs from the data
    python scripts/results_page.py add NAME ROWS.jsonl --commit SHA [--command CMD] [--date D]
                                              # append a benchmark's rows to docs/data/NAME.jsonl

Every row carries where it came from: `date` (when measured), `commit` (the code measured),
`sitting` (one measurement session's rows; numbered in order within a file) and, where known,
`command` (what produced the rows; OUT is the script's output folder). A section shows the
latest sitting of its file; the earlier sittings stay in the file. A new kind of measurement
is one more data file and one more `Section` in SECTIONS; new rows of a known kind are one
`add` and a rerun of this script.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import statistics
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"
PAGE = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
PROVENANCE = ("date", "commit", "sitting")


# ---------------------------------------------------------------- rows


def read_rows(name: str, data: Path = DATA) -> list[dict]:
    path = data / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def latest(rows: list[dict], has: str | None = None) -> list[dict]:
    """The rows of the newest sitting (among the sittings with a row that has key `has`)."""
    sittings = [r["sitting"] for r in rows if has is None or has in r]
    if not sittings:
        return []
    newest = max(sittings)
    return [r for r in rows if r["sitting"] == newest]


def geo_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _ms(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _wrap(command: str, width: int = 92) -> str:
    """An indented shell command, continued with backslashes so that no line passes `width`
    (a flag stays on the line of its value)."""
    units, words = [], command.split()
    for word in words:
        flag = units and units[-1].startswith("-") and " " not in units[-1]
        if flag and not word.startswith("-"):
            units[-1] += " " + word  # the flag's value
        else:
            units.append(word)
    lines, line = [], "   "
    for unit in units:
        if len(line) + len(unit) + 3 > width and line.strip():
            lines.append(line + " \\")
            line = "       "
        line += " " + unit
    return "\n".join([*lines, line])


def prose(text: str, width: int = 100) -> str:
    """Paragraphs (split on blank lines) filled to `width`."""
    return "\n\n".join(
        textwrap.fill(part, width, break_on_hyphens=False, break_long_words=False)
        for part in text.split("\n\n")
    )


def table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def shown(rows: list[dict], markdown: str) -> str:
    """A table with when its rows were measured and the commands that reproduce them."""
    commands = list(dict.fromkeys(r["command"] for r in rows if r.get("command")))
    if not commands:
        return f"Measured {rows[0]['date']} (the command was not recorded).\n\n{markdown}"
    listed = "\n".join(_wrap(c) for c in commands)
    head = f"Measured {rows[0]['date']}; reproduce (OUT: an output folder):"
    return f"{head}\n\n{listed}\n\n{markdown}"


# ---------------------------------------------------------------- tables, one per kind


def conditions(rows: list[dict]) -> str:
    """The SGLang release and the acceptance a sitting's rows ran under, as a sentence."""
    release = next((r["sglang"] for r in rows if r.get("sglang")), None)
    world = next((r["simulate"] for r in rows if r.get("simulate")), None)
    if world:
        means = ", ".join(f"{m:g}" for m in world["top1"])
        accept = (
            f"the simulated `{world['name']}` world (docs/simulation.md: top-1 mean "
            f"{means} by depth, the last for every deeper one; spread "
            f"{world['spread']:g}, ratio {world['ratio']:g}, off-spine "
            f"{world['off_spine']:g}, seed {world['seed']})"
        )
    else:
        accept = "the dummy weights' (about one token a round)"
    card = next((r for r in rows if r.get("card")), None)
    on = f" on one {card['card']} ({card['target_dtype']} target)" if card else ""
    return f"SGLang {release or '0.5.17'}{on}; acceptance: {accept}."


def round_cost_table(rows: list[dict]) -> str:
    """ms per decode round by batch size: DFLASH, each DDTREE variant, and DDTREE / DFLASH.
    A batch the server could not run reads "does not fit"; a round time the method could not
    measure (not positive: the shorter batch ran slower than the longer) reads "-"."""
    rows = latest(rows)
    variants = list(dict.fromkeys(r["variant"] for r in rows if "bs" in r))
    fits = {(r["variant"], r["bs"]) for r in rows if "bs" in r and "error" not in r}
    cost = {
        (r["variant"], r["bs"]): r["round_ms"]
        for r in rows
        if "bs" in r and (r.get("round_ms") or 0) > 0
    }
    batch = sorted({r["bs"] for r in rows if r.get("bs") is not None})
    trees = [v for v in variants if v.startswith("ddtree")]
    header = ["batch", *[f"{v} ms" for v in variants], *[f"{v} / dflash" for v in trees]]
    body = []
    for bs in batch:
        cells = [
            _ms(cost.get((v, bs))) or ("-" if (v, bs) in fits else "does not fit") for v in variants
        ]
        chain = cost.get(("dflash", bs))
        ratios = [_ms(cost[(v, bs)] / chain) if chain and cost.get((v, bs)) else "" for v in trees]
        body.append([str(bs), *cells, *ratios])
    method = (
        "the slope of latency against rounds"
        if rows[0].get("method") == "slope"
        else "the difference between the median requests of 64 and 32 new tokens over the "
        "difference of their rounds, which under simulated acceptance moves with each "
        "request's accepted lengths (one request per length at batch 1)"
    )
    head = f"{conditions(rows)} Round time: {method}."
    started = {r["variant"]: r["startup"] for r in rows if r.get("startup")}
    if started:
        head += (
            " Start-up, launch to healthy (of it, the verify and draft CUDA graphs): "
            + "; ".join(
                f"{v} {t['healthy_s']:.0f} s ({t.get('target_verify', 0):.0f} s, "
                f"{t.get('draft_decode', 0):.0f} s)"
                for v, t in started.items()
            )
            + "."
        )
    return shown(rows, prose(head) + "\n\n" + table(header, body))


def serving_simulated_table(rows: list[dict]) -> str:
    """Per concurrency: each server's output tok/s, DDTREE's over DFLASH's, TPOT, tokens per
    round, ms per round (TPOT x tokens per round), and the widths an automatic server chose
    during that run (`_widths_per_run`). A --steady-state sitting has a table of its own
    (steady_serving_table)."""
    rows = latest(rows)
    if any(r.get("mode") == "steady" for r in rows):
        return steady_serving_table(rows)
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    trees = [v for v in variants if v.startswith("ddtree")]
    at = {(r["variant"], r["concurrency"]): r for r in rows}
    auto, logged = _automatic(rows, variants)
    per_run = _widths_per_run(rows, auto)
    chosen = {(rows[i]["variant"], rows[i]["concurrency"]): _widths(n) for i, n in per_run.items()}
    header = [
        "c",
        *[f"{v} tok/s" for v in variants],
        *[f"{v} / dflash" for v in trees],
        *[f"{v} TPOT ms" for v in variants],
        *[f"{v} tokens/round" for v in variants],
        *[f"{v} ms/round" for v in variants],
        *[f"{v} widths x rounds" for v in auto],
    ]
    body = []
    for c in sorted({r["concurrency"] for r in rows}):
        got = [at.get((v, c), {}) for v in variants]
        chain = at.get(("dflash", c), {}).get("output_tok_s")
        ratios = [
            _ms(at[(v, c)]["output_tok_s"] / chain) if chain and (v, c) in at else "" for v in trees
        ]
        body.append(
            [
                str(c),
                *[_ms(g.get("output_tok_s"), 0) for g in got],
                *ratios,
                *[_ms(g.get("median_tpot_ms")) for g in got],
                *[_ms(g.get("accept_len")) for g in got],
                *[_ms(_round_ms(g.get("median_tpot_ms"), g.get("accept_len")), 1) for g in got],
                *[chosen.get((v, c), "") for v in auto],
            ]
        )
    head = f"{conditions(rows)} {_running(rows)}"
    for v in logged:  # the last table the server logged, over all of its runs
        last = [r for r in rows if r["variant"] == v][-1].get("widths_chosen") or "none logged"
        head += f" Widths {v} chose over all its runs, as its log last counted: {last}."
    return shown(rows, prose(head) + "\n\n" + table(header, body))


def _automatic(rows: list[dict], variants: list[str]) -> tuple[list[str], list[str]]:
    """The automatic-width servers whose every row counted its rounds per width (/server_info),
    and those whose widths came from a log's table (which lags its rounds: no per-run share)."""
    auto = [
        v
        for v in variants
        if "_auto" in v and all("widths_rounds" in r for r in rows if r["variant"] == v)
    ]
    return auto, [v for v in variants if "_auto" in v and v not in auto]


def _widths_per_run(rows: list[dict], auto: list[str]) -> dict[int, dict[int, int]]:
    """Rounds per width of each run of the `auto` servers, by the run's index in `rows`: the
    server counts them since start-up, so a run's share is the difference from the row before
    (rows in the order the runs were made; the first run's also holds the round-cost
    measurements before it)."""
    per_run, before = {}, {}
    for i, r in enumerate(rows):
        if r["variant"] in auto and "widths_rounds" in r:
            now = {int(w): n for w, n in (r["widths_rounds"] or {}).items()}
            last = before.get(r["variant"], {})
            per_run[i] = {w: n - last.get(w, 0) for w, n in now.items() if n > last.get(w, 0)}
            before[r["variant"]] = now
    return per_run


def _widths(rounds: dict[int, int]) -> str:
    return ", ".join(f"{w} x {n}" for w, n in rounds.items())


def _round_ms(tpot_ms: float | None, accept: float | None) -> float | None:
    """What a decode round cost while serving: TPOT x tokens per round."""
    return tpot_ms * accept if tpot_ms and accept else None


def _running(rows: list[dict]) -> str:
    running = "; ".join(
        f"{v} {n}" for v, n in {r["variant"]: r["max_running"] for r in rows}.items()
    )
    return f"Running requests at most: {running}."


def steady_serving_table(rows: list[dict]) -> str:
    """A --steady-state sitting (scripts/round_serving.py): per concurrency and server, the
    median tok/s of the cell's runs, their spread (the cell's kind=spread row), the median
    over DFLASH's, the medians of TPOT and tokens per round, ms per round, R x T ("capped":
    lowered below the rule's ask), the prefill share the runs measured, and the widths an
    automatic server chose over the cell's runs. The probe runs are not shown."""
    timed = [r for r in rows if r.get("kind") != "spread"]  # probes and runs, in order
    variants = list(dict.fromkeys(r["variant"] for r in timed if r.get("mode") == "steady"))
    auto, _ = _automatic(timed, variants)
    per_run = _widths_per_run(timed, auto)
    cells: dict[tuple[int, str], list[tuple[dict, dict[int, int]]]] = {}
    for i, r in enumerate(timed):
        if r.get("mode") == "steady":
            cells.setdefault((r["concurrency"], r["variant"]), []).append((r, per_run.get(i, {})))
    spreads = {(r["concurrency"], r["variant"]): r for r in rows if r.get("kind") == "spread"}
    body = []
    for c, v in sorted(cells, key=lambda k: (k[0], variants.index(k[1]))):
        chain = [r["output_tok_s"] for r, _ in cells.get((c, "dflash"), [])]
        base = statistics.median(chain) if chain and v != "dflash" else None
        runs = [r for r, _ in cells[c, v]]
        line = _steady_cells(runs, spreads.get((c, v), {}).get("spread"), base)
        body.append(line + ([_widths(_summed(n for _, n in cells[c, v]))] if auto else []))
    header = ["c", "server", "runs", "tok/s median", "spread", "/ dflash", "TPOT ms"]
    header += ["tokens/round", "ms/round", "R x T", "prefill share"]
    header += ["widths x rounds"] if auto else []
    return shown(rows, prose(_steady_head(rows)) + "\n\n" + table(header, body))


def _steady_head(rows: list[dict]) -> str:
    limit = next((r["prefill_share_limit"] for r in rows if r.get("prefill_share_limit")), None)
    return (
        f"{conditions(rows)} {_running(rows)} Steady state (`--steady-state`): each cell runs R "
        "requests per client of T new tokens, sized from a probe run per concurrency (P, a "
        "lone request's time to first token, and the TPOT at c) so that prefills take under "
        f"{_share(limit)} of a run; the prefill share is completed x P / duration, as "
        "measured (P bounds a batched prefill from above); spread = (max - min) / median of "
        "the runs' tok/s; \"capped\": R, then T, came down below the rule's ask, so that one "
        "run's estimate stays within --max-cell-seconds and T within the context's and the KV "
        "cache's room."
    )


def _summed(counts) -> dict[int, int]:
    """Rounds per width, summed over runs (in the order the widths first appear)."""
    total: dict[int, int] = {}
    for rounds in counts:
        for w, n in rounds.items():
            total[w] = total.get(w, 0) + n
    return total


def _steady_cells(cell: list[dict], spread: float | None, base: float | None) -> list[str]:
    """One steady cell's columns before its widths (see steady_serving_table)."""
    first = cell[0]
    tps = statistics.median(r["output_tok_s"] for r in cell)
    tpot = _median_of(cell, "median_tpot_ms")
    accept = _median_of(cell, "accept_len")
    size = f"{first['requests_per_client']} x {first['tokens']}"
    return [
        str(first["concurrency"]),
        first["variant"],
        str(len(cell)),
        f"{tps:.0f}",
        _share(spread),
        _ms(tps / base) if base else "",
        _ms(tpot),
        _ms(accept),
        _ms(_round_ms(tpot, accept), 1),
        size + (" capped" if first.get("capped") else ""),
        _share(_median_of(cell, "prefill_share")),
    ]


def _median_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _share(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def _serving_cells(runs: list[dict], chain: dict[int, float]) -> list[str]:
    """median tok/s (min-max), accept, and the geo-mean (range) of run-by-run ratios."""
    speeds = [r["output_throughput"] for r in runs]
    if runs[0]["server"] == "dflash":
        chain = {}  # no ratio of DFLASH to itself
    ratios = [r["output_throughput"] / chain[r["run"]] for r in runs if r["run"] in chain]
    ratio = f"{geo_mean(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else ""
    accepts = [r["accept_length"] for r in runs if r.get("accept_length") is not None]
    accept = f"{statistics.median(accepts):.2f}" if accepts else ""  # plain decoding: none
    return [f"{statistics.median(speeds):.0f} ({min(speeds):.0f}-{max(speeds):.0f})", accept, ratio]


def serving_table(rows: list[dict]) -> str:
    """Per temperature, concurrency and server: output tok/s over the runs, accept length, and
    the geometric mean of each run's tok/s over DFLASH's in the same run."""
    rows = [r for r in latest(rows, "output_throughput") if r.get("run") is not None]
    servers = list(dict.fromkeys(r["server"] for r in rows))
    body = []
    for temp in sorted({r["temperature"] for r in rows}):
        for c in sorted({r["concurrency"] for r in rows}):
            cell = [r for r in rows if r["temperature"] == temp and r["concurrency"] == c]
            chain = {r["run"]: r["output_throughput"] for r in cell if r["server"] == "dflash"}
            for server in servers:
                runs = [r for r in cell if r["server"] == server]
                if runs:
                    cpus = runs[0].get("cpus", "")
                    body.append(
                        [f"{temp:g}", str(c), server, str(cpus), *_serving_cells(runs, chain)]
                    )
    header = [
        "T",
        "c",
        "server",
        "CPUs",
        "tok/s median (min-max)",
        "accept",
        "/ dflash geo-mean (range)",
    ]
    return shown(rows, table(header, body))


DRAFTERS = {
    "dflash_chain": "DFlash chain (DFLASH)",
    "dflash2_chain": "DFlash2 chain (DFLASH, upstream's walk)",
    "ddtree_marginal": "DDTREE, marginal tree",
    "ddtree_lattice": "DDTREE, lattice tree without coverage",
    "ddtree_lattice_coverage": "DDTREE, lattice tree with coverage (as served)",
}


def dflash2_offline_table(rows: list[dict]) -> str:
    """Greedy tokens per round by drafter and tree size, over the DFlash chain's."""
    rows = latest(rows)
    first = rows[0]
    base = next(r["tokens_per_round"] for r in rows if r["drafter"] == "dflash_chain")
    body = [
        [
            DRAFTERS.get(r["drafter"], r["drafter"]),
            "" if r["nodes"] is None else str(r["nodes"]),
            f"{r['tokens_per_round']:.3f}",
            f"{r['tokens_per_round'] / base:.3f}",
        ]
        for r in rows
    ]
    loss = first["heldout_loss"]
    head = (
        f"On {first['device']}: a selector of rank {first['selector_rank']} over "
        f"K = {first['selector_top_k']} candidates, {first['selector_steps']} steps of "
        f"{first['selector_batch']} sequences; {first['blocks']} held-out blocks. Held-out "
        f"cross-entropy against the target over the K candidates (which hold "
        f"{loss['target_mass_in_top_k']:.0%} of the target's mass): selector "
        f"{loss['selector']:.3f} nats, marginal {loss['marginal']:.3f}."
    )
    header = ["drafter", "tree nodes", "tokens/round", "/ DFlash chain"]
    return shown(rows, prose(head) + "\n\n" + table(header, body))


def first_token_table(rows: list[dict]) -> str:
    rows = latest(rows)
    body = [
        [
            r["server"],
            str(r["max_new_tokens"]),
            str(r["requests"]),
            _ms(r["median_ms"], 1),
            _ms(r["min_ms"], 1),
        ]
        for r in rows
    ]
    return shown(rows, table(["server", "new tokens", "requests", "median ms", "min ms"], body))


def round_profile_table(rows: list[dict]) -> str:
    """GPU and host ms per part of a round (the worker's ddtree.* ranges), syncs, launches."""
    rows = latest(rows)
    body = []
    for r in rows:
        host = r.get("host", {})
        parts = sorted(set(r.get("gpu_ms", {})) | set(host.get("host_ms", {})))
        split = "; ".join(
            f"{p.removeprefix('ddtree.')} {r['gpu_ms'].get(p, 0):.2f} / "
            f"{host.get('host_ms', {}).get(p, 0):.2f}"
            for p in parts
        )
        body.append(
            [
                r["server"],
                str(r["bs"]),
                _ms(host.get("round_period_ms")),
                _ms(host.get("syncs_per_round"), 1),
                _ms(host.get("own_syncs_per_round"), 1),
                _ms(host.get("launches_per_round"), 0),
                split or "-",
            ]
        )
    header = [
        "server",
        "bs",
        "round ms",
        "host syncs",
        "of them DDTREE's",
        "launches",
        "part: GPU ms / host ms",
    ]
    return shown(rows, table(header, body))


def host_profile_reports(rows: list[dict]) -> str:
    """The newest sitting's short views verbatim; the long call trees are named, not shown."""
    rows = latest(rows)
    short = [r for r in rows if len(r["report"]) <= 3000]
    # a blank line between the report's header lines and its table, which markdown needs
    parts = [
        f"**{r['view']}** ({r['note']})\n\n" + r["report"].replace("\n|", "\n\n|", 1) for r in short
    ]
    long = [r["view"] for r in rows if r not in short]
    if long:
        parts.append(prose("In the data file, not shown here: " + "; ".join(long) + "."))
    return shown(rows, "\n\n".join(parts))


def gdn_verify_table(rows: list[dict]) -> str:
    """One GDN layer's tree verify (ms): SGLang's, the root paths', the chunked one's, and
    SGLang's chain verify of as many tokens; the commit; the outputs' largest differences."""
    rows = latest(rows, "chunk_verify_ms")
    body = [
        [
            str(r["bs"]),
            str(r["nodes"]),
            _ms(r["sglang_verify_ms"], 3),
            _ms(r["ours_verify_ms"], 3),
            _ms(r["chunk_verify_ms"], 3),
            _ms(r.get("sglang_chain_same_tokens_ms"), 3),
            _ms(r["sglang_commit_ms"], 3),
            _ms(r["ours_commit_ms"], 3),
            f"{r['max_abs_diff_o']:.1e}",
            f"{r['chunk_max_abs_diff_o']:.1e}",
        ]
        for r in rows
    ]
    header = [
        "bs",
        "N",
        "SGLang tree verify",
        "root paths",
        "chunked (default)",
        "SGLang chain, same tokens",
        "SGLang commit",
        "replay commit",
        "root paths max diff",
        "chunked max diff",
    ]
    return shown(rows, table(header, body))


CONV_DEFAULT = "conv_round_t4n128w2in_ms"  # gdn/conv_tree.py's tiling: 4 nodes x 128, 2 warps


def gdn_conv_table(rows: list[dict]) -> str:
    """The tree conv1d of one round (48 layers in one CUDA graph, ms) against SGLang's chain
    conv over as many tokens."""
    rows = latest(rows, CONV_DEFAULT)
    body = []
    for r in rows:
        ours, chain = r[CONV_DEFAULT], r["sglang_chain_conv_round_ms"]
        equal = r["conv_windows_equal"] and r["conv_parents_equal"]
        body.append(
            [
                str(r["bs"]),
                str(r["nodes"]),
                _ms(ours, 3),
                _ms(r["ours_conv_round_windows_ms"], 3),
                _ms(chain, 3),
                _ms(ours / chain),
                "yes" if equal else "NO",
            ]
        )
    header = [
        "bs",
        "N",
        "tree conv1d (default)",
        "with per-node windows",
        "SGLang chain, same tokens",
        "tree / chain",
        "equal to SGLang's",
    ]
    return shown(rows, table(header, body))


def gdn_table(rows: list[dict]) -> str:
    return gdn_verify_table(rows) + "\n\n" + gdn_conv_table(rows)


def tree_build_table(rows: list[dict]) -> str:
    rows = latest(rows)
    cell = {(r["shape"], r["builder"], r["bs"], r["nodes"]): r for r in rows}
    body = []
    for shape, bs, n in sorted({(r["shape"], r["bs"], r["nodes"]) for r in rows}):
        torch_row = cell.get((shape, "torch", bs, n))
        triton_row = cell.get((shape, "triton", bs, n))
        body.append(
            [
                shape,
                str(bs),
                str(n),
                *[_ms(x and x["build_ms"], 3) for x in (torch_row, triton_row)],
                *[_ms(x and x["head_ms"], 3) for x in (torch_row, triton_row)],
            ]
        )
    header = ["shape", "bs", "N", "build, torch", "build, Triton", "head, torch", "head, Triton"]
    return shown(rows, table(header, body))


def acceptance_table(rows: list[dict]) -> str:
    """Tokens per round (rounds) by method and temperature."""
    rows = latest(rows)
    temps = sorted({r["temperature"] for r in rows})
    body = []
    for method in dict.fromkeys(r["method"] for r in rows):
        at = {r["temperature"]: r for r in rows if r["method"] == method}
        label = f"DDTree budget {method.split()[-1]}" if method.startswith("DDTree") else method
        body.append(
            [
                label,
                *[
                    f"{at[t]['mean_accept_len']:.2f} ({at[t]['rounds']})" if t in at else ""
                    for t in temps
                ],
            ]
        )
    return shown(rows, table(["method", *[f"T={t:g}: tokens/round (rounds)" for t in temps]], body))


def budget_sweep_table(rows: list[dict]) -> str:
    rows = [r for r in latest(rows) if "concurrency" in r]  # not the per-server profiles
    body = [
        [
            r["server"],
            str(r["concurrency"]),
            f"{r['tokens_per_s']:.0f}",
            _ms(r.get("tpot_ms")),
            _ms(r.get("accept_len")),
            _ms(r["tpot_ms"] * r["accept_len"]) if r.get("accept_len") else "",
            str(r.get("identical_to_plain", "")),
        ]
        for r in rows
    ]
    header = ["server", "c", "tok/s", "TPOT ms", "accept", "round ms", "same as plain"]
    note = rows[0].get("note")
    return shown(rows, table(header, body) + (f"\n\nThis sitting {note}." if note else ""))


def soak_table(rows: list[dict]) -> str:
    rows = latest(rows)
    body = []
    for r in rows:
        fuzz = r.get("fuzz") or {}
        bad = fuzz.get("bad")
        fuzz_cell = f"{len(bad)} of {fuzz.get('cases')} not a 4xx" if bad is not None else ""
        body.append(
            [
                r["server"],
                *[
                    str(r.get(k, ""))
                    for k in (
                        "sent",
                        "completed",
                        "cancelled",
                        "refused",
                        "failed",
                        "p50_s",
                        "p99_s",
                        "tokens_per_s",
                    )
                ],
                fuzz_cell,
            ]
        )
    header = [
        "server",
        "sent",
        "completed",
        "cancelled",
        "refused (4xx)",
        "failed",
        "p50 s",
        "p99 s",
        "tok/s",
        "fuzz",
    ]
    return shown(rows, table(header, body))


def gpu_suite_table(rows: list[dict]) -> str:
    rows = latest(rows)
    body = [
        [
            r["suite"],
            str(r["passed"]),
            str(r["failed"] + r.get("errors", 0)),
            str(r["skipped"]),
            "yes" if r["complete"] else f"no ({r.get('note', '')})",
            "; ".join(r["failures"]),
        ]
        for r in rows
    ]
    header = ["suite", "passed", "failed", "skipped", "complete", "failures"]
    versions = ", ".join(f"{k} {rows[0][k]}" for k in ("sglang", "torch", "transformers"))
    card = f" on one {rows[0]['card']}" if rows[0].get("card") else ""
    head = f"On {versions}{card}; servers: {rows[0]['servers']}."
    return shown(rows, prose(head) + "\n\n" + table(header, body))


def simulated_acceptance_table(rows: list[dict]) -> str:
    """Per regime: the chain's tokens per round (measured and calibrated) and the tree's at each
    width, with the tree over the chain."""
    rows = latest(rows)
    regimes = list(dict.fromkeys(r["regime"] for r in rows))
    widths = sorted({r["nodes"] for r in rows if r["verify"] == "tree"})
    body = []
    for name in regimes:
        chain = next(r for r in rows if r["regime"] == name and r["verify"] == "chain")
        world = chain["world"]
        means = ", ".join(f"{m:.3f}" for m in world["top1"])
        trees = {
            r["nodes"]: r["tau"] for r in rows if r["regime"] == name and r["verify"] == "tree"
        }
        params = ", ".join(
            f"{k.replace('_', '-')} {v:g}"
            for k, v in world.items()
            if k not in ("name", "top1", "seed") and v is not None
        )
        body.append(
            [
                name,
                params,
                means,
                f"{chain['tau']:.2f} ({chain['chain_tau_calibrated']:.2f})",
                *[f"{trees[n]:.2f} ({trees[n] / chain['tau']:.2f}x)" for n in widths],
            ]
        )
    header = [
        "regime",
        "world",
        "top-1 means by depth",
        "chain (calibrated)",
        *[f"tree N={n}" for n in widths],
    ]
    first, tree = rows[0], next(r for r in rows if r["verify"] == "tree")
    note = (
        f"Block {first['block']}, K = {tree['topk']}; {first['rounds']} independent rounds per "
        "cell; each world's parameters (docs/simulation.md) beside its name."
    )
    return shown(rows, note + "\n\n" + table(header, body))


def paper_acceptance_table(rows: list[dict]) -> str:
    """The DDTree paper's tokens per round: Figure 3's budget sweep (one cell), then Table 1's
    chain and best-budget tree per model, dataset and temperature."""
    rows = latest(rows)
    sweep = [r for r in rows if r["where"].startswith("Figure 3")]
    chain = next(r for r in sweep if r["method"] == "dflash")
    trees = sorted((r for r in sweep if r["method"] == "ddtree"), key=lambda r: r["budget"])
    first = table(
        ["budget", *[str(r["budget"]) for r in trees]],
        [
            ["tokens per round", *[f"{r['acceptance_length']:.3f}" for r in trees]],
            [
                "over the chain",
                *[f"{r['acceptance_length'] / chain['acceptance_length']:.3f}" for r in trees],
            ],
        ],
    )
    cells: dict = {}
    for r in rows:
        if r["where"].startswith("Table 1"):
            key = (r["model"], r["dataset"], r["temperature"])
            cells.setdefault(key, {})[r["method"]] = r["acceptance_length"]
    body = [
        [
            m,
            d,
            f"{t:g}",
            f"{c['dflash']:.2f}",
            f"{c['ddtree']:.2f}",
            f"{c['ddtree'] / c['dflash']:.2f}",
        ]
        for (m, d, t), c in cells.items()
        if "dflash" in c and "ddtree" in c
    ]
    second = table(["model", "dataset", "T", "chain", "tree (best budget)", "tree / chain"], body)
    others = len(rows) - len(sweep) - sum(r["where"].startswith("Table 1") for r in rows)
    head = (
        f"Figure 3: {chain['model']} on {chain['dataset']}, T = {chain['temperature']:g}, block "
        f"{chain['block_size']}; the chain {chain['acceptance_length']:.3f} tokens per round."
    )
    tail = (
        f"Table 1: the best-speedup budget per cell (which one is not published). The file's "
        f"other {others} rows (Figure 4's histograms, Lucebox's budget sweeps, an independent "
        "vLLM port's sibling statistics) name their sources and are read by scripts/simworld/fit.py "
        "and docs/simulation.md."
    )
    return shown(rows, "\n\n".join([prose(head), first, prose(tail), second]))


def world_fit_table(rows: list[dict]) -> str:
    """The fitted world's tokens per round by budget beside the paper's, both histograms
    beside the paper's, the parameters and the loss."""
    rows = latest(rows)
    taus = [r for r in rows if r["kind"] == "tokens_per_round"]
    chain = next(r for r in taus if r["verify"] == "chain")
    body = [
        [
            "chain",
            f"{chain['paper_tau']:.3f}",
            "",
            f"{chain['tau']:.3f} ± {chain['tau_stderr']:.3f}",
            "",
            "",
        ]
    ]
    for r in (r for r in taus if r["verify"] == "tree"):
        paper = r.get("paper_tau")
        body.append(
            [
                str(r["budget"]),
                f"{paper:.3f}" if paper else "",
                f"{r['paper_ratio']:.3f}" if paper else "",
                f"{r['tau']:.3f} ± {r['tau_stderr']:.3f}",
                f"{r['ratio']:.3f}",
                "yes" if r["fitted"] else "no",
            ]
        )
    first = table(
        [
            "budget",
            "paper tokens/round",
            "paper / chain",
            "world tokens/round",
            "world / chain",
            "in the loss",
        ],
        body,
    )
    hists = {r["verify"]: r for r in rows if r["kind"] == "histogram"}
    tree = hists["tree"]
    body = [
        [
            str(k + 1),
            f"{100 * hists['chain']['paper_fraction_of_rounds'][k]:.2f}",
            f"{100 * hists['chain']['fraction_of_rounds'][k]:.2f}",
            f"{100 * tree['paper_fraction_of_rounds'][k]:.2f}",
            f"{100 * tree['fraction_of_rounds'][k]:.2f}",
        ]
        for k in range(len(tree["fraction_of_rounds"]))
    ]
    b = tree["budget"]
    second = table(
        [
            "accepted length",
            "paper chain %",
            "world chain %",
            f"paper tree {b} %",
            f"world tree {b} %",
        ],
        body,
    )
    fit = next(r for r in rows if r["kind"] == "fit")
    w, loss = fit["world"], fit["loss"]
    params = ", ".join(f"{k} {fit['parameters'][k]:g}" for k in fit["parameters"])
    head = (
        f"The `{w['name']}` world: {params}; top-1 means by depth "
        f"{', '.join(f'{m:.3f}' for m in w['top1'])} (the paper's chain histogram). Block "
        f"{fit['block']}, K = {fit['topk']}, budgets are draft nodes (root excluded); "
        f"{fit['rounds']} independent rounds per cell (the search: {fit['search_rounds']} per "
        f"evaluation, {fit['evaluations']} evaluations). Loss at these rounds "
        f"{loss['total']:.4f}: ratios {loss['ratios']:.4f}, tree histogram "
        f"{loss['tree_hist']:.4f}, chain histogram {loss['chain_hist']:.4f}."
    )
    return shown(rows, "\n\n".join([prose(head), first, second]))


def world_sensitivity_table(rows: list[dict], costs: list[dict] | None = None) -> str:
    """Tokens per round in the fitted world and with one parameter moved, and the DDTREE /
    DFLASH ratio they project with the newest round costs: (tree tokens / chain tokens) x
    (DFLASH ms / DDTREE ms) at a batch."""
    rows = latest(rows)
    costs = latest(read_rows("round_cost_27b") if costs is None else costs)
    ms = {(r["variant"], r["bs"]): r["round_ms"] for r in costs if (r.get("round_ms") or 0) > 0}
    card = next((r for r in costs if r.get("card")), {})
    nodes = list(rows[0]["tree_tau"])
    batches = (1, 4, 16)
    body = []
    for r in rows:
        cells = [
            f"{r['tree_tau'][n]:.2f} ({r['tree_tau'][n] / r['chain_tau']:.2f}x)" for n in nodes
        ]
        projected = []
        for bs in batches:
            tree, chain = ms.get(("ddtree32", bs)), ms.get(("dflash", bs))
            if tree and chain and "32" in r["tree_tau"]:
                projected.append(f"{r['tree_tau']['32'] / r['chain_tau'] * chain / tree:.2f}")
            else:
                projected.append("no DFLASH round cost" if tree else "no DDTREE N=32 round cost")
        value = "" if r["value"] is None else f"{r['value']:g}"
        body.append([r["varied"], value, f"{r['chain_tau']:.2f}", *cells, *projected])
    header = [
        "parameter",
        "value",
        "chain tokens/round",
        *[f"tree N={n}" for n in nodes],
        *[f"projected N=32 / DFLASH at c={bs}" for bs in batches],
    ]
    missing = sorted({str(bs) for bs in batches if ("dflash", bs) not in ms})
    head = (
        "Projected, not measured end to end: simulated acceptance (this CPU run) times "
        f"measured round costs (docs/data/round_cost_27b.jsonl, its newest sitting: one "
        f"{card.get('card', 'card')}, {card.get('target_dtype', '?')} target, one run, "
        f"{costs[0]['date'] if costs else '?'}; `ddtree32` and `dflash` at c requests in a "
        "batch). Every row but the first moves one parameter of the fitted world, the others "
        f"kept and the means matched to the paper's chain again; {rows[0]['rounds']} rounds "
        "per cell, trees of N nodes root included (the servers' widths)."
    )
    if missing:
        head += (
            f" No DFLASH round at batch {', '.join(missing)} in that sitting (its float32 verify "
            "scratch did not fit), so no projection there."
        )
    return shown(rows, prose(head) + "\n\n" + table(header, body))


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _load(row: dict) -> str:
    """The machine's mean load average during setup / demo / test, where recorded."""
    mean = row.get("load_mean") or {}
    return " / ".join(f"{mean[n]:g}" for n in ("setup", "demo", "test") if n in mean)


def fresh_clone_table(rows: list[dict]) -> str:
    rows = latest(rows)
    body = [
        [
            f"{r['machine']['cpus']} CPUs, {r['machine']['memory_gb']} GB",
            _load(r),
            *[_duration(r[f"{step}_s"]) for step in ("setup", "demo", "test")],
            r["test_summary"],
        ]
        for r in rows
    ]
    header = [
        "machine",
        "load average (setup / demo / test)",
        "setup",
        "demo",
        "test (ruff + pytest)",
        "pytest said",
    ]
    return shown(rows, table(header, body))


# ---------------------------------------------------------------- sections


@dataclass(frozen=True)
class Section:
    name: str  # docs/data/NAME.jsonl
    title: str
    about: str  # what was measured, how, and what it does and does not show
    render: Callable[[list[dict]], str]


SECTIONS = (
    Section(
        "serving_simulated_27b",
        "End to end at Qwen3.6-27B shapes, simulated acceptance",
        "`scripts/bench_round.py --simulate REGIME --serving C,...`: SGLang's own load "
        "generator (`sglang.bench_serving`, greedy; the command gives the new tokens and the "
        "requests per client, at least 16 a run) against one server at a time on one H200 (or "
        "the card the line above the table names): a Qwen3.6-27B-shaped target "
        "(64 layers, 48 of them Gated DeltaNet) and a 5-layer DFlash-shaped draft with dummy "
        "weights, CUDA graphs, FlashInfer, the overlap scheduler. The weights are dummy, so "
        "every kernel costs what it costs at 27B; which drafts the target accepts comes from "
        "a simulated world calibrated to published DFlash acceptance (docs/simulation.md), the "
        "same world for DFLASH's chain and DDTREE's tree. `ddtree32_auto` is DDTREE's default "
        "(N = 32, a width among 16 and 32 chosen each round). A server runs at most its "
        "running-request count (SGLang's per-node float32 verify scratch limits DFLASH to 16 "
        "on one H200); clients beyond it queue. tokens/round is SGLang's accept length. "
        "ms/round = median TPOT x tokens/round: what a decode round cost while serving, new "
        "requests' prefills included. A short cell (the default) is one run, and with few "
        "requests and tokens its prefills fill much of it at low concurrency, so its tok/s "
        "ratios are not the decode's; `--steady-state` cells run long enough that decode "
        "rounds fill them (their table gives R x T and the prefill share measured), twice, "
        "with the two runs' spread.",
        serving_simulated_table,
    ),
    Section(
        "round_cost_27b",
        "One decode round at Qwen3.6-27B shapes",
        "`scripts/bench_round.py` on one H200: the same 27B-shaped target and draft with dummy "
        "weights, CUDA graphs, FlashInfer, the overlap scheduler; b concurrent requests per "
        "batch size. A round's time is the slope of request latency against the request's "
        "decode rounds; rows measured before that method name theirs. The line above the "
        "table names the method, the SGLang release and the acceptance: "
        "the dummy weights' own, about one token a round, or a simulated world, where a round "
        "commits what a real drafter's would. `ddtree32_auto` is DDTREE's default. \"does not "
        "fit\": SGLang's float32 per-node verify scratch for that many DFLASH requests does "
        'not fit beside the weights on one GPU; DDTREE\'s compact scratch does. "-": the '
        "method gave no positive time (the shorter requests ran slower than the longer).",
        round_cost_table,
    ),
    Section(
        "serving_pair",
        "End to end on the shipped pair",
        "`scripts/bench_serving.py`: SGLang's own load generator (`sglang.bench_serving`) "
        "against servers of the 9.7M-parameter pair in `sglang_ddtree/assets/demo`, 128 new "
        "tokens on held-out prompts, one H200, each server pinned to its own CPUs where the "
        "machine has enough (the CPUs column, where recorded). The runs alternate between "
        "servers; the ratio column is the geometric mean of each run's tok/s over DFLASH's in "
        "the same run. `ddtree` is the default (automatic widths), `ddtree16` / `ddtree32` "
        "fixed widths, `none` plain decoding. This pair is so small that its rounds are bound "
        "by the host, not the GPU: it shows DDTREE's acceptance and host cost on a real "
        "model, and one run moves by 15-30%. It does not show what a large model gains: there "
        "plain decoding would not win, as it does here.",
        serving_table,
    ),
    Section(
        "dflash2_offline_pair",
        "DFlash2 trees on the shipped pair, offline",
        "`scripts/train_dflash2.py --pair sglang_ddtree/assets/demo`: a DFlash2 drafter for "
        "the shipped pair, its DFlash draft frozen and a candidate selector trained on the "
        "pair's data (docs/training.md), then four drafters scored on the held-out packages' "
        "text at temperature 0: a round accepts the longest prefix of the target's own greedy "
        "continuation that the proposal holds, plus the bonus. The trees are built by the "
        "builders DDTREE serves with (K = 8; N counts the root). Both drafters share one "
        "backbone, so DDTREE's marginal tree is the same for either, and the lattice tree "
        "and the DFlash2 chain differ from it only by the selector. No server runs: this is "
        "acceptance, not speed. DDTREE serves the lattice tree with coverage (docs/dflash2.md).",
        dflash2_offline_table,
    ),
    Section(
        "serving_dflash2_pair",
        "DFlash2 trees on the shipped pair, end to end",
        "`scripts/bench_serving.py --dflash2 DIR`: as the table above it, with the DFlash2 "
        "drafter of the offline table: `dflash` (SGLang's DFLASH on the DFlash drafter), "
        "`dflash_dflash2` (SGLang's DFLASH on the DFlash2 drafter, upstream's chain), `ddtree` "
        "(DDTREE's marginal tree, the same for either drafter) and `ddtree_dflash2` (DDTREE's "
        "lattice tree with coverage). accept is SGLang's accept length, tokens per round.",
        serving_table,
    ),
    Section(
        "first_token_pair",
        "Time to first tokens on the shipped pair",
        "`scripts/bench_serving.py --first-token N`: one-at-a-time requests of 1, 2 and 3 new "
        "tokens per server, to tell the prefill's share of the first token from the first "
        "decode rounds'.",
        first_token_table,
    ),
    Section(
        "round_profile_pair",
        "Where a round's time goes on the shipped pair",
        "`scripts/bench_serving.py --profile`: SGLang's torch profiler over 12 decode rounds "
        "per server and batch size; GPU and host ms per part of DDTREE's round (the worker's "
        "`ddtree.*` ranges), host syncs per round (all, and those in DDTREE's own code), and "
        "kernel launches. Profiler scale: the host times run slower than unprofiled.",
        round_profile_table,
    ),
    Section(
        "host_profile_pair",
        "Host samples of the shipped pair's servers",
        "`scripts/bench_serving.py --host-profile`: Python stack samples of every server "
        "process during one more run (`scripts/host_sampler`), printed by "
        "`scripts/host_profile.py` as ms per round by frame, DDTREE and DFLASH side by side. "
        "Sampling slows a server about 2x: compare frame by frame, not with the tables above.",
        host_profile_reports,
    ),
    Section(
        "gdn_tree_kernel",
        "Gated DeltaNet tree kernels at 27B head sizes",
        "`scripts/bench_gdn_tree.py` on one H200, no server: one GDN layer at Qwen3.6-27B head "
        "sizes (16 key / 48 value heads x 128) on trees from the builder (B = 16, K = 8), each "
        "call captured in a CUDA graph and timed with CUDA events. The first table is one "
        "layer's verify and commit, with the outputs' largest difference from SGLang's kernel "
        "(the root paths are bit-equal; the chunked form differs by float32 rounding); a round "
        "runs 48 layers, and the server commits all 48 in one launch. The second is the tree "
        "conv1d of a whole round: 48 layers back to back in one graph, against SGLang's chain "
        "conv over as many tokens (DFLASH's verify).",
        gdn_table,
    ),
    Section(
        "tree_build",
        "Building the tree",
        "`scripts/bench_tree_build.py` on one H200, no server: the draft head as the server "
        "runs it inside its draft CUDA graph (LM head over the B - 1 draft positions, float32 "
        "log-softmax, top-8, tree build, copies into static buffers) and the build alone, each "
        "captured in a CUDA graph and replayed 200 times between CUDA events (GPU ms, no "
        "launch overhead). Random bf16 weights at the pair's and the 27B's sizes; the torch "
        "and Triton trees are checked equal in every configuration.",
        tree_build_table,
    ),
    Section(
        "acceptance",
        "Acceptance against the tree budget",
        "`scripts/acceptance_table.py`: the shipped pair on the transformers reference engine "
        "(CPU, float32), 24 held-out prompts (the first 400 characters of files of the stdlib "
        "packages `asyncio`, `email` and `http`, which the pair's training held out) x 128 new "
        "tokens, DDTree top-K 8. Tokens per round = tokens emitted / target verify passes. At "
        "T = 0 every method's tokens are checked against the target's own greedy decoding "
        "(the script stops on a difference); at T = 1 prompt i is decoded with seed i. These "
        "are acceptance lengths only: what they buy depends on what a round costs (the "
        "sections above). The draft is weak (trained for minutes: docs/training.md), so at "
        "T = 1 the tree gains less than at T = 0. The figure: "
        "`scripts/acceptance_table.py --rows docs/data/acceptance.jsonl --plot "
        "docs/figures/acceptance.png`.\n\n![tokens per round against the budget]"
        "(figures/acceptance.png)",
        acceptance_table,
    ),
    Section(
        "budget_sweep_pair",
        "Node budgets end to end on the shipped pair",
        "`scripts/bench_e2e.py`: the pair's servers of the GPU test set measured one at a "
        "time with the script's own clients (c clients back to back), 32 held-out prompts x "
        '128 new tokens, greedy; "same as plain": outputs identical to the plain server\'s '
        "(of 32). Round ms = TPOT x accept length. Fixed budgets, before the automatic widths "
        "existed; `scripts/bench_serving.py` (above) is the end-to-end measure now.",
        budget_sweep_table,
    ),
    Section(
        "soak",
        "Soak and malformed requests",
        "`tests/gpu/test_soak.py` (marker `soak`): `scripts/soak.py`'s mixed load (1,000 seeded "
        "requests: OpenAI chat streamed and not, `/generate`, 1 token to near the context, "
        "T = 0 / 0.7 / 1, n 1-2, stop strings, a third with logprobs, penalties, a JSON schema "
        "or min_p, 30% cancelled, 32 in flight) on the shipped pair's servers, then "
        '`scripts/fuzz_requests.py`\'s malformed requests. "failed" is a request that neither '
        "completed nor got a 4xx; the fuzz column counts cases that did not get one.",
        soak_table,
    ),
    Section(
        "gpu_suite",
        "The GPU suite",
        "`tests/gpu` (docs/testing.md) on one GPU: tiny checkpoints served by SGLang without "
        "speculation, with DDTREE and with SGLang's DFLASH, each test's tokens checked against "
        "the target (greedy under the float32 referee, T > 0 by chi-square, logprobs, "
        "penalties, grammars, pools idle and no host sync, the context limit); `tests/unit -m "
        "gpu`: the package's kernels on the device against SGLang's and FlashInfer's. A "
        "sitting may run a subset of the servers (the servers line) or end before a suite "
        "finishes (the complete column).",
        gpu_suite_table,
    ),
    Section(
        "simulated_acceptance",
        "Tokens per round in the simulated worlds",
        "`scripts/simulated_acceptance.py` on the CPU: DDTREE's draft head and accept walk, and "
        "the chain DFLASH verifies, over independent rounds of each simulated world "
        "(docs/simulation.md). Tokens per round = accepted drafts + the bonus; in "
        "parentheses, the tree's over the chain's. This is what a server sees "
        "per round under DDTREE_SIMULATE; what each round costs comes from the GPU.",
        simulated_acceptance_table,
    ),
    Section(
        "ddtree_paper_acceptance",
        "Published tree acceptance",
        "Tokens per round published for DDTree and chain DFlash, not measured here: the DDTree "
        "paper (Ringel & Romano, arXiv 2604.12989; Figures 3 and 4 decoded from its vector "
        "plots), Lucebox's budget sweeps and an independent vLLM port's sibling statistics. "
        "Each row names its source and where in it; `commit` is the commit of this repository "
        "that recorded it. The simulated `ddtree_paper` world is fitted to the Figure 3 and 4 "
        "rows (the next section).",
        paper_acceptance_table,
    ),
    Section(
        "world_fit",
        "The fitted world against the paper's table",
        "`scripts/simworld/fit.py` on the CPU: the `ddtree_paper` world (docs/simulation.md) "
        "fitted to the DDTree paper's Qwen3-8B MATH-500 cell at T = 0 (Figure 3's tree over "
        "chain tokens per round by budget, Figure 4's accepted-length histograms) by a "
        "seeded pattern search, each evaluation DDTREE's own draft head, tree build and "
        "accept walk over the same rounds. Tokens per round = accepted drafts + the bonus. "
        "The paper's Figure 3 averages each response's mean and its histograms pool rounds, "
        "so its chain reads 7.789 there and 7.60 in the histogram; the world's chain follows "
        "the histogram. One paper cell at T = 0: the fit says nothing of other data sets or "
        "temperatures.",
        world_fit_table,
    ),
    Section(
        "world_sensitivity",
        "Projected DDTREE over DFLASH in the fitted world, by parameter",
        "`scripts/simworld/fit.py --sensitivity`: tokens per round of the chain and of trees "
        "of 16, 32 and 64 nodes in the fitted world and with each parameter moved alone, and "
        "the end-to-end ratio they would give with the newest measured round costs: (tree "
        "tokens per round / chain tokens per round) x (DFLASH ms per round / DDTREE ms per "
        "round at that batch). A projection from simulated acceptance and measured round "
        "costs, not an end-to-end measurement. shared 0.5 and 1 have no row: at tail 4 the means "
        "matched to the paper's chain would fall below the least the tail allows.",
        world_sensitivity_table,
    ),
    Section(
        "fresh_clone",
        "A fresh clone on a small CPU machine",
        "`scripts/time_fresh_clone.sh`: clone the repository into a temporary folder, then "
        "time `bash scripts/setup_cpu.sh` (creates `.venv`: about 3 GB downloaded from PyPI, "
        "so the link's speed counts, and about 6 GB on disk), `bash scripts/demo.sh` and `bash scripts/test.sh`, one "
        "after another. The machine's CPUs may be shared with other work: the load average "
        "column is the mean 1-minute load during each step (at 2 on a 2-CPU machine both CPUs "
        "are busy).",
        fresh_clone_table,
    ),
)


def render_section(section: Section, data: Path = DATA) -> str:
    if not (data / f"{section.name}.jsonl").exists():  # declared before its first rows
        return f"## {section.title}\n\n{prose(section.about)}\n\nNo rows yet."
    rows = read_rows(section.name, data)
    return "\n\n".join(
        [
            f"## {section.title}",
            prose(section.about),
            section.render(rows),
            f"Rows of every sitting: `docs/data/{section.name}.jsonl`.",
        ]
    )


def render_page(data: Path = DATA) -> str:
    intro = (
        "# Results\n\n"
        + prose(
            "Generated by `python scripts/results_page.py` from "
            "`docs/data/`; do not edit by hand. Each section shows the newest sitting of its "
            "data file; the earlier sittings stay in the file."
        )
        + "\n\n"
        + "\n".join(f"- [{s.title}](#{_anchor(s.title)})" for s in SECTIONS)
    )
    return "\n\n".join([intro, *[render_section(s, data) for s in SECTIONS]]) + "\n"


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")


# ---------------------------------------------------------------- README blocks

BLOCK = re.compile(r"(<!-- results:(\w+) -->\n)(.*?)(<!-- /results -->)", re.S)


def readme_block(name: str, data: Path = DATA) -> str:
    """What the README shows between `<!-- results:NAME -->` and `<!-- /results -->`."""
    if not (data / f"{name}.jsonl").exists():
        return "No rows yet.\n"
    rows = read_rows(name, data)
    if name == "fresh_clone":
        r = latest(rows)[0]
        cpus, load = r["machine"]["cpus"], _load(r)
        busy = max((r.get("load_mean") or {}).values(), default=0) > cpus  # more than its own
        shared = f", load average {load} during them" if load else ""
        shared += ": shared with other work" if busy else ""
        times = (
            f"setup {_duration(r['setup_s'])}, the demo {_duration(r['demo_s'])}, the "
            f"tests {_duration(r['test_s'])}"
        )
        return (
            prose(
                f"Measured on a fresh clone ({r['date']}, a {cpus}-CPU machine{shared}): "
                f"{times} (`scripts/time_fresh_clone.sh`)."
            )
            + "\n"
        )
    if name == "dflash2_offline_pair":
        return prose(dflash2_summary(rows)) + "\n"
    section = next(s for s in SECTIONS if s.name == name)
    return section.render(rows) + "\n"


def dflash2_summary(rows: list[dict], nodes: int = 32) -> str:
    """One sentence of the offline DFlash2 table: each drafter's tokens per round at `nodes`
    tree nodes, over the DFlash chain's."""
    rows = latest(rows)
    first = rows[0]
    got = {r["drafter"]: r["tokens_per_round"] for r in rows if r["nodes"] in (None, nodes)}
    base = got["dflash_chain"]

    def part(drafter: str, label: str) -> str:
        return f"{label} {got[drafter]:.2f} ({got[drafter] / base:.2f}x)"

    return (
        f"Offline on the shipped pair ({first['date']}, temperature 0, {first['blocks']} "
        f"held-out blocks, N = {nodes}), tokens per round: "
        f"the DFlash chain {base:.2f}; "
        + "; ".join(
            part(d, label)
            for d, label in (
                ("dflash2_chain", "the DFlash2 chain"),
                ("ddtree_marginal", "DDTREE's marginal tree"),
                ("ddtree_lattice_coverage", "DDTREE's lattice tree"),
            )
        )
        + " (docs/results.md)."
    )


def render_readme(text: str, data: Path = DATA) -> str:
    return BLOCK.sub(lambda m: m.group(1) + readme_block(m.group(2), data) + m.group(4), text)


# ---------------------------------------------------------------- adding rows


def add_rows(
    name: str,
    rows: list[dict],
    commit: str | None,
    command: str | None,
    date: str | None,
    data: Path = DATA,
) -> list[dict]:
    """Stamp a benchmark's rows as the file's next sitting and append them."""
    path = data / f"{name}.jsonl"
    old = read_rows(name, data) if path.exists() else []
    sitting = max((r["sitting"] for r in old), default=0) + 1
    stamped = []
    for row in rows:
        out = {
            "date": row.get("date") or date or datetime.date.today().isoformat(),
            "commit": row.get("commit") or commit,
            "sitting": sitting,
        }
        if not out["commit"]:
            raise SystemExit("the rows name no commit: pass --commit (the code measured)")
        if command or row.get("command"):
            out["command"] = row.get("command") or command
        out.update({k: v for k, v in row.items() if k not in (*PROVENANCE, "command")})
        stamped.append(out)
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in stamped)
    return stamped


def parser() -> argparse.ArgumentParser:
    """`results_page.py [--check]` regenerates (or checks); `results_page.py add ...` first
    appends a benchmark's rows as the next sitting of a data file, then regenerates."""
    p = argparse.ArgumentParser(
        prog="results_page.py",
        usage="%(prog)s [--check]\n       %(prog)s add NAME ROWS.jsonl [--commit SHA] "
        "[--command CMD] [--date D]",
        description="Regenerate docs/results.md and the README's generated blocks (between\n"
        "`<!-- results:NAME -->` and `<!-- /results -->`) from docs/data/*.jsonl; with no\n"
        "arguments it writes both.",
        epilog="examples:\n"
        "  .venv/bin/python scripts/results_page.py            # regenerate both\n"
        "  .venv/bin/python scripts/results_page.py --check    # exit 1 if either is stale\n"
        "  .venv/bin/python scripts/results_page.py add round_cost_27b "
        "OUT/round_cost_27b.jsonl --commit SHA",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 when docs/results.md or the README's blocks differ from "
        "what the data gives",
    )
    sub = p.add_subparsers(dest="action", title="commands", metavar="{add}")
    add = sub.add_parser(
        "add",
        help="append a benchmark's rows to docs/data/NAME.jsonl as its next sitting, then "
        "regenerate",
    )
    add.add_argument("name", help="the data file: docs/data/NAME.jsonl")
    add.add_argument("rows", type=Path, help="the JSON lines a benchmark wrote")
    add.add_argument("--commit", help="the commit measured (unless the rows name it)")
    add.add_argument("--command", help="the command that wrote the rows")
    add.add_argument("--date", help="when measured (default: today, unless the rows say)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if a.action == "add":
        rows = [json.loads(x) for x in a.rows.read_text().splitlines() if x.strip()]
        print(f"added {len(add_rows(a.name, rows, a.commit, a.command, a.date))} rows")
    page, readme = render_page(), render_readme(README.read_text())
    stale = [
        p for p, text in ((PAGE, page), (README, readme)) if not p.exists() or p.read_text() != text
    ]
    if a.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run python scripts/results_page.py")
        return 1 if stale else 0
    PAGE.write_text(page)
    README.write_text(readme)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

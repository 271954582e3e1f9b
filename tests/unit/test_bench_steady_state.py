"""scripts/bench_serving.py --steady-state, scripts/bench_round.py --serving --steady-state
(scripts/round_serving.py) and their rule (scripts/harness.steady_state): runs long enough that
decode rounds, not prefills, fill them, two per cell, with their one-run spread; bench_round's
cells within a cap. A fake load generator stands in for sglang.bench_serving."""

from __future__ import annotations

import argparse
import json
import math
from types import SimpleNamespace

import pytest

from tests.fixtures import load_script, offline_bench_round


def test_the_rule_keeps_prefills_ramp_and_tail_under_the_share():
    harness = load_script("harness")
    # 27B-like: a 60 ms prefill, 6 ms TPOT at c = 1, 16 ms at c = 32
    R, T = harness.steady_state(1, 60.0, 6.0)
    assert R == 10 and T == math.ceil(60 * 0.95 / (0.05 * 6))  # 190 tokens
    R, T = harness.steady_state(32, 60.0, 16.0)
    assert T == math.ceil(32 * 60 * 0.95 / (0.05 * 16))  # 2280 tokens
    # a wave's prefills over the wave: within the share
    assert 32 * 60 / (32 * 60 + T * 16) <= 0.05
    # never shorter than the short run asks
    assert harness.steady_state(1, 1.0, 50.0, tokens=128, per_client=16) == (16, 128)
    assert harness.prefill_share(100, 60.0, 120.0) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="0 < share < 1"):
        harness.steady_state(1, 60.0, 6.0, share=1.0)


def _args(tmp_path, **kw):
    base = dict(
        out=tmp_path,
        target="tok",
        concurrency="4,32",
        tokens=128,
        requests_per_client=2,
        prefill_share=0.05,
    )
    return argparse.Namespace(**{**base, **kw})


def test_steady_state_probes_then_runs_each_cell_long_with_both_runs_and_spread(
    tmp_path, monkeypatch
):
    """Probes at c = 1 (not asked for) and at each c give each server's prefill and TPOT; the
    cell's R and T are the largest either server needs; the rows carry them and the measured
    prefill share, which the plan keeps under 5%; the summary both runs and their spread."""
    bench = load_script("bench_serving")
    ttft = {"dflash": 50.0, "ddtree": 60.0}
    tpot = {("dflash", 1): 6.0, ("ddtree", 1): 5.0, ("dflash", 4): 10.0, ("ddtree", 4): 9.0}
    tpot |= {("dflash", 32): 16.0, ("ddtree", 32): 20.0}
    calls = []

    def fake_bench(argv):
        port = int(argv[argv.index("--port") + 1])
        name = {1: "dflash", 2: "ddtree"}[port]
        c = int(argv[argv.index("--max-concurrency") + 1])
        n = int(argv[argv.index("--num-prompts") + 1])
        tokens = int(argv[argv.index("--sharegpt-output-len") + 1])
        calls.append((name, c, n, tokens))
        waves = n / c  # the fake's server: c prefills per wave, then T rounds of TPOT
        duration = waves * (c * ttft[name] + tokens * tpot[name, c]) / 1e3
        first = calls.count(calls[-1]) == 1  # a cell's first run: 10% faster than its second
        tps = n * tokens / duration * (1.1 if first else 1.0)
        return {
            "output_throughput": tps,
            "median_ttft_ms": ttft[name] * (1 if c == 1 else c / 2),
            "median_tpot_ms": tpot[name, c],
            "completed": n,
            "duration": duration,
        }

    monkeypatch.setattr(bench, "run_bench", fake_bench)
    servers = [SimpleNamespace(name="dflash", port=1), SimpleNamespace(name="ddtree", port=2)]
    args = _args(tmp_path)
    probe = lambda *a: bench.measure(*a, tmp_path / "d.jsonl", args)  # noqa: E731
    plan = bench.steady_plan(servers, 0.0, args, probe)
    # probes: the flags' short run, c = 1 first, every server
    assert calls[:2] == [("dflash", 1, 16, 128), ("ddtree", 1, 16, 128)]
    assert ("ddtree", 32, 64, 128) in calls
    for c in (1, 4, 32):
        need = [math.ceil(c * ttft[s] * 0.95 / (0.05 * tpot[s, c])) for s in ttft]
        assert plan[c]["tokens"] == max(128, *need) and plan[c]["requests_per_client"] == 10
    assert plan[32]["tokens"] == math.ceil(32 * 50.0 * 0.95 / (0.05 * 16.0))  # DFLASH's
    rows = [
        bench.measure(s, run, 0.0, c, plan[c], tmp_path / "d.jsonl", args)
        for run in (1, 2)
        for c in (4, 32)
        for s in servers
    ]
    assert all(r["mode"] == "steady" and r["requests_per_client"] == 10 for r in rows)
    assert {r["prefill_ms"] for r in rows if r["server"] == "ddtree"} == {60.0}
    assert all(0 < r["prefill_share"] <= 0.05 for r in rows), [r["prefill_share"] for r in rows]
    summary = bench.summarize(rows)
    bench.write_spread(summary, tmp_path / "steady_summary.jsonl")
    written = [json.loads(x) for x in (tmp_path / "steady_summary.jsonl").read_text().splitlines()]
    for s in written:
        assert s["runs"] == 2 and len(s["runs_tok_s"]) == 2
        a, b = s["runs_tok_s"]
        assert s["spread"] == pytest.approx(abs(a - b) / ((a + b) / 2))
        assert s["spread"] == pytest.approx(0.1 / 1.05)  # the fake's 10% between the runs


def test_the_default_plan_is_the_flags_short_run(tmp_path):
    bench = load_script("bench_serving")
    plan = bench.default_plan(_args(tmp_path))
    assert plan == {c: {"requests_per_client": 2, "tokens": 128} for c in (4, 32)}


# ---- scripts/bench_round.py --serving --steady-state (scripts/round_serving.py)

PREFILL = 60.0  # the fake server's lone-request TTFT (ms)
TPOT = {1: 6.0, 4: 10.0, 32: 16.0}  # its TPOT (ms) by concurrency
RUNNING = 16  # its running requests at most: c = 32 runs in waves of 16


def _round_args(tmp_path, *flags):
    serving = load_script("round_serving")
    p = argparse.ArgumentParser()
    serving.add_arguments(p)
    args = serving.check_args(p.parse_args(["--serving", "4,32", "--steady-state", *flags]))
    args.out = tmp_path
    return serving, args


def _probes() -> dict[int, dict]:
    return {
        c: {"median_ttft_ms": PREFILL, "median_tpot_ms": tpot, "prompt_tokens": 200.0}
        for c, tpot in TPOT.items()
    }


def test_bench_round_plans_each_cell_as_the_rule_asks_in_waves_of_its_running_requests(tmp_path):
    """A cell's R and T are harness.steady_state's at the wave the server runs, min(c, running):
    at c = 32 a server of 16 running requests holds 16 prefills a wave, not 32. Within the cap
    nothing is lowered; c = 1 is probed for P but not a cell unless asked."""
    harness = load_script("harness")
    serving, args = _round_args(tmp_path, "--max-cell-seconds", "1e9")
    assert args.runs == 2 and args.prefill_share == 0.05
    plan = serving.plan_cells(_probes(), "dflash", args, RUNNING, 8192, None)
    assert set(plan) == {4, 32}
    for c, wave in ((4, 4), (32, 16)):
        R, T = harness.steady_state(wave, PREFILL, TPOT[c], 0.05, 256, 4)
        cell = plan[c]
        assert (cell["requests_per_client"], cell["tokens"]) == (R, T)
        assert cell["asked"] == {"requests_per_client": R, "tokens": T} and not cell["capped"]
        assert cell["prefill_ms"] == PREFILL and cell["prefill_share_limit"] == 0.05
    assert plan[32]["tokens"] == math.ceil(16 * 60 * 0.95 / (0.05 * 16))  # 1140, not 2280


def test_the_cap_lowers_r_then_t_to_their_floors_and_the_rows_say_capped(tmp_path):
    """One run's estimate, prompts_for(c, R) / w waves of w prefills and T rounds: past the
    limit R comes down first (to --requests-per-client), then T (to --serving-tokens), never
    below; T never passes the context's or the KV cache's room for a wave."""
    serving, args = _round_args(tmp_path, "--max-cell-seconds", "120")
    cell = serving.Cell(32, 16, PREFILL, 16.0)
    assert cell.seconds(10, 1140) == pytest.approx(20 * (16 * 60 + 1140 * 16) / 1e3)  # 384 s
    assert serving.cap(cell, (10, 1140), (4, 128), 200, 10**6) == (5, 1140)  # R alone: 192 s
    R, T = serving.cap(cell, (10, 1140), (4, 128), 120, 10**6)
    assert R == 4 and T == math.floor((120e3 * 16 / 128 - 16 * 60) / 16)  # 877
    assert cell.seconds(R, T) <= 120 < cell.seconds(R, T + 1)
    assert serving.cap(cell, (10, 1140), (4, 128), 1.0, 10**6) == (4, 128)  # the floors
    assert serving.cap(cell, (10, 1140), (4, 128), 1e9, 500) == (10, 500)  # the ceiling
    plan = serving.plan_cells(_probes(), "dflash", args, RUNNING, 8192, None)
    assert plan[32]["capped"] and plan[32]["requests_per_client"] == 4
    assert plan[32]["asked"] == {"requests_per_client": 10, "tokens": 1140}
    assert plan[32]["estimated_s"] <= 120 and not plan[4]["capped"]
    # the KV cache: 0.9 x 20000 tokens over a wave of 16, less the prompt's 200
    log = "[x] max_total_num_tokens=20000, chunked_prefill_size=8192, max_running_requests=16"
    kv = serving.kv_tokens(log)
    assert kv == 20000 and serving.token_ceiling(8192, kv, 16, 200.0) == 925
    plan = serving.plan_cells(_probes(), "dflash", args, RUNNING, 8192, kv)
    assert plan[32]["tokens"] <= 925 and plan[32]["capped"]


def _fake_bench(calls: list):
    def run_bench(argv):
        c = int(argv[argv.index("--max-concurrency") + 1])
        n = int(argv[argv.index("--num-prompts") + 1])
        tokens = int(argv[argv.index("--sharegpt-output-len") + 1])
        calls.append((c, n, tokens))
        wave = min(c, RUNNING)
        duration = n / wave * (wave * PREFILL + tokens * TPOT[c]) / 1e3
        first = calls.count(calls[-1]) == 1  # a cell's first run: 10% faster than its second
        return {
            "output_throughput": n * tokens / duration * (1.1 if first else 1.0),
            "median_ttft_ms": PREFILL * wave,
            "median_tpot_ms": TPOT[c],
            "accept_length": 3.5,
            "completed": n,
            "duration": duration,
            "total_input_tokens": 200 * n,
        }

    return run_bench


def test_bench_round_probes_then_runs_every_cell_twice_with_the_spread(tmp_path, monkeypatch):
    """Probes (warmed, c = 1 first), then run 1 of every cell, then run 2 (no warm-up: the
    probe warmed that c); each run's row carries mode, run, R, T, P and the prefill share it
    measured, within the limit; then a kind=spread row per cell with both runs' tok/s."""
    serving, args = _round_args(tmp_path, "--max-cell-seconds", "1e9")
    calls = []
    monkeypatch.setattr(serving, "run_bench", _fake_bench(calls))
    server = SimpleNamespace(name="dflash", port=1, log_text=lambda: "")
    rows = list(serving.cells(server, tmp_path / "d.jsonl", "tok", args, RUNNING, 8192))
    plan = serving.plan_cells(_probes(), "dflash", args, RUNNING, 8192, None)
    R4, T4 = plan[4]["requests_per_client"], plan[4]["tokens"]
    R32, T32 = plan[32]["requests_per_client"], plan[32]["tokens"]
    probes = [(1, 1, 256), (1, 16, 256), (4, 4, 256), (4, 16, 256), (32, 32, 256), (32, 128, 256)]
    runs = [(4, max(16, 4 * R4), T4), (32, 32 * R32, T32)]
    assert calls == probes + runs + runs
    assert [r.get("mode") for r in rows] == ["probe"] * 3 + ["steady"] * 6
    steady = [r for r in rows if r["mode"] == "steady" and "kind" not in r]
    assert [(r["run"], r["concurrency"]) for r in steady] == [(1, 4), (1, 32), (2, 4), (2, 32)]
    for r in steady:
        assert (r["requests_per_client"], r["tokens"]) == (
            plan[r["concurrency"]]["requests_per_client"],
            plan[r["concurrency"]]["tokens"],
        )
        assert r["prefill_ms"] == PREFILL and not r["capped"] and r["prompt_tokens"] == 200
        assert 0 < r["prefill_share"] <= 0.05, r
    spreads = [r for r in rows if r.get("kind") == "spread"]
    assert [s["concurrency"] for s in spreads] == [4, 32]
    for s in spreads:
        assert s["runs"] == 2 and len(s["runs_tok_s"]) == 2 and len(s["prefill_shares"]) == 2
        assert s["spread"] == pytest.approx(0.1 / 1.05)  # the fake's 10% between the runs


def test_bench_round_refuses_runs_without_steady_state(tmp_path):
    serving = load_script("round_serving")
    p = argparse.ArgumentParser()
    serving.add_arguments(p)
    with pytest.raises(SystemExit, match="--runs 3 needs --steady-state"):
        serving.check_args(p.parse_args(["--serving", "4", "--runs", "3"]))
    with pytest.raises(SystemExit, match="needs --serving"):
        serving.check_args(p.parse_args(["--steady-state"]))
    assert serving.check_args(p.parse_args(["--serving", "4"])).runs == 1


def test_bench_round_main_writes_steady_runs_and_spreads_beside_the_probes(tmp_path, monkeypatch):
    """main --serving --steady-state (no GPU, no server): serving_simulated_27b.jsonl holds each
    variant's probe rows, its runs' rows and its cells' spread rows, every one with the variant
    and the card; an automatic server's runs and probes count their widths, its spread rows
    do not; the prompt file holds the rule's R per client at the largest c."""
    bench = load_script("bench_round")
    log = "[x] max_total_num_tokens=400000, max_running_requests=16\n"
    offline_bench_round(monkeypatch, bench, log)
    monkeypatch.setattr(bench, "widths_rounds", lambda server: {"16": 1})
    sizes = []
    monkeypatch.setattr(
        bench.round_serving, "write_dataset", lambda path, n: sizes.append(n) or path
    )
    monkeypatch.setattr(bench.round_serving, "run_bench", _fake_bench([]))
    out = tmp_path / "out"
    argv = ["--out", str(out), "--work", str(tmp_path / "work"), "--batch", "1", "--profile", ""]
    argv += ["--variants", "dflash,ddtree32_auto", "--serving", "4,32", "--steady-state"]
    assert bench.main([*argv, "--max-cell-seconds", "1e9"]) == 0
    assert sizes == [32 * 10]  # R = 1 / (2 x 5%) at c = 32
    rows = [json.loads(x) for x in (out / "serving_simulated_27b.jsonl").read_text().splitlines()]
    for variant in ("dflash", "ddtree32_auto"):
        mine = [r for r in rows if r["variant"] == variant]
        kinds = [r.get("kind", r["mode"]) for r in mine]
        assert kinds == ["probe"] * 3 + ["steady"] * 4 + ["spread"] * 2
        assert all(r["card"] == "NVIDIA H100 80GB HBM3" and "max_running" in r for r in mine)
        counted = ["widths_rounds" in r for r in mine]
        assert counted == [variant == "ddtree32_auto"] * 7 + [False] * 2

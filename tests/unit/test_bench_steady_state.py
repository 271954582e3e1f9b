"""scripts/bench_serving.py --steady-state and its rule (scripts/harness.steady_state): runs long
enough that decode rounds, not prefills, fill them, two per cell, with their one-run spread.
A fake load generator stands in for sglang.bench_serving."""

from __future__ import annotations

import argparse
import json
import math
from types import SimpleNamespace

import pytest

from tests.fixtures import load_script


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

"""The GPU benchmark and test-server scripts, checked on CPU so device time is not spent on a
typo: their configs parse with SGLang's readers, every server command line parses with SGLang's
CLI, and the profiler-trace parser attributes kernel time to the right ranges."""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from tests.fixtures import H100, offline_bench_round

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    from tests.fixtures import load_script

    return load_script(name)


def _parse_cli(args: list[str]) -> argparse.Namespace:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(args)


def test_bench_round_configs_have_qwen36_27b_shapes(tmp_path):
    pytest.importorskip("sglang.srt.speculative.dflash_utils")
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.utils.hf_transformers.config import get_config

    bench = _script("bench_round")
    target, draft = bench.write_configs(tmp_path)
    cfg = get_config(str(target), trust_remote_code=False)
    text = cfg.text_config
    assert cfg.architectures == ["Qwen3_5ForConditionalGeneration"]
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size) == (5120, 64, 248320)
    assert text.layers_block_type.count("linear_attention") == 48
    assert text.layers_block_type.count("attention") == 16
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (24, 4, 256)
    assert (text.linear_num_key_heads, text.linear_num_value_heads) == (16, 48)
    dcfg = get_config(str(draft), trust_remote_code=False)
    parsed = parse_dflash_draft_config(draft_hf_config=dcfg)
    assert parsed.resolve_block_size() == 16
    assert parsed.resolve_target_layer_ids(target_num_layers=64) == [1, 16, 31, 46, 61]
    assert dcfg.num_hidden_layers == 5 and dcfg.hidden_size == 5120
    # the DFlash2-shaped draft: the same draft, SGLang's DFlash2 architecture and a selector of
    # rank 32 over K = 8, which DDTREE's variants on it name as --speculative-eagle-topk
    d2 = bench.dflash2_draft(draft)
    d2cfg = get_config(str(d2), trust_remote_code=False)
    parsed2 = parse_dflash_draft_config(draft_hf_config=d2cfg)
    assert d2cfg.architectures == ["DFlash2DraftModel"]
    assert (parsed2.selector_rank, parsed2.selector_top_k) == (32, 8)
    assert parsed2.resolve_target_layer_ids(target_num_layers=64) == [1, 16, 31, 46, 61]
    table = bench.variants(draft, bench.size_for(*H200))
    for name in ("dflash_dflash2", "ddtree32_dflash2", "ddtree32_auto_dflash2"):
        flags = table[name]
        assert bench.flag_value(flags, "--speculative-draft-model-path") == str(d2), name
    assert bench.flag_value(table["ddtree32_dflash2"], "--speculative-eagle-topk") == "8"
    assert bench.variant_env("ddtree32_auto_dflash2")["SGLANG_DDTREE_WIDTH"] == "auto"
    assert bench.variant_env("ddtree32_dflash2")["SGLANG_DDTREE_WIDTH"] == "fixed"
    assert bench.flag_value(table["dflash"], "--speculative-draft-model-path") == str(draft)


H200 = ("NVIDIA H200", 139.8)


def test_bench_round_server_commands_parse(tmp_path):
    pytest.importorskip("sglang.srt.server_args")
    bench = _script("bench_round")
    _, draft = bench.write_configs(tmp_path)
    for card in (H200, H100):
        sizing = bench.size_for(*card)
        table = bench.variants(draft, sizing)
        # every variant has an `_fp8kv` twin
        base = [n for n in table if not n.endswith("_fp8kv")]
        assert sorted(table) == sorted([*base, *(f"{n}_fp8kv" for n in base)])
        assert {"dflash_fp8kv", "ddtree32_auto_fp8kv"} <= set(table)
        for name, extra in table.items():
            own = sizing.with_kv_cache_dtype(bench.kv_cache_dtype(name))
            ns = _parse_cli(
                [
                    "--model-path",
                    "x",
                    *bench.COMMON,
                    *own.flags(),
                    "--cuda-graph-max-bs-decode",
                    "8",
                    *extra,
                ]
            )
            assert ns.load_format == "dummy", name
            assert ns.mem_fraction_static == sizing.mem_fraction_static
            assert ns.quantization == ("fp8" if card == H100 else None)
            # an fp8 target's draft stays bf16 (SGLang's `unquant`: no quantization)
            draft_quant = "unquant" if card == H100 and not name.startswith("none") else None
            assert ns.speculative_draft_model_quantization == draft_quant, (card, name)
            # `_fp8kv`: target and draft KV in fp8_e4m3 (the draft's follows --kv-cache-dtype)
            fp8kv = name.endswith("_fp8kv")
            assert ns.kv_cache_dtype == ("fp8_e4m3" if fp8kv else "auto"), name
            assert ns.speculative_draft_kv_cache_dtype is None
            if name.startswith("ddtree"):
                nodes = int(name[6:].split("_")[0])
                assert ns.speculative_algorithm == "DDTREE"
                assert ns.speculative_num_draft_tokens == nodes
                assert 1 <= ns.max_running_requests <= 16
                # the compact scratch (a few states' worth per request) lets 16 requests run
                # at every N
                assert ns.max_running_requests == 16
                assert ns.max_mamba_cache_size >= 5 * ns.max_running_requests
                env = bench.variant_env(name)
                assert "SGLANG_MAMBA_SSM_DTYPE" not in env
                assert env["SGLANG_DDTREE_WIDTH"] == ("auto" if "_auto" in name else "fixed")


def test_bench_round_sizes_itself_from_the_card():
    """One H200 keeps what every H200 row was measured with (bf16, 0.85, a 48 GiB verify-scratch
    budget, so the same running requests per variant); one H100 cannot hold the bf16 target
    beside a scratch (measured: its weights alone needed --mem-fraction-static above 0.866) and
    runs it in fp8 (30.6 GiB of weights with the bf16 draft), leaving SGLang's own estimate of
    the activations' memory (12.7 GiB) outside the static share: 0.84, not 0.85."""
    bench = _script("bench_round")
    assert bench.weights_gib("bf16") == pytest.approx(53.3, abs=0.05)
    assert bench.weights_gib("fp8") == pytest.approx(30.6, abs=0.05)
    assert bench.draft_params() == pytest.approx(1.73e9, rel=0.01)
    assert sum(bench.target_params()) == pytest.approx(26.9e9, rel=0.01)
    h200, h100 = bench.size_for(*H200), bench.size_for(*H100)
    assert (h200.target_dtype, h200.mem_fraction_static, h200.scratch_gib) == ("bf16", 0.85, 48)
    assert (h100.target_dtype, h100.mem_fraction_static, h100.scratch_gib) == ("fp8", 0.84, 19)
    assert h200.flags() == ["--mem-fraction-static", "0.85"] and h200.draft_flags() == []
    assert h100.flags() == ["--mem-fraction-static", "0.84", "--quantization", "fp8"]
    assert h100.draft_flags() == ["--speculative-draft-model-quantization", "unquant"]
    # what the activations get outside the static memory: at least SGLang's estimate
    assert (1 - h100.mem_fraction_static) * H100[1] >= bench.SGLANG_RESERVE_GIB
    assert (1 - 0.85) * H100[1] < bench.SGLANG_RESERVE_GIB  # where the constant 0.85 fell short
    # bf16 on the H100 would leave the pools too little (13.6 GiB)
    assert 0.84 * H100[1] - bench.weights_gib("bf16") < bench.KV_AND_STATES_GIB
    # the H200's running requests per variant are those its rows record (docs/data), also at
    # the 140.4 GiB nvidia-smi gives it (a 49 GiB budget)
    for gib in (139.8, 140.4):
        table = {
            name: int(bench.flag_value(flags, "--max-running-requests"))
            for name, flags in bench.variants(Path("d"), bench.size_for("H200", gib)).items()
        }
        assert (table["dflash"], table["nextn"]) == (16, 16)
        assert table["ddtree64"] == table["ddtree128"] == table["none"] == 16
    # the H100's: DFLASH's float32 scratch at width 16 (2.25 GiB a request, and one more)
    # holds 7 requests in 19 GiB; the compact DDTREE scratch runs 16
    table = {
        name: int(bench.flag_value(flags, "--max-running-requests"))
        for name, flags in bench.variants(Path("d"), h100).items()
    }
    assert (table["dflash"], table["dflash_bf16ssm"], table["nextn"]) == (7, 15, 15)
    assert table["ddtree64"] == table["ddtree32_auto"] == table["none"] == 16
    # --max-running beyond what the card holds is capped to it (live states of 6 slots each)
    assert (h200.most_running, h100.most_running) == (55, 29)
    capped = bench.variants(Path("d"), h100, cap=64)
    assert bench.flag_value(capped["ddtree64_auto"], "--max-running-requests") == "29"
    assert bench.flag_value(capped["dflash"], "--max-running-requests") == "7"
    assert bench.max_requests(16, 48) == 16 and bench.max_requests(128, 19) == 0
    with pytest.raises(SystemExit, match="too little memory for the pools even in fp8"):
        bench.size_for("NVIDIA A100-SXM4-40GB", 39.4)


def test_bench_round_sizes_an_fp8_kv_cache_at_one_byte_a_value():
    """`--kv-cache-dtype fp8_e4m3` keeps a token's KV (target and draft) in 32 + 10 KiB instead
    of 64 + 20: the same reserved KV tokens take half the memory and the verify scratch gets the
    rest; the card's fraction and target dtype do not change."""
    bench = _script("bench_round")
    assert (bench.kv_kib_per_token(), bench.kv_kib_per_token(1)) == (84.0, 42.0)
    assert bench.kv_bytes("auto") == 2 and bench.kv_bytes("fp8_e4m3") == 1
    # the KV share of the 17 GiB: what 16 requests' live states (and 0.1 GiB) leave, ~39K tokens
    assert bench.KV_RESERVED_GIB == pytest.approx(3.14, abs=0.01)
    assert bench.KV_RESERVED_GIB * 2**20 / 84 == pytest.approx(39_150, rel=0.01)
    assert bench.kv_and_states_gib() == bench.KV_AND_STATES_GIB == 17.0
    assert bench.kv_and_states_gib("fp8_e4m3") == pytest.approx(17.0 - 3.14 / 2, abs=0.01)
    assert (bench.kv_floor_gib(), bench.kv_floor_gib("fp8_e4m3")) == (4.0, 2.0)
    for card, (scratch, most) in ((H200, (50, 57)), (H100, (20, 30))):
        bf16 = bench.size_for(*card)
        fp8 = bench.size_for(*card, "fp8_e4m3")
        assert bf16.kv_cache_dtype == "auto" and fp8.kv_cache_dtype == "fp8_e4m3"
        assert (fp8.scratch_gib, fp8.most_running) == (scratch, most), card
        assert (fp8.target_dtype, fp8.mem_fraction_static) == (
            bf16.target_dtype,
            bf16.mem_fraction_static,
        )
        assert bf16.with_kv_cache_dtype("auto") is bf16
        assert bf16.with_kv_cache_dtype("fp8_e4m3") == fp8
        assert fp8.flags() == [*bf16.flags(), "--kv-cache-dtype", "fp8_e4m3"]
        assert bf16.row()["kv_cache_dtype"] == "auto"
        assert fp8.row()["kv_cache_dtype"] == "fp8_e4m3"
    assert bench.kv_cache_dtype("ddtree32_auto_fp8kv") == "fp8_e4m3"
    assert bench.kv_cache_dtype("dflash") == bench.kv_cache_dtype("ddtree32_auto") == "auto"
    # an `_fp8kv` variant's switches are its twin's
    assert bench.variant_env("ddtree32_auto_fp8kv") == bench.variant_env("ddtree32_auto")
    assert bench.variant_env("ddtree32_fp8kv")["SGLANG_DDTREE_WIDTH"] == "fixed"
    # on the H100: DFLASH's running requests stay 7 (20 GiB holds 8 x 2.25 GiB, one of them
    # SGLang's padding); its bf16-state twin 16; DDTREE's ceiling 30 with --max-running 64
    h100 = bench.size_for(*H100)
    table = bench.variants(Path("d"), h100, cap=64)
    running = {n: int(bench.flag_value(f, "--max-running-requests")) for n, f in table.items()}
    assert (running["dflash_fp8kv"], running["dflash_bf16ssm_fp8kv"]) == (7, 16)
    assert running["ddtree32_auto_fp8kv"] == 30 and running["ddtree32_auto"] == 29


def test_bench_round_rows_carry_the_card(tmp_path, monkeypatch):
    """main on a mocked H100 (no GPU, no server): every row of round_cost_27b.jsonl and
    serving_simulated_27b.jsonl names the card, its memory, the target's dtype, the KV cache's
    and the running-request cap; the servers get the fp8 target and the bf16 draft, an `_fp8kv`
    variant's an fp8 KV cache and its own scratch budget; a variant of which not one request
    fits starts no server."""
    bench = _script("bench_round")
    log = (
        "[x] Load weight end. elapsed=3.1 s, type=Qwen3_5ForConditionalGeneration, "
        "avail mem=50.10 GB, mem usage=27.52 GB.\n"
        "[x] Load weight end. elapsed=0.4 s, type=DFlashDraftModel, "
        "avail mem=46.80 GB, mem usage=3.25 GB.\n"
        "[x] intermediate_ssm_state_cache size: 18.00GB intermediate_conv_window_cache size\n"
    )
    started = offline_bench_round(monkeypatch, bench, log)
    plots = []
    monkeypatch.setattr(bench, "plot", lambda rows, path, card: plots.append(card))
    monkeypatch.setattr(bench.round_serving, "write_dataset", lambda path, n: path)
    monkeypatch.setattr(
        bench.round_serving,
        "serve",
        lambda server, dataset, tok, c, *a: {"concurrency": c, "output_tok_s": 1.0},
    )
    out = tmp_path / "out"
    argv = ["--out", str(out), "--work", str(tmp_path / "work"), "--batch", "1,8"]
    argv += ["--variants", "dflash,ddtree32_auto,dflash_fp8kv@1", "--profile", ""]
    assert bench.main([*argv, "--serving", "4", "--serving-variants", "dflash"]) == 0
    rows = [json.loads(x) for x in (out / "round_cost_27b.jsonl").read_text().splitlines()]
    served = [json.loads(x) for x in (out / "serving_simulated_27b.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and len(served) == 1
    for row in rows + served:
        assert row["card"] == "NVIDIA H100 80GB HBM3" and row["card_gib"] == 79.6
        assert row["target_dtype"] == "fp8" and row["mem_fraction_static"] == 0.84
        fp8kv = row["variant"] == "dflash_fp8kv"
        assert row["kv_cache_dtype"] == ("fp8_e4m3" if fp8kv else "auto")
        assert row["scratch_gib"] == (20 if fp8kv else 19) and "max_running" in row
    got = {(r["variant"], r["bs"]): r for r in rows}
    assert got["dflash", 1]["max_running"] == 7 and got["dflash", 1]["round_ms"] == 20.0
    assert got["dflash", 1]["weights_gb"] == [27.52, 3.25]
    assert got["dflash", 8]["error"] == "does not fit: at most 7 running requests"
    assert got["ddtree32_auto", 8]["max_running"] == 16 and "error" not in got["ddtree32_auto", 8]
    assert served[0]["variant"] == "dflash" and served[0]["max_running"] == 7
    assert got["dflash_fp8kv", 1]["max_running"] == 7
    assert [s.name for s in started] == ["dflash", "ddtree32_auto", "dflash_fp8kv"]
    assert plots == ["one NVIDIA H100 80GB HBM3 (fp8)"]
    for server in started:
        flags = " ".join(server.args)
        assert "--mem-fraction-static 0.84" in flags and "--quantization fp8" in flags
        assert "--speculative-draft-model-quantization unquant" in flags
        fp8kv = server.name == "dflash_fp8kv"
        assert ("--kv-cache-dtype fp8_e4m3" in flags) == fp8kv


def test_bench_round_puts_its_servers_in_the_simulated_world(tmp_path, monkeypatch):
    """--simulate REGIME: every server starts with scripts/simworld first on PYTHONPATH and
    DDTREE_SIMULATE=REGIME beside its variant's switches, and every row records the world; a
    bad value stops before any server starts."""
    bench = _script("bench_round")
    started = offline_bench_round(monkeypatch, bench)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    out = tmp_path / "out"
    argv = ["--out", str(out), "--work", str(tmp_path / "work"), "--batch", "1"]
    argv += ["--variants", "dflash,ddtree32", "--profile", ""]
    assert bench.main([*argv, "--simulate", "code:seed=3"]) == 0
    folder = ROOT / "scripts" / "simworld"
    for server in started:
        assert server.env["DDTREE_SIMULATE"] == "code:seed=3"
        assert server.env["PYTHONPATH"].split(os.pathsep)[0] == str(folder)
    assert started[1].env["SGLANG_DDTREE_WIDTH"] == "fixed"
    rows = [json.loads(x) for x in (out / "round_cost_27b.jsonl").read_text().splitlines()]
    assert {(r["simulate"]["name"], r["simulate"]["seed"]) for r in rows} == {("code", 3)}
    started.clear()
    with pytest.raises(ValueError, match="unknown regime 'fast'"):
        bench.main([*argv, "--simulate", "fast"])
    assert started == []


def test_no_script_imports_one_that_imports_it():
    """bench_round and bench_serving share the load generator's and the trace's helpers through
    scripts/harness.py and scripts/round_trace.py; no script imports another that imports it back
    (at module level or inside a function)."""
    import ast

    scripts = ROOT / "scripts"
    names = {p.stem for p in scripts.glob("*.py")}
    graph = {}
    for path in scripts.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
        graph[path.stem] = found & names - {path.stem}

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(
            n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph[start]
        )

    assert "bench_serving" not in graph["bench_round"]
    assert "bench_round" not in graph["bench_serving"] | graph["bench_e2e"]
    assert [name for name in sorted(graph) if reaches(name, name, {name})] == []


def test_bench_round_reads_the_automatic_widths_cost_table():
    from sglang_ddtree.round.widths import WidthPolicy

    bench = _script("bench_round")
    assert bench.width_table("no table here") is None
    policy = WidthPolicy((16, 32), buckets=(1, 8), explore=2)
    for bs, ms in ((1, {16: 20.0, 32: 21.5}), (8, {16: 30.0, 32: 41.0})):
        for _ in range(4):
            width = policy.choose(bs)
            policy.observe_cost(bs, width, ms[width])
    log = f"[x] DDTREE widths after 8 rounds (ms per round):\n{policy.table()}\n[x] next line"
    got = bench.width_table("[x] older\n" + log)
    assert got["widths"] == [16, 32]
    assert got["ms"] == {1: [20.0, 21.5], 8: [30.0, 41.0]}
    assert got["chosen"] == "16 x 4, 32 x 4"


def test_bench_round_measures_the_round_as_the_slope_over_counted_rounds(monkeypatch):
    """Requests that accept different numbers of tokens per round (real or simulated
    acceptance) still give the round's time: latency = prefill + rounds x round, fitted over
    every request, whatever each request's rounds were, and a slow batch of 1-token requests
    (DDTREE's once took 900 ms at bs 16) stays out of the fit; plain decoding counts the tokens
    after the first."""
    import random

    bench = _script("bench_round")
    rng = random.Random(0)

    def fake(server, bs, tokens, temperature=0.0):
        out = []
        for _ in range(bs):
            rounds = 0 if tokens == 1 else max(1, round(tokens / rng.uniform(2.0, 6.0)))
            meta = {
                "completion_tokens": tokens,
                "spec_verify_ct": rounds,
                "spec_accept_length": tokens / max(rounds, 1),
            }
            latency = 0.9 if tokens == 1 else 0.150 + 0.022 * rounds + rng.uniform(0, 2e-4)
            out.append({"latency": latency, "meta": meta})
        return out

    monkeypatch.setattr(bench, "timed_requests", fake)
    for bs in (1, 8):
        row = bench.measure(None, bs, 64)
        assert abs(row["round_ms"] - 22.0) < 0.1, row
        assert row["requests"] == 2 * max(bs, 3)
        assert row["prefill_ms"] == 900.0
    assert bench._decode_rounds({"completion_tokens": 64}) == 63  # plain decoding
    assert bench._decode_rounds({"completion_tokens": 64, "spec_verify_ct": 17}) == 17
    assert bench.slope([(3, 1.0), (3, 2.0)]) is None


def test_bench_round_serving_warms_each_concurrency_before_measuring(tmp_path, monkeypatch):
    """One unmeasured wave of `concurrency` requests, then the measured run, whose row is what
    the result says."""
    serving = _script("round_serving")
    calls = []

    def run_bench(argv):
        calls.append(argv)
        return {
            "output_throughput": 100.0 * len(calls),
            "median_tpot_ms": 5.0,
            "median_ttft_ms": 90.0,
            "accept_length": 3.5,
        }

    monkeypatch.setattr(serving, "run_bench", run_bench)
    server = type("S", (), {"name": "ddtree32_auto", "port": 32001})()
    row = serving.serve(server, tmp_path / "p.jsonl", "tok", 4, 128, 2, tmp_path)
    prompts = [int(a[a.index("--num-prompts") + 1]) for a in calls]
    outs = [a[a.index("--output-file") + 1] for a in calls]
    assert prompts == [4, 16] and outs[0].endswith("_warmup.jsonl")
    assert not outs[1].endswith("_warmup.jsonl")
    assert row["output_tok_s"] == 200.0 and row["requests"] == 16 and row["accept_len"] == 3.5


def test_bench_e2e_and_test_server_commands_parse(tmp_path):
    pytest.importorskip("sglang.srt.server_args")
    from tests.gpu.servers import COMMON, ENV, MODEL_VARIANTS, VARIANTS

    bench = _script("bench_e2e")
    for name, extra in bench.server_table("draft", [32, 64]).items():
        ns = _parse_cli(["--model-path", "x", *bench.COMMON, *extra])
        assert ns.attention_backend == "flashinfer", name
    for model, variants in MODEL_VARIANTS.items():
        for variant in variants:
            ns = _parse_cli(["--model-path", "x", *COMMON, *VARIANTS[variant](model, "d")])
            assert ns.max_running_requests == 16, (model, variant)
            assert ns.enable_deterministic_inference == ("_det" in variant)
    # the sync check (test tooling) on every server, through server_debug's sitecustomize
    assert ENV["DDTREE_SYNC_CHECK"] == "1"
    assert ENV["PYTHONPATH"].split(os.pathsep)[0].endswith("tests/gpu/server_debug")
    assert not any(name.startswith("SGLANG_DDTREE_") for name in ENV)


def test_bench_e2e_attaches_to_the_suites_servers_through_its_table(tmp_path, monkeypatch):
    """`python -m tests.gpu.servers launch ROOT` writes ROOT/servers.json; bench_e2e --attach
    reads the pair's servers from it (names, ports, tree shape) without importing the tests,
    and says what is missing when the set has not been started."""
    from tests.gpu import servers as suite

    bench = _script("bench_e2e")
    with pytest.raises(SystemExit, match="no server table under"):
        bench.attached_servers(tmp_path)
    pair = {n: s for n, s in suite.server_set(tmp_path).items() if n.startswith("pair-")}
    suite.write_server_table(tmp_path, pair)
    monkeypatch.setattr(bench.harness.Server, "is_healthy", lambda self: True)
    got = {s.name: s for s in bench.attached_servers(tmp_path)}
    nodes, _ = suite.tree_shape("pair")
    assert sorted(got) == sorted(["none", "dflash", f"ddtree{nodes}", "ddtree64"])
    assert got["dflash"].port == pair["pair-dflash"].port
    assert got["ddtree64"].args == pair["pair-ddtree64"].args


def test_the_benchmarks_plot_through_the_shared_helper(tmp_path):
    """bench_round's and bench_e2e's plots (scripts/harness.line_plot) write their PNGs."""
    pytest.importorskip("matplotlib")
    rows = [
        {"variant": v, "bs": bs, "round_ms": ms}
        for v, bs, ms in (("dflash", 8, 30.0), ("dflash", 1, 20.0), ("ddtree32", 1, 21.0))
    ]
    _script("bench_round").plot(rows, tmp_path / "round.png")
    rows = [
        {"server": s, "concurrency": c, "tokens_per_s": t, "accept_len": a}
        for s, c, t, a in (("dflash", 1, 100.0, 2.0), ("dflash", 4, 300.0, 2.1))
    ]
    _script("bench_e2e").plot(rows, tmp_path / "e2e.png")
    assert all((tmp_path / f).stat().st_size > 1000 for f in ("round.png", "e2e.png"))


def _span(cat: str, name: str, ts: int, dur: int, tid: int = 1) -> dict:
    """A complete ("X") event of a torch-profiler trace."""
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_bench_round_reads_the_gdn_scratch_from_either_pools_log(caplog):
    """SGLang's pool logs its per-node state buffer; the compact pool (state/gdn_pool.py)
    its own line, read here from the pool the hook really builds on the CPU."""
    pytest.importorskip("sglang.srt.mem_cache.memory_pool")
    import logging

    from tests.unit.test_gdn_pool import hybrid_pool

    bench = _script("bench_round")
    sglang_line = "intermediate_ssm_state_cache size: 45.00GB intermediate_conv_window_cache size"
    assert bench.gdn_scratch_gb(sglang_line) == 45.0
    assert bench.gdn_scratch_gb("Mamba Cache is allocated. conv_state size: 1.00GB") is None
    from sglang_ddtree.state import gdn_pool

    caplog.set_level(logging.INFO, logger=gdn_pool.__name__)
    pool = hybrid_pool(64, requests=40, slots=120)  # the default options: the compact scratch
    caches = pool.get_speculative_mamba2_params_all_layers()
    added = caches.intermediate_ssm.nbytes + caches.intermediate_conv_window[0].nbytes
    assert bench.gdn_scratch_gb(caplog.text) == round(added / (1 << 30), 3) > 0


def test_trace_parser_sums_kernels_inside_each_range(tmp_path):
    bench = _script("round_trace")
    events = [
        _span("user_annotation", "ddtree.draft", 0, 100),
        _span("user_annotation", "ddtree.draft", 200, 100),
        _span("user_annotation", "ddtree.verify", 400, 100),
        # the profiler's GPU-timeline mirror of a range: not a range of its own
        _span("gpu_user_annotation", "ddtree.draft", 5, 50, tid=7),
        {"cat": "cuda_driver", "ts": 220, "tid": 1, "args": {"correlation": 5}},  # graph replay
        {"cat": "kernel", "dur": 20, "args": {"correlation": 5}},
        {"cat": "cuda_runtime", "ts": 10, "tid": 1, "args": {"correlation": 1}},
        {"cat": "cuda_runtime", "ts": 210, "tid": 1, "args": {"correlation": 2}},
        {"cat": "cuda_runtime", "ts": 410, "tid": 1, "args": {"correlation": 3}},
        {"cat": "cuda_runtime", "ts": 420, "tid": 2, "args": {"correlation": 4}},  # other thread
        {"cat": "kernel", "dur": 30, "args": {"correlation": 1}},
        {"cat": "kernel", "dur": 50, "args": {"correlation": 2}},
        {"cat": "kernel", "dur": 7, "args": {"correlation": 3}},
        {"cat": "gpu_memcpy", "dur": 3, "args": {"correlation": 3}},
        {"cat": "kernel", "dur": 1000, "args": {"correlation": 4}},
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    parts = bench.parse_trace(bench.load_events(str(path)))
    assert parts == {"ddtree.draft": 0.05, "ddtree.verify": 0.01}  # ms per range occurrence


def test_launcher_restarts_a_failed_server_once_and_reports_status(tmp_path, monkeypatch):
    """The GPU test-server launcher (tests/gpu/servers.py) on fake servers: one that dies on
    its first start is started again once, alone, and comes up; one that always dies ends
    "failed"; status.json ends with every server settled."""
    from tests.gpu import servers as mod

    starts: dict[str, int] = {}

    class Fake:
        def __init__(self, name, log_dir):
            self.name, self.log_path = name, Path(log_dir) / f"server_{name}.log"

        def start(self, detach=False):
            starts[self.name] = starts.get(self.name, 0) + 1
            self.log_path.write_text("log\n")

        def is_healthy(self):
            n = starts.get(self.name, 0)
            return n >= 1 and not (self.name == "b" and n == 1) and self.name != "c"

        def is_alive(self):
            return self.is_healthy()

    fakes = {n: Fake(n, tmp_path) for n in ("a", "b", "c")}
    monkeypatch.setattr(mod, "server_set", lambda root: fakes)
    monkeypatch.setattr(mod, "LAUNCH_GAP_S", 0.0)
    monkeypatch.setattr(mod.time, "sleep", lambda s: None)
    mod.run_launcher(tmp_path, timeout=5)
    assert mod.read_status(tmp_path) == {"a": "healthy", "b": "healthy", "c": "failed"}
    assert starts == {"a": 1, "b": 2, "c": 2}
    assert (tmp_path / "server_b.first_try.log").exists()
    assert mod.wait(tmp_path, timeout=1) == mod.read_status(tmp_path)


def test_launcher_boots_at_most_max_booting_servers_at_once(tmp_path, monkeypatch):
    """The launcher keeps at most MAX_BOOTING servers booting, starts the rest in launch order
    as earlier ones come up, and settles every one."""
    from tests.gpu import servers as mod

    order, looks = [], {}

    class Fake:
        def __init__(self, name):
            self.name, self.log_path = name, tmp_path / f"server_{name}.log"

        def start(self, detach=False):
            order.append(self.name)
            looks[self.name] = 0

        def is_healthy(self):
            if self.name not in looks:
                return False
            looks[self.name] += 1
            return looks[self.name] > 3  # up on the launcher's third look after its start

        def is_alive(self):
            return True

    names = [f"s{i}" for i in range(7)]
    monkeypatch.setattr(mod, "server_set", lambda root: {n: Fake(n) for n in names})
    monkeypatch.setattr(mod, "LAUNCH_GAP_S", 0.0)
    monkeypatch.setattr(mod, "MAX_BOOTING", 3)
    monkeypatch.setattr(mod.time, "sleep", lambda s: None)
    most = []
    write = mod._write_status

    def spy(root, status):
        most.append(sum(n in looks and v == "starting" for n, v in status.items()))
        write(root, status)

    monkeypatch.setattr(mod, "_write_status", spy)
    mod.run_launcher(tmp_path, timeout=5)
    assert order == names
    assert max(most) == 3
    assert set(mod.read_status(tmp_path).values()) == {"healthy"}


def test_fp32_referee_scores_greedy_tokens_zero_and_others_positive():
    """tests/gpu's float32 referee (harness.fp32_deficit) on the shipped pair: the reference
    engine's own greedy tokens score 0, any other token scores its gap to the argmax."""
    import torch

    from sglang_ddtree import DEMO_PAIR_DIR
    from sglang_ddtree.reference.engine import generate_plain, load_pair
    from tests.gpu import harness

    target, _, tok = load_pair(DEMO_PAIR_DIR / "target", DEMO_PAIR_DIR / "draft")
    prompt = tok("def fibonacci(n):")["input_ids"]
    tokens = list(generate_plain(target, torch.tensor(prompt), 6).tokens)
    assert [harness.fp32_deficit(target, prompt, tokens, i) for i in range(6)] == [0.0] * 6
    other = [*tokens[:3], (tokens[3] + 1) % 8192]
    assert harness.fp32_deficit(target, prompt, other, 3) > 0.0


def test_greedy_referee_allows_what_bf16_strays_by_elsewhere_and_nothing_more():
    """tests/gpu's referee for tokens beyond the bf16 tolerance: a float32 argmax token passes;
    a token below the float32 argmax passes only within twice the bf16-vs-float32 gap measured at
    the same sequence's other positions."""
    import torch

    from sglang_ddtree import DEMO_PAIR_DIR
    from sglang_ddtree.reference.engine import generate_plain, load_pair
    from tests.gpu import harness

    target, _, tok = load_pair(DEMO_PAIR_DIR / "target", DEMO_PAIR_DIR / "draft")
    prompt = tok("def fibonacci(n):")["input_ids"]
    tokens = list(generate_plain(target, torch.tensor(prompt), 6).tokens)
    bf16 = [0.0, 0.0, 0.4, 0.0, 0.3, 0.0]  # teacher forcing strays from float32 at 2 and 4
    assert harness.beyond_tol_referee(target, prompt, tokens, bf16, 0.25) == [
        (2, 0.4, 0.0, 0.3),
        (4, 0.3, 0.0, 0.4),
    ]
    wrong = [*tokens[:5], (tokens[5] + 1) % 8192]
    fp32 = harness.fp32_deficits(target, prompt, wrong)[5]
    bf16 = [0.0] * 5 + [fp32]  # both precisions call it off-argmax, and agree elsewhere
    (row,) = harness.beyond_tol_referee(target, prompt, wrong, bf16, 0.25)
    assert fp32 > 0.25 and not harness.referee_accepts(row, 0.25)  # the test's assertion fails
    assert harness.referee_accepts((5, 0.27, 0.253, 0.215), 0.25)  # a bf16 near-tie seen on the GPU
    assert harness.referee_verdict(row, 0.25) is None
    # a served case: 6.125 nats in bf16, 2.885 in float32 at the same position: unresolved there,
    # within twice its controls' worst (1.719); not beyond a tighter bound, not when the two
    # precisions agree better, and never for a token far below the argmax
    row = (15, 97, 6.125, 2.885, 0.384)
    assert harness.referee_verdict(row, 0.25, bound=2 * 1.719) == "unresolved"
    assert not harness.referee_accepts(row, 0.25)
    assert harness.referee_verdict(row, 0.25, bound=2.0) is None
    assert harness.referee_verdict((97, 5.0, 2.885, 0.384), 0.25, bound=4.0) is None
    assert harness.referee_verdict((97, 12.0, 5.0, 0.384), 0.25, bound=2 * 1.719) is None


def test_top_kernels_ranks_gpu_time_per_round():
    bench = _script("round_trace")
    events = [
        _span("user_annotation", "scheduler.run_batch", 0, 8),
        _span("user_annotation", "scheduler.run_batch", 10, 8),
        _span("kernel", "gemm", 1, 3000),
        _span("kernel", "gemm", 11, 3000),
        _span("kernel", "gdn_tree", 2, 5000),
        _span("kernel", "gdn_tree", 12, 5000),
        _span("kernel", "tiny", 3, 10),
    ]
    assert bench.top_kernels(events, n=2) == [("gdn_tree", 5.0), ("gemm", 3.0)]


def test_host_trace_parser_counts_rounds_parts_and_own_syncs():
    bench = _script("round_trace")
    events = [
        _span("user_annotation", "scheduler.run_batch", 0, 8),
        _span("user_annotation", "scheduler.run_batch", 10, 8),
        _span("user_annotation", "scheduler.run_batch", 22, 8),
        _span("user_annotation", "ddtree.draft", 1, 2000),
        _span("user_annotation", "ddtree.draft", 11, 4000),
        # a sync under SGLang's code called from ours: SGLang's
        _span("python_function", "sglang_ddtree/x.py(1): f", 1, 5),
        _span("python_function", "sglang/srt/y.py(2): g", 2, 2),
        _span("cuda_runtime", "cudaStreamSynchronize", 3, 1),
        # a sync in our own frame: ours
        _span("python_function", "sglang_ddtree/x.py(9): h", 12, 3),
        _span("cuda_runtime", "cudaStreamSynchronize", 13, 1),
        # launches: two inside a ddtree range, one outside any
        _span("cuda_runtime", "cudaLaunchKernel", 4, 1),
        _span("cuda_runtime", "cudaGraphLaunch", 14, 1),
        _span("cuda_runtime", "cudaLaunchKernel", 5000, 1),
    ]
    host = bench.parse_trace_host(events)
    assert host["launches_per_round"] == 1.0
    assert host["launches_by_range"] == {"ddtree.draft": 2 / 3}
    assert host["round_period_ms"] == 0.011  # median of 10 us and 12 us
    assert host["host_ms"] == {"ddtree.draft": 3.0}
    assert host["syncs_per_round"] == 2 / 3
    assert host["own_syncs_per_round"] == 1 / 3
    assert host["syncs_by_frame"] == {
        "sglang/srt/y.py(2): g": 1 / 3,
        "sglang_ddtree/x.py(9): h": 1 / 3,
    }
    # host time per round by function, inclusive, sglang's and ours only
    funcs = bench.host_functions([*events, _span("python_function", "torch/z.py(3): t", 4, 9)])
    assert funcs == [
        ("sglang_ddtree/x.py(1): f", 0.0017),
        ("sglang_ddtree/x.py(9): h", 0.001),
        ("sglang/srt/y.py(2): g", 0.0007),
    ]
    # beyond the first n, only ours are kept
    assert [f for f, _ in bench.host_functions(events, n=1)] == [
        "sglang_ddtree/x.py(1): f",
        "sglang_ddtree/x.py(9): h",
    ]


def test_project_budget_leaves_out_automatic_servers_and_names_clashes(tmp_path):
    """An automatic-width server's rows (bench_round's `ddtreeN_auto`) have no one width; two
    fixed variants of one width (a default and an opt-out) need --variants."""
    bench = _script("project_budget")
    row = {"bs": 1, "round_ms": 20.0}
    rows = [{**row, "variant": v} for v in ("dflash", "ddtree32", "ddtree64", "ddtree64_auto")]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cost, tokens = bench.load(path, ROOT / "docs" / "data" / "acceptance.jsonl", 0.0)
    assert sorted(cost.ms) == sorted([bench.CHAIN, 32, 64])
    path.write_text(path.read_text() + json.dumps({**row, "variant": "ddtree32_sglangplan"}) + "\n")
    with pytest.raises(SystemExit, match="ddtree32.*ddtree32_sglangplan.*--variants"):
        bench.load(path, ROOT / "docs" / "data" / "acceptance.jsonl", 0.0)
    cost, _ = bench.load(
        path,
        ROOT / "docs" / "data" / "acceptance.jsonl",
        0.0,
        ["dflash", "ddtree32_sglangplan", "ddtree64"],
    )
    assert sorted(cost.ms) == sorted([bench.CHAIN, 32, 64])


def test_tree_build_bench_runs_the_server_head_on_cpu():
    """scripts/bench_tree_build.py's configuration path (the server's DraftTreeHead on random
    pair-shaped weights) on CPU: a valid tree of the asked size, nothing timed."""
    from sglang_ddtree.tree.testing import check_tree_invariants

    bench = _script("bench_tree_build")
    row, tree = bench.run_one("pair", "torch", bs=2, nodes=16, iters=1, device="cpu")
    assert row == {"shape": "pair", "builder": "torch", "bs": 2, "nodes": 16}
    assert tree.tokens.shape == (2, 16)
    check_tree_invariants(tree)


def test_project_budget_multiplies_the_measured_rows(capsys):
    """scripts/project_budget.py on the committed rows: the policy's choice per batch size and
    the projection (tokens per round / ms per round against DFLASH's), recomputed here."""
    bench = _script("project_budget")
    data = Path(__file__).resolve().parents[2] / "docs" / "data"
    rounds = data / "round_cost_27b.jsonl"
    # the sitting that measured fixed widths 32 and 64 beside DFLASH at bs 1, 8 and 16
    sitting = next(
        json.loads(x)["sitting"]
        for x in rounds.read_text().splitlines()
        if '"ddtree64_compact_conv_chunk"' in x
    )
    cost, tokens = bench.load(rounds, data / "acceptance.jsonl", 0.0, sitting=sitting)
    assert cost.batch_sizes == (1, 8, 16)
    rows = bench.project(cost, tokens, cost.batch_sizes)
    chain_rate = {bs: tokens[0] / cost.cost(bs, 0) for bs in cost.batch_sizes}
    for row in rows:
        width = 0 if row["choice"] == "chain" else int(row["choice"][2:])
        best = max(tokens[w] / cost.cost(row["bs"], w) for w in tokens)
        assert tokens[width] / cost.cost(row["bs"], width) == best
        assert row["projected_vs_dflash"] == best / chain_rate[row["bs"]]
    assert [r["choice"] for r in rows] == ["N=32", "N=32", "chain"]


def test_bench_gdn_tree_parses_its_sweeps_before_any_gpu_work():
    """The sweep flags fail on a typo at once, and tf32x3 is a precision, not a fourth field
    (splitting it there would cost a GPU call)."""
    bench = _script("bench_gdn_tree")
    assert bench.parse_chunk_tiles("32x4xtf32,64x8xtf32x3,16x4xieee,64x4xsplit") == [
        (32, 4, "tf32"),
        (64, 8, "tf32x3"),
        (16, 4, "ieee"),
        (64, 4, "split"),
    ]
    assert bench.parse_tiles("16x1,32x2") == [(16, 1), (32, 2)]
    off = dict(window_tile=False, ancestor_table=False, save_inputs=False)
    assert bench.conv_tilings("t4n256w4,t8n128w4tile,t4n256w4anc,t16n256w4nosave,t2n512w8in") == {
        "t4n256w4": dict(block_t=4, block_n=256, num_warps=4, **off),
        "t8n128w4tile": dict(block_t=8, block_n=128, num_warps=4, **{**off, "window_tile": True}),
        "t4n256w4anc": dict(block_t=4, block_n=256, num_warps=4, **{**off, "ancestor_table": True}),
        "t16n256w4nosave": dict(block_t=16, block_n=256, num_warps=4, **off),
        "t2n512w8in": dict(block_t=2, block_n=512, num_warps=8, **{**off, "save_inputs": True}),
    }
    with pytest.raises(ValueError, match="no windows to tile"):
        bench.conv_tilings("t8n128w4tilein")
    with pytest.raises(ValueError, match="precision must be"):
        bench.parse_chunk_tiles("32x4xfp8")
    with pytest.raises(ValueError, match="expected tNnNwN"):
        bench.conv_tilings("t4w4")


def test_bench_serving_dflash2_servers_pass_start_up(tmp_path):
    """--dflash2: SGLang's DFLASH and DDTREE's lattice tree on the DFlash2 draft, beside the
    DFlash draft's servers; DDTREE's flags pass its start-up on a DFlash2 checkpoint with the
    K that scripts/train_dflash2.py trains (8)."""
    pytest.importorskip("sglang")
    from sglang_ddtree.adapter import spec
    from sglang_ddtree.checkpoints.tiny import write_tiny_dflash2, write_tiny_qwen3
    from tests.unit.test_plugin import _server_args

    bench = _script("bench_serving")
    target = write_tiny_qwen3(tmp_path / "target", seed=0)
    d2 = write_tiny_dflash2(tmp_path / "d2", target, seed=0, selector_top_k=8, block_size=16)
    table = bench.server_table("draft", str(d2))
    assert "ddtree_dflash2" not in bench.server_table("draft")
    for name in ("dflash_dflash2", "ddtree_dflash2", "dflash", "ddtree"):
        ns = _parse_cli(["--model-path", str(target), *bench.COMMON, *table[name][0]])
        want = str(d2) if name.endswith("dflash2") else "draft"
        assert ns.speculative_draft_model_path == want, name
    ns = _parse_cli(["--model-path", str(target), *bench.COMMON, *table["ddtree_dflash2"][0]])
    assert ns.speculative_algorithm == "DDTREE"
    spec.validate_server_args(
        _server_args(d2, **{k: v for k, v in vars(ns).items() if v is not None})
    )


def test_bench_serving_servers_dataset_and_summary(tmp_path):
    """scripts/bench_serving.py: its server commands parse, its custom dataset is what
    sglang.bench_serving's loader reads (two turns per row), and the summary is the median and
    spread of the runs against DFLASH's median."""
    bench = _script("bench_serving")
    for name, (flags, env) in bench.server_table("draft").items():
        if importlib.util.find_spec("sglang.srt.server_args") is not None:
            ns = _parse_cli(["--model-path", "x", *bench.COMMON, *flags])
            assert ns.max_running_requests == 32, name
        fixed = name in ("ddtree16", "ddtree32")
        assert env.get("SGLANG_DDTREE_WIDTH") == ("fixed" if fixed else None), name
        assert "SGLANG_DDTREE_VERIFY_PLAN" not in env, name  # retired: the host plan serves
    path = bench.write_dataset(tmp_path / "d.jsonl", 5)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 5 and all(len(r["conversations"]) == 2 for r in rows)
    assert len({r["conversations"][0]["content"] for r in rows}) == 5
    # runs of 8 requests per client, at least 16: past the held-out files' openings, all distinct
    assert [bench.prompts_for(c, 8) for c in (1, 4, 16, 32)] == [16, 32, 128, 256]
    big = bench.write_dataset(tmp_path / "big.jsonl", 256).read_text().splitlines()
    assert len({json.loads(line)["conversations"][0]["content"] for line in big}) == 256
    with pytest.raises(SystemExit, match="lower --requests-per-client"):
        bench.write_dataset(tmp_path / "huge.jsonl", 10**6)
    argv = bench.bench_args(harness_server(), path, "tok", 16, 4, 1.0, 128, tmp_path / "o")
    assert argv[argv.index("--dataset-name") + 1] == "custom"
    assert argv[argv.index("--max-concurrency") + 1] == "4"
    runs = [
        {
            "run": i // 2 + 1,
            "server": s,
            "temperature": 0.0,
            "concurrency": 1,
            "output_throughput": v,
            "accept_length": 2.0,
            "median_tpot_ms": tpot,
            "median_ttft_ms": ttft,
        }
        for i, (s, v, tpot, ttft) in enumerate(
            [  # run i // 2 + 1: DFLASH's, then DDTREE's
                ("dflash", 100.0, 3.0, 40.0),
                ("ddtree", 130.0, 2.0, 50.0),
                ("dflash", 110.0, 3.3, 30.0),
                ("ddtree", 150.0, 2.2, 60.0),
                ("dflash", 90.0, 3.6, 35.0),
                ("ddtree", 120.0, 2.4, None),
            ]
        )  # a row without TTFT
    ]
    summary = {s["server"]: s for s in bench.summarize(runs)}
    assert summary["ddtree"]["median_tok_s"] == 130.0
    assert (summary["ddtree"]["min_tok_s"], summary["ddtree"]["max_tok_s"]) == (120.0, 150.0)
    assert summary["ddtree"]["vs_dflash"] == pytest.approx(1.3)
    assert summary["ddtree"]["ttft_ms"] == pytest.approx(55.0)  # of the rows that have it
    assert summary["ddtree"]["tpot_vs_dflash"] == pytest.approx(3.3 / 2.2)
    assert summary["dflash"]["tpot_vs_dflash"] == pytest.approx(1.0)
    # run by run 1.30, 1.36, 1.33: their geometric mean and range, where the medians give 1.30
    ddtree = summary["ddtree"]
    assert ddtree["geomean_vs_dflash"] == pytest.approx(
        (130 / 100 * 150 / 110 * 120 / 90) ** (1 / 3)
    )
    assert (ddtree["run_ratio_min"], ddtree["run_ratio_max"]) == pytest.approx((1.3, 150 / 110))
    assert summary["dflash"]["geomean_vs_dflash"] == pytest.approx(1.0)
    text = bench.table(list(summary.values()))
    assert (
        "| 0 | 1 | ddtree | 130 (120-150) | 2.00 | 1.30 | 1.33 (1.30-1.36) | 55.0 | 2.20 | 1.50 |"
        in text
    )
    old = [{k: v for k, v in r.items() if "_ms" not in k and k != "run"} for r in runs]
    assert "| 0 | 1 | ddtree | 130 (120-150) | 2.00 | 1.30 | - | - | - | - |" in bench.table(
        bench.summarize(old)
    )  # rows without TTFT, TPOT or run numbers (older rows had no TTFT or TPOT)
    # a run DFLASH lacks is left out; a run of 0 tok/s makes the mean 0; two benchmarks' rows
    # (repeated run numbers) in one summary are refused
    ratio = bench._run_ratios(runs[1::2], runs[0:4:2])
    assert ratio["geomean_vs_dflash"] == pytest.approx((1.3 * 150 / 110) ** 0.5)
    zero = [dict(runs[1], output_throughput=0.0), *runs[3::2]]
    assert bench._run_ratios(zero, runs[0::2])["geomean_vs_dflash"] == 0.0
    with pytest.raises(ValueError, match="repeated run numbers"):
        bench._run_ratios(runs[1::2], runs[0::2] + runs[0:1])


def test_bench_serving_profiles_each_server_at_every_temperature(tmp_path, monkeypatch):
    """bench_serving's --profile: a torch-profiled batch of 1 and of 4 per temperature on each
    named server only, each row tagged with its temperature."""
    bench = _script("bench_serving")
    calls = []

    def parts(server, bs, out_dir, tokens=48, temperature=0.0):
        calls.append((server.name, bs, temperature))
        return {"host": {"round_period_ms": 1.0, "syncs_per_round": 0.0}}

    monkeypatch.setattr(bench.round_trace, "profile_parts", parts)
    from types import SimpleNamespace

    servers = [SimpleNamespace(name="ddtree"), SimpleNamespace(name="dflash")]
    bench.profile(servers, ["ddtree"], tmp_path, [0.0, 1.0])
    assert calls == [("ddtree", 1, 0.0), ("ddtree", 4, 0.0), ("ddtree", 1, 1.0), ("ddtree", 4, 1.0)]
    rows = [json.loads(x) for x in (tmp_path / "round_profile_pair.jsonl").read_text().splitlines()]
    assert [(r["bs"], r["temperature"]) for r in rows] == [(1, 0.0), (4, 0.0), (1, 1.0), (4, 1.0)]


def test_bench_serving_first_token_probe_alternates_servers_by_length(tmp_path, monkeypatch):
    """bench_serving's --first-token: per length (1, 2, 3 new tokens) one warm-up request per
    server, then the servers in turn on the same prompt; the median and min of the timed
    ones per server and length."""
    bench = _script("bench_serving")
    from types import SimpleNamespace

    servers = [SimpleNamespace(name="ddtree"), SimpleNamespace(name="dflash")]
    sent = []

    def send(server, prompt, k):
        sent.append((server.name, prompt, k))
        clock[0] += {"ddtree": 0.004, "dflash": 0.003}[server.name] * k

    clock = [0.0]  # the requests' times; the sampler's waits pass at once
    monkeypatch.setattr(
        bench,
        "time",
        SimpleNamespace(
            perf_counter=lambda: clock[0], monotonic=bench.time.monotonic, sleep=lambda s: None
        ),
    )
    rows = bench.first_token(servers, ["a", "b", "c"], tmp_path, 2, send=send)
    assert [s[2] for s in sent] == [1] * 6 + [2] * 6 + [3] * 6
    assert [s[:2] for s in sent[:6]] == [
        ("ddtree", "a"),
        ("dflash", "a"),
        ("ddtree", "a"),
        ("dflash", "a"),
        ("ddtree", "b"),
        ("dflash", "b"),
    ]
    got = {(r["server"], r["max_new_tokens"]): r["median_ms"] for r in rows}
    assert got[("ddtree", 3)] == pytest.approx(12.0) and got[("dflash", 1)] == pytest.approx(3.0)
    assert all(r["requests"] == 2 and r["probe"] == "first_token" for r in rows)
    written = [
        json.loads(x) for x in (tmp_path / "first_token_pair.jsonl").read_text().splitlines()
    ]
    assert written == rows and bench.first_token(servers, [], tmp_path, 0) == []
    # a --host-profile server then takes the one-token requests alone, its sampler on
    sampler = tmp_path / "sampler"
    sampler.mkdir()
    servers[0].env = {"HOST_SAMPLER_DIR": str(sampler)}
    sent.clear()

    def send_sampled(server, prompt, k):
        send(server, prompt, k)
        if (sampler / "on").exists():  # the sampler writes its file once "on" is gone
            (sampler / "4242.txt").write_text("{}\n")

    bench.first_token(servers, ["a", "b", "c"], tmp_path, 2, send=send_sampled, sampled=("ddtree",))
    assert sent[-2:] == [("ddtree", "a", 1), ("ddtree", "b", 1)]
    folder = tmp_path / "host" / "ddtree" / "first_token"
    assert (folder / "4242.txt").exists() and not (sampler / "on").exists()
    meta = json.loads((folder / "meta.json").read_text())
    assert meta == {"probe": "first_token", "total_output_tokens": 2, "accept_length": 1.0}


def test_bench_serving_pins_cpus_by_default_where_each_set_gets_two():
    """The servers' sets first, of one size and none with CPU 0; the load generator's last (the
    lowest CPUs and the remainder); servers rotated run by run."""
    bench = _script("bench_serving")
    assert bench.pinned_cpus(list(range(16)), 3, None) == [
        (4, 5, 6, 7),
        (8, 9, 10, 11),
        (12, 13, 14, 15),
        (0, 1, 2, 3),
    ]
    five = bench.pinned_cpus(list(range(16)), 5, None)  # five servers
    assert five == [(6, 7), (8, 9), (10, 11), (12, 13), (14, 15), (0, 1, 2, 3, 4, 5)]
    assert [bench.run_order(list("abc"), run) for run in (1, 2, 3, 4)] == [
        list("abc"),
        list("bca"),
        list("cab"),
        list("abc"),
    ]
    assert bench.pinned_cpus(list(range(7)), 3, None) == []  # under two CPUs a set: not pinned
    assert bench.pinned_cpus(list(range(16)), 3, False) == []
    assert len(bench.pinned_cpus(list(range(4)), 3, True)) == 4  # asked for: one CPU a set


def test_bench_serving_copies_the_interrupt_counts_where_it_can(tmp_path):
    bench = _script("bench_serving")
    source = tmp_path / "interrupts"
    source.write_text("           CPU0       CPU1\n  0:         40          2   timer\n")
    bench.snapshot_interrupts(tmp_path / "start.txt", source)
    assert (tmp_path / "start.txt").read_text() == source.read_text()
    bench.snapshot_interrupts(tmp_path / "none.txt", tmp_path / "missing")  # not Linux: nothing
    assert not (tmp_path / "none.txt").exists()


def harness_server():
    from types import SimpleNamespace

    return SimpleNamespace(port=1234)


def test_the_harness_skips_a_port_something_listens_on():
    import socket

    harness = _script("harness")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        got = harness.free_port(taken, step=1)
        assert got != taken and got > taken


def test_a_server_that_exits_during_start_up_is_started_once_more(tmp_path, monkeypatch):
    """harness.Server.start_once_more_on_exit: the first start exits (as the pair's tokenizer
    load has under load), the second prints the awaited line; the first log is kept. Two exits
    in a row raise."""
    import sys

    harness = _script("harness")
    flag = tmp_path / "started_once"
    program = (
        f"import pathlib, sys, time; f = pathlib.Path({str(flag)!r})\n"
        "if not f.exists():\n    f.touch(); sys.exit(1)\n"
        "print('Memory pool ' + 'end', flush=True); time.sleep(30)"
    )
    server = harness.Server("fake", "m", 1, [], log_dir=tmp_path)
    monkeypatch.setattr(server, "command", lambda: [sys.executable, "-c", program])
    try:
        server.start_once_more_on_exit("Memory pool end", timeout=30)
        assert "Memory pool end" in server.log_text().split("\n", 1)[1]  # past the command
        assert (tmp_path / "server_fake.first_try.log").exists()
    finally:
        server.stop()
    failing = harness.Server("bad", "m", 2, [], log_dir=tmp_path)
    monkeypatch.setattr(failing, "command", lambda: [sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="exited"):
        failing.start_once_more_on_exit("Memory pool end", timeout=30)


def test_the_host_sampler_sees_the_scheduler_loop_and_the_report_scales_it(tmp_path):
    """A process with scripts/host_sampler on PYTHONPATH samples only while DIR/on exists, and
    host_profile prints the main thread's frames in ms per round: a loop that spends about
    three quarters of its time in one function shows that share under it."""
    import os
    import subprocess
    import sys
    import time

    fake = tmp_path / "scheduler.py"  # the file and loop names the report looks for
    fake.write_text(
        "import time, sys\n"
        "def busy(s):\n    end = time.perf_counter() + s\n"
        "    while time.perf_counter() < end: pass\n"
        "def event_loop_normal():\n    end = time.monotonic() + float(sys.argv[1])\n"
        "    while time.monotonic() < end:\n        busy(0.003)\n        rest(0.001)\n"
        "def rest(s):\n    end = time.perf_counter() + s\n"
        "    while time.perf_counter() < end: pass\n"
        "event_loop_normal()\n"
    )
    samples = tmp_path / "samples"
    samples.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "scripts" / "host_sampler"),
        "HOST_SAMPLER_DIR": str(samples),
    }
    proc = subprocess.Popen([sys.executable, str(fake), "4"], env=env)
    time.sleep(0.7)
    assert not list(samples.glob("*.txt"))  # dormant
    (samples / "on").touch()
    time.sleep(1.5)
    (samples / "on").unlink()
    proc.wait(timeout=30)
    files = list(samples.glob("*.txt"))
    assert len(files) == 1
    (samples / "meta.json").write_text(
        json.dumps({"total_output_tokens": 200, "accept_length": 2.0})
    )
    report = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "host_profile.py"),
            str(samples),
            "--focus",
            "event_loop_normal",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = {
        line.split("|")[2].strip(" ."): float(line.split("|")[1])
        for line in report.splitlines()
        if line.startswith("| ") and ":" in line
    }
    loop, busy = rows["scheduler.py:event_loop_normal"], rows["scheduler.py:busy"]
    head = json.loads(files[0].read_text().splitlines()[0])
    assert loop == pytest.approx(head["seconds"] * 1000 / 100, rel=0.1)  # 100 rounds
    assert 0.6 < busy / loop < 0.9
    own = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "host_profile.py"),
            str(samples),
            "--own",
            "scheduler.py",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    mine = {
        line.split("|")[2].strip(): float(line.split("|")[1])
        for line in own.splitlines()
        if " -> " in line
    }
    assert mine["scheduler.py:busy -> <self>"] == pytest.approx(busy, rel=0.02)


def test_servers_pinned_to_cpu_sets_run_on_them(tmp_path, monkeypatch):
    """harness.cpu_sets splits the CPUs into disjoint neighbouring runs (bench_serving
    --pin-cpus: one per server and one for the load generator), the servers' all of one size
    (the load generator takes what is left over), and a Server given a set starts its process
    on those CPUs only."""
    harness = _script("harness")
    assert harness.cpu_sets(list(range(16)), 3) == [
        (0, 1, 2, 3, 4, 5),
        (6, 7, 8, 9, 10),
        (11, 12, 13, 14, 15),
    ]
    # six sets of 16 CPUs: the first 6, the others 2 each (not 2, 2, 3, 3, 3 and 3)
    sets = harness.cpu_sets(list(range(16)), 6)
    assert [len(s) for s in sets] == [6, 2, 2, 2, 2, 2]
    assert sorted(c for s in sets for c in s) == list(range(16))
    assert harness.cpu_sets([3, 1, 2], 3) == [(1,), (2,), (3,)]
    with pytest.raises(ValueError, match="cannot split 2 CPUs into 3"):
        harness.cpu_sets([0, 1], 3)
    mine = sorted(os.sched_getaffinity(0))
    probe = "import os; print(sorted(os.sched_getaffinity(0)))"
    monkeypatch.setattr(harness.Server, "command", lambda self: [sys.executable, "-c", probe])
    for cpus in ((mine[-1],), ()):
        server = harness.Server("probe", "m", 1, log_dir=tmp_path, cpus=cpus)
        server.start()
        assert server.proc.wait(timeout=60) == 0
        printed = server.log_path.read_text().splitlines()[-1]
        assert printed == str(list(cpus) or mine)


def test_bench_serving_writes_host_reports_side_by_side(tmp_path):
    """--host-profile's samples come back as host_profile.py's tables, a few kB per sampled run
    with the servers side by side (the raw samples are megabytes): the worker's call tree in ms
    per round and the package's own frames, SGLang's like-named files (dflash.py) left out."""
    pytest.importorskip("sglang")  # own_files leaves out the names of SGLang's files
    bench = _script("bench_serving")
    loop = "MainThread;scheduler.py:event_loop_overlap;worker.py:forward_batch_generation"
    idle = "MainThread;scheduler.py:event_loop_overlap;scheduler.py:recv_requests"
    stacks = {
        "ddtree": {
            f"{loop};worker.py:_draft": 60,
            f"{loop};widths.py:finish": 20,
            f"{loop};dflash.py:prepare": 10,
            idle: 10,
        },
        "dflash": {
            "MainThread;scheduler.py:event_loop_overlap;"
            "dflash_worker_v2.py:forward_batch_generation": 50
        },
    }
    for name, rows in stacks.items():
        run = tmp_path / name / "t0_c1"
        run.mkdir(parents=True)
        lines = [json.dumps({"seconds": 1.0})] + [f"{k} {n}" for k, n in rows.items()]
        (run / "123.txt").write_text("\n".join(lines) + "\n")
        (run / "meta.json").write_text(
            json.dumps({"total_output_tokens": 200, "accept_length": 2.0})
        )
    (tmp_path / "ddtree" / "first_token").mkdir()  # a run whose samples did not arrive
    (tmp_path / "ddtree" / "first_token" / "meta.json").write_text("{}")
    broken = tmp_path / "ddtree" / "t1_c1"  # samples without the scheduler's loop
    broken.mkdir()
    (broken / "9.txt").write_text(json.dumps({"seconds": 1.0}) + "\nMainThread;x.py:y 5\n")
    (broken / "meta.json").write_text(json.dumps({"total_output_tokens": 1}))
    written = bench.host_reports(tmp_path, ["ddtree", "dflash"])
    assert [p.name for p in written] == ["report_t0_c1.md", "report_t1_c1.md"]
    assert "not readable: SystemExit" in written[1].read_text()  # and the others are written
    text = written[0].read_text()
    assert "| ddtree/t0_c1 | dflash/t0_c1 | frame (ms per round) |" in text
    rows = {
        line.split("|")[3].strip(" ."): [float(line.split("|")[i]) for i in (1, 2)]
        for line in text.split("## sglang_ddtree")[0].splitlines()
        if line.startswith("| ") and ":" in line
    }
    # 1 s over 100 rounds: 10 ms a round, 6 of them in _draft; the tree starts at the worker
    assert rows["worker.py:_draft"] == pytest.approx([6.0, 0.0])
    assert rows["worker.py:forward_batch_generation"] == pytest.approx([9.0, 0.0])
    assert rows["dflash_worker_v2.py:forward_batch_generation"] == pytest.approx([0.0, 10.0])
    assert not any("scheduler.py" in k for k in rows)
    own = text.split("## sglang_ddtree")[1]
    assert "worker.py:_draft -> <self>" in own and "widths.py:finish -> <self>" in own
    # SGLang's dflash.py is not the package's: its time is what worker.py's frame ran
    assert "worker.py:forward_batch_generation -> dflash.py:prepare" in own


def test_project_budget_reads_one_sitting_of_the_merged_rows(tmp_path):
    """docs/data/ keeps every sitting in one file: the newest unless one is named."""
    bench = _script("project_budget")
    row = {"bs": 1, "variant": "dflash"}
    rows = [{**row, "sitting": 1, "round_ms": 20.0}, {**row, "sitting": 2, "round_ms": 30.0}]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    acceptance = ROOT / "docs" / "data" / "acceptance.jsonl"
    assert bench.load(path, acceptance, 0.0)[0].ms[bench.CHAIN] == (30.0,)
    assert bench.load(path, acceptance, 0.0, sitting=1)[0].ms[bench.CHAIN] == (20.0,)
    with pytest.raises(SystemExit, match=r"no sitting 3 in the rows; there are \[1, 2\]"):
        bench.load(path, acceptance, 0.0, sitting=3)


def test_bench_round_reads_sglangs_startup_timings():
    bench = _script("bench_round")
    log = (
        "[x] Engine startup timings (s): load_weight=0.26, kv_cache_allocation=1.01, "
        "scheduler_e2e=30.15, cuda_graph={prefill=0.00, decode=0.00, target_verify=12.08, "
        "draft_prefill=0.00, draft_decode=2.98, draft_extend=0.00}, tokenizer_e2e=56.41\n"
        "[x] The server is fired up and ready to roll!\n"
    )
    got = bench.startup_timings(log)
    assert got["scheduler_e2e"] == 30.15 and got["target_verify"] == 12.08
    assert got["draft_decode"] == 2.98 and got["tokenizer_e2e"] == 56.41
    assert bench.startup_timings("no such line") == {}


def test_the_fp8_recipes_command_parses_with_sglangs_cli():
    """docs/fp8.md's launch command, with and without its optional FP8 KV cache, parses into an
    FP8-ready DDTREE server: the draft unquantized, bench_round's H100 fraction (a card of
    79.2 GiB, as the H100 rows' own) and its 6 Mamba slots a request."""
    pytest.importorskip("sglang.srt.server_args")
    import shlex

    bench = _script("bench_round")
    text = (ROOT / "docs" / "fp8.md").read_text()
    block = text.split("python -m sglang.launch_server", 1)[1].split("\n\n", 1)[0]
    argv = shlex.split(block.replace("\\\n", " ").replace('"$DRAFT"', "draft"))
    assert argv[-2:] == ["[--kv-cache-dtype", "fp8_e4m3]"]  # the optional flag
    del argv[-2:]
    for extra in ([], ["--kv-cache-dtype", "fp8_e4m3"]):
        ns = _parse_cli([*argv, *extra])
        assert ns.model_path == "Qwen/Qwen3.6-27B-FP8" and ns.quantization is None
        assert ns.speculative_algorithm == "DDTREE" and ns.attention_backend == "flashinfer"
        assert ns.speculative_draft_model_quantization == "unquant"
        assert ns.kv_cache_dtype == ("fp8_e4m3" if extra else "auto")
        h100 = bench.size_for("NVIDIA H100 80GB HBM3", 79.2)
        assert ns.mem_fraction_static == h100.mem_fraction_static == 0.839
        assert ns.max_mamba_cache_size == bench.MAMBA_SLOTS_PER_REQ * ns.max_running_requests

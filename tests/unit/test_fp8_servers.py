"""tests/gpu/servers.py's FP8 servers on the CPU: their flags as SGLang 0.5.23 parses them (an
FP8 target, its KV cache in fp8_e4m3 where asked, the draft unquantized), and the default set
(the FP8 servers in, the benchmark-only servers out unless DDTREE_GPU_BENCH=1)."""

from __future__ import annotations

import argparse

import pytest

from tests.gpu import servers as suite


def _parse(args: list[str]) -> argparse.Namespace:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(["--model-path", "x", *args])


@pytest.mark.parametrize("variant", suite.FP8_VARIANTS)
def test_the_fp8_servers_flags_give_an_fp8_target_and_a_bf16_draft(variant):
    pytest.importorskip("sglang.srt.server_args")
    ns = _parse([*suite.COMMON, *suite.VARIANTS[variant]("qwen3", "draft")])
    assert ns.quantization == "fp8"
    assert ns.kv_cache_dtype == ("fp8_e4m3" if variant.endswith("fp8kv") else "auto")
    spec = variant.startswith("ddtree")
    assert ns.speculative_algorithm == ("DDTREE" if spec else None)
    # SGLang gives the draft the target's --quantization unless told: `unquant` keeps it bf16
    assert ns.speculative_draft_model_quantization == ("unquant" if spec else None)
    assert ns.speculative_draft_kv_cache_dtype is None  # the draft's KV follows the target's


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-servers")  # the binary pairs, written once


def test_the_default_server_set_has_the_fp8_servers_and_no_benchmark_ones(root, monkeypatch):
    monkeypatch.delenv("DDTREE_GPU_SERVERS", raising=False)
    monkeypatch.delenv("DDTREE_GPU_BENCH", raising=False)
    launched, every = suite.launched_set(root), suite.server_set(root)
    bench = {f"{m}-{v}" for m, v in suite.BENCH_ONLY}
    assert set(every) - set(launched) == bench and len(launched) == 31
    for model in ("qwen3", "qwen35"):
        assert {f"{model}-{v}" for v in suite.FP8_VARIANTS} <= set(launched)
    assert not any("sglanggdn" in name for name in every)
    assert "SGLANG_DDTREE_GDN" not in str(suite.VARIANT_ENV)
    monkeypatch.setenv("DDTREE_GPU_BENCH", "1")
    asked = suite.launched_set(root)
    assert list(asked) == list(every)  # in launch order, each on the port it always has
    assert all(asked[n].port == launched[n].port for n in launched)

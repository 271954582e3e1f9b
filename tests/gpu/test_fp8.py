"""DDTREE on an FP8 target against plain FP8 serving, on the binary pairs (tests/gpu/servers.py):
`base_fp8` / `ddtree_fp8` serve SGLang's online FP8 weights (the draft stays bf16), `base_fp8kv` /
`ddtree_fp8kv` the same with the KV cache in fp8_e4m3. Each DDTREE server is held to the plain
server of its own numerics with test_serve's checks: greedy under the near-tie referee, the
sampled distribution by chi-square, logprobs within the plain server's own decode-vs-prefill
tolerance. First, that every one of these servers really served FP8.

Run on the device:  python -m pytest tests/gpu/test_fp8.py -m gpu -q -rA   (with DDTREE_GPU_ROOT
set, it reuses the running set, as test_serve does)
"""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("sglang")

from tests.gpu import harness  # noqa: E402
from tests.gpu import test_serve as serve  # noqa: E402

# test_serve's fixtures, under their names here
servers, fp32_pair, plain_greedy, sampled = (
    serve.servers,
    serve.fp32_pair,
    serve.plain_greedy,
    serve.sampled,
)

pytestmark = pytest.mark.gpu

# per numerics: (the plain server, the DDTREE server)
NUMERICS = {"fp8": ("base_fp8", "ddtree_fp8"), "fp8kv": ("base_fp8kv", "ddtree_fp8kv")}
FP8_PLAIN = tuple(plain for plain, _ in NUMERICS.values())
# per numerics: its --kv-cache-dtype (none: the default) and the target's KV pool dtype
KV_DTYPE = {"fp8": (None, "torch.bfloat16"), "fp8kv": ("fp8_e4m3", "torch.float8_e4m3fn")}
FP8_MODELS = [m for m in serve.MODELS if m != "pair"]  # the binary pairs
CASES = [(m, n) for m in FP8_MODELS for n in NUMERICS]
SERVER_ARGS = re.compile(r"server_args=(\{.*\})")
KV_POOL = re.compile(r"KV Cache (?:is allocated|VA upper bound)\. dtype: (\S+),")


def _greedy_top(server) -> tuple[list[int], list[dict]]:
    """16 greedy tokens on the first prompt from a flushed cache, and per token its top 5 as
    {token: logprob}."""
    serve._flush(server)
    status, out = harness.post(
        server.url + "/generate",
        {
            "text": harness.PROMPTS[0],
            "return_logprob": True,
            "top_logprobs_num": 5,
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
        },
    )
    assert status == 200, out
    top = [{tok: lp for lp, tok, *_ in row} for row in out["meta_info"]["output_top_logprobs"]]
    return out["output_ids"], top


def _same_numbers(a, b) -> bool:
    """Whether two _greedy_top runs agree: the same tokens, the same top 5, each within 1e-4."""
    (ids_a, top_a), (ids_b, top_b) = a, b
    return ids_a == ids_b and all(
        set(x) == set(y) and all(abs(x[t] - y[t]) <= 1e-4 for t in x)
        for x, y in zip(top_a, top_b, strict=True)
    )


@pytest.mark.parametrize("model", FP8_MODELS)
def test_the_fp8_servers_served_fp8(servers, model):
    """So that no check below can pass on a bf16 server: every FP8 server's start-up log gives
    --quantization fp8 (and --kv-cache-dtype fp8_e4m3 where asked), the target's KV pool was allocated in that dtype
    (SGLang's "KV Cache is allocated. dtype: ..." line, the target's first), a DDTREE server's
    draft kept unquantized; and the plain servers' numbers move with each flag: FP8 weights
    change the bf16 server's greedy logprobs, the FP8 KV cache the FP8 server's."""
    for numerics, names in NUMERICS.items():
        kv_flag, kv_dtype = KV_DTYPE[numerics]
        for variant in names:
            server = serve._up(servers, f"{model}-{variant}")
            log = server.log_text()
            found = SERVER_ARGS.search(log)
            assert found, f"{server.name}: no server_args line in its log"
            args, pools = found.group(1), KV_POOL.findall(log)
            print(f"{server.name}: KV pools {pools}")
            assert "'quantization': 'fp8'" in args, server.name
            assert kv_flag is None or f"'kv_cache_dtype': '{kv_flag}'" in args, server.name
            assert pools and pools[0] == kv_dtype, (server.name, pools)
            if variant.startswith("ddtree"):
                assert "'speculative_draft_model_quantization': 'fp8'" not in args, server.name
    plain, fp8, fp8kv = (
        _greedy_top(serve._up(servers, f"{model}-{v}")) for v in ("base", *FP8_PLAIN)
    )
    assert not _same_numbers(plain, fp8), "--quantization fp8 changed nothing"
    assert not _same_numbers(fp8, fp8kv), "--kv-cache-dtype fp8_e4m3 changed nothing"


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("model,numerics", CASES)
def test_fp8_greedy_is_the_plain_fp8_servers_greedy(
    servers, plain_greedy, fp32_pair, model, numerics, concurrency
):
    """test_serve's greedy check against the plain server of the same numerics: every DDTREE
    token within the tolerance of the FP8 target's own greedy choice under teacher forcing
    (through the plain FP8 server), the plain FP8 server's decode-vs-prefill the control (no
    DFLASH server runs in FP8), the float32 referee beyond it. The referee reads the bf16
    checkpoint, so the error it allows on a sequence (float32 against the served numerics at its
    other positions) includes what FP8 moves; a wrong token still sits nats below in both."""
    base, ddtree = NUMERICS[numerics]
    serve.assert_targets_greedy(
        servers, plain_greedy, fp32_pair, model, ddtree, concurrency, base=base
    )


@pytest.mark.parametrize("model,numerics", CASES)
def test_fp8_sampling_distribution_matches_plain_fp8(sampled, model, numerics):
    """test_serve's chi-square (T = 1, top-k 8, seeded; 3 positions at 1e-3, a rejection
    confirmed by a fresh draw at 1e-2) of DDTREE's tokens against the plain FP8 server's."""
    base, ddtree = NUMERICS[numerics]
    serve.assert_same_distribution(sampled, model, ddtree, True, base=base)


@pytest.mark.parametrize("model,numerics", CASES)
def test_fp8_logprobs_are_the_plain_fp8_servers(servers, model, numerics):
    """test_serve's logprob comparison against the plain FP8 server: where the greedy tokens
    agree, every logprob within twice the plain server's own decode-vs-prefill gap (at least
    TIE_TOL), and plain's clear top-5 members in DDTREE's top 5."""
    base, ddtree = NUMERICS[numerics]
    server, plain = serve._up(servers, f"{model}-{ddtree}"), serve._up(servers, f"{model}-{base}")
    agreed, worst, tol = serve.assert_logprobs_are_plains(server, plain)
    print(
        f"{server.name}: logprobs on {agreed} agreeing tokens, worst gap "
        f"{abs(worst[2] - worst[3]):.3f} (tolerance {tol:.3f})"
    )


# Last in this file: after the tests above have run on these servers.
@pytest.mark.parametrize("model,numerics", CASES)
def test_fp8_pools_return_to_idle_and_no_host_sync(servers, model, numerics):
    serve.assert_idle_and_no_host_sync(serve._up(servers, f"{model}-{NUMERICS[numerics][1]}"))

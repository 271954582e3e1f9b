"""DDTREE served by SGLang on the GPU, against the same server without speculation.

Both servers load identical tiny checkpoints written here with seeded weights: an attention-only
Qwen3 and a Qwen3.5 hybrid (Gated DeltaNet + gated attention, the Qwen3.6-27B architecture), each
with a seeded DFlash draft. All servers of a run start together (one GPU, small memory slices).

Run on the device:  python -m pytest tests/gpu -m gpu -x -q -s   (logs go to $OUT if set)
"""

from __future__ import annotations

import collections
import os
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("sglang")

from tests.gpu import harness  # noqa: E402

pytestmark = pytest.mark.gpu

from tests.gpu.servers import MODELS, NEW_TOKENS, server_set  # noqa: E402


@pytest.fixture(scope="module")
def servers():
    """The server set of tests/gpu/servers.py: reused when already running, else started here."""
    root = Path(os.environ.get("DDTREE_GPU_ROOT", tempfile.mkdtemp(prefix="ddtree-gpu-")))
    started = server_set(root)
    reuse = all(s.is_healthy() for s in started.values())
    if not reuse:
        for server in started.values():
            server.start()
        for server in started.values():
            server.wait_healthy(timeout=900)
    yield started  # logs stay in ROOT/logs (scripts/gpu_session.sh archives them to $OUT)
    if not reuse:
        for server in started.values():
            server.stop()


def _greedy_ids(server, concurrency: int) -> list[list[int]]:
    def one(prompt):
        out = harness.generate(
            server, prompt, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True
        )
        return out["output_ids"]

    return harness.run_all(one, harness.PROMPTS, concurrency)


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("variant", ["ddtree", "ddtree_sync"])
@pytest.mark.parametrize("model", MODELS)
def test_generate_greedy_identical(servers, model, variant, concurrency):
    base = _greedy_ids(servers[f"{model}-base"], concurrency)
    spec = _greedy_ids(servers[f"{model}-{variant}"], concurrency)
    assert all(len(x) == NEW_TOKENS for x in base)
    mismatches = {
        i: harness.first_divergence(a, b) for i, (a, b) in enumerate(zip(base, spec, strict=True))
    }
    mismatches = {i: pos for i, pos in mismatches.items() if pos is not None}
    assert not mismatches, f"prompt index -> first differing token: {mismatches}"


@pytest.mark.parametrize("variant", ["ddtree", "ddtree_sync"])
@pytest.mark.parametrize("model", MODELS)
def test_chat_greedy_identical(servers, model, variant):
    def texts(server):
        return harness.run_all(
            lambda p: harness.chat(server, p, max_tokens=64, temperature=0, ignore_eos=True)[
                "choices"
            ][0]["message"]["content"],
            harness.PROMPTS[:16],
            8,
        )

    assert texts(servers[f"{model}-base"]) == texts(servers[f"{model}-{variant}"])


@pytest.mark.parametrize("model", MODELS)
def test_acceptance_is_reported(servers, model):
    out = harness.generate(
        servers[f"{model}-ddtree"],
        harness.PROMPTS[0],
        max_new_tokens=64,
        temperature=0,
        ignore_eos=True,
    )
    meta = out["meta_info"]
    assert meta["spec_verify_ct"] >= 1
    assert 1.0 <= meta["spec_accept_length"] <= 16.0
    assert "accept len" in servers[f"{model}-ddtree"].log_text()


def _token_counts(server, position_count: int, n: int) -> list[collections.Counter]:
    def one(seed):
        out = harness.generate(
            server,
            "def fibonacci(n):",
            max_new_tokens=position_count,
            temperature=1.0,
            top_k=8,
            ignore_eos=True,
            sampling_seed=seed,
        )
        return out["output_ids"]

    samples = harness.run_all(one, range(n), 16)
    return [collections.Counter(s[i] for s in samples) for i in range(position_count)]


@pytest.mark.parametrize("model", MODELS)
def test_sampling_distribution_matches(servers, model):
    """Chi-square homogeneity of the token at each of 3 positions, base vs DDTREE (T=1, top-k 8).

    alpha = 1e-3 per position (Bonferroni over 3 positions: family-wise 3e-3).
    """
    from scipy.stats import chi2_contingency

    n = 1500
    base = _token_counts(servers[f"{model}-base"], 3, n)
    spec = _token_counts(servers[f"{model}-ddtree"], 3, n)
    for pos, (a, b) in enumerate(zip(base, spec, strict=True)):
        tokens = sorted(set(a) | set(b), key=lambda t: -(a[t] + b[t]))
        common = [t for t in tokens if a[t] + b[t] >= 10]
        rows = [[a[t] for t in common], [b[t] for t in common]]
        rows[0].append(n - sum(rows[0]))
        rows[1].append(n - sum(rows[1]))
        if rows[0][-1] + rows[1][-1] == 0:
            rows = [r[:-1] for r in rows]
        p_value = chi2_contingency(rows).pvalue
        assert p_value > 1e-3, f"position {pos}: p={p_value:.2e}, base={a}, ddtree={b}"


@pytest.mark.parametrize("model", MODELS)
def test_bad_requests_get_4xx_and_server_stays_up(servers, model):
    server = servers[f"{model}-ddtree"]
    chat = server.url + "/v1/chat/completions"
    msg = [{"role": "user", "content": "hi"}]
    cases = {
        "max_tokens=0": {"model": "x", "messages": msg, "max_tokens": 0},
        "max_tokens>context": {"model": "x", "messages": msg, "max_tokens": 100000},
        "logprobs": {"model": "x", "messages": msg, "max_tokens": 4, "logprobs": True},
        "min_p": {"model": "x", "messages": msg, "max_tokens": 4, "min_p": 0.1},
        "frequency_penalty": {
            "model": "x",
            "messages": msg,
            "max_tokens": 4,
            "frequency_penalty": 0.5,
        },
    }
    for name, payload in cases.items():
        status, body = harness.post(chat, payload)
        assert 400 <= status < 500, f"{name}: HTTP {status} {body}"
    ok = harness.generate(server, "hello", max_new_tokens=8, temperature=0)
    assert len(ok["output_ids"]) >= 1


@pytest.mark.parametrize("variant", ["ddtree", "ddtree_sync"])
@pytest.mark.parametrize("model", MODELS)
def test_pools_return_to_idle_and_no_host_sync(servers, model, variant):
    server = servers[f"{model}-{variant}"]
    status, _ = harness.post(server.url + "/flush_cache", {})
    assert status == 200
    status, loads = harness.get(server.url + "/v1/loads")
    assert status == 200, loads
    log = server.log_text()
    assert "leak" not in log.lower(), "memory leak reported in the server log"
    assert "synchronizing CUDA operation" not in log, "DDTREE's own code synced with the host"
    assert "Traceback" not in log
    (Path(os.environ.get("OUT", "/tmp")) / f"loads_{server.name}.json").write_text(str(loads))
    per_rank = loads.get("loads", []) if isinstance(loads, dict) else loads
    assert per_rank, loads
    assert all(r["num_used_tokens"] == 0 for r in per_rank), loads

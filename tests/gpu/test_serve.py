"""DDTREE served by SGLang on the GPU, against the same server without speculation.

Both servers load identical tiny checkpoints written here with seeded weights: an attention-only
Qwen3 and a Qwen3.5 hybrid (Gated DeltaNet + gated attention, the Qwen3.6-27B architecture), each
with a DFlash draft made to agree with it (testing/binary_pair.py), so rounds accept deep paths.
All servers of a run share one GPU in small memory slices (tests/gpu/servers.py).

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

from tests.gpu.servers import MODELS, NEW_TOKENS, NUM_NODES, TOPK, server_set  # noqa: E402


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


# bf16 kernels of different shapes (width-1 decode vs N-node tree verify) round differently, so
# two candidates whose log-probs are this close can swap places; anything farther apart cannot.
TIE_TOL = 0.25  # nats; bf16 log-probs near -4 are quantised in steps of 1/32


def _greedy_ids(server, concurrency: int) -> list[list[int]]:
    def one(prompt):
        out = harness.generate(
            server, prompt, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True
        )
        return out["output_ids"]

    return harness.run_all(one, harness.PROMPTS, concurrency)


def _base_verdicts(base, prompt: str, tokens: list[int]) -> list[tuple[float, float]]:
    """Teacher-force `tokens` through the plain server: per position, (logprob of the chosen
    token, best logprob) under the target alone given the prompt and the tokens before it."""
    prompt_ids = base.tokenize(prompt)
    out = harness.post(
        base.url + "/generate",
        {
            "input_ids": prompt_ids + tokens,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": len(prompt_ids) - 1,
            "top_logprobs_num": 1,
        },
    )[1]
    chosen = [lp for lp, _tok, *_ in out["meta_info"]["input_token_logprobs"][1:]]
    best = [top[0][0] for top in out["meta_info"]["input_top_logprobs"][1:]]
    return list(zip(chosen, best, strict=True))


def _deficits(base, tokens_per_prompt: list[list[int]]) -> list[float]:
    """Per generated token: how far below the target's own best log-prob it is (0 = argmax)."""
    out = []
    for prompt, tokens in zip(harness.PROMPTS, tokens_per_prompt, strict=True):
        out += [best - chosen for chosen, best in _base_verdicts(base, prompt, tokens)]
    return out


@pytest.fixture(scope="module")
def plain_greedy(servers):
    """The plain server's own greedy tokens and their teacher-forced deficits: the control that
    measures how far prefill (teacher forcing) and decode numerics disagree on their own."""
    result = {}
    for model in MODELS:
        base = servers[f"{model}-base"]
        tokens = _greedy_ids(base, 8)
        result[model] = (tokens, _deficits(base, tokens))
    return result


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("variant", ["ddtree", "ddtree_sync"])
@pytest.mark.parametrize("model", MODELS)
def test_generate_greedy_is_the_targets_greedy(servers, plain_greedy, model, variant, concurrency):
    """Every DDTREE token is the target's own greedy choice given the tokens before it, up to
    bf16 near-ties: the tolerance is TIE_TOL or the largest deficit the plain server's own
    greedy tokens show under the same teacher forcing, whichever is larger. A wrong token (a bug)
    sits nats below the argmax; most sequences also match the plain server exactly."""
    base = servers[f"{model}-base"]
    plain_tokens, plain_deficits = plain_greedy[model]
    spec = _greedy_ids(servers[f"{model}-{variant}"], concurrency)
    assert all(len(t) == NEW_TOKENS for t in spec)
    deficits = _deficits(base, spec)
    tol = max(TIE_TOL, max(plain_deficits))
    identical = sum(a == b for a, b in zip(spec, plain_tokens, strict=True))
    off_argmax = sum(d > 0 for d in deficits)
    plain_off = sum(d > 0 for d in plain_deficits)
    print(
        f"{model}-{variant} c={concurrency}: identical to plain {identical}/{len(spec)}; "
        f"off-argmax tokens {off_argmax}/{len(deficits)} (plain's own: {plain_off}); "
        f"max deficit {max(deficits):.3f} (plain's own {max(plain_deficits):.3f}, tol {tol:.3f})"
    )
    assert max(deficits) <= tol
    assert off_argmax <= 2 * plain_off + len(deficits) // 100


@pytest.mark.parametrize("variant", ["ddtree", "ddtree_sync"])
@pytest.mark.parametrize("model", MODELS)
def test_chat_goes_through_the_same_decode(servers, model, variant):
    """/v1/chat/completions on DDTREE equals /generate on the chat-templated prompt (one request
    at a time, so batching cannot change numerics)."""
    from transformers import AutoTokenizer

    server = servers[f"{model}-{variant}"]
    tok = AutoTokenizer.from_pretrained(server.model_path)
    for prompt in harness.PROMPTS[:8]:
        msgs = [{"role": "user", "content": prompt}]
        chat = harness.chat(server, prompt, max_tokens=64, temperature=0, ignore_eos=True)
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        gen = harness.generate(server, text, max_new_tokens=64, temperature=0, ignore_eos=True)
        assert chat["choices"][0]["message"]["content"] == gen["text"]
        assert chat["usage"]["completion_tokens"] == 64


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
    assert 3.0 <= meta["spec_accept_length"] <= 16.0  # the binary pair accepts ~4 per round
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


@pytest.mark.parametrize("model", MODELS)
def test_sglang_and_reference_engine_agree_round_for_round(servers, model):
    """The transformers reference engine (CPU, float32) and SGLang's DDTREE (GPU, bf16) on the
    same checkpoints: the same tokens in the same number of rounds. The binary pair's wide
    margins make both numerics pick the same tokens; budget 30 makes the tree a complete binary
    tree, so the draft's exact c0/c1 tie cannot change its shape on either device."""
    from sglang_ddtree.reference.engine import generate, load_pair

    server = servers[f"{model}-ddtree"]
    target, drafter, tok = load_pair(
        server.model_path, server.args[server.args.index("--speculative-draft-model-path") + 1]
    )
    n = 48
    for prompt in harness.PROMPTS[:6]:
        out = harness.generate(server, prompt, max_new_tokens=n, temperature=0, ignore_eos=True)
        ids = torch.tensor(tok(prompt)["input_ids"])
        ref = generate(target, drafter, ids, n, budget=NUM_NODES - 1, topk=TOPK)
        assert out["output_ids"] == list(ref.tokens), prompt
        assert out["meta_info"]["spec_verify_ct"] == ref.rounds, (prompt, ref.accept_lengths)

"""DDTREE served by SGLang on the GPU, against the same server without speculation.

Models (tests/gpu/servers.py): the agreeing binary pairs on an attention-only Qwen3 and a
Qwen3.5 hybrid (Gated DeltaNet + gated attention, the Qwen3.6-27B architecture), written here
with seeded weights, whose drafts make every round accept deep paths through side branches; and
the trained Qwen3.5 pair shipped in sglang_ddtree/assets/demo (real text, natural margins).
Every DDTREE server and its plain baseline load identical checkpoints.

Run on the device:  python -m pytest tests/gpu -m gpu -q -rA   (logs go to $OUT if set)
"""

from __future__ import annotations

import collections
import json
import os
import re
import tempfile
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("sglang")

from tests.gpu import harness  # noqa: E402

pytestmark = pytest.mark.gpu

from tests.gpu.servers import (  # noqa: E402
    BENCH_ONLY,
    ENV,
    MODEL_VARIANTS,
    NEW_TOKENS,
    VARIANT_ENV,
    launched_set,
    read_status,
    run_launcher,
    status_path,
    tree_shape,
)
from tests.gpu.servers import MODELS as ALL_MODELS  # noqa: E402

# DDTREE_GPU_MODELS=qwen3,pair: test only these models (one pytest process per model can then
# run beside the others against the same server set).
MODELS = tuple(os.environ.get("DDTREE_GPU_MODELS", ",".join(ALL_MODELS)).split(","))
assert set(MODELS) <= set(ALL_MODELS), MODELS
WAIT_S = float(os.environ.get("DDTREE_GPU_WAIT", "0"))  # how long a test waits for its server
SPEC_VARIANTS = ("ddtree", "ddtree_sync", "ddtree_det", "dflash")  # dflash: a control
# DDTREE in deterministic mode (root-path GDN verify): the batch-invariance test
DET_DDTREE = ("ddtree_det",)
# reported beside them, not asserted (none now: the chunked verify in deterministic mode, whose
# served tokens were not batch-invariant, is no longer servable there)
DET_KNOWN: tuple[str, ...] = ()
SPEC_SERVERS = [
    (m, v)
    for m in MODELS
    for v in MODEL_VARIANTS[m]
    if v in SPEC_VARIANTS and (m, v) not in BENCH_ONLY
]


@pytest.fixture(scope="module")
def servers():
    """The server set of tests/gpu/servers.py (its launched set): reused when already running,
    else started here. A server that did not come up fails the tests that use it (`_up`), not
    the others."""
    root = Path(os.environ.get("DDTREE_GPU_ROOT", tempfile.mkdtemp(prefix="ddtree-gpu-")))
    started = launched_set(root)
    # Launched by `python -m tests.gpu.servers launch` (status.json), or already up: reuse.
    reuse = status_path(root).exists() or any(s.is_healthy() for s in started.values())
    if not reuse:
        run_launcher(root)  # the same launcher, in this process: returns once all have settled
    yield started  # logs stay in ROOT/logs (scripts/gpu_session.sh archives them to $OUT)
    if not reuse:
        for server in started.values():
            server.stop_by_port()


def _up(servers, name: str) -> harness.Server:
    """The named server, once healthy: waits up to DDTREE_GPU_WAIT s while the launcher still
    reports it starting; fails the test if it does not come up."""
    if name not in servers:
        pytest.skip(f"{name} is not in this server set (DDTREE_GPU_SERVERS)")
    server = servers[name]
    root = Path(server.log_dir).parent
    deadline = time.time() + WAIT_S
    while not server.is_healthy():
        if time.time() > deadline or read_status(root).get(name, "starting") != "starting":
            state = read_status(root).get(name, "unknown")
            pytest.fail(
                f"server {name} is not up ({state}); log tail:\n{server.log_text()[-3000:]}"
            )
        time.sleep(2)
    return server


def _flush(server) -> None:
    """Empty the radix cache, so the next request's prefill runs over the whole prompt (the same
    kernel shapes as a cold request) and no cached state is reused. SGLang can still count the
    last request as running just after its response arrived (it then answers 400, which failed
    the deterministic test), so this retries for up to 10 s."""
    for _ in range(20):
        status, body = harness.post(server.url + "/flush_cache", {}, admin=True)
        if status == 200:
            return
        time.sleep(0.5)
    assert status == 200, body


# bf16 kernels of different shapes (width-1 decode vs N-node tree verify) round differently, so
# two candidates whose log-probs are this close can swap places; anything farther apart cannot.
TIE_TOL = 0.25  # nats; bf16 log-probs near -4 are quantised in steps of 1/32
CONTROL_MAX = 1.0  # nats: a larger prefill-vs-decode gap on plain's own tokens is a broken setup


def _greedy_ids(server, concurrency: int, prompts=harness.PROMPTS) -> list[list[int]]:
    def one(prompt):
        out = harness.generate(
            server, prompt, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True
        )
        return out["output_ids"]

    return harness.run_all(one, prompts, concurrency)


def _next_token_logprobs(base, input_ids: list[int], start: int, top: int = 1) -> dict:
    """Teacher-force `input_ids` through the plain server (radix cache flushed first): per
    position from `start` on, the log-prob of the token there and the top-`top` log-probs."""
    _flush(base)
    status, out = harness.post(
        base.url + "/generate",
        {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": start - 1,
            "top_logprobs_num": top,
        },
    )
    assert status == 200, out
    return out["meta_info"]


def _deficits(base, tokens_per_prompt: list[list[int]], prompts=harness.PROMPTS) -> list[float]:
    """Per generated token: how far below the target's own best log-prob it is (0 = argmax)."""
    return [
        d
        for prompt, tokens in zip(prompts, tokens_per_prompt, strict=True)
        for d in _token_deficits(base, base.tokenize(prompt), tokens)
    ]


def _token_deficits(base, prompt_ids: list[int], tokens: list[int]) -> list[float]:
    """_deficits for one sequence given as token ids."""
    meta = _next_token_logprobs(base, prompt_ids + tokens, len(prompt_ids))
    chosen = [lp for lp, _tok, *_ in meta["input_token_logprobs"][1:]]
    best = [top[0][0] for top in meta["input_top_logprobs"][1:]]
    return [b - c for c, b in zip(chosen, best, strict=True)]


@pytest.fixture(scope="module")
def fp32_pair(servers):
    """Per model: the reference engine's (target runner, draft runner, tokenizer) in float32 on
    the CPU, on the checkpoints the model's servers load: the referee for tokens that bf16
    teacher forcing calls off-argmax, and the engine SGLang's DDTREE is compared with."""
    from sglang_ddtree.reference.engine import load_pair

    cache = {}

    def get(model: str):
        if model not in cache:
            spec = next(s for n, s in servers.items() if n.startswith(f"{model}-ddtree"))
            draft = spec.args[spec.args.index("--speculative-draft-model-path") + 1]
            cache[model] = load_pair(spec.model_path, draft)
        return cache[model]

    return get


def _beyond_tol_refereed(base, target, spec, deficits, tol, prompts=None) -> list[tuple]:
    """harness.beyond_tol_referee over every prompt (`prompts`: their token ids; default the
    suite's prompts): (prompt index, position, bf16 deficit, float32 deficit, bf16 error on that
    sequence)."""
    out, k = [], 0
    for i, tokens in enumerate(spec):
        prompt_ids = base.tokenize(harness.PROMPTS[i]) if prompts is None else prompts[i]
        bf16 = deficits[k : k + len(tokens)]
        out += [(i, *r) for r in harness.beyond_tol_referee(target, prompt_ids, tokens, bf16, tol)]
        k += len(tokens)
    return out


def _control_holds(base, target, tokens, deficits, plain_deficits) -> bool:
    """Whether DFLASH's greedy tokens may widen another server's tolerance: every one of them
    beyond the plain server's own tolerance is a near-tie under the float32 referee. A control
    that leaves the target's greedy itself measures nothing (SGLang 0.5.23's DFLASH did on the
    hybrid binary pair: a token 2.07 nats below the float32 argmax)."""
    tol = max(TIE_TOL, max(plain_deficits))
    beyond = _beyond_tol_refereed(base, target, tokens, deficits, tol)
    verdicts = [harness.referee_verdict(row, TIE_TOL, bound=2 * tol) for row in beyond]
    if None in verdicts:
        print(f"DFLASH control left out (its own greedy fails the referee: {beyond})")
    return None not in verdicts


@pytest.fixture(scope="module")
def plain_greedy(servers):
    """Per model and plain variant (default `base`): the plain server's own greedy tokens and
    their teacher-forced deficits, the control that measures how far prefill (teacher forcing)
    and decode numerics disagree."""
    cache = {}

    def get(model: str, base: str = "base"):
        name = f"{model}-{base}"
        if name not in cache:
            server = _up(servers, name)
            tokens = _greedy_ids(server, 8)
            cache[name] = (tokens, _deficits(server, tokens))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def dflash_greedy(servers):
    """Per (model, concurrency, DFLASH variant, default `dflash`): SGLang's own DFLASH greedy
    tokens and their teacher-forced deficits, the second control (its verify pass runs the same
    target kernels as DDTREE's), or None where the model has no such DFLASH server."""
    cache = {}

    def get(model: str, concurrency: int, variant: str = "dflash"):
        key = model, concurrency, variant
        if key not in cache:
            if f"{model}-{variant}" not in servers:
                cache[key] = None
            else:
                base = _up(servers, f"{model}-base")
                tokens = _greedy_ids(_up(servers, f"{model}-{variant}"), concurrency)
                cache[key] = (tokens, _deficits(base, tokens))
        return cache[key]

    return get


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("model,variant", SPEC_SERVERS)
def test_generate_greedy_is_the_targets_greedy(
    servers, plain_greedy, dflash_greedy, fp32_pair, model, variant, concurrency
):
    """Every DDTREE token is the target's own greedy choice given the tokens before it, up to
    bf16 near-ties: within TIE_TOL nats of the best, or within the largest deficit the controls
    show under the same teacher forcing: the plain server's own greedy tokens (decode vs
    prefill kernels) and SGLang's DFLASH on the same checkpoints (its verify vs prefill). A
    token beyond that goes to the float32 referee, which must call it a near-tie (within
    TIE_TOL of the float32 argmax, or within the bf16-vs-float32 error teacher forcing shows at
    the same sequence's other tokens). A wrong token (a bug) sits nats below the argmax in both
    precisions, and a systematic one multiplies the off-argmax count, which may be at most
    twice the controls'."""
    if variant == "dflash":
        run, dflash = dflash_greedy(model, concurrency), None
    else:
        run, dflash = None, dflash_greedy(model, concurrency)
    assert_targets_greedy(
        servers, plain_greedy, fp32_pair, model, variant, concurrency, run, dflash
    )


def assert_targets_greedy(
    servers,
    plain_greedy,
    fp32_pair,
    model,
    variant,
    concurrency,
    run=None,
    dflash=None,
    base="base",
) -> None:
    """test_generate_greedy_is_the_targets_greedy's check of `{model}-{variant}` against the
    plain server `{model}-{base}`: its greedy tokens and their deficits `run` (default: asked of
    the server now and teacher-forced on the plain one), the plain server's own greedy as the
    control and DFLASH's (`dflash`: its tokens and deficits, or None) where it holds."""
    base_server = _up(servers, f"{model}-{base}")
    plain_tokens, plain_deficits = plain_greedy(model, base)
    if run is None:
        spec = _greedy_ids(_up(servers, f"{model}-{variant}"), concurrency)
        run = spec, _deficits(base_server, spec)
    spec, deficits = run
    assert all(len(t) == NEW_TOKENS for t in spec)
    controls = {"plain": plain_deficits}
    target = fp32_pair(model)[0]
    if dflash is not None and _control_holds(base_server, target, *dflash, plain_deficits):
        controls["dflash"] = dflash[1]
    tol = max(TIE_TOL, *(max(c) for c in controls.values()))
    control_off = max(sum(d > 0 for d in c) for c in controls.values())
    identical = sum(a == b for a, b in zip(spec, plain_tokens, strict=True))
    off_argmax = sum(d > 0 for d in deficits)
    print(
        f"{model}-{variant} c={concurrency} against {base}: identical to plain "
        f"{identical}/{len(spec)}; "
        f"off-argmax tokens {off_argmax}/{len(deficits)}, max deficit {max(deficits):.3f}; "
        + "; ".join(
            f"{k}: {sum(d > 0 for d in c)} off-argmax, max {max(c):.3f}"
            for k, c in controls.items()
        )
        + f"; tol {tol:.3f}"
    )
    # The plain control measures the instrument: a larger prefill-vs-decode gap makes the
    # tolerance meaningless unless SGLang's DFLASH on the same numerics is there to compare.
    assert max(plain_deficits) <= CONTROL_MAX or "dflash" in controls or variant == "dflash", (
        "control: teacher forcing disagrees with decode"
    )
    beyond = _beyond_tol_refereed(base_server, target, spec, deficits, tol)
    print(f"beyond tol (prompt, position, bf16 deficit, float32 deficit, bf16 error): {beyond}")
    verdicts = [harness.referee_verdict(row, TIE_TOL, bound=2 * tol) for row in beyond]
    print(f"referee: {verdicts}")
    assert None not in verdicts, beyond
    # at most one position per run where the two precisions cannot settle the token
    assert verdicts.count("unresolved") <= 1, beyond
    assert off_argmax <= 2 * control_off + len(deficits) // 100


def test_deterministic_mode_is_token_identical(servers):
    """SGLang's batch-invariant mode (--enable-deterministic-inference), 32 prompts x 128
    tokens at temperature 0, batch 1 and 8: the plain server and each DDTREE server (DET_DDTREE)
    give exactly the same tokens at both batch sizes; DDTREE equals the plain server token for
    token except where the two kernels (N-node tree verify vs width-1 decode) flip a bf16
    near-tie: at the first differing token, DDTREE's choice is within TIE_TOL of the target's
    best under teacher forcing. SGLang's DFLASH in the same mode (the control) is reported
    beside it."""
    if "pair" not in MODELS:
        pytest.skip("the pair's servers are tested by another process (DDTREE_GPU_MODELS)")
    base = _up(servers, "pair-base_det")
    named = [("plain", base)]
    named += [
        (v, _up(servers, f"pair-{v}")) for v in DET_DDTREE + DET_KNOWN if f"pair-{v}" in servers
    ]
    if "pair-dflash_det" in servers:
        named.append(("dflash", _up(servers, "pair-dflash_det")))
    runs = {}
    for name, server in named:
        for c in (1, 8):
            _flush(server)
            runs[name, c] = _greedy_ids(server, c)
    ref = runs["plain", 1]
    same = {k: sum(a == b for a, b in zip(v, ref, strict=True)) for k, v in runs.items()}
    firsts = {
        k: [harness.first_divergence(a, b) for a, b in zip(v, ref, strict=True)]
        for k, v in runs.items()
    }
    print("identical to plain at batch 1 (of 32):", same)
    print("first divergences:", {k: [f for f in v if f is not None] for k, v in firsts.items()})
    assert runs["plain", 8] == runs["plain", 1], "the plain server is not batch-invariant"
    failures, known = [], []
    for variant in (name for name, _ in named if name.startswith("ddtree")):
        found = known if variant in DET_KNOWN else failures
        deficits = []
        for i, at in enumerate(firsts[variant, 1]):
            if at is not None:
                tokens = runs[variant, 1][i][: at + 1]
                deficits.append(_deficits(base, [tokens], [harness.PROMPTS[i]])[at])
        print(f"{variant}: deficit at its first divergence from plain: {deficits}")
        if runs[variant, 8] != runs[variant, 1]:
            moved = [
                i
                for i, (a, b) in enumerate(zip(runs[variant, 8], runs[variant, 1], strict=True))
                if a != b
            ]
            found.append(f"{variant} is not batch-invariant (prompts {moved})")
        if not all(d <= TIE_TOL for d in deficits):
            found.append(f"{variant} left plain's greedy at a non-tie: {deficits}")
    print(f"known, not asserted ({', '.join(DET_KNOWN)}): {known or 'none this run'}")
    assert not failures, failures


@pytest.mark.parametrize(
    "model,variant",
    [(m, v) for m in MODELS for v in ("ddtree_fixed", "dflash") if (m, v) not in BENCH_ONLY],
)
def test_chat_goes_through_the_same_decode(servers, model, variant):
    """/v1/chat/completions on DDTREE equals /generate on the chat-templated prompt (one request
    at a time from a flushed cache, so batching and prefix reuse cannot change numerics). On a
    fixed-width server: with automatic widths two identical requests may verify at different
    widths (the choice follows measured round costs), whose bf16 kernels can flip a near-tie
    (the greedy test referees those servers' tokens)."""
    from transformers import AutoTokenizer

    server = _up(servers, f"{model}-{variant}")
    tok = AutoTokenizer.from_pretrained(server.model_path)
    for prompt in harness.PROMPTS[:8]:
        msgs = [{"role": "user", "content": prompt}]
        _flush(server)
        chat = harness.chat(server, prompt, max_tokens=64, temperature=0, ignore_eos=True)
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        _flush(server)
        gen = harness.generate(server, text, max_new_tokens=64, temperature=0, ignore_eos=True)
        assert chat["choices"][0]["message"]["content"] == gen["text"], prompt
        assert chat["usage"]["completion_tokens"] == 64


@pytest.mark.parametrize("model", MODELS)
def test_acceptance_is_reported(servers, model):
    server = _up(servers, f"{model}-ddtree")
    out = harness.generate(
        server, harness.PROMPTS[0], max_new_tokens=64, temperature=0, ignore_eos=True
    )
    meta = out["meta_info"]
    assert meta["spec_verify_ct"] >= 1
    low = 1.5 if model == "pair" else 3.0  # binary pairs ~4 per round; the pair 2.6 on average
    assert low <= meta["spec_accept_length"] <= 16.0, meta
    assert "accept len" in server.log_text()


SAMPLE_POSITIONS, SAMPLES, SAMPLE_TOP_K = 3, 1500, 8


def _samples(
    server, n: int, seeded: bool = True, draw: int = 0, extra: dict | None = None
) -> list[list[int]]:
    """n samples of SAMPLE_POSITIONS tokens at T=1, top-k 8 (and the sampling options `extra`).
    `seeded`: request i carries sampling_seed=draw*n+i (SGLang then draws the verify coins from
    a hash of seed and position); otherwise the coins come from torch's RNG. Draws are
    independent of each other."""

    def one(seed):
        params = {**({"sampling_seed": seed} if seeded else {}), **(extra or {})}
        out = harness.generate(
            server,
            "def fibonacci(n):",
            max_new_tokens=SAMPLE_POSITIONS,
            temperature=1.0,
            top_k=SAMPLE_TOP_K,
            ignore_eos=True,
            **params,
        )
        return out["output_ids"]

    return harness.run_all(one, range(draw * n, (draw + 1) * n), 16)


@pytest.fixture(scope="module")
def sampled(servers):
    """(model, variant, seeded, draw, base) -> (the plain server `{model}-{base}`'s seeded
    samples, the speculative server's samples); each draw is a fresh, independent sample of
    both."""
    cache = {}

    def get(model: str, variant: str, seeded: bool = True, draw: int = 0, base: str = "base"):
        plain = f"{model}-{base}", draw
        if plain not in cache:
            cache[plain] = _samples(_up(servers, plain[0]), SAMPLES, True, draw)
        key = model, variant, seeded, draw
        if key not in cache:
            cache[key] = _samples(_up(servers, f"{model}-{variant}"), SAMPLES, seeded, draw)
        return cache[plain], cache[key]

    return get


@pytest.mark.parametrize(
    "model,variant,seeded",
    [(m, v, True) for m, v in SPEC_SERVERS] + [(m, "ddtree", False) for m in MODELS],
)
def test_sampling_distribution_matches(sampled, model, variant, seeded):
    """Chi-square homogeneity of the token at each of 3 positions, base vs DDTREE (T=1, top-k 8),
    with seeded requests (SGLang's hashed verify coins) and, for one server per model, unseeded
    ones (torch's RNG).

    alpha = 1e-3 per position (Bonferroni over 3 positions: family-wise 3e-3 per test, a few
    percent over the suite's ~20 such tests). A rejected position must be confirmed by a fresh,
    independent draw of both servers at CONFIRM_ALPHA: a real difference rejects again, a false
    alarm (probability 3e-3) does so with probability 1e-2.
    """
    assert_same_distribution(sampled, model, variant, seeded)


def assert_same_distribution(sampled, model, variant, seeded, base="base") -> None:
    """test_sampling_distribution_matches's chi-square of `{model}-{variant}` against the plain
    server `{model}-{base}`, a rejection confirmed by a fresh draw of both."""
    p_values = _chi2_p_values(*sampled(model, variant, seeded, base=base))
    print(f"{model}-{variant} against {base}, seeded={seeded}: p per position {p_values}")
    rejected = [pos for pos, p in enumerate(p_values) if p <= 1e-3]
    if not rejected:
        return
    base_samples, spec_samples = sampled(model, variant, seeded, draw=1, base=base)
    again = _chi2_p_values(base_samples, spec_samples)
    print(f"rejected at {rejected}; a fresh draw gives {again}")
    for pos in rejected:
        a = collections.Counter(s[pos] for s in base_samples)
        b = collections.Counter(s[pos] for s in spec_samples)
        assert again[pos] > CONFIRM_ALPHA, (
            f"position {pos}: p={p_values[pos]:.2e}, then {again[pos]:.2e}; base={a}, ddtree={b}"
        )


CONFIRM_ALPHA = 1e-2
# T > 0 with what DDTREE applies per node (SGLANG_DDTREE_PENALTIES=1, the default), against the
# plain server without the overlap scheduler (`base_sync`, whose penalties count every output
# token); min_p unseeded (SGLang's flashinfer min-p sampler takes no seed)
SAMPLING_OPTIONS = {
    "min_p": ({"min_p": 0.2}, False),
    "penalties": (
        {"frequency_penalty": 0.8, "presence_penalty": 0.4, "repetition_penalty": 1.3},
        True,
    ),
}


@pytest.mark.parametrize("case", SAMPLING_OPTIONS)
@pytest.mark.parametrize("model", MODELS)
def test_sampling_with_min_p_and_penalties_matches(servers, model, case):
    """The chi-square of test_sampling_distribution_matches with min_p, and with the penalties,
    each node's distribution the request's given its own path (the same confirmation rule)."""
    extra, seeded = SAMPLING_OPTIONS[case]
    base, spec = _up(servers, f"{model}-base_sync"), _up(servers, f"{model}-ddtree")
    first = _chi2_p_values(
        _samples(base, SAMPLES, seeded, 0, extra), _samples(spec, SAMPLES, seeded, 0, extra)
    )
    print(f"{model} {case}: p per position {first}")
    rejected = [pos for pos, p in enumerate(first) if p <= 1e-3]
    if rejected:
        again = _chi2_p_values(
            _samples(base, SAMPLES, seeded, 1, extra), _samples(spec, SAMPLES, seeded, 1, extra)
        )
        assert all(again[pos] > CONFIRM_ALPHA for pos in rejected), (first, again)


def _chi2_p_values(base_samples, spec_samples) -> list[float]:
    """Per position: the chi-square homogeneity p-value of the two samples' tokens there
    (tokens seen fewer than 10 times pooled into one column)."""
    from scipy.stats import chi2_contingency

    n, out = len(base_samples), []
    for pos in range(SAMPLE_POSITIONS):
        a = collections.Counter(s[pos] for s in base_samples)
        b = collections.Counter(s[pos] for s in spec_samples)
        tokens = sorted(set(a) | set(b), key=lambda t: -(a[t] + b[t]))
        common = [t for t in tokens if a[t] + b[t] >= 10]
        rows = [[a[t] for t in common], [b[t] for t in common]]
        rows[0].append(n - sum(rows[0]))
        rows[1].append(n - sum(rows[1]))
        if rows[0][-1] + rows[1][-1] == 0:
            rows = [r[:-1] for r in rows]
        out.append(float(chi2_contingency(rows).pvalue))
    return out


@pytest.mark.parametrize("model,variant", SPEC_SERVERS)
def test_sampled_tokens_are_in_the_targets_top_k(servers, sampled, model, variant):
    """A support check with no sampling noise: every token DDTREE sampled (T=1, top-k 8) is one
    of the target's top 8 given the tokens before it (teacher-forced through the plain server
    from a flushed cache), up to TIE_TOL at the 8th place. Reports any violation with its prefix
    and how often it was sampled."""
    base = _up(servers, f"{model}-base")
    _, spec_samples = sampled(model, variant)
    prompt_ids = base.tokenize("def fibonacci(n):")
    by_prefix = collections.defaultdict(collections.Counter)
    for s in spec_samples:
        for pos in range(SAMPLE_POSITIONS):
            by_prefix[tuple(s[:pos])][s[pos]] += 1
    checked, violations = 0, []
    for prefix, counts in sorted(by_prefix.items(), key=lambda kv: -sum(kv[1].values()))[:80]:
        ids = prompt_ids + list(prefix)
        meta = _next_token_logprobs(base, ids + [0], len(ids), top=SAMPLE_TOP_K + 8)
        top = meta["input_top_logprobs"][-1]  # the distribution after `ids`
        allowed = {tok for _lp, tok, *_ in top[:SAMPLE_TOP_K]}
        eighth = top[SAMPLE_TOP_K - 1][0]  # tokens near-tied with the 8th may be in (once:
        allowed |= {tok for lp, tok, *_ in top if eighth - lp <= TIE_TOL}  # three at -4.32)
        checked += 1
        for tok, count in counts.items():
            if tok not in allowed:
                violations.append((prefix, tok, count, [(round(lp, 2), t) for lp, t, *_ in top]))
    print(f"{model}-{variant}: {checked} prefixes checked, violations: {violations[:10]}")
    assert not violations


def test_sampled_requests_keep_a_deterministic_server_serving(servers):
    """SGLang 0.5.23's seeded sampler asserts on min_p (sampler.py: "With sampling seed,
    multinomial_with_seed will provide wrong results"), which ended plain and DFLASH
    deterministic servers on a sampled request. On a deterministic DDTREE server every sampled
    request is served or refused with a 4xx (min_p by DDTREE's front end), and the server keeps
    serving: a greedy request after them is answered."""
    if "pair" not in MODELS:
        pytest.skip("the pair's servers are tested by another process (DDTREE_GPU_MODELS)")
    server = _up(servers, "pair-ddtree_det")
    cases = {
        "top_p and top_k": {"temperature": 0.8, "top_p": 0.9, "top_k": 20},
        "seeded": {"temperature": 0.8, "top_p": 0.9, "sampling_seed": 7},
        "min_p": {"temperature": 0.8, "min_p": 0.1},
    }
    for name, sampling in cases.items():
        status, body = harness.post(
            server.url + "/generate",
            {"text": harness.PROMPTS[0], "sampling_params": {"max_new_tokens": 16, **sampling}},
        )
        assert status == 200 or 400 <= status < 500, f"{name}: HTTP {status} {body}"
        if name == "min_p":
            assert 400 <= status < 500 and "min_p" in str(body), body
    ok = harness.generate(server, "hello", max_new_tokens=8, temperature=0)
    assert len(ok["output_ids"]) >= 1
    assert "Traceback" not in server.log_text()


@pytest.mark.parametrize("model", MODELS)
def test_bad_requests_get_4xx_and_server_stays_up(servers, model):
    server = _up(servers, f"{model}-ddtree")
    chat = server.url + "/v1/chat/completions"
    msg = [{"role": "user", "content": "hi"}]
    cases = {
        "max_tokens=0": {"model": "x", "messages": msg, "max_tokens": 0},
        "max_tokens>context": {"model": "x", "messages": msg, "max_tokens": 100000},
        "n=0": {"model": "x", "messages": msg, "max_tokens": 4, "n": 0},
        "temperature a string": {"model": "x", "messages": msg, "temperature": "hot"},
    }
    for name, payload in cases.items():
        status, body = harness.post(chat, payload)
        assert 400 <= status < 500, f"{name}: HTTP {status} {body}"
    # a token id outside the vocabulary (SGLang does not check it: a crash without DDTREE's own
    # check)
    status, body = harness.post(
        server.url + "/generate",
        {"input_ids": [1, 2, 10**9], "sampling_params": {"max_new_tokens": 4}},
    )
    assert 400 <= status < 500, f"token id 10**9: HTTP {status} {body}"
    ok = harness.generate(server, "hello", max_new_tokens=8, temperature=0)
    assert len(ok["output_ids"]) >= 1


@pytest.mark.parametrize("model,variant", SPEC_SERVERS)
def test_pools_return_to_idle_and_no_host_sync(servers, model, variant):
    assert_idle_and_no_host_sync(_up(servers, f"{model}-{variant}"))


def assert_idle_and_no_host_sync(server) -> None:
    """After its tests: no leak, host sync or traceback in the server's log, and its KV pool
    idle once the radix cache is flushed."""
    _flush(server)
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


# What each hybrid DDTREE server must have logged, so that a switch that silently did not
# engage (a hook that missed its target) cannot pass as tested: its GDN path (the startup line
# of state/gdn.describe) and the first use of each of its hooks.
COMMIT = "first GDN state commit through sglang_ddtree.gdn.tree_verify.commit_paths"
PATHS = "first GDN tree verify through sglang_ddtree.gdn.tree_verify"
CHUNK = "first GDN tree verify through sglang_ddtree.gdn.chunk_tree.chunk_tree_verify"
CONV = "first tree conv1d through sglang_ddtree.gdn.conv_tree"
COMPACT = ("Mamba pool sized for", "compact GDN verify scratch for")  # solver and pool hooks
HOSTPLAN = "first verify plan from host lengths"
MASKPACK = "first verify mask packed by tree/mask_pack.py"
ACCEPT = ("first accepted path moved to the front by round/accept_path.py",)
WIDTH = {"auto": "DDTREE verify width: auto among", "fixed": "DDTREE verify width: fixed at"}


def _engaged(verify: str = "chunk", width: str = "auto") -> tuple:
    """The startup lines and first-use lines of a GDN path (chunked verify, or the root paths
    in deterministic mode; tree conv1d, compact scratch), of the verify width (auto, but in
    deterministic mode) and of the verify's FlashInfer plan from host lengths with the mask
    packed from the tree, and of the accepted path's kernels."""
    line = (
        f"GDN path: ddtree (verify: {verify}; commit: replay; tree conv1d: ddtree; "
        "scratch: compact)"
    )
    uses = [
        CHUNK if verify == "chunk" else PATHS,
        COMMIT,
        HOSTPLAN,
        MASKPACK,
        *ACCEPT,
    ]
    return (line, WIDTH[width], *uses, CONV, *COMPACT)


DEFAULT_DDTREE = ("ddtree", "ddtree_sync", "ddtree_fp8", "ddtree_fp8kv")
ENGAGED = {
    **{v: _engaged() for v in DEFAULT_DDTREE},
    "ddtree_fixed": _engaged(width="fixed"),
    # the deterministic mode's defaults: root-path verify, fixed width
    "ddtree_det": _engaged(verify="paths", width="fixed"),
}
# what must not be in a log: the other verify kernel, hooks that are off
NOT_ENGAGED = {
    **{v: (PATHS, WIDTH["fixed"]) for v in DEFAULT_DDTREE},
    "ddtree_fixed": (PATHS, WIDTH["auto"]),
    "ddtree_det": (CHUNK,),
}


@pytest.mark.parametrize(  # qwen3 has no GDN layers, so no GDN hook ever runs there
    "model,variant",
    [
        (m, v)
        for m in MODELS
        if m != "qwen3"
        for v in MODEL_VARIANTS[m]
        if v in ENGAGED and (m, v) not in BENCH_ONLY
    ],
)
def test_the_variants_switches_engaged(servers, model, variant):
    import dataclasses
    from unittest import mock

    from sglang_ddtree.config import Options

    server = _up(servers, f"{model}-{variant}")
    log = server.log_text()
    # the resolved options, as a value (/server_info): what this server's environment parses to
    with mock.patch.dict(os.environ, {**ENV, **VARIANT_ENV.get(variant, {})}):
        # the server's modes as its flags give them (compat.option_modes reads the same two)
        expected = Options.from_env(
            unified_memory="--enable-unified-memory" in server.args,
            deterministic="--enable-deterministic-inference" in server.args,
        )
    status, info = harness.get(server.url + "/server_info")
    assert status == 200, info
    reported = [s["ddtree"] for s in info.get("internal_states", []) if "ddtree" in s]
    assert reported and reported[0]["options"] == dataclasses.asdict(expected), reported
    assert f"sglang_ddtree: options: {expected.describe()}" in log
    # an automatic-width server counts its rounds per width; a fixed one has no such count
    chosen = reported[0].get("widths_chosen")
    if expected.width != "auto":
        assert chosen is None, chosen
    assert all(isinstance(n, int) and n >= 0 for n in (chosen or {}).values()), chosen

    # which paths the hooks took, as values (/server_info's "engaged": gdn.Engaged's names);
    # the start-up lines (GDN path, width, pool) from the log
    def took(line: str) -> bool:
        if line.startswith("first "):
            return any(e.startswith(line[len("first ") :]) for e in reported[0]["engaged"])
        return line in log

    for line in ENGAGED[variant]:
        assert took(line), f"{model}-{variant}: {line!r} not taken"
    for line in NOT_ENGAGED.get(variant, ()):
        assert not took(line), f"{model}-{variant}: {line!r} taken"
    assert reported[0]["gdn_path"] in log  # the start-up line gives the same GDN path


# Grammar-constrained decoding: SGLang's grammar backend (xgrammar) masks the
# draft tree per path in the verify. Small grammars that every output can finish within
# GRAMMAR_TOKENS, and a checker per grammar.
GRAMMAR_TOKENS = 96
GRAMMARS = {
    "json_schema": (
        json.dumps(
            {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "pattern": "^[a-z]{1,10}$"},
                    "count": {"enum": [1, 2, 3]},
                },
                "required": ["name", "count"],
            }
        ),
        lambda text: set(json.loads(text)) == {"name", "count"}
        and json.loads(text)["count"] in (1, 2, 3),
    ),
    "regex": (
        r"(yes|no), [a-z]{3,8}\.",
        lambda text: re.fullmatch(r"(yes|no), [a-z]{3,8}\.", text),
    ),
    "ebnf": (
        'root ::= "def " name "(" name "):"\nname ::= [a-z] [a-z]? [a-z]? [a-z]?',
        lambda text: re.fullmatch(r"def [a-z]{1,4}\([a-z]{1,4}\):", text),
    ),
}


def _constrained(server, prompt: str, kind: str, **sampling) -> dict:
    params = {"max_new_tokens": GRAMMAR_TOKENS, kind: GRAMMARS[kind][0], **sampling}
    return harness.generate(server, prompt, **params)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_constrained_output_is_plains_and_parses(servers, fp32_pair, model, kind):
    """At T=0 DDTREE's output under a JSON schema, a regex or an EBNF grammar equals the plain
    server's under the same grammar, except where the two part at a float32 near-tie between
    their two (both allowed) tokens; every output satisfies its grammar; at T=1, 8 samples all
    do. One request at a time from a flushed cache."""
    server, base = _up(servers, f"{model}-ddtree"), _up(servers, f"{model}-base")
    target, _drafter, tok = fp32_pair(model)
    ok = GRAMMARS[kind][1]
    parted = []
    for prompt in harness.PROMPTS[:6]:
        outs = []
        for s in (server, base):
            _flush(s)
            outs.append(_constrained(s, prompt, kind, temperature=0))
        got, want = outs
        assert ok(got["text"]), (kind, prompt, got["text"])
        assert ok(want["text"]), ("plain", kind, prompt, want["text"])
        at = harness.first_divergence(got["output_ids"], want["output_ids"])
        if at is not None:
            ids = tok(prompt)["input_ids"]
            gap = abs(
                harness.fp32_deficit(target, ids, got["output_ids"], at)
                - harness.fp32_deficit(target, ids, want["output_ids"], at)
            )
            parted.append((prompt, at, round(gap, 3)))
    assert all(gap <= TIE_TOL for _p, _i, gap in parted), parted
    samples = [
        _constrained(server, harness.PROMPTS[i % 6], kind, temperature=1.0)["text"]
        for i in range(8)
    ]
    assert all(ok(text) for text in samples), (kind, samples)
    print(f"{model} {kind}: parted {parted}")


@pytest.mark.parametrize("model", MODELS)
def test_a_grammar_that_rejects_the_drafts_still_makes_progress(servers, model):
    """Digits only: the drafter (code text) proposes almost nothing the grammar allows, so most
    rounds accept no drafted token; each round still emits the target's own (bonus) token, and
    the 40 digits (fewer tokens: the tokenizers have digit pairs) match the grammar. Through the
    OpenAI chat route too (response_format json_schema)."""
    server = _up(servers, f"{model}-ddtree")
    _flush(server)
    out = harness.generate(
        server, harness.PROMPTS[0], max_new_tokens=40, temperature=0, regex="[0-9]{40}"
    )
    assert re.fullmatch("[0-9]{40}", out["text"]), out["text"]
    # the first token comes from the prefill, then at least one per round; the binary drafts
    # (their two tokens are never digits) are all rejected: exactly one per round
    rounds, tokens = out["meta_info"]["spec_verify_ct"], len(out["output_ids"])
    if model == "pair":
        assert 1 <= rounds <= tokens - 1, out["meta_info"]
    else:
        assert rounds == tokens - 1, out["meta_info"]
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    chat = harness.chat(
        server,
        harness.PROMPTS[1],
        max_tokens=GRAMMAR_TOKENS,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "flag", "schema": schema}},
    )
    assert set(json.loads(chat["choices"][0]["message"]["content"])) == {"ok"}, chat


def _assert_greedy_logprob(token: int, chosen, top, where) -> None:
    """A greedy token's logprob entry ([logprob, id, text]) is its own (the same id: aligned),
    at the best logprob of its top list (the tiny models' logits tie exactly at times, and the
    top list may then rank another of the tied tokens first), and where the top list holds the
    token, at the same logprob."""
    assert chosen[1] == token, (where, chosen)
    assert abs(chosen[0] - top[0][0]) < 1e-5, (where, chosen, top)
    listed = [t[0] for t in top if t[1] == token]
    assert all(abs(x - chosen[0]) < 1e-5 for x in listed), (where, chosen, top)


# Penalties per node (SGLANG_DDTREE_PENALTIES=1, the default `ddtree`
# servers): greedy with each setting, every served token refereed in float32 in the penalised
# distribution its own context gives (the reference engine on the CPU). The control for bf16
# noise is the plain server without the overlap scheduler (`base_sync`): with it, SGLang
# counts a request's output one token late (ScheduleBatch.cumulate_penalty_output_tokens runs
# before the last token is processed), which the float32 referee would charge to the control.
PENALTY_CASES = {
    "frequency+presence": {"frequency_penalty": 0.6, "presence_penalty": 0.4},
    "repetition": {"repetition_penalty": 1.4},
    "min_new_tokens": {"min_new_tokens": 40},
    # the binary pairs' two tokens (100, 101) and an ordinary one: the same bias at every node,
    # added after the penalties, as SGLang's plain sampler adds it
    "logit_bias": {"logit_bias": {"100": 1.5, "101": -1.0, "17": 2.5}},
}


def _penalised_deficits(target, prompt_ids, tokens, setting, stops) -> list[float]:
    """Per token: how far below the float32 argmax of the penalised logits it is, the penalties
    counting the tokens before it (SGLang's order: tree.penalties.penalize), min_new_tokens
    blocking `stops`."""
    import torch

    from sglang_ddtree.accept.penalties import penalize

    logits, _ = target.prefill(torch.tensor(prompt_ids + tokens))
    rows = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(tokens)].float()
    counts = torch.zeros(rows.shape[-1])
    out = []
    for i, token in enumerate(tokens):
        x = penalize(
            rows[i],
            counts,
            counts > 0,
            setting.get("frequency_penalty", 0.0),
            setting.get("presence_penalty", 0.0),
            setting.get("repetition_penalty", 1.0),
        )
        for token_id, bias in setting.get("logit_bias", {}).items():
            x[int(token_id)] += bias
        if i < setting.get("min_new_tokens", 0):
            x[list(stops)] = float("-inf")
        lp = x.log_softmax(-1)
        out.append(float(lp.max() - lp[token]))
        counts[token] += 1
    return out


@pytest.mark.parametrize("case", PENALTY_CASES)
@pytest.mark.parametrize("model", MODELS)
def test_penalties_are_exact_inside_the_tree(servers, fp32_pair, model, case):
    """Every greedy token DDTREE serves with the penalty is the argmax of the target's penalised
    distribution given its own context, within TIE_TOL or the bf16 noise the plain server
    without overlap shows under the same setting (both refereed in float32); with
    min_new_tokens no output ends on a blocked stop token before the floor."""
    server, base = _up(servers, f"{model}-ddtree"), _up(servers, f"{model}-base_sync")
    target, _draft, tokenizer = fp32_pair(model)
    setting = PENALTY_CASES[case]
    stops = {tokenizer.eos_token_id} - {None}
    worst = {"ddtree": 0.0, "plain": 0.0}
    for prompt in harness.PROMPTS[:6]:
        prompt_ids = base.tokenize(prompt)
        for name, s in (("ddtree", server), ("plain", base)):
            _flush(s)
            status, out = harness.post(
                s.url + "/generate",
                {
                    "text": prompt,
                    "sampling_params": {"max_new_tokens": 48, "temperature": 0, **setting},
                },
            )
            assert status == 200, out
            tokens = out["output_ids"]
            if case == "min_new_tokens" and len(tokens) < setting["min_new_tokens"]:
                assert tokens[-1] not in stops, (name, prompt, len(tokens))
            deficits = _penalised_deficits(target, prompt_ids, tokens, setting, stops)
            worst[name] = max(worst[name], max(deficits))
    tol = max(TIE_TOL, 2 * worst["plain"])  # the control's own noise, never below TIE_TOL
    print(
        f"{model} {case}: worst float32 deficit ddtree {worst['ddtree']:.3f}, plain "
        f"{worst['plain']:.3f} (tolerance {tol:.3f})"
    )
    assert worst["ddtree"] <= tol, worst


@pytest.mark.parametrize("model", MODELS)
def test_logprobs_are_the_plain_servers(servers, model):
    """Logprobs (always served; the default `ddtree` server): greedy /generate
    with return_logprob and top_logprobs_num=5, one request at a time from a flushed cache,
    against the plain server. Where the tokens agree, every token's logprob (the prefill's
    first token and each round's bonus token included) is plain's within a tolerance set by
    the control (twice plain's own gap between its decode and its prefill logprobs on its own
    tokens, at least TIE_TOL), and every token plain ranks in its top 5 by more than TIE_TOL
    above the 5th is in DDTREE's top 5. Then the OpenAI shape: chat with logprobs and
    top_logprobs=3 has one entry per completion token."""
    server, base = _up(servers, f"{model}-ddtree"), _up(servers, f"{model}-base")
    agreed, worst, tol = assert_logprobs_are_plains(server, base)
    print(
        f"{model}: logprobs on {agreed} agreeing tokens, worst gap "
        f"{abs(worst[2] - worst[3]):.3f} (tolerance {tol:.3f})"
    )

    # batched, half the requests asking for logprobs: each gets one per token, aligned
    def one(i):
        body = {
            "text": harness.PROMPTS[i],
            "return_logprob": i % 2 == 0,
            "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
        }
        status, out = harness.post(server.url + "/generate", body)
        assert status == 200, out
        return i, out

    for i, out in harness.run_all(one, range(8), 8):
        if i % 2 == 0:
            meta_b = out["meta_info"]
            assert len(meta_b["output_token_logprobs"]) == len(out["output_ids"]), (i, meta_b)
            for j, token in enumerate(out["output_ids"]):
                _assert_greedy_logprob(
                    token,
                    meta_b["output_token_logprobs"][j],
                    meta_b["output_top_logprobs"][j],
                    (i, j),
                )
    chat = harness.chat(
        server,
        harness.PROMPTS[0],
        max_tokens=16,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        ignore_eos=True,
    )
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] == 16, content
    # top_logprobs are keyed by token text: two tokens of one text count once; greedy: the
    # chosen token is the best of them
    for c in content:
        assert 1 <= len(c["top_logprobs"]) <= 3, c
        assert abs(max(t["logprob"] for t in c["top_logprobs"]) - c["logprob"]) < 1e-5, c


def assert_logprobs_are_plains(server, base) -> tuple[int, tuple, float]:
    """test_logprobs_are_the_plain_servers's comparison of `server` with the plain server
    `base` (6 prompts x 32 greedy tokens, top 5, one request at a time from a flushed cache):
    returns (tokens compared, the worst (prompt, index, logprob, plain's), the tolerance)."""
    agreed, control, pairs = 0, 0.0, []
    for prompt in harness.PROMPTS[:6]:
        payload = {
            "text": prompt,
            "return_logprob": True,
            "top_logprobs_num": 5,
            "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True},
        }
        outs = []
        for s in (server, base):
            _flush(s)
            status, out = harness.post(s.url + "/generate", payload)
            assert status == 200, out
            outs.append(out)
        got, want = outs
        ids, meta, w_meta = got["output_ids"], got["meta_info"], want["meta_info"]
        lp, top = meta["output_token_logprobs"], meta["output_top_logprobs"]
        assert len(lp) == len(ids) == 32 and len(top) == 32, (len(lp), len(ids), len(top))
        # the control: plain's decode logprobs against its own prefill (teacher forcing)
        prompt_ids = base.tokenize(prompt)
        forced = _next_token_logprobs(base, prompt_ids + want["output_ids"], len(prompt_ids))
        forced_lp = [x[0] for x in forced["input_token_logprobs"][1:]]
        control = max(
            control,
            max(
                abs(a[0] - b)
                for a, b in zip(w_meta["output_token_logprobs"], forced_lp, strict=True)
            ),
        )
        at = harness.first_divergence(ids, want["output_ids"])
        at = len(ids) if at is None else at
        w_top = w_meta["output_top_logprobs"]
        for i in range(len(ids)):
            _assert_greedy_logprob(ids[i], lp[i], top[i], (prompt, i))
        for i in range(at):
            pairs.append((prompt, i, lp[i][0], w_meta["output_token_logprobs"][i][0]))
            fifth = w_top[i][-1][0]
            clear = {t[1] for t in w_top[i] if t[0] > fifth + TIE_TOL}
            assert clear <= {t[1] for t in top[i]}, (prompt, i, top[i], w_top[i])
        agreed += at
    assert agreed >= 32, agreed  # enough agreeing tokens that the comparison means something
    assert control <= CONTROL_MAX, f"plain's decode and prefill logprobs differ by {control}"
    tol = max(TIE_TOL, 2 * control)
    worst = max(pairs, key=lambda r: abs(r[2] - r[3]))
    assert abs(worst[2] - worst[3]) <= tol, (worst, tol)
    return agreed, worst, tol


def _stream(url: str, payload: dict) -> list[dict]:
    """The JSON chunks of an OpenAI streaming response (server-sent events)."""
    import json
    import urllib.request

    req = urllib.request.Request(
        url,
        data=json.dumps({**payload, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    chunks = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                chunks.append(json.loads(line[5:]))
    return chunks


@pytest.mark.parametrize("model", MODELS)
def test_prompt_completion_and_streamed_logprobs_are_served(servers, model):
    """Logprobs, the other ways to ask: prompt logprobs (logprob_start_len 0)
    equal the plain server's (both are SGLang's own prefill of the target), /v1/completions
    with logprobs has one entry per completion token, and a streamed chat's chunks carry one
    logprob entry per token, each the chosen token's at the best of its top_logprobs."""
    server, base = _up(servers, f"{model}-ddtree"), _up(servers, f"{model}-base")
    for prompt in harness.PROMPTS[:3]:
        got = []
        for s in (server, base):
            _flush(s)
            status, out = harness.post(
                s.url + "/generate",
                {
                    "text": prompt,
                    "return_logprob": True,
                    "logprob_start_len": 0,
                    "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                },
            )
            assert status == 200, out
            got.append([x[0] for x in out["meta_info"]["input_token_logprobs"][1:]])
        assert len(got[0]) == len(got[1]) > 0
        gap = max(abs(a - b) for a, b in zip(*got, strict=True))
        assert gap <= TIE_TOL, (prompt, gap)
    # token_ids_logprob: the asked tokens' logprobs at every emitted position, as plain's where
    # the two servers' tokens agree
    asked = []
    for s in (server, base):
        _flush(s)
        status, out = harness.post(
            s.url + "/generate",
            {
                "text": harness.PROMPTS[0],
                "return_logprob": True,
                "token_ids_logprob": [5, 17],
                "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
            },
        )
        assert status == 200, out
        asked.append((out["output_ids"], out["meta_info"]["output_token_ids_logprobs"]))
        prompt_tokens = out["meta_info"]["prompt_tokens"]
    (ids, per_token), (plain_ids, plain_per_token) = asked
    assert len(per_token) == len(ids) == 8 and all(len(e) == 2 for e in per_token), per_token
    agree = harness.first_divergence(ids, plain_ids)
    agree = len(ids) if agree is None else agree
    # the control: plain's decode values against its own prefill of the same tokens (the asked
    # tokens sit far in the tail, where bf16 moves a logprob by more than near the top)
    prompt_ids = base.tokenize(harness.PROMPTS[0])
    assert len(prompt_ids) == prompt_tokens, (len(prompt_ids), prompt_tokens)  # aligned
    assert agree >= 1, (ids, plain_ids)
    _flush(base)
    status, forced = harness.post(
        base.url + "/generate",
        {
            "input_ids": prompt_ids + plain_ids,
            "return_logprob": True,
            "token_ids_logprob": [5, 17],
            "logprob_start_len": len(prompt_ids) - 1,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        },
    )
    assert status == 200, forced
    # entry k + 1: the asked tokens in the distribution that chose plain's k-th token (entry 0
    # is the prompt's last position, as for input_token_logprobs)
    teacher = forced["meta_info"]["input_token_ids_logprobs"][1 : len(plain_ids) + 1]
    control = max(
        abs(a[0] - b[0])
        for d, f in zip(plain_per_token, teacher, strict=True)
        for a, b in zip(d, f, strict=True)
    )
    assert control <= CONTROL_MAX, (
        f"plain's decode and prefill token_ids logprobs differ by {control}"
    )
    tol = max(TIE_TOL, 2 * control)
    gaps = [
        abs(a[0] - b[0])
        for mine, theirs in zip(per_token[:agree], plain_per_token[:agree], strict=True)
        for a, b in zip(mine, theirs, strict=True)
    ]
    print(
        f"{model} token_ids_logprob: worst gap {max(gaps, default=0):.3f} over {agree} tokens, "
        f"plain's decode against its prefill {control:.3f}"
    )
    assert max(gaps, default=0) <= tol, (gaps, tol, per_token[:agree], plain_per_token[:agree])
    status, out = harness.post(
        server.url + "/v1/completions",
        {
            "model": "x",
            "prompt": harness.PROMPTS[1],
            "max_tokens": 12,
            "temperature": 0,
            "logprobs": 3,
            "ignore_eos": True,
        },
    )
    assert status == 200, out
    lp = out["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == out["usage"]["completion_tokens"] == 12, lp
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"]), lp
    chunks = _stream(
        server.url + "/v1/chat/completions",
        {
            "model": "x",
            "messages": [{"role": "user", "content": harness.PROMPTS[2]}],
            "max_tokens": 16,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
    )
    entries = [
        c
        for ch in chunks
        for choice in ch.get("choices", [])
        for c in ((choice.get("logprobs") or {}).get("content") or [])
    ]
    usage = next(ch["usage"] for ch in reversed(chunks) if ch.get("usage"))
    assert len(entries) == usage["completion_tokens"] == 16, (len(entries), usage)
    for c in entries:
        assert abs(max(t["logprob"] for t in c["top_logprobs"]) - c["logprob"]) < 1e-5, c


@pytest.mark.parametrize("model", MODELS)
def test_automatic_widths_are_measured_and_chosen(servers, model):
    """The default server (SGLANG_DDTREE_WIDTH=auto): after 100 rounds or more (4 prompts alone,
    then 8 at once) its log holds the policy's table, with a measured round cost for every
    width it captured and every width chosen at least once (the calibration runs each one)."""
    import re

    server = _up(servers, f"{model}-ddtree")
    kw = {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True}
    for prompt in harness.PROMPTS[:4]:
        harness.generate(server, prompt, **kw)
    harness.run_all(lambda p: harness.generate(server, p, **kw), harness.PROMPTS[:8], 8)
    log = server.log_text()
    found = re.search(r"DDTREE verify width: auto among ([0-9, ]+) \(", log)
    assert found, "no automatic-width start-up line"
    widths = [int(w) for w in found.group(1).split(", ")]
    assert len(widths) >= 2 and "DDTREE widths after " in log, widths
    table = log.split("DDTREE widths after ")[-1].splitlines()[1:]
    header = [int(w) for w in table[0].split()[1:]]
    assert header == widths, table[0]
    rows = [line.split()[1:] for line in table[1:] if line[:1].isdigit()]
    assert rows, table
    for j, width in enumerate(widths):
        assert any(row[j] != "-" for row in rows), f"width {width} never measured: {table}"
    chosen = next(line for line in table if line.startswith("widths chosen:"))
    for width in widths:
        assert f"{width} x " in chosen, chosen
    print(f"{model}: " + "\n".join(table[: len(rows) + 3]))


@pytest.mark.parametrize("model", MODELS)
def test_sglang_and_reference_engine_agree_round_for_round(servers, fp32_pair, model):
    """The transformers reference engine (float32) and SGLang's DDTREE (bf16) on the same
    checkpoints, 8 prompts x 48 tokens. Where their tokens agree, the binary pairs (whose draft
    ties its two tokens exactly, so the tree is the complete binary tree in both precisions)
    must also agree round for round. Where they part, SGLang's token must be a float32
    near-tie there (within TIE_TOL of the float32 argmax, teacher-forced on SGLang's own
    prefix), or SGLang's own DFLASH on the same checkpoints must make the same choice at the
    same place (then SGLang's bf16 verify numerics, not DDTREE, parted from float32). Reports
    how many prompts agree. The server's width is fixed at N (`ddtree_fixed`): the reference
    verifies every round at N, and automatic widths change how many rounds a text takes."""
    from sglang_ddtree.reference.engine import generate

    server = _up(servers, f"{model}-ddtree_fixed")
    dflash = servers.get(f"{model}-dflash")
    target, drafter, tok = fp32_pair(model)
    nodes, topk = tree_shape(model)
    n, prompts, same, rounds_equal, parted = 48, harness.PROMPTS[:8], 0, 0, []
    kw = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    for prompt in prompts:
        ids = tok(prompt)["input_ids"]
        _flush(server)
        out = harness.generate(server, prompt, **kw)
        ref = generate(target, drafter, torch.tensor(ids), n, budget=nodes - 1, topk=topk)
        tokens = out["output_ids"]
        at = harness.first_divergence(tokens, list(ref.tokens))
        if at is None:
            same += 1
            if out["meta_info"]["spec_verify_ct"] == ref.rounds:
                rounds_equal += 1
            elif model != "pair":
                pytest.fail(
                    f"{prompt!r}: SGLang {out['meta_info']['spec_verify_ct']} rounds, "
                    f"reference {ref.rounds} ({ref.accept_lengths})"
                )
            continue
        fp32 = harness.fp32_deficit(target, ids, tokens, at)
        shared = None
        if fp32 > TIE_TOL and dflash is not None:
            _flush(_up(servers, dflash.name))
            shared = (
                harness.generate(dflash, prompt, **kw)["output_ids"][: at + 1] == tokens[: at + 1]
            )
        parted.append((prompt, at, round(fp32, 3), shared))
    print(
        f"{model}: identical on {same}/{len(prompts)} prompts, rounds equal on "
        f"{rounds_equal}; parted (prompt, index, float32 deficit of SGLang's token, DFLASH "
        f"made the same choice): {parted}"
    )
    assert all(d <= TIE_TOL or shared for _p, _i, d, shared in parted), parted


LONG_NEW = 64  # new tokens after a prompt at the context limit


def _long_prompt_ids(base, count: int, context: int = 2048) -> list[list[int]]:
    """`count` prompts of context - LONG_NEW - 8 tokens: the suite's prompts, each followed by
    the others in turn until the length is reached (the servers' --context-length is 2048)."""
    ids = [base.tokenize(p) for p in harness.PROMPTS]
    out = []
    for i in range(count):
        row = []
        for k in range(len(ids) * 64):
            row += ids[(i + k) % len(ids)]
            if len(row) >= context - LONG_NEW - 8:
                break
        out.append(row[: context - LONG_NEW - 8])
    return out


TRACK_INTERVAL = 256  # SGLang's --mamba-track-interval default (the servers keep it)


@pytest.mark.parametrize("model", [m for m in MODELS if m != "qwen3"])  # the hybrid models
def test_a_prefix_hit_on_states_left_by_tree_rounds_is_the_targets_greedy(
    servers, plain_greedy, fp32_pair, model
):
    """The prefix cache's Mamba states that DDTREE's rounds leave (the commit's tracking step
    and buffers, accept_path.py: one gather for a batch of one; and the state a request ends
    with) are the target's: a request that continues another's whole greedy text, which ran
    past a tracking interval, hits the cache beyond its prompt, so its prefill starts from a
    state tree rounds wrote, and its greedy tokens are the target's (teacher forced on the
    plain server, the near-tie referee beyond tolerance). A wrong state would put its tokens
    nats off the target's argmax."""
    base = _up(servers, f"{model}-base")
    spec = _up(servers, f"{model}-ddtree")
    _flush(spec)
    prompt = base.tokenize(harness.PROMPTS[0])
    assert len(prompt) < TRACK_INTERVAL
    first = harness.generate(
        spec, harness.PROMPTS[0], max_new_tokens=TRACK_INTERVAL + 64, temperature=0, ignore_eos=True
    )
    prefix = prompt + first["output_ids"]
    status, out = harness.post(
        spec.url + "/generate",
        {
            "input_ids": prefix,
            "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True},
        },
    )
    assert status == 200, out
    cached = out["meta_info"].get("cached_tokens", 0)
    print(f"{model}: prompt {len(prompt)}, prefix {len(prefix)}, cached {cached}")
    assert cached > len(prompt), "no hit past the prompt: the test reads no state of a round"
    tokens = out["output_ids"]
    deficits = _token_deficits(base, prefix, tokens)
    _, plain_deficits = plain_greedy(model)
    tol = max(TIE_TOL, max(plain_deficits))
    print(f"{model}: max deficit {max(deficits):.3f} over {len(tokens)} tokens, tol {tol:.3f}")
    beyond = [
        (0, *r)
        for r in harness.beyond_tol_referee(fp32_pair(model)[0], prefix, tokens, deficits, tol)
    ]
    verdicts = [harness.referee_verdict(row, TIE_TOL, bound=2 * tol) for row in beyond]
    assert None not in verdicts, beyond
    assert verdicts.count("unresolved") <= 1, beyond


@pytest.mark.parametrize("model", MODELS)
def test_prompts_at_the_context_limit_are_the_targets_greedy(servers, fp32_pair, model):
    """Long prompts on the small models: prompts 8 tokens short of the context limit once
    LONG_NEW tokens are added, 4 at once, on the default DDTREE server: served, and every token
    the target's own greedy choice up to the near-tie referee (the plain server's own greedy on
    the same prompts is the control)."""
    base = _up(servers, f"{model}-base")
    spec_server = _up(servers, f"{model}-ddtree")
    prompts = _long_prompt_ids(base, 4)

    def greedy(server):
        def one(ids):
            status, out = harness.post(
                server.url + "/generate",
                {
                    "input_ids": ids,
                    "sampling_params": {
                        "max_new_tokens": LONG_NEW,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                },
            )
            assert status == 200, out
            return out["output_ids"]

        return harness.run_all(one, prompts, len(prompts))

    def deficits(tokens_per_prompt):
        return [
            d
            for ids, tokens in zip(prompts, tokens_per_prompt, strict=True)
            for d in _token_deficits(base, ids, tokens)
        ]

    plain, spec = greedy(base), greedy(spec_server)
    assert all(len(t) == LONG_NEW for t in spec)
    # the rounds near the limit leave no KV slot behind: SGLang's idle check (the suite's
    # SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1) stops the server on a leak
    time.sleep(3)
    assert spec_server.is_healthy(), spec_server.log_text()[-3000:]
    assert "memory leak" not in spec_server.log_text()
    control = max(deficits(plain))
    tol = max(TIE_TOL, control)
    found = deficits(spec)
    beyond = _beyond_tol_refereed(base, fp32_pair(model)[0], spec, found, tol, prompts)
    verdicts = [harness.referee_verdict(row, TIE_TOL, bound=2 * tol) for row in beyond]
    same = sum(a == b for a, b in zip(spec, plain, strict=True))
    print(
        f"{model} long prompts ({len(prompts[0])} tokens): identical to plain {same}/"
        f"{len(spec)}; max deficit {max(found):.3f}, plain's {control:.3f}; "
        f"beyond tol {beyond}, referee {verdicts}"
    )
    assert None not in verdicts and verdicts.count("unresolved") <= 1, beyond


@pytest.mark.skipif("pair" not in MODELS, reason="runs with the pair's tests (one start-up)")
def test_a_configuration_that_does_not_fit_is_refused_before_any_graph(tmp_path):
    """DDTREE on the shipped pair asked for far more Mamba state slots than its
    memory fraction holds stops during start-up, before any CUDA graph is captured, with the
    memory in numbers and the flags that fix it (gdn_pool.size_mamba_pool), not with an OOM."""
    from tests.gpu.servers import COMMON, DEMO, ENV, ddtree_args

    args = list(COMMON)
    args[args.index("--max-mamba-cache-size") + 1] = "1000000"
    args[args.index("--mem-fraction-static") + 1] = "0.05"
    server = harness.Server(
        "pair-oversized",
        str(DEMO / "target"),
        harness.free_port(34500),
        [*args, *ddtree_args("pair", DEMO / "draft")],
        ENV,
        log_dir=tmp_path,
    )
    server.start()
    try:
        server.proc.wait(timeout=600)
    finally:
        server.stop()
    import re

    log = server.log_text()
    refusal = next(
        (line for line in log.splitlines() if "DDTREE: not enough GPU memory" in line), None
    )
    assert refusal is not None, log[-3000:]
    for flag in ("--max-mamba-cache-size", "--mem-fraction-static", "--max-running-requests"):
        assert flag in refusal, refusal
    # SGLang logs "Capture target verify CUDA graph begin." (and the draft's) at capture
    assert not re.search(r"(?i)capture[^\n]*cuda graph", log), log[-3000:]
    assert "out of memory" not in log.lower(), log[-3000:]


# Per-request options as a new user meets them: the OpenAI Python SDK (openai 2.x) against the default DDTREE
# server, logprobs, penalties and min_p on (their defaults), and a JSON schema.
@pytest.mark.parametrize("model", MODELS)
def test_the_openai_sdk_gets_logprobs_penalties_and_json_schemas(servers, model):
    """Through `openai.OpenAI(...).chat.completions.create`, on the default `ddtree` server
    against the plain one at T=0: logprobs with top_logprobs=3 give one entry per token, each
    greedy token the best of its list, and where the two servers' tokens agree, their logprobs
    differ by at most 2 x CONTROL_MAX (test_logprobs_are_the_plain_servers holds the tight,
    control-based bound); frequency / presence penalties and min_p (T > 0, seeded) are served;
    a json_schema response format parses and fits the schema; streamed with logprobs, every
    chunk's token has its entry. Exactness of the penalties and min_p is
    test_penalties_are_exact_inside_the_tree's and the chi-square's."""
    openai = pytest.importorskip("openai")
    server, base = _up(servers, f"{model}-ddtree"), _up(servers, f"{model}-base")
    clients = [
        openai.OpenAI(base_url=s.url + "/v1", api_key="none", timeout=600, max_retries=0)
        for s in (server, base)
    ]
    msg = [{"role": "user", "content": harness.PROMPTS[0]}]
    greedy = dict(
        model="default", messages=msg, temperature=0, max_tokens=24, extra_body={"ignore_eos": True}
    )
    entries = []
    for s, client in zip((server, base), clients, strict=True):
        _flush(s)
        out = client.chat.completions.create(**greedy, logprobs=True, top_logprobs=3)
        content = out.choices[0].logprobs.content
        assert len(content) == out.usage.completion_tokens == 24, (s.name, len(content))
        for c in content:
            assert 1 <= len(c.top_logprobs) <= 3, (s.name, c)
            assert abs(max(t.logprob for t in c.top_logprobs) - c.logprob) < 1e-5, (s.name, c)
        entries.append(content)
    ours, plain = entries
    agree = next(
        (i for i, (a, b) in enumerate(zip(ours, plain, strict=False)) if a.token != b.token), 24
    )
    gaps = [abs(a.logprob - b.logprob) for a, b in zip(ours[:agree], plain[:agree], strict=False)]
    assert agree >= 1 and max(gaps) <= 2 * CONTROL_MAX, (agree, gaps)
    client = clients[0]
    out = client.chat.completions.create(**greedy, frequency_penalty=0.5, presence_penalty=0.3)
    assert out.usage.completion_tokens == 24 and out.choices[0].message.content, out
    out = client.chat.completions.create(
        model="default",
        messages=msg,
        temperature=0.8,
        seed=7,
        max_tokens=16,
        extra_body={"min_p": 0.05, "repetition_penalty": 1.2},
    )
    assert out.usage.completion_tokens >= 1, out
    schema, fits = GRAMMARS["json_schema"]
    out = client.chat.completions.create(
        model="default",
        messages=msg,
        temperature=0,
        max_tokens=GRAMMAR_TOKENS,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "item", "schema": json.loads(schema)},
        },
    )
    assert fits(out.choices[0].message.content), out.choices[0].message.content
    streamed, tokens = 0, 0
    for chunk in client.chat.completions.create(
        **greedy, logprobs=True, top_logprobs=2, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += len(chunk.choices[0].logprobs.content or [])
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    assert streamed == 24 and tokens in (0, 24), (streamed, tokens)
    print(f"{model}: SDK logprobs agree on {agree} tokens, worst gap {max(gaps):.3f}")


def _image_data_url(seed: int, side: int = 96) -> str:
    """A side x side RGB PNG of seeded noise, as a data URL."""
    import base64
    import io

    import numpy as np

    image = pytest.importorskip("PIL.Image")
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


# Last in this file: a server an image request broke would take no other test with it.
@pytest.mark.parametrize("model", [m for m in MODELS if m != "qwen3"])  # the image models
def test_an_image_request_is_the_targets_greedy_up_to_a_near_tie(servers, model):
    """Qwen3.5 / 3.6 are image models, and a chat request with an image reaches the tree verify
    with SGLang's multimodal (mrope) positions. On the fixed-width DDTREE server and the plain
    one, greedy, from a flushed cache: the same tokens up to the first divergence, and there
    DDTREE's token within the greedy test's tolerance of the plain server's best, by the plain
    server's own log-probs; both emit every token asked for, and DDTREE serves on."""
    server, base = _up(servers, f"{model}-ddtree_fixed"), _up(servers, f"{model}-base")
    tol = max(TIE_TOL, 2 * CONTROL_MAX)
    agreed = []
    for i, prompt in enumerate(harness.PROMPTS[:4]):
        content = [
            {"type": "image_url", "image_url": {"url": _image_data_url(i)}},
            {"type": "text", "text": prompt},
        ]
        body = {
            "model": "x",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 32,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 5,
        }
        answers = []
        for s in (server, base):
            _flush(s)
            status, out = harness.post(s.url + "/v1/chat/completions", body)
            assert status == 200, (s.name, out)
            assert out["usage"]["completion_tokens"] == 32, (s.name, out["usage"])
            answers.append(out["choices"][0]["logprobs"]["content"])
        ours, plain = answers
        k = next(
            (
                j
                for j, (a, b) in enumerate(zip(ours, plain, strict=True))
                if a["token"] != b["token"]
            ),
            len(ours),
        )
        agreed.append(k)
        if k < len(ours):  # a divergence must be a near-tie of the target's own
            alternatives = {t["token"]: t["logprob"] for t in plain[k]["top_logprobs"]}
            gap = plain[k]["logprob"] - alternatives.get(ours[k]["token"], float("-inf"))
            assert gap <= tol, (prompt, k, ours[k]["token"], plain[k]["token"], gap)
    print(f"{model}: image requests agree with plain on {agreed} of 32 tokens")
    assert (
        harness.generate(server, "def f(x):", max_new_tokens=4, temperature=0, ignore_eos=True)[
            "meta_info"
        ]["completion_tokens"]
        == 4
    )

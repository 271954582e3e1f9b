"""One request never takes a DDTREE server down, on the GPU, on the shipped pair (hybrid Qwen3.5
target with Gated DeltaNet layers and its DFlash draft), with servers started here:

- `ddtree`: DDTREE with default options (and SGLang's --enable-custom-logit-processor, so that
  DDTREE's own refusal of a processor is what answers);
- `base`: plain decoding without the overlap scheduler (exact penalty counts, the per-node
  penalties' control; also the processor's control and the teacher-forcing server of the
  near-tie referee);
- `pressure`: DDTREE with a KV pool smaller than its running set and a small Mamba state pool,
  so that SGLang retracts and re-admits requests and evicts radix-cache prefixes with their
  Mamba states.

The tests: the fuzz corpus (scripts/fuzz_requests.py: every per-request limit's class on chat
and /generate, streamed and not) beside good requests, every malformed case a 4xx, the server
serving on and a fixed greedy probe unchanged; a custom logit processor refused by DDTREE (the
plain server applies it); retraction, each request's tokens the target's greedy (penalised ones
in their own penalised distribution) under the suite's float32 referee; eviction and re-hits of
prefixes with hybrid state, greedy still the target's.

    python -m pytest tests/gpu/test_limits.py -m gpu -q -rA -s      (logs under $OUT if set)
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("sglang")
if "pair" not in os.environ.get("DDTREE_GPU_MODELS", "pair").split(","):
    # one pytest per model runs the suite (scripts/gpu_session.sh): these run in the pair's
    pytest.skip(
        "the pair's limits servers are tested by the pair's process", allow_module_level=True
    )

from tests.fixtures import load_script  # noqa: E402
from tests.gpu import harness  # noqa: E402
from tests.gpu.servers import COMMON, DEMO, ENV, ddtree_args  # noqa: E402
from tests.gpu.test_serve import (  # noqa: E402
    TIE_TOL,
    _flush,
    _penalised_deficits,
    _token_deficits,
)

pytestmark = pytest.mark.gpu

CONTEXT = 2048  # the suite's --context-length
PROCESSOR = ["--enable-custom-logit-processor"]
# a KV pool of 3,072 tokens against 16 running requests of ~60 + 384 tokens (~7,100): decode runs
# out and SGLang retracts; 96 Mamba state slots: SGLang 0.5.23 caps the running requests at one
# per 5 slots with the radix cache on (80 for 16), which leaves the radix cache few states to keep
# --schedule-conservativeness 0.1: SGLang 0.5.23 admits a request only while the pool holds 0.7 x
# its max_new_tokens beside the running ones, so without it 16 requests of 384 tokens never
# outgrow 3072 slots and nothing is retracted (seen on the GPU); at 0.1 it admits on 7% and
# retracts once they grow
PRESSURE = {
    "--max-total-tokens": "3072",
    "--max-mamba-cache-size": "96",
    "--schedule-conservativeness": "0.1",
}
RETRACT_NEW, RETRACT_REQUESTS = 384, 16
RETRACTED = "KV cache pool is full. Retract requests."  # SGLang's log line


def _flags(overrides: dict[str, str]) -> list[str]:
    args = list(COMMON)
    for flag, value in overrides.items():
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return args


@pytest.fixture(scope="module")
def servers():
    out = Path(os.environ.get("OUT", tempfile.mkdtemp(prefix="ddtree-limits-"))) / "limits_logs"
    out.mkdir(parents=True, exist_ok=True)
    ddtree = ddtree_args("pair", DEMO / "draft")
    flags = {
        "ddtree": [*COMMON, *ddtree, *PROCESSOR],
        "base": [*COMMON, "--disable-overlap-schedule", *PROCESSOR],
        "pressure": [*_flags(PRESSURE), *ddtree],
    }
    started = {
        name: harness.Server(
            f"limits-{name}",
            str(DEMO / "target"),
            harness.free_port(36000 + 100 * i),
            args,
            ENV,
            log_dir=out,
        )
        for i, (name, args) in enumerate(flags.items())
    }
    try:
        for server in started.values():
            server.start_once_more_on_exit("Memory pool end", timeout=600)
        for server in started.values():
            server.wait_healthy(timeout=600)
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def target():
    """The reference engine's float32 target on the CPU: the referee."""
    from sglang_ddtree.reference.engine import load_pair

    return load_pair(str(DEMO / "target"), str(DEMO / "draft"))[0]


def _alive(server) -> None:
    assert server.is_healthy(), server.log_text()[-3000:]
    assert "Traceback" not in server.log_text(), server.log_text()[-3000:]


def test_the_fuzz_gets_a_4xx_for_every_malformed_case_and_the_server_serves_on(servers):
    """scripts/fuzz_requests.py against the default DDTREE server, good greedy requests beside
    it: every malformed case (every per-request limit's class on chat and /generate, streamed
    and not) a 4xx with a message, the server alive, a fixed greedy probe's text unchanged, and
    no Traceback in its log."""
    fuzz = load_script("fuzz_requests")
    server = servers["ddtree"]
    report = fuzz.run(server.url, rounds=2, context=CONTEXT, seed=0)
    print(
        json.dumps(
            {
                k: report[k]
                for k in (
                    "cases",
                    "ignored_with_200",
                    "good_text_unchanged",
                    "probe_unchanged",
                    "alive_after",
                )
            }
        )
    )
    assert report["bad"] == [], report["bad"][:10]
    assert report["alive_after"] and report["probe_unchanged"], report
    _alive(server)


def _processor_request(tokens_to_ban: list[int]) -> dict:
    from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor

    return {
        "text": harness.PROMPTS[0],
        "custom_logit_processor": DisallowedTokensLogitsProcessor.to_str(),
        "sampling_params": {
            "max_new_tokens": 32,
            "temperature": 0,
            "custom_params": {"token_ids": tokens_to_ban},
        },
    }


def test_a_custom_logit_processor_is_refused_by_name_and_the_plain_server_applies_it(servers):
    """DDTREE would apply a processor to the first token only (SGLang's tree verify never calls
    it): a 400 naming it on /generate and chat, streamed or not; the plain server, the control,
    serves the same processor (its greedy text then holds none of the banned tokens)."""
    fuzz = load_script("fuzz_requests")
    base, ddtree = servers["base"], servers["ddtree"]
    plain = harness.generate(base, harness.PROMPTS[0], max_new_tokens=32, temperature=0)
    banned = sorted(set(plain["output_ids"][:4]))
    status, out = harness.post(base.url + "/generate", _processor_request(banned))
    assert status == 200 and not set(out["output_ids"]) & set(banned), out
    body = _processor_request(banned)
    chat = {
        "model": "x",
        "messages": [{"role": "user", "content": harness.PROMPTS[0]}],
        "max_tokens": 8,
        "custom_logit_processor": body["custom_logit_processor"],
        "custom_params": {"token_ids": banned},
    }
    for path, payload in (("/generate", body), ("/v1/chat/completions", chat)):
        for stream in (False, True):
            raw = json.dumps({**payload, "stream": stream}).encode()
            status, text = fuzz.post(ddtree.url + path, raw)
            verdict = fuzz.judge(status, text, False, fuzz.is_streamed(path, raw))
            assert verdict == "ok" and "custom_logit_processor" in text, (path, stream, text)
    _alive(ddtree)


def _retraction_requests(base) -> list[tuple[list[int], dict]]:
    """RETRACT_REQUESTS greedy requests of RETRACT_NEW tokens (EOS ignored): the suite's prompts,
    every other one with penalties (frequency + presence, repetition), whose counts must survive a
    retraction."""
    settings = [
        {},
        {"frequency_penalty": 0.6, "presence_penalty": 0.4},
        {},
        {"repetition_penalty": 1.3},
    ]
    return [
        (base.tokenize(harness.PROMPTS[i]), settings[i % len(settings)])
        for i in range(RETRACT_REQUESTS)
    ]


def _greedy(server, ids: list[int], setting: dict, new: int) -> list[int]:
    status, out = harness.post(
        server.url + "/generate",
        {
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": new,
                "temperature": 0,
                "ignore_eos": True,
                **setting,
            },
        },
    )
    assert status == 200, out
    return out["output_ids"]


def test_retracted_requests_keep_their_state_and_penalty_counts(servers, target):
    """A KV pool smaller than the running set: SGLang retracts requests (its log says so) and
    re-admits them, prefilling their prompt and output again; DDTREE's per-request state (the
    draft context, the Mamba states, the penalty counts rebuilt from the output at that
    prefill) must come back exactly. Every token is the target's greedy: unpenalised requests
    under the suite's near-tie referee (bf16 teacher forcing on the plain server, float32 for
    the tokens beyond tolerance), penalised ones within the float32 tolerance the plain server
    (exact counts) shows on the same requests."""
    base, pressure = servers["base"], servers["pressure"]
    requests = _retraction_requests(base)
    start = pressure.log_path.stat().st_size
    served = harness.run_all(
        lambda r: _greedy(pressure, r[0], r[1], RETRACT_NEW), requests, len(requests)
    )
    log = pressure.log_path.read_text(errors="replace")[start:]
    retractions = log.count(RETRACTED)
    print(f"retractions logged: {retractions}")
    assert retractions > 0, "no retraction happened: the pool holds the running set"
    assert all(len(t) == RETRACT_NEW for t in served)
    control = [_greedy(base, ids, s, RETRACT_NEW) for ids, s in requests]
    _assert_targets_greedy(base, target, requests, served, control)
    _alive(pressure)


def _assert_targets_greedy(base, target, requests, served, control) -> None:
    """Penalised requests: the worst float32 deficit in the penalised distribution within
    max(TIE_TOL, twice the control's); the others: bf16 deficits on the plain server, and the
    float32 referee for the tokens beyond max(TIE_TOL, the control's worst bf16 deficit), as
    the suite's greedy tests judge them."""
    worst, plain_worst, beyond, verdicts = 0.0, 0.0, [], []
    stops = set()  # EOS is ignored: nothing is blocked
    for (ids, setting), tokens, ctrl in zip(requests, served, control, strict=True):
        if setting:
            worst = max(worst, max(_penalised_deficits(target, ids, tokens, setting, stops)))
            plain_worst = max(
                plain_worst, max(_penalised_deficits(target, ids, ctrl, setting, stops))
            )
            continue
        tol = max(TIE_TOL, max(_token_deficits(base, ids, ctrl)))
        rows = harness.beyond_tol_referee(
            target, ids, tokens, _token_deficits(base, ids, tokens), tol
        )
        beyond += rows
        verdicts += [harness.referee_verdict(row, TIE_TOL, bound=2 * tol) for row in rows]
    tol = max(TIE_TOL, 2 * plain_worst)
    print(
        f"penalised: worst float32 deficit {worst:.3f} (control {plain_worst:.3f}, tolerance "
        f"{tol:.3f}); greedy beyond tolerance {beyond}, referee {verdicts}"
    )
    assert worst <= tol
    assert None not in verdicts and verdicts.count("unresolved") <= 1, beyond


def _long_prefix(base, i: int, length: int = 600) -> list[int]:
    """A prompt of `length` tokens: the suite's prompts from the i-th on, in turn."""
    ids = [base.tokenize(p) for p in harness.PROMPTS]
    row, k = [], i
    while len(row) < length:
        row += ids[k % len(ids)]
        k += 1
    return row[:length]


TRACK_INTERVAL = 256  # SGLang's --mamba-track-interval default (these servers keep it)


def test_evicted_and_rehit_prefixes_with_hybrid_state_stay_the_targets_greedy(servers, target):
    """The radix cache under memory pressure on the hybrid pair: each prefix is served past a
    Mamba tracking interval (so tree rounds write the cached state) and sent again at once (a
    hit); other requests then push the prefixes out; sent again, some are evicted (fewer cached
    tokens than right after caching) and the last one served is hit again; every greedy
    continuation is the target's under the suite's near-tie referee."""
    base, pressure = servers["base"], servers["pressure"]
    _flush(pressure)
    prefixes, cached_then = [], []
    for i in range(4):  # 4 x 1,024 tokens: more than the 3,072-token pool keeps
        prompt = _long_prefix(base, i)
        tokens, _ = _served(pressure, prompt, 2 * TRACK_INTERVAL - len(prompt) % TRACK_INTERVAL)
        prefixes.append(prompt + tokens)  # decoded past a tracking interval
        cached_then.append(_served(pressure, prefixes[-1], 16)[1])
    others = [_long_prefix(base, 17 + i, 400) for i in range(16)]
    harness.run_all(lambda ids: _served(pressure, ids, 64), others, 16)  # the pressure
    again = [_served(pressure, ids, 48) for ids in prefixes]
    cached_now = [cached for _, cached in again]
    print(f"cached tokens right after caching {cached_then}, after the pressure {cached_now}")
    assert min(cached_then) > 0, "the prefixes were never cached: the test reads no cached state"
    assert any(now < then for now, then in zip(cached_now, cached_then, strict=True)), (
        "nothing was evicted: the pool holds every prefix"
    )
    last = prefixes[-1] + again[-1][0]
    rehit = _served(pressure, last, 32)  # just served: a hit on what it left
    assert rehit[1] > len(prefixes[-1]) // 2, rehit[1]
    requests = [(ids, {}) for ids in prefixes] + [(last, {})]
    served = [tokens for tokens, _ in again] + [rehit[0]]
    control = [
        _greedy(base, ids, {}, len(tokens))
        for (ids, _), tokens in zip(requests, served, strict=True)
    ]
    _assert_targets_greedy(base, target, requests, served, control)
    _alive(pressure)


def _served(server, ids: list[int], new: int) -> tuple[list[int], int]:
    """(greedy tokens, cached prompt tokens) of one request."""
    status, out = harness.post(
        server.url + "/generate",
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
        },
    )
    assert status == 200, out
    return out["output_ids"], int(out["meta_info"].get("cached_tokens", 0))


def test_the_pressure_servers_pools_come_back_to_idle(servers):
    """After the retraction and eviction tests: the KV pool idle (SGLang's idle check, the suite's
    SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE, would have stopped the server on a leak)."""
    pressure = servers["pressure"]
    time.sleep(3)
    status, loads = harness.get(pressure.url + "/v1/loads")
    assert status == 200, loads
    per_rank = loads.get("loads", []) if isinstance(loads, dict) else loads
    assert sum(r.get("num_used_tokens", 0) for r in per_rank) == 0, loads
    _alive(pressure)
    assert "memory leak" not in pressure.log_text().lower()

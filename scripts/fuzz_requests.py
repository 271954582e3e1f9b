"""Bad requests, fuzzed: a seeded, bounded corpus of malformed requests sent to
a running server while good greedy requests run beside them.

    python scripts/fuzz_requests.py http://127.0.0.1:31010 [--rounds 3] [--context 2048] \
        [--out fuzz.json]

Every malformed request must get a 4xx with a message (a streamed /generate: SGLang answers 200
and sends the 4xx as the stream's first event; a few, such as unknown top-level fields, may also
be ignored with a 200: OpenAI-compatible servers differ there, and the report says which); none
may get a 5xx or break the connection. The corpus holds every class of the per-request limits
(docs/requests.md) on chat and /generate, streamed and not, bodies SGLang reads untyped (Vertex),
request ids of every shape (a list for one prompt, empty, long, unprintable, the health check's
prefix, the start of SGLang's own ids, duplicates and prefixes inside a batch) and per-prompt
fields of a batch whose lists do not match its prompts. Then a streamed request is held in flight
while requests with its id, an id it begins and its id's start are sent (each a 4xx: SGLang
aborts by prefix), and, on a DDTREE server (its /server_info says so), every admin endpoint must
be a 401 or 403 (a server started without --admin-api-key; what a served one changed is undone
after). /health is probed every second throughout: every answer a 200 within HEALTH_WITHIN_S.
Some of the corpus's requests end a plain SGLang server (a control, not a target of this
script). The good requests' greedy text during the
fuzz must equal their text before it (exactly so only on a batch-invariant server, e.g.
--enable-deterministic-inference: otherwise bf16 near-ties can flip with the batch), a fixed
greedy probe sent alone must give the same text before and after, and the server must still
answer after it.
Only 127.0.0.1 / localhost servers are accepted. Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

CHAT, GENERATE, COMPLETIONS = "/v1/chat/completions", "/generate", "/v1/completions"
GOOD = [f"def f{i}(x):\n    return" for i in range(4)]
PROBE = {"text": "def fibonacci(n):", "sampling_params": {"max_new_tokens": 32, "temperature": 0}}


def _chat(**fields) -> dict:
    return {
        "model": "default",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        **fields,
    }


def _generate(sampling: dict, **top) -> dict:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 8, **sampling}, **top}


NAN, BIG = float("nan"), 1e300
SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
# A server's per-request limits, one class each (README, "Per-request limits"): (name, chat
# fields or None where chat has no such field, /generate sampling fields, /generate top-level
# fields). Every class goes to chat and /generate, streamed and not.
LIMITS = [
    (
        "top_logprobs past the vocabulary",
        {"logprobs": True, "top_logprobs": 10**6},
        {},
        {"return_logprob": True, "top_logprobs_num": 10**6},
    ),
    (
        "top_logprobs negative",
        {"logprobs": True, "top_logprobs": -1},
        {},
        {"return_logprob": True, "top_logprobs_num": -1},
    ),
    (
        "token_ids_logprob 100k ids",
        None,
        {},
        {"return_logprob": True, "token_ids_logprob": [1] * 100_000},
    ),
    ("logprob_start_len negative", None, {}, {"return_logprob": True, "logprob_start_len": -5}),
    (
        "logprob_start_len past the prompt",
        None,
        {},
        {"return_logprob": True, "logprob_start_len": 10**9},
    ),
    ("logit_bias NaN", {"logit_bias": {"5": NAN}}, {"logit_bias": {"5": NAN}}, {}),
    ("logit_bias 1e300", {"logit_bias": {"5": BIG}}, {"logit_bias": {"5": BIG}}, {}),
    ("logit_bias a string", {"logit_bias": {"5": "big"}}, {"logit_bias": {"5": "big"}}, {}),
    (
        "logit_bias key past the vocabulary",
        {"logit_bias": {"999999999": 1}},
        {"logit_bias": {"999999999": 1}},
        {},
    ),
    (
        "logit_bias 2000 entries",
        {"logit_bias": {str(i): 1 for i in range(2000)}},
        {"logit_bias": {str(i): 1 for i in range(2000)}},
        {},
    ),
    ("stop 1000 strings", {"stop": ["x"] * 1000}, {"stop": ["x"] * 1000}, {}),
    ("stop a 100k-character string", {"stop": "x" * 100_000}, {"stop": "x" * 100_000}, {}),
    ("stop_regex that does not compile", {"stop_regex": "(a"}, {"stop_regex": "(a"}, {}),
    ("stop_regex 10k bytes", {"stop_regex": "a" * 10_000}, {"stop_regex": "a" * 10_000}, {}),
    (
        "stop_token_ids past the vocabulary",
        {"stop_token_ids": [10**9]},
        {"stop_token_ids": [10**9]},
        {},
    ),
    ("stop_token_ids negative", {"stop_token_ids": [-1]}, {"stop_token_ids": [-1]}, {}),
    (
        "stop_token_ids 100k ids",
        {"stop_token_ids": [1] * 100_000},
        {"stop_token_ids": [1] * 100_000},
        {},
    ),
    ("n x max_tokens", {"n": 128, "max_tokens": 10**7}, {"n": 128, "max_new_tokens": 10**7}, {}),
    ("min_tokens 10**12", {"min_tokens": 10**12}, {"min_new_tokens": 10**12}, {}),
    (
        "json_schema 100k characters",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA},
            }
        },
        {"json_schema": json.dumps(SCHEMA)},
        {},
    ),
    ("regex 100k characters", {"regex": "a" * 100_000}, {"regex": "a" * 100_000}, {}),
    (
        "ebnf 100k characters",
        {"ebnf": "root ::= " + "'a' " * 25_000},
        {"ebnf": "root ::= " + "'a' " * 25_000},
        {},
    ),
    ("temperature NaN", {"temperature": NAN}, {"temperature": NAN}, {}),
    ("temperature 1e300", {"temperature": BIG}, {"temperature": BIG}, {}),
    ("top_p NaN", {"top_p": NAN}, {"top_p": NAN}, {}),
    ("top_k 1e300", None, {"top_k": BIG}, {}),
    ("top_k 2**40", {"top_k": 2**40}, {"top_k": 2**40}, {}),
    ("min_p NaN", {"min_p": NAN}, {"min_p": NAN}, {}),
    ("frequency_penalty NaN", {"frequency_penalty": NAN}, {"frequency_penalty": NAN}, {}),
    ("repetition_penalty 1e-40", {"repetition_penalty": 1e-40}, {"repetition_penalty": 1e-40}, {}),
    ("seed 2**70", {"seed": 2**70}, {"sampling_seed": 2**70}, {}),
    ("seed a string", None, {"sampling_seed": "abc"}, {}),
    ("stream_interval a string", None, {"stream_interval": "often"}, {}),
    ("ignore_eos a string", None, {"ignore_eos": "yes"}, {}),
    (
        "custom_logit_processor",
        {"custom_logit_processor": "{}"},
        {},
        {"custom_logit_processor": "{}"},
    ),
    ("stop_regex that backtracks", {"stop_regex": "(a+)+c"}, {"stop_regex": "(a+)+c"}, {}),
    ("stop_regex without bound", {"stop_regex": "a+"}, {"stop_regex": "a+"}, {}),
    ("return_hidden_states", {"return_hidden_states": True}, {}, {"return_hidden_states": True}),
    ("session_params id a list", None, {}, {"session_params": {"id": ["a"]}}),
    ("session_params offset a string", None, {}, {"session_params": {"id": "s", "offset": "x"}}),
    ("custom_labels not allowed", None, {}, {"custom_labels": {"x": "y"}}),
    ("return_sampling_mask", None, {}, {"return_sampling_mask": True}),
    ("sampling is_normalized", None, {"is_normalized": True, "temperature": 0}, {}),
    (
        "custom_params nested",
        {"custom_params": {"a": {"b": {"c": 1}}}},
        {"custom_params": {"a": {"b": {"c": 1}}}},
        {},
    ),
]
VERTEX = "/vertex_generate"


def _vertex(**parameters) -> dict:
    return {
        "instances": [{"text": "hi"}],
        "parameters": {"sampling_params": {"max_new_tokens": 8}, **parameters},
    }


def limit_cases() -> list[tuple[str, str, dict, bool]]:
    """Every LIMITS class on chat and /generate, streamed and not (and the top logprobs on
    /v1/completions, whose field is `logprobs`)."""
    out = []
    for name, chat, sampling, top in LIMITS:
        for stream in (False, True):
            tag = " (streamed)" if stream else ""
            out.append(
                (
                    f"generate: {name}{tag}",
                    GENERATE,
                    {**_generate(sampling, **top), "stream": stream},
                    False,
                )
            )
            if chat is not None:
                out.append((f"chat: {name}{tag}", CHAT, _chat(**chat, stream=stream), False))
    completion = {"model": "default", "prompt": "hi", "max_tokens": 8, "logprobs": 10**6}
    out.append(("completions: top logprobs past the vocabulary", COMPLETIONS, completion, False))
    return out


def _batch(**fields) -> dict:
    return {"text": ["hi", "yo"], "sampling_params": {"max_new_tokens": 8}, **fields}


def _completions(**fields) -> dict:
    return {"model": "default", "prompt": ["hi", "yo"], "max_tokens": 8, **fields}


# Request ids (front_door/identity.py): (name, path, body); each streamed and not
IDS = [
    ("rid a list for one prompt", GENERATE, _generate({}, rid=["q", "r"])),
    ("rid empty", GENERATE, _generate({}, rid="")),
    ("rid 300 characters", GENERATE, _generate({}, rid="q" * 300)),
    ("rid with a newline", GENERATE, _generate({}, rid="q\nr")),
    ("rid the health check's", GENERATE, _generate({}, rid="HEALTH_CHECK_fuzz")),
    ("rid the start of a uuid", GENERATE, _generate({}, rid="7")),
    ("rid a number", GENERATE, _generate({}, rid=5)),
    ("rid an object", GENERATE, _generate({}, rid={"a": 1})),
    ("rid twice in a batch", GENERATE, _batch(rid=["q", "q"])),
    ("rid one the start of another in a batch", GENERATE, _batch(rid=["q", "qr"])),
    ("rid short of the batch", GENERATE, _batch(rid=["q"])),
    ("chat: rid a list", CHAT, _chat(rid=["q", "r"])),
    ("chat: rid the health check's", CHAT, _chat(rid="HEALTH_CHECK")),
    ("chat: rid empty", CHAT, _chat(rid="")),
    ("chat: rid a number", CHAT, _chat(rid=5)),
    ("completions: rid short of the batch", COMPLETIONS, _completions(rid=["q"])),
    ("completions: rid the start of a responses id", COMPLETIONS, _completions(rid="resp_")),
]
# Per-prompt fields of a batch of two (front_door/batch_shape.py): (name, path, body)
BATCHES = [
    ("sampling_params short of the batch", _batch(sampling_params=[{"max_new_tokens": 8}])),
    ("sampling_params past the batch", _batch(sampling_params=[{"max_new_tokens": 8}] * 3)),
    ("sampling_params empty", _batch(sampling_params=[])),
    ("return_logprob short", _batch(return_logprob=[True])),
    ("logprob_start_len short", _batch(return_logprob=True, logprob_start_len=[-1])),
    ("top_logprobs_num past the batch", _batch(return_logprob=True, top_logprobs_num=[1] * 3)),
    ("token_ids_logprob short", _batch(return_logprob=True, token_ids_logprob=[[1]])),
    ("custom_logit_processor short", _batch(custom_logit_processor=[None])),
    ("lora_path short", _batch(lora_path=[None])),
    ("bootstrap_host short", _batch(bootstrap_host=["h"])),
    ("bootstrap_room short", _batch(bootstrap_room=[1])),
    ("decode_tp_size short", _batch(decode_tp_size=[1])),
    ("video_data short", _batch(video_data=["v"])),
    ("audio_data empty", _batch(audio_data=[])),
    ("modalities short", _batch(modalities=["image"])),
    ("multi_item_delimiter_indices short", _batch(multi_item_delimiter_indices=[[1]])),
    ("token_indices_to_pool one list", _batch(token_indices_to_pool=[1])),
    ("input_embeds [[]]", {"input_embeds": [[]], "sampling_params": {"max_new_tokens": 8}}),
    ("positional_embed_overrides an object", _batch(positional_embed_overrides={"a": 1})),
    ("return_logprob a list for one prompt", _generate({}, return_logprob=[True])),
    ("bootstrap_room a list for one prompt", _generate({}, bootstrap_room=[1, 2])),
]
COMPLETION_BATCHES = [
    ("bootstrap_host short", _completions(bootstrap_host=["h"])),
    ("extra_key short", _completions(extra_key=["k"])),
]


def identity_cases() -> list[tuple[str, str, dict, bool]]:
    """IDS and BATCHES, streamed and not."""
    out = []
    for stream in (False, True):
        tag = " (streamed)" if stream else ""
        for name, path, body in IDS:
            prefix = "" if path != GENERATE else "generate: "
            out.append((f"{prefix}{name}{tag}", path, {**body, "stream": stream}, False))
        for name, body in BATCHES:
            out.append(
                (f"generate batch: {name}{tag}", GENERATE, {**body, "stream": stream}, False)
            )
        for name, body in COMPLETION_BATCHES:
            out.append(
                (f"completions batch: {name}{tag}", COMPLETIONS, {**body, "stream": stream}, False)
            )
    return out


# Admin endpoints (front_door/admin.py): a DDTREE server started without --admin-api-key answers
# each with 403 (SGLang alone serves them to any client). Bodies that change little if served.
ADMIN = [
    ("/flush_cache", {}),
    ("/pause_generation", {"mode": "in_place"}),
    ("/continue_generation", {}),
    ("/slow_down", {"forward_sleep_time": 0.01}),
    ("/set_internal_state", {"server_args": {"max_running_requests": 1}}),
    ("/set_internal_state", {"server_args": {"speculative_accept_threshold_single": 0.5}}),
    ("/configure_logging", {"log_requests": False, "log_level": "loud"}),
    ("/abort_request", {"rid": "fuzz-nobody"}),
    ("/abort_request", {"rid": ""}),
    ("/start_profile", {"output_dir": "/tmp/fuzz_requests_profile", "num_steps": 1}),
    ("/stop_profile", {}),
    ("/release_memory_occupation", {}),
    ("/resume_memory_occupation", {}),
    ("/update_weights_from_disk", {"model_path": "/nonexistent"}),
    ("/update_weight_version", {"new_version": "fuzz"}),
    ("/load_lora_adapter", {"lora_name": "fuzz", "lora_path": "/nonexistent"}),
    ("/get_weights_by_name", {"name": "lm_head.weight"}),
    ("/set_trace_level?level=0", {}),
]
# after the admin phase, what would undo a served one (each a 403 where the gate holds)
RESTORE = [
    ("/continue_generation", {}),
    ("/slow_down", {"forward_sleep_time": None}),
    ("/resume_memory_occupation", {}),
    ("/stop_profile", {}),
]
HEALTH_WITHIN_S = 25.0  # SGLang's /health answers within SGLANG_HEALTH_CHECK_TIMEOUT (20 s) + 1 s


def corpus(context: int, seed: int = 0) -> list[tuple[str, str, bytes, bool]]:
    """(name, path, body bytes, may_be_ignored) for every malformed request, in a seeded order."""
    long_prompt = " ".join(["word"] * (2 * context))
    cases = [
        ("invalid json", CHAT, b'{"model": "default", "messages": [', False),
        ("not an object", CHAT, b"[1, 2, 3]", False),
        ("empty body", CHAT, b"", False),
        ("max_tokens a string", CHAT, _chat(max_tokens="ten"), False),
        ("temperature a string", CHAT, _chat(temperature="hot"), False),
        ("messages a string", CHAT, _chat(messages="hi"), False),
        ("content a number", CHAT, _chat(messages=[{"role": "user", "content": 5}]), False),
        ("empty messages", CHAT, _chat(messages=[]), False),
        ("unknown role", CHAT, _chat(messages=[{"role": "wizard", "content": "hi"}]), False),
        ("unknown field", CHAT, _chat(frobnicate=True), True),
        ("max_tokens 0", CHAT, _chat(max_tokens=0), False),
        ("max_tokens negative", CHAT, _chat(max_tokens=-5), False),
        ("max_tokens huge", CHAT, _chat(max_tokens=10**12), False),
        ("temperature negative", CHAT, _chat(temperature=-1.0), False),
        ("top_p above 1", CHAT, _chat(top_p=2.0), False),
        ("n zero", CHAT, _chat(n=0), False),
        ("n in the thousands", CHAT, _chat(n=5000), False),
        (
            "prompt over the context",
            CHAT,
            _chat(messages=[{"role": "user", "content": long_prompt}]),
            False,
        ),
        ("generate: text a number", GENERATE, {"text": 5, "sampling_params": {}}, False),
        (
            "generate: sampling_params a list",
            GENERATE,
            {"text": "hi", "sampling_params": [1]},
            False,
        ),
        (
            "generate: negative token id",
            GENERATE,
            {"input_ids": [1, -7, 3], "sampling_params": {"max_new_tokens": 4}},
            False,
        ),
        (
            "generate: token id past the vocabulary",
            GENERATE,
            {"input_ids": [1, 10**9], "sampling_params": {"max_new_tokens": 4}},
            False,
        ),
        (
            "generate: max_new_tokens negative",
            GENERATE,
            {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
            False,
        ),
        (
            "generate: 2000 prompts",
            GENERATE,
            {"text": ["hi"] * 2000, "sampling_params": {"max_new_tokens": 1}},
            False,
        ),
        (
            "generate: an empty prompt in a batch",
            GENERATE,
            {"input_ids": [[], [1, 2]], "sampling_params": {"max_new_tokens": 4}},
            False,
        ),
        (  # tokenized on the front end's event loop by SGLang: /health waited meanwhile
            "generate: a 4 MiB text over the context",
            GENERATE,
            {"text": "word " * 800_000, "sampling_params": {"max_new_tokens": 8}},
            False,
        ),
        (
            "an 80 MiB body",
            CHAT,
            _chat(messages=[{"role": "user", "content": "x" * (80 << 20)}]),
            False,
        ),
        # SGLang builds a Vertex request from its parameters untyped: each ended a plain server
        (
            "vertex: top_logprobs_num a float",
            VERTEX,
            _vertex(return_logprob=True, top_logprobs_num=2.0),
            False,
        ),
        (
            "vertex: logprob_start_len a float",
            VERTEX,
            _vertex(return_logprob=True, logprob_start_len=1.0),
            False,
        ),
        ("vertex: lora_id a list", VERTEX, _vertex(lora_id=[5]), False),
        (
            "vertex: routed_experts_start_len a string",
            VERTEX,
            _vertex(return_routed_experts=True, routed_experts_start_len="x"),
            False,
        ),
        *limit_cases(),
        *identity_cases(),
    ]
    out = [
        (n, p, b if isinstance(b, bytes) else json.dumps(b).encode(), ok) for n, p, b, ok in cases
    ]
    random.Random(seed).shuffle(out)
    return out


def post(url: str, body: bytes, timeout: float = 120) -> tuple[int | None, str]:
    """(status, body text), status None when the connection failed."""
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:
        return None, repr(e)


def judge(status: int | None, text: str, may_be_ignored: bool, streamed: bool = False) -> str:
    """ "ok" (a 4xx with a message, an allowed 200, or for a streamed /generate SGLang's refusal:
    a 200 stream whose first event is an error with a 4xx code), else what was wrong."""
    if status is not None and 400 <= status < 500:
        return "ok" if text.strip() else "4xx without a message"
    if status == 200 and may_be_ignored:
        return "ok"
    if status == 200 and streamed:
        return _streamed_refusal(text)
    return f"got {status}"


def _streamed_refusal(text: str) -> str:
    events = [line[6:] for line in text.splitlines() if line.startswith("data: {")]
    first = json.loads(events[0]) if events else {}
    error = first.get("error") if isinstance(first, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, int) and 400 <= code < 500 and error.get("message"):
        return "ok"
    return f"a 200 stream whose first event is not a 4xx error: {text[:120]!r}"


def is_streamed(path: str, body: bytes) -> bool:
    """Whether a /generate body asks for a stream (SGLang refuses those inside the stream)."""
    try:
        return path == GENERATE and json.loads(body).get("stream") is True
    except (ValueError, AttributeError):
        return False


def greedy(url: str, prompt: str) -> str | None:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
    status, text = post(url + GENERATE, json.dumps(body).encode())
    return json.loads(text)["text"] if status == 200 else None


def probe(url: str) -> str | None:
    """The fixed greedy probe's text (None: not served)."""
    status, text = post(url + GENERATE, json.dumps(PROBE).encode())
    return json.loads(text)["text"] if status == 200 else None


def get(url: str, timeout: float = 60) -> tuple[int | None, str, float]:
    """(status, body text, seconds), status None when no answer came."""
    tic = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace"), time.monotonic() - tic
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace"), time.monotonic() - tic
    except OSError as e:
        return None, repr(e), time.monotonic() - tic


class HealthProbe:
    """GET /health every `every` seconds on a thread while the fuzz runs: each answer's status
    and time (a healthy server answers 200 within HEALTH_WITHIN_S whatever is queued)."""

    def __init__(self, url: str, every: float = 1.0) -> None:
        self.url, self.every, self.rows = url, every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            status, _, seconds = get(self.url + "/health", timeout=2 * HEALTH_WITHIN_S)
            self.rows.append((status, round(seconds, 3)))
            self._stop.wait(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def report(self) -> dict:
        status, _, seconds = get(self.url + "/health", timeout=2 * HEALTH_WITHIN_S)
        rows = [*self.rows, (status, round(seconds, 3))]
        slowest = max(s for _, s in rows)
        failed = sum(st != 200 for st, _ in rows)
        ok = failed == 0 and slowest <= HEALTH_WITHIN_S
        return {"probes": len(rows), "failed": failed, "slowest_s": slowest, "ok": ok}


def in_flight_cases(url: str, seed: int) -> list[dict]:
    """A streamed request held in flight (its first event read, its connection open), and
    requests whose id equals it, begins with it, or is its start: each must get a 4xx (SGLang
    aborts by prefix, so the one whose client leaves would end the other); then the hold is
    closed (its client leaves)."""
    held = f"fuzz-hold-{seed}"
    body = {
        "text": "hold",
        "rid": held,
        "stream": True,
        "sampling_params": {"max_new_tokens": 512, "temperature": 0, "ignore_eos": True},
    }
    req = urllib.request.Request(
        url + GENERATE, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    rows = []
    try:
        hold = urllib.request.urlopen(req, timeout=120)
    except OSError as e:
        return [{"case": "in flight: the held request", "status": None, "verdict": repr(e)}]
    with hold:
        first = hold.readline().decode(errors="replace")
        if not first.startswith("data: {") or '"error"' in first:
            verdict = f"the held request did not stream: {first[:120]!r}"
            return [
                {"case": "in flight: the held request", "status": hold.status, "verdict": verdict}
            ]
        for name, rid in (
            ("the same id", held),
            ("one it begins", held + "-x"),
            ("its start", held[:-1]),
        ):
            for path, payload in ((GENERATE, _generate({}, rid=rid)), (CHAT, _chat(rid=rid))):
                status, text = post(url + path, json.dumps(payload).encode())
                rows.append(
                    {
                        "case": f"in flight: {path} {name}",
                        "status": status,
                        "verdict": judge(status, text, False),
                        "message": text[:200],
                    }
                )
    return rows


def admin_cases(url: str) -> list[dict]:
    """Every ADMIN endpoint must be a 401 or 403 (a DDTREE server started without
    --admin-api-key), then RESTORE undoes whatever was served."""
    rows = []
    for path, body in ADMIN:
        status, text = post(url + path, json.dumps(body).encode())
        verdict = "ok" if status in (401, 403) else f"got {status}: the admin gate answers 403"
        rows.append(
            {"case": f"admin: {path}", "status": status, "verdict": verdict, "message": text[:200]}
        )
    for path, body in RESTORE:
        post(url + path, json.dumps(body).encode())
    return rows


def serves_ddtree(url: str) -> bool:
    """Whether /server_info names DDTREE: the admin phase runs on DDTREE servers only (a plain
    SGLang server serves the admin endpoints to anyone: the phase would pause and slow it)."""
    status, text, _ = get(url + "/server_info")
    try:
        return status == 200 and json.loads(text).get("speculative_algorithm") == "DDTREE"
    except (ValueError, AttributeError):
        return False


def run(url: str, rounds: int, context: int, seed: int, admin: bool | None = None) -> dict:
    """The corpus `rounds` times over (seeded orders) with the good greedy requests running beside
    it, between two runs of the fixed probe alone; then the in-flight ids and (on a DDTREE server,
    or where `admin` says) the admin endpoints; /health probed throughout."""
    cases = [c for r in range(rounds) for c in corpus(context, seed + r)]
    admin = serves_ddtree(url) if admin is None else admin
    rows = []
    probe_before = probe(url)
    with HealthProbe(url) as health, cf.ThreadPoolExecutor(max_workers=8) as pool:
        before = list(pool.map(lambda p: greedy(url, p), GOOD))  # batched as during the fuzz
        during = [pool.submit(greedy, url, p) for p in GOOD * rounds]
        for name, path, body, may in cases:
            status, text = post(url + path, body)
            rows.append(
                {
                    "case": name,
                    "status": status,
                    "verdict": judge(status, text, may, is_streamed(path, body)),
                    "message": text[:200],
                }
            )
        rows += in_flight_cases(url, seed)
        if admin:
            rows += admin_cases(url)
        during = [f.result() for f in during]
    alive = (
        post(
            url + GENERATE,
            json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 1}}).encode(),
        )[0]
        == 200
    )
    probe_after = probe(url)
    healthy = health.report()
    bad = [r for r in rows if r["verdict"] != "ok"]
    same = all(t == before[i % len(GOOD)] for i, t in enumerate(during)) and None not in before
    probed = probe_before is not None and probe_after == probe_before
    return {
        "cases": len(rows),
        "bad": bad,
        "ignored_with_200": sorted(
            {
                r["case"]
                for r in rows
                if r["status"] == 200
                and r["verdict"] == "ok"
                and not r["case"].endswith("(streamed)")
            }
        ),
        "admin_probed": admin,
        "health": healthy,
        "good_text_unchanged": same,
        "probe_unchanged": probed,
        "alive_after": alive,
        "ok": not bad and same and alive and probed and healthy["ok"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("url")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    host = urllib.parse.urlparse(args.url).hostname
    if host not in ("127.0.0.1", "localhost"):
        raise SystemExit(
            f"fuzz_requests.py sends traffic to 127.0.0.1 / localhost only, not {host}"
        )
    report = run(args.url.rstrip("/"), args.rounds, args.context, args.seed)
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

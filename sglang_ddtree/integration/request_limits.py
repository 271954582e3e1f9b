"""What one request may ask of a DDTREE server: the front end's limits (README, "Per-request
limits"), one pure check over a request before it is scheduled.

`check_request` runs in the tokenizer manager before SGLang's `_validate_one_request`, once per
request of a batch and per sample of `n` (SGLang splits them first), for /generate and the
OpenAI chat and completions endpoints, streamed or not. It raises ValueError, which SGLang answers
with HTTP 400 (a streamed /generate: an error event) while the server serves on.

Why the front end: SGLang's scheduler turns every request's numbers into tensors when it forms a
batch (`SamplingBatchInfo.from_schedule_batch`, the penalizers, the logits processor), and an
exception in a round ends the whole scheduler process (`run_scheduler_process` signals the
parent to quit): it cannot abort one request of a batched forward. So every value that reaches a
round must be one the round takes: the checks here make the bad ones impossible.

SGLang's own checks stay SGLang's, and run after these in the same request path (in 0.5.17 and
0.5.23 alike): `SamplingParams.verify` (temperature finite and >= 0, top_p in (0, 1], min_p in
[0, 1], frequency and presence penalties in [-2, 2], repetition in (0, 2], min_new_tokens <=
max_new_tokens, logit_bias keys in the vocabulary, one grammar at most), `_validate_one_request`
(prompt + max_new_tokens within the context, token_ids_logprob ids in the vocabulary,
custom_logit_processor behind --enable-custom-logit-processor); 0.5.23's `normalize` also bounds
stop strings to 32 and stop_regex to 32 patterns of 256 bytes, the bounds used here on both. What
is here is what those leave out: the type of each field (a string where a number belongs
raises a TypeError, an HTTP 500, in SGLang's checks), the upper bounds (top_k and
min_new_tokens overflow the scheduler's int32 tensors, a temperature past float32 turns a
grammar's masked logits into NaN), every size a request sets, and the ids SGLang never checks
(stop_token_ids index the min_new_tokens penalizer's scatter).
"""

from __future__ import annotations

import dataclasses
import math
import re

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat top_logprobs
MAX_TOKEN_IDS_LOGPROB = 256
MAX_LOGIT_BIAS = 100.0  # OpenAI's range, [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOPS = 32  # SGLang 0.5.23's MAX_STOP_COUNT, also for stop_regex
MAX_STOP_CHARS = 256  # SGLang 0.5.23's MAX_STOP_REGEX_LEN (bytes for stop_regex, as there)
MAX_STOP_TOKEN_IDS = 1024
MAX_SAMPLED_TOKENS = 1 << 20  # n x max_tokens (or the context, if longer): 128 x 8,192
MAX_GRAMMAR_CHARS = 1 << 16
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY = 0.01
INT32_MAX = (1 << 31) - 1  # the scheduler's int32 tensors (top_k, min_new_tokens)
TOP_K_ALL = 1 << 30  # SGLang's "the whole vocabulary" (sampling_params.TOP_K_ALL)
GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")
# float fields SGLang range-checks itself (SamplingParams.verify); only their type is ours
_SGLANG_RANGED = ("top_p", "min_p", "frequency_penalty", "presence_penalty")
# flags the scheduler and the detokenizer read as they come (a string there reaches
# tokenizer.decode or a modulo in the scheduler's output streamer)
_FLAGS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The served model's sizes the limits depend on (None: unknown, that bound not applied)."""

    vocab: int | None
    context: int | None


def check_request(obj, input_ids, sizes: Sizes) -> None:
    """Raise ValueError naming the field, its value and the limit for the first field of one
    request (SGLang's GenerateReqInput for one request: `sampling_params` a dict) that a DDTREE
    server does not take; `input_ids` the prompt's ids when known."""
    if getattr(obj, "custom_logit_processor", None):
        raise ValueError(
            "custom_logit_processor is not served with DDTREE speculative decoding: SGLang's "
            "tree verify never calls it, so it would change the first token only; send this "
            "request to a server without speculative decoding, or without the processor."
        )
    prompt_len = len(input_ids) if input_ids is not None else None
    _check_logprobs(obj, prompt_len, sizes.vocab)
    sampling = getattr(obj, "sampling_params", None)
    if sampling is None:
        return
    if not isinstance(sampling, dict):
        raise ValueError(f"sampling_params must be a JSON object, got {_show(sampling)}.")
    _check_numbers(sampling)
    _check_flags(sampling)
    _check_lengths(sampling, prompt_len, sizes.context)
    _check_logit_bias(sampling.get("logit_bias"), sizes.vocab)
    _check_stops(sampling, sizes.vocab)
    _check_grammar(sampling)


def _check_logprobs(obj, prompt_len: int | None, vocab: int | None) -> None:
    """top_logprobs_num, token_ids_logprob and logprob_start_len (GenerateReqInput's names; the
    OpenAI endpoints' top_logprobs / logprobs arrive as top_logprobs_num)."""
    top = getattr(obj, "top_logprobs_num", None)
    if top is not None:
        limit = MAX_TOP_LOGPROBS if vocab is None else min(MAX_TOP_LOGPROBS, vocab)
        top = _whole("top_logprobs_num (top_logprobs)", top)
        _within("top_logprobs_num (top_logprobs)", top, 0, limit,
                "top logprobs per token (a round returns batch x B x k of them)")  # fmt: skip
    ids = getattr(obj, "token_ids_logprob", None)
    if ids is not None:
        if not isinstance(ids, list):
            raise ValueError(f"token_ids_logprob must be a list of token ids, got {_show(ids)}.")
        _within("len(token_ids_logprob)", len(ids), 0, MAX_TOKEN_IDS_LOGPROB,
                "ids (every prompt and output token returns one logprob per id)")  # fmt: skip
    start = getattr(obj, "logprob_start_len", None)
    if start is not None:
        start = _whole("logprob_start_len", start)
        if start != -1:
            high = prompt_len if prompt_len is not None else max(start, 0)
            _within("logprob_start_len", start, 0, high,
                    "(a position in the prompt; -1: output logprobs only)")  # fmt: skip


def _check_numbers(sampling: dict) -> None:
    """Every float field a real, finite number; the bounds SGLang's verify leaves open."""
    for name in _SGLANG_RANGED:
        _number(name, sampling.get(name))
    temperature = _number("temperature", sampling.get("temperature"))
    if temperature is not None and temperature > MAX_TEMPERATURE:  # negative: SGLang's verify
        raise ValueError(
            f"temperature={temperature} is above DDTREE's limit of {MAX_TEMPERATURE} (the "
            "sampler divides float32 logits by it, and past float32's range a grammar's masked "
            f"logits become NaN); use a temperature in [0, {MAX_TEMPERATURE}]."
        )
    repetition = _number("repetition_penalty", sampling.get("repetition_penalty"))
    if repetition is not None and 0 < repetition < MIN_REPETITION_PENALTY:
        raise ValueError(
            f"repetition_penalty={repetition} is below DDTREE's limit of "
            f"{MIN_REPETITION_PENALTY} (it divides positive logits, and at about 1e-37 a "
            f"float32 logit overflows to inf); use a value in [{MIN_REPETITION_PENALTY}, 2]."
        )
    top_k = sampling.get("top_k")
    top_k = None if top_k is None else _whole("top_k", top_k)
    if top_k is not None and top_k != -1:
        _within("top_k", top_k, 1, TOP_K_ALL, "(-1: off; the scheduler holds top_k in int32)")


def _check_flags(sampling: dict) -> None:
    """The booleans a true or false, stream_interval a whole number >= 1."""
    for name in _FLAGS:
        if sampling.get(name) is not None and not isinstance(sampling[name], bool):
            raise ValueError(f"{name} must be true or false, got {_show(sampling[name])}.")
    interval = sampling.get("stream_interval")
    if interval is not None:
        _within("stream_interval", _whole("stream_interval", interval), 1, INT32_MAX,
                "tokens (the scheduler streams every that many)")  # fmt: skip


def _check_lengths(sampling: dict, prompt_len: int | None, context: int | None) -> None:
    """max_new_tokens, min_new_tokens and n x max_new_tokens (n's own range, 1-128, and
    max_new_tokens >= 1 are hooks.RequestCheck's)."""
    room = None if context is None else context - (prompt_len or 0)  # what SGLang lets it run to
    most = sampling.get("max_new_tokens")
    if most is not None:
        most = _whole("max_new_tokens (max_tokens)", most)
    least = sampling.get("min_new_tokens")
    if least is not None:
        high = most if most is not None else room if room is not None else INT32_MAX
        _within("min_new_tokens (min_tokens)", _whole("min_new_tokens (min_tokens)", least), 0,
                high, "(at most max_new_tokens, or the context left after the prompt)")  # fmt: skip
    samples = sampling.get("n")
    samples = 1 if samples is None else _whole("n", samples)
    each = most if most is not None else room
    limit = MAX_SAMPLED_TOKENS if context is None else max(MAX_SAMPLED_TOKENS, context)
    if each is not None and samples * each > limit:  # one sample alone is the context's business
        raise ValueError(
            f"n x max_tokens = {samples} x {each} = {samples * each} tokens is above DDTREE's "
            f"limit of {limit} per request (each of the n samples decodes up to max_tokens; "
            "unset, to the context); lower n or max_tokens, or send several requests."
        )


def _check_logit_bias(bias, vocab: int | None) -> None:
    """A {token id: bias} object of at most MAX_LOGIT_BIAS_ENTRIES ids in the vocabulary, each
    bias finite within +-MAX_LOGIT_BIAS: the verify adds the biases after SGLang's NaN guard, and
    a NaN or a float32 overflow there can sample a token outside the vocabulary."""
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be an object of token id: bias, got {_show(bias)}.")
    _within("len(logit_bias)", len(bias), 0, MAX_LOGIT_BIAS_ENTRIES,
            "token ids (the scheduler writes them one by one whenever it forms a batch)")  # fmt: skip
    for key, value in bias.items():
        token = _token_id(f"logit_bias key {_show(key)}", key)
        if vocab is not None and not 0 <= token < vocab:
            raise ValueError(f"logit_bias key {token} is outside the vocabulary [0, {vocab}).")
        value = _number(f"logit_bias[{token}]", value)
        _within(f"logit_bias[{token}]", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS,
                "(OpenAI's range; the verify adds it after SGLang's NaN guard)")  # fmt: skip


def _check_stops(sampling: dict, vocab: int | None) -> None:
    """stop strings, stop_regex patterns and stop_token_ids: counts, lengths, ids in the
    vocabulary (each round the scheduler decodes as many of a request's last tokens as its
    longest stop holds, and runs every pattern over them)."""
    for name in ("stop", "stop_regex"):
        texts = sampling.get(name)
        if texts is not None:
            _check_stop_texts(name, [texts] if isinstance(texts, str) else texts)
    ids = sampling.get("stop_token_ids")
    if ids is None:
        return
    if not isinstance(ids, list):
        raise ValueError(f"stop_token_ids must be a list of token ids, got {_show(ids)}.")
    _within("len(stop_token_ids)", len(ids), 0, MAX_STOP_TOKEN_IDS,
            "ids (the min_new_tokens penalizer pads every request's list to the batch's longest)")  # fmt: skip
    for value in ids:
        token = _token_id("stop_token_ids entry", value)
        if vocab is not None and not 0 <= token < vocab:
            raise ValueError(f"stop_token_ids holds {token}, outside the vocabulary [0, {vocab}) "
                             "(SGLang's min_new_tokens penalizer indexes by it).")  # fmt: skip


def _check_stop_texts(name: str, texts) -> None:
    """`stop` or `stop_regex` as a list: at most MAX_STOPS strings of MAX_STOP_CHARS (characters
    for stop strings, UTF-8 bytes for patterns, as SGLang 0.5.23 counts them); patterns compile."""
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"{name} must be a string or a list of strings, got {_show(texts)}.")
    _within(f"len({name})", len(texts), 0, MAX_STOPS, "entries")
    for text in texts:
        size = len(text.encode()) if name == "stop_regex" else len(text)
        _within(f"len({name} {_show(text)})", size, 0, MAX_STOP_CHARS,
                "bytes" if name == "stop_regex" else "characters")  # fmt: skip
        if name == "stop_regex":
            _compiles(text)


def _check_grammar(sampling: dict) -> None:
    """A grammar (json_schema, regex, ebnf, structural_tag) is a string of at most
    MAX_GRAMMAR_CHARS. Its compile time is bounded by SGLang's grammar queue, in 0.5.17 and
    0.5.23 alike: a grammar not compiled within SGLANG_GRAMMAR_MAX_POLL_ITERATIONS (10,000)
    polls of at least SGLANG_GRAMMAR_POLL_INTERVAL (5 ms), at least 50 s, aborts its request
    ("Grammar preprocessing timed out"), and one that fails to compile aborts its request; but
    the compile thread runs on, which is what the length bounds."""
    for name in GRAMMARS:
        grammar = sampling.get(name)
        if grammar is None:
            continue
        if not isinstance(grammar, str):
            raise ValueError(f"{name} must be a string, got {_show(grammar)}.")
        _within(f"len({name})", len(grammar), 0, MAX_GRAMMAR_CHARS,
                "characters (SGLang compiles it on the scheduler's grammar threads)")  # fmt: skip


def _compiles(pattern: str) -> None:
    try:
        re.compile(pattern)
    except (re.error, RecursionError) as exc:
        raise ValueError(
            f"stop_regex {_show(pattern)} is not a regular expression: {exc}."
        ) from None


def _number(name: str, value) -> float | None:
    """value as a finite real number (None stays None: SGLang's default), or a ValueError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {_show(value)}.")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}.")
    return value


def _whole(name: str, value) -> int:
    """value as an integer (an integral float such as 8.0 taken as 8), or a ValueError."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {_show(value)}.")
    return value


def _token_id(name: str, value) -> int:
    """A token id: an integer, or a string of one (JSON object keys are strings)."""
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        return int(value)
    return _whole(name, value)


def _within(name: str, value, low, high, what: str) -> None:
    if not low <= value <= high:
        shown = f"{value:.6g}" if isinstance(value, int) and abs(value) >= 10**15 else value
        raise ValueError(f"{name}={shown} is outside DDTREE's limit [{low}, {high}] {what}.")


def _show(value, width: int = 48) -> str:
    """A short repr for a message (a 1 MB string is named by its start and length)."""
    text = repr(value)
    return text if len(text) <= width else f"{text[:width]}... ({len(text)} characters)"

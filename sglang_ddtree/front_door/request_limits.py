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

SGLang's own checks stay SGLang's, and run after these in the same request path:
`SamplingParams.verify` (temperature finite and >= 0, top_p in (0, 1], min_p in
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
from collections.abc import Callable

from sglang_ddtree.front_door.stop_regex import check_regex_cost, compiles
from sglang_ddtree.front_door.values import (
    number,
    scalar,
    show,
    string,
    token_id,
    whole,
    within,
)

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat top_logprobs
MAX_TOKEN_IDS_LOGPROB = 256
MAX_LOGIT_BIAS = 100.0  # OpenAI's range, [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOPS = 32  # SGLang 0.5.23's MAX_STOP_COUNT, also for stop_regex
MAX_STOP_CHARS = 256  # SGLang 0.5.23's MAX_STOP_REGEX_LEN (bytes for stop_regex, as there)
MAX_STOP_TOKEN_IDS = 1024
MAX_SAMPLED_TOKENS = 1 << 20  # n x max_tokens (or the context, if longer): 128 x 8,192
MAX_GRAMMAR_CHARS = 1 << 16
MAX_SAMPLES = 128  # n: OpenAI's bound
MAX_BATCH = 1024  # prompts in one call (a /generate or /v1/completions list)
MAX_BATCH_SAMPLES = 1024  # prompts x n in one call
MAX_LABEL_CHARS = 128  # a custom_labels value
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
# SamplingParams fields SGLang fills itself (normalize); a client's would skip the checks here
_INTERNAL_SAMPLING = (
    "is_normalized",
    "stop_strs",
    "stop_regex_strs",
    "stop_str_max_len",
    "stop_regex_max_len",
)
# request fields a DDTREE server does not serve, refused when set, and why
UNSERVED = {
    "input_embeds": "the DFlash drafter reads token ids; send text or input_ids",
    "return_hidden_states": "a tree verify's hidden-state rows are its nodes', not the emitted "
    "tokens'",
    "return_routed_experts": "captured for every tree node, not for the emitted tokens",
    "return_indexer_topk": "captured for every tree node, not for the emitted tokens",
    "return_sampling_mask": "DDTREE's tree sampler does not capture the sampling support",
    "sampling_logprobs_mode": "it goes with return_sampling_mask",
    "lora_path": "the DFlash drafter has no adapters, and the tree verify has not been run with "
    "them",
    "lora_id": "SGLang sets it from lora_path",
    "positional_embed_overrides": "it is for SGLang's Python engine, not a served request",
}
SESSION_FIELDS = ("id", "rid", "offset", "replace", "drop_previous_output")
MAX_SESSION_ID_CHARS = 256
MAX_CUSTOM_PARAMS = 64  # custom_params keys
MAX_CUSTOM_PARAM_ITEMS = 1024  # items of one list or object value


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What the limits depend on: the served model's sizes (None: unknown, that bound not
    applied), the custom metric labels the server allows
    (--tokenizer-metrics-allowed-custom-labels) and SGLang's measure of a stop pattern."""

    vocab: int | None
    context: int | None
    labels: tuple[str, ...] = ()
    # SGLang's measure of a stop_regex's longest match, which sizes the text its scheduler
    # searches (sampling_params.get_max_seq_length; None: this module's own)
    regex_length: Callable[[str], int] | None = None


def check_batch(obj) -> None:
    """Raise ValueError for a call (SGLang's GenerateReqInput before it is split into requests)
    whose size the split itself would make too large: n in [1, MAX_SAMPLES], at most MAX_BATCH
    prompts, at most MAX_BATCH_SAMPLES prompts x n, and each token_ids_logprob list (copied once
    per sample) within MAX_TOKEN_IDS_LOGPROB. SGLang makes one request, with its own state,
    per prompt and sample before any per-request check runs."""
    sampling = getattr(obj, "sampling_params", None)
    each = sampling if isinstance(sampling, list) else [sampling]
    most = 1
    for params in each:
        samples = params.get("n") if isinstance(params, dict) else None
        if samples is not None:
            samples = whole("n", samples)
            within(
                "n",
                samples,
                1,
                MAX_SAMPLES,
                "samples per request (OpenAI's bound; SGLang makes a request of each)",
            )
            most = max(most, samples)
    prompts = _prompts(obj)
    within("the number of prompts", prompts, 1, MAX_BATCH, "in one call")
    within("prompts x n", prompts * most, 1, MAX_BATCH_SAMPLES, "requests in one call")
    ids = getattr(obj, "token_ids_logprob", None)
    for entry in ids if isinstance(ids, list) and ids and isinstance(ids[0], list) else [ids]:
        if isinstance(entry, list):
            within(
                "len(token_ids_logprob)",
                len(entry),
                0,
                MAX_TOKEN_IDS_LOGPROB,
                "ids (every prompt and output token returns one logprob per id)",
            )


def _prompts(obj) -> int:
    """How many prompts a call holds: a list of texts or of id lists is a batch."""
    text, ids = getattr(obj, "text", None), getattr(obj, "input_ids", None)
    if isinstance(text, list):
        return len(text)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return 1


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
    for name, why in UNSERVED.items():
        value = getattr(obj, name, None)
        if value is not None and value is not False and value != [] and value != {}:
            raise ValueError(f"{name}={show(value)} is not served by DDTREE: {why}.")
    _integers(obj, _INTEGER_FIELDS)
    prompt_len = len(input_ids) if input_ids is not None else None
    in_session = getattr(obj, "session_params", None) or getattr(obj, "session_id", None)
    if prompt_len == 0 and not in_session:  # SGLang refuses it alone, not in a batch
        raise ValueError(
            "the prompt is empty: a request needs at least one prompt token (or a "
            "session whose context it continues)."
        )
    _check_logprobs(obj, prompt_len, sizes.vocab)
    _check_session(obj, sizes.context)
    _check_labels(getattr(obj, "custom_labels", None), sizes.labels)
    sampling = getattr(obj, "sampling_params", None)
    if sampling is None:
        return
    if not isinstance(sampling, dict):
        raise ValueError(f"sampling_params must be a JSON object, got {show(sampling)}.")
    for name in _INTERNAL_SAMPLING:
        if name in sampling:
            raise ValueError(f"sampling_params.{name} is SGLang's own field, not a client's.")
    _integers(sampling, _INTEGER_SAMPLING)
    _check_numbers(sampling)
    _check_custom_params(sampling.get("custom_params"))
    _check_flags(sampling)
    _check_lengths(sampling, prompt_len, sizes.context)
    _check_logit_bias(sampling.get("logit_bias"), sizes.vocab)
    _check_stops(sampling, sizes.vocab, sizes.regex_length)
    _check_grammar(sampling)


def _check_logprobs(obj, prompt_len: int | None, vocab: int | None) -> None:
    """top_logprobs_num, token_ids_logprob and logprob_start_len (GenerateReqInput's names; the
    OpenAI endpoints' top_logprobs / logprobs arrive as top_logprobs_num)."""
    top = getattr(obj, "top_logprobs_num", None)
    if top is not None:
        limit = MAX_TOP_LOGPROBS if vocab is None else min(MAX_TOP_LOGPROBS, vocab)
        top = whole("top_logprobs_num (top_logprobs)", top)
        within(
            "top_logprobs_num (top_logprobs)",
            top,
            0,
            limit,
            "top logprobs per token (a round returns batch x B x k of them)",
        )
    ids = getattr(obj, "token_ids_logprob", None)
    if ids is not None:
        if not isinstance(ids, list):
            raise ValueError(f"token_ids_logprob must be a list of token ids, got {show(ids)}.")
        within(
            "len(token_ids_logprob)",
            len(ids),
            0,
            MAX_TOKEN_IDS_LOGPROB,
            "ids (every prompt and output token returns one logprob per id)",
        )
    start = getattr(obj, "logprob_start_len", None)
    if start is not None:
        start = whole("logprob_start_len", start)
        if start != -1:
            high = prompt_len if prompt_len is not None else max(start, 0)
            within(
                "logprob_start_len",
                start,
                0,
                high,
                "(a position in the prompt; -1: output logprobs only)",
            )


# the integer fields, of the request and of its sampling parameters
_INTEGER_FIELDS = ("top_logprobs_num", "logprob_start_len")
_INTEGER_SAMPLING = ("max_new_tokens", "min_new_tokens", "top_k", "n", "stream_interval")


def _integers(holder, names: tuple[str, ...]) -> None:
    """An integral float in an integer field (20.0, as a model's generation_config.json may give
    top_k) becomes the integer, written back: the scheduler takes the value as it comes, and a
    float top_logprobs_num reached torch.topk's k. Any other non-integer is refused later."""
    is_dict = isinstance(holder, dict)
    for name in names:
        value = holder.get(name) if is_dict else getattr(holder, name, None)
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            if is_dict:
                holder[name] = int(value)
            else:
                setattr(holder, name, int(value))


def _check_session(obj, context: int | None) -> None:
    """session_id a string; session_params null or an object of SESSION_FIELDS, each of its
    type: the scheduler looks the id up in a dict and slices by the offset as they come (a
    list there raised in the scheduler)."""
    session_id = getattr(obj, "session_id", None)
    if session_id is not None:
        string("session_id", session_id, MAX_SESSION_ID_CHARS)
    params = getattr(obj, "session_params", None)
    if params is None:
        return
    if not isinstance(params, dict) or not set(params) <= set(SESSION_FIELDS):
        raise ValueError(
            f"session_params must be an object of {', '.join(SESSION_FIELDS)}, got {show(params)}."
        )
    for name in ("id", "rid"):
        if params.get(name) is not None:
            string(f"session_params.{name}", params[name], MAX_SESSION_ID_CHARS)
    if params.get("offset") is not None:
        offset = whole("session_params.offset", params["offset"])
        within(
            "session_params.offset",
            offset,
            0,
            context if context is not None else INT32_MAX,
            "tokens (a position in the session's context)",
        )
    for name in ("replace", "drop_previous_output"):
        if params.get(name) is not None and not isinstance(params[name], bool):
            raise ValueError(
                f"session_params.{name} must be true or false, got {show(params[name])}."
            )


def _check_labels(labels, allowed: tuple[str, ...]) -> None:
    """custom_labels: an object of the labels the server allows
    (--tokenizer-metrics-allowed-custom-labels), each value a JSON scalar of at most
    MAX_LABEL_CHARS characters as text:
    SGLang passes them to its Prometheus metrics as they come, where another name raises in the
    front end's output loop and ends the server."""
    if not labels:
        return
    if not isinstance(labels, dict):
        raise ValueError(f"custom_labels must be an object, got {show(labels)}.")
    for name, value in labels.items():
        if name not in allowed:
            listed = ", ".join(allowed) or "none: the server allows no custom labels"
            raise ValueError(
                f"custom_labels {show(name)} is not a label this server allows "
                f"({listed}; --tokenizer-metrics-allowed-custom-labels)."
            )
        scalar(f"custom_labels[{show(name)}]", value)  # Prometheus takes its str()
        within(
            f"len(custom_labels[{show(name)}])", len(str(value)), 0, MAX_LABEL_CHARS, "characters"
        )


def _check_numbers(sampling: dict) -> None:
    """Every float field a real, finite number; the bounds SGLang's verify leaves open."""
    for name in _SGLANG_RANGED:
        number(name, sampling.get(name))
    temperature = number("temperature", sampling.get("temperature"))
    if temperature is not None and temperature > MAX_TEMPERATURE:  # negative: SGLang's verify
        raise ValueError(
            f"temperature={temperature} is above DDTREE's limit of {MAX_TEMPERATURE} (the "
            "sampler divides float32 logits by it, and past float32's range a grammar's masked "
            f"logits become NaN); use a temperature in [0, {MAX_TEMPERATURE}]."
        )
    repetition = number("repetition_penalty", sampling.get("repetition_penalty"))
    if repetition is not None and 0 < repetition < MIN_REPETITION_PENALTY:
        raise ValueError(
            f"repetition_penalty={repetition} is below DDTREE's limit of "
            f"{MIN_REPETITION_PENALTY} (it divides positive logits, and at about 1e-37 a "
            f"float32 logit overflows to inf); use a value in [{MIN_REPETITION_PENALTY}, 2]."
        )
    top_k = sampling.get("top_k")
    top_k = None if top_k is None else whole("top_k", top_k)
    if top_k is not None and top_k != -1:
        within("top_k", top_k, 1, TOP_K_ALL, "(-1: off; the scheduler holds top_k in int32)")


def _check_custom_params(params) -> None:
    """custom_params as SGLang types it (sampling_params.CustomParamValue): an object whose values
    are JSON scalars (integers within int64), lists of them or objects of them, at most
    MAX_CUSTOM_PARAMS keys and MAX_CUSTOM_PARAM_ITEMS items a value. SGLang's own request models
    let deeper values through, and its scheduler's typed decoder (SGLANG_USE_PICKLE_IPC=0)
    raises on them, which ends the scheduler."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError(f"custom_params must be an object, got {show(params)}.")
    within("len(custom_params)", len(params), 0, MAX_CUSTOM_PARAMS, "keys")
    for key, value in params.items():
        name = f"custom_params[{show(key)}]"
        if not isinstance(key, str):
            raise ValueError(f"custom_params keys must be strings, got {show(key)}.")
        if not isinstance(value, dict | list):
            scalar(name, value)
            continue
        within(f"len({name})", len(value), 0, MAX_CUSTOM_PARAM_ITEMS, "items")
        if isinstance(value, dict) and not all(isinstance(k, str) for k in value):
            raise ValueError(f"{name}'s keys must be strings, got {show(value)}.")
        for item in value.values() if isinstance(value, dict) else value:
            scalar(name, item)


def _check_flags(sampling: dict) -> None:
    """The booleans a true or false, stream_interval a whole number >= 1."""
    for name in _FLAGS:
        if sampling.get(name) is not None and not isinstance(sampling[name], bool):
            raise ValueError(f"{name} must be true or false, got {show(sampling[name])}.")
    interval = sampling.get("stream_interval")
    if interval is not None:
        within(
            "stream_interval",
            whole("stream_interval", interval),
            1,
            INT32_MAX,
            "tokens (the scheduler streams every that many)",
        )


def _check_lengths(sampling: dict, prompt_len: int | None, context: int | None) -> None:
    """max_new_tokens, min_new_tokens and n x max_new_tokens (n's own range, 1-128, and
    max_new_tokens >= 1 are checks.RequestCheck's)."""
    room = None if context is None else context - (prompt_len or 0)  # what SGLang lets it run to
    most = sampling.get("max_new_tokens")
    if most is not None:
        most = whole("max_new_tokens (max_tokens)", most)
    least = sampling.get("min_new_tokens")
    if least is not None:
        high = most if most is not None else room if room is not None else INT32_MAX
        within(
            "min_new_tokens (min_tokens)",
            whole("min_new_tokens (min_tokens)", least),
            0,
            high,
            "(at most max_new_tokens, or the context left after the prompt)",
        )
    samples = sampling.get("n")
    samples = 1 if samples is None else whole("n", samples)
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
        raise ValueError(f"logit_bias must be an object of token id: bias, got {show(bias)}.")
    within(
        "len(logit_bias)",
        len(bias),
        0,
        MAX_LOGIT_BIAS_ENTRIES,
        "token ids (the scheduler writes them one by one whenever it forms a batch)",
    )
    for key, value in bias.items():
        token = token_id(f"logit_bias key {show(key)}", key)
        if vocab is not None and not 0 <= token < vocab:
            raise ValueError(f"logit_bias key {token} is outside the vocabulary [0, {vocab}).")
        value = number(f"logit_bias[{token}]", value)
        within(
            f"logit_bias[{token}]",
            value,
            -MAX_LOGIT_BIAS,
            MAX_LOGIT_BIAS,
            "(OpenAI's range; the verify adds it after SGLang's NaN guard)",
        )


def _check_stops(
    sampling: dict, vocab: int | None, regex_length: Callable[[str], int] | None = None
) -> None:
    """stop strings, stop_regex patterns and stop_token_ids: counts, lengths, ids in the
    vocabulary (each round the scheduler decodes as many of a request's last tokens as its
    longest stop holds, and runs every pattern over them)."""
    for name in ("stop", "stop_regex"):
        texts = sampling.get(name)
        if texts is not None:
            _check_stop_texts(name, [texts] if isinstance(texts, str) else texts)
    patterns = sampling.get("stop_regex")
    if patterns:
        check_regex_cost([patterns] if isinstance(patterns, str) else patterns, regex_length)
    ids = sampling.get("stop_token_ids")
    if ids is None:
        return
    if not isinstance(ids, list):
        raise ValueError(f"stop_token_ids must be a list of token ids, got {show(ids)}.")
    within(
        "len(stop_token_ids)",
        len(ids),
        0,
        MAX_STOP_TOKEN_IDS,
        "ids (the min_new_tokens penalizer pads every request's list to the batch's longest)",
    )
    for value in ids:
        token = token_id("stop_token_ids entry", value)
        if vocab is not None and not 0 <= token < vocab:
            raise ValueError(
                f"stop_token_ids holds {token}, outside the vocabulary [0, {vocab}) "
                "(SGLang's min_new_tokens penalizer indexes by it)."
            )


def _check_stop_texts(name: str, texts) -> None:
    """`stop` or `stop_regex` as a list: at most MAX_STOPS strings of MAX_STOP_CHARS (characters
    for stop strings, UTF-8 bytes for patterns, as SGLang 0.5.23 counts them); patterns compile."""
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"{name} must be a string or a list of strings, got {show(texts)}.")
    within(f"len({name})", len(texts), 0, MAX_STOPS, "entries")
    for text in texts:
        size = len(text.encode()) if name == "stop_regex" else len(text)
        within(
            f"len({name} {show(text)})",
            size,
            0,
            MAX_STOP_CHARS,
            "bytes" if name == "stop_regex" else "characters",
        )
        if name == "stop_regex":
            compiles(text)


def _check_grammar(sampling: dict) -> None:
    """A grammar (json_schema, regex, ebnf, structural_tag) is a string of at most
    MAX_GRAMMAR_CHARS. Its compile time is bounded by SGLang's grammar queue: a grammar not compiled within SGLANG_GRAMMAR_MAX_POLL_ITERATIONS (10,000)
    polls of at least SGLANG_GRAMMAR_POLL_INTERVAL (5 ms), at least 50 s, aborts its request
    ("Grammar preprocessing timed out"), and one that fails to compile aborts its request; but
    the compile thread runs on, which is what the length bounds."""
    for name in GRAMMARS:
        grammar = sampling.get(name)
        if grammar is None:
            continue
        if not isinstance(grammar, str):
            raise ValueError(f"{name} must be a string, got {show(grammar)}.")
        within(
            f"len({name})",
            len(grammar),
            0,
            MAX_GRAMMAR_CHARS,
            "characters (SGLang compiles it on the scheduler's grammar threads)",
        )

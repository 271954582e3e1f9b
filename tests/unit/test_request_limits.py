"""The front end's per-request limits (front_door/request_limits.py): each refusal names the
field, the value and the limit; the value at the limit passes; and through SGLang's own request
path (tests/front_end.py) every class is a 400 on /generate, chat and completions, streamed or
not, never a 500, while the same requests within the limits would be scheduled."""

from __future__ import annotations

import json
import types

import pytest

from sglang_ddtree.adapter import compat
from sglang_ddtree.front_door import request_limits as limits
from sglang_ddtree.front_door import stop_regex
from sglang_ddtree.front_door.request_limits import Sizes, check_request

SIZES = Sizes(vocab=1000, context=2048, regex_length=compat.stop_regex_length)


def _request(sampling=None, prompt=(1, 2, 3), **fields):
    obj = types.SimpleNamespace(sampling_params={"max_new_tokens": 8, **(sampling or {})}, **fields)
    return obj, list(prompt)


def _refused(sampling=None, sizes=SIZES, **fields) -> str:
    obj, prompt = _request(sampling, **fields)
    with pytest.raises(ValueError) as info:
        check_request(obj, prompt, sizes)
    return str(info.value)


def _passes(sampling=None, sizes=SIZES, **fields) -> None:
    obj, prompt = _request(sampling, **fields)
    assert check_request(obj, prompt, sizes) is None


# (fields at the limit: pass, fields one past it: refused, words the refusal must hold)
BOUNDS = {
    "top_logprobs_num": (
        dict(top_logprobs_num=20),
        dict(top_logprobs_num=21),
        ["top_logprobs_num", "=21", "[0, 20]"],
    ),
    "top_logprobs_num negative": (
        dict(top_logprobs_num=0),
        dict(top_logprobs_num=-1),
        ["top_logprobs_num", "=-1", "[0, 20]"],
    ),
    "token_ids_logprob": (
        dict(token_ids_logprob=[1] * 256),
        dict(token_ids_logprob=[1] * 257),
        ["len(token_ids_logprob)=257", "[0, 256]"],
    ),
    "logprob_start_len past the prompt": (
        dict(logprob_start_len=3),
        dict(logprob_start_len=4),
        ["logprob_start_len=4", "[0, 3]"],
    ),
    "logprob_start_len negative": (
        dict(logprob_start_len=-1),
        dict(logprob_start_len=-2),
        ["logprob_start_len=-2", "[0, 3]", "-1"],
    ),
    "logit_bias value": (
        dict(sampling={"logit_bias": {"5": 100.0, "6": -100}}),
        dict(sampling={"logit_bias": {"5": 100.5}}),
        ["logit_bias[5]=100.5", "[-100.0, 100.0]"],
    ),
    "logit_bias key": (
        dict(sampling={"logit_bias": {"999": 1.0}}),
        dict(sampling={"logit_bias": {"1000": 1.0}}),
        ["logit_bias key 1000", "[0, 1000)"],
    ),
    "logit_bias entries": (
        dict(sampling={"logit_bias": {str(i): 1.0 for i in range(1000)}}),
        dict(sampling={"logit_bias": {str(i): 1.0 for i in range(1025)}}),
        ["len(logit_bias)=1025", "[0, 1024]"],
    ),
    "stop count": (
        dict(sampling={"stop": ["x"] * 32}),
        dict(sampling={"stop": ["x"] * 33}),
        ["len(stop)=33", "[0, 32]"],
    ),
    "stop length": (
        dict(sampling={"stop": "y" * 256}),
        dict(sampling={"stop": ["y" * 257]}),
        ["len(stop", "=257", "[0, 256] characters"],
    ),
    "stop_regex bytes": (
        dict(sampling={"stop_regex": "é" * 128}),
        dict(sampling={"stop_regex": "é" * 128 + "a"}),
        ["len(stop_regex", "=257", "[0, 256] bytes"],
    ),
    "stop_token_ids count": (
        dict(sampling={"stop_token_ids": list(range(1000)) + [1] * 24}),
        dict(sampling={"stop_token_ids": [1] * 1025}),
        ["len(stop_token_ids)=1025", "[0, 1024]"],
    ),
    "stop_token_ids in the vocabulary": (
        dict(sampling={"stop_token_ids": [0, 999]}),
        dict(sampling={"stop_token_ids": [1000]}),
        ["stop_token_ids holds 1000", "[0, 1000)"],
    ),
    "stop_token_ids negative": (
        dict(sampling={"stop_token_ids": ["7"]}),
        dict(sampling={"stop_token_ids": [-1]}),
        ["stop_token_ids holds -1", "[0, 1000)"],
    ),
    "n x max_tokens": (
        dict(sampling={"n": 128, "max_new_tokens": 8192}),
        dict(sampling={"n": 128, "max_new_tokens": 8193}),
        ["n x max_tokens = 128 x 8193", "1048576"],
    ),
    "n x the context left": (
        dict(sampling={"n": 2, "max_new_tokens": None}),
        dict(sampling={"n": 2, "max_new_tokens": None}, sizes=Sizes(1000, 2**20)),
        ["n x max_tokens = 2 x 1048573", "1048576"],
    ),
    "min_new_tokens": (
        dict(sampling={"min_new_tokens": 8}),
        dict(sampling={"min_new_tokens": 9}),
        ["min_new_tokens", "=9", "[0, 8]"],
    ),
    "min_new_tokens without max_new_tokens": (
        dict(sampling={"min_new_tokens": 2045, "max_new_tokens": None}),
        dict(sampling={"min_new_tokens": 2**40, "max_new_tokens": None}),
        ["min_new_tokens", "=1099511627776", "[0, 2045]"],
    ),
    "json_schema length": (
        dict(sampling={"json_schema": "x" * 65536}),
        dict(sampling={"json_schema": "x" * 65537}),
        ["len(json_schema)=65537", "[0, 65536]"],
    ),
    "ebnf length": (
        dict(sampling={"ebnf": "x" * 10}),
        dict(sampling={"ebnf": "x" * 65537}),
        ["len(ebnf)=65537", "[0, 65536]"],
    ),
    "regex length": (
        dict(sampling={"regex": "x" * 10}),
        dict(sampling={"regex": "x" * 65537}),
        ["len(regex)=65537"],
    ),
    "temperature": (
        dict(sampling={"temperature": 100}),
        dict(sampling={"temperature": 1e300}),
        ["temperature=1e+300", "limit of 100.0"],
    ),
    "top_k": (
        dict(sampling={"top_k": 2**30}),
        dict(sampling={"top_k": 2**30 + 1}),
        ["top_k=1073741825", "[1, 1073741824]"],
    ),
    "top_k off": (
        dict(sampling={"top_k": -1}),
        dict(sampling={"top_k": 0}),
        ["top_k=0", "[1, 1073741824]", "-1: off"],
    ),
    "repetition_penalty": (
        dict(sampling={"repetition_penalty": 0.01}),
        dict(sampling={"repetition_penalty": 1e-40}),
        ["repetition_penalty=1e-40", "limit of 0.01"],
    ),
    "stop_regex match length": (
        dict(sampling={"stop_regex": "x{127}y"}),
        dict(sampling={"stop_regex": "x{128}y"}),
        ["stop_regex 'x{128}y'", "129 characters", "limit is 128"],
    ),
    "stop_regex without bound": (
        dict(sampling={"stop_regex": r"\n{2,16}"}),
        dict(sampling={"stop_regex": r"\n\n+"}),
        ["stop_regex", "without bound", "{0,16}"],
    ),
    "stop_regex SGLang cannot bound": (
        dict(sampling={"stop_regex": "(?:ab|cd){4}"}),
        dict(sampling={"stop_regex": "[^a]b"}),
        ["stop_regex '[^a]b'", "without bound", "[^x]"],
    ),
    "stop_regex ways": (
        dict(sampling={"stop_regex": "a?" * 6 + "b"}),
        dict(sampling={"stop_regex": "a?" * 7 + "b"}),
        ["in 128 ways", "8 characters", "1024", "limit of 512", "no repeat inside"],
    ),
    "stop_regex work summed": (
        dict(sampling={"stop_regex": ["a{0,15}b", "c{0,15}d"]}),
        dict(sampling={"stop_regex": ["a{0,15}b", "c{0,16}d"]}),
        ["'c{0,16}d'", "17 ways", "545", "other patterns"],
    ),
    "nested repeats": (
        dict(sampling={"stop_regex": "(?:a{1,2}){1,2}"}),
        dict(sampling={"stop_regex": "(a+)+c"}),
        ["'(a+)+c'", "without bound"],
    ),
    "nested bounded repeats": (
        dict(sampling={"stop_regex": "(?:a{1,2}){1,2}"}),
        dict(sampling={"stop_regex": "(a{1,8}){1,8}"}),
        ["too many ways"],
    ),
    "session offset": (
        dict(session_params={"id": "s", "offset": 2048}),
        dict(session_params={"id": "s", "offset": 2049}),
        ["session_params.offset=2049", "[0, 2048]"],
    ),
    "session id length": (
        dict(session_params={"id": "s" * 256}),
        dict(session_id="s" * 257),
        ["len(session_id)=257", "[0, 256]"],
    ),
    "custom_params keys": (
        dict(sampling={"custom_params": {str(i): 1 for i in range(64)}}),
        dict(sampling={"custom_params": {str(i): 1 for i in range(65)}}),
        ["len(custom_params)=65", "[0, 64]"],
    ),
    "custom_params items": (
        dict(sampling={"custom_params": {"a": [1] * 1024, "b": {"x": None}}}),
        dict(sampling={"custom_params": {"a": {str(i): 1 for i in range(1025)}}}),
        ["len(custom_params['a'])=1025", "[0, 1024]"],
    ),
    "custom label value": (
        dict(custom_labels={"team": "t" * 128}, sizes=Sizes(1000, 2048, ("team",))),
        dict(custom_labels={"team": "t" * 129}, sizes=Sizes(1000, 2048, ("team",))),
        ["len(custom_labels['team'])=129", "[0, 128]"],
    ),
}


@pytest.mark.parametrize("case", BOUNDS)
def test_each_limit_passes_at_its_bound_and_names_field_value_and_limit_past_it(case):
    inside, outside, words = BOUNDS[case]
    _passes(**inside)
    message = _refused(**outside)
    for word in words:
        assert word in message, (word, message)


# (fields: refused whatever the sizes, words of the refusal)
MALFORMED = {
    "a NaN bias": (
        dict(sampling={"logit_bias": {"5": float("nan")}}),
        ["logit_bias[5]", "finite", "nan"],
    ),
    "an infinite bias": (
        dict(sampling={"logit_bias": {"5": float("inf")}}),
        ["logit_bias[5]", "inf"],
    ),
    "a bias a string": (
        dict(sampling={"logit_bias": {"5": "big"}}),
        ["logit_bias[5]", "number", "'big'"],
    ),
    "a bias key not a number": (
        dict(sampling={"logit_bias": {"five": 1}}),
        ["logit_bias key 'five'"],
    ),
    "logit_bias a list": (dict(sampling={"logit_bias": [1, 2]}), ["logit_bias must be an object"]),
    "temperature a string": (dict(sampling={"temperature": "hot"}), ["temperature", "'hot'"]),
    "temperature NaN": (dict(sampling={"temperature": float("nan")}), ["temperature", "nan"]),
    "top_p NaN": (dict(sampling={"top_p": float("nan")}), ["top_p", "nan"]),
    "top_p a string": (dict(sampling={"top_p": "0.5"}), ["top_p", "'0.5'"]),
    "min_p infinite": (dict(sampling={"min_p": float("inf")}), ["min_p", "inf"]),
    "frequency_penalty a list": (
        dict(sampling={"frequency_penalty": [1]}),
        ["frequency_penalty", "[1]"],
    ),
    "presence_penalty NaN": (
        dict(sampling={"presence_penalty": float("nan")}),
        ["presence_penalty"],
    ),
    "top_k fractional": (dict(sampling={"top_k": 2.5}), ["top_k", "integer", "2.5"]),
    "top_k NaN": (dict(sampling={"top_k": float("nan")}), ["top_k", "integer", "nan"]),
    "max_new_tokens a string": (
        dict(sampling={"max_new_tokens": "ten"}),
        ["max_new_tokens", "'ten'"],
    ),
    "n a float": (dict(sampling={"n": 1.5}), ["n must be an integer", "1.5"]),
    "stop a number": (dict(sampling={"stop": 5}), ["stop must be a string or a list"]),
    "stop_regex that does not compile": (
        dict(sampling={"stop_regex": "(a"}),
        ["stop_regex '(a'", "not a regular"],
    ),
    "stop_token_ids a dict": (
        dict(sampling={"stop_token_ids": {"a": 1}}),
        ["stop_token_ids must be a list"],
    ),
    "json_schema an object": (
        dict(sampling={"json_schema": {"type": "object"}}),
        ["json_schema must be a string"],
    ),
    "token_ids_logprob a number": (dict(token_ids_logprob=5), ["token_ids_logprob must be a list"]),
    "top_logprobs_num a string": (dict(top_logprobs_num="all"), ["top_logprobs_num", "'all'"]),
    "stream_interval a string": (
        dict(sampling={"stream_interval": "often"}),
        ["stream_interval", "'often'"],
    ),
    "stream_interval zero": (dict(sampling={"stream_interval": 0}), ["stream_interval=0", "[1, "]),
    "ignore_eos a string": (
        dict(sampling={"ignore_eos": "yes"}),
        ["ignore_eos must be true or false", "'yes'"],
    ),
    "skip_special_tokens a number": (
        dict(sampling={"skip_special_tokens": 2}),
        ["skip_special_tokens", "2"],
    ),
    "a custom logit processor": (
        dict(custom_logit_processor='{"callable": "x"}'),
        ["custom_logit_processor", "first token"],
    ),
    "top_logprobs_num fractional": (
        dict(top_logprobs_num=2.5),
        ["top_logprobs_num", "integer", "2.5"],
    ),
    "logprob_start_len fractional": (
        dict(logprob_start_len=1.5),
        ["logprob_start_len", "integer", "1.5"],
    ),
    "max_new_tokens fractional": (
        dict(sampling={"max_new_tokens": 8.5}),
        ["max_new_tokens", "8.5"],
    ),
    "a repeat count past the parser's": (
        dict(sampling={"stop_regex": "a{4294967295}"}),
        ["stop_regex", "not a regular expression"],
    ),
    "an empty prompt": (dict(prompt=()), ["the prompt is empty"]),
    "session_params id a list": (
        dict(session_params={"id": ["a"]}),
        ["session_params.id must be a string", "['a']"],
    ),
    "session_params a list": (dict(session_params=["a"]), ["session_params must be an object"]),
    "session_params unknown key": (dict(session_params={"id": "a", "x": 1}), ["session_params"]),
    "session_params offset a string": (
        dict(session_params={"id": "a", "offset": "3"}),
        ["session_params.offset", "integer", "'3'"],
    ),
    "session_params replace a string": (
        dict(session_params={"replace": "yes"}),
        ["session_params.replace must be true or false"],
    ),
    "session_id a dict": (dict(session_id={"a": 1}), ["session_id must be a string"]),
    "custom_labels not allowed": (
        dict(custom_labels={"x": "y"}),
        ["custom_labels 'x'", "allows no custom labels"],
    ),
    "custom_labels a list": (dict(custom_labels=["x"]), ["custom_labels must be an object"]),
    "an internal sampling field": (
        dict(sampling={"is_normalized": True, "temperature": 0}),
        ["sampling_params.is_normalized", "SGLang's own"],
    ),
    "internal stop strings": (
        dict(sampling={"stop_strs": ["x" * 10**6]}),
        ["sampling_params.stop_strs"],
    ),
    "custom_params nested": (
        dict(sampling={"custom_params": {"a": {"b": {"c": 1}}}}),
        ["custom_params['a']", "JSON scalars", "{'c': 1}"],
    ),
    "custom_params a list of objects": (
        dict(sampling={"custom_params": {"a": [{"b": 1}]}}),
        ["custom_params['a']", "JSON scalars"],
    ),
    "custom_params a list": (
        dict(sampling={"custom_params": [1]}),
        ["custom_params must be an object"],
    ),
    "custom_params past int64": (
        dict(sampling={"custom_params": {"a": 2**64}}),
        ["custom_params['a']=", "int64"],
    ),
    "custom_params NaN": (
        dict(sampling={"custom_params": {"a": [float("nan")]}}),
        ["custom_params['a']", "nan"],
    ),
    **{
        f"{name} set": (dict(**{name: value}), [name, "not served by DDTREE"])
        for name, value in [
            ("input_embeds", [[0.1, 0.2]]),
            ("return_hidden_states", True),
            ("return_routed_experts", True),
            ("return_indexer_topk", True),
            ("return_sampling_mask", True),
            ("sampling_logprobs_mode", "support"),
            ("lora_path", "adapter"),
            ("lora_id", [5]),
            ("positional_embed_overrides", {"embeds": 1}),
        ]
    },
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_values_are_refused_by_name(case):
    fields, words = MALFORMED[case]
    message = _refused(**fields)
    for word in words:
        assert word in message, (word, message)


def test_an_integral_float_in_an_integer_field_is_written_back_as_the_integer():
    """A model's generation_config.json may give top_k as 20.0 (transformers keeps it a float),
    and SGLang's chat adapter puts it in every request that does not set top_k: served, with the
    integer the scheduler needs."""
    obj, prompt = _request(
        {"top_k": 20.0, "max_new_tokens": 8.0, "n": 2.0},
        top_logprobs_num=3.0,
        logprob_start_len=1.0,
    )
    assert check_request(obj, prompt, SIZES) is None
    assert obj.sampling_params == {"top_k": 20, "max_new_tokens": 8, "n": 2}
    assert (obj.top_logprobs_num, obj.logprob_start_len) == (3, 1)
    assert all(type(v) is int for v in (*obj.sampling_params.values(), obj.top_logprobs_num))


def test_a_session_turn_may_bring_no_new_tokens():
    """A session continues its own context, so an empty prompt is SGLang's to judge there."""
    _passes(prompt=(), session_params={"id": "s"})
    assert "the prompt is empty" in _refused(prompt=())


def test_unserved_fields_at_their_defaults_pass():
    """What SGLang's OpenAI adapters set on every request (False, None, empty) is not a request
    for the feature."""
    _passes(
        return_hidden_states=False,
        return_routed_experts=False,
        return_sampling_mask=False,
        image_data=None,
        video_data=[],
        input_embeds=None,
        lora_path=None,
        sampling_logprobs_mode=None,
        custom_labels={},
        session_params=None,
        session_id=None,
    )
    _passes(
        session_params={
            "id": "s",
            "rid": "r",
            "offset": 0,
            "replace": True,
            "drop_previous_output": False,
        },
        session_id=None,
    )
    _passes(custom_labels={"team": "a", "tier": 2}, sizes=Sizes(1000, 2048, ("team", "tier")))
    _passes(image_data=["http://x/a.png"])  # SGLang's start-up warm-up of an image model sends one


def _call(text="hi", input_ids=None, token_ids_logprob=None, **sampling):
    return types.SimpleNamespace(
        text=text,
        input_ids=input_ids,
        sampling_params=sampling,
        token_ids_logprob=token_ids_logprob,
    )


@pytest.mark.parametrize(
    "obj,words",
    [
        (_call(n=129), ["n=129", "[1, 128]"]),
        (_call(n=0), ["n=0", "[1, 128]"]),
        (_call(n=2.0), ["n must be an integer", "2.0"]),
        (_call(n=10**9), ["n=1000000000", "[1, 128]"]),
        (_call(text=["x"] * 1025), ["the number of prompts=1025", "[1, 1024]"]),
        (_call(text=None, input_ids=[[1]] * 1025), ["the number of prompts=1025"]),
        (_call(text=["x"] * 9, n=128), ["prompts x n=1152", "[1, 1024]"]),
        (
            types.SimpleNamespace(
                text=["x", "y"],
                input_ids=None,
                token_ids_logprob=None,
                sampling_params=[{"n": 1}, {"n": 200}],
            ),
            ["n=200"],
        ),
        (_call(token_ids_logprob=[1] * 257), ["len(token_ids_logprob)=257", "[0, 256]"]),
        (
            _call(text=["a", "b"], token_ids_logprob=[[1], [1] * 257]),
            ["len(token_ids_logprob)=257"],
        ),
    ],
)
def test_a_calls_size_is_bounded_before_it_is_split(obj, words):
    with pytest.raises(ValueError) as info:
        limits.check_batch(obj)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_a_call_within_the_bounds_passes_before_it_is_split():
    for obj in (
        _call(n=128),
        _call(text=["x"] * 1024),
        _call(text=["x"] * 8, n=128),
        _call(text=None, input_ids=[1, 2, 3], n=4),
        _call(token_ids_logprob=[1] * 256),
        types.SimpleNamespace(text="x", input_ids=None, sampling_params=None),
    ):
        assert limits.check_batch(obj) is None


def test_the_stop_regex_bounds_keep_a_search_short():
    """The costliest patterns the bounds admit, each searched over the longest tail the
    scheduler decodes for it (its longest match + 1 + a round's 15 more tokens, each as long as
    a long vocabulary token, 73 characters), take milliseconds, where `(a+)+c` took 0.8 s on 24
    characters and patterns of 256 ways and characters took a second on such a tail."""
    import re
    import time

    worst = [
        ".{0,3}" + "." * 123 + "x",
        "(?:a|a)" + "." * 126 + "x",
        "[ab]{0,15}" + "." * 16 + "c",
        "a?" * 6 + "b",
        "(?:a{1,2}){1,3}" + "." * 14 + "x",
    ]
    for pattern in worst:
        _passes(sampling={"stop_regex": pattern})
        tail = "a" * (73 * (compat.stop_regex_length(pattern) + 16))
        tic = time.perf_counter()
        for _ in range(5):
            re.search(pattern, tail)
        assert (time.perf_counter() - tic) / 5 < 0.02, pattern


def test_one_sample_may_run_to_a_context_longer_than_the_product_bound():
    long_context = Sizes(vocab=1000, context=2**21)
    _passes(sampling={"max_new_tokens": None}, sizes=long_context)
    _passes(sampling={"max_new_tokens": 2**21 - 3}, sizes=long_context)
    assert "limit of 2097152" in _refused(
        sampling={"n": 2, "max_new_tokens": None}, sizes=long_context
    )


def test_a_long_value_is_named_by_its_start_and_length():
    message = _refused(sampling={"stop": ["z" * 10_000]})
    assert "zzz" in message and "(10002 characters)" in message and len(message) < 300


def test_requests_within_every_limit_pass_and_unknown_sizes_skip_their_bounds():
    _passes(
        sampling={
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "min_p": 0.05,
            "frequency_penalty": 0.5,
            "presence_penalty": -0.5,
            "repetition_penalty": 1.2,
            "min_new_tokens": 2,
            "n": 4,
            "sampling_seed": -3,
            "logit_bias": {"17": 2.5, 18: -1},
            "stop": ["\n\n", "END"],
            "stop_regex": r"\d{1,8}\.",
            "stop_token_ids": [2, 3],
            "ebnf": "root ::= 'a'",
        },
        top_logprobs_num=5,
        token_ids_logprob=[1, 2],
        logprob_start_len=0,
        custom_logit_processor=None,
    )
    obj = types.SimpleNamespace(
        sampling_params={"logit_bias": {"10000": 1.0}, "n": 100, "max_new_tokens": None}
    )
    assert check_request(obj, None, Sizes(None, None)) is None  # no vocabulary, no context


# ------------------------------------------------------------ through SGLang's request path


@pytest.fixture(scope="module")
def front_end():
    pytest.importorskip("sglang")
    from sglang_ddtree import DEMO_PAIR_DIR
    from tests.front_end import FrontEnd

    return FrontEnd(DEMO_PAIR_DIR / "target", context=2048)


def _bodies(chat: dict, generate: dict, top: dict, completion: dict | None = None) -> dict:
    """The same option on the three endpoints: chat fields, /generate sampling fields, top-level
    /generate fields, and completions fields (default: chat's)."""
    msg = [{"role": "user", "content": "def f(x):"}]
    completion = chat if completion is None else completion
    return {
        "/v1/chat/completions": {"model": "x", "messages": msg, "max_tokens": 8, **chat},
        "/v1/completions": {"model": "x", "prompt": "def f(x):", "max_tokens": 8, **completion},
        "/generate": {
            "text": "def f(x):",
            "sampling_params": {"max_new_tokens": 8, **generate},
            **top,
        },
    }


SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
# (chat / completions fields, /generate sampling fields, /generate top-level fields[,
# completions fields where they differ from chat's])
THROUGH_SGLANG = {
    "top_logprobs": (
        {"logprobs": True, "top_logprobs": 10**6},
        {},
        {"return_logprob": True, "top_logprobs_num": 10**6},
        {"logprobs": 10**6},
    ),
    "logit_bias NaN": (
        {"logit_bias": {"5": float("nan")}},
        {"logit_bias": {"5": float("nan")}},
        {},
    ),
    "logit_bias 1e300": ({"logit_bias": {"5": 1e300}}, {"logit_bias": {"5": 1e300}}, {}),
    "stop strings": ({"stop": ["x"] * 1000}, {"stop": ["x"] * 1000}, {}),
    "a long stop string": ({"stop": "x" * 100_000}, {"stop": "x" * 100_000}, {}),
    "stop_token_ids past the vocabulary": (
        {"stop_token_ids": [10**9]},
        {"stop_token_ids": [10**9]},
        {},
    ),
    "many stop_token_ids": (
        {"stop_token_ids": [1] * 100_000},
        {"stop_token_ids": [1] * 100_000},
        {},
    ),
    "n x max_tokens": ({"n": 128, "max_tokens": 10**7}, {"n": 128, "max_new_tokens": 10**7}, {}),
    "a huge regex": ({"regex": "a" * 100_000}, {"regex": "a" * 100_000}, {}),
    "a huge json_schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA},
            }
        },
        {"json_schema": json.dumps(SCHEMA)},
        {},
        {"json_schema": json.dumps(SCHEMA)},
    ),
    "temperature 1e300": ({"temperature": 1e300}, {"temperature": 1e300}, {}),
    "top_k 2**40": ({"top_k": 2**40}, {"top_k": 2**40}, {}),
    "min_p NaN": ({"min_p": float("nan")}, {"min_p": float("nan")}, {}),
    "repetition_penalty 1e-40": ({"repetition_penalty": 1e-40}, {"repetition_penalty": 1e-40}, {}),
    "seed 2**70": ({"seed": 2**70}, {"sampling_seed": 2**70}, {}),
    "min_tokens 10**12": ({"min_tokens": 10**12}, {"min_new_tokens": 10**12}, {}),
    "custom_logit_processor": (
        {"custom_logit_processor": "{}"},
        {},
        {"custom_logit_processor": "{}"},
    ),
    "n 10**9": ({"n": 10**9}, {"n": 10**9}, {}),
    "a backtracking stop_regex": ({"stop_regex": "(a+)+c"}, {"stop_regex": "(a+)+c"}, {}),
    "return_hidden_states": ({"return_hidden_states": True}, {}, {"return_hidden_states": True}),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", THROUGH_SGLANG)
def test_every_class_is_a_400_on_every_endpoint_streamed_or_not(front_end, case, stream):
    for path, body in _bodies(*THROUGH_SGLANG[case]).items():
        answer = front_end.answer(path, json.dumps({**body, "stream": stream}).encode())
        assert answer.status == 400, (path, answer)
        assert answer.streamed == (stream and path == "/generate"), (path, answer)


def test_the_same_requests_within_the_limits_would_be_scheduled(front_end):
    """The negative control: every option above at a value inside its limit passes SGLang's
    whole request path and DDTREE's."""
    chat = {
        "logprobs": True,
        "top_logprobs": 5,
        "logit_bias": {"5": 2.0},
        "stop": ["\n\n"],
        "stop_token_ids": [2],
        "n": 2,
        "temperature": 0.7,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "seed": 7,
    }
    generate = {k: v for k, v in chat.items() if k not in ("logprobs", "top_logprobs", "seed")}
    generate.update(sampling_seed=7, min_new_tokens=2)
    top = {"return_logprob": True, "top_logprobs_num": 5}
    for stream in (False, True):
        for path, body in _bodies(chat, generate, top).items():
            assert front_end.answer(path, {**body, "stream": stream}).status == 200, path


def test_sglangs_own_checks_still_answer_for_what_they_cover(front_end):
    """What SGLang range-checks itself stays SGLang's (its message, a 400)."""
    for sampling, words in [
        ({"temperature": -1.0}, "temperature must be a non-negative"),
        ({"top_p": 2.0}, "top_p must be in (0, 1]"),
        ({"frequency_penalty": 5.0}, "frequency_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 2]"),
        ({"logit_bias": {"5": 1.0}, "json_schema": "{}", "regex": "a"}, "Only one of json_schema"),
    ]:
        answer = front_end.answer("/generate", {"text": "hi", "sampling_params": sampling})
        assert answer.status == 400 and words in answer.message, answer


def test_other_algorithms_are_left_to_sglang(front_end):
    from tests.front_end import FrontEnd

    plain = FrontEnd.__new__(FrontEnd)
    plain._server_args, plain._lock = front_end._server_args, front_end._lock
    plain.in_flight = set()
    plain.tokenizer, plain.manager = (
        front_end.tokenizer,
        types.SimpleNamespace(
            **{
                **vars(front_end.manager),
                "server_args": types.SimpleNamespace(
                    speculative_algorithm=None,
                    enable_custom_logit_processor=True,
                    return_hidden_states_mode=None,
                ),
            }
        ),
    )
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4, "logit_bias": {"5": 1e300}}}
    assert plain.answer("/generate", body).status == 200  # SGLang alone takes it
    assert front_end.answer("/generate", body).status == 400


def test_the_limits_are_the_readmes():
    """docs/requests.md's per-request limits table (the README points to it) states every bound
    with its number."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "docs" / "requests.md").read_text()
    table = readme[readme.index("### Per-request limits") :]
    table = table[: table.index("\n\n", table.index("|"))]
    for number in (
        limits.MAX_TOP_LOGPROBS,
        limits.MAX_TOKEN_IDS_LOGPROB,
        int(limits.MAX_LOGIT_BIAS),
        limits.MAX_LOGIT_BIAS_ENTRIES,
        limits.MAX_STOPS,
        limits.MAX_STOP_CHARS,
        limits.MAX_STOP_TOKEN_IDS,
        f"{limits.MAX_SAMPLED_TOKENS:,}",
        f"{limits.MAX_GRAMMAR_CHARS:,}",
        int(limits.MAX_TEMPERATURE),
        limits.MIN_REPETITION_PENALTY,
        stop_regex.MAX_STOP_REGEX_MATCH,
        stop_regex.MAX_STOP_REGEX_WORK,
        limits.MAX_SAMPLES,
        f"{limits.MAX_BATCH:,}",
        f"{limits.MAX_BATCH_SAMPLES:,}",
        limits.MAX_LABEL_CHARS,
        limits.MAX_SESSION_ID_CHARS,
        limits.MAX_CUSTOM_PARAMS,
        f"{limits.MAX_CUSTOM_PARAM_ITEMS:,}",
    ):
        assert str(number) in table, number
    for name in limits.UNSERVED:
        assert f"`{name}`" in readme, name


def test_a_stop_pattern_with_huge_repeat_counts_is_refused_at_once():
    """Counting ways takes a few steps whatever the repeat counts (a loop over them took 0.5 s of
    the front end's event loop for 18 repeats of 2^32 in one 252-byte pattern)."""
    import time

    pattern = "a{,4294967294}" * 18
    tic = time.perf_counter()
    assert "stop_regex" in _refused(sampling={"stop_regex": pattern[:252]})
    assert stop_regex._regex_shape(
        stop_regex.re_parser.parse("(?:a{,4294967294}){,4294967294}"), {}
    )
    assert time.perf_counter() - tic < 0.05
    assert stop_regex._repeat_ways(0, 4294967294, 1) == stop_regex._MANY
    assert stop_regex._repeat_ways(2, 4, 3) == 9 + 27 + 81

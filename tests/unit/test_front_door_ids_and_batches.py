"""The front door's request ids (front_door/identity.py) and per-prompt shapes
(front_door/batch_shape.py), through SGLang 0.5.23's own request classes, normalize and
_init_req_state (tests/front_end.py): each class is a 400 naming the field on a DDTREE server,
where SGLang alone answers 500 (IndexError, TypeError), serves it silently cut, or takes an id
whose abort would reach other requests; and the SGLang behaviour each guard rests on is read from
its source, so an upgrade that changes it fails here."""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import types

import pytest

from sglang_ddtree.front_door import batch_shape, checks, identity

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def front_ends():
    pytest.importorskip("sglang")
    from sglang_ddtree import DEMO_PAIR_DIR
    from tests.front_end import FrontEnd

    return (
        FrontEnd(DEMO_PAIR_DIR / "target", context=2048),
        FrontEnd(DEMO_PAIR_DIR / "target", context=2048, algorithm="DFLASH"),
    )


def _one(**fields) -> dict:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 4}, **fields}


def _two(**fields) -> dict:
    return {"text": ["hi", "yo"], "sampling_params": {"max_new_tokens": 4}, **fields}


def _chat(**fields) -> dict:
    return {
        "model": "x",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **fields,
    }


def _completions(**fields) -> dict:
    return {"model": "x", "prompt": ["hi", "yo"], "max_tokens": 4, **fields}


# (path, body, words DDTREE's 400 holds, what SGLang alone answers)
IDS = {
    "a list for one prompt": (
        "/generate",
        _one(rid=["q", "r"]),
        "is a list for one prompt",
        500,  # TypeError: unhashable type: 'list' (rid_to_state keyed by it)
    ),
    "a list for one chat": ("/v1/chat/completions", _chat(rid=["q", "r"]), "one prompt", 500),
    "empty": ("/generate", _one(rid=""), "1 to 256 printable characters, got 0", 200),
    "too long": ("/generate", _one(rid="q" * 257), "got 257", 200),
    "unprintable": ("/generate", _one(rid="q\nr"), "with unprintable ones", 200),
    "the health check's": ("/generate", _one(rid="HEALTH_CHECK_7"), "reserves", 200),
    "the health check's, on chat": (
        "/v1/chat/completions",
        _chat(rid="my-HEALTH_CHECK"),
        "holds 'HEALTH_CHECK'",
        200,
    ),
    "the start of a uuid": ("/generate", _one(rid="3"), "'' + 32 hex digits", 200),
    "the start of a responses id": ("/generate", _one(rid="resp_"), "'resp_' + 32 hex", 200),
    "the start of a health id": ("/generate", _one(rid="HEALTH"), "'HEALTH_CHECK_'", 200),
    "twice in a batch": ("/generate", _two(rid=["q", "q"]), "'q' twice", 400),
    "one the start of another": ("/generate", _two(rid=["q", "qr"]), "which begins with it", 200),
    "short of the batch": ("/generate", _two(rid=["q"]), "1 ids for 2 prompts", 400),
    "short of a completions batch": ("/v1/completions", _completions(rid=["q"]), "1 ids", 400),
    "not a string (Vertex builds it untyped)": (None, None, "must be a string", None),
}


@pytest.mark.parametrize("case", sorted(IDS))
@pytest.mark.parametrize("stream", [False, True])
def test_a_request_id_is_one_string_that_reaches_no_other_request(front_ends, case, stream):
    ddtree, plain = front_ends
    path, body, words, sglang = IDS[case]
    if path is None:
        with pytest.raises(ValueError, match=words):
            identity.check_ids(["q", 5], single=False, prompts=2)
        return
    body = {**body, "stream": stream}
    answer = ddtree.answer(path, body)
    assert answer.status == 400 and words in answer.message, answer
    assert "rid" in answer.message and answer.streamed == (stream and path == "/generate")
    assert plain.answer(path, body).status == sglang  # SGLang alone


def test_good_ids_are_served(front_ends):
    ddtree, _ = front_ends
    uuid = "0123456789abcdef" * 2
    for body in (
        _one(rid="client-7"),
        _one(rid=uuid),  # a whole uuid4 hex is no other id's start
        _one(rid="resp_x"),
        _two(rid="batch"),  # SGLang names them batch_0, batch_1
        _two(rid=["q-1", "q-2"]),
        _one(rid=["q"], sampling_params={"max_new_tokens": 4, "n": 2}),  # n > 1: a batch of one
    ):
        assert ddtree.answer("/generate", body).status == 200, body
    assert ddtree.answer("/v1/chat/completions", _chat(rid="chat-1")).status == 200


def test_an_id_in_flight_or_one_that_begins_or_ends_it_is_refused(front_ends):
    """SGLang refuses an id that is in flight itself, but takes one that an in-flight id begins
    with: its client's disconnect (an abort by prefix) would end the in-flight request."""
    ddtree, plain = front_ends
    for front in front_ends:
        front.in_flight = {"job-1_0", "job-1_1"}  # a batch named "job-1", being served
    try:
        for rid, words in (
            ("job-1_0", "is in flight"),
            ("job-1", "an in-flight request's id begin one with the other"),
            ("job-1_0-retry", "begin one with the other"),
        ):
            for path, body in (
                ("/generate", _one(rid=rid)),
                ("/v1/chat/completions", _chat(rid=rid)),
            ):
                answer = ddtree.answer(path, body)
                assert answer.status == 400 and words in answer.message, (rid, answer)
        assert ddtree.answer("/generate", _two(rid="job-1")).status == 400  # job-1_0, job-1_1
        assert ddtree.answer("/generate", _one(rid="job-2")).status == 200
        assert plain.answer("/generate", _one(rid="job-1_0")).status == 400  # SGLang's own check
        assert plain.answer("/generate", _one(rid="job-1")).status == 200  # its abort: both
    finally:
        for front in front_ends:
            front.in_flight = set()


def test_sglangs_own_health_check_passes_and_a_client_cannot_pose_as_it():
    """The /health handler names its request HEALTH_CHECK_<uuid hex> and passes its own HTTP
    request, whose path a client cannot give a body to."""
    ddtree = types.SimpleNamespace(
        server_args=types.SimpleNamespace(speculative_algorithm="DDTREE"), rid_to_state={}
    )

    async def generate_request(manager, obj, request=None):
        yield "served"

    def call(path):
        obj = types.SimpleNamespace(
            rid="HEALTH_CHECK_" + "ab" * 16, text=None, input_ids=[0], sampling_params={}
        )
        request = types.SimpleNamespace(url=types.SimpleNamespace(path=path))

        async def first():
            gen = checks._bounded_call(generate_request, ddtree, obj, request)
            try:
                return await gen.__anext__()
            finally:
                await gen.aclose()

        return asyncio.run(first())

    assert call("/health") == "served" and call("/health_generate") == "served"
    assert call("/api/v2/health") == "served"  # under a --root-path
    with pytest.raises(ValueError, match="reserves"):
        call("/generate")


def test_the_in_flight_check_reads_the_managers_own_ids():
    flying = {f"{i:032x}" for i in range(5000)} | {"alpha_0", "alpha_1"}
    identity.check_ids("beta", single=True, prompts=1, in_flight=flying)
    for rid in ("alpha", "alpha_0", "alpha_1x"):
        with pytest.raises(ValueError, match="rid='alpha"):
            identity.check_ids(rid, single=True, prompts=1, in_flight=flying)
    with pytest.raises(ValueError, match="is in flight"):
        identity.check_ids(["beta", f"{7:032x}"], single=False, prompts=2, in_flight=flying)


def _batch_value(name):
    """A value of `name`'s own type for one prompt (SGLang's request model takes it)."""
    return {
        "sampling_params": {"max_new_tokens": 4},
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 1,
        "return_sampling_mask": False,
        "sampling_logprobs_mode": None,
        "return_hidden_states": False,
        "custom_logit_processor": None,
        "lora_path": None,
        "watermark": None,
        "extra_key": "k",
        "cache_salt": "s",
        "kv_hints": None,
        "bootstrap_host": "h",
        "bootstrap_port": 1,
        "bootstrap_room": 1,
        "bootstrap_pair_key": "k",
        "decode_tp_size": 1,
    }[name]


SHAPED = [n for n in batch_shape.ONE_PER_PROMPT if n not in batch_shape.UNSERVED_EARLY]


@pytest.mark.parametrize("name", SHAPED)
def test_a_per_prompt_list_of_the_wrong_length_names_the_field_and_both_lengths(front_ends, name):
    ddtree, plain = front_ends
    for entries in (1, 3):
        body = _two(**{name: [_batch_value(name)] * entries})
        answer = ddtree.answer("/generate", body)
        assert answer.status == 400, (name, answer)
        assert f"{name} has {entries} entries for 2 prompts" in answer.message
    # one per prompt passes the shape (and meets the field's own checks after it)
    right = ddtree.answer("/generate", _two(**{name: [_batch_value(name)] * 2}))
    assert "entries for" not in right.message


# SGLang alone: a short list raised IndexError in __getitem__ (a 500) for these, before any
# per-request check; the rest it checks itself (a 400) or takes
SGLANG_500 = [
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "custom_logit_processor",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
]


@pytest.mark.parametrize("name", SGLANG_500)
def test_sglang_alone_answers_a_short_per_prompt_list_with_a_500(front_ends, name):
    _, plain = front_ends
    answer = plain.answer("/generate", _two(**{name: [_batch_value(name)]}))
    assert answer.status == 500 and "IndexError" in answer.message, answer


@pytest.mark.parametrize(
    "fields,words,sglang",
    [
        ({"sampling_params": []}, "sampling_params has 0 entries for 2 prompts", 500),
        ({"sampling_params": [{"max_new_tokens": 4}] * 3}, "has 3 entries", 200),  # cut
        ({"top_logprobs_num": [1, 2, 3]}, "top_logprobs_num has 3 entries", 200),  # cut
        ({"token_ids_logprob": [[1]]}, "token_ids_logprob has 1 entries for 2", 500),
        ({"video_data": ["v"]}, "video_data has 1 entries for 2 prompts", 500),
        ({"audio_data": []}, "audio_data has 0 entries", 500),
        ({"modalities": ["image"]}, "modalities has 1 entries", 500),
        ({"multi_item_delimiter_indices": [[1]]}, "has 1 entries for 2", 500),
        ({"token_indices_to_pool": [1]}, "one list of 1 ids for 2 prompts", 500),
        ({"lora_path": [None]}, "lora_path has 1 entries for 2", 500),
        ({"input_ids": None, "input_embeds": [[]]}, "input_embeds=[[]] is not served", 500),
        ({"positional_embed_overrides": {"a": 1}}, "is not served", 500),  # KeyError: 0
    ],
)
def test_batch_shapes_sglang_answers_with_a_500_or_cuts(front_ends, fields, words, sglang):
    ddtree, plain = front_ends
    body = _two(**fields)
    if "input_embeds" in fields:
        body.pop("text")
    for stream in (False, True):
        answer = ddtree.answer("/generate", {**body, "stream": stream})
        assert answer.status == 400 and words in answer.message, answer
    assert plain.answer("/generate", body).status == sglang


def test_one_prompt_takes_one_value_and_n_makes_a_batch_of_one(front_ends):
    """A list for one prompt reached the scheduler as it came (SGLang normalizes only a batch),
    where it reads one bool or int per request; with n > 1 SGLang makes a batch of one."""
    ddtree, plain = front_ends
    for fields in ({"return_logprob": [True]}, {"bootstrap_room": [1, 2]}):
        answer = ddtree.answer("/generate", _one(**fields))
        assert answer.status == 400 and "for one prompt: give it one value" in answer.message
        assert plain.answer("/generate", _one(**fields)).status == 200
    n2 = {"max_new_tokens": 4, "n": 2}
    assert ddtree.answer("/generate", _one(sampling_params=[n2])).status == 200
    answer = ddtree.answer("/generate", _one(sampling_params=[n2, n2]))
    assert "sampling_params has 2 entries for 1 prompts" in answer.message


def test_untyped_shapes_are_refused_too():
    """The Vertex route and the offline engine build requests without SGLang's request model:
    a mix of ids and id lists, a list in a per-prompt list, a sampling_params that is no
    object."""
    call = types.SimpleNamespace
    for obj, words in (
        (call(text=["a", "b"], token_ids_logprob=[[1], 2]), "mixes ids and lists of ids"),
        (call(text="a", token_ids_logprob=[[1], [2]]), "2 lists of ids for one prompt"),
        (call(text=["a", "b"], token_ids_logprob=[[1], [[2]]]), r"token_ids_logprob\[1\]"),
        (call(text=["a", "b"], return_logprob=[True, [False]]), r"return_logprob\[1\]"),
        (call(text=["a", "b"], sampling_params=[{}, 5]), r"sampling_params\[1\] must be"),
    ):
        with pytest.raises(ValueError, match=words):
            batch_shape.check_shape(obj)
    batch_shape.check_shape(call(text=["a", "b"], token_ids_logprob=[1, 2]))  # one for all


def _sglang_function(module: str, cls: str, name: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None:
        pytest.skip(f"{module} is not installed")
    tree = ast.parse(open(spec.origin).read())
    klass = next(c for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls)
    fn = next(f for f in klass.body if getattr(f, "name", None) == name)
    return ast.unparse(fn)


def test_the_sglang_behaviour_the_id_rules_rest_on():
    """Read from SGLang 0.5.23's source: the scheduler aborts by prefix and drops a health-check
    id while busy; the tokenizer manager never aborts an empty id, ignores a health check's
    abort, and keys its states by the id; the /health handler names its request with the
    reserved prefix. An upgrade that changes one of these changes what identity.py must hold."""
    pytest.importorskip("sglang")
    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

    assert HEALTH_CHECK_RID_PREFIX == identity.RESERVED
    scheduler = "sglang.srt.managers.scheduler"
    abort = _sglang_function(scheduler, "Scheduler", "abort_request")
    assert "req.rid.startswith(recv_req.rid)" in abort
    intake = _sglang_function(scheduler, "Scheduler", "process_input_requests")
    assert "is_health_check_generate_req(recv_req) and (not self.is_fully_idle(" in intake
    manager = "sglang.srt.managers.tokenizer_manager"
    assert "if not abort_all and (not rid):" in _sglang_function(
        manager, "TokenizerManager", "abort_request"
    )
    assert "if is_health_check_generate_req(recv_obj):\n        return" in _sglang_function(
        manager, "TokenizerManager", "_handle_abort_req"
    )
    assert "rid in self.rid_to_state or rid in rids" in _sglang_function(
        manager, "TokenizerManager", "_init_req_state"
    )
    http = importlib.util.find_spec("sglang.srt.entrypoints.http_server")
    assert 'rid = f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"' in open(http.origin).read()
    assert tuple(checks.HEALTH_PATHS) == ("/health", "/health_generate")

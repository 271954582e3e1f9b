"""/health on a DDTREE server: what SGLang 0.5.23's handler answers (read from its source) and
the front door's guard for the one request that kept it from answering at all, a long prompt
text tokenized on the event loop (front_door/long_text.py): counted in a thread, refused when it
cannot fit, while the loop serves on."""

from __future__ import annotations

import asyncio
import importlib.util
import time
import types

import pytest

from sglang_ddtree.front_door import checks, long_text

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from sglang_ddtree import DEMO_PAIR_DIR

    return AutoTokenizer.from_pretrained(DEMO_PAIR_DIR / "target")


def _manager(tokenizer, context=2048, truncate=False):
    return types.SimpleNamespace(
        server_args=types.SimpleNamespace(speculative_algorithm="DDTREE"),
        tokenizer=tokenizer,
        context_len=context,
        allow_auto_truncate=truncate,
        rid_to_state={},
    )


def _call(manager, text):
    """The generate_request hook around a stand-in original; (its first item, the loop's longest
    stall in seconds while the hook ran)."""

    async def generate_request(manager, obj, request=None):
        yield "served"

    async def run():
        obj = types.SimpleNamespace(text=text, input_ids=None, sampling_params={})
        stalls, done = [], asyncio.Event()

        async def tick():  # the event loop's other work: a 10 ms timer
            while not done.is_set():
                tic = time.perf_counter()
                await asyncio.sleep(0.01)
                stalls.append(time.perf_counter() - tic)

        ticker = asyncio.create_task(tick())
        gen = checks._bounded_call(generate_request, manager, obj)
        try:
            return await gen.__anext__(), max(stalls or [0.0])
        finally:
            done.set()
            await ticker
            await gen.aclose()

    return asyncio.run(run())


def test_a_long_text_that_cannot_fit_is_refused_before_sglang_tokenizes_it(tokenizer):
    text = "word " * 400_000  # 2 MB, 400,000 tokens
    with pytest.raises(ValueError, match=r"text is \d+ tokens \(2000000 characters\), not below"):
        _call(_manager(tokenizer), text)
    with pytest.raises(ValueError, match=r"text\[1\] is \d+ tokens"):
        _call(_manager(tokenizer), ["hi", text])
    other = _manager(tokenizer)
    other.server_args.speculative_algorithm = "DFLASH"
    assert _call(other, text)[0] == "served"  # SGLang's to tokenize, on its loop


def test_the_loop_is_not_stalled_by_the_count(tokenizer):
    """The hook's own work on the loop stays short while a text that takes the tokenizer a
    while is counted (the Rust tokenizer releases the GIL)."""
    text = "word " * 400_000
    stalls = []

    async def run():
        done = asyncio.Event()

        async def tick():
            while not done.is_set():
                tic = time.perf_counter()
                await asyncio.sleep(0.01)
                stalls.append(time.perf_counter() - tic)

        ticker = asyncio.create_task(tick())
        try:
            await long_text.check_text_lengths(tokenizer, text, 2048)
        except ValueError:
            pass
        done.set()
        await ticker

    tic = time.perf_counter()
    asyncio.run(run())
    counted = time.perf_counter() - tic
    print(f"counted in {counted:.2f} s, longest loop stall {max(stalls):.3f} s")
    assert len(stalls) >= 3, (counted, stalls)  # the timer fired during the count
    assert max(stalls) < max(0.1, counted / 2), (counted, max(stalls))


def test_texts_that_fit_or_are_short_pass_and_truncation_turns_it_off(tokenizer):
    fits = "w" * (long_text.LONG_TEXT + 1)  # one long word: few tokens
    assert _call(_manager(tokenizer, context=10**6), "word " * 60_000)[0] == "served"
    assert _call(_manager(tokenizer), "hi " * 1000)[0] == "served"  # short: not counted here
    assert _call(_manager(tokenizer, truncate=True), "word " * 60_000)[0] == "served"
    tokens = len(tokenizer([fits])["input_ids"][0])
    assert _call(_manager(tokenizer, context=tokens + 1), fits)[0] == "served"
    with pytest.raises(ValueError, match=f"not below the context of {tokens} tokens"):
        _call(_manager(tokenizer, context=tokens), fits)


def test_sglangs_health_handler_answers_within_its_timeout_by_any_scheduler_output():
    """Read from SGLang 0.5.23's source: /health and /health_generate share one handler that
    sends a one-token request and answers 200 as soon as any scheduler output arrives after it
    began (a busy scheduler acknowledges a skipped health check after its next batch), else 503
    after SGLANG_HEALTH_CHECK_TIMEOUT (20 s) polled each second, marking the server UnHealthy;
    the one-token request goes through the generate_request hook, which lets SGLang's own id
    pass (test_front_door_ids_and_batches)."""
    spec = importlib.util.find_spec("sglang.srt.entrypoints.http_server")
    if spec is None:
        pytest.skip("sglang is not installed")
    source = open(spec.origin).read()
    assert 'HEALTH_CHECK_TIMEOUT = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))' in source
    handler = source[
        source.index('@app.get("/health")') : source.index('@app.get("/get_model_info")')
    ]
    assert '@app.get("/health_generate")' in handler
    assert "while time.time() < tic + HEALTH_CHECK_TIMEOUT:" in handler
    assert "await asyncio.sleep(1)" in handler
    assert "last_receive_tstamp > tic" in handler
    assert "ServerStatus.UnHealthy" in handler
    assert "generate_request(gri, request)" in handler

"""scripts/fuzz_requests.py against a stand-in server on 127.0.0.1 that answers as a DDTREE server's
front end does (SGLang's request path with DDTREE's hook, tests/front_end.py): every malformed
case is judged, a 5xx, a 4xx without a message, a streamed refusal without its error event and a
changed greedy text are caught, and the same front end without DDTREE's limits fails."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.fixtures import load_script
from tests.front_end import admin_paths


@pytest.fixture(scope="module")
def fuzz():
    return load_script("fuzz_requests")


class _Handler(BaseHTTPRequestHandler):
    """A stand-in server whose answers are a DDTREE server's front end's (tests/front_end.py:
    SGLang's request classes and checks with DDTREE's hook) for everything the fuzz sends; the
    good greedy requests and the probe get a fixed text."""

    front_end = None  # set by the fixture
    broken: set[str] = set()  # behaviours switched on by a test
    greedy_calls = 0
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def _reply(self, code, body, raw: bytes | None = None):
        data = raw if raw is not None else json.dumps(body).encode() if body is not None else b""
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            return self._reply(503 if "unhealthy" in self.broken else 200, None)
        if self.path == "/server_info":
            algorithm = self.front_end.manager.server_args.speculative_algorithm
            return self._reply(200, {"speculative_algorithm": algorithm})
        return self._reply(404, {"error": "not found"})

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            b = json.loads(raw)
        except json.JSONDecodeError:
            b = None
        if self.path == "/generate" and isinstance(b, dict) and _good(b):
            return self._good(b)
        if isinstance(b, dict) and str(b.get("rid")).startswith("fuzz-hold") and b.get("stream"):
            return self._hold(raw, b["rid"])
        if "open_admin" in self.broken and self.path.split("?")[0] in admin_paths():
            return self._reply(200, {})
        if isinstance(b, dict) and "n500" in self.broken and b.get("n") == 5000:
            return self._reply(500, {"error": "internal"})
        if isinstance(b, dict) and "mute" in self.broken and b.get("max_tokens") == 0:
            return self._reply(400, None)
        answer = self.front_end.answer(self.path, raw)
        if answer.streamed and "unstreamed" not in self.broken:  # SGLang's streamed refusal
            event = {"error": {"message": answer.message, "code": 400}}
            return self._reply(200, None, f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())
        if answer.status == 200:
            return self._reply(200, {"text": "served", "choices": []})
        return self._reply(answer.status, {"error": answer.message})

    def _hold(self, raw: bytes, rid: str):
        """A streamed request held in flight until its client leaves (at most 30 s): its id in
        the front end's in-flight ids meanwhile, as SGLang's rid_to_state holds it."""
        answer = self.front_end.answer(self.path, raw)
        if answer.status != 200:
            return self._reply(answer.status, {"error": answer.message})
        self.front_end.in_flight.add(rid)
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                self.wfile.write(b'data: {"text": "x"}\n\n')
                self.wfile.flush()
                time.sleep(0.02)
        except OSError:
            pass  # the client left
        finally:
            self.front_end.in_flight.discard(rid)

    def _good(self, b):
        text = str(b.get("text"))
        # "drift": one good prompt's text changes once the fuzz has begun, that is after the
        # fuzz's first pass over its good prompts (GOOD; the probe is not one of them). The
        # calls arrive on several threads in any order: counted under a lock.
        with _Handler.lock:
            if text.startswith("def f") and not text.startswith("def fibonacci"):
                _Handler.greedy_calls += 1
            begun = _Handler.greedy_calls > 4  # fuzz_requests.GOOD's four prompts
        drift = "drift" in self.broken and begun and text.startswith("def f1")
        return self._reply(200, {"text": "drift" if drift else "ok"})


def _good(b) -> bool:
    """The fuzz's own good requests: its greedy prompts, the probe and the liveness check."""
    return (
        str(b.get("text")).startswith(("def f", "def fibonacci"))
        or b.get("text") == "hi"
        and (b.get("sampling_params") == {"max_new_tokens": 1})
    )


@pytest.fixture(scope="module")
def front_ends():
    pytest.importorskip("sglang")
    from sglang_ddtree import DEMO_PAIR_DIR
    from tests.front_end import FrontEnd

    ddtree = FrontEnd(DEMO_PAIR_DIR / "target", context=2048)
    plain = FrontEnd(DEMO_PAIR_DIR / "target", context=2048, algorithm="DFLASH")
    return {"DDTREE": ddtree, "DFLASH": plain}


@pytest.fixture()
def url(front_ends):
    _Handler.broken, _Handler.greedy_calls = set(), 0
    _Handler.front_end = front_ends["DDTREE"]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_ddtree_front_end_passes(fuzz, url):
    """Every malformed case, the per-request limits' classes on chat and /generate streamed and
    not among them, gets a 4xx (a streamed /generate: SGLang's error event) from SGLang's request
    path with DDTREE's hook."""
    report = fuzz.run(url, rounds=2, context=2048, seed=0)
    assert report["ok"], report["bad"][:5]
    in_flight = 6  # the same id, one the held id begins, its start; on /generate and chat
    assert report["cases"] == 2 * len(fuzz.corpus(2048)) + in_flight + len(fuzz.ADMIN)
    assert report["ignored_with_200"] == ["unknown field"]
    assert report["probe_unchanged"] and report["admin_probed"]  # /server_info names DDTREE
    assert report["health"]["ok"] and report["health"]["probes"] >= 2


def test_the_corpus_holds_every_limit_on_both_endpoints_streamed_and_not(fuzz):
    names = [name for name, *_ in fuzz.corpus(2048)]
    for limit, chat, *_ in fuzz.LIMITS:
        for stream in ("", " (streamed)"):
            assert f"generate: {limit}{stream}" in names
            assert chat is None or f"chat: {limit}{stream}" in names
    assert sum(chat is not None for _, chat, *_ in fuzz.LIMITS) >= 25


def test_a_front_end_without_ddtrees_limits_fails_the_fuzz(fuzz, url, front_ends):
    """The negative control: SGLang's request path alone (another algorithm, DDTREE's hook off)
    schedules or 500s what DDTREE refuses: the fuzz names those cases."""
    _Handler.front_end = front_ends["DFLASH"]
    assert not fuzz.serves_ddtree(url)  # the admin phase would change a plain server's state
    report = fuzz.run(url, rounds=1, context=2048, seed=0, admin=True)
    bad = {r["case"] for r in report["bad"]}
    assert not report["ok"]
    for case in (
        "generate: rid a list for one prompt",  # a 500: rid_to_state keyed by a list
        "chat: rid a list (streamed)",
        "generate: rid the health check's",  # served: dropped while the server is busy
        "generate: rid the start of a uuid (streamed)",  # served: its abort reaches others
        "generate batch: sampling_params short of the batch",  # IndexError: a 500
        "generate batch: token_ids_logprob short (streamed)",
        "completions batch: bootstrap_host short",
        "generate batch: top_logprobs_num past the batch",  # served, cut silently
        "in flight: /generate one it begins",  # served beside the held request
        "admin: /pause_generation",  # served to a client without a key
        "admin: /set_internal_state",
    ):
        assert case in bad, (case, sorted(bad)[:20])
    for case in (
        "generate: logit_bias 1e300",
        "chat: logit_bias NaN (streamed)",
        "generate: stop_token_ids past the vocabulary",
        "generate: top_k 1e300",
        "chat: top_logprobs past the vocabulary",
        "vertex: top_logprobs_num a float",
        "generate: session_params id a list",
        "chat: stop_regex that backtracks",
        "generate: 2000 prompts",
    ):
        assert case in bad, (case, sorted(bad)[:20])


def test_a_5xx_a_silent_4xx_a_silent_stream_and_a_changed_text_are_caught(fuzz, url):
    _Handler.broken = {"n500", "mute", "drift", "unstreamed"}
    report = fuzz.run(url, rounds=1, context=2048, seed=0)
    verdicts = {r["case"]: r["verdict"] for r in report["bad"]}
    assert verdicts.pop("n in the thousands") == "got 500"
    assert verdicts.pop("max_tokens 0") == "4xx without a message"
    # without the error event, a streamed /generate refusal is a plain 400: not SGLang's shape,
    # but a refusal; the judge takes a 200 stream only with a 4xx error event first
    assert all(v == "ok" for v in verdicts.values())
    assert not report["good_text_unchanged"] and not report["ok"]
    assert fuzz.judge(200, 'data: {"text": "hi"}\n\ndata: [DONE]', False, streamed=True) != "ok"
    assert fuzz.judge(200, 'data: {"error": {"message": "no", "code": 400}}', False, True) == "ok"
    assert fuzz.judge(200, 'data: {"error": {"message": "no", "code": 500}}', False, True) != "ok"


def test_an_open_admin_endpoint_and_a_failed_health_check_are_caught(fuzz, url):
    _Handler.broken = {"open_admin", "unhealthy"}
    report = fuzz.run(url, rounds=1, context=2048, seed=0)
    verdicts = {r["case"]: r["verdict"] for r in report["bad"]}
    assert {c for c in verdicts if c.startswith("admin: ")} == {
        f"admin: {path}" for path, _ in fuzz.ADMIN
    }
    assert verdicts["admin: /flush_cache"] == "got 200: the admin gate answers 403"
    assert len(verdicts) == len({p for p, _ in fuzz.ADMIN})
    assert not report["health"]["ok"] and report["health"]["failed"] == report["health"]["probes"]
    assert not report["ok"]


def test_the_corpus_holds_every_id_and_batch_class_streamed_and_not(fuzz):
    names = [name for name, *_ in fuzz.corpus(2048)]
    for limit, path, _ in fuzz.IDS:
        prefix = "generate: " if path == fuzz.GENERATE else ""
        for stream in ("", " (streamed)"):
            assert f"{prefix}{limit}{stream}" in names
    for limit, _ in fuzz.BATCHES:
        assert f"generate batch: {limit} (streamed)" in names
    assert len(fuzz.IDS) >= 15 and len(fuzz.BATCHES) >= 20 and len(fuzz.ADMIN) >= 15


def test_the_corpus_is_seeded(fuzz):
    assert fuzz.corpus(2048, 1) == fuzz.corpus(2048, 1) != fuzz.corpus(2048, 2)
    assert sorted(fuzz.corpus(2048, 1)) == sorted(fuzz.corpus(2048, 2))

"""scripts/fuzz_requests.py against a stand-in server on 127.0.0.1 that validates like a careful
server: every malformed case is judged, a 5xx or a 4xx without a message is caught, and a changed
greedy text is caught."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.fixtures import load_script


@pytest.fixture(scope="module")
def fuzz():
    return load_script("fuzz_requests")


def _chat_error(b) -> str | None:
    msgs = b.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return "messages must be a non-empty list"
    for m in msgs:
        if m.get("role") not in ("system", "user", "assistant") or not isinstance(
            m.get("content"), str
        ):
            return "bad message"
        if len(m["content"].split()) > 2048:
            return "prompt longer than the context"
    mt, t, n = b.get("max_tokens", 1), b.get("temperature", 1.0), b.get("n", 1)
    if not isinstance(mt, int) or not 1 <= mt <= 4096 or not isinstance(t, int | float) or t < 0:
        return "bad max_tokens / temperature"
    if b.get("top_p", 1.0) > 1 or not isinstance(n, int) or not 1 <= n <= 16:
        return "bad top_p / n"
    return None


def _generate_error(b) -> str | None:
    sp = b.get("sampling_params")
    if not isinstance(sp, dict) or sp.get("max_new_tokens", 1) < 0:
        return "bad sampling_params"
    if "input_ids" in b:
        return None if all(0 <= i < 1000 for i in b["input_ids"]) else "token id out of range"
    return None if isinstance(b.get("text"), str) else "text must be a string"


class _Handler(BaseHTTPRequestHandler):
    broken: set[str] = set()  # behaviours switched on by a test
    greedy_calls = 0

    def log_message(self, *args):
        pass

    def _reply(self, code, body):
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            b = json.loads(raw)
            assert isinstance(b, dict)
        except (json.JSONDecodeError, AssertionError):
            return self._reply(400, {"error": "body must be a JSON object"})
        if self.path == "/generate":
            error = _generate_error(b)
            if error:
                return self._reply(400, {"error": error})
            if str(b.get("text")).startswith("def f"):
                _Handler.greedy_calls += 1
            # "drift": one good prompt's text changes once the fuzz has begun
            drift = "drift" in self.broken and _Handler.greedy_calls > 4
            drift &= str(b.get("text")).startswith("def f1")
            return self._reply(200, {"text": "drift" if drift else "ok"})
        if "n500" in self.broken and b.get("n") == 5000:
            return self._reply(500, {"error": "internal"})
        if "mute" in self.broken and b.get("max_tokens") == 0:
            return self._reply(400, None)
        error = _chat_error(b)
        return self._reply(400, {"error": error}) if error else self._reply(200, {"choices": []})


@pytest.fixture()
def url():
    _Handler.broken, _Handler.greedy_calls = set(), 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_careful_server_passes(fuzz, url):
    report = fuzz.run(url, rounds=2, context=2048, seed=0)
    assert report["ok"], report
    assert report["cases"] == 2 * len(fuzz.corpus(2048)) and report["ignored_with_200"] == [
        "unknown field"
    ]


def test_a_5xx_a_silent_4xx_and_a_changed_text_are_caught(fuzz, url):
    _Handler.broken = {"n500", "mute", "drift"}
    report = fuzz.run(url, rounds=1, context=2048, seed=0)
    verdicts = {r["case"]: r["verdict"] for r in report["bad"]}
    assert verdicts == {"n in the thousands": "got 500", "max_tokens 0": "4xx without a message"}
    assert not report["good_text_unchanged"] and not report["ok"]


def test_the_corpus_is_seeded(fuzz):
    assert fuzz.corpus(2048, 1) == fuzz.corpus(2048, 1) != fuzz.corpus(2048, 2)
    assert sorted(fuzz.corpus(2048, 1)) == sorted(fuzz.corpus(2048, 2))

"""scripts/soak.py's client logic against a stand-in HTTP server on 127.0.0.1: the request mix,
each outcome (completed, streamed, refused, cancelled), the summary, and the localhost guard."""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.fixtures import load_script


@pytest.fixture(scope="module")
def soak():
    yield load_script("soak")
    sys.modules.pop("soak", None)


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _json(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except BrokenPipeError:  # the client cancelled
            pass

    def do_GET(self):
        if self.path == "/health":
            self._json(200, {})
        else:
            self._json(200, {"loads": [{"num_used_tokens": 0}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/generate":
            sp = body["sampling_params"]
            if sp.get("n", 1) > 1:
                return self._json(400, {"error": "n > 1 is not supported"})
            if sp["max_new_tokens"] > 100:
                time.sleep(1.0)  # slow: a cancel lands first
            return self._json(200, {"text": "x", "meta_info": {"completion_tokens": 3}})
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            if body["max_tokens"] == 7:  # SGLang streams an error with status 200
                self.wfile.write(b'data: {"error": {"message": "boom"}}\n\n')
                return None
            if body["max_tokens"] == 9:  # a request the scheduler refused, streamed
                self.wfile.write(b'data: {"error": {"message": "no logprobs", "code": 400}}\n\n')
                return None
            for _ in range(4):
                self.wfile.write(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n')
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            return None
        return self._json(200, {"choices": [], "usage": {"completion_tokens": 5}})


@pytest.fixture(scope="module")
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_mix_is_seeded_and_covers_every_kind_of_request(soak):
    a, b = soak.request_mix(400, 2048, seed=1), soak.request_mix(400, 2048, seed=1)
    assert a == b and a != soak.request_mix(400, 2048, seed=2)
    assert {r.api for r in a} == {"chat", "chat_stream", "generate"}
    assert {r.temperature for r in a} == {0.0, 0.7, 1.0} and {r.n for r in a} == {1, 2}
    assert min(r.max_tokens for r in a) == 1 and max(r.max_tokens for r in a) <= 512
    words = [len(r.prompt.split()) for r in a]
    assert min(words) == 1 and max(words) == int((2048 - 520) / 1.5)
    cancelled = sum(r.cancel_after_s is not None for r in a) / len(a)
    assert 0.2 < cancelled < 0.4 and any(r.stop for r in a)
    assert all(r.top_p == 1.0 and r.top_k == -1 for r in a if r.temperature == 0)
    assert {r.option for r in a} == {None, *soak.OPTIONS}
    assert 0.25 < sum(r.option is not None for r in a) / len(a) < 0.45


def test_a_mix_without_an_option_changes_only_the_requests_that_carried_it(soak):
    mix = soak.request_mix(200, 2048, seed=3)
    kept = soak.without(mix, "logprobs")
    assert len(kept) == len(mix) and "logprobs" not in {r.option for r in kept}
    for before, after in zip(mix, kept, strict=True):
        if before.option == "logprobs":
            assert after.option is None and after.prompt == before.prompt
        else:
            assert after == before
    assert any(r.option == "logprobs" for r in mix)  # the mix had some to leave out


def test_each_option_reaches_both_apis_as_its_client_sends_it(soak):
    R = soak.Request
    chat = {o: soak.payload(R("chat", "a", 5, 0.7, option=o))[1] for o in soak.OPTIONS}
    assert chat["logprobs"]["logprobs"] is True and chat["logprobs"]["top_logprobs"] == 3
    assert chat["penalties"]["frequency_penalty"] == 0.5
    assert chat["json_schema"]["response_format"]["json_schema"]["schema"] == soak.SCHEMA
    assert chat["min_p"]["min_p"] == 0.05
    gen = {o: soak.payload(R("generate", "a", 5, 0.7, option=o))[1] for o in soak.OPTIONS}
    assert gen["logprobs"]["return_logprob"] is True
    assert gen["penalties"]["sampling_params"]["frequency_penalty"] == 0.5
    assert json.loads(gen["json_schema"]["sampling_params"]["json_schema"]) == soak.SCHEMA
    assert gen["min_p"]["sampling_params"]["min_p"] == 0.05
    assert "logprobs" not in soak.payload(R("chat", "a", 5, 0.7))[1]


def test_each_outcome_and_the_summary(soak, url):
    R = soak.Request
    rows = [
        soak.send(url, R("generate", "a", 5, 0.0)),
        soak.send(url, R("chat", "a", 5, 0.7, top_k=20, stop=["x"])),
        soak.send(url, R("chat_stream", "a", 5, 1.0)),
        soak.send(url, R("generate", "a", 5, 0.0, n=2)),
        soak.send(url, R("generate", "a", 200, 0.0, cancel_after_s=0.2)),
    ]
    assert [r["outcome"] for r in rows] == [
        "completed",
        "completed",
        "completed",
        "refused",
        "cancelled",
    ]
    assert [r["tokens"] for r in rows[:3]] == [3, 5, 4]  # the stream: 4 content chunks
    assert rows[4]["latency_s"] < 0.9  # the cancel did not wait for the response
    summary = soak.summarize(rows, wall_s=2.0)
    assert (summary["completed"], summary["refused"], summary["cancelled"]) == (3, 1, 1)
    assert summary["failed"] == 0 and summary["tokens_per_s"] == 6.0
    assert "n > 1" in summary["errors"][0]
    assert soak.health(url) == {"probe": "x", "healthy": True, "kv_tokens_in_use": 0}
    # a stream that reports an error, a server that is gone (even for a request meant to be
    # cancelled): failures, not completions or cancellations
    assert soak.send(url, R("chat_stream", "a", 7, 0.0))["outcome"] == "failed"
    # a streamed error with a 4xx code is a refusal (SGLang's scheduler-side 400s stream so)
    refused = soak.send(url, R("chat_stream", "a", 9, 0.0))
    assert (refused["outcome"], refused["status"]) == ("refused", 400)
    gone = "http://127.0.0.1:9"  # nothing listens on the discard port here
    assert soak.send(gone, R("generate", "a", 5, 0.0, cancel_after_s=0.5))["outcome"] == "failed"
    assert soak.health(gone) == {"probe": None, "healthy": False, "kv_tokens_in_use": None}


def test_the_log_scan_reads_from_a_byte_offset(soak, tmp_path):
    log = tmp_path / "server.log"
    log.write_bytes("progress ██████ 100%\nTraceback (old)\n".encode())
    start = log.stat().st_size
    with open(log, "ab") as f:
        f.write(b"ok\nTraceback (most recent call last):\n")
    assert soak.log_problems(log, start) == ["Traceback"]
    assert soak.log_problems(log, log.stat().st_size) == []


def test_only_local_servers(soak):
    assert soak.check_local("http://127.0.0.1:30000/") == "http://127.0.0.1:30000"
    with pytest.raises(SystemExit, match="127.0.0.1 / localhost only"):
        soak.check_local("http://10.0.0.5:30000")


def test_the_completion_timeline_shows_a_stall(soak):
    rows = [{"outcome": "completed", "t_end": 100.0 + t} for t in (1, 2, 35, 36, 37)]
    rows.append({"outcome": "cancelled", "t_end": 105.0})
    assert soak.completion_timeline(rows, 100.0) == [2, 0, 0, 3]
    assert soak.completion_timeline([], 0.0) == []


def test_a_checked_soak_reports_its_checks_and_reads_the_log_window(soak, url, tmp_path):
    log = tmp_path / "server.log"
    log.write_text("Traceback (before the soak)\n")
    start = log.stat().st_size
    R = soak.Request
    row = soak.checked_soak(
        url, [R("generate", "a", 5, 0.0)], 10, 2, log, start, loads_required=True
    )
    assert row["completed"] == 1 and row["log_problems"] == []
    assert row["checks"] == {
        "probe_unchanged": True,
        "healthy": True,
        "kv_idle": True,
        "log_clean": True,
    }
    log.write_text(log.read_text() + "a memory leak\n")
    assert soak.checked_soak(url, [], 10, 2, log, start)["log_problems"] == ["leak"]


def test_the_slopes_are_least_squares_after_the_warm_up(soak):
    """MiB per minute over the samples after the warm-up: a steady 3 MiB/min growth reads 3, a
    flat line with noise about 0, and the warm-up's jump is left out."""
    grow = [(t, 1000 + 3 * t / 60 + (500 if t < 300 else 0), 2000.0) for t in range(0, 1800, 30)]
    slopes = soak.memory_slopes(grow, warm_up_s=300)
    assert slopes["rss_mib_per_min"] == pytest.approx(3.0, abs=1e-6)
    assert slopes["gpu_mib_per_min"] == 0.0 and slopes["fitted"] == 50
    assert slopes["rss_first_last_mib"] == (1015.0, 1000 + 3 * 1770 / 60)
    noisy = [(t, 1000 + (5 if (t // 30) % 2 else -5), None) for t in range(0, 1800, 30)]
    flat = soak.memory_slopes(noisy, warm_up_s=300)
    assert abs(flat["rss_mib_per_min"]) < 0.05 and flat["gpu_mib_per_min"] is None
    assert soak.memory_slopes(grow[:2], warm_up_s=0)["rss_mib_per_min"] is None  # too few


def test_the_sampler_reads_a_process_groups_rss(soak):
    """The sampler finds a process group's members in /proc and sums their resident sets: a
    child that allocates 200 MiB raises the group's RSS by about that much."""
    import os
    import subprocess
    import sys
    import time

    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; x = bytearray(200 << 20); "
            "x[::4096] = b'1' * len(x[::4096]); print('ready', flush=True); "
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert child.stdout.readline().strip() == b"ready"
        pids = soak.group_pids(os.getpgid(child.pid))
        assert pids == [child.pid]
        assert 190 < soak.rss_mib(pids) < 400
        with soak.MemorySampler(os.getpgid(child.pid), every_s=0.2) as sampler:
            time.sleep(0.7)
        assert len(sampler.samples) >= 4 and all(190 < s[1] < 400 for s in sampler.samples)
        assert [s[0] for s in sampler.samples] == sorted(s[0] for s in sampler.samples)
    finally:
        child.kill()
        child.wait()

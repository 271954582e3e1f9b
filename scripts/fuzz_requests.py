"""Bad requests, fuzzed (issue 15, part 4): a seeded, bounded corpus of malformed requests sent to
a running server while good greedy requests run beside them.

    python scripts/fuzz_requests.py http://127.0.0.1:31010 [--rounds 3] [--context 2048] \
        [--out fuzz.json]

Every malformed request must get a 4xx with a message (a few, such as unknown top-level
fields, may also be ignored with a 200: OpenAI-compatible servers differ there, and the report
says which); none may get a 5xx or break the connection. The good requests' greedy text during
the fuzz must equal their text before it (exactly so only on a batch-invariant server, e.g.
--enable-deterministic-inference: otherwise bf16 near-ties can flip with the batch), and the
server must still answer after it.
Only 127.0.0.1 / localhost servers are accepted. Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

CHAT, GENERATE = "/v1/chat/completions", "/generate"
GOOD = [f"def f{i}(x):\n    return" for i in range(4)]


def _chat(**fields) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8, **fields}  # fmt: skip


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
        ("prompt over the context", CHAT,
         _chat(messages=[{"role": "user", "content": long_prompt}]), False),
        ("generate: text a number", GENERATE, {"text": 5, "sampling_params": {}}, False),
        ("generate: sampling_params a list", GENERATE, {"text": "hi", "sampling_params": [1]},
         False),
        ("generate: negative token id", GENERATE,
         {"input_ids": [1, -7, 3], "sampling_params": {"max_new_tokens": 4}}, False),
        ("generate: token id past the vocabulary", GENERATE,
         {"input_ids": [1, 10**9], "sampling_params": {"max_new_tokens": 4}}, False),
        ("generate: max_new_tokens negative", GENERATE,
         {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, False),
    ]  # fmt: skip
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


def judge(status: int | None, text: str, may_be_ignored: bool) -> str:
    """ "ok" (a 4xx with a message, or an allowed 200), else what was wrong."""
    if status is not None and 400 <= status < 500:
        return "ok" if text.strip() else "4xx without a message"
    if status == 200 and may_be_ignored:
        return "ok"
    return f"got {status}"


def greedy(url: str, prompt: str) -> str | None:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
    status, text = post(url + GENERATE, json.dumps(body).encode())
    return json.loads(text)["text"] if status == 200 else None


def run(url: str, rounds: int, context: int, seed: int) -> dict:
    cases = [c for r in range(rounds) for c in corpus(context, seed + r)]
    rows = []
    with cf.ThreadPoolExecutor(max_workers=8) as pool:
        before = list(pool.map(lambda p: greedy(url, p), GOOD))  # batched as during the fuzz
        during = [pool.submit(greedy, url, p) for p in GOOD * rounds]
        for name, path, body, may in cases:
            status, text = post(url + path, body)
            rows.append({"case": name, "status": status, "verdict": judge(status, text, may),
                         "message": text[:200]})  # fmt: skip
        during = [f.result() for f in during]
    alive = post(url + GENERATE, json.dumps({"text": "hi", "sampling_params": {
        "max_new_tokens": 1}}).encode())[0] == 200  # fmt: skip
    bad = [r for r in rows if r["verdict"] != "ok"]
    same = all(t == before[i % len(GOOD)] for i, t in enumerate(during)) and None not in before
    return {"cases": len(rows), "bad": bad, "ignored_with_200": sorted({r["case"] for r in rows
            if r["status"] == 200}), "good_text_unchanged": same, "alive_after": alive,
            "ok": not bad and same and alive}  # fmt: skip


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

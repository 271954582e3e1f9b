"""A bounded mixed soak of running servers: seeded requests through the OpenAI
chat API (streaming and not) and /generate, prompt lengths from one token to near the context,
max_tokens 1-512, temperature 0 / 0.7 / 1.0 with top-p / top-k, n 1 and 2, stop strings, about
a third with one client option (logprobs, penalties, a JSON schema or min_p), about 30 %
cancelled at a random moment, more requests in flight than the server runs at once. The same
request list goes to every server, one server after another.

    python scripts/soak.py --server ddtree=http://127.0.0.1:31010 \
        --server dflash=http://127.0.0.1:31050 [--requests 1000] [--seconds 300] \
        [--concurrency 32] [--context 2048] [--log ddtree=PATH] [--out soak.json]

Before and after each server's soak: a fixed greedy probe (its text must not change), /health,
and /v1/loads (the KV pool back to idle); with --log NAME=PATH, the server log's new lines are
searched for a Traceback or a leak report; with --memory NAME=PID, that server's process group's
host RSS and the GPUs' memory in use are sampled every --sample-every s (30) and the report gives
their least-squares slopes in MiB per minute after --warm-up s (300), and every sample. Only 127.0.0.1 / localhost servers are accepted.
Report per server: completed, cancelled, refused (4xx) and failed requests (also per option),
p50 / p99 latency, generated tokens per second; exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import os
import random
import statistics
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

WORDS = (
    "def return self value list data item index result config print while import "
    "class yield lambda None True False for in if else try except with open read"
).split()
PROBE = {"text": "def fibonacci(n):", "sampling_params": {"max_new_tokens": 64, "temperature": 0}}


@dataclass
class Request:
    api: str  # "chat" | "chat_stream" | "generate"
    prompt: str
    max_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stop: list[str] = field(default_factory=list)
    cancel_after_s: float | None = None  # abort the HTTP request after this long
    option: str | None = None  # one of OPTIONS: what clients send beside the prompt


# per-request options clients send: a server that does not serve one answers 4xx,
# which counts as refused, not failed
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}
OPTIONS = ("logprobs", "penalties", "json_schema", "min_p")


def request_mix(count: int, context: int, seed: int = 0) -> list[Request]:
    """`count` seeded requests; prompt lengths up to about context - 520 tokens (a word and a
    space are about 1.5 tokens for these tokenizers, so the words are capped by that)."""
    rng = random.Random(seed)
    out = []
    max_words = max(1, int((context - 520) / 1.5))
    for _ in range(count):
        words = rng.choice([1, rng.randint(2, 64), rng.randint(64, max(64, max_words)), max_words])
        temperature = rng.choice([0.0, 0.7, 1.0])
        out.append(
            Request(
                api=rng.choice(["chat", "chat_stream", "generate"]),
                prompt=" ".join(rng.choice(WORDS) for _ in range(words)),
                max_tokens=rng.choice([1, rng.randint(2, 64), rng.randint(64, 512)]),
                temperature=temperature,
                top_p=rng.choice([1.0, 0.9]) if temperature else 1.0,
                top_k=rng.choice([-1, 20]) if temperature else -1,
                n=rng.choice([1, 1, 1, 2]),
                stop=rng.choice([[], [], ["\n\n"], ["return", "yield"]]),
                cancel_after_s=rng.uniform(0.05, 3.0) if rng.random() < 0.3 else None,
                option=rng.choice([None] * 7 + list(OPTIONS)),
            )
        )
    return out


def without(reqs: list[Request], option: str) -> list[Request]:
    """The same requests with `option` left out (they go without any): for a server that does
    not serve that option at all, so that its soak measures what it does serve."""
    return [replace(r, option=None) if r.option == option else r for r in reqs]


def payload(req: Request) -> tuple[str, dict]:
    """(path, JSON body) of one request."""
    if req.api == "generate":
        sp = {
            "max_new_tokens": req.max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "n": req.n,
            "stop": req.stop,
        }
        body = {"text": req.prompt, "sampling_params": sp}
        if req.option == "logprobs":
            body.update(return_logprob=True, top_logprobs_num=3)
        elif req.option == "penalties":
            sp.update(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1)
        elif req.option == "json_schema":
            sp["json_schema"] = json.dumps(SCHEMA)
        elif req.option == "min_p":
            sp["min_p"] = 0.05
        return "/generate", body
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": req.prompt}],
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "n": req.n,
        "stream": req.api == "chat_stream",
    }
    if req.top_k > 0:
        body["top_k"] = req.top_k
    if req.stop:
        body["stop"] = req.stop
    if req.option == "logprobs":
        body.update(logprobs=True, top_logprobs=3)
    elif req.option == "penalties":
        body.update(frequency_penalty=0.5, presence_penalty=0.3)
    elif req.option == "json_schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "item", "schema": SCHEMA},
        }
    elif req.option == "min_p":
        body["min_p"] = 0.05
    return "/v1/chat/completions", body


def send(url: str, req: Request, timeout: float = 600) -> dict:
    """One request: {"outcome": completed | cancelled | refused | failed, "status", "latency_s",
    "tokens"}. A cancel closes the connection mid-request (the server must abort it)."""
    path, body = payload(req)
    http = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    t0 = time.time()
    limit = req.cancel_after_s or timeout
    try:
        with urllib.request.urlopen(http, timeout=limit) as r:
            tokens = 0
            if body.get("stream"):
                for line in r:  # server-sent events: a JSON chunk per data line
                    if time.time() - t0 > limit:
                        return _row("cancelled", r.status, t0, tokens)
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:  # SGLang streams an error with status 200
                        error = chunk["error"]
                        code = error.get("code") if isinstance(error, dict) else None
                        refused = isinstance(code, int) and 400 <= code < 500  # e.g. a 400
                        return _row(
                            "refused" if refused else "failed",
                            code or 200,
                            t0,
                            tokens,
                            str(error)[:300],
                        )
                    tokens += sum(
                        bool((c.get("delta") or {}).get("content"))
                        for c in chunk.get("choices", [])
                    )
            else:
                out = json.loads(r.read())
                tokens = _tokens(out)
        return _row("completed", 200, t0, tokens)
    except urllib.error.HTTPError as e:
        return _row(
            "refused" if 400 <= e.code < 500 else "failed",
            e.code,
            t0,
            0,
            e.read().decode(errors="replace")[:300],
        )
    except (OSError, urllib.error.URLError) as e:  # timeouts, resets, refusals
        reason = getattr(e, "reason", e)
        if req.cancel_after_s is not None and isinstance(reason, TimeoutError):
            return _row("cancelled", None, t0, 0)  # our own deadline, not the server's doing
        return _row("failed", None, t0, 0, repr(e)[:300])


def _tokens(out) -> int:
    if isinstance(out, list):  # /generate with n > 1
        return sum(_tokens(o) for o in out)
    if "usage" in out and out["usage"]:
        return int(out["usage"].get("completion_tokens", 0))
    return int(out.get("meta_info", {}).get("completion_tokens", 0))


def _row(outcome, status, t0, tokens, error=None) -> dict:
    now = time.time()
    row = {
        "outcome": outcome,
        "status": status,
        "latency_s": now - t0,
        "tokens": tokens,
        "t_end": now,
    }
    return {**row, "error": error} if error else row


def summarize(rows: list[dict], wall_s: float) -> dict:
    """Counts per outcome, latency percentiles of completed requests, generated tokens / s."""
    done = sorted(r["latency_s"] for r in rows if r["outcome"] == "completed")

    def pct(q):
        return round(done[min(len(done) - 1, int(q * len(done)))], 3) if done else None

    counts = {
        k: sum(r["outcome"] == k for r in rows)
        for k in ("completed", "cancelled", "refused", "failed")
    }
    errors = sorted(
        {str(r.get("error") or r["status"]) for r in rows if r["outcome"] in ("refused", "failed")}
    )[:10]
    return {
        **counts,
        "p50_s": pct(0.5),
        "p99_s": pct(0.99),
        "mean_s": round(statistics.mean(done), 3) if done else None,
        "tokens_per_s": round(sum(r["tokens"] for r in rows) / max(wall_s, 1e-9), 1),
        "wall_s": round(wall_s, 1),
        "errors": errors,
    }


def check_local(url: str) -> str:
    host = urllib.parse.urlparse(url).hostname
    if host not in ("127.0.0.1", "localhost"):
        raise SystemExit(f"soak.py sends traffic to 127.0.0.1 / localhost only, not {host}")
    return url.rstrip("/")


def health(url: str) -> dict:
    """Probe text, /health status and the KV tokens in use (None where the server has no
    /v1/loads)."""
    status, probe = _post(url + "/generate", PROBE)
    ok = _get(url + "/health")[0] == 200
    loads = _get(url + "/v1/loads")[1]
    per_rank = loads.get("loads", []) if isinstance(loads, dict) else loads
    used = sum(r.get("num_used_tokens", 0) for r in per_rank) if per_rank else None
    return {
        "probe": probe.get("text") if status == 200 else None,
        "healthy": ok,
        "kv_tokens_in_use": used,
    }


def _post(url, body):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}
    except (OSError, json.JSONDecodeError):  # a server that is gone
        return None, {}


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, json.loads(r.read() or b"{}")
    except (urllib.error.HTTPError, urllib.error.URLError, json.JSONDecodeError):
        return None, {}


def soak(url: str, reqs: list[Request], seconds: float, concurrency: int) -> dict:
    deadline = time.time() + seconds
    t0 = time.time()

    def one(req):
        if time.time() >= deadline:
            return None
        return {**send(url, req), "option": req.option}

    with cf.ThreadPoolExecutor(max_workers=concurrency) as pool:
        rows = [r for r in pool.map(one, reqs) if r is not None]
    by_option = {}  # option -> outcome -> count
    for r in rows:
        counts = by_option.setdefault(r["option"] or "none", {})
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    return {
        **summarize(rows, time.time() - t0),
        "sent": len(rows),
        "by_option": by_option,
        "completed_per_10s": completion_timeline(rows, t0),
    }


def completion_timeline(rows: list[dict], t0: float, step: float = 10.0) -> list[int]:
    """Completed requests per `step` seconds since t0: a stalled server shows as empty
    buckets followed by a burst."""
    ends = [r["t_end"] - t0 for r in rows if r["outcome"] == "completed"]
    if not ends:
        return []
    counts = [0] * (int(max(ends) // step) + 1)
    for e in ends:
        counts[int(e // step)] += 1
    return counts


def checked_soak(
    url: str,
    reqs: list[Request],
    seconds: float,
    concurrency: int,
    log: Path | None = None,
    start: int = 0,
    loads_required: bool = False,
) -> dict:
    """`soak` between two `health` probes: its summary plus "checks" (the probe's text
    unchanged, /health, the KV cache idle (with loads_required, /v1/loads must answer), no
    Traceback or leak in `log` past byte `start`), "log_problems" and the KV tokens in use."""
    before = health(url)
    result = soak(url, reqs, seconds, concurrency)
    time.sleep(2)  # let aborted requests drain
    after = health(url)
    problems = log_problems(log, start) if log is not None else []
    idle = (0,) if loads_required else (0, None)
    checks = {
        "probe_unchanged": before["probe"] is not None and after["probe"] == before["probe"],
        "healthy": after["healthy"],
        "kv_idle": after["kv_tokens_in_use"] in idle,
        "log_clean": not problems,
    }
    return {
        **result,
        "checks": checks,
        "log_problems": problems,
        "kv_tokens_in_use_after": after["kv_tokens_in_use"],
    }


# --- memory over a long soak: the server's host RSS and the GPU's memory, sampled every 30 s ---


def group_pids(pgid: int) -> list[int]:
    """The processes of process group `pgid` (a server started in its own session: its main
    process, SGLang's scheduler and detokenizer), from /proc."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid:  # after the name: state, ppid, pgrp
            pids.append(int(stat.parent.name))
    return sorted(pids)


def rss_mib(pids: list[int]) -> float:
    """The summed resident set of `pids`, MiB (VmRSS)."""
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += sum(
            int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")
        )
    return total / 1024


def gpu_used_mib(pids: list[int] | None = None) -> float | None:
    """GPU memory in use, MiB (nvidia-smi): that of `pids` where nvidia-smi lists them (it
    cannot inside some containers), else every visible GPU's; None without nvidia-smi."""
    apps = _nvidia_smi("--query-compute-apps=pid,used_memory") if pids else None
    rows = [line.split(",") for line in (apps or "").splitlines() if "," in line]
    mine = [float(used) for pid, used in rows if pid.strip().isdigit() and int(pid) in pids]
    if mine:
        return sum(mine)
    total = _nvidia_smi("--query-gpu=memory.used")
    return None if total is None else float(sum(float(x) for x in total.split()))


def _nvidia_smi(query: str) -> str | None:
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


class MemorySampler:
    """Every `every_s` seconds in a thread: (seconds since start, the group's host RSS MiB, its
    GPU memory in use MiB, gpu_used_mib's). Use as a context manager around the soak."""

    def __init__(self, pgid: int, every_s: float = 30.0) -> None:
        import threading

        self.pgid, self.every_s, self.samples = pgid, every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._t0 = time.time()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        self._sample()  # the last one, after the soak

    def _sample(self) -> None:
        pids = group_pids(self.pgid)
        self.samples.append(
            (round(time.time() - self._t0, 1), round(rss_mib(pids), 1), gpu_used_mib(pids))
        )

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.every_s):
                return


def memory_slopes(samples: list[tuple], warm_up_s: float) -> dict:
    """The least-squares slope of host RSS and GPU memory, MiB per minute, over the samples
    after `warm_up_s` (caches and allocators fill first), with their first and last values."""
    kept = [s for s in samples if s[0] >= warm_up_s]
    out = {"samples": len(samples), "fitted": len(kept)}
    for i, key in ((1, "rss"), (2, "gpu")):
        points = [(s[0] / 60.0, s[i]) for s in kept if s[i] is not None]
        out[f"{key}_mib_per_min"] = _slope(points)
        out[f"{key}_first_last_mib"] = (points[0][1], points[-1][1]) if points else None
    return out


def _slope(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 3:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return round(sum((x - mx) * (y - my) for x, y in points) / var, 3) if var else None


def log_problems(path: Path, start: int) -> list[str]:
    """Traceback / leak in the log past byte `start`."""
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    return [w for w in ("Traceback", "leak") if w.lower() in text.lower()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", action="append", required=True, help="NAME=URL")
    p.add_argument("--log", action="append", default=[], help="NAME=PATH of its log")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=300, help="per server")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--memory",
        action="append",
        default=[],
        help="NAME=PID: sample that server's process group (host RSS) and the GPUs' "
        "memory every --sample-every s, and report the slopes",
    )
    p.add_argument("--sample-every", type=float, default=30.0)
    p.add_argument("--warm-up", type=float, default=300.0, help="s left out of the slopes")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    servers = {n: check_local(u) for n, u in (s.split("=", 1) for s in args.server)}
    logs = {n: Path(v) for n, v in (s.split("=", 1) for s in args.log)}
    groups = {n: os.getpgid(int(v)) for n, v in (s.split("=", 1) for s in args.memory)}
    reqs = request_mix(args.requests, args.context, args.seed)
    report, ok = {}, True
    for name, url in servers.items():
        log = logs.get(name)
        sampler = MemorySampler(groups[name], args.sample_every) if name in groups else None
        with sampler or contextlib.nullcontext():
            report[name] = checked_soak(
                url, reqs, args.seconds, args.concurrency, log, log.stat().st_size if log else 0
            )
        if sampler is not None:
            report[name]["memory"] = {
                "slopes": memory_slopes(sampler.samples, args.warm_up),
                "samples": sampler.samples,
            }
        ok &= all(report[name]["checks"].values()) and report[name]["failed"] == 0
        print(name, json.dumps(report[name]), flush=True)
    report["mix"] = [asdict(r) for r in reqs[:3]]
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

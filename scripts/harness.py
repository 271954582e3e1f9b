"""Launch SGLang servers and talk to them over HTTP: the small harness the benchmarks, the
reliability tools and the GPU tests share (plain Python, standard library only; transformers
for `Server.tokenize`, SGLang for `run_bench`, the package for `write_dataset`, each imported
where it is used). Every server writes its log under `log_dir`. The benchmarks' shared parts
live here, so that no benchmark imports another: timed batches of requests (`timed_requests`)
and SGLang's load generator, `sglang.bench_serving` (`write_dataset`, `bench_args`,
`run_bench`) with the steady-state rule of its runs (`steady_state`, `steady_plan`,
`prefill_share`, `spread`); scripts/round_trace.py holds their profiler-trace readers.

Scripts beside this file import it by name (`import harness`: `python scripts/NAME.py` puts
scripts/ first on sys.path); tests import `scripts.harness` (the checkout on their path).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class LinkedList:\n    def __init__(self):",
    "# Parse the command line arguments",
    "for i in range(10):\n    print(",
    "def quicksort(items):\n    if len(items) <= 1:",
    "The quick brown fox",
    "Once upon a time, in a small village,",
    "import numpy as np\nx = np.",
    "with open('data.txt') as f:",
    "try:\n    value = int(text)\nexcept",
    "def __repr__(self):\n        return",
    "SELECT name, age FROM users WHERE",
    "async def fetch(session, url):",
    "# TODO: handle the empty case",
    "lambda x: x *",
    "if __name__ == '__main__':",
    "result = {key: value for key, value in",
    "raise ValueError(f'unexpected",
    "def test_addition():\n    assert",
    "The capital of France is",
    "while True:\n    line = input()",
    "from dataclasses import dataclass\n\n@dataclass\nclass Point:",
    "logger = logging.getLogger(__name__)",
    "def merge(a, b):\n    out = []",
    "x = [1, 2, 3]\ny = [",
    "Hello, my name is",
    "return sorted(items, key=lambda",
    'def read_config(path):\n    """Read',
    "numbers = list(map(int,",
    "yield from",
    "print('done')",
]


_TOKENIZERS: dict = {}
_TOKENIZER_LOCK = threading.Lock()


def free_port(start: int, step: int = 10, tries: int = 50) -> int:
    """The first port of start, start + step, ... that nothing on 127.0.0.1 listens on (another
    server's internal ports can sit on a fixed one)."""
    for port in range(start, start + step * tries, step):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port among {start}, {start + step}, ... ({tries} tried)")


def cpu_sets(cpus: list[int], parts: int) -> list[tuple[int, ...]]:
    """`cpus` split into `parts` disjoint runs of neighbouring CPUs: the first with the
    remainder, the others all of one size. bench_serving gives the first (the lowest CPUs, CPU 0
    among them, where a Linux guest often takes its interrupts and housekeeping) to its load
    generator and the others to the servers, so that servers compared side by side get as many
    cores each and none of them CPU 0: the shipped pair is host-bound, and five
    servers on 16 CPUs, split as evenly as they went, ran two servers on 2 cores (one of them
    on CPU 0) and three on 3."""
    if not 1 <= parts <= len(cpus):
        raise ValueError(f"cannot split {len(cpus)} CPUs into {parts} sets")
    cpus, size = sorted(cpus), len(cpus) // parts
    first = len(cpus) - size * (parts - 1)
    return [tuple(cpus[:first])] + [
        tuple(cpus[first + i * size : first + (i + 1) * size]) for i in range(parts - 1)
    ]


@dataclass
class Server:
    name: str
    model_path: str
    port: int
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path = Path("/tmp")
    proc: subprocess.Popen | None = None
    cpus: tuple[int, ...] = ()  # the CPUs its processes run on (empty: wherever the OS puts them)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return Path(self.log_dir) / f"server_{self.name}.log"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.args,
        ]

    def start(self, detach: bool = False) -> None:
        """Start the server; `detach` puts it in its own session so it outlives this process."""
        cmd = self.command()
        self.log_path.write_text("$ " + " ".join(cmd) + "\n")
        log = open(self.log_path, "a")  # noqa: SIM115 - lives as long as the server
        cpus = set(self.cpus)
        self.proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        if detach:
            self.proc = None  # not ours to wait for; found again through its port

    def start_once_more_on_exit(self, line: str, timeout: float) -> None:
        """Start it and wait for `line` in its log; a server that exits during start-up is
        started once more (its first log kept as .first_try.log). Under load the shipped pair's
        tokenizer has failed to load now and then (`Couldn't instantiate the backend
        tokenizer`), as the GPU suite's launcher saw and retries too."""
        for attempt in (1, 2):
            self.start()
            try:
                self.wait_for_log(line, timeout)
                return
            except RuntimeError:
                if attempt == 2:
                    raise
                try:  # whatever the first attempt left behind (a scheduler child)
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                self.log_path.replace(self.log_path.with_suffix(".first_try.log"))
                print(f"{self.name}: exited during start-up; starting it once more", flush=True)

    def is_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout: float) -> float:
        start = time.time()
        while time.time() - start < timeout:
            if self.is_healthy():
                return time.time() - start
            if not self.is_alive():
                raise RuntimeError(f"server {self.name} exited: {self.log_text()[-3000:]}")
            time.sleep(2)
        raise TimeoutError(f"server {self.name} not healthy after {timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def wait_for_log(self, text: str, timeout: float) -> None:
        start = time.time()
        while time.time() - start < timeout and text not in self.log_text():
            if not self.is_alive():
                raise RuntimeError(f"server {self.name} exited: {self.log_text()[-3000:]}")
            time.sleep(1)

    def is_alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        pattern = f"--port {self.port} "
        found = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, check=False)
        return found.returncode == 0

    def stop_by_port(self) -> None:
        subprocess.run(["pkill", "-f", "--", f"--port {self.port} "], check=False)

    def tokenize(self, text: str) -> list[int]:
        """The model's token ids for `text` (its tokenizer loaded once per process, under a
        lock: loading the same files from several threads at once has failed)."""
        from transformers import AutoTokenizer

        with _TOKENIZER_LOCK:
            if self.model_path not in _TOKENIZERS:
                _TOKENIZERS[self.model_path] = AutoTokenizer.from_pretrained(self.model_path)
            tok = _TOKENIZERS[self.model_path]
        return tok(text)["input_ids"]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


# The admin key the test and benchmark servers start with (--admin-api-key): a DDTREE server
# closes SGLang's admin endpoints (/flush_cache, /start_profile, ...) without one, and these
# tools use two of them. Loopback servers only; never a production key.
ADMIN_KEY = "sglang-ddtree-local-admin"
ADMIN_ARGS = ("--admin-api-key", ADMIN_KEY)


def post(url: str, payload: dict, timeout: float = 600, admin: bool = False) -> tuple[int, dict]:
    """POST a JSON body; admin: with the servers' admin key as the bearer (ADMIN_KEY)."""
    headers = {"Content-Type": "application/json"}
    if admin:
        headers["Authorization"] = f"Bearer {ADMIN_KEY}"
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
            try:
                return r.status, json.loads(body)
            except json.JSONDecodeError:
                return r.status, {"raw": body.decode(errors="replace")}
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")
        try:
            return e.code, json.loads(body)
        except json.JSONDecodeError:
            return e.code, {"raw": body}


def get(url: str, timeout: float = 60) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"raw": e.read().decode(errors="replace")}


def generate(server: Server, prompt: str, **sampling) -> dict:
    status, out = post(server.url + "/generate", {"text": prompt, "sampling_params": sampling})
    if status != 200:
        raise RuntimeError(f"{server.name} /generate {status}: {out}")
    return out


def chat(server: Server, prompt: str, **params) -> dict:
    payload = {"model": "x", "messages": [{"role": "user", "content": prompt}], **params}
    status, out = post(server.url + "/v1/chat/completions", payload)
    if status != 200:
        raise RuntimeError(f"{server.name} chat {status}: {out}")
    return out


def run_all(fn, items, concurrency: int) -> list:
    """fn(item) for every item with `concurrency` requests in flight; results in item order."""
    with cf.ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(fn, items))


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def line_plot(
    series: dict[str, list[tuple[float, float]]],
    path: Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    log2_x: bool = False,
) -> None:
    """One line with markers per label (points sorted by x), saved as a PNG (the benchmarks'
    plots; matplotlib is imported only here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in series.items():
        ax.plot(*zip(*sorted(points), strict=True), marker="o", label=label)
    if log2_x:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def timed_requests(server: Server, bs: int, tokens: int, temperature: float = 0.0) -> list[dict]:
    """`bs` concurrent /generate requests of `tokens` new tokens (PROMPTS in turn, ignore_eos):
    per request, its latency (s) and SGLang's meta_info."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(bs)]

    def one(prompt):
        t0 = time.perf_counter()
        out = generate(
            server, prompt, max_new_tokens=tokens, temperature=temperature, ignore_eos=True
        )
        return {"latency": time.perf_counter() - t0, "meta": out["meta_info"]}

    return run_all(one, prompts, bs)


def prompts_for(concurrency: int, per_client: int) -> int:
    """Requests per load-generator run: `per_client` per client, at least 16."""
    return max(16, per_client * concurrency)


STEADY_PREFILL_SHARE = 0.05  # of a steady-state run's time, at most, spent in prefills


def steady_state(
    concurrency: int,
    prefill_ms: float,
    tpot_ms: float,
    share: float = STEADY_PREFILL_SHARE,
    tokens: int = 128,
    per_client: int = 2,
) -> tuple[int, int]:
    """(requests per client R, new tokens per request T) of a steady-state run: decode rounds,
    not prefills nor the first wave's ramp and the last one's tail, fill all but `share` of it.
    A wave of c requests spends about c x prefill_ms in prefills (each holds the batch's decode:
    the measured time to first token of a lone request) and T x tpot_ms decoding, so
    T >= c x prefill_ms x (1 - share) / (share x tpot_ms); the ramp and the tail take about half
    a request's time each of the R a client sends, so R >= 1 / (2 x share). At least `tokens`
    and `per_client` (the short run's)."""
    if not 0 < share < 1 or min(prefill_ms, tpot_ms) <= 0:
        raise ValueError(
            f"need 0 < share < 1 and positive times, got {share}, {prefill_ms}, {tpot_ms}"
        )
    T = math.ceil(concurrency * prefill_ms * (1 - share) / (share * tpot_ms))
    return steady_per_client(share, per_client), max(tokens, T)


def steady_per_client(share: float = STEADY_PREFILL_SHARE, per_client: int = 2) -> int:
    """steady_state's R: at least 1 / (2 x share) requests per client (the first wave's ramp
    and the last one's tail take about half a request's time each), and `per_client`; what
    sizes a steady-state benchmark's prompt file."""
    return max(per_client, math.ceil(1 / (2 * share)))


def steady_plan(
    probes: dict[tuple[str, int], dict],
    concurrencies: list[int],
    share: float = STEADY_PREFILL_SHARE,
    tokens: int = 128,
    per_client: int = 2,
    running: dict[str, int] | None = None,
) -> dict[int, dict]:
    """--steady-state's cells from probe runs: probes[name, c] is server `name`'s short run at
    concurrency c (c = 1 among them), its median TTFT at c = 1 the server's prefill time P (a
    lone request's) and its median TPOT at c the decode's. Per c, the largest R and T that
    steady_state asks of any server, so that the servers of a cell do the same work:
    {c: {"requests_per_client": R, "tokens": T, "prefill_ms": {name: P}}}. A wave holds
    min(c, running[name]) requests where the server runs fewer than c at once (the rest
    queue, and only the running ones' prefills hold its batch)."""
    names = list(dict.fromkeys(name for name, _ in probes))
    prefill = {n: probes[n, 1]["median_ttft_ms"] for n in names}
    plan = {}
    for c in concurrencies:
        sizes = [
            steady_state(
                min(c, (running or {}).get(n, c)),
                prefill[n],
                probes[n, c]["median_tpot_ms"],
                share,
                tokens,
                per_client,
            )
            for n in names
        ]
        R, T = max(r for r, _ in sizes), max(t for _, t in sizes)
        plan[c] = {"requests_per_client": R, "tokens": T, "prefill_ms": prefill}
    return plan


def spread(values: list[float]) -> float | None:
    """Runs' one-run spread, (max - min) / median (None: no runs, or a median of 0)."""
    mid = statistics.median(values) if values else 0
    return (max(values) - min(values)) / mid if mid else None


def prefill_share(completed: int, prefill_ms: float, duration_s: float) -> float:
    """The share of a run's `duration_s` its `completed` requests' prefills took, at
    `prefill_ms` each (a lone request's time to first token: an upper bound under batching)."""
    return completed * prefill_ms / (1e3 * duration_s) if duration_s > 0 else float("nan")


def write_dataset(path: Path, n: int) -> Path:
    """bench_serving's custom JSONL of n held-out prompts (the package's
    `training.corpus.heldout_prompts`): a user turn (the prompt) and an assistant turn (unused:
    the output length is fixed by --sharegpt-output-len)."""
    from sglang_ddtree.training.corpus import heldout_prompts

    prompts = heldout_prompts(n)
    if len(prompts) < n:
        raise SystemExit(
            f"only {len(prompts)} held-out prompts for the {n} requests of a run: "
            "lower --requests-per-client"
        )
    rows = [
        {
            "conversations": [
                {"role": "user", "content": p},
                {"role": "assistant", "content": "unused reply"},
            ]
        }
        for p in prompts
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def bench_args(
    server,
    dataset: Path,
    tokenizer: str,
    prompts: int,
    concurrency: int,
    temperature: float,
    tokens: int,
    out_file: Path,
) -> list[str]:
    """`sglang.bench_serving`'s arguments for one run against `server` (write_dataset's file,
    greedy or at `temperature`, `tokens` new tokens per request, a fixed seed)."""
    return [
        "--backend",
        "sglang",
        "--host",
        "127.0.0.1",
        "--port",
        str(server.port),
        "--model",
        tokenizer,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(dataset),
        "--num-prompts",
        str(prompts),
        "--sharegpt-output-len",
        str(tokens),
        "--max-concurrency",
        str(concurrency),
        "--temperature",
        str(temperature),
        "--seed",
        "42",
        "--flush-cache",
        "--warmup-requests",
        str(min(concurrency, 4)),
        "--output-file",
        str(out_file),
    ]


def run_bench(argv: list[str]) -> dict:
    """One `python -m sglang.bench_serving ARGV`, in this process (its import is the slow part):
    the result row it appends to --output-file."""
    from sglang.benchmark.serving import cli_main

    out_file = Path(argv[argv.index("--output-file") + 1])
    before = out_file.read_text().count("\n") if out_file.exists() else 0
    saved = sys.argv
    sys.argv = ["sglang.bench_serving", *argv]
    try:
        cli_main()
    finally:
        sys.argv = saved
    lines = out_file.read_text().splitlines()
    if len(lines) <= before:
        raise RuntimeError(f"bench_serving wrote no result to {out_file}")
    return json.loads(lines[-1])

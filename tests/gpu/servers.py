"""The GPU test server set, all on one GPU in small memory slices: per binary pair
(attention-only Qwen3, hybrid Qwen3.5) a plain server and DDTREE with and without the overlap
scheduler, each again on an FP8 target (FP8 weights, then FP8 weights and KV cache), and DDTREE
and SGLang's DFLASH on the pair's DFlash2 draft (the binary draft with a candidate selector,
tests/gpu/test_dflash2.py); for the trained pair (hybrid Qwen3.5, sglang_ddtree/assets/demo) a plain server and DDTREE, each also in
SGLang's deterministic (batch-invariant) mode. SGLang's DFLASH on the pair and DDTREE at N=64
start only for the end-to-end benchmark (DDTREE_GPU_BENCH=1; scripts/bench_e2e.py --attach).

    python -m tests.gpu.servers launch ROOT      # write checkpoints, start a detached launcher
                                                 # (setsid) that starts every server, restarts
                                                 # a failed one once, and keeps ROOT/status.json
    python -m tests.gpu.servers wait ROOT [S]    # until every server is healthy or failed
    python -m tests.gpu.servers start ROOT [S]   # launch + wait
    python -m tests.gpu.servers stop ROOT [MODEL...]

Then `DDTREE_GPU_ROOT=ROOT python -m pytest tests/gpu -m gpu` reuses the running servers
(DDTREE_GPU_MODELS=qwen3 narrows it to one model, DDTREE_GPU_WAIT=S lets a test wait for its
server to come up). DDTREE_GPU_BENCH=1 at launch adds BENCH_ONLY's servers to the set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from sglang_ddtree import DEMO_PAIR_DIR as DEMO
from tests.gpu.harness import ADMIN_ARGS, Server

MODELS = ("qwen3", "qwen35", "pair")
NEW_TOKENS = 128
# Binary pairs: budget 30 = the complete binary tree of depth 4 (the draft ties its two tokens).
NUM_NODES, TOPK = 31, 4
# The trained pair (sglang_ddtree/assets/demo): the default shape, budget 31, top-8.
PAIR_NUM_NODES, PAIR_TOPK = 32, 8
# Pools capped far below the memory fraction (--max-total-tokens, --max-mamba-cache-size,
# --max-running-requests), which only sets how much of the free memory a server measured before
# it loaded may be gone when it sizes its pools: SGLang's budget is what is free then minus
# (1 - fraction) of what was free before, and the neighbours that start at the same time take
# their share in between. At 0.15 that tolerance was 15% (on one H100 with 27 servers starting,
# 3 GiB: the late servers failed the check); at 0.5 it is half, while each server still holds
# only its capped pools (13 servers used 32 GiB on the H200; the 27 of the default set before the
# DFlash2 servers, about 2.5 GiB each, fit one 80 GB H100; the 31 now, about 78 GiB, are near an
# H100's 80 GB: DDTREE_GPU_SERVERS narrows a run there).
COMMON = [
    *ADMIN_ARGS,  # the tools' admin calls (/flush_cache, /start_profile)
    "--attention-backend",
    "flashinfer",
    "--dtype",
    "bfloat16",
    "--mem-fraction-static",
    "0.5",
    "--max-total-tokens",
    "65536",
    "--max-mamba-cache-size",
    "256",
    "--max-running-requests",
    "16",
    "--cuda-graph-max-bs-decode",
    "16",
    # five captured batch sizes, not twelve (a batch between them replays the next one up,
    # padded, as in production): each capture runs once per width and server, 31 servers at once
    "--cuda-graph-bs-decode",
    "1",
    "2",
    "4",
    "8",
    "16",
    "--context-length",
    "2048",
    # SGLang captures prefill graphs by default (about 70 s of each start-up); the decode
    # rounds the tests compare do not use them
    "--disable-prefill-cuda-graph",
    # JSON grammars without free whitespace between tokens: with it the tiny pairs' greedy
    # output can spend every token on whitespace (the grammar tests need outputs that finish)
    "--constrained-json-disable-any-whitespace",
]
REPO = Path(__file__).resolve().parents[2]
DEBUG_TOOLS = Path(__file__).resolve().parent / "server_debug"
# Every server runs DDTREE's round code under the sync check (test tooling: server_debug's
# sitecustomize installs it in the server's processes; the tests fail on its warning).
ENV = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "DDTREE_SYNC_CHECK": "1",
    "PYTHONPATH": os.pathsep.join(
        p for p in (str(DEBUG_TOOLS), str(REPO), os.environ.get("PYTHONPATH")) if p
    ),
}
# Batch-invariant kernels (SGLang's --enable-deterministic-inference): the only mode in which a
# bf16 server's greedy text does not depend on how many tokens share a forward pass.
DETERMINISTIC = ["--enable-deterministic-inference"]
# SGLang's online FP8 on the bf16 checkpoint: --quantization fp8 quantizes every linear layer at
# load (on an H100 per output channel, activations per token at run time; the embedding and LM
# head stay bf16), the target's KV cache in fp8_e4m3 with FP8_KV (scale 1.0: the checkpoints
# carry none). The draft stays bf16: SGLang gives it the target's --quantization unless
# --speculative-draft-model-quantization says otherwise (`unquant`: none); its KV cache follows
# --kv-cache-dtype, as a user's would.
FP8 = ["--quantization", "fp8"]
FP8_KV = [*FP8, "--kv-cache-dtype", "fp8_e4m3"]
DRAFT_BF16 = ["--speculative-draft-model-quantization", "unquant"]


def tree_shape(model: str) -> tuple[int, int]:
    """(--speculative-num-draft-tokens, --speculative-eagle-topk) of the DDTREE servers."""
    return (PAIR_NUM_NODES, PAIR_TOPK) if model == "pair" else (NUM_NODES, TOPK)


def dflash_args(draft: Path) -> list[str]:
    return ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(draft)]


def dflash2_draft(draft: str | Path) -> Path:
    """The binary pair's DFlash2 draft beside its DFlash draft `draft` (write_pair writes it):
    the same backbone with a candidate selector over TOPK candidates
    (checkpoints/binary_pair.write_binary_dflash2)."""
    draft = Path(draft)
    return draft.with_name(draft.name + "2")


def ddtree_args(model: str, draft: Path, nodes: int | None = None) -> list[str]:
    default_nodes, topk = tree_shape(model)
    nodes = nodes or default_nodes
    return [
        "--speculative-algorithm",
        "DDTREE",
        "--speculative-draft-model-path",
        str(draft),
        "--speculative-num-draft-tokens",
        str(nodes),
        "--speculative-eagle-topk",
        str(topk),
    ]


VARIANTS = {
    "base": lambda model, draft: [],
    # plain decoding without the overlap scheduler: its penalties count every output token
    # (with overlap, SGLang counts them one token late), the per-node penalties' control
    "base_sync": lambda model, draft: ["--disable-overlap-schedule"],
    "ddtree": ddtree_args,
    "ddtree_sync": lambda model, draft: [*ddtree_args(model, draft), "--disable-overlap-schedule"],
    "base_det": lambda model, draft: DETERMINISTIC,
    "ddtree_det": lambda model, draft: [*ddtree_args(model, draft), *DETERMINISTIC],
    # SGLang's own chain DFlash on the same pair: the control for numerics (a bf16 difference
    # between the verify and the decode path shows up in DFLASH as much as in DDTREE).
    "dflash": lambda model, draft: dflash_args(draft),
    "dflash_det": lambda model, draft: [*dflash_args(draft), *DETERMINISTIC],
    "ddtree64": lambda model, draft: ddtree_args(model, draft, nodes=64),
    # with VARIANT_ENV below, a switch's other value:
    "ddtree_fixed": ddtree_args,  # every round at N (the default, auto, picks a width per round)
    # the FP8 target: plain, and DDTREE (default options) beside it, with FP8 weights and with
    # FP8 weights and KV cache (tests/gpu/test_fp8.py)
    "base_fp8": lambda model, draft: [*FP8],
    "ddtree_fp8": lambda model, draft: [*ddtree_args(model, draft), *FP8, *DRAFT_BF16],
    "base_fp8kv": lambda model, draft: [*FP8_KV],
    "ddtree_fp8kv": lambda model, draft: [*ddtree_args(model, draft), *FP8_KV, *DRAFT_BF16],
    # the DFlash2 draft: DDTREE's lattice tree (K = the selector's TOPK, the flag repeats it),
    # and SGLang's DFLASH walking its selector's chain, the control (tests/gpu/test_dflash2.py)
    "ddtree_dflash2": lambda model, draft: ddtree_args(model, dflash2_draft(draft)),
    "dflash_dflash2": lambda model, draft: dflash_args(dflash2_draft(draft)),
}
# Per-variant environment on top of ENV.
VARIANT_ENV = {
    "ddtree_fixed": {"SGLANG_DDTREE_WIDTH": "fixed"},
}
FP8_VARIANTS = ("base_fp8", "ddtree_fp8", "base_fp8kv", "ddtree_fp8kv")
DFLASH2_VARIANTS = ("ddtree_dflash2", "dflash_dflash2")
# Which variants each model runs (31 servers by default, 33 with BENCH_ONLY's). Launch order
# interleaves the models, plain servers first, so each model's tests can begin while the others
# still start. SGLang's own chain DFLASH runs beside DDTREE on the binary pairs as the control
# for numerics.
MODEL_VARIANTS = {
    "qwen3": (
        "base",
        "base_sync",
        "ddtree",
        "ddtree_fixed",
        "ddtree_sync",
        "dflash",
        *FP8_VARIANTS,
        *DFLASH2_VARIANTS,
    ),
    "qwen35": (
        "base",
        "base_sync",
        "ddtree",
        "ddtree_fixed",
        "ddtree_sync",
        "dflash",
        *FP8_VARIANTS,
        *DFLASH2_VARIANTS,
    ),
    "pair": (
        "base",
        "base_sync",
        "ddtree",
        "ddtree_fixed",
        "base_det",
        "ddtree_det",
        "dflash_det",
        "dflash",
        "ddtree64",
    ),
}
# Started for scripts/bench_e2e.py --attach, only when the launch has DDTREE_GPU_BENCH=1; not
# tested themselves by tests/gpu (a pytest with DDTREE_GPU_BENCH=1 takes pair-dflash as the
# pair's DFLASH control, as it does the binary pairs' dflash).
BENCH_ONLY = {("pair", "dflash"), ("pair", "ddtree64")}
LAUNCH_GAP_S = 4.0
# Servers booting at once: 27 at once on 16 host cores left every start-up CPU-bound (125 s of
# verify-graph capture each) and every test waiting for the last; in line, the first servers
# are up for their tests while the rest start.
MAX_BOOTING = 8


def model_of(name: str) -> str:
    """The model of a server name `<model>-<variant>`."""
    return name.split("-", 1)[0]


def write_pair(root: Path, model: str) -> tuple[Path, Path]:
    """The checkpoints a model name stands for. `qwen3` / `qwen35`: the agreeing binary pair
    (testing/binary_pair.py; deep side-branch acceptance every round), written under root.
    `pair`: the trained Qwen3.5 target + DFlash draft shipped with the package (real text,
    natural logit margins). A binary pair's DFlash2 draft is written beside its draft
    (`dflash2_draft`)."""
    if model == "pair":
        return DEMO / "target", DEMO / "draft"
    from sglang_ddtree.checkpoints.binary_pair import write_binary_dflash2, write_binary_pair

    target, draft = root / f"{model}-binary", root / f"{model}-binary-dflash"
    if not (draft / "config.json").exists():
        write_binary_pair(root, model, seed=0)
    if not (dflash2_draft(draft) / "config.json").exists():
        write_binary_dflash2(root, model, seed=0, selector_top_k=TOPK)
    return target, draft


def server_set(root: Path) -> dict[str, Server]:
    """Every server the suite defines, BENCH_ONLY's included (each keeps its port whichever are
    started), in launch order (interleaved across models, plain servers first).
    DDTREE_GPU_SERVERS=name,name,...: only those (a partial rerun)."""
    root = Path(root)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    servers, port = {}, 31000
    for model in MODELS:
        target, draft = write_pair(root, model)
        for variant in MODEL_VARIANTS[model]:
            name = f"{model}-{variant}"
            args = [*COMMON, *VARIANTS[variant](model, draft)]
            env = {**ENV, **VARIANT_ENV.get(variant, {})}
            servers[name] = Server(name, str(target), port, args, env, log_dir=root / "logs")
            port += 10
    only = os.environ.get("DDTREE_GPU_SERVERS")
    if only:
        servers = {n: s for n, s in servers.items() if n in only.split(",")}

    def launch_order(name: str) -> tuple[int, int]:
        model = model_of(name)
        return MODEL_VARIANTS[model].index(name.split("-", 1)[1]), MODELS.index(model)

    return dict(sorted(servers.items(), key=lambda kv: launch_order(kv[0])))


def launched_set(root: Path) -> dict[str, Server]:
    """The servers a launch starts and the tests use: server_set less BENCH_ONLY's, which
    DDTREE_GPU_BENCH=1 adds (for scripts/bench_e2e.py --attach); DDTREE_GPU_MODELS=m,m narrows
    it to those models' servers (a suite run one model at a time)."""
    bench = os.environ.get("DDTREE_GPU_BENCH") == "1"
    skipped = set() if bench else {f"{m}-{v}" for m, v in BENCH_ONLY}
    servers = {n: s for n, s in server_set(root).items() if n not in skipped}
    models = os.environ.get("DDTREE_GPU_MODELS")
    if models:
        servers = {n: s for n, s in servers.items() if model_of(n) in models.split(",")}
    return servers


def status_path(root: Path) -> Path:
    return Path(root) / "status.json"


def read_status(root: Path) -> dict[str, str]:
    """name -> "starting" | "healthy" | "failed", as the launcher last wrote it ({} before)."""
    try:
        return json.loads(status_path(root).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _write_status(root: Path, status: dict[str, str]) -> None:
    tmp = status_path(root).with_suffix(".tmp")
    tmp.write_text(json.dumps(status, indent=1))
    tmp.replace(status_path(root))


def run_launcher(root: Path, timeout: float = 1500) -> None:
    """Start the servers in launch order, LAUNCH_GAP_S apart and at most MAX_BOOTING at a time
    (the rest wait "starting" in line), then watch them: one that dies is started again once,
    alone (after the others have settled, so no neighbour allocates while it sizes its pools).
    Keeps ROOT/status.json current."""
    servers = launched_set(root)
    status = {name: "healthy" if s.is_healthy() else "starting" for name, s in servers.items()}
    queue = [name for name, v in status.items() if v == "starting"]
    booting: list[str] = []
    dead: list[str] = []  # died on their first start, waiting for their one retry
    retried, t0 = set(), time.time()
    while any(v == "starting" for v in status.values()) and time.time() - t0 < timeout:
        booting, died = _watch(servers, status, booting, retried)
        dead += died
        while queue and len(booting) < MAX_BOOTING:
            name = queue.pop(0)
            servers[name].start(detach=True)
            booting.append(name)
            time.sleep(LAUNCH_GAP_S)
        if dead and not booting and not queue:  # restart one dead server, alone
            name = dead.pop(0)
            retried.add(name)
            log = servers[name].log_path
            log.rename(log.with_suffix(".first_try.log"))
            servers[name].start(detach=True)
            booting.append(name)
            print(f"{name}: restarted once", flush=True)
        _write_status(root, status)
        time.sleep(2)
    for name, v in status.items():
        if v == "starting":
            status[name] = "failed"
    _write_status(root, status)
    print(json.dumps(status), flush=True)


def _watch(servers, status, booting, retried) -> tuple[list[str], list[str]]:
    """One look at the servers booting: marks the healthy ones (and the dead ones already
    retried, failed) in status; returns (those still booting, those newly dead to retry)."""
    still, dead = [], []
    for name in booting:
        s = servers[name]
        if s.is_healthy():
            status[name] = "healthy"
        elif s.is_alive():
            still.append(name)
        elif name in retried:
            status[name] = "failed"
        else:
            dead.append(name)
    return still, dead


def write_server_table(root: Path, servers: dict[str, Server]) -> Path:
    """ROOT/servers.json: each server's model, port, flags and log folder, so that a tool can
    attach to the running set without importing the tests (scripts/bench_e2e.py --attach)."""
    path = Path(root) / "servers.json"
    table = {
        n: {"model_path": s.model_path, "port": s.port, "args": s.args, "log_dir": str(s.log_dir)}
        for n, s in servers.items()
    }
    path.write_text(json.dumps(table, indent=1))
    return path


def launch(root: Path) -> None:
    """Write the checkpoints and ROOT/servers.json, then run the launcher detached (its own
    session, so it outlives the calling command)."""
    root = Path(root)
    # writes the binary-pair checkpoints before anything starts
    write_server_table(root, launched_set(root))
    status_path(root).unlink(missing_ok=True)
    log = open(root / "launcher.log", "a")  # noqa: SIM115 - the launcher's stdout
    subprocess.Popen(
        [sys.executable, "-m", "tests.gpu.servers", "launcher", str(root)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=os.getcwd(),
    )


def wait(root: Path, timeout: float) -> dict[str, str]:
    """Until the launcher has settled every server (or timeout); returns the status."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        status = read_status(root)
        if status and all(v != "starting" for v in status.values()):
            return status
        time.sleep(3)
    return read_status(root)


def main(argv: list[str]) -> None:
    command, root = argv[0], Path(argv[1])
    if command == "stop":  # every server the suite defines, whichever were launched
        models = argv[2:] or MODELS
        for name, s in server_set(root).items():
            if model_of(name) in models:
                s.stop_by_port()
        return
    if command == "launcher":
        run_launcher(root)
        return
    t0 = time.time()
    if command in ("launch", "start"):
        launch(root)
        if command == "launch":
            return
    status = wait(root, float(argv[2]) if len(argv) > 2 else 900)
    print(json.dumps({"status": status, "after_s": round(time.time() - t0, 1)}))
    servers = server_set(root)  # status.json names what was launched
    for name, v in status.items():
        if v != "healthy":
            print(f"NOT HEALTHY {name} ({v}): {servers[name].log_text()[-1500:]}")
    sys.exit(0 if status and all(v == "healthy" for v in status.values()) else 1)


if __name__ == "__main__":
    main(sys.argv[1:])

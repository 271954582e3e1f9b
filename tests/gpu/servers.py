"""The GPU test server set, all on one GPU in small memory slices: per binary pair
(attention-only Qwen3, hybrid Qwen3.5) a plain server and DDTREE with and without the overlap
scheduler; for the trained pair (hybrid Qwen3.5, sglang_ddtree/assets/demo) a plain server and
DDTREE, each also in SGLang's deterministic (batch-invariant) mode.

    python -m tests.gpu.servers start ROOT   # write checkpoints, start every server detached
                                             # (setsid), wait until healthy; logs in ROOT/logs
    python -m tests.gpu.servers stop ROOT

Then `DDTREE_GPU_ROOT=ROOT python -m pytest tests/gpu -m gpu` reuses the running servers.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from sglang_ddtree import DEMO_PAIR_DIR as DEMO
from tests.gpu.harness import Server

MODELS = ("qwen3", "qwen35", "pair")
NEW_TOKENS = 128
# Binary pairs: budget 30 = the complete binary tree of depth 4 (the draft ties its two tokens).
NUM_NODES, TOPK = 31, 4
# The trained pair (sglang_ddtree/assets/demo): the issue-4 default shape, budget 31, top-8.
PAIR_NUM_NODES, PAIR_TOPK = 32, 8
COMMON = [
    "--attention-backend", "flashinfer", "--dtype", "bfloat16", "--mem-fraction-static", "0.07",
    "--max-running-requests", "16", "--cuda-graph-max-bs", "16", "--context-length", "2048",
]  # fmt: skip
ENV = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", "SGLANG_DDTREE_SYNC_CHECK": "1"}
# Batch-invariant kernels (SGLang's --enable-deterministic-inference): the only mode in which a
# bf16 server's greedy text does not depend on how many tokens share a forward pass.
DETERMINISTIC = ["--enable-deterministic-inference"]


def tree_shape(model: str) -> tuple[int, int]:
    """(--speculative-num-draft-tokens, --speculative-eagle-topk) of the DDTREE servers."""
    return (PAIR_NUM_NODES, PAIR_TOPK) if model == "pair" else (NUM_NODES, TOPK)


def ddtree_args(model: str, draft: Path) -> list[str]:
    nodes, topk = tree_shape(model)
    return [
        "--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(draft),
        "--speculative-num-draft-tokens", str(nodes), "--speculative-eagle-topk", str(topk),
    ]  # fmt: skip


VARIANTS = {
    "base": lambda model, draft: [],
    "ddtree": ddtree_args,
    "ddtree_sync": lambda model, draft: [*ddtree_args(model, draft), "--disable-overlap-schedule"],
    "base_det": lambda model, draft: DETERMINISTIC,
    "ddtree_det": lambda model, draft: [*ddtree_args(model, draft), *DETERMINISTIC],
    # SGLang's own chain DFlash on the same pair: the control for numerics (a bf16 difference
    # between the verify and the decode path shows up in DFLASH as much as in DDTREE).
    "dflash": lambda model, draft: [
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        str(draft),
    ],  # fmt: skip
}
# Which variants each model runs (11 servers in all, 7% of the GPU's memory each).
MODEL_VARIANTS = {
    "qwen3": ("base", "ddtree", "ddtree_sync"),
    "qwen35": ("base", "ddtree", "ddtree_sync", "dflash"),
    "pair": ("base", "ddtree", "base_det", "ddtree_det"),
}


def write_pair(root: Path, model: str) -> tuple[Path, Path]:
    """The checkpoints a model name stands for. `qwen3` / `qwen35`: the agreeing binary pair
    (testing/binary_pair.py; deep side-branch acceptance every round), written under root.
    `pair`: the trained Qwen3.5 target + DFlash draft shipped with the package (real text,
    natural logit margins)."""
    if model == "pair":
        return DEMO / "target", DEMO / "draft"
    from sglang_ddtree.testing.binary_pair import write_binary_pair

    target, draft = root / f"{model}-binary", root / f"{model}-binary-dflash"
    if not (draft / "config.json").exists():
        write_binary_pair(root, model, seed=0)
    return target, draft


def server_set(root: Path) -> dict[str, Server]:
    root = Path(root)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    servers, port = {}, 31000
    for model in MODELS:
        target, draft = write_pair(root, model)
        for variant in MODEL_VARIANTS[model]:
            name = f"{model}-{variant}"
            args = [*COMMON, *VARIANTS[variant](model, draft)]
            servers[name] = Server(name, str(target), port, args, ENV, log_dir=root / "logs")
            port += 10
    return servers


def main(argv: list[str]) -> None:
    command, root = argv[0], Path(argv[1])
    servers = server_set(root)
    if command == "stop":
        for s in servers.values():
            s.stop_by_port()
        return
    t0 = time.time()
    failed = {}
    for name, s in servers.items():
        if not s.is_healthy():
            s.start(detach=True)
            # Stagger: SGLang sizes its pools from free memory measured around weight loading,
            # so a neighbour allocating at that moment makes the check fail.
            try:
                s.wait_for_log("Memory pool end", timeout=300)
            except RuntimeError as e:  # one server failing must not stop the others
                failed[name] = str(e)[-1500:]
    times = {}
    for name, s in servers.items():
        if name in failed:
            continue
        try:
            times[name] = round(s.wait_healthy(timeout=float(argv[2]) if len(argv) > 2 else 900), 1)
        except (RuntimeError, TimeoutError) as e:
            failed[name] = str(e)[-1500:]
    print(json.dumps({"healthy_after_s": times, "total_s": round(time.time() - t0, 1)}))
    for name, why in failed.items():
        print(f"FAILED TO START {name}: {why}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main(sys.argv[1:])

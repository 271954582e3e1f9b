"""The GPU test server set: per tiny model (attention-only Qwen3, hybrid Qwen3.5; both the
agreeing binary pair), a plain server and DDTREE with and without the overlap scheduler, all on
one GPU in small memory slices.

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

from tests.gpu.harness import Server

MODELS = ("qwen3", "qwen35")
NEW_TOKENS = 128
NUM_NODES, TOPK = 31, 4  # budget 30 = the complete binary tree of depth 4
COMMON = [
    "--attention-backend", "flashinfer", "--dtype", "bfloat16", "--mem-fraction-static", "0.08",
    "--max-running-requests", "16", "--cuda-graph-max-bs", "16", "--context-length", "2048",
]  # fmt: skip
ENV = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", "SGLANG_DDTREE_SYNC_CHECK": "1"}


def ddtree_args(draft: Path) -> list[str]:
    return [
        "--speculative-algorithm",
        "DDTREE",
        "--speculative-draft-model-path",
        str(draft),
        "--speculative-num-draft-tokens",
        str(NUM_NODES),
        "--speculative-eagle-topk",
        str(TOPK),
    ]


VARIANTS = {
    "base": lambda draft: [],
    "ddtree": ddtree_args,
    "ddtree_sync": lambda draft: [*ddtree_args(draft), "--disable-overlap-schedule"],
}


def write_pair(root: Path, model: str) -> tuple[Path, Path]:
    """The agreeing binary pair (testing/binary_pair.py): deep side-branch acceptance every
    round, wide argmax margins (few bf16 near-ties)."""
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
        for variant, extra in VARIANTS.items():
            name = f"{model}-{variant}"
            servers[name] = Server(
                name, str(target), port, [*COMMON, *extra(draft)], ENV, log_dir=root / "logs"
            )
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
    for s in servers.values():
        if not s.is_healthy():
            s.start(detach=True)
            # Stagger: SGLang sizes its pools from free memory measured around weight loading,
            # so a neighbour allocating at that moment makes the check fail.
            s.wait_for_log("Memory pool end", timeout=300)
    times = {}
    for name, s in servers.items():
        times[name] = round(s.wait_healthy(timeout=float(argv[2]) if len(argv) > 2 else 900), 1)
    print(json.dumps({"healthy_after_s": times, "total_s": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main(sys.argv[1:])

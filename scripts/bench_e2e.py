"""End-to-end speed on the real (trained) pair: DDTREE (node-budget sweep) vs DFLASH vs plain
decoding, all servers in one run on one GPU, with held-out prompts.

    python scripts/bench_e2e.py --out OUT [--target DIR --draft DIR (default: the shipped pair)]
        [--budgets 16,32,64,128] [--concurrency 1,4,16] [--prompts 64] [--tokens 256]

Prompts: the opening lines of files from the packages the training held out (asyncio, email,
http, ...; `training.corpus.HELD_OUT_STDLIB`), deterministic order. For each server and
concurrency c: c clients send requests back to back until every prompt was served once; reported
are output tokens/s, mean time per output token, mean acceptance length (SGLang's meta_info), and
for DDTREE the reference engine's acceptance length on the first prompts (at T=0 it must equal
SGLang's, round for round), and how many outputs equal the plain server's (greedy). All
servers start up front in small memory slices; they are measured one at a time, so each has
the GPU's compute to itself.
`--attach ROOT`: measure the pair's servers of the GPU test set (tests/gpu/servers.py, already
running under ROOT, as its ROOT/servers.json lists them: plain, DFLASH, DDTREE N=32 (torch and
Triton tree builders) and N=64, top-8) instead of starting new ones.
Output: OUT/budget_sweep_pair.jsonl (with --profile also OUT/round_profile_pair.jsonl) and a
table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import harness  # beside this script (scripts/harness.py)
import round_trace  # beside this script (scripts/round_trace.py)
from harness import ADMIN_ARGS

from sglang_ddtree import DEMO_PAIR_DIR
from sglang_ddtree.training.corpus import heldout_prompts

COMMON = [
    *ADMIN_ARGS,  # the tools' admin calls (/flush_cache, /start_profile)
    "--attention-backend",
    "flashinfer",
    "--dtype",
    "bfloat16",
    "--mem-fraction-static",
    "0.08",
    "--max-running-requests",
    "16",
    "--cuda-graph-max-bs-decode",
    "16",
]


TOPK = 8  # DDTREE's --speculative-eagle-topk, and the reference engine's topk beside it


def server_table(draft: str, budgets: list[int]) -> dict[str, list[str]]:
    spec = ["--speculative-draft-model-path", draft]
    table = {"none": [], "dflash": ["--speculative-algorithm", "DFLASH", *spec]}
    for n in budgets:
        table[f"ddtree{n}"] = [
            "--speculative-algorithm",
            "DDTREE",
            *spec,
            "--speculative-num-draft-tokens",
            str(n),
            "--speculative-eagle-topk",
            str(TOPK),
        ]
    return table


def attached_servers(root: Path) -> list:
    """The trained pair's servers of the GPU test set (ROOT/servers.json, written by
    `python -m tests.gpu.servers launch ROOT`), renamed as this script names its own."""
    try:
        table = json.loads((Path(root) / "servers.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"no server table under {root} ({exc}): start the set first") from exc
    missing = [
        n for n in ("pair-base", "pair-dflash", "pair-ddtree", "pair-ddtree64") if n not in table
    ]
    if missing:
        raise SystemExit(
            f"the server set under {root} has no {', '.join(missing)}: start the "
            "whole set (without DDTREE_GPU_SERVERS) first"
        )
    spec = table["pair-ddtree"]["args"]
    nodes = int(spec[spec.index("--speculative-num-draft-tokens") + 1])
    topk = int(spec[spec.index("--speculative-eagle-topk") + 1])
    assert topk == TOPK, (topk, TOPK)
    names = {
        "none": "pair-base",
        "dflash": "pair-dflash",
        f"ddtree{nodes}": "pair-ddtree",
        "ddtree64": "pair-ddtree64",
    }
    servers = []
    for name, test_name in names.items():
        row = table[test_name]
        server = harness.Server(
            test_name, row["model_path"], row["port"], row["args"], log_dir=Path(row["log_dir"])
        )
        if not server.is_healthy():
            raise SystemExit(f"{test_name} is not running under {root}")
        server.name = name
        servers.append(server)
    return servers


def load(server, prompts: list[str], concurrency: int, tokens: int) -> dict:
    def one(prompt):
        t0 = time.perf_counter()
        out = harness.generate(
            server, prompt, max_new_tokens=tokens, temperature=0, ignore_eos=True
        )
        return time.perf_counter() - t0, out["meta_info"], out["output_ids"]

    harness.run_all(one, prompts[:concurrency], concurrency)  # warm-up
    t0 = time.perf_counter()
    results = harness.run_all(one, prompts, concurrency)
    wall = time.perf_counter() - t0
    produced = sum(m["completion_tokens"] for _, m, _ in results)
    return {
        "tokens_per_s": produced / wall,
        "tpot_ms": 1e3 * statistics.mean(lat / m["completion_tokens"] for lat, m, _ in results),
        "accept_len": statistics.mean(m.get("spec_accept_length", 1.0) for _, m, _ in results),
        "verify_ct": [m.get("spec_verify_ct") for _, m, _ in results],
        "output_ids": [ids for _, _, ids in results],
    }


def budget_of(name: str) -> int:
    """The reference engine's node budget (N - 1, the root excluded) of a `ddtree<N>...` server."""
    return int(re.match(r"ddtree(\d+)", name).group(1)) - 1


def reference_rounds(target: str, draft: str, prompts: list[str], budget: int, tokens: int):
    """The reference engine's round count per prompt (float32; on the GPU when there is one:
    on the device's CPUs, beside the servers, 2 prompts x 128 tokens took 5 minutes)."""
    import torch

    from sglang_ddtree.reference.engine import generate, load_pair

    device = "cuda" if torch.cuda.is_available() else "cpu"
    runner, drafter, tok = load_pair(target, draft, device=device)
    out = []
    for prompt in prompts:
        res = generate(runner, drafter, tok(prompt)["input_ids"], tokens, budget=budget, topk=TOPK)
        out.append(res.rounds)
    return out


def profile(servers: list, out: Path) -> None:
    for server in servers:
        if server.name == "none":
            continue
        for bs in (1, 8):
            row = {
                "server": server.name,
                "bs": bs,
                **round_trace.profile_parts(server, bs, out / "traces"),
            }
            print(json.dumps(row), flush=True)
            with open(out / "round_profile_pair.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")


def plot(rows: list[dict], path: Path) -> None:
    """Output tokens/s against concurrency, one line per server (acceptance in the legend)."""
    series = {}
    for name in dict.fromkeys(r["server"] for r in rows):
        mine = [r for r in rows if r["server"] == name]
        accept = statistics.mean(r["accept_len"] for r in mine)
        series[f"{name} (accept {accept:.2f})"] = [
            (r["concurrency"], r["tokens_per_s"]) for r in mine
        ]
    harness.line_plot(
        series,
        path,
        xlabel="concurrency",
        ylabel="output tokens/s",
        title="trained pair (9.7M target, 2.0M DFlash draft), one H200",
        log2_x=True,
    )


def print_table(rows: list[dict]) -> None:
    print(f"\n{'server':<16} {'conc':>4} {'tok/s':>9} {'TPOT ms':>8} {'accept':>7} {'same':>5}")
    for r in rows:
        print(
            f"{r['server']:<16} {r['concurrency']:>4} {r['tokens_per_s']:>9.1f} "
            f"{r['tpot_ms']:>8.2f} {r['accept_len']:>7.2f} "
            f"{r.get('identical_to_plain', '-'):>5}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=str(DEMO_PAIR_DIR / "target"))
    p.add_argument("--draft", default=str(DEMO_PAIR_DIR / "draft"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budgets", default="16,32,64,128")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--reference-prompts", type=int, default=4)
    p.add_argument("--attach", type=Path, help="use the running GPU test servers under this root")
    p.add_argument(
        "--plot-only", type=Path, help="re-plot a budget_sweep_pair.jsonl into OUT and stop"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="then profile one round of each speculative server at batch 1 and 8 "
        "(round_trace.profile_parts: GPU ms per DDTREE part, host ms, syncs per round)",
    )
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        rows = [json.loads(line) for line in args.plot_only.read_text().splitlines() if line]
        print_table(rows)
        plot(rows, args.out / "bench_e2e.png")
        return 0
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    prompts = heldout_prompts(args.prompts)
    budgets = [int(b) for b in args.budgets.split(",")]
    if args.attach:
        servers = attached_servers(args.attach)
    else:
        servers = [
            harness.Server(name, args.target, 33000 + 10 * i, [*COMMON, *extra], log_dir=logs)
            for i, (name, extra) in enumerate(server_table(args.draft, budgets).items())
        ]
        # Start every server up front (staggered: SGLang sizes its pools from the free memory
        # it sees while loading), then measure one at a time; an idle server does not use the
        # GPU.
        t0 = time.time()
        for server in servers:
            server.start()
            server.wait_for_log("Memory pool end", timeout=600)
        for server in servers:
            server.wait_healthy(timeout=900)
        print(json.dumps({"all_healthy_after_s": round(time.time() - t0, 1)}), flush=True)
    rows, plain_ids = [], None
    try:
        for server in servers:
            for c in (int(x) for x in args.concurrency.split(",")):
                row = {
                    "server": server.name,
                    "concurrency": c,
                    **load(server, prompts, c, args.tokens),
                }
                ids = row.pop("output_ids")
                if server.name == "none" and c == 1:
                    plain_ids = ids
                if plain_ids is not None:  # greedy: the same tokens as the plain server?
                    row["identical_to_plain"] = sum(
                        a == b for a, b in zip(ids, plain_ids, strict=False)
                    )
                    row["first_divergence"] = [
                        harness.first_divergence(a, b) for a, b in zip(ids, plain_ids, strict=False)
                    ]
                if server.name.startswith("ddtree") and c == 1 and args.reference_prompts:
                    k = args.reference_prompts
                    try:
                        ref = reference_rounds(
                            args.target,
                            args.draft,
                            prompts[:k],
                            budget_of(server.name),
                            args.tokens,
                        )
                    except Exception as e:  # the measured rows matter more; report and go on
                        ref = f"reference engine failed: {e!r}"
                    row["reference_rounds"], row["sglang_rounds"] = ref, row["verify_ct"][:k]
                rows.append(row)
                print(
                    json.dumps(
                        {k: v for k, v in row.items() if k not in ("verify_ct", "first_divergence")}
                    ),
                    flush=True,
                )
                with open(args.out / "budget_sweep_pair.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
        if args.profile:
            profile(servers, args.out)
    finally:
        for server in servers:
            server.stop()  # only those this script started (attached ones have no process)
    print_table(rows)
    if rows:
        try:
            plot(rows, args.out / "bench_e2e.png")
        except ImportError as exc:  # matplotlib is optional; the jsonl has everything
            print(f"no plot: {exc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Per-round decode cost at Qwen3.6-27B scale (dummy weights), DDTREE against DFLASH, NEXTN (the
built-in MTP layer with its tree) and no speculation, side by side on one GPU.

    python scripts/bench_round.py --out OUT [--variants none,dflash,nextn,ddtree32,ddtree64]
        [--batch 1,4,8,16] [--tokens 96] [--profile ddtree64]

Per variant: one server (CUDA graphs on, FlashInfer), then for each batch size b: b concurrent
requests of 1, `--tokens` / 2 and `--tokens` new tokens. Round time = the slope of request
latency against the request's decode rounds (spec_verify_ct, or new tokens - 1 for plain
decoding). Dummy weights accept at random, so this is the cost of a round, not a speed-up;
`--simulate` gives every server a world in which drafts are accepted as a real drafter's are
(docs/simulation.md), and `--serving` measures end to end in it. Also recorded: the Gated DeltaNet
verify scratch the server allocated, and (for `--profile` variants) GPU time per DDTREE part from
SGLang's torch-profiler trace, using the worker's `ddtree.*` ranges.
Output: OUT/round_cost_27b.jsonl (one row per measurement; docs/data/ keeps them, docs/results.md
shows them), a table on stdout, OUT/bench_round.png. The unit tests check configs, variants and
the trace parsers on CPU.
"""

from __future__ import annotations

import argparse
import bisect
import glob
import gzip
import json
import re
import statistics
import time
from pathlib import Path

import harness  # beside this script (scripts/harness.py)
from bench_serving import bench_args, run_bench, write_dataset

QWEN36_TEXT = dict(  # Qwen3.6-27B text sizes (ddtree.md §3)
    model_type="qwen3_5_text",
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    attn_output_gate=True,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    full_attention_interval=4,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    partial_rotary_factor=0.25,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
        "partial_rotary_factor": 0.25,
    },
    tie_word_embeddings=False,
    dtype="bfloat16",
    mtp_num_hidden_layers=1,
    mtp_use_dedicated_embeddings=False,
)
DRAFT = dict(  # a Qwen3.6-27B-DFlash-shaped draft: 5 layers, 4 sliding + 1 full, block 16
    architectures=["DFlashDraftModel"],
    model_type="qwen3",
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=5,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1e7,
    max_position_embeddings=262144,
    hidden_act="silu",
    use_sliding_window=True,
    sliding_window=2048,
    layer_types=["sliding_attention"] * 4 + ["full_attention"],
    num_target_layers=64,
    block_size=16,
    dflash_config={"target_layer_ids": [1, 16, 31, 46, 61]},
    tie_word_embeddings=False,
    dtype="bfloat16",
)
# Prefill CUDA graphs are off: they do not touch the decode round and took 33-112 s to capture
# per server at 27B.
COMMON = [
    "--attention-backend",
    "flashinfer",
    "--load-format",
    "dummy",
    "--context-length",
    "8192",
    "--mem-fraction-static",
    "0.85",
    "--disable-prefill-cuda-graph",
]


# Gated DeltaNet verify scratch: SGLang keeps every verified token's recurrent state until the
# commit, 48 layers x 48 heads x 128 x 128 per request and token (144 MiB in float32, 72 MiB in
# bfloat16), for (running requests + 1) x verify width. This much of the H200 goes to it; the
# rest holds the 27B weights (~56 GB with the draft), the KV cache and the live states.
SCRATCH_GIB = 48
VOCAB = 1024  # the written tokenizer's (the model's vocabulary is Qwen3.6's)
GDN_STATE_MIB = 48 * 48 * 128 * 128 * 4 / 2**20
MAMBA_SLOTS_PER_REQ = 6  # >= SGLang's mamba slots per running request (3, +2 with overlap)
# SGLang's SSM-state dtype (SGLANG_MAMBA_SSM_DTYPE; float32 by default): the `_bf16ssm` variants
# halve the scratch, which is what lets N = 64 run 8 requests.
# `_sglanggdn`: DDTREE with SGLang's own GDN tree verify, conv1d and commit (per-node states)
# instead of sglang_ddtree.gdn's (and its compact scratch, which lets 16 requests run at any N).
# `_sglangplan`: SGLang's FlashInfer plan for the verify instead of round/verify_plan.py's
# (the measurement that decides which of the two stays).
VARIANT_ENV = {
    "_bf16ssm": {"SGLANG_MAMBA_SSM_DTYPE": "bfloat16"},
    "_sglanggdn": {"SGLANG_DDTREE_GDN": "sglang"},
    "_sglangplan": {"SGLANG_DDTREE_VERIFY_PLAN": "sglang"},
    "_auto": {"SGLANG_DDTREE_WIDTH": "auto"},
}
# DDTREE's default picks a verify width per round (SGLANG_DDTREE_WIDTH=auto); the `ddtreeN`
# variants measure the round at N itself (fixed), `ddtreeN_auto` the default, whose server logs
# the cost table it measured per (batch bucket, width) (`width_table`).
FIXED = {"SGLANG_DDTREE_WIDTH": "fixed"}


def max_requests(width: int, state_bytes: int = 4, cap: int = 16) -> int:
    """Running requests whose verify scratch at `width` tokens fits SCRATCH_GIB (1 to cap)."""
    per_request_mib = GDN_STATE_MIB * state_bytes / 4 * width
    return max(1, min(cap, int(SCRATCH_GIB * 1024 / per_request_mib) - 1))


def variant_env(name: str) -> dict[str, str]:
    env = {k: v for suffix, env in VARIANT_ENV.items() if suffix in name for k, v in env.items()}
    if name.startswith("ddtree") and "_auto" not in name:
        env.update(FIXED)
    return env


def width_table(log: str) -> dict | None:
    """The last cost table an automatic-width server logged (round/worker.py): {"widths",
    "ms": {bucket: [ms or None per width]}, "chosen": "w x rounds, ..."}; None: none logged."""
    if "DDTREE widths after " not in log:
        return None
    lines = log.split("DDTREE widths after ")[-1].splitlines()[1:]
    widths = [int(w) for w in lines[0].split()[1:]]
    ms = {}
    for line in lines[1:]:
        if not line[:1].isdigit():
            break
        bucket, *cells = line.split()
        ms[int(bucket)] = [None if c == "-" else float(c) for c in cells]
    chosen = next((x for x in lines if x.startswith("widths chosen:")), "")
    return {"widths": widths, "ms": ms, "chosen": chosen.removeprefix("widths chosen:").strip()}


def variants(draft: Path, cap: int = 16) -> dict[str, list[str]]:
    """Server flags per variant. Speculative variants size the Mamba pool explicitly
    (--max-mamba-cache-size) so SGLang's verify scratch is reserved for max_requests() requests
    rather than solved from leftover memory; the compact-scratch DDTREE variants and plain
    decoding run at most `cap` requests (--max-running), the others at most 16."""

    def requests(n: int) -> list[str]:
        return [
            "--max-running-requests",
            str(n),
            "--max-mamba-cache-size",
            str(MAMBA_SLOTS_PER_REQ * n),
        ]

    def running(width: int, state_bytes: int = 4) -> list[str]:
        # SGLang's per-node scratch: at most 16 requests whatever `cap` (more leave the KV
        # cache too little memory on one H200)
        return requests(max_requests(width, state_bytes))

    spec = [
        "--speculative-draft-model-path",
        str(draft),
        "--speculative-draft-load-format",
        "dummy",
    ]
    dd = ["--speculative-algorithm", "DDTREE", *spec, "--speculative-eagle-topk", "8"]
    dflash = ["--speculative-algorithm", "DFLASH", *spec]
    out = {
        "none": ["--max-running-requests", str(cap)],
        "dflash": [*dflash, *running(16)],
        "dflash_bf16ssm": [*dflash, *running(16, 2)],
        "nextn": [
            "--speculative-algorithm",
            "NEXTN",
            "--speculative-eagle-topk",
            "4",
            "--speculative-num-steps",
            "3",
            "--speculative-num-draft-tokens",
            "8",
            *running(8),
        ],
    }
    for n in (16, 32, 64, 128):
        width = [*dd, "--speculative-num-draft-tokens", str(n)]
        # the compact scratch (the default): SGLang's default 16 requests at every N
        out[f"ddtree{n}"] = out[f"ddtree{n}_auto"] = out[f"ddtree{n}_sglangplan"] = [
            *width,
            *requests(cap),
        ]
        out[f"ddtree{n}_sglanggdn"] = [*width, *running(n)]  # N states per request
    out["ddtree64_sglanggdn_bf16ssm"] = [
        *dd,
        "--speculative-num-draft-tokens",
        "64",
        *running(64, 2),
    ]
    return out


def widths_rounds(server) -> dict[str, int] | None:
    """An automatic-width server's decode rounds per width since start-up (/server_info: the
    rank whose policy chooses for every rank reports them)."""
    status, info = harness.get(server.url + "/server_info")
    states = info.get("internal_states", []) if status == 200 else []
    counted = (s.get("ddtree", {}).get("widths_chosen") for s in states)
    return next((c for c in counted if c is not None), None)


def startup_timings(log: str) -> dict[str, float]:
    """SGLang's last "Engine startup timings (s): ..." line as {name: s} (the CUDA graph parts
    under their own names, e.g. target_verify, draft_decode); {} when the log has none."""
    lines = [x for x in log.splitlines() if "Engine startup timings (s):" in x]
    if not lines:
        return {}
    found = re.findall(r"(\w+)=([0-9.]+)", lines[-1].split("Engine startup timings (s):")[1])
    return {name: float(value) for name, value in found}


def effective_max_running(log: str) -> int | None:
    """The max_running_requests SGLang settled on (it can lower the flag to fit its pools)."""
    found = re.findall(r"max_running_requests=(\d+)", log)
    return int(found[-1]) if found else None


def write_configs(root: Path) -> tuple[Path, Path]:
    from sglang_ddtree.checkpoints.tiny import PREPROCESSOR_CONFIG, write_tokenizer

    target, draft = root / "qwen36-27b-dummy", root / "qwen36-27b-dflash-dummy"
    ids = write_tokenizer(target, VOCAB)
    draft.mkdir(parents=True, exist_ok=True)
    vision = dict(
        model_type="qwen3_5",
        depth=1,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        out_hidden_size=5120,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
        deepstack_visual_indexes=[],
        in_channels=3,
    )
    cfg = dict(
        architectures=["Qwen3_5ForConditionalGeneration"],
        model_type="qwen3_5",
        text_config={**QWEN36_TEXT, "eos_token_id": ids["<|im_end|>"]},
        vision_config=vision,
        tie_word_embeddings=False,
        dtype="bfloat16",
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"],
    )
    (target / "config.json").write_text(json.dumps(cfg, indent=1))
    (target / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=1))
    dcfg = {**DRAFT, "dflash_config": {**DRAFT["dflash_config"], "mask_token_id": ids["<|MASK|>"]}}
    (draft / "config.json").write_text(json.dumps(dcfg, indent=1))
    return target, draft


def _latencies(server, bs: int, tokens: int, temperature: float = 0.0) -> list[dict]:
    prompts = [harness.PROMPTS[i % len(harness.PROMPTS)] for i in range(bs)]

    def one(prompt):
        t0 = time.perf_counter()
        out = harness.generate(
            server, prompt, max_new_tokens=tokens, temperature=temperature, ignore_eos=True
        )
        return {"latency": time.perf_counter() - t0, "meta": out["meta_info"]}

    return harness.run_all(one, prompts, bs)


def wait_gpu_free(baseline: int, timeout: float = 120) -> float:
    """Until the GPU has 95% of `baseline` bytes free again (a stopped server's processes can
    hold their memory for seconds, and the next server sizes its pools from what is free);
    returns the free GiB."""
    import torch

    t0 = time.time()
    while True:
        free, _ = torch.cuda.mem_get_info()
        if free >= 0.95 * baseline or time.time() - t0 > timeout:
            return free / 2**30
        time.sleep(2)


def _decode_rounds(meta: dict) -> int:
    """Decode rounds after the prefill: verify passes (speculative), or new tokens past the
    first (plain decoding, where the prefill makes the first)."""
    return meta.get("spec_verify_ct") or meta["completion_tokens"] - 1


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y on x; None when every x is the same."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    return sxy / sxx if sxx > 0 else None


def measure(server, bs: int, tokens: int) -> dict:
    """One batch size's round cost: the slope of each request's latency against its decode
    rounds, over batches of `bs` requests of `tokens // 2` and `tokens` new tokens (each
    repeated until it holds at least 3 requests), after a warm-up at `tokens` (the graphs, and
    an automatic server's calibration of every width at this batch's graph bucket). What all
    requests share (the prefill, the client) falls in the intercept; a request's rounds are
    counted, not assumed, so acceptance (real or simulated) varying from request to request
    is what the slope runs over. A batch of 1-token requests gives prefill_ms and stays out of
    the fit (one such batch once took 900 ms at bs 16)."""
    _latencies(server, bs, tokens)  # warm-up
    repeat = -(-3 // bs)
    runs = {
        n: [r for _ in range(repeat) for r in _latencies(server, bs, n)]
        for n in (1, max(2, tokens // 2), tokens)
    }
    points = [(_decode_rounds(r["meta"]), r["latency"]) for n in runs if n > 1 for r in runs[n]]
    per_round = slope(points)
    full = runs[tokens]
    accept = [r["meta"].get("spec_accept_length", 1.0) for r in full]
    return {
        "bs": bs,
        "method": "slope",
        "round_ms": 1e3 * per_round if per_round and per_round > 0 else None,
        "requests": len(points),
        "tokens_per_s": bs * tokens / max(r["latency"] for r in full[-bs:]),
        "accept_len": statistics.mean(accept),
        "prefill_ms": 1e3 * statistics.median(r["latency"] for r in runs[1]),
    }


def long_prompts(server, lengths: list[int], vocab: int, tokens: int = 32) -> list[dict]:
    """Long prompts: per prompt length, one request alone and then 4 at once, greedy, whose
    token ids share their first three quarters (the radix cache serves it to the later ones).
    Per request: HTTP status, latency, cached prompt tokens, completion tokens, or the error;
    dummy weights, so the text is not compared."""
    import random

    rows = []
    for length in lengths:
        rnd = random.Random(length)
        shared = [rnd.randrange(10, vocab) for _ in range(length * 3 // 4)]

        def one(i, shared=shared, length=length, rnd_seed=length):
            tail = random.Random(rnd_seed * 100 + i)
            ids = shared + [tail.randrange(10, vocab) for _ in range(length - len(shared))]
            t0 = time.perf_counter()
            try:
                status, out = harness.post(
                    server.url + "/generate",
                    {
                        "input_ids": ids,
                        "sampling_params": {
                            "max_new_tokens": tokens,
                            "temperature": 0,
                            "ignore_eos": True,
                        },
                    },
                    timeout=180,
                )
            except OSError as exc:  # a timeout or a dropped connection: a result
                status, out = None, repr(exc)
            meta = out.get("meta_info", {}) if isinstance(out, dict) else {}
            return {
                "status": status,
                "latency_s": round(time.perf_counter() - t0, 3),
                "cached_tokens": meta.get("cached_tokens"),
                "completion_tokens": meta.get("completion_tokens"),
                "error": None if status == 200 else str(out)[:300],
            }

        for bs in (1, 4):
            results = harness.run_all(one, list(range(bs)), bs)
            rows.append(
                {
                    "prompt_tokens": length,
                    "bs": bs,
                    "requests": results,
                    "served": all(
                        r["status"] == 200 and r["completion_tokens"] == tokens for r in results
                    ),
                }
            )
            print(json.dumps({"long_context": rows[-1]}), flush=True)
    return rows


def gdn_scratch_gb(log: str) -> float | None:
    """The GDN verify scratch the Mamba pool allocated: SGLang's per-node states, or (the
    `_compact` variants) state/gdn_pool.py's scratch and conv windows."""
    m = re.search(r"intermediate_ssm_state_cache size: ([0-9.]+)GB", log) or re.search(
        r"compact GDN verify scratch for \d+ requests x \d+ nodes: ([0-9.]+) GB", log
    )
    return float(m.group(1)) if m else None


def profile_parts(
    server, bs: int, out_dir: Path, tokens: int = 48, temperature: float = 0.0
) -> dict:
    """From SGLang's torch-profiler trace of `bs` requests at `temperature`: {"gpu_ms": GPU ms
    per DDTREE part per round (parse_trace), "host": round period, host ms per part, syncs
    (parse_trace_host)}."""
    suffix = f"_t{temperature:g}" if temperature else ""
    trace_dir = out_dir / f"trace_{server.name}_bs{bs}{suffix}"
    trace_dir.mkdir(parents=True, exist_ok=True)
    harness.post(
        server.url + "/start_profile",
        {"output_dir": str(trace_dir), "num_steps": 12, "activities": ["CPU", "GPU"]},
    )
    _latencies(server, bs, tokens, temperature)
    deadline = time.time() + 120
    while time.time() < deadline and not glob.glob(str(trace_dir / "*.json*")):
        time.sleep(2)
    files = sorted(glob.glob(str(trace_dir / "*.json*")))
    if not files:
        return {}
    events = load_events(files[-1])  # one parse of the (large) trace for all three
    return {
        "gpu_ms": parse_trace(events),
        "host": parse_trace_host(events),
        "top_kernels": top_kernels(events),
        "host_functions": host_functions(events),
    }


def load_events(path: str) -> list[dict]:
    """The events of a torch-profiler trace (.json or .json.gz)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _round_starts(events: list[dict]) -> list[float]:
    """Start times of the scheduler's `run_batch` ranges: one per decode round."""
    return sorted(
        e["ts"]
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == "user_annotation"
        and e.get("name") == "scheduler.run_batch"
    )


def parse_trace_host(events: list[dict]) -> dict:
    """Host side of a trace: the median period of the scheduler's `run_batch` (one decode round
    per batch), the mean host ms of each `ddtree.*` range, and host synchronisations
    (cudaStreamSynchronize/cudaDeviceSynchronize) per round, with those whose innermost Python
    frame from sglang or sglang_ddtree is in sglang_ddtree counted as DDTREE's own."""
    starts = _round_starts(events)
    events = [e for e in events if e.get("ph") == "X"]
    ann = [e for e in events if e.get("cat") == "user_annotation"]
    gaps = [(b - a) / 1e3 for a, b in zip(starts, starts[1:], strict=False)]
    host: dict[str, list[float]] = {}
    for e in ann:
        if e["name"].startswith("ddtree."):
            host.setdefault(e["name"], []).append(e["dur"] / 1e3)
    frames = [e for e in events if e.get("cat") == "python_function"]
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and "Synchronize" in e["name"]]
    own, where = 0, {}
    for s in syncs:
        around = [
            f
            for f in frames
            if f["tid"] == s["tid"]
            and f["ts"] <= s["ts"] <= f["ts"] + f["dur"]
            and ("sglang/" in f["name"] or "sglang_ddtree/" in f["name"])
        ]
        inner = max(around, key=lambda f: f["ts"])["name"] if around else "(no sglang frame)"
        where[inner] = where.get(inner, 0) + 1
        if "sglang_ddtree/" in inner:
            own += 1
    rounds = max(len(starts), 1)
    launches = [e for e in events if e.get("cat") == "cuda_runtime" and "Launch" in e["name"]]
    return {
        "round_period_ms": statistics.median(gaps) if gaps else None,
        # kernel and graph launches from the host: each one's host cost, whoever issues it
        "launches_per_round": len(launches) / rounds,
        "launches_by_range": _launches_by_range(ann, launches, rounds),
        "host_ms": {k: statistics.mean(v) for k, v in host.items()},
        "syncs_per_round": len(syncs) / rounds,
        "own_syncs_per_round": own / rounds,
        # the innermost sglang / sglang_ddtree frame of each sync: which function waits
        "syncs_by_frame": {k: v / rounds for k, v in sorted(where.items(), key=lambda kv: -kv[1])},
    }


def _launches_by_range(ann: list[dict], launches: list[dict], rounds: int) -> dict[str, float]:
    """Launches per round inside each `ddtree.*` range (same thread; the ranges do not nest)."""
    ranges = sorted(
        (e["ts"], e["ts"] + e["dur"], e["tid"], e["name"])
        for e in ann
        if e["name"].startswith("ddtree.")
    )
    starts = [r[0] for r in ranges]
    out: dict[str, float] = {}
    for e in launches:
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i >= 0 and e["ts"] <= ranges[i][1] and e["tid"] == ranges[i][2]:
            out[ranges[i][3]] = out.get(ranges[i][3], 0) + 1
    return {k: v / rounds for k, v in sorted(out.items())}


def host_functions(events: list[dict], n: int = 150) -> list[tuple[str, float]]:
    """The n sglang / sglang_ddtree Python functions with the most host time, and every other
    sglang_ddtree one, as (frame, ms per round; inclusive: a caller's time holds its callees'):
    where a round's host time goes."""
    rounds = max(len(_round_starts(events)), 1)
    total: dict[str, float] = {}
    for e in events:
        name = e.get("name", "")
        if (
            e.get("ph") == "X"
            and e.get("cat") == "python_function"
            and ("sglang/" in name or "sglang_ddtree/" in name)
        ):
            total[name] = total.get(name, 0.0) + e["dur"]
    ranked = sorted(total.items(), key=lambda kv: -kv[1])
    kept = ranked[:n] + [kv for kv in ranked[n:] if "sglang_ddtree/" in kv[0]]
    return [(name, round(us / rounds / 1e3, 4)) for name, us in kept]


def top_kernels(events: list[dict], n: int = 15) -> list[tuple[str, float]]:
    """The n GPU kernels with the most time in the trace, as (name, ms per round), rounds
    counted by the scheduler's `run_batch` ranges: which kernels a round's GPU time is made of."""
    rounds = len(_round_starts(events))
    total: dict[str, float] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            total[e["name"][:120]] = total.get(e["name"][:120], 0.0) + e["dur"]
    ranked = sorted(total.items(), key=lambda kv: -kv[1])[:n]
    return [(name, round(us / max(rounds, 1) / 1e3, 4)) for name, us in ranked]


def parse_trace(events: list[dict]) -> dict[str, float]:
    """Sum the GPU kernel time launched inside each `ddtree.*` range, per round (ms). Ranges are
    the host-side ones (the profiler also mirrors them on the GPU timeline); launches include
    driver calls, which is how CUDA-graph replays (cuGraphLaunch) appear."""
    ranges = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == "user_annotation"
        and str(e.get("name", "")).startswith("ddtree.")
    ]
    launches = [
        e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    ]
    kernels = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "correlation" in e.get(
            "args", {}
        ):
            kernels.setdefault(e["args"]["correlation"], []).append(e["dur"])
    totals, counts = {}, {}
    for r in ranges:
        lo, hi = r["ts"], r["ts"] + r["dur"]
        gpu_us = sum(
            sum(kernels.get(e["args"]["correlation"], []))
            for e in launches
            if e["tid"] == r["tid"] and lo <= e["ts"] <= hi
        )
        totals[r["name"]] = totals.get(r["name"], 0.0) + gpu_us
        counts[r["name"]] = counts.get(r["name"], 0) + 1
    return {k: totals[k] / counts[k] / 1e3 for k in totals}


SIMULATE = "SGLANG_DDTREE_SIMULATE"


def simulated(value: str) -> dict | None:
    """The world --simulate names, as its rows record it (None: no simulation)."""
    from sglang_ddtree.simulation import parse

    world = parse(value)
    return world.as_dict() if world else None


def serving_requests(concurrency: int, per_client: int) -> int:
    return max(16, per_client * concurrency)


def serve(
    server, dataset: Path, tokenizer: str, concurrency: int, tokens: int, per_client: int, out: Path
) -> dict:
    """One sglang.bench_serving run at this concurrency (scripts/bench_serving.py's prompts and
    arguments): tokens/s, TPOT, TTFT and SGLang's accept length. A first wave of `concurrency`
    requests goes unmeasured: without it, each server's first run at 4 clients stalled one
    request about 6 s before its first token (a first-seen prefill shape), a third of the run."""
    prompts = serving_requests(concurrency, per_client)
    run_bench(
        bench_args(
            server,
            dataset,
            tokenizer,
            concurrency,
            concurrency,
            0.0,
            tokens,
            out / f"bench_serving_{server.name}_warmup.jsonl",
        )
    )
    argv = bench_args(
        server,
        dataset,
        tokenizer,
        prompts,
        concurrency,
        0.0,
        tokens,
        out / f"bench_serving_{server.name}.jsonl",
    )
    result = run_bench(argv)
    return {
        "concurrency": concurrency,
        "requests": prompts,
        "tokens": tokens,
        "output_tok_s": result["output_throughput"],
        "median_tpot_ms": result.get("median_tpot_ms"),
        "median_ttft_ms": result.get("median_ttft_ms"),
        "accept_len": result.get("accept_length"),
    }


def plot(rows: list[dict], path: Path) -> None:
    """ms per decode round against batch size, one line per variant."""
    series = {
        name: [(r["bs"], r["round_ms"]) for r in rows if r["variant"] == name]
        for name in dict.fromkeys(r["variant"] for r in rows)
    }
    harness.line_plot(
        series,
        path,
        xlabel="batch size",
        ylabel="ms per decode round",
        title="Qwen3.6-27B-shaped target (dummy weights), one H200",
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/root/bench_round"))
    p.add_argument("--variants", default="none,dflash,nextn,ddtree16,ddtree32,ddtree64,ddtree128")
    p.add_argument("--batch", default="1,4,8,16")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--profile", default="ddtree64", help="variants to profile at bs 1 and 8")
    p.add_argument(
        "--graph-max-bs", type=int, help="--cuda-graph-max-bs-decode (default: max --batch)"
    )
    p.add_argument("--port-base", type=int, default=32000, help="variant i listens on base + i")
    p.add_argument(
        "--max-running",
        type=int,
        default=16,
        help="the most running requests a variant is started with (the Mamba pool sized for them)",
    )
    p.add_argument(
        "--simulate",
        default="",
        help="a simulated world for every server "
        "(SGLANG_DDTREE_SIMULATE, sglang_ddtree/simulation.py: e.g. narrative), so "
        "that drafts are accepted as a real drafter's would be",
    )
    p.add_argument(
        "--serving",
        default="",
        help="after each variant's rounds, "
        "sglang.bench_serving at these concurrencies (e.g. 1,8,16,32): "
        "OUT/serving_simulated_27b.jsonl",
    )
    p.add_argument(
        "--serving-variants", default="", help="the variants --serving runs on (default: every one)"
    )
    p.add_argument("--serving-tokens", type=int, default=256, help="new tokens per request")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument(
        "--long-context",
        default="",
        help="after each variant's rounds, prompts of "
        "these token counts alone and 4 at once (e.g. 16384,32768); the context "
        "length becomes the largest + 1024",
    )
    args = p.parse_args()
    sizes = [b for v in args.variants.split(",") if "@" in v for b in v.split("@")[1].split("+")]
    graph_bs = args.graph_max_bs or max(int(b) for b in [*args.batch.split(","), *sizes])
    args.out.mkdir(parents=True, exist_ok=True)
    target, draft = write_configs(args.work)
    table = variants(draft, args.max_running)
    lengths = [int(n) for n in args.long_context.split(",") if n]
    common = list(COMMON)
    if lengths:
        common[common.index("--context-length") + 1] = str(max(lengths) + 1024)
    import torch

    baseline = torch.cuda.mem_get_info()[0]  # free before any server (others may share the GPU)
    rows = []
    world = simulated(args.simulate)
    concurrencies = [int(c) for c in args.serving.split(",") if c]
    dataset = None
    if concurrencies:
        most = max(serving_requests(c, args.requests_per_client) for c in concurrencies)
        dataset = write_dataset(args.out / "prompts.jsonl", most)

    def emit(row: dict, kind: str = "round_cost_27b") -> None:
        row = {**row, "simulate": world} if world else row
        if kind == "round_cost_27b":
            rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out / f"{kind}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    for i, spec in enumerate(args.variants.split(",")):
        # NAME@B+B: that variant at those batch sizes only
        name, _, only = spec.partition("@")
        batches = [int(b) for b in (only.split("+") if only else args.batch.split(","))]
        extra = [*common, "--cuda-graph-max-bs-decode", str(graph_bs), *table[name]]
        env = {**variant_env(name), **({SIMULATE: args.simulate} if world else {})}
        server = harness.Server(
            name, str(target), args.port_base + i, extra, env=env, log_dir=args.out
        )
        print(json.dumps({"variant": name, "gpu_free_gib": round(wait_gpu_free(baseline), 1)}))
        server.start()
        try:
            healthy_s = server.wait_healthy(timeout=900)  # from launch
            startup = {"healthy_s": round(healthy_s, 1), **startup_timings(server.log_text())}
            scratch = gdn_scratch_gb(server.log_text())
            max_req = int(table[name][table[name].index("--max-running-requests") + 1])
            max_req = min(max_req, effective_max_running(server.log_text()) or max_req)
            for bs in batches:
                if bs > max_req:  # what does not fit is a row too
                    emit(
                        {
                            "variant": name,
                            "bs": bs,
                            "max_running": max_req,
                            "error": f"does not fit: at most {max_req} running requests",
                        }
                    )
                    continue
                row = {
                    "variant": name,
                    "gdn_scratch_gb": scratch,
                    "max_running": max_req,
                    "startup": startup,
                    **measure(server, bs, args.tokens),
                }
                if name in args.profile.split(",") and bs in (1, 8):
                    row["profile"] = profile_parts(server, bs, args.work)
                if "_auto" in name:
                    row["width_table"] = width_table(server.log_text())
                emit(row)
            serving = not args.serving_variants or name in args.serving_variants.split(",")
            for concurrency in concurrencies if serving else []:
                row = serve(
                    server,
                    dataset,
                    str(target),
                    concurrency,
                    args.serving_tokens,
                    args.requests_per_client,
                    args.out,
                )
                row.update(variant=name, max_running=max_req)
                if "_auto" in name:
                    row["widths_rounds"] = widths_rounds(server)
                emit(row, "serving_simulated_27b")
            if lengths:
                emit({"variant": name, "long_context": long_prompts(server, lengths, VOCAB)})
        except Exception as exc:  # a variant that does not fit is a result, not a crash
            emit({"variant": name, "error": str(exc)[-500:]})
        finally:
            server.stop()
    ok = [r for r in rows if r.get("round_ms") is not None]
    print(f"\n{'variant':<10} {'bs':>3} {'ms/round':>9} {'tok/s':>8} {'accept':>7} {'GDN GB':>7}")
    for r in ok:
        print(
            f"{r['variant']:<10} {r['bs']:>3} {r['round_ms']:>9.2f} {r['tokens_per_s']:>8.1f} "
            f"{r['accept_len']:>7.2f} {r['gdn_scratch_gb'] or 0:>7.2f}"
        )
    if ok:
        plot(ok, args.out / "bench_round.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

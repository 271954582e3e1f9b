"""SGLang's torch-profiler trace of a server's decode rounds, taken and read: GPU ms per DDTREE
part (the worker's `ddtree.*` ranges), the host side (round period, host ms per range, syncs,
launches), the top kernels and the Python functions with the most host time.

bench_round.py, bench_serving.py and bench_e2e.py profile their servers through
`profile_parts`; the parsers are plain Python over the trace's events (the unit tests feed them
hand-made ones). Scripts beside this file import it by name, as they do harness.py.
"""

from __future__ import annotations

import bisect
import glob
import gzip
import json
import statistics
import time
from pathlib import Path

import harness  # beside this script (scripts/harness.py)


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
        admin=True,
    )
    harness.timed_requests(server, bs, tokens, temperature)
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

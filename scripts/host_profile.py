"""Where a server's host time goes in a decode round: the call tree of the scheduler's main
thread, in ms per round, side by side for several servers (from host_sampler's samples).

    python scripts/host_profile.py DIR [DIR ...] [--min-ms 0.03] [--depth 14] [--focus NAME]
        [--own worker.py,widths.py,...]

Each DIR is what `scripts/bench_serving.py --host-profile` wrote for one server and temperature:
the sampler's <pid>.txt files (scripts/host_sampler/sitecustomize.py) and meta.json, the
sampled run's bench_serving row. Rounds = output tokens / accept length (tokens for a server
without speculation): the batch rounds at concurrency 1, request rounds beyond (c of them share
one batch round). A frame's ms per round = its share of the main thread's samples x the sampled
seconds / rounds; the sampled seconds include the run's idle gaps (under the scheduler's
on_idle and recv_requests frames), and sampling slows a server about 2x, so compare servers
sampled alike, frame by frame. --focus starts the tree at the first frame of that name (e.g.
forward_batch_generation); frames under --min-ms in every column are left out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_LOOP = "scheduler.py:event_loop"  # the scheduler's loops: event_loop_normal / _overlap


def read_samples(path: Path) -> tuple[dict, dict[str, int]]:
    lines = path.read_text().splitlines()
    stacks = {}
    for line in lines[1:]:
        stack, _, n = line.rpartition(" ")
        stacks[stack] = stacks.get(stack, 0) + int(n)
    return json.loads(lines[0]), stacks


def scheduler_stacks(folder: Path) -> tuple[dict, list[tuple[list[str], int]]]:
    """The sampled process whose main thread runs the scheduler loop: (header, stacks)."""
    for path in sorted(folder.glob("*.txt")):
        head, stacks = read_samples(path)
        main = [(s.split(";")[1:], n) for s, n in stacks.items() if s.startswith("MainThread;")]
        if any(_LOOP in s for frames, _ in main for s in frames):
            return head, main
    raise SystemExit(f"{folder}: no sampled process runs the scheduler loop")


def rounds(meta: dict) -> float:
    tokens = float(meta["total_output_tokens"])
    return tokens / float(meta.get("accept_length") or 1.0)


def tree(stacks: list[tuple[list[str], int]], focus: str | None) -> dict:
    """{frame: [samples, children]} from the root (or from each --focus frame)."""
    root: dict = {}
    for frames, n in stacks:
        if focus is not None:
            names = [f.split(":", 1)[-1] for f in frames]
            if focus not in names:
                continue
            frames = frames[names.index(focus) :]
        node = root
        for f in frames:
            entry = node.setdefault(f, [0, {}])
            entry[0] += n
            node = entry[1]
    return root


def lines_of(
    trees: list[dict], scales: list[float], min_ms: float, depth: int, indent: int = 0
) -> list[str]:
    names = sorted(
        {k for t in trees for k in t},
        key=lambda k: -max(t.get(k, [0])[0] * s for t, s in zip(trees, scales, strict=True)),
    )
    out = []
    for name in names:
        ms = [t.get(name, [0])[0] * s for t, s in zip(trees, scales, strict=True)]
        if max(ms) < min_ms:
            continue
        cells = " | ".join(f"{m:6.3f}" for m in ms)
        out.append(f"| {cells} | {'. ' * indent}{name} |")
        if indent + 1 < depth:
            subs = [t.get(name, [0, {}])[1] for t in trees]
            out += lines_of(subs, scales, min_ms, depth, indent + 1)
    return out


def own_time(stacks: list[tuple[list[str], int]], prefixes: tuple[str, ...]) -> dict[str, int]:
    """--own: per frame of the named files, the samples of its stacks where it is the deepest
    such frame, by what it was running then (the callee one level down, or <self>): where the
    time of a package's own code goes, its calls into other code included."""
    out: dict[str, int] = {}
    for frames, n in stacks:
        mine = [i for i, f in enumerate(frames) if f.split(":", 1)[0] in prefixes]
        if mine:
            i = mine[-1]
            key = f"{frames[i]} -> {frames[i + 1] if i + 1 < len(frames) else '<self>'}"
            out[key] = out.get(key, 0) + n
    return out


def report(
    dirs: list[Path], min_ms: float = 0.03, depth: int = 14, focus: str | None = None, own: str = ""
) -> str:
    """The side-by-side table of `dirs` (one per server and run), as `main` prints it."""
    trees, scales, heads, owns = [], [], [], []
    for folder in dirs:
        head, stacks = scheduler_stacks(folder)
        meta = json.loads((folder / "meta.json").read_text())
        total = sum(n for _, n in stacks)
        scales.append(head["seconds"] * 1000.0 / total / rounds(meta))
        trees.append(tree(stacks, focus))
        owns.append(own_time(stacks, tuple(x for x in own.split(",") if x)))
        heads.append(
            f"{folder.parent.name}/{folder.name}: {rounds(meta):.0f} rounds, "
            f"{head['seconds'] * 1000.0 / rounds(meta):.2f} ms a round"
        )
    out = [
        *heads,
        "| " + " | ".join(f"{d.parent.name}/{d.name}" for d in dirs) + " | frame (ms per round) |",
        "|" + "---|" * (len(dirs) + 1),
    ]
    if not own:
        return "\n".join([*out, *lines_of(trees, scales, min_ms, depth)])
    keys = sorted(
        {k for o in owns for k in o},
        key=lambda k: -max(o.get(k, 0) * c for o, c in zip(owns, scales, strict=True)),
    )
    for k in keys:
        ms = [o.get(k, 0) * c for o, c in zip(owns, scales, strict=True)]
        if max(ms) >= min_ms:
            out.append("| " + " | ".join(f"{m:6.3f}" for m in ms) + f" | {k} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dirs", nargs="+", type=Path)
    p.add_argument("--min-ms", type=float, default=0.03)
    p.add_argument("--depth", type=int, default=14)
    p.add_argument("--focus", default=None)
    p.add_argument(
        "--own",
        default="",
        help="file names (e.g. worker.py,widths.py): instead of the tree, the time of "
        "their frames by what each ran, largest first",
    )
    args = p.parse_args()
    print(report(args.dirs, args.min_ms, args.depth, args.focus, args.own))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

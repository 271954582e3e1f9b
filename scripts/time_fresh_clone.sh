#!/usr/bin/env bash
# Time what a newcomer runs on a fresh clone, one step after another: the setup
# (scripts/setup_cpu.sh: creates .venv, ~3 GB from PyPI), the demo (scripts/demo.sh) and the
# tests (scripts/test.sh: ruff + pytest). Writes one JSON row to OUT for
#   python scripts/results_page.py add fresh_clone OUT
# (the README's stated times come from docs/data/fresh_clone.jsonl). It also samples the
# machine's load average during each step (load_mean): 2 CPUs shared with other work slow
# every step.
#   bash scripts/time_fresh_clone.sh [OUT] [REF]   OUT: default fresh_clone.jsonl; REF: HEAD
# The clone is of this repository's committed REF; uncommitted changes are not timed.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "${1:-fresh_clone.jsonl}")
commit=$(git -C "$repo" rev-parse --short "${2:-HEAD}")
work=$(mktemp -d)
sampler=""
trap '[ -n "$sampler" ] && kill "$sampler" 2>/dev/null; rm -rf "$work"' EXIT
# --no-local: copy the objects as a clone from a server would, not hard links
git clone -q --no-local "$repo" "$work/clone"
git -C "$work/clone" checkout -q "$commit"
cd "$work/clone"
load_before=$(cut -d' ' -f1 /proc/loadavg)
# the machine's 1-minute load average every 5 s, by step: on a shared machine other work on the
# CPUs slows every step, and the rows say how much there was
echo setup >"$work/step"
(while sleep 5; do echo "$(cat "$work/step") $(cut -d' ' -f1 /proc/loadavg)"; done \
  >>"$work/load.txt") &
sampler=$!

timed() {  # timed NAME CMD...: run CMD with its output in $work/NAME.log, seconds in $work/NAME.s
  local name=$1 t0
  shift
  echo "$name" >"$work/step"
  t0=$(date +%s.%N)
  echo "[time_fresh_clone] $name: $*" >&2
  if ! "$@" >"$work/$name.log" 2>&1; then
    echo "[time_fresh_clone] $name failed; the end of its output:" >&2
    tail -n 30 "$work/$name.log" >&2
    exit 1
  fi
  echo "$(date +%s.%N) - $t0" | bc >"$work/$name.s"
}

timed setup bash scripts/setup_cpu.sh
timed demo bash scripts/demo.sh
timed test bash scripts/test.sh

WORK=$work OUT=$out COMMIT=$commit LOAD="$load_before" python3 - <<'EOF'
import datetime, json, os, platform, re
from pathlib import Path

work = Path(os.environ["WORK"])
seconds = {n: round(float((work / f"{n}.s").read_text()), 1) for n in ("setup", "demo", "test")}
# pytest's summary line ("N passed, M skipped ... in S s"); a warning printed at interpreter exit
# can follow it
summary = next(line for line in reversed((work / "test.log").read_text().splitlines())
               if re.search(r"\d+ (passed|failed)", line))
mem_kb = int(next(l for l in open("/proc/meminfo") if l.startswith("MemTotal")).split()[1])
samples = [line.split() for line in (work / "load.txt").read_text().splitlines()]
load = {n: [float(v) for step, v in samples if step == n] for n in ("setup", "demo", "test")}
row = {
    "date": datetime.date.today().isoformat(),
    "commit": os.environ["COMMIT"],
    "command": "bash scripts/time_fresh_clone.sh OUT/fresh_clone.jsonl",
    "machine": {"cpus": os.cpu_count(), "memory_gb": round(mem_kb / 2**20),
                "python": platform.python_version()},
    "load_before": float(os.environ["LOAD"]),
    "load_mean": {n: round(sum(v) / len(v), 1) for n, v in load.items() if v},
    **{f"{n}_s": s for n, s in seconds.items()},
    "test_summary": summary.strip("= "),
}
Path(os.environ["OUT"]).write_text(json.dumps(row) + "\n")
print(json.dumps(row))
EOF

#!/usr/bin/env bash
# On the GPU device (see ../shared/gpu/README.md): after the bundle parts are stashed,
#   bash scripts/gpu_session.sh start [WAIT_S]   unpack sglang, install this package, start the
#                                                GPU test servers detached, wait until healthy
#   bash scripts/gpu_session.sh test [PYTEST ARGS]  run tests/gpu against the running servers
#   bash scripts/gpu_session.sh stop
#   bash scripts/gpu_session.sh train [MINUTES [TOTAL]]  start scripts/train_pair.py detached (it shares
#                                                the GPU with the test servers), log in ROOT
#   bash scripts/gpu_session.sh fetch-pair       copy the trained pair to $OUT in <16 MiB parts
#   bash scripts/gpu_session.sh bench-e2e [ARGS]    scripts/bench_e2e.py on the shipped pair
#   bash scripts/gpu_session.sh bench-round [ARGS]  scripts/bench_round.py (27B-shaped, dummy)
# Logs and results are copied to $OUT.
# The working tree carries the ~24 MiB shipped pair, so run `bash scripts/gpu_resplit.sh 26` once
# after ../shared/gpu/build_bundle.sh and stash the 5 smaller parts in 5 calls (the last one with
# .gpu/jitcache.tar.xz) to stay under the device tool's 64 MiB per call.
# Suggested test split (each call under 600 s):
#   bash scripts/gpu_session.sh test -k "greedy or deterministic or chat"
#   bash scripts/gpu_session.sh test -k "not (greedy or deterministic or chat)"
set -uo pipefail
cd "$(dirname "$0")/.."
eval "$(bash .gpu/device.sh env)" || exit 1
ROOT=${DDTREE_GPU_ROOT:-/root/ddtree-gpu}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/pip.log" 2>&1 \
  || { cat "$OUT/pip.log"; exit 1; }
case "${1:-}" in
  start)
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    python3 -m tests.gpu.servers start "$ROOT" "${2:-520}"; rc=$?
    tail -n 30 "$ROOT"/logs/*.log > "$OUT/server_tails.txt" 2>/dev/null
    tar czf "$OUT/logs.tgz" -C "$ROOT/logs" . 2>/dev/null
    exit $rc ;;
  test)
    shift
    DDTREE_GPU_ROOT="$ROOT" python3 -m pytest tests/gpu -m gpu -q -rA "$@" 2>&1 | tee "$OUT/pytest.log"
    rc=${PIPESTATUS[0]}
    tar czf "$OUT/logs.tgz" -C "$ROOT/logs" . 2>/dev/null
    exit $rc ;;
  stop) python3 -m tests.gpu.servers stop "$ROOT" ;;
  train)
    mkdir -p "$ROOT"
    setsid nohup python3 scripts/train_pair.py --out "$ROOT/pair" --device cuda \
      --minutes "${2:-10}" --total-minutes "${3:-${2:-10}}" > "$ROOT/train.log" 2>&1 < /dev/null &
    sleep 20; tail -n 5 "$ROOT/train.log" ;;
  fetch-pair)
    tail -n 20 "$ROOT/train.log" > "$OUT/train_tail.txt"
    cp "$ROOT/pair/report.json" "$OUT/" 2>/dev/null
    tar -C "$ROOT" -cf - pair | xz -1 -T0 | split -b 15M -d -a 1 - "$OUT/pair.tar.xz.part-"
    ls -la "$OUT" ;;
  bench-e2e)
    shift
    python3 -m tests.gpu.servers stop "$ROOT"  # the benchmark wants the GPU to itself
    demo=sglang_ddtree/assets/demo
    python3 scripts/bench_e2e.py --target $demo/target --draft $demo/draft --out "$OUT/e2e" "$@"
    rc=$?; tar czf "$OUT/e2e_logs.tgz" -C "$OUT/e2e" logs && rm -rf "$OUT/e2e/logs"; exit $rc ;;
  bench-round)
    shift
    python3 -m tests.gpu.servers stop "$ROOT"
    python3 scripts/bench_round.py --out "$OUT/round" "$@"
    rc=$?; tar czf "$OUT/round_logs.tgz" -C "$OUT/round" --remove-files \
      $(cd "$OUT/round" && ls server_*.log 2>/dev/null); exit $rc ;;
  *) echo "usage: gpu_session.sh start|test|stop|train|fetch-pair|bench-e2e|bench-round" >&2
     exit 2 ;;
esac

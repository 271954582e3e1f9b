#!/usr/bin/env bash
# The GPU suite and benchmarks on a CUDA machine, detached so that they outlive the calling shell.
# Needs SGLang 0.5.23 importable (as `python3 -m sglang.launch_server` would find it); installs
# this checkout into that Python with --no-deps. Results are copied to $OUT (default /tmp/out).
#   bash scripts/gpu_session.sh start [WAIT_S [PYTEST ARGS]]  install this package, launch the
#                                                GPU test servers detached, start the tests in
#                                                the background (one pytest per model, each
#                                                beginning as its servers come up), then
#                                                collect for up to WAIT_S
#   bash scripts/gpu_session.sh collect [WAIT_S] wait for the background tests, copy results
#   bash scripts/gpu_session.sh test-bg [PYTEST ARGS]  the background tests again
#   bash scripts/gpu_session.sh test [PYTEST ARGS]  tests/gpu in the foreground
#   bash scripts/gpu_session.sh stop
#   bash scripts/gpu_session.sh train [MINUTES [TOTAL]]  start scripts/train_pair.py detached (it shares
#                                                the GPU with the test servers), log in ROOT
#   bash scripts/gpu_session.sh bench-e2e [ARGS]    scripts/bench_e2e.py on the shipped pair (its servers
#                                                started with DDTREE_GPU_BENCH=1)
#   bash scripts/gpu_session.sh bench-round [ARGS]  scripts/bench_round.py (27B-shaped, dummy)
#   [ROUND=name] bash scripts/gpu_session.sh bench-round-bg [ARGS] / collect-round [WAIT_S]  the same,
#                                                detached (several at once under distinct ROUNDs)
#   bash scripts/gpu_session.sh chain GPU NAME [--after-tests] [ARGS]  on one GPU, detached: (the
#                                                tests, then) bench_round.py into ROOT/NAME
#   [GDN_ARGS=...|none SUITE_WAIT=S] bash scripts/gpu_session.sh all NAME [ARGS]  detached,
#                                                into ROOT/NAME: the suite with the GPU unit
#                                                tests beside it, bench_gdn_tree.py, then (given
#                                                ARGS) bench_round.py ARGS; collect-all NAME [WAIT_S]
#   [GDN_ARGS=... SERVING_ARGS=...] bash scripts/gpu_session.sh measure NAME [ARGS]  the same
#                                                with the benchmarks first on the quiet GPU
#                                                (bench_round.py ARGS, bench_gdn_tree.py), then
#                                                the suite (soak.py on bench_serving.py's
#                                                servers, fuzz_requests.py on its DDTREE one,
#                                                meanwhile), then
#                                                bench_serving.py on the pair
#   bash scripts/gpu_session.sh soak-serving DIR   the soak and fuzz on DIR's bench_serving servers
#   bash scripts/gpu_session.sh dflash2 NAME [MINUTES [ARGS]]  detached, into ROOT/NAME: a DFlash2
#                                                drafter for the shipped pair (train_dflash2.py,
#                                                MINUTES of training), then bench_serving.py's
#                                                four-way servers on it (ARGS replace its
#                                                defaults); collect-all NAME gathers it
#   bash scripts/gpu_session.sh bench-tree [ARGS]   scripts/bench_tree_build.py (no server)
#   bash scripts/gpu_session.sh bench-gdn [ARGS]    scripts/bench_gdn_tree.py (no server)
# Background processes (servers, tests) run in their own sessions; `collect` gathers their
# results as $OUT/results.tgz + summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=${DDTREE_GPU_ROOT:-/root/ddtree-gpu}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# (soak-serving runs beside `collect` inside `measure`: the package is installed already, and two
# editable installs at once could race)
[ "${1:-}" = soak-serving ] || python3 -m pip install -q --no-deps --no-build-isolation --no-index \
  -e . >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
# SUITE_MODELS="qwen3 pair" narrows the suite (its servers and tests) to those models
MODELS=${SUITE_MODELS:-qwen3 qwen35 pair}
# the runs `collect` waits for: one pytest per model, and the soak (tests/gpu/test_soak.py: the
# mixed soak and the fuzz on servers of its own; SOAK=0 leaves it out)
RUNS="$MODELS"; [ "${SOAK:-1}" = 0 ] || RUNS="$RUNS soak"
# each model's test files in the order of its servers' launch (tests/gpu/servers.py starts the
# FP8 and DFlash2 servers last; test_limits starts servers of its own, so after the set has
# settled); SUITE_FILES="..." narrows them
SUITE_FILES=${SUITE_FILES:-tests/gpu/test_serve.py tests/gpu/test_limits.py tests/gpu/test_fp8.py tests/gpu/test_dflash2.py}
N_RUNS=$(wc -w <<< "$RUNS")

test_bg() {  # one detached pytest per model, and the soak; ROOT/results/pytest_<run>.{log,rc}
  mkdir -p "$ROOT/results"; rm -f "$ROOT"/results/pytest_*.rc
  # each model's servers stop once its tests are done (memory for the rest); the soak's own
  # three servers start once every suite server has settled with 12 GB of GPU memory and 16 GB
  # of host memory to spare, or else once the first model's servers have stopped
  for m in $MODELS; do
    SUITE_FILES="$SUITE_FILES" DDTREE_GPU_ROOT="$ROOT" DDTREE_GPU_MODELS=$m DDTREE_GPU_WAIT=600 OMP_NUM_THREADS=4 \
      OUT="$ROOT/results" setsid nohup bash -c \
      'python3 -m pytest $SUITE_FILES -m gpu -q -rA --durations=12 "$@" > "$0.log" 2>&1; rc=$?
       python3 -m tests.gpu.servers stop "$DDTREE_GPU_ROOT" "$DDTREE_GPU_MODELS"; echo $rc > "$0.rc"' \
      "$ROOT/results/pytest_$m" "$@" < /dev/null > /dev/null 2>&1 &
  done
  [ "${SOAK:-1}" = 0 ] && return
  ROOT=$ROOT OMP_NUM_THREADS=4 OUT="$ROOT/results" setsid nohup bash -c \
    'room() {
       [ -s "$ROOT/status.json" ] && ! grep -q starting "$ROOT/status.json" &&
         [ "$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits | head -n 1)" -gt 12000 ] &&
         [ "$(free -m | awk "/^Mem:/ {print \$7}")" -gt 16000 ]
     }
     until ls "$(dirname "$0")"/pytest_*.rc > /dev/null 2>&1 || room; do sleep 5; done
     python3 -m pytest tests/gpu/test_soak.py -m soak -k "not long_soak" -q -rA > "$0.log" 2>&1
     echo $? > "$0.rc"' "$ROOT/results/pytest_soak" < /dev/null > /dev/null 2>&1 &
}

failures() {  # each failure as tests/gpu/conftest.py recorded it when it happened, the last $1
  # characters of its report
  for f in "$ROOT"/results/reports_*.jsonl; do
    [ -f "$f" ] && python3 -c 'import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["outcome"] == "failed":
        print("==", r["test"], r["when"], r["seconds"], "s")
        print(r["detail"][-int(sys.argv[2]):])' "$f" "$1"
  done
}

collect() {  # wait up to $1 s for every background pytest; results to $OUT
  local t0=$SECONDS
  while [ $((SECONDS - t0)) -lt "$1" ]; do
    n=$(ls "$ROOT"/results/pytest_*.rc 2>/dev/null | wc -l)
    [ "$n" -ge "$N_RUNS" ] && break
    sleep 5
  done
  {
    echo "== server status"; cat "$ROOT/status.json" 2>/dev/null; echo
    for m in $RUNS; do
      echo "== pytest $m rc=$(cat "$ROOT/results/pytest_$m.rc" 2>/dev/null || echo running)"
      grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|^[0-9.]+s (call|setup)" \
        "$ROOT/results/pytest_$m.log" 2>/dev/null | tail -n 60
    done
    failures 1500
  } > "$OUT/summary.txt"
  cat "$OUT/summary.txt"
  tar czf "$OUT/results.tgz" -C "$ROOT" results logs launcher.log status.json 2>/dev/null
  [ "$(ls "$ROOT"/results/pytest_*.rc 2>/dev/null | wc -l)" -ge "$N_RUNS" ] || return 3
  ! grep -qv '^0$' "$ROOT"/results/pytest_*.rc
}

case "${1:-}" in
  start)
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    DDTREE_GPU_MODELS=$(tr ' ' , <<< "$MODELS") python3 -m tests.gpu.servers launch "$ROOT" || exit 1
    wait_s=${2:-500}; shift 2 2>/dev/null || shift
    test_bg "$@"
    collect "$wait_s" ;;
  collect) collect "${2:-540}" ;;
  test-bg) shift; test_bg "$@"; sleep 2; echo "started" ;;
  wait) python3 -m tests.gpu.servers wait "$ROOT" "${2:-540}" ;;
  test)
    shift
    DDTREE_GPU_ROOT="$ROOT" python3 -m pytest tests/gpu -m gpu -q -rA "$@" 2>&1 | tee "$OUT/pytest.log"
    rc=${PIPESTATUS[0]}
    tar czf "$OUT/logs.tgz" -C "$ROOT/logs" . 2>/dev/null
    exit $rc ;;
  stop) shift; python3 -m tests.gpu.servers stop "$ROOT" "$@" ;;
  train)
    mkdir -p "$ROOT"
    setsid nohup python3 scripts/train_pair.py --out "$ROOT/pair" --device cuda \
      --minutes "${2:-10}" --total-minutes "${3:-${2:-10}}" > "$ROOT/train.log" 2>&1 < /dev/null &
    sleep 20; tail -n 5 "$ROOT/train.log" ;;
  bench-e2e)  # on the pair servers of the test set (plain, DFLASH, DDTREE N=32 and 64; DFLASH
    # and N=64 start only when the set was launched with DDTREE_GPU_BENCH=1)
    shift
    python3 -m tests.gpu.servers stop "$ROOT" qwen3 qwen35  # the GPU and CPUs to the pair
    python3 scripts/bench_e2e.py --out "$OUT/e2e" --attach "$ROOT" "$@"  # the shipped pair
    rc=$?; tar czf "$OUT/e2e_logs.tgz" -C "$ROOT/logs" $(cd "$ROOT/logs" && ls server_pair-*.log)
    # profiler traces (--profile) nest too deep and too many to come back one by one
    [ -d "$OUT/e2e/traces" ] && tar cJf "$OUT/e2e_traces.tar.xz" -C "$OUT/e2e" traces \
      && rm -rf "$OUT/e2e/traces"
    exit $rc ;;
  bench-tree)  # tree build / draft head GPU time, torch vs Triton builder (no server)
    shift
    python3 scripts/bench_tree_build.py --out "$OUT/tree" "$@" ;;
  bench-gdn)  # one GDN layer's tree verify + commit: SGLang's kernel vs sglang_ddtree.gdn (no server)
    shift
    python3 scripts/bench_gdn_tree.py --out "$OUT/gdn" "$@" ;;
  bench-round-bg)  # bench_round.py detached (outlives the call), results in ROOT/$ROUND
    # ROUND=name (default "round") runs several at once, e.g. one per GPU with
    # CUDA_VISIBLE_DEVICES and distinct --port-base; collect-round gathers all of them.
    shift; dir="$ROOT/${ROUND:-round}"
    mkdir -p "$dir"
    setsid nohup python3 scripts/bench_round.py --out "$dir" --work "/root/bench_${ROUND:-round}" \
      "$@" > "$dir/run.log" 2>&1 < /dev/null &
    sleep 5; tail -n 3 "$dir/run.log"; echo started ;;
  collect-round)  # wait up to $2 s for every bench-round-bg; results to $OUT
    t0=$SECONDS
    while pgrep -f "scripts/bench_round.py" > /dev/null && [ $((SECONDS - t0)) -lt "${2:-540}" ]; do
      sleep 5
    done
    for dir in "$ROOT"/round*/; do
      name=$(basename "$dir")
      cp "$dir/round_cost_27b.jsonl" "$OUT/$name.jsonl" 2>/dev/null
      echo "== $name"; tail -n 20 "$dir/run.log" | cut -c1-600
    done
    tar czf "$OUT/round_logs.tgz" -C "$ROOT" $(cd "$ROOT" && ls -d round*/*.log 2>/dev/null)
    pgrep -f "scripts/bench_round.py" > /dev/null && echo "bench_round still running"
    pgrep -f "gpu_session.sh start" > /dev/null && echo "tests still running" ;;
  chain)  # chain GPU NAME [--after-tests] BENCH_ROUND_ARGS: detached, on GPU number GPU: (with
    # --after-tests: the GPU test suite first, its summary in ROOT/NAME/tests.txt, then its servers
    # stopped) scripts/bench_round.py into ROOT/NAME. `collect-round` / `collect` gather them.
    gpu=$2; name=$3; shift 3; tests=0
    [ "${1:-}" = "--after-tests" ] && { tests=1; shift; }
    mkdir -p "$ROOT/$name"
    ROOT=$ROOT CUDA_VISIBLE_DEVICES=$gpu TESTS=$tests NAME=$name setsid nohup bash -c '
      if [ "$TESTS" = 1 ]; then
        bash scripts/gpu_session.sh start 1500 > "$ROOT/$NAME/tests.txt" 2>&1
        python3 -m tests.gpu.servers stop "$ROOT"
      fi
      python3 scripts/bench_round.py --out "$ROOT/$NAME" --work "/root/bench_$NAME" "$@" \
        > "$ROOT/$NAME/run.log" 2>&1' chain "$@" < /dev/null > /dev/null 2>&1 &
    sleep 2; echo "chain $name on GPU $gpu started" ;;
  all)  # all NAME [BENCH_ROUND ARGS]: detached, into ROOT/NAME: the GPU suite
    # (DDTREE_GPU_SERVERS narrows it) with the GPU unit tests beside it, its servers stopped
    # after SUITE_WAIT s (default 1500) at the latest; bench_gdn_tree.py with $GDN_ARGS on the
    # quiet GPU (GDN_ARGS=none: skipped); then, given ARGS, bench_round.py with them
    name=$2; shift 2; dir="$ROOT/$name"; mkdir -p "$dir"
    ROOT=$ROOT NAME=$name DIR=$dir SUITE_WAIT=${SUITE_WAIT:-1500} GDN_ARGS="${GDN_ARGS:---bs 1,8,16 --nodes 16,32,64 --conv --conv-tilings t4n256w4anc --chunk-tiles 16x4xsplit,32x4xsplit,64x4xtf32}" \
      setsid nohup bash -c '
        python3 -m pytest tests/unit -m gpu -q -rA > "$DIR/unit_gpu.log" 2>&1 &
        unit=$!
        OUT="$DIR/suite" bash scripts/gpu_session.sh start "$SUITE_WAIT" > "$DIR/suite.log" 2>&1
        python3 -m tests.gpu.servers stop "$ROOT"
        wait $unit
        # a suite cut off at SUITE_WAIT: its tests and the servers they started go, so that
        # the benchmarks below have the GPU to themselves
        pkill -f "[p]ytest tests/gpu"; sleep 3; pkill -f "[s]glang.launch_server"; sleep 10
        [ "$GDN_ARGS" = none ] || python3 scripts/bench_gdn_tree.py --out "$DIR/gdn" $GDN_ARGS \
          > "$DIR/gdn.log" 2>&1
        [ $# -gt 0 ] && python3 scripts/bench_round.py --out "$DIR/round" \
          --work "/root/bench_$NAME" "$@" > "$DIR/round.log" 2>&1
        touch "$DIR/done"' all "$@" < /dev/null > /dev/null 2>&1 &
    sleep 2; echo "all $name started in $dir" ;;
  measure)  # measure NAME [BENCH_ROUND ARGS]: detached, into ROOT/NAME, in this order: (given
    # ARGS) bench_round.py alone on the GPU; bench_gdn_tree.py with $GDN_ARGS; the GPU unit tests
    # beside the suite (DDTREE_GPU_SERVERS narrows it); scripts/bench_serving.py ($SERVING_ARGS),
    # its servers booted once the suite's are healthy, measuring once its tests are done.
    # collect-all NAME gathers it.
    name=$2; shift 2; dir="$ROOT/$name"; mkdir -p "$dir"
    ROOT=$ROOT NAME=$name DIR=$dir GDN_ARGS="${GDN_ARGS:---bs 1,8,16 --nodes 16,32,64 --conv}" \
      SERVING_ARGS="${SERVING_ARGS:-}" setsid nohup bash -c '
        [ $# -gt 0 ] && python3 scripts/bench_round.py --out "$DIR/round" \
          --work "/root/bench_$NAME" "$@" > "$DIR/round.log" 2>&1
        python3 scripts/bench_gdn_tree.py --out "$DIR/gdn" $GDN_ARGS > "$DIR/gdn.log" 2>&1
        python3 -m pytest tests/unit -m gpu -q -rA > "$DIR/unit_gpu.log" 2>&1 &
        OUT="$DIR/suite" bash scripts/gpu_session.sh start 0 > "$DIR/suite_start.log" 2>&1
        python3 -m tests.gpu.servers wait "$ROOT" 900 > "$DIR/suite_wait.log" 2>&1
        (unset DDTREE_GPU_SERVERS; python3 scripts/bench_serving.py --out "$DIR/serving" \
          --hold-until "$DIR/suite.done" $SERVING_ARGS > "$DIR/serving.log" 2>&1) &
        # the soak and the fuzz against bench_serving'"'"'s ddtree and dflash servers (their URLs are
        # its first lines) while the suite runs, before its measurement
        (bash scripts/gpu_session.sh soak-serving "$DIR" > "$DIR/soak_driver.log" 2>&1
         touch "$DIR/soak.done") &
        OUT="$DIR/suite" bash scripts/gpu_session.sh collect 1500 > "$DIR/suite.log" 2>&1
        python3 -m tests.gpu.servers stop "$ROOT"; sleep 5
        t=$SECONDS; until [ -e "$DIR/soak.done" ] || [ $((SECONDS - t)) -gt 600 ]; do sleep 3; done
        touch "$DIR/suite.done"
        wait
        touch "$DIR/done"' measure "$@" < /dev/null > /dev/null 2>&1 &
    sleep 2; echo "measure $name started in $dir" ;;
  soak-serving)  # soak-serving DIR: once DIR/serving.log names healthy ddtree and dflash
    # servers (scripts/bench_serving.py), scripts/soak.py on both, then scripts/fuzz_requests.py
    # on ddtree; results in DIR/soak.json, DIR/fuzz_ddtree.json
    dir=$2; t0=$SECONDS
    until grep -q "dflash: healthy" "$dir/serving.log" 2>/dev/null; do
      [ $((SECONDS - t0)) -gt 900 ] && { echo "no healthy bench_serving servers"; exit 1; }
      sleep 3
    done
    url() { sed -n "s/^$1: \(http[^ ]*\)$/\1/p" "$dir/serving.log" | head -n 1; }
    python3 scripts/soak.py --server "ddtree=$(url ddtree)" --server "dflash=$(url dflash)" \
      --log "ddtree=$dir/serving/server_ddtree.log" --log "dflash=$dir/serving/server_dflash.log" \
      --requests 1000 --seconds 150 --concurrency 64 --context 4096 --out "$dir/soak.json"
    echo "soak rc=$?"
    # the fuzz on DDTREE only: its corpus holds requests that end a plain SGLang server (the
    # Vertex bodies, logit_bias 1e300), and DFLASH's server is measured after this (its control
    # fuzz is tests/gpu/test_soak.py's, on servers of its own)
    python3 scripts/fuzz_requests.py "$(url ddtree)" --context 4096 --out "$dir/fuzz_ddtree.json"
    echo "fuzz ddtree rc=$?" ;;
  dflash2)  # dflash2 NAME [MINUTES [BENCH_SERVING ARGS]]: detached, into ROOT/NAME
    name=$2; minutes=${3:-3}; shift 3 2>/dev/null || shift $#; dir="$ROOT/$name"; mkdir -p "$dir"
    [ $# -gt 0 ] || set -- --concurrency 1,8,32 --temperatures 0,1 --runs 3
    DIR=$dir MINUTES=$minutes setsid nohup bash -c '
        python3 scripts/train_dflash2.py --pair sglang_ddtree/assets/demo --out "$DIR/dflash2" \
          --device cuda --minutes "$MINUTES" > "$DIR/dflash2.log" 2>&1 &&
        python3 scripts/bench_serving.py --out "$DIR/serving" \
          --dflash2 "$DIR/dflash2/draft_dflash2" \
          --servers dflash,dflash_dflash2,ddtree,ddtree_dflash2,none "$@" > "$DIR/serving.log" 2>&1
        touch "$DIR/done"' dflash2 "$@" < /dev/null > /dev/null 2>&1 &
    sleep 2; echo "dflash2 $name started in $dir" ;;
  collect-all)  # collect-all NAME [WAIT_S]: wait for `all NAME` (up to WAIT_S), results to $OUT
    dir="$ROOT/$2"; t0=$SECONDS
    while [ ! -e "$dir/done" ] && [ $((SECONDS - t0)) -lt "${3:-540}" ]; do sleep 5; done
    for f in unit_gpu.log gdn.log suite/summary.txt round.log soak_driver.log dflash2.log \
        serving/table.md; do
      [ -f "$dir/$f" ] && { echo "== $f"; tail -n 40 "$dir/$f" | cut -c1-400; }
    done
    # a suite still running: its progress and each failure so far (tests/gpu/conftest.py's
    # reports), and the servers' state
    [ -f "$dir/suite/summary.txt" ] || {
      echo "== servers: $(python3 -c 'import collections, json, sys
print(dict(collections.Counter(json.load(open(sys.argv[1])).values())))' "$ROOT/status.json" 2>&1)"
      for f in "$ROOT"/results/pytest_*.log; do
        [ -f "$f" ] && echo "== $(basename "$f"): $(grep -E '^[.FEsx]+' "$f" | tr -d '\n' | cut -c1-200)"
      done
      failures 600
    }
    tar czf "$OUT/$2.tgz" -C "$ROOT" --exclude='trace_*' "$2" results logs launcher.log \
      status.json 2>/dev/null
    [ -e "$dir/done" ] && echo "all $2: done" || echo "all $2: still running" ;;
  bench-round)
    shift
    python3 -m tests.gpu.servers stop "$ROOT"
    python3 scripts/bench_round.py --out "$OUT/round" "$@"
    rc=$?; tar czf "$OUT/round_logs.tgz" -C "$OUT/round" --remove-files \
      $(cd "$OUT/round" && ls server_*.log 2>/dev/null); exit $rc ;;
  *) echo "usage: gpu_session.sh start|collect|test-bg|wait|test|stop|train|bench-e2e|bench-tree|bench-gdn|bench-round[-bg]|chain|collect-round|all|collect-all|dflash2" >&2
     exit 2 ;;
esac

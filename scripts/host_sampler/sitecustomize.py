"""A stack sampler for the host side of SGLang servers: where each process's Python time goes,
for scripts/host_profile.py. Not part of the package; a server gets it by running with this
folder first on PYTHONPATH and HOST_SAMPLER_DIR set (scripts/bench_serving.py --host-profile
does both). Python imports `sitecustomize` at start-up in every process, SGLang's spawned
scheduler and detokenizer included.

Dormant until HOST_SAMPLER_DIR/on exists (one stat every 0.5 s). While it exists, every
HOST_SAMPLER_MS (default 1) it records the stack of the main thread (HOST_SAMPLER_THREADS=all:
of every other thread, at several times the cost to the sampled process); when it is removed, it
writes HOST_SAMPLER_DIR/<pid>.txt: a header line, then `thread;frame;...;frame COUNT` lines
(the collapsed format of flame-graph tools, outermost frame first).

A sample is taken when the sampler gets the GIL, so while sampling the switch interval is
lowered to the sampling period (the same for every server sampled this way).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time

_DIR = os.environ.get("HOST_SAMPLER_DIR")
_PERIOD = max(float(os.environ.get("HOST_SAMPLER_MS", "1")), 0.1) / 1000.0
_DEPTH = 96
_ALL = os.environ.get("HOST_SAMPLER_THREADS", "main") == "all"


_LABELS: dict = {}  # code object -> "file.py:function"


def _stack(frame) -> str:
    names = []
    while frame is not None and len(names) < _DEPTH:
        code = frame.f_code
        label = _LABELS.get(code)
        if label is None:
            label = _LABELS[code] = f"{os.path.basename(code.co_filename)}:{code.co_name}"
        names.append(label)
        frame = frame.f_back
    return ";".join(reversed(names))


def _write(counts: collections.Counter, samples: int, seconds: float) -> None:
    head = {
        "pid": os.getpid(),
        "argv": sys.argv[:4],
        "samples": samples,
        "seconds": seconds,
        "period_ms": _PERIOD * 1000.0,
    }
    lines = [json.dumps(head)] + [f"{stack} {n}" for stack, n in counts.most_common()]
    path = os.path.join(_DIR, f"{os.getpid()}.txt")
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)


def _sample(me: int, counts: collections.Counter) -> None:
    frames = sys._current_frames()
    if not _ALL:
        main = frames.get(threading.main_thread().ident)
        if main is not None:
            counts[f"MainThread;{_stack(main)}"] += 1
        return
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in frames.items():
        if ident != me:
            counts[f"{names.get(ident, ident)};{_stack(frame)}"] += 1


def _loop() -> None:
    on = os.path.join(_DIR, "on")
    me = threading.get_ident()
    while True:
        while not os.path.exists(on):
            time.sleep(0.5)
        counts: collections.Counter = collections.Counter()
        switch = sys.getswitchinterval()
        sys.setswitchinterval(_PERIOD)
        start, samples = time.monotonic(), 0
        while samples % 200 or os.path.exists(on):
            _sample(me, counts)
            samples += 1
            time.sleep(_PERIOD)
        sys.setswitchinterval(switch)
        _write(counts, samples, time.monotonic() - start)


def _start() -> None:
    threading.Thread(target=_loop, name="host-sampler", daemon=True).start()


if _DIR:
    _start()
    os.register_at_fork(after_in_child=_start)

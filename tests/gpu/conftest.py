"""Every GPU test's outcome the moment it is known: one JSON line per test phase that fails or
skips and per test call, in $OUT/reports_<DDTREE_GPU_MODELS or all>.jsonl (OUT unset: nothing is
written). pytest prints its failures only when the run ends; a run cut off by a time limit would
otherwise leave a row of F's and no reason."""

from __future__ import annotations

import json
import os
from pathlib import Path

LONGREPR_CHARS = 6000  # the end of a failure's report: the assertion and its message


def _report_path() -> Path | None:
    out = os.environ.get("OUT")
    if not out:
        return None
    return Path(out) / f"reports_{os.environ.get('DDTREE_GPU_MODELS') or 'all'}.jsonl"


def pytest_runtest_logreport(report) -> None:
    if report.when != "call" and report.passed:
        return
    path = _report_path()
    if path is None:
        return
    row = {
        "test": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "seconds": round(report.duration, 1),
    }
    if not report.passed:
        row["detail"] = str(report.longrepr)[-LONGREPR_CHARS:]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")

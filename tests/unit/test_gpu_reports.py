"""tests/gpu/conftest.py writes each GPU test's outcome as it happens (a run cut off by a time
limit keeps its reasons)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tests.gpu import conftest


def _report(when, outcome, longrepr=None):
    return SimpleNamespace(
        nodeid="tests/gpu/test_x.py::test_y[qwen3]",
        when=when,
        outcome=outcome,
        passed=outcome == "passed",
        duration=1.26,
        longrepr=longrepr,
    )


def test_each_call_and_every_failure_is_written_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("DDTREE_GPU_MODELS", "qwen3")
    conftest.pytest_runtest_logreport(_report("setup", "passed"))  # not written
    conftest.pytest_runtest_logreport(_report("call", "passed"))
    conftest.pytest_runtest_logreport(_report("call", "failed", "x" * 9000 + "AssertionError: 3"))
    conftest.pytest_runtest_logreport(_report("setup", "skipped", "needs the pair"))
    rows = [json.loads(x) for x in (tmp_path / "reports_qwen3.jsonl").read_text().splitlines()]
    assert [(r["when"], r["outcome"]) for r in rows] == [
        ("call", "passed"),
        ("call", "failed"),
        ("setup", "skipped"),
    ]
    assert "detail" not in rows[0] and rows[0]["seconds"] == 1.3
    assert rows[1]["detail"].endswith("AssertionError: 3")
    assert len(rows[1]["detail"]) == conftest.LONGREPR_CHARS


def test_nothing_is_written_without_out(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.chdir(tmp_path)
    conftest.pytest_runtest_logreport(_report("call", "failed", "boom"))
    assert list(tmp_path.iterdir()) == []

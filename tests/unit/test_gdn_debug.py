"""The servers' debugging aids are test tooling (tests/gpu/server_debug), not server switches: a
server refuses their old switches; the check compares the chunked verify with the root paths,
saves what differs, survives a save that fails, and reaches the kernels DDTREE's hooks call; the
root paths and the precisions are served on request; the sync check wraps the worker's round
code as its module is imported."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.gpu.server_debug import ddtree_gdn_debug as debug
from tests.gpu.server_debug import ddtree_sync_check as sync_check
from tests.gpu.server_debug.ddtree_gdn_debug import Checker, Settings


@pytest.mark.parametrize(
    "name",
    [
        "SGLANG_DDTREE_GDN_CHECK",
        "SGLANG_DDTREE_GDN_CHECK_SERVE",
        "SGLANG_DDTREE_GDN_CHECK_SAVE",
        "SGLANG_DDTREE_GDN_PERTURB",
    ],
)
def test_a_server_refuses_the_old_debug_switches(monkeypatch, name):
    from sglang_ddtree import config

    monkeypatch.setenv(name, "1")
    with pytest.raises(ValueError, match=f"{name} is no longer a server switch.*server_debug"):
        config.Options.from_env()
    assert not {"gdn_check", "gdn_perturb", "gdn_check_serve"} & set(
        config.Options.__dataclass_fields__
    )


def _args(scratch=None):
    """A verify's kernel arguments: 7 inputs, the states, slots, parents, scratch, its rows."""
    scratch = torch.zeros(2, 8) if scratch is None else scratch
    return (
        *[torch.zeros(1)] * 7,
        torch.zeros(3, 2, 3, 5),
        torch.tensor([1], dtype=torch.int32),
        torch.zeros(1, 4, dtype=torch.int64),
        scratch,
        torch.zeros(1, dtype=torch.int32),
    )


def test_the_check_saves_the_inputs_of_a_verify_that_differs(tmp_path, caplog):
    """The root-path kernel runs beside the chunked one (on a copy of the scratch); a verify with
    a row that differs by more than the tolerance of its own size is saved and logged, one that
    agrees is not; inside a CUDA graph the round's worst row accumulates on the device and
    after_round reports it."""
    o, seen, ref = torch.ones(4, 2, 3), [], [None]
    args = _args()

    def root_paths(*a, **kw):
        seen.append(a[10] is not args[10])  # a copy of the scratch
        return ref[0]

    check = Checker(Settings(check=str(tmp_path)), root_paths)
    ref[0] = o.clone()
    assert check.compare(o, args, 16) is o
    assert list(tmp_path.iterdir()) == [] and check.counts["differed"] == 0
    ref[0] = o.clone()
    ref[0][2, 1] = 10.0  # one small row off: judged against its own size, not the largest row's
    ref[0][0] = o[0] = 100.0
    with caplog.at_level("INFO"):
        check.compare(o, args, 16)
    saved = torch.load(tmp_path / f"verify_{os.getpid()}_2.pt")
    assert torch.equal(saved["paths"], ref[0]) and torch.equal(saved["chunk"], o)
    assert saved["states"].shape == (1, 2, 3, 5) and saved["call"] == 2
    assert saved["scratch_chunk"].shape == saved["scratch_paths"].shape == (1, 8)
    assert "verify 2: worst difference so far 0.9" in caplog.text
    assert "by 0.9 of the row's max |o| at node 2 (request 0), value head 1" in caplog.text
    assert all(seen) and float(check.worst[0]) == 0.0  # the accumulator, made by an eager call
    nan = o.clone()
    nan[1, 0, 0] = float("nan")  # a NaN output is as far off as can be
    assert debug.row_error(nan, ref[0])[1, 0] == float("inf")


def test_inside_a_graph_the_round_accumulates_and_after_round_reads_it(monkeypatch, caplog):
    o = torch.ones(4, 2, 3)
    ref = [o.clone()]
    check = Checker(Settings(check="unused"), lambda *a, **kw: ref[0])
    check.compare(o, _args(), 16)  # an eager warm-up makes the accumulator
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    ref[0] = o.clone()
    ref[0][2, 1] = 10.0
    check.compare(o, _args(), 16)
    assert float(check.worst[0]) == pytest.approx(0.9)
    with caplog.at_level("WARNING"):
        check.after_round()
    assert "round 1 (CUDA graph)" in caplog.text and float(check.worst[0]) == 0.0


def test_serve_paths_returns_the_root_paths_and_save_keeps_the_first_calls(tmp_path):
    o, ref = torch.ones(4, 2, 3), torch.ones(4, 2, 3) + 1e-4
    check = Checker(Settings(check=str(tmp_path), serve="paths", save=2), lambda *a, **kw: ref)
    for _ in range(3):
        assert check.compare(o, _args(), 16) is ref
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"verify_{os.getpid()}_{n}.pt" for n in (1, 2)
    ]
    assert check.counts["differed"] == 0


def test_a_save_that_fails_is_logged_once_and_the_check_goes_on(tmp_path, caplog):
    """A full disk or an unwritable folder: the first failure is logged, saving stops, and the
    verify is served as before (no exception on the decode thread)."""
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    o, ref = torch.ones(4, 2, 3), torch.ones(4, 2, 3) * 2  # every call differs
    check = Checker(Settings(check=str(blocked / "check")), lambda *a, **kw: ref)
    with caplog.at_level("WARNING"):
        for _ in range(3):
            assert check.compare(o, _args(), 16) is o
    assert caplog.text.count("failed") == 1 and not check.saving
    assert check.counts["differed"] == 3


def test_settings_are_read_and_checked():
    env = {
        "DDTREE_GDN_CHECK": "/x",
        "DDTREE_GDN_CHECK_SERVE": "paths",
        "DDTREE_GDN_CHECK_SAVE": "3",
        "DDTREE_GDN_PERTURB": "0.004",
    }
    assert Settings.from_env(env) == Settings("/x", "paths", 3, 0.004)
    assert (
        not Settings.from_env({}).active and Settings.from_env({"DDTREE_GDN_PERTURB": "0.1"}).active
    )
    with pytest.raises(ValueError, match="set DDTREE_GDN_CHECK=DIR too"):
        Settings.from_env({"DDTREE_GDN_CHECK_SERVE": "paths"})
    with pytest.raises(ValueError, match="_SAVE >= 0"):
        Settings.from_env({"DDTREE_GDN_CHECK": "/x", "DDTREE_GDN_CHECK_SAVE": "-1"})
    asked = Settings.from_env({"DDTREE_GDN_VERIFY": "paths", "DDTREE_GDN_PRECISION": "ieee"})
    assert asked.active and (asked.verify, asked.precision) == ("paths", "ieee")
    with pytest.raises(ValueError, match="DDTREE_GDN_PRECISION one of"):
        Settings.from_env({"DDTREE_GDN_PRECISION": "bf16"})


def test_install_serves_the_root_paths_and_the_precision_asked_for(monkeypatch):
    """DDTREE_GDN_VERIFY=paths: the GDN path never takes the chunked verify;
    DDTREE_GDN_PRECISION: the chunked verify's products at that precision."""
    from sglang_ddtree.gdn import chunk_tree, tree_verify
    from sglang_ddtree.state import gdn

    for module, name in (
        (chunk_tree, "chunk_tree_verify"),
        (tree_verify, "tree_verify"),
        (tree_verify, "commit_paths"),
        (gdn.GDNPath, "chunked"),
    ):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    seen = []
    monkeypatch.setattr(
        chunk_tree,
        "chunk_tree_verify",
        lambda *a, max_path, **kw: seen.append(kw) or torch.ones(4, 2, 3),
    )
    assert gdn.GDNPath(16).chunked(32)
    debug.install(Settings(verify="paths", precision="ieee"))
    assert not gdn.GDNPath(16).chunked(32)
    chunk_tree.chunk_tree_verify(*_args(), max_path=16)
    assert seen == [{"precision": "ieee"}]


def test_install_wraps_the_kernels_ddtrees_hooks_import_at_each_call(monkeypatch, tmp_path):
    """What state/gdn.py imports inside its hooks (the chunked and root-path verifies, the
    commit) becomes the checked / perturbed one; the check compares with the package's own
    root-path kernel and reads the round before each commit."""
    from sglang_ddtree.gdn import chunk_tree, tree_verify

    for module, name in (
        (chunk_tree, "chunk_tree_verify"),
        (tree_verify, "tree_verify"),
        (tree_verify, "commit_paths"),
    ):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    calls = []
    monkeypatch.setattr(
        chunk_tree,
        "chunk_tree_verify",
        lambda *a, max_path, **kw: calls.append("chunk") or torch.ones(4, 2, 3),
    )
    monkeypatch.setattr(
        tree_verify, "tree_verify", lambda *a, **kw: calls.append("paths") or torch.ones(4, 2, 3)
    )
    monkeypatch.setattr(tree_verify, "commit_paths", lambda *a, **kw: calls.append("commit"))
    checker = debug.install(Settings(check=str(tmp_path), perturb=0.01))
    from sglang_ddtree.gdn.chunk_tree import chunk_tree_verify
    from sglang_ddtree.gdn.tree_verify import commit_paths
    from sglang_ddtree.gdn.tree_verify import tree_verify as root_paths

    served = chunk_tree_verify(*_args(), max_path=16, precision="split")
    assert calls == ["chunk", "paths"] and checker.counts["calls"] == 1  # checked
    assert not torch.equal(served, torch.ones(4, 2, 3))  # and perturbed
    assert (served - 1).abs().max() <= 0.01
    assert not torch.equal(root_paths(*_args(), max_path=16), torch.ones(4, 2, 3))
    commit_paths()
    assert calls[-1] == "commit"


def test_the_perturbation_is_a_bounded_fixed_relative_error():
    """Deterministic, within its size, off at 0, in the output's dtype."""
    o = torch.randn(31, 2, 128)
    a, b = debug.perturb(o, 0.004), debug.perturb(o, 0.004)
    rel = ((a - o).abs() / o.abs().clamp(min=1e-12)).max()
    assert torch.equal(a, b) and 1e-3 < rel <= 0.004 + 1e-6
    assert torch.equal(debug.perturb(o, 0.0), o)
    assert debug.perturb(o.bfloat16(), 0.004).dtype == torch.bfloat16


def test_the_sync_check_wraps_the_workers_round_code_once_imported(monkeypatch, tmp_path):
    """install() before the worker module is imported: the import runs the module, then its
    own_code becomes the sync debug mode; a module already loaded is patched at once."""
    monkeypatch.setattr(sync_check, "WORKER", "fake_ddtree_worker")
    (tmp_path / "fake_ddtree_worker.py").write_text("def own_code():\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, "fake_ddtree_worker", raising=False)
    sync_check.install()
    import fake_ddtree_worker

    assert fake_ddtree_worker.own_code is sync_check.sync_debug
    assert not any(isinstance(f, sync_check._AfterImport) for f in sys.meta_path)
    fake_ddtree_worker.own_code = None
    sync_check.install()  # loaded: patched now
    assert fake_ddtree_worker.own_code is sync_check.sync_debug
    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with sync_check.sync_debug():
        assert modes == ["warn"]
    assert modes == ["warn", 0]


def test_the_product_runs_its_round_code_without_the_sync_check():
    """Without the tooling, the round's own_code is a plain context (the package parses no
    switch for it)."""
    pytest.importorskip("sglang.srt.speculative.dflash_worker_v2")
    import contextlib

    from sglang_ddtree.round import round as stages

    assert isinstance(stages.own_code(), contextlib.nullcontext)

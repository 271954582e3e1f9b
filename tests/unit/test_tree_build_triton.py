"""build_tree_triton (one Triton program per request) against build_tree_reference, bit-for-bit.

CPU: the kernels run under Triton's interpreter, which must be chosen before triton is imported
(TRITON_INTERPRET=1; the interpreter also replaces triton.language's own jit helpers at import).
So the CPU tests below run only in a process started that way; in a plain run,
`test_cpu_tests_under_triton_interpreter` starts that process on this file and requires every
CPU test to pass there. Interpreted pops cost ~15 ms each, hence the modest sizes.
Directly: TRITON_INTERPRET=1 python -m pytest tests/unit/test_tree_build_triton.py -m "not gpu"
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from sglang_ddtree.tree import DraftTree, build_tree, build_tree_reference, tree_capacity
from sglang_ddtree.tree.build_triton import build_tree_triton
from sglang_ddtree.tree.testing import LOGPROB_MODES, check_tree_invariants, random_build_inputs

torch.set_num_threads(1)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter process")
CPU_TESTS = 20  # interpreter_only test items in this file; the interpreter process must pass all


def test_cpu_tests_under_triton_interpreter():
    if INTERPRETED:
        pytest.skip("already inside the interpreter process")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        __file__,
        "-m",
        "not gpu",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert re.search(rf"\b{CPU_TESTS} passed", tail) and "failed" not in tail, tail


def assert_trees_equal(fast: DraftTree, ref: DraftTree) -> None:
    """Every field equal; scores compared bit-for-bit."""
    for name in DraftTree._fields:
        a, b = getattr(fast, name), getattr(ref, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if name == "scores":
            a, b = a.view(torch.int32), b.view(torch.int32)
        assert torch.equal(a, b), f"{name} differs:\n{a}\n{b}"


def check_against_reference(build, root, ids, lps, budget: int) -> DraftTree:
    tree = build(root, ids, lps, budget)
    assert_trees_equal(
        DraftTree(*(t.cpu() for t in tree)), build_tree_reference(root, ids, lps, budget)
    )
    return tree


# --- CPU, under the interpreter ---------------------------------------------------------------


@interpreter_only
@pytest.mark.parametrize("mode", LOGPROB_MODES)
def test_matches_reference_seeded_sweep(mode):
    """36 shapes x bs 2 per mode (216 trees): L 1..6, K 1..5, budget 1..min(capacity, 24)."""
    g = torch.Generator().manual_seed(2024)
    for _ in range(36):
        L, K = int(torch.randint(1, 7, (), generator=g)), int(torch.randint(1, 6, (), generator=g))
        budget = int(torch.randint(1, min(tree_capacity(K, L), 24) + 1, (), generator=g))
        root, ids, lps = random_build_inputs(g, 2, L, K, K + 2, mode)  # small vocab: repeats
        tree = check_against_reference(build_tree_triton, root, ids, lps, budget)
        check_tree_invariants(tree)


@interpreter_only
@pytest.mark.parametrize("L,K", [(1, 8), (2, 5), (3, 3), (4, 2), (5, 1)])
def test_budget_at_capacity(L, K):
    """Every prefix selected: the frontier empties exactly at the last pop (ties mode)."""
    g = torch.Generator().manual_seed(L * 10 + K)
    root, ids, lps = random_build_inputs(g, 2, L, K, K + 1, "ties")
    check_against_reference(build_tree_triton, root, ids, lps, tree_capacity(K, L))


@interpreter_only
def test_k1_is_the_dflash_chain():
    g = torch.Generator().manual_seed(3)
    L = 15
    root, ids, lps = random_build_inputs(g, 2, L, 1, 50, "continuous")
    tree = check_against_reference(build_tree_triton, root, ids, lps, L)
    assert torch.equal(tree.parents, torch.arange(-1, L).expand(2, -1))
    assert torch.equal(tree.tokens[:, 1:], ids[:, :, 0])


@interpreter_only
@pytest.mark.parametrize("mode", ["continuous", "ties"])
def test_serving_shape_past_256_nodes(mode):
    """L=15, K=8, budget 260: parent indices and depths beyond one byte in the packed key."""
    g = torch.Generator().manual_seed(11)
    root, ids, lps = random_build_inputs(g, 1, 15, 8, 1000, mode)
    check_against_reference(build_tree_triton, root, ids, lps, 260)


@interpreter_only
def test_strided_inputs_and_preprocessing():
    """Non-contiguous inputs; NaN/-inf -> floor, +inf/positives -> 0, ties keep rank order."""
    g = torch.Generator().manual_seed(5)
    root, ids, lps = random_build_inputs(g, 3, 4, 3, 9, "dirty")
    ids_t = ids.transpose(1, 2).contiguous().transpose(1, 2)  # [bs, L, K] with K-major strides
    lps_t = lps.transpose(1, 2).contiguous().transpose(1, 2)
    root_s = torch.stack([root, root], dim=1)[:, 0]  # stride 2
    assert not ids_t.is_contiguous() and not lps_t.is_contiguous() and root_s.stride(0) == 2
    tree = build_tree_triton(root_s, ids_t, lps_t, 20)
    assert_trees_equal(tree, build_tree_reference(root, ids, lps, 20))
    one = build_tree_triton(
        torch.zeros(1, dtype=torch.int64),
        torch.tensor([[[0, 1, 2, 3]]]),
        torch.tensor([[[float("nan"), 0.5, -1.0, float("-inf")]]]),
        4,
    )
    assert one.scores[0].tolist() == [0.0] + [-1.0e4] * 4
    assert one.tokens[0].tolist() == [0, 0, 1, 2, 3]


@interpreter_only
def test_empty_batch():
    g = torch.Generator().manual_seed(1)
    root, ids, lps = random_build_inputs(g, 0, 3, 2, 5, "continuous")
    tree = build_tree_triton(root, ids, lps, 5)
    assert tree.tokens.shape == (0, 6) and tree.visibility.shape == (0, 6, 6)


# --- errors -----------------------------------------------------------------------------------


def _ok_inputs(bs=2, L=3, K=2):
    g = torch.Generator().manual_seed(0)
    return random_build_inputs(g, bs, L, K, 8, "continuous")


@interpreter_only
@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda r, i, lp: (r, i, lp, 15), r"budget=15 exceeds the 14 prefixes .*K=2, L=3"),
        (lambda r, i, lp: (r, i, lp, 0), r"budget must be an int >= 1, got 0"),
        (lambda r, i, lp: (r[:1], i, lp, 3), r"root has 1 entries but topk_ids has bs=2"),
        (lambda r, i, lp: (r, i, lp.double(), 3), r"topk_logprobs must be torch.float32"),
        (lambda r, i, lp: (r, i.int(), lp, 3), r"topk_ids must be torch.int64, got torch.int32"),
        (lambda r, i, lp: (r, i[:, :0], lp[:, :0], 3), r"L >= 1 .* got L=0, K=2"),
    ],
)
def test_bad_inputs_raise(mutate, message):
    with pytest.raises(ValueError, match=message):
        build_tree_triton(*mutate(*_ok_inputs()))


@interpreter_only
def test_limits_raise():
    root, ids, lps = _ok_inputs(bs=1, L=11, K=2)  # capacity 4094
    with pytest.raises(ValueError, match=r"budget <= 1024, got budget=1025"):
        build_tree_triton(root, ids, lps, 1025)
    root, ids, lps = random_build_inputs(torch.Generator().manual_seed(0), 1, 1, 65, 70, "ties")
    with pytest.raises(ValueError, match=r"K <= 64 candidates, got K=65"):
        build_tree_triton(root, ids, lps, 3)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter takes CPU tensors")
def test_compiled_kernels_refuse_cpu_tensors():
    with pytest.raises(ValueError, match=r"needs CUDA tensors, got device cpu"):
        build_tree_triton(*_ok_inputs(), 3)


# --- CUDA: compiled kernels -------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(
    INTERPRETED or not torch.cuda.is_available(), reason="needs CUDA and compiled kernels"
)


def _cuda(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.cuda() for t in tensors]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("K", [8, 32])
def test_cuda_exact_and_sync_free(K):
    g = torch.Generator().manual_seed(K)
    L = 15
    build_tree_triton(*_cuda(*random_build_inputs(g, 2, L, K, 99, "ties")), 16)  # compile
    for budget in (16, 17, 32, 64, 100, 128, 256, 512, 1000, 1024):
        for mode in LOGPROB_MODES:
            root, ids, lps = random_build_inputs(g, 4, L, K, 2 * K + 3, mode)
            args = _cuda(root, ids, lps)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                tree = build_tree_triton(*args, budget)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert_trees_equal(
                DraftTree(*(t.cpu() for t in tree)), build_tree_reference(root, ids, lps, budget)
            )


def _capture(fn, bufs: list[torch.Tensor], budget: int) -> tuple[torch.cuda.CUDAGraph, DraftTree]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*bufs, budget)  # warm-up (and Triton compilation) outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*bufs, budget)
    return graph, out


def _replay_ms(graph: torch.cuda.CUDAGraph, iters: int = 200) -> float:
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay_exact_and_timing():
    """Captured once per shape, replayed on new contents; prints ms per call next to build_tree."""
    g = torch.Generator().manual_seed(23)
    L, K = 15, 8
    rows = []
    for bs in (1, 8, 16):
        for budget in (16, 32, 64, 128):
            bufs = _cuda(*random_build_inputs(g, bs, L, K, 100, "continuous"))
            graph, out = _capture(build_tree_triton, bufs, budget)
            torch_graph, _ = _capture(build_tree, bufs, budget)
            for mode in LOGPROB_MODES:
                fresh = random_build_inputs(g, bs, L, K, 100, mode)
                for buf, new in zip(bufs, fresh, strict=True):
                    buf.copy_(new)
                graph.replay()
                torch.cuda.synchronize()
                ref = build_tree_reference(*fresh, budget)
                assert_trees_equal(DraftTree(*(t.cpu() for t in out)), ref)
            rows.append((bs, budget, _replay_ms(graph), _replay_ms(torch_graph)))
    print(f"\nbuild tree, CUDA graph replay, L={L} K={K}, mean ms per call")
    print(f"{'bs':>4} {'budget':>7} {'triton':>9} {'torch':>9}")
    for bs, budget, ms_triton, ms_torch in rows:
        print(f"{bs:>4} {budget:>7} {ms_triton:>9.4f} {ms_torch:>9.4f}")

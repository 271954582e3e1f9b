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

import pytest
import torch
import triton
import triton.language as tl

from sglang_ddtree.tree import DraftTree, build_tree, build_tree_reference, tree_capacity
from sglang_ddtree.tree.build_triton import (
    _pack_key,
    _unpack_key,
    build_lattice_tree_triton,
    build_tree_triton,
)
from sglang_ddtree.tree.lattice import build_lattice_tree, build_lattice_tree_reference
from sglang_ddtree.tree.testing import (
    LOGPROB_MODES,
    assert_trees_equal,
    check_tree_invariants,
    no_host_sync,
    random_build_inputs,
)
from tests.fixtures import run_cpu_tests_under_triton_interpreter
from tests.unit.test_lattice_build import random_lattice

torch.set_num_threads(1)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter process")
CPU_TESTS = 23  # interpreter_only test items in this file; the interpreter process must pass all


def test_cpu_tests_under_triton_interpreter():
    if INTERPRETED:
        pytest.skip("already inside the interpreter process")
    run_cpu_tests_under_triton_interpreter(__file__, CPU_TESTS)


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
    """36 shapes x bs 2 per mode (216 trees in all): L 1..6, K 1..5, budget <= 24."""
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
def test_serving_shape_large_budget():
    """L=15, K=8, budget 260 (512 frontier lanes), no ties: a serving-sized tree."""
    g = torch.Generator().manual_seed(11)
    root, ids, lps = random_build_inputs(g, 1, 15, 8, 1000, "continuous")
    check_against_reference(build_tree_triton, root, ids, lps, 260)


@interpreter_only
def test_ties_with_node_indices_past_one_byte():
    """Tied keys, budget 300 with rank 0 at log-prob 0: nodes with parents >= 256 get popped."""
    g = torch.Generator().manual_seed(15)  # a seed whose tree reaches parents >= 256 (asserted)
    root, ids, lps = random_build_inputs(g, 1, 15, 8, 1000, "ties")
    lps[..., 0] = 0.0  # rank-0 children keep their parent's score: deep chains pop early
    tree = check_against_reference(build_tree_triton, root, ids, lps, 300)
    assert tree.parents.max().item() >= 256


@triton.jit
def _key_round_trip_kernel(
    score_ptr, depth_ptr, parent_ptr, rank_ptr, key_ptr, n, BLOCK: tl.constexpr
):
    i = tl.arange(0, BLOCK)
    ok = i < n
    score = tl.load(score_ptr + i, mask=ok)
    depth = tl.load(depth_ptr + i, mask=ok)
    key = _pack_key(score, depth, tl.load(parent_ptr + i, mask=ok), tl.load(rank_ptr + i, mask=ok))
    tl.store(key_ptr + i, key, mask=ok)
    score, depth, parent, rank = _unpack_key(key)
    tl.store(score_ptr + i, score, mask=ok)  # overwritten in place with the decoded fields
    tl.store(depth_ptr + i, depth, mask=ok)
    tl.store(parent_ptr + i, parent, mask=ok)
    tl.store(rank_ptr + i, rank, mask=ok)


@interpreter_only
def test_packed_key_round_trips_and_orders_like_the_tuple():
    """Fields over their whole ranges (depth 1..1025, parent 0..1024, rank 0..63), tied scores
    including 0, subnormals and the deepest floor sum: integer order == (-score, depth, parent, rank).
    """
    g = torch.Generator().manual_seed(4)
    n = 2000
    values = torch.tensor([0.0, -1e-45, -3e-45, -0.5, -1.0, -1.0e4, -1.025e7], dtype=torch.float32)
    fields = [
        values[torch.randint(len(values), (n,), generator=g)],
        torch.randint(1, 1026, (n,), generator=g),
        torch.randint(0, 1025, (n,), generator=g),
        torch.randint(0, 64, (n,), generator=g),
    ]
    for f in fields[1:]:
        f[:4] = torch.tensor([f.min(), f.max(), f.min(), f.max()])  # the extremes, tied too
    decoded = [f.clone() for f in fields]
    keys = torch.empty(n, dtype=torch.int64)
    _key_round_trip_kernel[(1,)](*decoded, keys, n, BLOCK=triton.next_power_of_2(n))
    assert torch.equal(decoded[0].view(torch.int32), fields[0].view(torch.int32))
    for got, want in zip(decoded[1:], fields[1:], strict=True):
        assert torch.equal(got, want)
    tuples = list(zip(*(f.tolist() for f in fields), strict=True))
    by_tuple = sorted(range(n), key=lambda k: (-tuples[k][0], *tuples[k][1:]))
    by_key = sorted(range(n), key=lambda k: keys[k].item())
    assert [tuples[k] for k in by_key] == [tuples[k] for k in by_tuple]


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


# --- errors (raised before any launch: these run in both processes) ----------------------------


def _ok_inputs(bs=2, L=3, K=2):
    g = torch.Generator().manual_seed(0)
    return random_build_inputs(g, bs, L, K, 8, "continuous")


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


# --- compiled for sm_90 on this host (no GPU needed) -------------------------------------------

POINTER_TYPES = {
    "root_ptr": "*i64",
    "ids_ptr": "*i64",
    "lp_ptr": "*fp32",
    "lp_buf": "*fp32",
    "tokens_ptr": "*i64",
    "parents_ptr": "*i64",
    "depth_ptr": "*i64",
    "first_child_ptr": "*i64",
    "next_sibling_ptr": "*i64",
    "scores_ptr": "*fp32",
    "vis_ptr": "*u8",
}


@pytest.mark.skipif(INTERPRETED, reason="needs the compiled kernels")
@pytest.mark.parametrize(
    "kernel,constexprs,num_warps",
    [
        ("_tree_search_kernel", {"NP": 128, "LT": 16, "KP": 8}, 1),  # budget 64..127, K=8
        ("_tree_search_kernel", {"NP": 2048, "LT": 16, "KP": 64}, 8),  # both limits
        ("_tree_search_kernel", {"NP": 16, "LT": 16, "KP": 1}, 1),  # K=1 chain
        ("_visibility_kernel", {"ROWS": 32, "NP": 128}, 4),
    ],
)
def test_kernels_compile_for_hopper(kernel, constexprs, num_warps, monkeypatch, tmp_path):
    """Triton's full pipeline down to a cubin (its bundled ptxas): catches what the lenient
    interpreter lets through (types of loop-carried values, scalar/tensor mixes)."""
    pytest.importorskip("triton.backends.nvidia")
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    from sglang_ddtree.tree import build_triton

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fn = getattr(build_triton, kernel)
    types = {
        n: "constexpr" if n in constexprs else POINTER_TYPES.get(n, "i32") for n in fn.arg_names
    }
    compiled = triton.compile(
        ASTSource(fn, types, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps},
    )
    assert compiled.asm["cubin"] and ".entry " + kernel in compiled.asm["ptx"]


# --- CUDA: compiled kernels -------------------------------------------------------------------


@interpreter_only
@pytest.mark.parametrize("mode", ["continuous", "dirty"])
def test_lattice_kernel_matches_the_heap(mode):
    """24 shapes x bs 2 per mode: L 1..5, K 1..4, budgets up to 20 and the capacity; dirty
    lattices hold ties, -inf, NaN and positive values (the builders' cleaning)."""
    g = torch.Generator().manual_seed(77 if mode == "dirty" else 78)
    for _ in range(24):
        L, K = (
            int(torch.randint(1, 6, (1,), generator=g)),
            int(torch.randint(1, 5, (1,), generator=g)),
        )
        cap = tree_capacity(K, L)
        root, ids, cond = random_lattice(g, 2, L, K, K + 4, mode)
        for budget in sorted(
            {1, min(cap, 20), min(cap, int(torch.randint(1, 21, (1,), generator=g)))}
        ):
            tree = build_lattice_tree_triton(root, ids, cond, budget)
            assert_trees_equal(tree, build_lattice_tree_reference(root, ids, cond, budget))
            check_tree_invariants(tree)


needs_cuda = pytest.mark.skipif(
    INTERPRETED or not torch.cuda.is_available(), reason="needs CUDA and compiled kernels"
)


def _cuda(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.cuda() for t in tensors]


SERVING_BUDGETS = (16, 17, 32, 64, 100, 128, 256, 512, 1000, 1024)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "L,K,budgets",
    [
        (15, 8, SERVING_BUDGETS),
        (15, 32, SERVING_BUDGETS),
        (15, 1, (15,)),  # the chain; one-lane preprocessing scan
        (3, 4, (84,)),  # budget = capacity
        (2, 64, (1024,)),  # both limits at once
    ],
)
def test_cuda_exact_and_sync_free(L, K, budgets):
    """Steady-state calls (after a compiling warm-up per shape) raise on any host sync."""
    g = torch.Generator().manual_seed(L * 100 + K)
    for budget in budgets:
        build_tree_triton(*_cuda(*random_build_inputs(g, 3, L, K, 2 * K + 3, "ties")), budget)
        for mode in LOGPROB_MODES:
            root, ids, lps = random_build_inputs(g, 3, L, K, 2 * K + 3, mode)
            args = _cuda(root, ids, lps)
            with no_host_sync():
                tree = build_tree_triton(*args, budget)
            assert_trees_equal(
                DraftTree(*(t.cpu() for t in tree)), build_tree_reference(root, ids, lps, budget)
            )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("K", [4, 8])
def test_cuda_lattice_exact_sync_free_and_in_a_graph(K):
    """The lattice kernel on CUDA at B = 16: bit-equal to the heap on continuous and dirty
    lattices with no host sync; captured once, replayed on new contents; ms per call printed
    beside the batched torch builder's."""
    g = torch.Generator().manual_seed(31 + K)
    L, rows = 15, []
    for bs in (1, 8, 16):
        for budget in (15, 31, 63, 127, 255):
            for mode in ("continuous", "dirty"):
                root, ids, cond = random_lattice(g, bs, L, K, 2 * K + 3, mode)
                build_lattice_tree_triton(*_cuda(root, ids, cond), budget)  # compiles
                with no_host_sync():
                    tree = build_lattice_tree_triton(*_cuda(root, ids, cond), budget)
                want = build_lattice_tree_reference(root, ids, cond, budget)
                assert_trees_equal(DraftTree(*(t.cpu() for t in tree)), want)
            bufs = _cuda(*random_lattice(g, bs, L, K, 2 * K + 3, "continuous"))
            graph, out = _capture(build_lattice_tree_triton, bufs, budget)
            torch_graph, _ = _capture(build_lattice_tree, bufs, budget)
            fresh = random_lattice(g, bs, L, K, 2 * K + 3, "dirty")
            for buf, new in zip(bufs, fresh, strict=True):
                buf.copy_(new)
            graph.replay()
            torch.cuda.synchronize()
            want = build_lattice_tree_reference(*fresh, budget)
            assert_trees_equal(DraftTree(*(t.cpu() for t in out)), want)
            rows.append((bs, budget, _replay_ms(graph), _replay_ms(torch_graph)))
    print(f"\nlattice tree, CUDA graph replay, L={L} K={K}, mean ms per call")
    print(f"{'bs':>4} {'budget':>7} {'triton':>9} {'torch':>9}")
    for bs, budget, ms_triton, ms_torch in rows:
        print(f"{bs:>4} {budget:>7} {ms_triton:>9.4f} {ms_torch:>9.4f}")


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

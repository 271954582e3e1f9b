"""build_tree (batched, sync-free) against build_tree_reference (heap) and brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_ddtree.tree import (
    LOGPROB_FLOOR,
    DraftTree,
    build_tree,
    build_tree_reference,
    topk_logprobs_from_logits,
    tree_capacity,
)
from sglang_ddtree.tree.testing import (
    LOGPROB_MODES,
    assert_static_graph,
    assert_trees_equal,
    check_tree_invariants,
    no_host_sync,
    random_build_inputs,
    random_logprobs,
)

torch.set_num_threads(1)


@st.composite
def build_cases(draw, max_budget: int = 40):
    bs = draw(st.integers(1, 3))
    L = draw(st.integers(1, 5))
    K = draw(st.integers(1, 5))
    capacity = tree_capacity(K, L)
    budget = draw(st.one_of(st.just(min(capacity, max_budget)), st.integers(1, max_budget)))
    budget = min(budget, capacity)
    mode = draw(st.sampled_from(LOGPROB_MODES))
    seed = draw(st.integers(0, 2**31 - 1))
    vocab = draw(st.integers(K, K + 3))  # small vocab: ids repeat across positions
    g = torch.Generator().manual_seed(seed)
    return (*random_build_inputs(g, bs, L, K, vocab, mode), budget)


@settings(max_examples=250, deadline=None)
@given(build_cases())
def test_build_matches_reference(case):
    root, ids, lps, budget = case
    fast = build_tree(root, ids, lps, budget)
    assert_trees_equal(fast, build_tree_reference(root, ids, lps, budget))
    check_tree_invariants(fast)


@pytest.mark.parametrize("mode", LOGPROB_MODES)
def test_build_matches_reference_seeded_sweep(mode):
    """Thousands of trees: 120 shapes x bs 8 per mode, wider trees than the hypothesis cases."""
    g = torch.Generator().manual_seed(1234)
    for _ in range(120):
        L, K = int(torch.randint(1, 8, ())), int(torch.randint(1, 7, ()))
        budget = int(torch.randint(1, min(tree_capacity(K, L), 64) + 1, ()))
        root, ids, lps = random_build_inputs(g, 8, L, K, K + 2, mode)
        fast = build_tree(root, ids, lps, budget)
        assert_trees_equal(fast, build_tree_reference(root, ids, lps, budget))
        check_tree_invariants(fast)


def test_every_budget_up_to_capacity_is_consistent():
    """Trees of growing budget on one input are nested prefixes of each other (best-first)."""
    g = torch.Generator().manual_seed(7)
    root, ids, lps = random_build_inputs(g, 4, 3, 3, 6, "ties")
    full = build_tree(root, ids, lps, tree_capacity(3, 3))
    for budget in range(1, tree_capacity(3, 3) + 1):
        tree = build_tree(root, ids, lps, budget)
        assert_trees_equal(tree, build_tree_reference(root, ids, lps, budget))
        for name in ("tokens", "parents", "depth", "scores"):
            assert torch.equal(getattr(tree, name), getattr(full, name)[:, : budget + 1]), name


# --- brute force over every prefix ------------------------------------------------------------


def enumerate_prefixes(lp: np.ndarray) -> list[tuple[tuple[int, ...], np.float32, tuple]]:
    """All rank tuples of length 1..L with float32 path score and the full recursive sort key."""
    L, K = lp.shape
    out, key_of, score_of = [], {(): ()}, {(): np.float32(0.0)}
    for depth in range(1, L + 1):
        for ranks in itertools.product(range(K), repeat=depth):
            parent = ranks[:-1]
            score = np.float32(score_of[parent] + lp[depth - 1, ranks[-1]])
            score_of[ranks] = score
            key_of[ranks] = (-float(score), depth, key_of[parent], ranks[-1])
            out.append((ranks, score, key_of[ranks]))
    return out


def tree_rank_paths(tree: DraftTree, ids: torch.Tensor, b: int) -> list[tuple[int, ...]]:
    """Node 1..budget as rank tuples (ids are distinct per position, so token -> rank)."""
    tokens, parents, depth = (t[b].tolist() for t in (tree.tokens, tree.parents, tree.depth))
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, len(tokens)):
        rank = ids[b, depth[i] - 1].tolist().index(tokens[i])
        paths.append(paths[parents[i]] + (rank,))
    return paths[1:]


@pytest.mark.parametrize("mode", ["continuous", "ties"])
@pytest.mark.parametrize("L,K", [(1, 4), (2, 3), (3, 2), (3, 3), (4, 2)])
def test_build_is_top_budget_by_brute_force(mode, L, K):
    g = torch.Generator().manual_seed(L * 10 + K)
    capacity = tree_capacity(K, L)
    for budget in sorted({1, 2, capacity // 2, capacity - 1, capacity} - {0}):
        root, ids, lps = random_build_inputs(g, 4, L, K, K + 1, mode)
        tree = build_tree(root, ids, lps, budget)
        for b in range(4):
            lp = np.maximum(lps[b].numpy(), np.float32(LOGPROB_FLOOR))  # clean inputs: no NaN
            prefixes = enumerate_prefixes(lp)
            chosen = tree_rank_paths(tree, ids, b)
            # exact semantics, ties included: the budget smallest keys, in key order
            expected = [r for r, _, _ in sorted(prefixes, key=lambda p: p[2])[:budget]]
            assert chosen == expected
            # product-of-marginals view: the scores are the budget largest, set prefix-closed
            top_scores = sorted((s for _, s, _ in prefixes), reverse=True)[:budget]
            assert sorted(tree.scores[b, 1:].tolist(), reverse=True) == top_scores
            assert all(r[:-1] in set(chosen) | {()} for r in chosen)
            if mode == "continuous":  # no ties: the top set is unique
                by_score = sorted(prefixes, key=lambda p: -p[1])[:budget]
                assert set(chosen) == {r for r, _, _ in by_score}


def test_k1_is_the_dflash_chain():
    g = torch.Generator().manual_seed(3)
    for L in (1, 4, 15):
        root, ids, lps = random_build_inputs(g, 3, L, 1, 50, "continuous")
        tree = build_tree(root, ids, lps, L)
        assert torch.equal(tree.depth, torch.arange(L + 1).expand(3, -1))
        assert torch.equal(tree.parents, torch.arange(-1, L).expand(3, -1))
        assert torch.equal(tree.tokens[:, 1:], ids[:, :, 0])
        assert torch.equal(
            tree.visibility, torch.ones(L + 1, L + 1).tril().bool().expand(3, -1, -1)
        )
        with pytest.raises(ValueError, match=f"budget={L + 1}.*K=1, L={L}"):
            build_tree(root, ids, lps, L + 1)


def test_preprocessing_clamps_and_orders():
    """NaN/-inf become the floor, positives 0, and the result is non-increasing per position."""
    root = torch.zeros(1, dtype=torch.int64)
    ids = torch.tensor([[[0, 1, 2, 3]]])
    lps = torch.tensor([[[float("nan"), 0.5, -1.0, float("-inf")]]])
    tree = build_tree(root, ids, lps, 4)
    assert tree.scores[0].tolist() == [
        0.0,
        LOGPROB_FLOOR,
        LOGPROB_FLOOR,
        LOGPROB_FLOOR,
        LOGPROB_FLOOR,
    ]
    assert tree.tokens[0].tolist() == [0, 0, 1, 2, 3]  # ties keep rank order


def test_scores_and_shapes_at_large_budget():
    """A serving-sized tree (B=16 -> L=15, K=8, budget 256) stays exact and fixed-shape."""
    g = torch.Generator().manual_seed(11)
    root, ids, lps = random_build_inputs(g, 2, 15, 8, 1000, "continuous")
    tree = build_tree(root, ids, lps, 256)
    assert tree.tokens.shape == (2, 257) and tree.visibility.shape == (2, 257, 257)
    assert_trees_equal(tree, build_tree_reference(root, ids, lps, 256))


# --- errors -----------------------------------------------------------------------------------


def _ok_inputs(bs=2, L=3, K=2):
    g = torch.Generator().manual_seed(0)
    return random_build_inputs(g, bs, L, K, 8, "continuous")


@pytest.mark.parametrize("builder", [build_tree, build_tree_reference])
@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda r, i, lp: (r, i, lp, 15), r"budget=15 exceeds the 14 prefixes .*K=2, L=3"),
        (lambda r, i, lp: (r, i, lp, 0), r"budget must be an int >= 1, got 0"),
        (lambda r, i, lp: (r, i, lp, 2.0), r"budget must be an int >= 1, got 2.0"),
        (lambda r, i, lp: (r[:1], i, lp, 3), r"root has 1 entries but topk_ids has bs=2"),
        (
            lambda r, i, lp: (r, i[:, :, :1], lp, 3),
            r"topk_ids \(2, 3, 1\) and topk_logprobs \(2, 3, 2\) must have the same shape",
        ),
        (
            lambda r, i, lp: (r, i, lp.double(), 3),
            r"topk_logprobs must be torch.float32, got torch.float64",
        ),
        (lambda r, i, lp: (r, i.int(), lp, 3), r"topk_ids must be torch.int64, got torch.int32"),
        (lambda r, i, lp: (r[:, None], i, lp, 3), r"root must have 1 dims, got shape \(2, 1\)"),
        (lambda r, i, lp: (r, i[:, :0], lp[:, :0], 3), r"L >= 1 .* got L=0, K=2"),
        (lambda r, i, lp: (r, i[..., :0], lp[..., :0], 3), r"K >= 1 .* got L=3, K=0"),
    ],
)
def test_bad_inputs_raise(builder, mutate, message):
    with pytest.raises(ValueError, match=message):
        builder(*mutate(*_ok_inputs()))


def test_tree_capacity():
    assert tree_capacity(1, 15) == 15
    assert tree_capacity(2, 3) == 14
    assert tree_capacity(8, 1) == 8
    assert tree_capacity(32, 63) == 1 << 62  # saturates instead of a 95-digit int
    assert tree_capacity(5, 0) == 0


# --- topk_logprobs_from_logits --------------------------------------------------------------


def test_topk_logprobs_from_logits():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 4, 30, generator=g, dtype=torch.float64).to(torch.bfloat16)
    ids, lps = topk_logprobs_from_logits(logits, 6)
    assert ids.dtype == torch.int64 and lps.dtype == torch.float32 and ids.shape == (2, 4, 6)
    full = torch.log_softmax(logits.float(), dim=-1)
    assert torch.equal(lps, full.gather(-1, ids))
    assert torch.equal(lps, full.sort(dim=-1, descending=True).values[..., :6])
    assert torch.all(lps[..., 1:] <= lps[..., :-1])
    with pytest.raises(ValueError, match=r"k must be an int in \[1, V=30\], got 31"):
        topk_logprobs_from_logits(logits, 31)
    with pytest.raises(ValueError, match=r"\[bs, L, V\] tensor, got \(4, 30\)"):
        topk_logprobs_from_logits(logits[0], 3)


# --- no host synchronisation ------------------------------------------------------------------


def test_static_graph_detector_catches_host_reads():
    x = torch.randn(3, 4)
    for bad in (lambda t: t + t.sum().item(), lambda t: t[t > 0], lambda t: t.nonzero()):
        with pytest.raises(AssertionError):
            assert_static_graph(bad, x)


def test_build_tree_traces_without_data_dependence():
    """One trace, replayed on fresh inputs of the same shapes, matches the reference."""
    g = torch.Generator().manual_seed(9)
    budget = 12
    gm = assert_static_graph(
        lambda r, i, lp: tuple(build_tree(r, i, lp, budget)),
        *random_build_inputs(g, 3, 4, 3, 7, "continuous"),
    )
    for mode in LOGPROB_MODES:
        root, ids, lps = random_build_inputs(g, 3, 4, 3, 7, mode)
        assert_trees_equal(
            DraftTree(*gm(root, ids, lps)), build_tree_reference(root, ids, lps, budget)
        )


# --- CUDA -------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_build_tree_cuda_sync_free_and_exact():
    g = torch.Generator().manual_seed(21)
    for L, K, budget in [(15, 8, 256), (7, 4, 64), (3, 1, 3), (15, 32, 1024)]:
        for mode in LOGPROB_MODES:
            root, ids, lps = random_build_inputs(g, 4, L, K, 2 * K + 3, mode)
            ref = build_tree_reference(root, ids, lps, budget)
            args = (root.cuda(), ids.cuda(), lps.cuda())
            with no_host_sync():
                tree = build_tree(*args, budget)
            assert_trees_equal(DraftTree(*(t.cpu() for t in tree)), ref)


@pytest.mark.gpu
@needs_cuda
def test_build_tree_cuda_graph_replay():
    """Captured once, replayed on new contents written into the same input buffers."""
    g = torch.Generator().manual_seed(22)
    bs, L, K, budget = 4, 15, 8, 128
    bufs = [t.cuda() for t in random_build_inputs(g, bs, L, K, 40, "continuous")]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        build_tree(*bufs, budget)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = build_tree(*bufs, budget)
    for mode in LOGPROB_MODES:
        fresh = random_build_inputs(g, bs, L, K, 40, mode)
        for buf, new in zip(bufs, fresh, strict=True):
            buf.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert_trees_equal(DraftTree(*(t.cpu() for t in out)), build_tree_reference(*fresh, budget))


def test_random_logprobs_modes_are_sorted_where_promised():
    g = torch.Generator().manual_seed(0)
    for mode in ("continuous", "ties"):
        lp = random_logprobs(g, (50, 6), mode)
        assert torch.all(lp[:, 1:] <= lp[:, :-1])

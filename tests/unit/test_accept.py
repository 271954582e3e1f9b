"""accept_walk (batched, sync-free) against accept_walk_reference and brute force;
sample_target_tokens against a plain top-k/top-p definition; the losslessness claim at T > 0."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_ddtree.accept import accept_walk, accept_walk_reference, sample_target_tokens
from sglang_ddtree.accept.sampling import filtered_probs
from sglang_ddtree.tree import (
    AcceptResult,
    DraftTree,
    build_tree,
    topk_logprobs_from_logits,
    tree_capacity,
)
from sglang_ddtree.tree.testing import (
    LOGPROB_MODES,
    assert_static_graph,
    no_host_sync,
    random_build_inputs,
)
from tests.fixtures import chi_square_pvalue

torch.set_num_threads(1)


def assert_results_equal(fast: AcceptResult, ref: AcceptResult) -> None:
    for name in AcceptResult._fields:
        a, b = getattr(fast, name), getattr(ref, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name} differs:\n{a}\n{b}"


def random_targets(g: torch.Generator, tree: DraftTree, vocab: int, follow: float) -> torch.Tensor:
    """[bs, N] target tokens; with probability `follow` a node's target is one child's token,
    so deep accepted paths occur."""
    bs, N = tree.tokens.shape
    targets = torch.randint(vocab, (bs, N), generator=g)
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    for b in range(bs):
        for j in torch.randperm(N - 1, generator=g).add(1).tolist():
            if torch.rand((), generator=g) < follow:
                targets[b, parents[b][j]] = tokens[b][j]
    return targets


@st.composite
def walk_cases(draw):
    bs, L, K = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 4))
    budget = draw(st.integers(1, min(tree_capacity(K, L), 40)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    vocab = K + 2
    root, ids, lps = random_build_inputs(g, bs, L, K, vocab, draw(st.sampled_from(LOGPROB_MODES)))
    tree = build_tree(root, ids, lps, budget)
    follow = draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    return tree, random_targets(g, tree, vocab, follow), L


@settings(max_examples=300, deadline=None)
@given(walk_cases())
def test_walk_matches_reference(case):
    tree, targets, L = case
    fast = accept_walk(tree, targets, L)
    assert_results_equal(fast, accept_walk_reference(tree, targets, L))
    # shape of the result: a + 1 valid entries, bonus last, path root-first
    a = fast.num_accepted
    assert torch.all(fast.path[:, 0] == 0)
    assert torch.equal(fast.emitted.gather(1, a[:, None])[:, 0], fast.bonus)
    assert torch.equal((fast.emitted >= 0).sum(1), a + 1)


def root_paths(parents: list[int]) -> list[list[int]]:
    paths = [[0]]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + [i])
    return paths


def test_greedy_walk_equals_brute_force():
    """Accepted path = the longest root path whose every token is its parent's target token."""
    g = torch.Generator().manual_seed(4)
    for L, K, budget in [(1, 3, 3), (3, 2, 10), (4, 3, 30), (6, 4, 60), (15, 2, 40)]:
        root, ids, lps = random_build_inputs(g, 6, L, K, K + 1, "ties")
        tree = build_tree(root, ids, lps, budget)
        targets = random_targets(g, tree, K + 1, 0.7)
        result = accept_walk(tree, targets, L)
        for b in range(6):
            tok, tgt = tree.tokens[b].tolist(), targets[b].tolist()
            parents = tree.parents[b].tolist()
            ok = [p for p in root_paths(parents) if all(tok[j] == tgt[parents[j]] for j in p[1:])]
            best = max(ok, key=len)
            assert sum(len(p) == len(best) for p in ok) == 1  # distinct siblings: unique
            assert result.path[b, : len(best)].tolist() == best
            assert result.emitted[b, : len(best)].tolist() == [tok[j] for j in best[1:]] + [
                tgt[best[-1]]
            ]


def test_walk_on_chain_is_prefix_match():
    """K = 1: accept the longest prefix where the target's token matches the draft."""
    tree = build_tree(
        torch.tensor([7]), torch.tensor([[[1], [2], [3]]]), torch.zeros(1, 3, 1), budget=3
    )
    for targets, a, emitted in [
        ([1, 2, 3, 9], 3, [1, 2, 3, 9]),
        ([1, 2, 5, 9], 2, [1, 2, 5, -1]),
        ([4, 2, 3, 9], 0, [4, -1, -1, -1]),
    ]:
        result = accept_walk(tree, torch.tensor([targets]), 3)
        assert result.num_accepted.tolist() == [a] and result.emitted[0].tolist() == emitted


def test_walk_bad_inputs():
    tree = build_tree(torch.tensor([0]), torch.tensor([[[1, 2]]]), torch.zeros(1, 1, 2), 2)
    with pytest.raises(ValueError, match=r"target_tokens has shape \(1, 2\), expected \(1, 3\)"):
        accept_walk(tree, torch.zeros(1, 2, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match=r"target_tokens must be torch.int64, got torch.int32"):
        accept_walk(tree, torch.zeros(1, 3, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match=r"max_depth must be an int >= 1 .* got 0"):
        accept_walk_reference(tree, torch.zeros(1, 3, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match=r"tree.parents has shape \(1, 2\), expected \(1, 3\)"):
        accept_walk(tree._replace(parents=tree.parents[:, :2]), torch.zeros(1, 3).long(), 1)


# --- sample_target_tokens -------------------------------------------------------------------


def plain_filtered(logits: list[float], t: float, top_p: float, top_k: int) -> np.ndarray:
    """The documented sampling distribution, in float64, one row."""
    V = len(logits)
    z = np.array(logits, dtype=np.float64) / t
    p = np.exp(z - z.max())
    p /= p.sum()
    order = sorted(range(V), key=lambda i: (-logits[i], i))
    kept = order[: V if top_k <= 0 or top_k >= V else top_k]
    q = np.zeros(V)
    q[kept] = p[kept] / p[kept].sum()
    final, mass = [], 0.0
    for i in kept:
        if final and mass >= top_p:
            break
        final.append(i)
        mass += q[i]
    out = np.zeros(V)
    out[final] = q[final] / q[final].sum()
    return out


def _fill(bs: int, value, dtype) -> torch.Tensor:
    return torch.full((bs,), value, dtype=dtype)


def test_sampling_greedy_rows_are_argmax_lowest_index():
    g = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 3, (4, 5, 7), generator=g).float()  # many ties
    temperature = torch.tensor([0.0, 0.7, 0.0, 1.0])
    out = sample_target_tokens(
        logits, temperature, _fill(4, 1.0, torch.float32), torch.tensor([0, 1, 3, 1]), g
    )
    first_max = (logits == logits.amax(-1, keepdim=True)).int().argmax(-1)  # lowest index
    assert torch.equal(out[[0, 2]], first_max[[0, 2]])
    assert torch.equal(out[[1, 3]], first_max[[1, 3]])  # top_k = 1 is greedy at any T


def test_sampling_respects_support():
    g = torch.Generator().manual_seed(2)
    bs, N, V = 64, 3, 9
    logits = torch.randn(bs, N, V, generator=g) * 2
    temperature = torch.rand(bs, generator=g) * 1.5 + 0.2
    top_p = torch.rand(bs, generator=g) * 0.9 + 0.1
    top_k = torch.randint(-1, V + 2, (bs,), generator=g)
    for _ in range(5):
        out = sample_target_tokens(logits, temperature, top_p, top_k, g)
        for b in range(bs):
            for n in range(N):
                row = plain_filtered(
                    logits[b, n].tolist(), temperature[b].item(), top_p[b].item(), int(top_k[b])
                )
                assert row[out[b, n]] > 0


@pytest.mark.parametrize(
    "t,top_p,top_k", [(1.0, 1.0, 0), (0.6, 1.0, 0), (1.3, 1.0, 3), (0.9, 0.7, 0), (1.1, 0.8, 4)]
)
def test_sampling_distribution(t, top_p, top_k):
    g = torch.Generator().manual_seed(3)
    V, trials = 8, 20000
    row = torch.randn(V, generator=g) * 1.5
    probs = plain_filtered(row.tolist(), t, top_p, top_k)
    logits = row.expand(trials // 4, 4, V)
    bs = logits.shape[0]
    out = sample_target_tokens(
        logits,
        _fill(bs, t, torch.float32),
        _fill(bs, top_p, torch.float32),
        _fill(bs, top_k, torch.int64),
        g,
    )
    counts = np.bincount(out.flatten().numpy(), minlength=V)
    assert chi_square_pvalue(counts, probs) > 1e-3  # alpha = 1e-3, fixed seed


def test_filtered_probs_matches_plain_definition():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(16, 2, 10, generator=g)
    t, p, k = torch.rand(16) + 0.3, torch.rand(16) * 0.9 + 0.1, torch.randint(0, 12, (16,))
    probs, ids = filtered_probs(logits, t, p, k)
    probs = probs / probs.sum(-1, keepdim=True)
    dense = torch.zeros_like(probs).scatter(-1, ids, probs)
    for b in range(16):
        for n in range(2):
            ref = plain_filtered(logits[b, n].tolist(), t[b].item(), p[b].item(), int(k[b]))
            np.testing.assert_allclose(dense[b, n].double().numpy(), ref, atol=1e-6)


def test_sampling_is_reproducible_with_a_generator():
    logits = torch.randn(3, 4, 20)
    args = (torch.ones(3), torch.ones(3), torch.zeros(3, dtype=torch.int64))
    a = sample_target_tokens(logits, *args, torch.Generator().manual_seed(5))
    b = sample_target_tokens(logits, *args, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def test_sampling_bad_inputs():
    logits = torch.zeros(2, 3, 4)
    ok = (torch.ones(2), torch.ones(2), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"temperature must be a \[bs=2\] tensor, got \(3,\)"):
        sample_target_tokens(logits, torch.ones(3), *ok[1:])
    with pytest.raises(ValueError, match=r"top_k must be an integer tensor, got torch.float32"):
        sample_target_tokens(logits, *ok[:2], torch.zeros(2))
    with pytest.raises(ValueError, match=r"\[bs, N, V\] tensor, got \(3, 4\)"):
        sample_target_tokens(logits[0], *ok)


# --- losslessness at T > 0: a Markov target, an unrelated drafter -----------------------------

V, L, K, BUDGET, M, TRIALS, START = 6, 3, 3, 8, 3, 20000, 0


def markov_setup(t: float, top_p: float, top_k: int):
    g = torch.Generator().manual_seed(2024)
    table = torch.randn(V, V, generator=g) * 1.5  # [V, V] next-token logits given previous
    draft_logits = torch.randn(1, L, V, generator=g)  # fixed marginals, unrelated to table
    rows = [plain_filtered(table[v].tolist(), t, top_p, top_k) for v in range(V)]
    return table, draft_logits, np.stack(rows)


def exact_sequence_probs(P: np.ndarray) -> np.ndarray:
    """[V**M] probability of each M-token continuation of START under plain sampling."""
    probs = np.zeros(V**M)
    for code in range(V**M):
        seq = [START] + [code // V ** (M - 1 - m) % V for m in range(M)]
        probs[code] = math.prod(P[a, b] for a, b in zip(seq, seq[1:], strict=False))
    return probs


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [bs, N, V] (rows sum to 1), u [bs, N] uniform -> [bs, N] samples."""
    cdf = probs.cumsum(-1)
    return (cdf < u[..., None] * cdf[..., -1:]).sum(-1).clamp(max=probs.shape[-1] - 1)


def run_ddtree(table, draft_logits, t, top_p, top_k, rule: str, g) -> np.ndarray:
    """TRIALS independent generations of M tokens from START; returns counts per sequence."""
    bs = TRIALS
    ids, lps = topk_logprobs_from_logits(draft_logits, K)  # [1, L, K]
    ids, lps = ids.expand(bs, L, K), lps.expand(bs, L, K)
    temperature, p, k = (
        _fill(bs, t, torch.float32),
        _fill(bs, top_p, torch.float32),
        _fill(bs, top_k, torch.int64),
    )
    root = torch.full((bs,), START)
    rounds = []
    for _ in range(M):  # every round emits at least one token
        tree = build_tree(root, ids, lps, BUDGET)
        if rule == "correct":  # each node: one sample from its own next-token distribution
            targets = sample_target_tokens(table[tree.tokens], temperature, p, k, g)
        elif rule == "parent_context":  # bug: node reads its parent's logits (shifted by one)
            context = torch.where(
                tree.parents < 0, root[:, None], tree.tokens.gather(1, tree.parents.clamp(min=0))
            )
            targets = sample_target_tokens(table[context], temperature, p, k, g)
        elif rule == "shared_uniform":  # bug: one uniform per round reused by every node
            probs, sorted_ids = filtered_probs(table[tree.tokens], temperature, p, k)
            u = torch.rand(bs, 1, generator=g).expand(bs, tree.tokens.shape[1])
            choice = inverse_cdf(probs / probs.sum(-1, keepdim=True), u)
            targets = sorted_ids.gather(-1, choice[..., None])[..., 0]
        result = accept_walk(tree, targets, L)
        rounds.append(result.emitted)
        root = result.bonus
    emitted = torch.cat(rounds, dim=1)  # [bs, M * (L + 1)], -1 padded per round
    order = torch.sort((emitted < 0).int(), dim=1, stable=True).indices
    seqs = emitted.gather(1, order)[:, :M]  # first M tokens of each trial
    codes = sum(seqs[:, m] * V ** (M - 1 - m) for m in range(M))
    return np.bincount(codes.numpy(), minlength=V**M)


SAMPLING_CONFIGS = [(0.8, 1.0, 0), (1.2, 0.85, 4)]


@pytest.mark.parametrize("t,top_p,top_k", SAMPLING_CONFIGS)
def test_ddtree_is_lossless_at_positive_temperature(t, top_p, top_k):
    """Chi-square goodness of fit of the first M emitted tokens, alpha = 1e-3, fixed seed."""
    table, draft_logits, P = markov_setup(t, top_p, top_k)
    g = torch.Generator().manual_seed(7)
    counts = run_ddtree(table, draft_logits, t, top_p, top_k, "correct", g)
    assert chi_square_pvalue(counts, exact_sequence_probs(P)) > 1e-3


@pytest.mark.parametrize("rule", ["parent_context", "shared_uniform"])
@pytest.mark.parametrize("t,top_p,top_k", SAMPLING_CONFIGS)
def test_lossless_check_detects_wrong_rules(t, top_p, top_k, rule):
    """Negative controls: the same test must reject known-wrong target sampling."""
    table, draft_logits, P = markov_setup(t, top_p, top_k)
    g = torch.Generator().manual_seed(7)
    counts = run_ddtree(table, draft_logits, t, top_p, top_k, rule, g)
    expected = exact_sequence_probs(P)
    outside_support = counts[expected == 0].sum() > 0
    assert outside_support or chi_square_pvalue(counts, expected) < 1e-9


def test_markov_setup_has_deep_acceptance():
    """Sanity: the drafter is good enough that multi-token rounds happen (the test has teeth)."""
    table, draft_logits, _ = markov_setup(1.0, 1.0, 0)
    ids, lps = topk_logprobs_from_logits(draft_logits.expand(2000, L, V), K)
    tree = build_tree(torch.full((2000,), START), ids, lps, BUDGET)
    g = torch.Generator().manual_seed(0)
    targets = sample_target_tokens(
        table[tree.tokens],
        torch.ones(2000),
        torch.ones(2000),
        torch.zeros(2000, dtype=torch.int64),
        g,
    )
    accepted = accept_walk(tree, targets, L).num_accepted
    assert (accepted >= 1).float().mean() > 0.3 and (accepted >= 2).any()


# --- no host synchronisation ------------------------------------------------------------------


def test_walk_and_sampling_trace_without_data_dependence():
    g = torch.Generator().manual_seed(8)
    root, ids, lps = random_build_inputs(g, 3, 4, 3, 5, "ties")
    tree = build_tree(root, ids, lps, 10)
    targets = random_targets(g, tree, 5, 0.8)
    gm = assert_static_graph(
        lambda *a: tuple(accept_walk(DraftTree(*a[:-1]), a[-1], 4)), *tree, targets
    )
    for follow in (0.0, 0.9, 1.0):
        other = build_tree(*random_build_inputs(g, 3, 4, 3, 5, "continuous"), 10)
        targets = random_targets(g, other, 5, follow)
        assert_results_equal(
            AcceptResult(*gm(*other, targets)), accept_walk_reference(other, targets, 4)
        )
    logits = torch.randn(3, 11, 7)
    knobs = (torch.tensor([0.0, 1.0, 0.5]), torch.tensor([1.0, 0.3, 0.9]), torch.tensor([0, 2, 7]))
    assert_static_graph(lambda x, t, p, k: sample_target_tokens(x, t, p, k), logits, *knobs)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_walk_and_sampling_cuda_sync_free():
    g = torch.Generator().manual_seed(9)
    root, ids, lps = random_build_inputs(g, 8, 15, 8, 20, "ties")
    tree = build_tree(root, ids, lps, 128)
    targets = random_targets(g, tree, 20, 0.9)
    ref = accept_walk_reference(tree, targets, 15)
    cuda_tree, cuda_targets = DraftTree(*(t.cuda() for t in tree)), targets.cuda()
    logits = torch.randn(8, 129, 1000, device="cuda")
    knobs = (
        torch.rand(8, device="cuda"),
        torch.rand(8, device="cuda"),
        torch.randint(0, 50, (8,), device="cuda"),
    )
    with no_host_sync():
        result = accept_walk(cuda_tree, cuda_targets, 15)
        sampled = sample_target_tokens(logits, *knobs)
    assert_results_equal(AcceptResult(*(t.cpu() for t in result)), ref)
    assert sampled.shape == (8, 129)

"""The lattice tree (tree/lattice.py): the heap against brute force on tiny lattices, the batched
builder against the heap, the marginal DDTree as the special case of equal rows, determinism,
and the chain model against SGLang's own DFlash2 selector."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch

from sglang_ddtree.tree import build_tree_reference, tree_capacity
from sglang_ddtree.tree.lattice import (
    build_lattice_tree,
    build_lattice_tree_reference,
    lattice_chain_logprobs,
)
from sglang_ddtree.tree.testing import (
    TIE_VALUES,
    assert_trees_equal,
    check_tree_invariants,
    random_build_inputs,
    random_ids,
)

torch.set_num_threads(1)
f32 = np.float32


def random_lattice(g: torch.Generator, bs: int, L: int, K: int, vocab: int, mode: str):
    """(root [bs], candidate_ids [bs, L, K], cond_logprobs [bs, L, K, K])."""
    root = torch.randint(vocab, (bs,), generator=g)
    ids = random_ids(g, bs, L, K, vocab)
    if mode == "continuous":
        return root, ids, lattice_chain_logprobs(torch.randn(bs, L, K, K, generator=g) * 2)
    values = torch.tensor([*TIE_VALUES, float("nan"), 0.5], dtype=torch.float32)
    picks = values[torch.randint(len(values), (bs, L, K, K), generator=g)]
    return root, ids, picks  # ties, -inf, NaN, > 0: the builders' cleaning


def tree_paths(tree, b: int) -> list[tuple[int, ...]]:
    """Root-excluded token path of every non-root node of request b, in node order."""
    tokens, parents = tree.tokens[b].tolist(), tree.parents[b].tolist()
    paths = [()]
    for i in range(1, len(tokens)):
        paths.append(paths[parents[i]] + (tokens[i],))
    return paths[1:]


def brute_force(ids: list, cond: list, budget: int) -> list[tuple[tuple[int, ...], f32]]:
    """Every prefix's float32 score, accumulated root-first; the best `budget` by (-score, depth,
    candidate path). Continuous scores have no ties, so this is the tree's node order."""
    L, K = len(ids), len(ids[0])
    found = []
    for d in range(1, L + 1):
        for cands in itertools.product(range(K), repeat=d):
            score, prev = f32(0.0), 0
            for e, c in enumerate(cands):
                score = score + f32(cond[e][prev][c])
                prev = c
            found.append((-float(score), d, cands, score))
    found.sort()
    return [(tuple(ids[e][c] for e, c in enumerate(x[2])), x[3]) for x in found[:budget]]


@pytest.mark.parametrize("L,K", [(1, 4), (2, 3), (3, 3), (4, 2), (3, 4)])
def test_reference_is_the_top_paths_by_chain_score(L, K):
    g = torch.Generator().manual_seed(10 * L + K)
    for _ in range(20):
        root, ids, cond = random_lattice(g, 2, L, K, K + 3, "continuous")
        for budget in sorted({1, 2, K, tree_capacity(K, L) // 2 or 1, tree_capacity(K, L)}):
            tree = build_lattice_tree_reference(root, ids, cond, budget)
            check_tree_invariants(tree)
            for b in range(2):
                best = brute_force(ids[b].tolist(), cond[b].tolist(), budget)
                assert tree_paths(tree, b) == [p for p, _ in best]
                assert tree.scores[b, 1:].tolist() == [float(s) for _, s in best]


@pytest.mark.parametrize("mode", ["continuous", "dirty"])
def test_batched_matches_reference(mode):
    g = torch.Generator().manual_seed(11)
    for _ in range(150):
        bs = int(torch.randint(1, 4, (1,), generator=g))
        L, K = (int(x) for x in torch.randint(1, 6, (2,), generator=g))
        root, ids, cond = random_lattice(g, bs, L, K, K + 2, mode)
        budget = int(torch.randint(1, min(tree_capacity(K, L), 40) + 1, (1,), generator=g))
        ref = build_lattice_tree_reference(root, ids, cond, budget)
        assert_trees_equal(build_lattice_tree(root, ids, cond, budget), ref)
        check_tree_invariants(ref)


@pytest.mark.parametrize("mode", ["continuous", "ties"])
def test_equal_rows_give_the_marginal_tree(mode):
    """A lattice whose transitions ignore the predecessor is the marginal DDTree, bit for bit
    (ties and node order included): the marginal builders are this builder's special case."""
    g = torch.Generator().manual_seed(12)
    for _ in range(100):
        L, K = (int(x) for x in torch.randint(1, 5, (2,), generator=g))
        root, ids, lps = random_build_inputs(g, 3, L, K, K + 2, mode)
        cond = lps[:, :, None, :].expand(3, L, K, K).contiguous()
        budget = min(tree_capacity(K, L), 30)
        marginal = build_tree_reference(root, ids, lps, budget)
        assert_trees_equal(build_lattice_tree_reference(root, ids, cond, budget), marginal)
        assert_trees_equal(build_lattice_tree(root, ids, cond, budget), marginal)


def test_deterministic_and_rows_independent():
    g = torch.Generator().manual_seed(13)
    root, ids, cond = random_lattice(g, 5, 6, 4, 12, "continuous")
    a = build_lattice_tree(root, ids, cond, 40)
    assert_trees_equal(a, build_lattice_tree(root.clone(), ids.clone(), cond.clone(), 40))
    for b in range(5):
        one = build_lattice_tree_reference(root[b : b + 1], ids[b : b + 1], cond[b : b + 1], 40)
        assert_trees_equal(one, type(a)(*(f[b : b + 1] for f in a)))


def chain_mass(tree, ids: torch.Tensor, cond: torch.Tensor) -> float:
    """sum over non-root nodes of Q(path) under the chain (expected accepted drafts, if the
    target were the chain)."""
    total, ids0 = 0.0, ids[0].tolist()
    for path in tree_paths(tree, 0):
        lp, prev = 0.0, 0
        for e, token in enumerate(path):
            c = ids0[e].index(token)
            lp, prev = lp + float(cond[0, e, prev, c]), c
        total += float(np.exp(lp))
    return total


def chain_marginals(cond: torch.Tensor) -> torch.Tensor:
    """[1, L, K, K] log conditionals -> [1, L, K] log marginals of each slot under the chain."""
    p = cond[0].double().exp()
    marg = [p[0, 0]]
    for e in range(1, p.shape[0]):
        marg.append(marg[-1] @ p[e])
    return torch.stack(marg).log().float()[None]


def test_chain_tree_beats_the_marginal_tree_under_the_chain():
    """Where transitions matter (a sharp pairing of slot-e and slot-e+1 candidates), the lattice
    tree holds more chain mass than the marginal DDTree built from the chain's own exact
    marginals; it is never below it (it is the optimum, the test above)."""
    g = torch.Generator().manual_seed(14)
    L, K, budget, wins = 4, 4, 12, 0
    for _ in range(30):
        root, ids, _ = random_lattice(g, 1, L, K, 9, "continuous")
        sharp = torch.randn(1, L, K, K, generator=g) * 4  # strong predecessor dependence
        cond = lattice_chain_logprobs(sharp)
        marg = chain_marginals(cond).sort(dim=-1, descending=True)
        marg_ids = ids.gather(2, marg.indices)
        lattice = chain_mass(build_lattice_tree(root, ids, cond, budget), ids, cond)
        marginal = chain_mass(build_tree_reference(root, marg_ids, marg.values, budget), ids, cond)
        assert lattice >= marginal - 1e-6
        wins += lattice > marginal + 1e-3
    assert wins >= 20


def test_chain_logprobs_shape_and_slot_zero():
    g = torch.Generator().manual_seed(15)
    scores = torch.randn(2, 3, 4, 4, generator=g)
    cond = lattice_chain_logprobs(scores)
    torch.testing.assert_close(cond.exp().sum(-1), torch.ones(2, 3, 4))
    assert torch.equal(cond[:, 0], cond[:, 0, :1].expand(2, 4, 4))
    cover = torch.tensor([[-0.5, -1.0, 0.0], [0.0, -2.0, -0.1]])
    shifted = lattice_chain_logprobs(scores, cover)
    torch.testing.assert_close(shifted, cond + cover[:, :, None, None])
    with pytest.raises(ValueError, match=r"\[bs, L, K, K\]"):
        lattice_chain_logprobs(scores[..., :3])
    with pytest.raises(ValueError, match=r"log_coverage must be \[bs, L\]"):
        lattice_chain_logprobs(scores, cover[:, :2])


def test_bad_inputs_name_the_values():
    root, ids = torch.zeros(1, dtype=torch.int64), torch.zeros(1, 2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"cond_logprobs must be a \[bs, L, K, K\] tensor"):
        build_lattice_tree_reference(root, ids, torch.zeros(1, 2, 3), 2)
    with pytest.raises(ValueError, match=r"must be \[bs, L, K, K\] for candidate_ids"):
        build_lattice_tree(root, ids, torch.zeros(1, 2, 4, 4), 2)
    with pytest.raises(ValueError, match=r"budget=20 exceeds the 12 prefixes"):
        build_lattice_tree(root, ids, torch.zeros(1, 2, 3, 3), 20)


def test_chain_model_is_sglangs_dflash2_selector():
    """SGLang's CandidateSelector (srt/models/dflash.py): its q rows along a sampled walk are
    exp of our conditionals at T = 1, and its greedy walk is our tree's first-child chain."""
    pytest.importorskip("sglang")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.models.dflash import CandidateSelector
    g = torch.Generator().manual_seed(16)
    bs, L, K, H, V, R = 3, 5, 4, 8, 30, 6
    selector = CandidateSelector(hidden_size=H, vocab_size=V, state_rank=R, top_k=K)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        for p in selector.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        ids = random_ids(g, bs, L, K, V)
        scores = selector.build_lattice(
            candidate_ids=ids,
            unary_logits=torch.randn(bs, L, K, generator=g),
            hidden_states=torch.randn(bs, L, H, generator=g),
            anchor_token_ids=torch.randint(V, (bs,), generator=g),
        )
        walk = dict(candidate_ids=ids, scores=scores, temperatures=torch.ones(bs))
        tokens, q_rows = selector.sample_path(
            **walk, uniforms=torch.rand(bs, L, generator=g), greedy_mask=torch.zeros(bs) > 0
        )
        greedy, _ = selector.sample_path(
            **walk, uniforms=torch.rand(bs, L), greedy_mask=torch.ones(bs) > 0
        )
    cond = lattice_chain_logprobs(scores)
    index = (ids == tokens[:, :, None]).int().argmax(-1)  # [bs, L] candidate index walked
    prev = torch.cat([torch.zeros(bs, 1, dtype=torch.int64), index[:, :-1]], dim=1)
    rows = cond.gather(2, prev[:, :, None, None].expand(bs, L, 1, K))[:, :, 0]
    torch.testing.assert_close(rows.exp(), q_rows, rtol=1e-5, atol=1e-6)
    tree = build_lattice_tree(ids[:, 0, 0].clone(), ids, cond, tree_capacity(K, L))
    first_child = tree.first_child.tolist()
    for b in range(bs):
        node, chain = 0, []
        while first_child[b][node] != -1:
            node = first_child[b][node]
            chain.append(int(tree.tokens[b, node]))
        assert chain == greedy[b].tolist()

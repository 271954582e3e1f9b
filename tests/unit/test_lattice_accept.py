"""Losslessness of lattice trees (docs/dflash2.md, "Losslessness"): the target-only walk
(accept/sampling.py + accept/walk.py, unchanged) over a tree built from DFlash2-style chain
conditionals emits the target's distribution at T > 0 and its greedy continuation at T = 0.

Negative control: recursive rejection over the siblings with the chain conditionals as the
proposal (SpecInfer's rule) is exact only when the siblings were *sampled* from those
conditionals; on the deterministic best-first tree the same code is rejected by the same
chi-square test. A positive control runs that code on sampled siblings, where it passes, so its
failure is the rule's, not a bug of the test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sglang_ddtree.accept import accept_walk, sample_target_tokens
from sglang_ddtree.tree import DraftTree
from sglang_ddtree.tree.lattice import build_lattice_tree, lattice_chain_logprobs
from tests.fixtures import chi_square_pvalue

torch.set_num_threads(1)

V, L, K, BUDGET, M, TRIALS, START = 6, 3, 3, 8, 3, 20000, 0


def target_rows(table: torch.Tensor, t: float, top_k: int) -> torch.Tensor:
    """[V, V] float64 next-token distribution given the previous token: temperature, then top-k
    (ties to the lower id, as accept/sampling.py)."""
    probs = torch.softmax(table.double() / t, dim=-1)
    if 0 < top_k < V:
        keep = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
        probs = torch.zeros_like(probs).scatter(1, keep, probs.gather(1, keep))
    return probs / probs.sum(-1, keepdim=True)


def setup(t: float, top_k: int):
    """A Markov target and, per root token, a DFlash2-like lattice and its tree."""
    g = torch.Generator().manual_seed(2025)
    table = torch.randn(V, V, generator=g) * 1.5  # [V, V] target logits given the previous token
    ids, scores = noisy_lattice(table, g)
    cond = lattice_chain_logprobs(scores)  # [V, L, K, K]
    trees = build_lattice_tree(torch.arange(V), ids, cond, BUDGET)  # row v: the tree of root v
    return table, target_rows(table, t, top_k), trees, child_proposals(trees, ids, cond)


def noisy_lattice(table: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Per root v: slot e's candidates are the K likeliest tokens of the target's marginal at
    e (T = 1), and the transition scores the target's logits between them plus noise, so the
    drafter agrees with the target often but not always. -> ids [V, L, K], scores [V, L, K, K]."""
    step = torch.softmax(table, dim=-1)  # [V, V]
    marginal = torch.eye(V)  # [V roots, V]: slot -1 is the root
    ids, scores = [], []
    for e in range(L):
        pred = torch.arange(V)[:, None].expand(V, K) if e == 0 else ids[-1]  # [V, K]
        marginal = marginal @ step
        ids.append(marginal.topk(K, dim=-1).indices)  # [V, K]
        logits = table[pred[:, :, None], ids[-1][:, None, :]]  # [V, K, K]
        scores.append(logits + torch.randn(V, K, K, generator=g))
    return torch.stack(ids, 1), torch.stack(scores, 1)


def child_proposals(trees: DraftTree, ids: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
    """[V, N, V] float64: each node's chain conditional over the next slot's candidates, dense
    over the vocabulary (zero for a leaf at depth L)."""
    R, N = trees.tokens.shape
    q = torch.zeros(R, N, V, dtype=torch.float64)
    for r in range(R):
        for n in range(N):
            d = int(trees.depth[r, n])
            if d == L:
                continue
            row = 0 if d == 0 else ids[r, d - 1].tolist().index(int(trees.tokens[r, n]))
            q[r, n].scatter_(0, ids[r, d], cond[r, d, row].double().exp())
    return q


def exact_sequence_probs(P: torch.Tensor) -> np.ndarray:
    """[V**M] probability of each M-token continuation of START under plain sampling."""
    probs = np.zeros(V**M)
    for code in range(V**M):
        seq = [START] + [code // V ** (M - 1 - m) % V for m in range(M)]
        probs[code] = math.prod(float(P[a, b]) for a, b in zip(seq, seq[1:], strict=False))
    return probs


def gather_trees(trees: DraftTree, root: torch.Tensor) -> DraftTree:
    """Each trial's tree: the tree of its round's root; the root token is the trial's own."""
    return DraftTree(*(field[root] for field in trees))


def sibling_rejection_walk(
    tree: DraftTree, q: torch.Tensor, P: torch.Tensor, g: torch.Generator
) -> torch.Tensor:
    """Recursive rejection over siblings (SpecInfer; without replacement: a tried sibling's
    proposal mass is removed and the rest renormalised). tree [bs, N], q [bs, N, V] each node's
    proposal over its children, P [V, V] target rows. -> emitted [bs, depth + 1], -1 padded."""
    bs, N = tree.tokens.shape
    rows = torch.arange(bs)
    node, live = torch.zeros(bs, dtype=torch.int64), torch.ones(bs, dtype=torch.bool)
    emitted = torch.full((bs, int(tree.depth.max()) + 1), -1, dtype=torch.int64)
    for step in range(emitted.shape[1]):
        residual = P[tree.tokens[rows, node]].clone()  # [bs, V]
        proposal = q[rows, node].clone()  # [bs, V]
        child, moved = tree.first_child[rows, node], torch.zeros(bs, dtype=torch.bool)
        for _ in range(N):
            trying = live & ~moved & (child >= 0)
            token = tree.tokens[rows, child.clamp(min=0)]
            qj = proposal / proposal.sum(-1, keepdim=True).clamp(min=1e-300)
            ratio = residual[rows, token] / qj[rows, token].clamp(min=1e-300)
            accept = trying & (torch.rand(bs, generator=g, dtype=torch.float64) < ratio)
            moved |= accept
            reject = trying & ~accept
            left = (residual - qj).clamp(min=0)
            left = left / left.sum(-1, keepdim=True).clamp(min=1e-300)
            residual = torch.where(reject[:, None], left, residual)
            proposal[rows, token] = torch.where(reject, 0.0, proposal[rows, token])
            node = torch.where(accept, child, node)
            child = torch.where(
                trying & ~accept, tree.next_sibling[rows, child.clamp(min=0)], child
            )
        bonus = torch.multinomial(residual, 1, generator=g)[:, 0]
        emitted[:, step] = torch.where(moved, tree.tokens[rows, node], bonus)
        emitted[:, step] = torch.where(live, emitted[:, step], -1)
        live &= moved
    return emitted


def first_m_codes(rounds: list[torch.Tensor]) -> np.ndarray:
    emitted = torch.cat(rounds, dim=1)  # -1 padded per round
    order = torch.sort((emitted < 0).int(), dim=1, stable=True).indices
    seqs = emitted.gather(1, order)[:, :M]
    codes = sum(seqs[:, m] * V ** (M - 1 - m) for m in range(M))
    return np.bincount(codes.numpy(), minlength=V**M)


def run_lattice(setup_out, t: float, top_k: int, rule: str, g: torch.Generator) -> np.ndarray:
    """TRIALS generations of M tokens from START; counts per M-token sequence."""
    table, P, trees, q = setup_out
    bs = TRIALS
    root, rounds = torch.full((bs,), START), []
    temperature = torch.full((bs,), t)
    top_p, k = torch.ones(bs), torch.full((bs,), top_k, dtype=torch.int64)
    for _ in range(M):  # every round emits at least one token
        tree = gather_trees(trees, root)
        if rule == "target_only":
            targets = sample_target_tokens(table[tree.tokens], temperature, top_p, k, g)
            emitted = accept_walk(tree, targets, L).emitted
        else:  # "sibling_rejection": the conditionals as proposal over deterministic siblings
            emitted = sibling_rejection_walk(tree, q[root], P, g)
        rounds.append(emitted)
        last = (emitted >= 0).sum(1) - 1
        root = emitted.gather(1, last[:, None])[:, 0]
    return first_m_codes(rounds)


CONFIGS = [(1.0, 0), (0.7, 0), (1.3, 4)]


@pytest.mark.parametrize("t,top_k", CONFIGS)
def test_target_only_walk_on_lattice_trees_is_lossless(t, top_k):
    """Chi-square of the first M emitted tokens against plain sampling, alpha = 1e-3."""
    out = setup(t, top_k)
    counts = run_lattice(out, t, top_k, "target_only", torch.Generator().manual_seed(7))
    assert chi_square_pvalue(counts, exact_sequence_probs(out[1])) > 1e-3


@pytest.mark.parametrize("t,top_k", CONFIGS)
def test_sibling_rejection_on_the_deterministic_tree_is_caught(t, top_k):
    out = setup(t, top_k)
    counts = run_lattice(out, t, top_k, "sibling_rejection", torch.Generator().manual_seed(7))
    expected = exact_sequence_probs(out[1])
    outside_support = counts[expected == 0].sum() > 0
    assert outside_support or chi_square_pvalue(counts, expected) < 1e-9


def sampled_children(q: torch.Tensor, k: int, g: torch.Generator) -> torch.Tensor:
    """[bs, V] proposals -> [bs, k] distinct tokens drawn without replacement (Gumbel top-k)."""
    gumbel = -torch.empty_like(q).exponential_(generator=g).log()
    return (q.log() + gumbel).topk(k, dim=-1).indices


def test_sibling_rejection_is_exact_on_sampled_siblings():
    """Positive control: one root, k children drawn without replacement from q, the same walk:
    the first token is distributed as the target's (and as the deterministic case is not)."""
    g = torch.Generator().manual_seed(8)
    bs, k = TRIALS, 2
    P = torch.softmax(torch.randn(1, V, generator=g, dtype=torch.float64) * 1.5, -1)
    P = P.expand(V, V)  # the same target row after every token: only the first is tested
    q = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, -1).expand(bs, V)
    ones = torch.ones(bs, 1, dtype=torch.int64)
    tree = DraftTree(
        tokens=torch.cat([0 * ones, sampled_children(q, k, g)], 1),
        parents=torch.tensor([[-1, 0, 0]]).expand(bs, 3),
        depth=torch.tensor([[0, 1, 1]]).expand(bs, 3),
        first_child=torch.tensor([[1, -1, -1]]).expand(bs, 3),
        next_sibling=torch.tensor([[-1, 2, -1]]).expand(bs, 3),
        visibility=torch.ones(bs, 3, 3, dtype=torch.bool),  # not read by the walk
        scores=torch.zeros(bs, 3),
    )
    proposals = torch.zeros(bs, 3, V, dtype=torch.float64)
    proposals[:, 0] = q
    first = sibling_rejection_walk(tree, proposals, P, g)[:, 0]
    counts = np.bincount(first.numpy(), minlength=V)
    assert chi_square_pvalue(counts, P[0].numpy()) > 1e-3
    top = q[:1].topk(k).indices.expand(bs, k)  # the deterministic tree's children
    tree = tree._replace(tokens=torch.cat([0 * ones, top], 1))
    first = sibling_rejection_walk(tree, proposals, P, g)[:, 0]
    assert chi_square_pvalue(np.bincount(first.numpy(), minlength=V), P[0].numpy()) < 1e-9


def test_greedy_walk_emits_the_target_argmax_continuation():
    table, _, trees, _ = setup(1.0, 0)
    root, out = torch.tensor([START]), []
    while len(out) < 3 * M:
        tree = gather_trees(trees, root)
        targets = table[tree.tokens].argmax(-1)  # T = 0: the target's argmax at every node
        result = accept_walk(tree, targets, L)
        out += result.emitted[0, : int(result.num_accepted[0]) + 1].tolist()
        root = result.bonus
    plain = [START]
    for _ in range(len(out)):
        plain.append(int(table[plain[-1]].argmax()))
    assert out == plain[1:]


def test_lattice_trees_accept_deep():
    """Sanity: multi-token rounds happen, so the distribution test covers accepted paths."""
    table, P, trees, _ = setup(1.0, 0)
    g = torch.Generator().manual_seed(9)
    tree = gather_trees(trees, torch.full((4000,), START))
    temperature, top_p = torch.ones(4000), torch.ones(4000)
    targets = sample_target_tokens(table[tree.tokens], temperature, top_p, 0 * top_p.long(), g)
    accepted = accept_walk(tree, targets, L).num_accepted
    assert (accepted >= 1).float().mean() > 0.3 and (accepted >= 2).float().mean() > 0.05

"""accept/budget.py: the prefix property the policy rests on, the predicted acceptance, and the
policy's choices against cost tables."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_ddtree.accept.budget import chain_expected_tokens, expected_tokens, truncate
from sglang_ddtree.round.widths import CHAIN, Calibration, CostTable, choose_width
from sglang_ddtree.tree import build_tree_reference
from sglang_ddtree.tree.testing import random_build_inputs


@pytest.mark.parametrize("mode", ["continuous", "ties"])
def test_the_first_n_nodes_of_a_tree_are_the_n_node_tree(mode):
    """Why one build at the largest width serves every smaller one."""
    gen = torch.Generator().manual_seed(5)
    root, ids, lps = random_build_inputs(gen, 3, 7, 4, 60, mode)
    wide = build_tree_reference(root, ids, lps, 31)
    for n in (1, 4, 8, 15, 16):
        small = build_tree_reference(root, ids, lps, n)
        assert torch.equal(wide.tokens[:, : n + 1], small.tokens)
        assert torch.equal(wide.parents[:, : n + 1], small.parents)
        assert torch.equal(wide.scores[:, : n + 1], small.scores)


@pytest.mark.parametrize("mode", ["continuous", "ties"])
def test_truncating_a_wide_tree_gives_the_smaller_build_exactly(mode):
    """Every field of truncate(build(N), w) equals build(w - 1)'s, links included, for the
    reference and the batched torch builders; width 1 is the root alone."""
    from sglang_ddtree.tree import build_tree

    gen = torch.Generator().manual_seed(11)
    root, ids, lps = random_build_inputs(gen, 3, 7, 4, 60, mode)
    for build in (build_tree_reference, build_tree):
        wide = build(root, ids, lps, 31)
        for width in (1, 2, 5, 9, 16, 32):
            small = build(root, ids, lps, width - 1) if width > 1 else None
            cut = truncate(wide, width)
            if small is None:
                assert cut.tokens.shape == (3, 1) and (cut.first_child == -1).all()
                continue
            for name in small._fields:
                assert torch.equal(getattr(cut, name), getattr(small, name)), (build, width, name)
    with pytest.raises(ValueError, match="width must be in"):
        truncate(wide, 33)


def test_expected_tokens_is_one_plus_the_sum_of_path_probabilities():
    gen = torch.Generator().manual_seed(7)
    root, ids, lps = random_build_inputs(gen, 2, 5, 3, 40, "continuous")
    tree = build_tree_reference(root, ids, lps, 11)
    got = expected_tokens(tree.scores, [1, 4, 12])
    for b in range(2):
        q = [math.exp(float(s)) for s in tree.scores[b]]
        want = [1.0, 1.0 + sum(q[1:4]), 1.0 + sum(q[1:12])]
        assert got[b].tolist() == pytest.approx(want, rel=1e-6)
    assert (got[:, 1:] >= got[:, :-1]).all()  # more nodes never predict fewer tokens
    with pytest.raises(ValueError, match="widths"):
        expected_tokens(tree.scores, [13])


def test_the_chain_is_the_top1_tree():
    gen = torch.Generator().manual_seed(9)
    root, ids, lps = random_build_inputs(gen, 2, 6, 4, 40, "continuous")
    chain_tree = build_tree_reference(root, ids[:, :, :1], lps[:, :, :1], 6)  # K = 1: a path
    want = expected_tokens(chain_tree.scores, [7])[:, 0]
    assert chain_expected_tokens(lps[:, :, 0]).tolist() == pytest.approx(want.tolist(), rel=1e-6)


TABLE = dict(batch_sizes=(1, 8, 16))


def _expected(bs: int, per_width: list[float]) -> torch.Tensor:
    return torch.tensor([per_width] * bs)


def test_the_policy_picks_the_chain_when_the_cost_table_says_the_chain_wins():
    widths = [16, 32, 64]
    cost = CostTable(
        **TABLE,
        ms={
            CHAIN: (23.0, 34.0, 46.0),
            16: (23.5, 39.0, 60.0),
            32: (24.0, 51.0, 90.0),
            64: (31.0, 69.0, 128.0),
        },
    )
    acc = [2.2, 2.4, 2.5]  # a weak drafter: the tree adds little over the chain's 2.1
    chain = torch.full((16,), 2.1)
    assert choose_width(cost, _expected(16, acc), widths, chain[:16]) == CHAIN
    # at batch 1 the same tree costs about the chain's round: a tree wins
    assert choose_width(cost, _expected(1, acc), widths, chain[:1]) in widths


def test_the_policy_picks_a_wide_tree_when_verify_cost_is_flat():
    widths = [16, 32, 64]
    flat = CostTable(**TABLE, ms={w: (20.0, 20.0, 20.0) for w in (CHAIN, *widths)})
    chain = torch.full((8,), 1.9)
    assert choose_width(flat, _expected(8, [2.4, 2.6, 2.8]), widths, chain) == 64
    # and nothing is gained from width that predicts nothing more: the smaller one
    assert choose_width(flat, _expected(8, [2.4, 2.4, 2.4]), widths) == 16


def test_calibration_is_a_ratio_of_sums_over_the_last_requests():
    """The ratio of observed to predicted tokens summed over requests, the older fading by
    1 - 1 / horizon per request: a batch of 8 weighs 8 rounds of one request."""
    cal = Calibration(horizon=4)
    assert cal.ratio is None
    assert cal.update(observed=2.0, predicted=4.0) == pytest.approx(0.5)  # the first alone
    assert cal.update(observed=4.0, predicted=4.0) == pytest.approx((0.75 * 2 + 4) / (0.75 * 4 + 4))
    assert cal.update(observed=1.0, predicted=2.0, requests=8) == pytest.approx(
        (0.75**8 * (0.75 * 2 + 4) + 8) / (0.75**8 * (0.75 * 4 + 4) + 16)
    )
    with pytest.raises(ValueError, match="horizon"):
        Calibration(horizon=0.5)


def test_the_cost_table_interpolates_and_extrapolates_along_the_batch():
    cost = CostTable(batch_sizes=(1, 8, 16), ms={32: (24.0, 52.0, 68.0)})
    assert cost.cost(8, 32) == 52.0
    assert cost.cost(12, 32) == pytest.approx(60.0)
    assert cost.cost(32, 32) == pytest.approx(100.0)  # the last slope
    assert cost.cost(1, 32) == 24.0
    with pytest.raises(ValueError, match="increasing"):
        CostTable(batch_sizes=(8, 1), ms={})
    with pytest.raises(ValueError, match="positive ms"):
        CostTable(batch_sizes=(1, 8), ms={32: (1.0,)})

"""The DraftTree -> SGLang EAGLE verify layout (FULL custom mask, positions, retrieve links) and the
draft head that builds trees inside the draft graph; pure torch on CPU."""

from __future__ import annotations

import torch

from sglang_ddtree.config import DDTreeConfig
from sglang_ddtree.integration import tree_layout
from sglang_ddtree.integration.draft_head import DraftTreeHead
from sglang_ddtree.tree import build_tree, build_tree_reference, topk_logprobs_from_logits
from sglang_ddtree.tree.testing import assert_trees_equal


def _random_trees(bs: int, L: int, K: int, budget: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, L, 50, generator=g)
    ids, lps = topk_logprobs_from_logits(logits, K)
    root = torch.randint(0, 50, (bs,), generator=g)
    return build_tree(root, ids, lps, budget)


def _naive_full_mask(visibility: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    rows = []
    for b, S in enumerate(seq_lens):
        for i in range(visibility.shape[1]):
            rows.append(torch.ones(S, dtype=torch.bool))
            rows.append(visibility[b, i])
    return torch.cat(rows)


def test_full_mask_matches_a_row_by_row_construction():
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        bs = int(torch.randint(1, 5, (1,), generator=g))
        tree = _random_trees(
            bs, L=6, K=3, budget=int(torch.randint(1, 40, (1,), generator=g)), seed=seed
        )
        seq_lens = torch.randint(1, 30, (bs,), generator=g)
        N = tree.num_nodes
        size = tree_layout.full_mask_size(N, bs, int(seq_lens.sum()))
        out = torch.zeros(size + 7, dtype=torch.bool)  # over-sized buffers are allowed
        tree_layout.write_full_mask(tree.visibility, seq_lens, out)
        expected = _naive_full_mask(tree.visibility, seq_lens.tolist())
        assert torch.equal(out[:size], expected)


def test_positions_and_retrieve_index():
    tree = _random_trees(3, L=5, K=2, budget=9, seed=1)
    seq_lens = torch.tensor([4, 10, 7])
    pos = tree_layout.node_positions(tree.depth, seq_lens).view(3, -1)
    assert torch.equal(pos, seq_lens[:, None] + tree.depth)
    assert torch.equal(pos[:, 0], seq_lens)  # the root sits at the committed length
    idx = tree_layout.retrieve_index(3, tree.num_nodes, torch.device("cpu"))
    assert idx[2, 0].item() == 2 * tree.num_nodes and idx[1, 3].item() == tree.num_nodes + 3


def test_draft_head_builds_the_reference_tree_from_block_hidden_states():
    torch.manual_seed(0)
    cfg = DDTreeConfig(block_size=6, num_nodes=12, topk=3)
    V, H, bs = 40, 16, 3
    weight = torch.randn(V + 8, H)  # padded LM head: only the first V rows are tokens
    head = DraftTreeHead(lm_head_weight=weight, vocab_size=V, cfg=cfg, max_bs=5)
    hidden = torch.randn(bs * cfg.block_size, H)
    input_ids = torch.randint(0, V, (bs * cfg.block_size,))
    head(hidden, input_ids)

    logits = hidden.view(bs, cfg.block_size, H)[:, 1:] @ weight[:V].T
    ids, lps = topk_logprobs_from_logits(logits.float(), cfg.topk)
    root = input_ids.view(bs, cfg.block_size)[:, 0]
    expected = build_tree_reference(root, ids, lps, cfg.budget)
    got = head.tree(bs)
    assert_trees_equal(got, expected)
    assert int(got.tokens.max()) < V


def test_tree_builder_is_selectable_and_checked(monkeypatch):
    import pytest

    from sglang_ddtree.integration.draft_head import tree_builder

    assert tree_builder() is build_tree
    assert tree_builder(device=torch.device("cpu")) is build_tree
    monkeypatch.setenv("SGLANG_DDTREE_TREE_BUILDER", "torch")
    assert tree_builder(device=torch.device("cuda")) is build_tree
    monkeypatch.setenv("SGLANG_DDTREE_TREE_BUILDER", "heap")
    with pytest.raises(ValueError, match="'torch' or 'triton', got 'heap'"):
        tree_builder()


def test_ranks_of_a_vocabulary_sharded_lm_head_build_the_single_rank_tree():
    """Issue 18, part 1: three ranks holding uneven slices of the LM head (each with padding
    rows), each reducing its slice to its top-K and merging what the (simulated) all-gather
    returns, build the tree the single-rank head builds, identical on every rank."""
    from sglang_ddtree.integration.draft_head import VocabShard

    torch.manual_seed(3)
    cfg = DDTreeConfig(block_size=6, num_nodes=12, topk=3)
    V, H, bs = 40, 16, 3
    weight = torch.randn(V, H)
    hidden = torch.randn(bs * cfg.block_size, H)
    input_ids = torch.randint(0, V, (bs * cfg.block_size,))
    whole = DraftTreeHead(lm_head_weight=weight, vocab_size=V, cfg=cfg, max_bs=bs)
    whole(hidden, input_ids)
    bounds = [0, 7, 25, 40]
    slices = [torch.cat([weight[a:b], torch.randn(2, H)]) for a, b in zip(bounds, bounds[1:])]  # noqa: B905
    block = hidden.view(bs, cfg.block_size, H)[:, 1:]
    from sglang_ddtree.tree.shard_topk import shard_topk

    parts = [shard_topk(block @ w[: b - a].T, cfg.topk, a)
             for w, a, b in zip(slices, bounds, bounds[1:])]  # noqa: B905  # fmt: skip

    def gather_for(rank):
        calls = []

        def gather(t):
            i = len(calls) % len(parts[0])
            calls.append(i)
            assert torch.equal(t, parts[rank][i])  # this rank's own part, in order
            return torch.stack([p[i] for p in parts])

        return gather

    trees = []
    for rank, (w, a, b) in enumerate(zip(slices, bounds, bounds[1:])):  # noqa: B905
        head = DraftTreeHead(lm_head_weight=w, vocab_size=b - a, cfg=cfg, max_bs=bs,
                             shard=VocabShard(offset=a, gather=gather_for(rank)))  # fmt: skip
        head(hidden, input_ids)
        trees.append(head.tree(bs))
    single = whole.tree(bs)
    for tree in trees:
        for name in single._fields:  # the same tree; the scores up to the log-sum-exp's rounding
            got, want = getattr(tree, name), getattr(single, name)
            same = (
                torch.allclose(got, want, atol=1e-5) if name == "scores" else torch.equal(got, want)
            )
            assert same, (name, got, want)
        for name in single._fields:  # and bit-identical on every rank
            assert torch.equal(getattr(tree, name), getattr(trees[0], name)), name

"""The DraftTree -> SGLang EAGLE verify layout (FULL custom mask, positions, retrieve links) and the
draft head that builds trees inside the draft graph; pure torch on CPU."""

from __future__ import annotations

import pytest
import torch

from sglang_ddtree.config import DDTreeConfig
from sglang_ddtree.round.draft_head import DraftTreeHead
from sglang_ddtree.tree import build_tree, build_tree_reference, topk_logprobs_from_logits
from sglang_ddtree.tree import verify_layout as tree_layout
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


def test_tree_builder_follows_the_device_and_is_checked():
    """torch off CUDA; a benchmark may name one (scripts/bench_tree_build.py)."""
    import pytest

    from sglang_ddtree.round.draft_head import tree_builder

    assert tree_builder() is build_tree
    assert tree_builder(device=torch.device("cpu")) is build_tree
    assert tree_builder("torch", device=torch.device("cuda")) is build_tree
    with pytest.raises(ValueError, match="'torch' or 'triton', got 'heap'"):
        tree_builder("heap")


def test_ranks_of_a_vocabulary_sharded_lm_head_build_the_single_rank_tree():
    """Tensor parallelism: three ranks holding uneven slices of the LM head (each with padding
    rows), each reducing its slice to its top-K and merging what the (simulated) all-gather
    returns, build the tree the single-rank head builds, identical on every rank."""
    from sglang_ddtree.round.draft_head import VocabShard

    torch.manual_seed(3)
    cfg = DDTreeConfig(block_size=6, num_nodes=12, topk=3)
    V, H, bs = 40, 16, 3
    weight = torch.randn(V, H)
    hidden = torch.randn(bs * cfg.block_size, H)
    input_ids = torch.randint(0, V, (bs * cfg.block_size,))
    whole = DraftTreeHead(lm_head_weight=weight, vocab_size=V, cfg=cfg, max_bs=bs)
    whole(hidden, input_ids)
    bounds = [0, 7, 25, 40]
    slices = [
        torch.cat([weight[a:b], torch.randn(2, H)])
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    block = hidden.view(bs, cfg.block_size, H)[:, 1:]
    from sglang_ddtree.tree.shard_topk import shard_topk

    parts = [
        shard_topk(block @ w[: b - a].T, cfg.topk, a)
        for w, a, b in zip(slices, bounds, bounds[1:], strict=False)
    ]

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
        head = DraftTreeHead(
            lm_head_weight=w,
            vocab_size=b - a,
            cfg=cfg,
            max_bs=bs,
            shard=VocabShard(offset=a, gather=gather_for(rank)),
        )
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


def test_the_worker_gives_each_rank_of_a_sharded_lm_head_its_rows_and_the_same_tree():
    """Tensor parallelism, the wiring: `worker.tree_head` reads a vocabulary-parallel LM head's
    shard (SGLang's shard indices: this rank's first global id and its real rows, the padding
    rows left out) and, given the TP gather, merges through it; two ranks with padded shards
    then build the single-rank tree, and at tp = 1 the head takes the real rows, no shard."""
    from types import SimpleNamespace

    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbeddingShardIndices

    from sglang_ddtree.round.worker import tree_head

    torch.manual_seed(5)
    cfg = DDTreeConfig(block_size=5, num_nodes=10, topk=3)
    V, H, bs, pad = 30, 8, 2, 2
    weight = torch.randn(V, H)
    hidden = torch.randn(bs * cfg.block_size, H)
    input_ids = torch.randint(0, V, (bs * cfg.block_size,))

    def lm_head(rows, start, end):
        shard = VocabParallelEmbeddingShardIndices(start, end + pad, V, V, start, end, V, V)
        return SimpleNamespace(weight=torch.cat([rows, torch.randn(pad, H)]), shard_indices=shard)

    single = tree_head(lm_head(weight, 0, V), cfg, bs)
    assert single.shard is None and single.vocab_size == V  # the padding rows are not tokens
    quantized = lm_head(weight, 0, V)
    quantized.weight = quantized.weight.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"quantizes \(lm_head.weight is torch.float8_e4m3fn"):
        tree_head(quantized, cfg, bs)
    whole = DraftTreeHead(lm_head_weight=weight, vocab_size=V, cfg=cfg, max_bs=bs)
    single(hidden, input_ids)
    whole(hidden, input_ids)
    assert_trees_equal(single.tree(bs), whole.tree(bs))

    # a simulated all-gather: every rank's reduction of its slice, stacked in rank order
    from sglang_ddtree.tree.shard_topk import shard_topk

    bounds = ((0, 17), (17, V))
    block = hidden.view(bs, cfg.block_size, H)[:, 1:]
    parts = [shard_topk(block @ weight[a:b].T, cfg.topk, a) for a, b in bounds]

    def gather_for(rank):
        calls = iter(range(len(parts[rank])))

        def gather(t):
            i = next(calls)
            assert torch.equal(t, parts[rank][i])  # this rank's own part, in order
            return torch.stack([p[i] for p in parts])

        return gather

    heads = [
        tree_head(lm_head(weight[a:b], a, b), cfg, bs, gather_for(rank))
        for rank, (a, b) in enumerate(bounds)
    ]
    assert [(h.shard.offset, h.vocab_size) for h in heads] == [(0, 17), (17, 13)]
    trees = []
    for h in heads:
        h(hidden, input_ids)
        trees.append(h.tree(bs))
    want = whole.tree(bs)
    for tree in trees:
        assert torch.equal(tree.tokens, want.tokens) and torch.equal(tree.parents, want.parents)
        assert torch.allclose(tree.scores, want.scores, atol=1e-5)
        assert_trees_equal(tree, trees[0])  # bit-identical on every rank


def test_the_tp_gather_stacks_every_ranks_tensor_in_rank_order(monkeypatch):
    """compat.tp_gather on SGLang's TP group: its concat-style all-gather along a new leading
    dimension, so gather(t) is [ranks, *t.shape] (a fake two-rank group stands in for NCCL)."""
    import sglang.srt.distributed as dist

    from sglang_ddtree.adapter import compat

    class TwoRanks:
        world_size = 2

        def all_gather(self, t, dim=-1):
            assert dim == 0 and t.shape[0] == 1 and t.is_contiguous()
            return torch.cat([t, t + 100], dim=0)  # rank 1 holds this rank's values + 100

    monkeypatch.setattr(dist, "get_tp_group", lambda: TwoRanks())
    gather = compat.tp_gather()
    t = torch.arange(6).view(2, 3).t()  # not contiguous
    got = gather(t)
    assert got.shape == (2, 3, 2)
    assert torch.equal(got[0], t) and torch.equal(got[1], t + 100)

"""tree/shard_topk.py: the draft head's top-K log-probs from a vocabulary-sharded LM head (each
rank's top-K and log-sum-exp, merged): the single-rank top-K of the full log-softmax, ties to the
lower token id, whatever the split."""

from __future__ import annotations

import pytest
import torch

from sglang_ddtree.tree.shard_topk import merge_topk, shard_topk, topk_lower_id_first


def _sharded(logits: torch.Tensor, bounds: list[int], k: int):
    """Simulated ranks: each takes its slice, the parts are stacked in rank order (all-gather)."""
    parts = [shard_topk(logits[..., a:b], k, a) for a, b in zip(bounds, bounds[1:], strict=False)]
    return merge_topk(*(torch.stack(x) for x in zip(*parts, strict=True)), k)


@pytest.mark.parametrize("bounds", [[0, 64], [0, 16, 32, 48, 64], [0, 5, 41, 64], [0, 3, 6, 64]])
def test_the_merge_is_the_full_vocabularys_top_k(bounds):
    gen = torch.Generator().manual_seed(len(bounds))
    logits = torch.randn(2, 5, 64, generator=gen) * 4  # [bs, B - 1, V]; k = 8 > a 3-wide shard
    ids, logprobs = _sharded(logits, bounds, 8)
    want_v, want_i = topk_lower_id_first(torch.log_softmax(logits, -1), 8)
    assert torch.equal(ids, want_i)
    torch.testing.assert_close(logprobs, want_v, rtol=0, atol=2e-6)
    full_v, _ = torch.topk(torch.log_softmax(logits, -1), 8)  # no ties here: torch's own order
    torch.testing.assert_close(logprobs, full_v, rtol=0, atol=2e-6)


def test_exact_ties_go_to_the_lower_id_whatever_the_split():
    logits = torch.zeros(1, 1, 40)
    logits[..., [3, 17, 18, 30, 39]] = 2.0  # five tied best tokens across shard boundaries
    logits[..., [5, 25]] = 1.0
    for bounds in ([0, 40], [0, 10, 20, 30, 40], [0, 18, 40], [0, 31, 40]):
        ids, logprobs = _sharded(logits, bounds, 6)
        assert ids.flatten().tolist() == [3, 17, 18, 30, 39, 5], bounds
        assert torch.equal(logprobs[..., :5], logprobs[..., :1].expand(1, 1, 5))


def test_a_split_gives_the_same_bytes_to_every_rank():
    """Every rank merges the same gathered tensors: bit-identical results, and two different
    splits of one vocabulary agree on the ids (the log-probs to rounding)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 4, 50, generator=gen)
    a = _sharded(logits, [0, 25, 50], 8)
    b = _sharded(logits, [0, 25, 50], 8)
    c = _sharded(logits, [0, 7, 19, 50], 8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(a[0], c[0])
    torch.testing.assert_close(a[1], c[1], rtol=0, atol=2e-6)

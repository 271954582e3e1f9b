"""accept/penalties.py: each node's penalties exactly as its own path gives them, against a plain
per-node loop that builds the node's context and counts it."""

from __future__ import annotations

import pytest
import torch

from sglang_ddtree.accept.penalties import (
    penalize,
    penalize_tree,
    penalize_tree_,
    suppress_eos_before_min_tokens,
)
from sglang_ddtree.tree import build_tree_reference
from sglang_ddtree.tree.testing import random_build_inputs


def _trees(bs, N, vocab, gen):
    root, ids, lps = random_build_inputs(gen, bs, 7, 4, vocab, mode="continuous")
    return build_tree_reference(root, ids, lps, N - 1)


def _per_node(logits, tree, counts, seen, f, p, r):
    out = torch.empty_like(logits)
    bs, N, V = logits.shape
    for b in range(bs):
        for i in range(N):
            path = [j for j in range(1, N) if tree.visibility[b, i, j]]  # nodes 1..i on i's path
            c = counts[b].clone().to(logits.dtype)
            s = seen[b].clone()
            for j in path:
                c[tree.tokens[b, j]] += 1
                s[tree.tokens[b, j]] = True
            out[b, i] = penalize(logits[b, i], c, s, f[b], p[b], r[b])
    return out


@pytest.mark.parametrize("repeats", [False, True])
def test_every_node_gets_the_penalties_of_its_own_path(repeats):
    """Random DDTrees (repeats: a tiny vocabulary, so tokens recur along paths and between
    siblings), counts and seen sets from a made-up history, all three penalties at once."""
    gen = torch.Generator().manual_seed(3)
    bs, N, V = 3, 20, 6 if repeats else 100
    tree = _trees(bs, N, V, gen)
    logits = torch.randn(bs, N, V, generator=gen) * 3
    counts = torch.randint(0, 3, (bs, V), generator=gen) * (torch.rand(bs, V, generator=gen) < 0.3)
    seen = (counts > 0) | (torch.rand(bs, V, generator=gen) < 0.2)  # the prompt's tokens too
    f, p = torch.tensor([0.5, 0.0, 1.2]), torch.tensor([0.3, 0.7, 0.0])
    r = torch.tensor([1.3, 1.0, 0.8])
    got = penalize_tree(logits, tree.tokens, tree.visibility, counts, f, p, r, seen=seen)
    torch.testing.assert_close(
        got, _per_node(logits, tree, counts, seen, f, p, r), rtol=0, atol=1e-6
    )
    # the root's row sees the shared counts only: SGLang's own penalty for the chain's first step
    shared = penalize(logits[:, 0], counts.float(), seen, f[:, None], p[:, None], r[:, None])
    torch.testing.assert_close(got[:, 0], shared, rtol=0, atol=1e-6)


def test_no_penalty_leaves_the_logits_alone():
    gen = torch.Generator().manual_seed(5)
    tree = _trees(2, 12, 50, gen)
    logits = torch.randn(2, 12, 50, generator=gen)
    counts = torch.randint(0, 4, (2, 50), generator=gen)
    off = penalize_tree(
        logits, tree.tokens, tree.visibility, counts, torch.zeros(2), torch.zeros(2), torch.ones(2)
    )
    assert torch.equal(off, logits)


def test_eos_is_blocked_per_node_until_min_tokens():
    """A node at depth d follows output_len + d tokens: EOS is blocked below min_tokens."""
    logits = torch.zeros(2, 4, 10)
    depth = torch.tensor([[0, 1, 2, 3], [0, 1, 1, 2]])
    out = suppress_eos_before_min_tokens(
        logits, depth, torch.tensor([5, 1]), torch.tensor([7, 1]), torch.tensor([9, 2])
    )
    blocked = torch.isinf(out[..., 9])
    assert blocked.tolist() == [[True, True, False, False], [False, False, False, False]]
    assert torch.equal(torch.isinf(out[..., 2]), blocked) and not torch.isinf(out[..., :2]).any()


def test_one_position_is_penalised_as_sglangs_own_penalizers_do():
    """`penalize` against SGLang's penalizer classes driven as its overlap scheduler drives
    them (cumulate the output tokens, accumulate the additive penalties, then the scaling ones,
    SamplingBatchInfo.apply_logits_bias's order): the same logits, negative and positive ones,
    tokens seen once and twice, all three penalties at once and min_new_tokens's EOS block."""
    from types import SimpleNamespace

    penaltylib = pytest.importorskip("sglang.srt.sampling.penaltylib")
    from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

    gen = torch.Generator().manual_seed(5)
    V, eos = 23, 3
    params = [(0.4, 0.3, 1.3, 0), (-0.2, 0.5, 0.8, 9), (0.0, 0.0, 1.0, 0)]
    reqs = [
        SimpleNamespace(
            sampling_params=SimpleNamespace(
                frequency_penalty=f,
                presence_penalty=p,
                repetition_penalty=r,
                min_new_tokens=m,
                stop_token_ids=None,
            ),
            eos_token_ids=None,
            tokenizer=SimpleNamespace(additional_stop_token_ids=None, eos_token_id=eos),
        )
        for f, p, r, m in params
    ]

    class Batch:  # the orchestrator keeps a weak reference to its batch
        device = "cpu"

    batch = Batch()
    batch.reqs = reqs
    orch = penaltylib.BatchedPenalizerOrchestrator(
        V,
        batch,
        {
            penaltylib.BatchedFrequencyPenalizer,
            penaltylib.BatchedMinNewTokensPenalizer,
            penaltylib.BatchedPresencePenalizer,
            penaltylib.BatchedRepetitionPenalizer,
        },
    )
    outputs = torch.randint(0, V, (5, len(reqs)), generator=gen)
    outputs[1] = outputs[0]  # some tokens twice
    counts = torch.zeros(len(reqs), V)
    for step in outputs:
        orch.cumulate_output_tokens(step)
        counts[torch.arange(len(reqs)), step] += 1
    logits = torch.randn(len(reqs), V, generator=gen) * 3
    sglang = logits.clone()
    additive = torch.zeros(len(reqs), V)
    orch.accumulate_additive_penalties(additive)
    sglang.add_(additive)
    apply_scaling_penalties(sglang, orch.accumulate_scaling_penalties())
    f, p, r = (torch.tensor([x[i] for x in params]) for i in range(3))
    ours = penalize(logits, counts, counts > 0, f[:, None], p[:, None], r[:, None])
    ours = suppress_eos_before_min_tokens(
        ours[:, None],
        torch.zeros(len(reqs), 1, dtype=torch.long),
        torch.full((3,), 5),
        torch.tensor([x[3] for x in params]),
        torch.tensor([eos]),
    )[:, 0]
    torch.testing.assert_close(ours, sglang, rtol=1e-6, atol=1e-6)


def test_the_in_place_tree_penalties_are_penalize_tree(monkeypatch):
    """penalize_tree_ (the server's, in place, few temporaries) gives penalize_tree's logits,
    repeated tokens on a path, negative and positive logits and every penalty at once."""
    gen = torch.Generator().manual_seed(9)
    bs, N, V = 3, 11, 17
    tree = _trees(bs, N, V, gen)
    logits = torch.randn(bs, N, V, generator=gen) * 3
    counts = torch.randint(0, 3, (bs, V), generator=gen).float()
    f, p, r = (
        torch.tensor([0.5, -0.3, 0.0]),
        torch.tensor([0.2, 0.4, 0.0]),
        torch.tensor([1.3, 0.7, 1.0]),
    )
    want = penalize_tree(logits, tree.tokens, tree.visibility, counts, f, p, r)
    got = penalize_tree_(logits.clone(), tree.tokens, tree.visibility, counts, f, p, r)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # a temporary budget below the batch: a request or two at a time, the same bits
    per_request = N * V * 5
    for budget in (1, per_request, 2 * per_request + 1):
        chunked = penalize_tree_(
            logits.clone(), tree.tokens, tree.visibility, counts, f, p, r, temp_bytes=budget
        )
        assert torch.equal(chunked, got), budget
    from sglang_ddtree.accept import penalties as module

    sizes = []

    def counted(x, *args, **kwargs):
        sizes.append(x.shape[0])
        return penalize_tree_(x, *args, **kwargs)

    monkeypatch.setattr(module, "penalize_tree_", counted)  # the chunks' own calls
    penalize_tree_(
        logits.clone(), tree.tokens, tree.visibility, counts, f, p, r, temp_bytes=2 * per_request
    )
    assert sizes == [2, 1]

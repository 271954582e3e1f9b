"""The agreeing "binary" pair (testing/binary_pair.py): DDTree accepts deep paths every round,
through rank-0 and rank-1 children alike, and stays token-identical to plain greedy decoding on
the attention-only and the hybrid Gated DeltaNet target. This is the pair the GPU tests serve."""

from __future__ import annotations

import pytest
import torch

from sglang_ddtree.checkpoints.binary_pair import binary_fraction, write_binary_pair
from sglang_ddtree.reference.engine import generate, generate_chain, generate_plain, load_pair

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\n"]


@pytest.fixture(scope="module", params=["qwen3", "qwen35"])
def pair(request, tmp_path_factory):
    torch.set_num_threads(1)
    target_dir, draft_dir = write_binary_pair(tmp_path_factory.mktemp("binary"), request.param)
    return load_pair(target_dir, draft_dir)


def _off_chain_depths(trace) -> list[int]:
    """Depths of accepted nodes that are not their parent's first child (rank >= 1)."""
    tree, path = trace.tree, trace.accept.path[0]
    out = []
    for depth in range(1, int(trace.accept.num_accepted[0]) + 1):
        node, parent = int(path[depth]), int(path[depth - 1])
        if int(tree.first_child[0, parent]) != node:
            out.append(depth)
    return out


def test_ddtree_accepts_deep_side_branches_and_matches_plain_greedy(pair):
    target, drafter, tok = pair
    deep_rounds = off_chain = rounds = 0
    for prompt in PROMPTS:
        ids = torch.tensor(tok(prompt)["input_ids"])
        plain = generate_plain(target, ids, 96)
        traces = []
        result = generate(target, drafter, ids, 96, budget=31, topk=4, on_round=traces.append)
        assert list(result.tokens) == list(plain.tokens), prompt
        assert binary_fraction(list(plain.tokens)) > 0.8
        rounds += len(traces)
        deep_rounds += sum(int(t.accept.num_accepted[0]) >= 4 for t in traces)
        off_chain += sum(bool(_off_chain_depths(t)) for t in traces)
    assert deep_rounds >= rounds // 2, (deep_rounds, rounds)
    assert off_chain >= 5, off_chain  # accepted paths through rank-1 children


def test_chain_dflash_matches_too(pair):
    target, drafter, tok = pair
    ids = torch.tensor(tok(PROMPTS[0])["input_ids"])
    plain = generate_plain(target, ids, 48)
    chain = generate_chain(target, drafter, ids, 48)
    assert list(chain.tokens) == list(plain.tokens)

"""End-to-end greedy losslessness of the reference engine on tiny seeded CPU models (float32).

DDTree and chain DFlash must emit exactly the tokens of plain greedy decoding with the target's
own transformers cache, on an attention-only Qwen3 and a Gated DeltaNet hybrid Qwen3.5, with
the random tiny DFlash draft (acceptance near zero: every round ends at the root) and with the
OracleDrafter (deep paths and side branches get accepted and committed).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang_ddtree.reference.engine import (
    RoundTrace,
    generate,
    generate_chain,
    generate_plain,
    load_pair,
)
from sglang_ddtree.reference.naive import NaiveTargetRunner
from sglang_ddtree.reference.oracle import OracleDrafter
from tests.fixtures import tiny_pairs

ARCHS = ("qwen3", "qwen35")
PROMPTS = (
    "def add(a, b):\n    return",
    "import os\nimport sys\n\n",
    "class Stack:\n    def push(self, item):",
)
NEW_TOKENS = 256
BLOCK_SIZE = 16  # the OracleDrafter's
DFLASH_BLOCK_SIZE = 8  # the random draft is never accepted; a short block keeps verify cheap


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict:
    """arch -> (HFTargetRunner, DFlashDraftRunner, tokenizer), loaded through load_pair."""
    return tiny_pairs(tmp_path_factory, ARCHS, DFLASH_BLOCK_SIZE)


@pytest.fixture(scope="module")
def prompts(pairs) -> dict:
    return {arch: [tok(p)["input_ids"] for p in PROMPTS] for arch, (_, _, tok) in pairs.items()}


@pytest.fixture(scope="module")
def plain(pairs, prompts) -> dict:
    """(arch, prompt index) -> plain greedy tokens: the ground truth."""
    return {
        (arch, i): generate_plain(pairs[arch][0], ids, NEW_TOKENS).tokens
        for arch in ARCHS
        for i, ids in enumerate(prompts[arch])
    }


def _off_chain(trace: RoundTrace) -> bool:
    """Did the accepted path use a node that is not the draft's rank-0 token at its depth?"""
    accept, tree = trace.accept, trace.tree
    path = accept.path[0, 1 : int(accept.num_accepted[0]) + 1]  # accepted draft nodes
    depth = tree.depth[0, path]
    return bool((tree.tokens[0, path] != trace.topk_ids[0, depth - 1, 0]).any())


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_lossless_with_dflash_draft(arch, pairs, prompts, plain):
    target, drafter, _ = pairs[arch]
    for i, ids in enumerate(prompts[arch]):
        tree = generate(target, drafter, ids, NEW_TOKENS, budget=6, topk=2)
        chain = generate_chain(target, drafter, ids, NEW_TOKENS)
        assert len(plain[arch, i]) == NEW_TOKENS
        assert tree.tokens == plain[arch, i], f"DDTree differs from plain on prompt {i}"
        assert chain.tokens == plain[arch, i], f"chain DFlash differs from plain on prompt {i}"
        assert (
            sum(tree.accept_lengths)
            >= NEW_TOKENS - 1
            > sum(tree.accept_lengths) - DFLASH_BLOCK_SIZE
        )
        assert tree.rounds == len(tree.accept_lengths)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_lossless_with_oracle_deep_and_side_paths(arch, pairs, prompts, plain):
    target, _, _ = pairs[arch]
    deep = off_chain = rounds = 0
    for i, ids in enumerate(prompts[arch]):
        traces: list[RoundTrace] = []
        oracle = OracleDrafter(target.model, BLOCK_SIZE, noise=0.15, seed=i, lookahead=NEW_TOKENS)
        tree = generate(target, oracle, ids, NEW_TOKENS, budget=32, topk=4, on_round=traces.append)
        chain = generate_chain(target, oracle, ids, NEW_TOKENS)
        assert tree.tokens == plain[arch, i], f"DDTree differs from plain on prompt {i}"
        assert chain.tokens == plain[arch, i], f"chain DFlash differs from plain on prompt {i}"
        assert [int(t.accept.num_accepted[0]) + 1 for t in traces] == tree.accept_lengths
        deep += sum(int(t.accept.num_accepted[0]) >= 8 for t in traces)
        off_chain += sum(_off_chain(t) for t in traces)
        rounds += len(traces)
    # Measured on these seeds: 106 rounds for 768 tokens, 31 deep, 34-36 through a side branch
    # (same on both targets: with the oracle the tree shape depends only on the demotions).
    assert deep >= 15, f"only {deep} of {rounds} rounds accepted depth >= 8"
    assert off_chain >= 15, f"only {off_chain} of {rounds} rounds accepted a side branch"


def test_runner_and_naive_runner_agree_round_by_round(pairs, prompts):
    """The cached tree verify (HFTargetRunner) and the no-cache naive runner make the same
    trees, the same target tokens and the same accepted paths, round by round (hybrid model)."""
    target, _, _ = pairs["qwen35"]
    naive = NaiveTargetRunner(target.model, target.tap_layer_ids)
    runs = []
    for runner in (target, naive):
        traces: list[RoundTrace] = []
        oracle = OracleDrafter(target.model, 8, noise=0.3, seed=7)
        generate(
            runner, oracle, prompts["qwen35"][0], 40, budget=10, topk=3, on_round=traces.append
        )
        runs.append(traces)
    fast, slow = runs
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a.tree.tokens, b.tree.tokens)
        assert torch.equal(a.target_tokens, b.target_tokens)
        assert torch.equal(a.accept.path, b.accept.path)
    assert any(_off_chain(t) for t in fast), "the check never left the rank-0 chain"


def test_stops_at_max_new_tokens_and_eos(pairs, prompts, plain):
    target, drafter, _ = pairs["qwen3"]
    ids, truth = prompts["qwen3"][1], plain["qwen3", 1]
    oracle = OracleDrafter(target.model, BLOCK_SIZE, noise=0.0)
    short = generate(target, oracle, ids, 5, budget=16, topk=2)
    assert short.tokens == truth[:5]
    assert short.accept_lengths[0] == BLOCK_SIZE  # the round was truncated, not shortened
    # tokens per round as SGLang counts a request's accept length: what was emitted (the
    # prefill's token in, the cut tokens out) over the verify rounds
    assert short.rounds == 1 and short.tokens_per_round == 5.0
    assert short.mean_accept_length == BLOCK_SIZE
    assert generate_plain(target, ids, 3).tokens_per_round == 1.0
    eos = truth[20]
    stop = truth.index(eos) + 1
    for result in (
        generate(target, oracle, ids, NEW_TOKENS, budget=16, topk=2, eos_token_id=eos),
        generate(target, drafter, ids, NEW_TOKENS, budget=8, topk=2, eos_token_id=[eos]),
        generate_plain(target, ids, NEW_TOKENS, eos_token_id=eos),
    ):
        assert result.tokens == truth[:stop]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(budget=0, topk=4), "budget must be >= 1 draft nodes, got 0"),
        (dict(budget=4, topk=0), r"topk must be in \[1, vocab_size=\d+\], got 0"),
        (dict(budget=4, topk=10**6), r"topk must be in \[1, vocab_size=\d+\], got 1000000"),
        (dict(budget=8, topk=1), r"budget=8 exceeds .* topk=1 .* depth 7 .* at most 7 nodes"),
        (dict(budget=4, topk=2, prompt=[]), r"prompt is empty \(0 tokens\)"),
        (dict(budget=4, topk=2, max_new=4093), r"\(4 tokens\) \+ max_new_tokens \(4093\) = 4097 "),
        (dict(budget=4, topk=2, max_new=0), "max_new_tokens must be >= 1, got 0"),
        (dict(budget=4, topk=2, temperature=-1.0), r"temperature must be a finite number in "),
        (dict(budget=4, topk=2, temperature=float("nan")), r"in \[0, 100\] .*, got nan"),
        (dict(budget=4, topk=2, temperature=float("inf")), r"in \[0, 100\] .*, got inf"),
        # the DDTREE server's limit (front_door/request_limits.MAX_TEMPERATURE), not float32's
        (dict(budget=4, topk=2, temperature=1e300), r"in \[0, 100\] .*limit\), got 1e\+300$"),
        (dict(budget=4, topk=2, temperature=100.5), r"in \[0, 100\] .*, got 100.5"),
        (dict(budget=4, topk=2, top_k=2**31), r"top_k must be in \[0, 1073741824\]"),
    ],
)
def test_bad_settings_raise_before_generation(pairs, kwargs, match):
    target, drafter, _ = pairs["qwen3"]
    target.prefill(torch.tensor([1, 2, 3]))
    committed = target.committed_len
    prompt, max_new = kwargs.pop("prompt", [5, 6, 7, 8]), kwargs.pop("max_new", 8)
    with pytest.raises(ValueError, match=match):
        generate(target, drafter, prompt, max_new, **kwargs)
    assert target.committed_len == committed, "validation must happen before any prefill"


def test_load_pair_reads_taps_and_block_size(pairs, tmp_path):
    target, drafter, tokenizer = pairs["qwen35"]
    assert drafter.block_size == DFLASH_BLOCK_SIZE
    assert target.tap_layer_ids == list(drafter.target_layer_ids)
    assert target.vocab_size == drafter.vocab_size
    with pytest.raises(ValueError, match="has no config.json"):
        load_pair(tmp_path / "nowhere", tmp_path / "nowhere", "float32", "cpu")
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_pair(Path("."), Path("."), "float8", "cpu")


def test_draft_vocab_mismatch_is_refused(pairs, monkeypatch):
    target, drafter, _ = pairs["qwen3"]
    monkeypatch.setattr(drafter, "vocab_size", target.vocab_size + 1)
    match = f"draft vocab_size={target.vocab_size + 1} does not match .*={target.vocab_size}$"
    with pytest.raises(ValueError, match=match):
        generate(target, drafter, [1, 2, 3], 4, budget=4, topk=2)

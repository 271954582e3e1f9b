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


def test_the_dflash2_draft_keeps_the_binary_tree_deep_and_shapes_it_by_its_chain(tmp_path):
    """The binary pair's DFlash2 draft (write_binary_dflash2), through SGLang's CandidateSelector
    on the block the reference engine drafts: c0 and c1 are every slot's two best candidates,
    the selector's transitions tell the two predecessors apart, and the lattice tree the GPU
    suite's DDTREE server builds from it (budget 30, K = 4) holds every binary path 3 deep (the
    DFlash draft's tree holds them 4 deep), so rounds still accept deep paths."""
    import warnings

    from safetensors.torch import load_file

    from sglang_ddtree.checkpoints.binary_pair import BINARY_TOKENS, write_binary_dflash2
    from sglang_ddtree.tree.lattice import build_lattice_tree, lattice_chain_logprobs

    pytest.importorskip("sglang")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.models.dflash import CandidateSelector

    torch.set_num_threads(1)
    draft_dir = write_binary_dflash2(tmp_path, "qwen3")
    target, drafter, tok = load_pair(tmp_path / "qwen3-binary", draft_dir)
    weights = load_file(str(draft_dir / "model.safetensors"))
    prefix = "candidate_selector."
    selector_weights = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    V, rank = selector_weights["predecessor_codebook"].shape
    selector = CandidateSelector(
        hidden_size=drafter.config.hidden_size, vocab_size=V, state_rank=rank, top_k=4
    )
    selector.load_state_dict(selector_weights)
    ids = torch.tensor(tok(PROMPTS[0])["input_ids"])
    logits, taps = target.prefill(ids)
    root = int(logits[-1].argmax())
    drafter.append_context(taps)
    hidden = drafter.block_hidden(root, len(ids))[1:]  # [B - 1, H]
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        unary, cand = torch.topk(hidden @ drafter.target_lm_head.weight.T, 4)
        scores = selector.build_lattice(
            candidate_ids=cand[None],
            unary_logits=unary[None].float(),
            hidden_states=hidden[None],
            anchor_token_ids=torch.tensor([root]),
        )
    assert all(set(row[:2].tolist()) == set(BINARY_TOKENS) for row in cand)
    cond = lattice_chain_logprobs(scores)  # [1, B - 1, 4, 4]
    assert (cond[0, 1:, 0] - cond[0, 1:, 1]).abs().max() > 0.05  # the predecessor matters
    tree = build_lattice_tree(torch.tensor([root]), cand[None], cond, 30)
    assert set(tree.tokens[0, 1:].tolist()) == set(BINARY_TOKENS)
    assert int((tree.depth[0, 1:] <= 3).sum()) == 2 + 4 + 8  # every binary path, 3 deep

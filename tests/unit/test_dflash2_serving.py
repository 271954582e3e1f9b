"""DDTREE serving a DFlash2 drafter, on the CPU: the lattice draft head (round/draft_head.py's
LatticeTreeHead) on SGLang's own CandidateSelector (random weights, eager) and a stand-in draft
model exposing compute_candidates; the worker's DFlash2 wiring (round/worker.py). The start-up
checks are in test_plugin.py, the tiny DFlash2 checkpoint in test_tiny.py; the GPU suite serves
it (tests/gpu/test_dflash2.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("sglang")

from sglang_ddtree.adapter import compat  # noqa: E402
from sglang_ddtree.config import DDTreeConfig  # noqa: E402
from sglang_ddtree.round.draft_head import DraftTreeHead, LatticeTreeHead  # noqa: E402
from sglang_ddtree.tree.lattice import (  # noqa: E402
    build_lattice_tree_reference,
    lattice_chain_logprobs,
)

pytestmark = pytest.mark.usefixtures("one_thread")

B, H, R = 6, 16, 5  # block, hidden, selector rank


def _sglang_dflash():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.models import dflash
    return dflash


class StubDraft(torch.nn.Module):
    """What the lattice head reads of SGLang's DFlash2DraftModel: `candidate_selector` (SGLang's
    own) and `compute_candidates` (rows [n, H] -> the top-K ids and their logits over an LM head
    [V, H], sorted; DFlash2DraftModel's projects through the target's)."""

    def __init__(self, weight: torch.Tensor, top_k: int, generator: torch.Generator):
        super().__init__()
        V = weight.shape[0]
        self.weight = weight
        self.candidate_selector = _sglang_dflash().CandidateSelector(
            hidden_size=H, vocab_size=V, state_rank=R, top_k=top_k
        )
        with torch.no_grad():
            for p in self.candidate_selector.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))

    def compute_candidates(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert hidden.dim() == 2  # SGLang's top-k kernel is 2-D
        values, ids = torch.topk(hidden @ self.weight.T, self.candidate_selector.top_k, dim=-1)
        return ids, values


def _block(bs: int, V: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft block's outputs as the draft graph's tail gets them: hidden states [bs * B, H]
    and input ids [bs * B] (the root, then mask tokens)."""
    hidden = torch.randn(bs * B, H, generator=g)
    ids = torch.full((bs, B), V - 1, dtype=torch.int64)
    ids[:, 0] = torch.randint(V - 1, (bs,), generator=g)
    return hidden, ids.flatten()


def _fields_equal(a, b) -> None:
    for name in a._fields:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_the_dflash2_architectures_are_sglangs():
    """compat's list is every DFlash2 class the installed release registers."""
    dflash = _sglang_dflash()
    names = {c.__name__ for c in dflash.EntryClass if issubclass(c, dflash.DFlash2DraftModel)}
    assert set(compat.DFLASH2_ARCHITECTURES) == names


@pytest.mark.parametrize("budget", [7, 30])
def test_the_lattice_head_builds_the_reference_tree_of_the_drafters_lattice(budget):
    """Into its static buffers: the heap's tree (tree.lattice's specification) on the lattice
    SGLang's selector scores for the block's slots 1..B-1, anchored at the block's root, with
    the chain's log conditionals; bit for bit, every field. Rows past the batch stay as they
    were."""
    g = torch.Generator().manual_seed(3)
    V, K, bs = 40, 4, 3
    draft = StubDraft(torch.randn(V, H, generator=g), K, g)
    cfg = DDTreeConfig(block_size=B, num_nodes=budget + 1, topk=K)
    head = LatticeTreeHead(draft_model=draft, cfg=cfg, max_bs=5, device=torch.device("cpu"))
    hidden, input_ids = _block(bs, V, g)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        head(hidden, input_ids)
        slots = hidden.view(bs, B, H)[:, 1:]
        root = input_ids.view(bs, B)[:, 0]
        ids, unary = draft.compute_candidates(slots.reshape(-1, H))
        scores = draft.candidate_selector.build_lattice(
            candidate_ids=ids.view(bs, B - 1, K),
            unary_logits=unary.view(bs, B - 1, K),
            hidden_states=slots,
            anchor_token_ids=root,
        )
    expected = build_lattice_tree_reference(
        root, ids.view(bs, B - 1, K), lattice_chain_logprobs(scores), budget
    )
    _fields_equal(head.tree(bs), expected)
    assert not head.tokens[bs:].any() and not head.visibility[bs:].any()
    # the lattice is not the marginal one: some node's children follow its own row
    assert not torch.equal(scores[:, 1:, 0], scores[:, 1:, 1])


def test_a_selector_that_ignores_the_predecessor_gives_the_dflash_heads_tree():
    """With the selector's predecessor codebook zero, every row of a slot is its unary logits;
    with K the whole vocabulary, their softmax over K is the LM head's full softmax. The lattice
    head's tree is then the DFlash head's (DraftTreeHead, the torch builder) on the same LM
    head: the same nodes, links and mask, the scores within float32 rounding (the two
    log-softmaxes sum the same terms in different orders)."""
    g = torch.Generator().manual_seed(5)
    V = K = 6
    weight = torch.randn(V, H, generator=g)
    draft = StubDraft(weight, K, g)
    with torch.no_grad():
        draft.candidate_selector.predecessor_codebook.zero_()
    cfg = DDTreeConfig(block_size=B, num_nodes=32, topk=K)
    cpu = torch.device("cpu")
    lattice = LatticeTreeHead(draft_model=draft, cfg=cfg, max_bs=4, device=cpu)
    marginal = DraftTreeHead(lm_head_weight=weight, vocab_size=V, cfg=cfg, max_bs=4)
    hidden, input_ids = _block(4, V, g)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        lattice(hidden, input_ids)
        marginal(hidden, input_ids)
    ours, theirs = lattice.tree(4), marginal.tree(4)
    for name in ("tokens", "parents", "depth", "first_child", "next_sibling", "visibility"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    torch.testing.assert_close(ours.scores, theirs.scores, rtol=0, atol=1e-5)


def test_the_lattice_head_refuses_a_k_other_than_its_selectors():
    g = torch.Generator().manual_seed(0)
    draft = StubDraft(torch.randn(20, H, generator=g), 4, g)
    cfg = DDTreeConfig(block_size=B, num_nodes=8, topk=8)
    with pytest.raises(ValueError, match="scores 4 candidates per position.*K=8"):
        LatticeTreeHead(draft_model=draft, cfg=cfg, max_bs=2, device=torch.device("cpu"))
